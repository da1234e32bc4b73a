/* SPDX-License-Identifier: MIT */
/*
 * The fuzz targets' in-process daemon (tests/fuzz/, docs/RELIABILITY.md).
 *
 * One real shardd runs inside the fuzzer's process: shd_server_init()
 * with its socket in a private temporary directory, its io_uring event loop,
 * its engine (one worker) and the host backend. A fuzz input is a small
 * program of actions (fuzz_run): fake clients connect over that socket (each
 * connection is a SOCK_SEQPACKET socket pair), send datagrams with or
 * without fds, attach as ranks, register and open groups, push ring entries,
 * die, re-attach, send admin requests; the daemon runs its own loop for a
 * turn between actions (a stop eventfd ends each turn).
 *
 * After every input the harness ends every job and session the way shardd's
 * shutdown does, then checks, besides crashes and sanitizer reports:
 *   - every ring entry a live client submitted got exactly one completion,
 *     echoing its user_data, op, group and step;
 *   - every request a live client framed got exactly one reply with its seq
 *     (GOODBYE: none), and no reply came for a request never sent;
 *   - once its session is closed, every client still connected reaches EOF
 *     (nothing of the daemon holds its socket);
 *   - the process holds exactly the fds it held before the input;
 *   - no job, session or buffer remains, and while the input runs the heap
 *     the daemon holds stays under FUZZ_HEAP_CAP and its buffers under the
 *     small --max-memory it runs with (FUZZ_MAX_MEMORY).
 * A failed check prints what it saw and aborts, which libFuzzer reports as
 * a crash with the input saved.
 */
#ifndef SHARDD_FUZZ_DAEMON_H
#define SHARDD_FUZZ_DAEMON_H

#include <stddef.h>
#include <stdint.h>

/* The actions an input may use; each target enables its own set. */
enum fuzz_action {
	FZ_CONNECT,      /* a new client connects */
	FZ_HELLO,        /* a HELLO, valid or with one field mutated */
	FZ_MSG,          /* a framed message of any type with a fuzzed payload */
	FZ_RAW,          /* one raw datagram, with or without fds */
	FZ_SPLIT,        /* a message over several datagrams, maybe malformed */
	FZ_REGISTER,     /* REGISTER_GROUP with fuzzed specs */
	FZ_REGISTER_ALL, /* the same REGISTER_GROUP from every live rank of a job */
	FZ_OPEN,         /* OPEN_GROUP */
	FZ_ADMIN,        /* an admin request (templates or raw JSON) */
	FZ_GOODBYE,      /* GOODBYE */
	FZ_CLOSE,        /* the client dies (its socket closes) */
	FZ_SHUT_WR,      /* the client half-closes its socket */
	FZ_SQE,          /* one ring entry with fuzzed fields */
	FZ_SQE_BURST,    /* the same collective op from every live rank of a job */
	FZ_REATTACH,     /* a dead rank comes back: connect and HELLO as it */
	FZ_WRITE_BUF,    /* a client writes fuzzed bytes into a grad or shard buffer */
	FZ_EXEC_MAP, /* EXEC_MAP of a (rank-executed) group: its own rank's, a peer's, or junk */
	FZ_TURN,     /* the daemon's loop turns */
	FZ_CRON,     /* the daemon's cron runs as if some seconds had passed */
	FZ_ACTION_COUNT
};

struct fuzz_target {
	const char *name;
	/* Actions in the order an input's action byte picks them (byte % n). */
	const enum fuzz_action *actions;
	unsigned nactions;
	/* Jobs attached before the program runs, one client per rank (0: none). */
	int attach_jobs;
};

/*
 * The target a fuzz_*.c file defines; fuzz_daemon.c's libFuzzer hooks
 * (LLVMFuzzerInitialize, LLVMFuzzerTestOneInput) start the daemon and run
 * each input as its program.
 */
extern const struct fuzz_target fuzz_target;

#endif /* SHARDD_FUZZ_DAEMON_H */
