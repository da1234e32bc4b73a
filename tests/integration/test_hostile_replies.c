/* SPDX-License-Identifier: MIT */
/*
 * Hostile clients against a real shardd, 4: clients that never read their
 * replies, announce messages they never send, or never say anything. Each bad input must get an error naming the
 * field and the value (or an admin {"ok": false}), exactly one completion
 * per ring entry, and afterwards a well-behaved client on the same daemon
 * must still get a barrier, a nop and a correct unshard; the daemon's log
 * must stay free of sanitizer reports (the SANITIZE=1 build). The raw
 * clients are tests/lib/rawproto.h: proto/ only, nothing in libshardd
 * filters what reaches the daemon. The hostile suites:
 * test_hostile_{ring,control,death,replies}.c.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "hostile.h"

TestSuite(hostile, .init = start_daemon, .fini = stop_daemon, .timeout = 30);

/* ------------------------------------------------------------------ */
/* 4. Replies nobody reads, memory never sent, connections that are silent */
/* ------------------------------------------------------------------ */

#define BIG_PARAMS 10000u /* a GROUP reply of this many params is about 2.2 MB */

/* Register a BIG_PARAMS-param group on a 1x1 raw client and read its reply. */
static void raw_register_big(struct raw *r, const char *name)
{
	struct shardd_register_group h = reg_hdr(name, BIG_PARAMS);
	struct shardd_param_spec *specs = calloc(BIG_PARAMS, sizeof(*specs));

	cr_assert_not_null(specs);
	for (uint32_t i = 0; i < BIG_PARAMS; i++) {
		char pname[32];

		snprintf(pname, sizeof(pname), "p%u", i);
		specs[i] = pspec(pname, SHARDD_DTYPE_FP32, 1, (uint64_t[]){ 3 });
	}
	raw_send_register(r, &h, specs, BIG_PARAMS);
	free(specs);
	raw_recv_group(r);
}

/* Send OPEN_GROUP `name` `n` times without reading a reply. */
static void raw_open_unread(struct raw *r, const char *name, int n)
{
	struct shardd_open_group o = { .name = { 0 } };

	snprintf(o.name, sizeof(o.name), "%s", name);
	for (int i = 0; i < n; i++)
		send_msg(r->fd, SHARDD_MSG_OPEN_GROUP, ++r->seq, &o, sizeof(o));
}

#define UNREAD_OPENS 12 /* about 27 MB of GROUP replies: far past any socket buffer */

/*
 * The daemon never waits for a client to read: replies that do not fit in
 * its socket are queued while everyone else is served, and the client,
 * once it reads, gets every one of them, whole and in order.
 */
Test(hostile, replies_a_client_does_not_read_are_queued_while_others_are_served)
{
	uint32_t first_seq, gid = 0;
	struct raw a;

	raw_attach(&a, "unread", 0, 1, 1, 0);
	raw_register_big(&a, "big");
	first_seq = a.seq + 1;
	raw_open_unread(&a, "big", UNREAD_OPENS);
	assert_others_served();
	for (int i = 0; i < UNREAD_OPENS; i++) {
		struct shardd_group_reply g;
		struct shardd_ctrl_rx rx;

		recv_msg(a.fd, &rx);
		cr_assert_eq(rx.hdr.type, SHARDD_MSG_GROUP, "reply %d: type %u, want GROUP", i,
			     rx.hdr.type);
		cr_assert_eq(rx.hdr.seq, first_seq + (uint32_t)i, "reply %d: seq %u, want %u", i,
			     rx.hdr.seq, first_seq + (uint32_t)i);
		cr_assert_eq(rx.nfds, 4, "reply %d carries %d fds", i, rx.nfds);
		cr_assert_eq(rx.hdr.length,
			     sizeof(g) + (size_t)BIG_PARAMS * (sizeof(struct shardd_param_layout) +
							       sizeof(struct shardd_param_spec)));
		memcpy(&g, rx.payload, sizeof(g));
		cr_assert_eq(g.nparams, BIG_PARAMS);
		if (i)
			cr_assert_eq(g.group_id, gid, "reply %d names group %u, not %u", i,
				     g.group_id, gid);
		gid = g.group_id;
		shardd_ctrl_rx_reset(&rx);
	}
	raw_nop_ok(&a, 1);
	raw_close(&a);
	assert_others_served();
}

