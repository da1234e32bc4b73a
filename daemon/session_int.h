/* SPDX-License-Identifier: MIT */
/*
 * Private to the four files of a session: session.c (lifetime, reading,
 * dispatch), session_out.c (output queue, reply framing), hello.c (the
 * handshake, ring creation, stream fences) and ring.c (the ring service).
 */
#ifndef SHARDD_SESSION_INT_H
#define SHARDD_SESSION_INT_H

#include <stddef.h>
#include <stdint.h>

#include "job.h"
#include "session.h"

/* ---- session.c ---- */

/* What shardd_sessions_init was given. */
extern struct shardd_sessions_env shardd_session_env;

/* "client 3 (pid 1234)" or "client 3 (job 'j' rank 1, pid 1234)". */
const char *shardd_session_name(const struct shardd_session *s, char *buf, size_t len);
/*
 * "RLIMIT_NOFILE=1024, open fds=1024": what a shortage of descriptors is
 * measured against.
 */
const char *shardd_fd_limit_describe(char *buf, size_t len);
/*
 * Reply an error, then end the session (credentials, handshake and framing
 * errors): it lingers until the client has read the error.
 */
void __attribute__((format(printf, 4, 5)))
shardd_session_reject(struct shardd_session *s, uint32_t seq, int code, const char *fmt, ...);
/*
 * Is the client behind this session gone (socket hung up, process exited)?
 * Checked without waiting.
 */
int shardd_session_peer_gone(struct shardd_session *s);
/* How the job reaches a session attached to one of its ranks (shardd_job_attach). */
extern const struct shardd_rank_sink_ops shardd_session_sink_ops;

/* ---- session_out.c ---- */

/* Send SHARDD_MSG_ERROR (code, text) through the output queue. */
void shardd_session_send_error(struct shardd_session *s, uint32_t seq, int code, const char *text);
/* Reply an error to a request and keep serving the session. */
void __attribute__((format(printf, 4, 5)))
shardd_session_reply_error(struct shardd_session *s, uint32_t seq, int code, const char *fmt, ...);
/* Drop every queued reply and stop watching for POLLOUT (the session is ending). */
void shardd_session_out_clear(struct shardd_session *s);

/* ---- hello.c ---- */

/* SHARDD_MSG_HELLO from a session in the handshake: attach it or refuse it. */
void shardd_session_hello(struct shardd_session *s, const struct shardd_msg_hdr *hdr,
			  const uint8_t *payload, uint32_t len);
/*
 * SHARDD_MSG_STREAM: import the client's per-SQ-slot events and answer
 * with ours, one per CQ slot (shardd_proto.h). Once per connection.
 */
void shardd_session_stream(struct shardd_session *s, uint32_t seq, const uint8_t *payload,
			   uint32_t len);

#endif /* SHARDD_SESSION_INT_H */
