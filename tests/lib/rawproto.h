/* SPDX-License-Identifier: MIT */
/*
 * The protocol spoken by hand, for tests that must reach the daemon past
 * libshardd's checks: raw control connections (datagrams with any header,
 * fds by SCM_RIGHTS, replies checked field by field), raw attached clients
 * (HELLO by hand, the ring mapped with shardd_ring_attach, entries pushed
 * with shardd_sq_push), registration payloads and a deterministic random
 * stream. Everything goes through proto/ only, so nothing in libshardd
 * filters what reaches the daemon. Failures are Criterion assertions.
 */
#ifndef SHARDD_TEST_RAWPROTO_H
#define SHARDD_TEST_RAWPROTO_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "harness.h"
#include "shardd_ctrl.h"
#include "shardd_ring.h"

#define REPLY_MS     5000
#define NEEDLES(...) ((const char *const[]){ __VA_ARGS__, NULL })

/* The daemon that raw_connect dials and whose log a failed wait dumps. */
void rawproto_use(struct harness_daemon *d);

/* -- raw control connections -------------------------------------- */

int raw_connect(void);
/* One datagram of raw bytes, with `passfd` (>= 0) attached by SCM_RIGHTS. */
void send_dgram(int sock, const void *buf, size_t len, int passfd);
/* A header (and `len` payload bytes of `payload`) as one datagram. */
void send_hdr(int sock, uint32_t magic, uint16_t type, uint16_t flags, uint32_t length,
	      uint32_t seq, const void *payload, size_t len, int passfd);
void send_msg(int sock, uint16_t type, uint32_t seq, const void *payload, uint32_t len);
void recv_msg(int sock, struct shardd_ctrl_rx *rx);
/* rx is an ERROR with `code` whose text holds every needle; rx is reset. */
void check_error(struct shardd_ctrl_rx *rx, uint32_t seq, int32_t code, const char *const *needles,
		 const char *what);
void expect_error(int sock, uint32_t seq, int32_t code, const char *const *needles,
		  const char *what);
void expect_eof(int sock, const char *what);
/* The daemon answers `sock` with the ERROR (expect_error), then closes it; sock is closed. */
void expect_refused(int sock, uint32_t seq, int32_t code, const char *const *needles,
		    const char *what);
/* One admin request on `sock`: the parsed reply (an object), checked for seq. */
json_t *admin_call(int sock, uint32_t seq, const char *req, size_t len);
/* An admin reply {"ok": false, "code": code, "error": "...needle..."}. */
void expect_admin_error(int sock, const char *req, int32_t code, const char *needle);
/* The daemon's count of open connections, through `status`. */
int64_t admin_connections(int sock);
/*
 * Wait (request after request, no sleeping) until the daemon counts `want`
 * connections: it has processed every EOF of the connections we closed.
 */
void wait_connections(int sock, int64_t want);

/* -- raw attached clients: HELLO by hand, the ring mapped directly --- */

struct raw {
	int fd;       /* control socket */
	int doorbell; /* eventfd */
	void *mem;    /* ring mapping */
	size_t size;
	struct shardd_ring ring;
	uint32_t seq;
};

struct shardd_hello make_hello(const char *job, uint32_t rank, uint32_t replicate, uint32_t shard,
			       uint32_t sq_entries);
void raw_attach(struct raw *r, const char *job, uint32_t rank, uint32_t replicate, uint32_t shard,
		uint32_t sq_entries);
void raw_close(struct raw *r);
/* Ring the doorbell when the daemon sleeps (the protocol's rule). */
void raw_kick(struct raw *r);
void raw_push(struct raw *r, const struct shardd_sqe *sqe);
uint32_t ring_load(const uint32_t *p);
/* The daemon closed this client: socket hung up or ring marked dead. */
int raw_gone(struct raw *r);
/*
 * Reap one completion within timeout_ms: 0, -ETIMEDOUT, -ECONNRESET (the
 * daemon dropped us) or -EBADMSG. Spins, then futex-waits in short slices.
 */
int raw_reap(struct raw *r, struct shardd_cqe *cqe, char *msg, int timeout_ms);
void raw_reap_ok(struct raw *r, struct shardd_cqe *cqe, char *msg, const char *what);
struct shardd_sqe sqe_of(uint8_t op, uint32_t group, uint64_t step, uint32_t flags,
			 uint64_t user_data);
/* Push one entry, reap its completion (the only one in flight). */
struct shardd_cqe raw_op(struct raw *r, struct shardd_sqe sqe, char *msg);
/* A nop round trip: the daemon is still serving this ring. */
void raw_nop_ok(struct raw *r, uint64_t user_data);

/* -- registration payloads ----------------------------------------- */

struct shardd_param_spec pspec(const char *name, uint32_t dtype, uint32_t ndim,
			       const uint64_t *shape);
struct shardd_register_group reg_hdr(const char *name, uint32_t nparams);
/* hdr then nspecs specs (malloc'ed); *len its size. */
uint8_t *reg_payload(const struct shardd_register_group *hdr, const struct shardd_param_spec *specs,
		     uint32_t nspecs, uint32_t *len);
void raw_send_register(struct raw *r, const struct shardd_register_group *hdr,
		       const struct shardd_param_spec *specs, uint32_t nspecs);
/* The GROUP reply to our last request: its group id (the 4 fds are closed). */
uint32_t raw_recv_group(struct raw *r);
/* A one-param fp32 [4, 2] group: its id. */
uint32_t raw_register_small(struct raw *r, const char *name);

/* -- deterministic randomness (xorshift64*: a fixed seed, the same stream every run) -- */

void rnd_seed(uint64_t seed);
uint64_t rnd(void);
void rnd_bytes(void *buf, size_t len);

#endif /* SHARDD_TEST_RAWPROTO_H */