#define BURST 1000 /* requests sent at once: many loop turns' read budget */

/*
 * A burst of requests larger than one loop turn's read budget is read on
 * over the next turns: every request gets its reply, in order.
 */
Test(hostile, a_burst_of_requests_past_one_turns_read_budget_is_served_whole_and_in_order)
{
	struct raw a;

	raw_attach(&a, "burst", 0, 1, 1, 0);
	for (uint32_t i = 0; i < BURST; i++)
		send_msg(a.fd, 200, 100 + i, NULL, 0);
	for (uint32_t i = 0; i < BURST; i++)
		expect_error(a.fd, 100 + i, -SHARDD_E_INVALID, NEEDLES("message type 200"),
			     "a request of the burst");
	raw_nop_ok(&a, 1);
	raw_close(&a);
	assert_others_served();
}

#define OVERFLOW_OPENS 40 /* about 90 MB of GROUP replies: past SHD_SESSION_OUT_MAX */

/* A client that lets more than the queue's bound of replies pile up is dropped, named. */
Test(hostile, client_letting_replies_pile_past_the_bound_is_dropped_and_named)
{
	struct pollfd p;
	char needle[64];
	struct raw a;

	raw_attach(&a, "pileup", 0, 1, 1, 0);
	raw_register_big(&a, "big");
	raw_open_unread(&a, "big", OVERFLOW_OPENS);
	p = (struct pollfd){ .fd = a.fd, .events = POLLRDHUP };
	cr_assert_eq(poll(&p, 1, REPLY_MS), 1,
		     "the daemon kept a client with %d unread 2 MB "
		     "replies",
		     OVERFLOW_OPENS);
	cr_assert(p.revents & (POLLHUP | POLLRDHUP), "revents 0x%x", p.revents);
	snprintf(needle, sizeof(needle), "pid %d) does not read its replies", (int)getpid());
	wait_log(&hostile_daemon, needle);
	raw_close(&a);
	assert_others_served();
}

/* The daemon's VmSize or VmRSS, in bytes. */
static uint64_t daemon_vm(const char *field)
{
	char path[64], line[128];
	unsigned long long kb = 0;
	size_t n = strlen(field);
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)hostile_daemon.pid);
	f = fopen(path, "r");
	cr_assert_not_null(f, "%s: %s", path, strerror(errno));
	while (fgets(line, sizeof(line), f))
		if (strncmp(line, field, n) == 0 && line[n] == ':')
			cr_assert_eq(sscanf(line + n + 1, "%llu", &kb), 1, "%s", line);
	fclose(f);
	cr_assert_gt(kb, 0, "%s has no %s", path, field);
	return kb * 1024;
}

#define ANNOUNCED_BYTES (60u << 20)
#define VM_SLACK        (16u << 20) /* well under the announced 60 MiB */

/*
 * A message's buffer grows with what arrives: announcing 60 MiB and
 * sending one datagram makes the daemon map (VmSize) and touch (VmRSS)
 * about that datagram, not the announced length.
 */
Test(hostile, announced_length_is_not_allocated_before_the_bytes_arrive)
{
	uint8_t *chunk = calloc(1, SHARDD_CTRL_CHUNK - sizeof(struct shardd_msg_hdr));
	uint64_t size0, rss0, size1, rss1;
	int admin = raw_connect();
	struct raw a;

	cr_assert_not_null(chunk);
	raw_attach(&a, "announce", 0, 1, 1, 0);
	json_decref(admin_call(admin, 1, "{\"cmd\":\"status\"}", 16));
	size0 = daemon_vm("VmSize");
	rss0 = daemon_vm("VmRSS");
	send_hdr(a.fd, SHARDD_MAGIC, SHARDD_MSG_REGISTER_GROUP, 0, ANNOUNCED_BYTES, ++a.seq, chunk,
		 SHARDD_CTRL_CHUNK - sizeof(struct shardd_msg_hdr), -1);
	/* The loop takes events in arrival order: this reply comes after the datagram was read. */
	json_decref(admin_call(admin, 2, "{\"cmd\":\"status\"}", 16));
	size1 = daemon_vm("VmSize");
	rss1 = daemon_vm("VmRSS");
	cr_assert_lt(size1, size0 + VM_SLACK,
		     "VmSize grew by %llu bytes for one %u-byte datagram "
		     "of a message announcing %u",
		     (unsigned long long)(size1 - size0), SHARDD_CTRL_CHUNK, ANNOUNCED_BYTES);
	cr_assert_lt(rss1, rss0 + VM_SLACK, "VmRSS grew by %llu bytes for one %u-byte datagram",
		     (unsigned long long)(rss1 - rss0), SHARDD_CTRL_CHUNK);
	assert_daemon_alive();
	free(chunk);
	raw_close(&a);
	close(admin);
	assert_others_served();
}

