/* SPDX-License-Identifier: MIT */
/*
 * Private to the five files of a session, from the bottom up: session.c
 * (the object, its list, its end), session_out.c (output queue, reply
 * framing, refusals), ring.c (the ring service, the job's sink), hello.c
 * (the handshake, ring creation, stream fences) and control.c (accept,
 * reading, dispatch). Each calls only the files below it.
 */
#ifndef SHD_SESSION_INT_H
#define SHD_SESSION_INT_H

#include <stddef.h>
#include <stdint.h>

#include "job.h"
#include "session.h"

/*
 * One message not yet sent: header and payload framed in one buffer, so
 * that its datagrams are its SHARDD_CTRL_CHUNK-sized slices in order.
 */
struct shd_session_out {
	struct shd_session_out *next;
	uint32_t len;                 /* framed bytes: header + payload */
	uint32_t off;                 /* bytes sent so far, at a datagram boundary */
	int fds[SHARDD_CTRL_MAX_FDS]; /* ours (duplicated); ride on the first datagram */
	int nfds;                     /* 0 once the first datagram is sent */
	uint8_t buf[];
};

/* ---- session.c ---- */

/* What shd_sessions_init was given. */
extern struct shd_sessions_env shd_session_env;
/* Bytes of the ring regions of all sessions (hello.c counts, shd_session_reap gives back). */
extern uint64_t shd_session_rings_bytes;

/* "client 3 (pid 1234)" or "client 3 (job 'j' rank 1, pid 1234)". */
const char *shd_session_name(const struct shd_session *s, char *buf, size_t len);
/*
 * "RLIMIT_NOFILE=1024, open fds=1024": what a shortage of descriptors is
 * measured against.
 */
const char *shd_fd_limit_describe(char *buf, size_t len);
/*
 * Is the client behind this session gone (socket hung up, process exited)?
 * Checked without waiting.
 */
int shd_session_peer_gone(struct shd_session *s);
/*
 * A new session on accepted socket `fd`, in the handshake, with the next
 * client id, at the head of the list; NULL (fd closed, logged) when out of
 * memory.
 */
struct shd_session *shd_session_new(int fd);
/*
 * Everything of a session but its socket: detach it from its job
 * (`goodbye`: the client said so), mark its ring dead, close its pidfd and
 * doorbell, drop the message being read.
 */
void shd_session_release(struct shd_session *s, int goodbye, const char *why);
/* End the session now (shd_session_close; `goodbye`: the client said so). */
void shd_session_end(struct shd_session *s, int goodbye, const char *why);
/* Free one queued reply and its fds. */
void shd_session_out_free(struct shd_session_out *m);
/* Drop every queued reply and stop watching for POLLOUT (the session is ending). */
void shd_session_out_clear(struct shd_session *s);

/* ---- session_out.c ---- */

/* Send SHARDD_MSG_ERROR (code, text) through the output queue. */
void shd_session_send_error(struct shd_session *s, uint32_t seq, int code, const char *text);
/* Reply an error to a request and keep serving the session. */
void __attribute__((format(printf, 4, 5)))
shd_session_reply_error(struct shd_session *s, uint32_t seq, int code, const char *fmt, ...);
/*
 * Reply an error, then end the session (credentials, handshake and framing
 * errors): it lingers until the client has read the error.
 */
void __attribute__((format(printf, 4, 5)))
shd_session_reject(struct shd_session *s, uint32_t seq, int code, const char *fmt, ...);
/*
 * Read and drop what a refused client still sends; its EOF closes the
 * session.
 */
void shd_session_linger_drain(struct shd_session *s);

/* ---- ring.c ---- */

/* How the job reaches a session attached to one of its ranks (shd_job_attach). */
extern const struct shd_rank_sink_ops shd_session_sink_ops;

/* ---- hello.c ---- */

/* SHARDD_MSG_HELLO from a session in the handshake: attach it or refuse it. */
void shd_session_hello(struct shd_session *s, const struct shardd_msg_hdr *hdr,
		       const uint8_t *payload, uint32_t len);
/*
 * SHARDD_MSG_STREAM: import the client's per-SQ-slot events and answer
 * with ours, one per CQ slot (shardd_proto.h). Once per connection.
 */
void shd_session_stream(struct shd_session *s, uint32_t seq, const uint8_t *payload, uint32_t len);

#endif /* SHD_SESSION_INT_H */
