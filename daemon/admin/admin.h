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
#ifndef SHD_ADMIN_H
#define SHD_ADMIN_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define SHD_ADMIN_DUMP_LIMIT_DEFAULT 64    /* values a dump returns unless asked */
#define SHD_ADMIN_DUMP_LIMIT_MAX     65536 /* most values one dump returns */

/* One reply, ready to send as SHARDD_MSG_ADMIN_REPLY: `len` bytes of JSON at `text`. */
struct shd_admin_reply {
	const char *text; /* owned, or fallback */
	size_t len;
	char *owned;        /* the JSON jansson wrote; NULL when the fallback is sent */
	char fallback[160]; /* the reply built without jansson: out of memory, too big */
};

/*
 * Execute one SHARDD_MSG_ADMIN request, the JSON text of `payload` (`len`
 * bytes, untrusted), from a client running as `peer_uid` (`peer_pid`: 0
 * when unknown), into *out: always a reply to send, an error reply when
 * the request fails or its reply cannot be built. The caller sends it and
 * frees it with shd_admin_reply_free.
 */
void shd_admin_handle(const void *payload, size_t len, uid_t peer_uid, pid_t peer_pid,
		      struct shd_admin_reply *out);
void shd_admin_reply_free(struct shd_admin_reply *r);

/*
 * The Prometheus text exposition of everything shardd knows (ops, memory
 * by kind, jobs, ranks attached), NUL-terminated and malloc'd (the caller
 * frees), or NULL when out of memory (admin_views.c).
 */
char *shd_admin_metrics_render(void);

#endif /* SHD_ADMIN_H */