#define HANDSHAKE_S "0.5" /* --handshake-timeout of the daemon below */
#define STATUS_REQ  "{\"cmd\":\"status\"}"

/* The next message on `fd` is an {"ok": true} ADMIN_REPLY numbered `seq`. */
static void recv_admin_ok(int fd, uint32_t seq)
{
	struct shardd_ctrl_rx rx = { 0 };
	json_t *r;

	cr_assert_eq(shardd_ctrl_recv(fd, &rx, REPLY_MS), 0, "no admin reply %u", seq);
	cr_assert_eq(rx.hdr.type, SHARDD_MSG_ADMIN_REPLY, "reply type %u", rx.hdr.type);
	cr_assert_eq(rx.hdr.seq, seq, "admin reply seq %u, want %u", rx.hdr.seq, seq);
	r = json_loadb((const char *)rx.payload, rx.hdr.length, 0, NULL);
	cr_assert(json_is_true(json_object_get(r, "ok")), "admin reply %u: %.*s", seq,
		  (int)rx.hdr.length, (const char *)rx.payload);
	json_decref(r);
	shardd_ctrl_rx_reset(&rx);
}

/*
 * Connections that never complete a message (silent, or half a HELLO) are
 * closed after the handshake timeout, naming their pid; an admin connection
 * that spoke and an attached rank stay.
 */
Test(hostile, connections_that_never_complete_a_message_are_closed_after_the_timeout)
{
	const char *extra[] = { "--handshake-timeout", HANDSHAKE_S, NULL };
	struct harness_daemon d = { 0 };
	struct shardd_client *c = NULL;
	struct shardd_hello h = make_hello("silent", 0, 1, 1, 0);
	int admin, silent, half;
	char needle[96];

	cr_assert_eq(harness_daemon_start(&d, extra), 0, "shardd did not start");
	admin = harness_raw_connect(d.socket);
	cr_assert_geq(admin, 0);
	cr_assert_eq(shardd_ctrl_send(admin, SHARDD_MSG_ADMIN, 1, STATUS_REQ, 16, NULL, 0), 0);
	cr_assert_eq(harness_attach(&d, "silent", 0, 1, 1, &c), 0, "attach: %s",
		     shardd_last_error());
	silent = harness_raw_connect(d.socket);
	half = harness_raw_connect(d.socket);
	cr_assert(silent >= 0 && half >= 0);
	send_hdr(half, SHARDD_MAGIC, SHARDD_MSG_HELLO, 0, sizeof(h), 1, &h, sizeof(h) / 2, -1);

	cr_assert_eq(harness_expect_eof(silent, REPLY_MS), 0,
		     "a silent connection stayed open past --handshake-timeout " HANDSHAKE_S);
	cr_assert_eq(
		harness_expect_eof(half, REPLY_MS), 0,
		"a connection with half a HELLO stayed open past --handshake-timeout " HANDSHAKE_S);
	snprintf(needle, sizeof(needle), "pid %d) sent no complete message", (int)getpid());
	wait_log(&d, needle);

	/* Past the timeout, the admin connection that spoke and the attached rank are served. */
	recv_admin_ok(admin, 1);
	cr_assert_eq(shardd_ctrl_send(admin, SHARDD_MSG_ADMIN, 2, STATUS_REQ, 16, NULL, 0), 0,
		     "the admin connection was closed");
	recv_admin_ok(admin, 2);
	cr_assert_eq(shardd_nop(c), 0, "the attached rank was dropped: %s", shardd_last_error());
	shardd_close(c);
	close(silent);
	close(half);
	close(admin);
	harness_daemon_stop_expect_clean(&d);
}
