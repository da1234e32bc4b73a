/* SPDX-License-Identifier: MIT */
/*
 * Admin requests (shardctl, PROTOCOL.md "Admin requests"): a connection
 * sends SHARDD_MSG_ADMIN with a JSON object {"cmd": "...", args...}, with or
 * without a HELLO first, and gets SHARDD_MSG_ADMIN_REPLY with a JSON object:
 * {"ok": true, ...} or {"ok": false, "error": "...", "code": N}. Every
 * command is read-only but `end`, which ends a job. Only clients running
 * as shardd's own uid may send them (a gid let in by --allow-gid may attach
 * ranks, not inspect or end).
 *
 * Loop thread only: the replies read the loop's state (sessions, jobs, the
 * engine's groups) without locks. Buffer contents are read while pool
 * threads may be writing them: a racy snapshot, documented as such.
 */
#ifndef SHARDD_ADMIN_H
#define SHARDD_ADMIN_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <jansson.h>

struct shardd_session;

#define SHARDD_ADMIN_DUMP_LIMIT_DEFAULT 64     /* values a dump returns unless asked */
#define SHARDD_ADMIN_DUMP_LIMIT_MAX     65536  /* most values one dump returns */

/* Bytes of buffers held, by kind, summed over jobs and groups. */
struct shardd_memory_use {
	uint64_t shards;         /* flat shards (the master params) */
	uint64_t sharded_grads;  /* reduce outputs */
	uint64_t unsharded;      /* one unsharded copy per replica */
	uint64_t grads;          /* ranks' unsharded grad buffers (reduce inputs) */
	uint64_t partials;       /* HSDP reduce-scatter outputs kept for the all-reduce */
};

/* Over every job of the daemon. */
void shardd_memory_use_all(struct shardd_memory_use *out);

struct shardd_job;
/* Bytes of every buffer job `j` holds (the `total` of its memory). */
uint64_t shardd_memory_job_bytes(const struct shardd_job *j);

/*
 * Execute one request from a peer running as `peer_uid`: the JSON text of
 * `payload` (`len` bytes, untrusted). Returns the reply object (the caller
 * decrefs), or NULL when out of memory.
 */
json_t *shardd_admin_exec(const void *payload, size_t len, uid_t peer_uid);

/*
 * Serve SHARDD_MSG_ADMIN number `seq` from session `s`: reply with
 * SHARDD_MSG_ADMIN_REPLY; a client that cannot be sent its reply is dropped.
 */
void shardd_admin_handle(struct shardd_session *s, uint32_t seq, const void *payload,
			 uint32_t len);

#endif /* SHARDD_ADMIN_H */
