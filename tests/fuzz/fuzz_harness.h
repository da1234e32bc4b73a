/* SPDX-License-Identifier: MIT */
/*
 * What the files of the fuzz harness share (tests/fuzz/harness_*.c and
 * fuzz_daemon.c, described in fuzz_daemon.h): the limits, the state of one
 * input, and the functions one file calls in another. Loop thread = the
 * fuzzer's thread: every daemon call runs on it, as the daemon's own loop
 * would.
 */
#ifndef SHARDD_FUZZ_HARNESS_H
#define SHARDD_FUZZ_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#include "shardd_ctrl.h"
#include "shardd_proto.h"
#include "shardd_ring.h"

/*
 * The daemon runs with small memory limits, so that the fuzzer reaches its
 * own refusal (registry.c group_commit_memory) rather than a harness filter,
 * and an input never makes it commit more than FUZZ_MAX_MEMORY of buffers.
 */
#define FUZZ_MAX_MEMORY     ((uint64_t)32 << 20) /* --max-memory */
#define FUZZ_MAX_JOB_MEMORY ((uint64_t)16 << 20) /* --max-job-memory */
/* Heap the process may hold above its level at the start of an input. */
#define FUZZ_HEAP_CAP ((size_t)256 << 20)

#define FZ_CLIENTS 32   /* connections per input: 3 jobs of 6 ranks and re-attaches */
#define FZ_PENDING 256  /* requests awaiting a reply, per client */
#define FZ_OPS     4096 /* ring entries per input */
#define FZ_GROUPS  16   /* group ids a client remembers */
#define FZ_JOBS    3    /* job names "fz0".."fz2" */
#define FZ_SETTLE  64   /* loop turns to let the daemon take everything sent */

struct fz_in {
	const uint8_t *p;
	size_t n;
};

struct fz_request {
	uint32_t seq;
	uint16_t type;
};

struct fz_client {
	int fd;       /* our end of the connection; -1 once we closed it */
	int eof;      /* the daemon closed the connection */
	int loose;    /* sent unframed or malformed bytes: replies are not matched */
	int attached; /* welcomed */
	int job;      /* index of the job named in its HELLO, -1 before */
	uint32_t rank;
	struct shardd_ctrl_rx rx;
	void *ring_mem;
	uint64_t ring_size;
	struct shardd_ring ring;
	int doorbell;
	struct fz_request pending[FZ_PENDING];
	unsigned npending;
	uint32_t groups[FZ_GROUPS];
	unsigned ngroups;
	int buf_fd[2]; /* grad and flat shard of its last GROUP reply, or -1 */
	uint64_t buf_size[2];
};

struct fz_op {
	int client;
	int done;
	int res; /* the completion's */
	struct shardd_sqe sqe;
};

struct fz_job {
	uint32_t replicate, shard; /* the mesh the setup attached, 0 when none */
};

struct fz_state {
	struct fz_client c[FZ_CLIENTS];
	unsigned nclients;
	struct fz_op ops[FZ_OPS];
	unsigned nops;
	struct fz_job jobs[FZ_JOBS];
	uint32_t seq;
	size_t heap0;
};

extern struct fz_state st;
extern int trace;   /* SHARDD_FUZZ_TRACE: print replies and completions */
extern int stop_fd; /* written before each loop turn: ends it */
extern char sock_dir[64];
extern uint8_t dgram[SHARDD_CTRL_CHUNK];
extern const char *target_name;
extern const char *const job_names[FZ_JOBS];

/* Print what a check saw and abort: libFuzzer reports a crash with the input saved. */
void __attribute__((noreturn, format(printf, 1, 2))) fail(const char *fmt, ...);

/* harness_daemon.c: the daemon, its loop, the process-wide checks */
int fd_count(void);
void fd_list(void);
uint64_t buf_bytes(void);
void check_memory(void);
void daemon_turn(void);
int fuzz_init(void);

/* harness_clients.c: the fake clients */
void turn(void);
void settle(void);
struct fz_client *client_pick(struct fz_in *in);
struct fz_client *client_connect(void);
void client_close(struct fz_client *c);
void expect_reply(struct fz_client *c, uint32_t seq, uint16_t type);
void client_send(struct fz_client *c, uint16_t type, uint16_t flags, const void *payload,
		 uint32_t len);
int some_fd(struct fz_client *c, uint8_t kind);

/* harness_actions.c: reading the input and the actions */
uint8_t in_u8(struct fz_in *in);
void act_hello(struct fz_in *in);
void act_msg(struct fz_in *in);
void act_raw(struct fz_in *in);
void act_split(struct fz_in *in);
void act_register(struct fz_in *in);
void act_register_all(struct fz_in *in);
void act_open(struct fz_in *in);
void act_admin(struct fz_in *in);
void act_goodbye(struct fz_in *in);
void act_close(struct fz_in *in);
void act_shut_wr(struct fz_in *in);
void act_sqe(struct fz_in *in);
void act_sqe_burst(struct fz_in *in);
struct fz_client *attach_rank(int job, uint32_t rank);
void act_reattach(struct fz_in *in);
void act_write_buf(struct fz_in *in);
void act_exec_map(struct fz_in *in);
void act_turn(struct fz_in *in);
void act_cron(struct fz_in *in);

#endif /* SHARDD_FUZZ_HARNESS_H */
