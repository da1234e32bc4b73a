/* SPDX-License-Identifier: MIT */
/*
 * Hostile clients against a real shardd, 2: broken control framing before
 * and after HELLO, bad requests, bad registrations and admin requests,
 * random datagrams, and a registration failing while its reply cannot be
 * sent. Each bad input must get an error naming the
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
/* 2. Control messages                                                 */
/* ------------------------------------------------------------------ */

Test(hostile, framing_errors_before_hello_are_named_and_close_only_that_connection)
{
	struct shardd_hello h = make_hello("pre", 0, 1, 1, 0);
	uint8_t big[70000] = { 0 };
	int pipefd[2], fd;

	cr_assert_eq(pipe(pipefd), 0);

	fd = raw_connect();
	send_hdr(fd, 0x12345678u, SHARDD_MSG_HELLO, 0, sizeof(h), 9, &h, sizeof(h), -1);
	expect_refused(fd, 9, -SHARDD_E_MAGIC, NEEDLES("0x12345678"), "wrong magic");

	fd = raw_connect();
	send_dgram(fd, "SHRD\1", 5, -1);
	expect_refused(fd, 0, -SHARDD_E_MALFORMED, NEEDLES("5 bytes"), "truncated header");

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_HELLO, 0, 2u << 20, 3, &h, sizeof(h), -1);
	expect_error(fd, 3, -SHARDD_E_MALFORMED, NEEDLES("hdr.length = 2097152"),
		     "over the handshake limit");
	expect_eof(fd, "over the handshake limit");
	close(fd);

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_ADMIN, 0, UINT32_MAX, 4, NULL, 0, -1);
	expect_refused(fd, 4, -SHARDD_E_MALFORMED, NEEDLES("4294967295"), "length 2^32-1");

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_HELLO, 0, sizeof(h), 5, &h, sizeof(h), pipefd[0]);
	expect_refused(fd, 5, -SHARDD_E_MALFORMED, NEEDLES("file descriptor"), "fd on a HELLO");

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_HELLO, 0x8, sizeof(h), 6, &h, sizeof(h), -1);
	expect_refused(fd, 6, -SHARDD_E_MALFORMED, NEEDLES("flags = 0x8"), "header flags");

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, 77, 0, 0, 7, NULL, 0, -1);
	expect_refused(fd, 7, -SHARDD_E_STATE, NEEDLES("type 77"), "unknown type before HELLO");

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_REGISTER_GROUP, 0, 0, 8, NULL, 0, -1);
	expect_refused(fd, 8, -SHARDD_E_STATE, NEEDLES("type 5"), "REGISTER_GROUP before HELLO");

	fd = raw_connect();
	send_dgram(fd, big, sizeof(big), -1);
	expect_refused(fd, 0, -SHARDD_E_MALFORMED, NEEDLES("larger than"), "oversized datagram");

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_ADMIN, 0, 4, 10, big, 10, -1);
	expect_refused(fd, 10, -SHARDD_E_MALFORMED, NEEDLES("more payload"), "overlong payload");

	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_ADMIN, 0, 100, 11, big, 10, -1);
	send_dgram(fd, big, 10, pipefd[1]);
	expect_refused(fd, 11, -SHARDD_E_MALFORMED, NEEDLES("continuation"),
		       "fd on a continuation");

	/* Half a message carrying the sender's own socket: refused at once, not kept. */
	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_ADMIN, 0, 100, 13, big, 10, fd);
	expect_error(fd, 13, -SHARDD_E_MALFORMED, NEEDLES("1 file descriptor"),
		     "fd on half a message");
	expect_eof(fd, "fd on half a message");
	close(fd);

	/* A message announcing more than ever comes, then the sender hangs up. */
	fd = raw_connect();
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_HELLO, 0, 1000, 12, &h, sizeof(h), -1);
	close(fd);

	close(pipefd[0]);
	close(pipefd[1]);
	assert_others_served();
}

Test(hostile, bad_requests_after_hello_get_errors_and_the_session_goes_on)
{
	struct shardd_hello h = make_hello("post", 0, 1, 1, 0);
	struct shardd_open_group og;
	struct raw r;

	raw_attach(&r, "post", 0, 1, 1, 0);
	raw_register_small(&r, "real");

	send_hdr(r.fd, SHARDD_MAGIC, 77, 0, 0, 20, NULL, 0, -1);
	expect_error(r.fd, 20, -SHARDD_E_INVALID, NEEDLES("type 77"), "unknown type");
	send_msg(r.fd, SHARDD_MSG_WELCOME, 21, &h, 64);
	expect_error(r.fd, 21, -SHARDD_E_INVALID, NEEDLES("type 2"), "WELCOME from a client");
	send_msg(r.fd, SHARDD_MSG_HELLO, 22, &h, sizeof(h));
	expect_error(r.fd, 22, -SHARDD_E_STATE, NEEDLES("already attached", "'post'"),
		     "second HELLO");

	memset(og.name, 'x', sizeof(og.name));
	send_msg(r.fd, SHARDD_MSG_OPEN_GROUP, 23, &og, sizeof(og));
	expect_error(r.fd, 23, -SHARDD_E_INVALID, NEEDLES("NUL-terminated"), "open: no NUL");
	send_msg(r.fd, SHARDD_MSG_OPEN_GROUP, 24, &og, 10);
	expect_error(r.fd, 24, -SHARDD_E_MALFORMED, NEEDLES("10 bytes", "64"), "open: short");
	memset(&og, 0, sizeof(og));
	memcpy(og.name, "no\x01such\xff", 9);
	send_msg(r.fd, SHARDD_MSG_OPEN_GROUP, 25, &og, sizeof(og));
	expect_error(r.fd, 25, -SHARDD_E_NOGROUP, NEEDLES("no group", "'real'"),
		     "open: unknown name lists the groups");
	send_msg(r.fd, SHARDD_MSG_OPEN_GROUP, 26, NULL, 0);
	expect_error(r.fd, 26, -SHARDD_E_MALFORMED, NEEDLES("0 bytes"), "open: empty");
	send_msg(r.fd, SHARDD_MSG_STREAM, 27, NULL, 0);
	expect_error(r.fd, 27, -ENOTSUP, NEEDLES("--backend cuda", "--backend host"),
		     "stream fences on the host backend");

	/* After all that the session still serves ring and control requests. */
	raw_nop_ok(&r, 1);
	snprintf(og.name, sizeof(og.name), "real");
	send_msg(r.fd, SHARDD_MSG_OPEN_GROUP, ++r.seq, &og, sizeof(og));
	raw_recv_group(&r);
	raw_close(&r);
	assert_others_served();
}

/* Attach, send something fatal, expect an ERROR and the close; the rank is free again. */
static void expect_fatal_after_hello(void (*send_bad)(int fd), uint32_t seq, int32_t code,
				     const char *const *needles, const char *what)
{
	struct raw r;

	raw_attach(&r, "fatal", 0, 1, 1, 0);
	send_bad(r.fd);
	if (needles)
		expect_error(r.fd, seq, code, needles, what);
	expect_eof(r.fd, what);
	raw_close(&r);
	raw_attach(&r, "fatal", 0, 1, 1, 0);
	raw_nop_ok(&r, 1);
	raw_close(&r);
}

static void bad_magic(int fd)
{
	send_hdr(fd, 0xdeadbeefu, SHARDD_MSG_ADMIN, 0, 0, 30, NULL, 0, -1);
}

static void over_ctrl_max(int fd)
{
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_REGISTER_GROUP, 0, SHARDD_CTRL_MAX + 1, 31, NULL, 0,
		 -1);
}

static void fd_on_register(int fd)
{
	struct shardd_register_group h = reg_hdr("g", 0);
	int null = open("/dev/null", O_RDONLY | O_CLOEXEC);

	cr_assert_geq(null, 0);
	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_REGISTER_GROUP, 0, sizeof(h), 32, &h, sizeof(h),
		 null);
	close(null);
}

static void half_then_eof(int fd)
{
	struct shardd_register_group h = reg_hdr("g", 1);

	send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_REGISTER_GROUP, 0, 5000, 33, &h, sizeof(h), -1);
	shutdown(fd, SHUT_WR);
}

Test(hostile, fatal_framing_errors_after_hello_close_that_client_only)
{
	expect_fatal_after_hello(bad_magic, 30, -SHARDD_E_MAGIC, NEEDLES("0xdeadbeef"),
				 "wrong magic after HELLO");
	expect_fatal_after_hello(over_ctrl_max, 31, -SHARDD_E_MALFORMED, NEEDLES("67108865"),
				 "length over SHARDD_CTRL_MAX");
	expect_fatal_after_hello(fd_on_register, 32, -SHARDD_E_MALFORMED,
				 NEEDLES("file descriptor"), "fd on REGISTER_GROUP");
	expect_fatal_after_hello(half_then_eof, 0, 0, NULL, "half a message, then EOF");
	assert_others_served();
}

/* One REGISTER_GROUP that must fail with code and needles; the session goes on. */
static void expect_register_error(struct raw *r, const void *payload, uint32_t len, int32_t code,
				  const char *const *needles, const char *what)
{
	send_msg(r->fd, SHARDD_MSG_REGISTER_GROUP, ++r->seq, payload, len);
	expect_error(r->fd, r->seq, code, needles, what);
}

static void expect_spec_error(struct raw *r, const struct shardd_register_group *h,
			      const struct shardd_param_spec *specs, uint32_t n, int32_t code,
			      const char *const *needles, const char *what)
{
	uint32_t len;
	uint8_t *p = reg_payload(h, specs, n, &len);

	expect_register_error(r, p, len, code, needles, what);
	free(p);
}

Test(hostile, bad_registrations_are_refused_naming_the_field_and_value)
{
	struct shardd_param_spec ok = pspec("w", SHARDD_DTYPE_FP32, 2, (uint64_t[]){ 4, 3 });
	struct shardd_param_spec two[2], s, *many;
	struct shardd_register_group h;
	struct raw r;
	uint32_t len;
	uint8_t *p;

	raw_attach(&r, "reg", 0, 1, 1, 0);

	h = reg_hdr("g", 0);
	expect_spec_error(&r, &h, NULL, 0, -SHARDD_E_INVALID, NEEDLES("nparams = 0"), "nparams 0");
	h = reg_hdr("g", UINT32_MAX);
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("nparams = 4294967295"),
			  "nparams huge");
	h = reg_hdr("g", SHARDD_MAX_PARAMS);
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_MALFORMED, NEEDLES("nparams = 65536"),
			  "nparams 65536 with one spec");
	h = reg_hdr("g", 2);
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_MALFORMED, NEEDLES("248 bytes", "408"),
			  "nparams 2 with one spec");
	expect_register_error(&r, "short", 5, -SHARDD_E_MALFORMED, NEEDLES("5 bytes"),
			      "payload shorter than the header");
	h = reg_hdr("g", 1);
	memset(h.name, 'G', sizeof(h.name));
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("name", "NUL"),
			  "group name without NUL");
	h = reg_hdr("", 1);
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("empty"), "empty group name");
	h = reg_hdr("g", 1);
	h.param_dtype = 9;
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("param_dtype = 9"),
			  "param_dtype 9");
	h = reg_hdr("g", 1);
	h.reduce_dtype = 77;
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("reduce_dtype = 77"),
			  "reduce_dtype 77");
	h = reg_hdr("g", 1);
	h.exec = 3;
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("exec = 3"), "exec");
	h = reg_hdr("g", 1);
	h.init = 5;
	expect_spec_error(&r, &h, &ok, 1, -SHARDD_E_INVALID, NEEDLES("init = 5"), "init");

	h = reg_hdr("g", 1);
	s = ok;
	memset(s.name, 'p', sizeof(s.name));
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("param #0", "NUL"),
			  "param name without NUL");
	s = ok;
	s.ndim = 9;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("ndim = 9"), "ndim 9");
	s = ok;
	s.shard_dim = 2;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("shard_dim = 2"),
			  "shard_dim == ndim");
	s = ok;
	s.shard_dim = UINT32_MAX;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("shard_dim = 4294967295"),
			  "shard_dim huge");
	s = ok;
	s.dtype = 77;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("dtype = 77"), "dtype 77");
	s = ok;
	s.dtype = SHARDD_DTYPE_NONE;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("dtype = 0"), "dtype none");
	s = ok;
	s.flags = 0x40;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("flags = 0x40"), "param flags");
	s = ok;
	s.shape[5] = 7;
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("shape[5] = 7"),
			  "shape past ndim");
	s = pspec("w", SHARDD_DTYPE_FP32, 3, (uint64_t[]){ 1ull << 32, 1ull << 32, 4 });
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("shape[1] = 0x100000000"),
			  "shape product over 2^64");
	s = pspec("w", SHARDD_DTYPE_FP16, 1, (uint64_t[]){ UINT64_MAX });
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("0xffffffffffffffff"),
			  "shape 2^64-1");
	s = pspec("w", SHARDD_DTYPE_BF16, 2, (uint64_t[]){ 1ull << 20, 1ull << 20 });
	expect_spec_error(&r, &h, &s, 1, -SHARDD_E_INVALID, NEEDLES("overflows"), "a 2 TiB param");
	h = reg_hdr("g", 2);
	two[0] = ok;
	two[1] = ok;
	expect_spec_error(&r, &h, two, 2, -SHARDD_E_INVALID, NEEDLES("'w'", "params #0 and #1"),
			  "duplicate param names");

	/* A large registration over many datagrams whose last param is bad. */
	many = calloc(2000, sizeof(*many));
	cr_assert_not_null(many);
	for (uint32_t i = 0; i < 2000; i++) {
		char name[32];

		snprintf(name, sizeof(name), "layer.%u.w", i);
		many[i] = pspec(name, SHARDD_DTYPE_BF16, 1, (uint64_t[]){ 3 + i % 5 });
	}
	many[1999].ndim = 12;
	h = reg_hdr("many", 2000);
	expect_spec_error(&r, &h, many, 2000, -SHARDD_E_INVALID,
			  NEEDLES("layer.1999.w", "ndim = 12"), "bad last param of 2000");
	many[1999].ndim = 1;
	p = reg_payload(&h, many, 2000, &len);
	send_msg(r.fd, SHARDD_MSG_REGISTER_GROUP, ++r.seq, p, len);
	raw_recv_group(&r);
	free(p);
	free(many);

	/* A good registration works after all the refusals; a second one is refused. */
	raw_register_small(&r, "g");
	h = reg_hdr("g", 1);
	expect_spec_error(&r, &h, &ok, 1, -EEXIST, NEEDLES("'g'", "already registered"),
			  "duplicate group");
	raw_nop_ok(&r, 1);
	raw_close(&r);
	assert_others_served();
}

Test(hostile, bad_admin_requests_get_ok_false_naming_the_field)
{
	struct raw r;
	char *huge;
	size_t n;
	int fd = raw_connect();
	struct shardd_register_group h;
	struct shardd_param_spec s = pspec("w\xc3", SHARDD_DTYPE_FP32, 1, (uint64_t[]){ 4 });
	json_t *reply;

	/* Before any HELLO, on a connection that stays open through every error. */
	expect_admin_error(fd, "not json{", -SHARDD_E_MALFORMED, "not JSON");
	expect_admin_error(fd, "", -SHARDD_E_MALFORMED, "not JSON");
	expect_admin_error(fd, "[1,2]", -SHARDD_E_MALFORMED, "object");
	expect_admin_error(fd, "\"status\"", -SHARDD_E_MALFORMED, "not JSON");
	expect_admin_error(fd, "42", -SHARDD_E_MALFORMED, "not JSON");
	expect_admin_error(fd, "{\"cmd\":5}", -SHARDD_E_MALFORMED, "\"cmd\"");
	expect_admin_error(fd, "{\"cmd\":\"status\",\"cmd\":\"jobs\"}", -SHARDD_E_MALFORMED,
			   "not JSON");
	expect_admin_error(fd, "{\"cmd\":\"frobnicate\"}", -SHARDD_E_INVALID, "'frobnicate'");
	expect_admin_error(fd, "{\"cmd\":\"ranks\",\"job\":5}", -SHARDD_E_INVALID, "\"job\"");
	expect_admin_error(fd, "{\"cmd\":\"ranks\",\"job\":\"nope\"}", -SHARDD_E_NOJOB,
			   "no job 'nope'");

	/* Deep nesting and a huge multi-byte command name (cut mid-character in the text). */
	n = 200000;
	huge = malloc(2 * n + 64);
	cr_assert_not_null(huge);
	memset(huge, '[', n);
	memset(huge + n, ']', n);
	huge[2 * n] = '\0';
	expect_admin_error(fd, huge, -SHARDD_E_MALFORMED, "not JSON");
	n = (size_t)sprintf(huge, "{\"cmd\":\"a");
	for (int i = 0; i < 150000; i++) {
		huge[n++] = (char)0xc3;
		huge[n++] = (char)0xa9;
	}
	n += (size_t)sprintf(huge + n, "\"}");
	expect_admin_error(fd, huge, -SHARDD_E_INVALID, "unknown admin command");
	n = (size_t)sprintf(huge, "{\"cmd\":\"ranks\",\"job\":\"");
	memset(huge + n, 'j', 300000);
	n += 300000;
	n += (size_t)sprintf(huge + n, "\"}");
	expect_admin_error(fd, huge, -SHARDD_E_NOJOB, "no job");
	free(huge);

	/* A group whose name and param name are not UTF-8, registered by a client. */
	raw_attach(&r, "adm", 0, 1, 2, 0);
	h = reg_hdr("g\xff\xfe", 1);
	raw_send_register(&r, &h, &s, 1); /* rank 1 never comes: it stays pending */
	/* Asked on the same socket, so the registration was taken first. */
	reply = admin_call(r.fd, 50, "{\"cmd\":\"groups\"}", 16);
	cr_assert(json_is_true(json_object_get(reply, "ok")), "groups with a non-UTF-8 name: %s",
		  json_string_value(json_object_get(reply, "error")));
	json_decref(reply);
	reply = admin_call(r.fd, 51, "{\"cmd\":\"ranks\"}", 15);
	cr_assert(json_is_true(json_object_get(reply, "ok")), "ranks with a non-UTF-8 name: %s",
		  json_string_value(json_object_get(reply, "error")));
	json_decref(reply);
	expect_admin_error(fd, "{\"cmd\":\"show\",\"group\":\"zz\"}", -SHARDD_E_NOGROUP,
			   "no group 'zz'");
	expect_admin_error(fd, "{\"cmd\":\"show\",\"group\":[]}", -SHARDD_E_INVALID, "\"group\"");

	/* Argument types of dump, on the attached connection. */
	expect_admin_error(r.fd, "{\"cmd\":\"dump\",\"group\":\"zz\",\"param\":\"w\"}",
			   -SHARDD_E_NOGROUP, "'zz'");
	raw_close(&r);
	raw_attach(&r, "adm1", 0, 1, 1, 0);
	raw_register_small(&r, "d");
#define DUMP(extra) "{\"cmd\":\"dump\",\"group\":\"d\",\"param\":\"w\"" extra "}"
	expect_admin_error(r.fd, DUMP(",\"rank\":\"x\""), -SHARDD_E_INVALID, "\"rank\"");
	expect_admin_error(r.fd, DUMP(",\"rank\":99"), -SHARDD_E_INVALID, "\"rank\" = 99");
	expect_admin_error(r.fd, DUMP(",\"limit\":-1"), -SHARDD_E_INVALID, "\"limit\"");
	expect_admin_error(r.fd, DUMP(",\"limit\":1e300"), -SHARDD_E_INVALID, "\"limit\"");
	expect_admin_error(r.fd, DUMP(",\"rows\":\"a\""), -SHARDD_E_INVALID, "\"rows\"");
	expect_admin_error(r.fd, DUMP(",\"rows\":[3,1]"), -SHARDD_E_INVALID, "\"rows\" = 3:1");
	expect_admin_error(r.fd, DUMP(",\"rows\":[0,9999999999]"), -SHARDD_E_INVALID, "\"rows\"");
	expect_admin_error(r.fd, DUMP(",\"what\":\"secrets\""), -SHARDD_E_INVALID, "'secrets'");
	expect_admin_error(r.fd, DUMP(",\"what\":7"), -SHARDD_E_INVALID, "\"what\"");
	expect_admin_error(r.fd, "{\"cmd\":\"dump\",\"group\":\"d\",\"param\":\"nope\"}",
			   -SHARDD_E_INVALID, "no param 'nope'");
#undef DUMP
	raw_nop_ok(&r, 1);
	raw_close(&r);
	close(fd);
	assert_others_served();
}

#define FUZZ_CONNECTIONS 300

/* One datagram of fuzz: noise, or a header with odd fields and some payload. */
static size_t fuzz_dgram(uint8_t *buf, size_t cap)
{
	size_t len;

	if (rnd() % 3 == 0) {
		len = rnd() % 120;
		rnd_bytes(buf, len);
		return len;
	}
	struct shardd_msg_hdr h = {
		.magic = rnd() % 8 ? SHARDD_MAGIC : (uint32_t)rnd(),
		.type = (uint16_t)(rnd() % 12),
		.flags = rnd() % 8 ? 0 : (uint16_t)rnd(),
		.length = rnd() % 4 ? (uint32_t)(rnd() % 300) : (uint32_t)rnd(),
		.seq = (uint32_t)rnd(),
	};
	len = sizeof(h) + rnd() % 300;
	if (len > cap)
		len = cap;
	memcpy(buf, &h, sizeof(h));
	rnd_bytes(buf + sizeof(h), len - sizeof(h));
	return len;
}

Test(hostile, random_datagrams_before_and_after_hello_never_hurt_the_daemon)
{
	uint8_t buf[512];
	int admin = raw_connect();
	int64_t base = admin_connections(admin);

	rnd_seed(0xf0220f0220f02201ull);
	for (int i = 0; i < FUZZ_CONNECTIONS; i++) {
		struct raw r = { .fd = -1, .doorbell = -1 };
		int ndgrams = 1 + (int)(rnd() % 3);

		if (i % 2)
			raw_attach(&r, "fuzz", 0, 1, 1, 0);
		else
			r.fd = raw_connect();
		for (int k = 0; k < ndgrams; k++) {
			size_t len = fuzz_dgram(buf, sizeof(buf));

			/* The daemon may have closed us already: a failed send is fine. */
			if (send(r.fd, buf, len, MSG_NOSIGNAL) < 0)
				break;
		}
		raw_close(&r);
	}
	/* Every connection was processed to its EOF; none is left behind. */
	wait_connections(admin, base);
	close(admin);
	assert_others_served();
}

/* ------------------------------------------------------------------ */
/* A reply that cannot be sent in the middle of a failing registration */
/* ------------------------------------------------------------------ */

/* Send REGISTER_GROUP, then prove with an admin round trip that the daemon took it. */
static void raw_register_arrived(struct raw *r, const char *name, uint64_t d0)
{
	struct shardd_register_group h = reg_hdr(name, 1);
	struct shardd_param_spec s = pspec("w", SHARDD_DTYPE_FP32, 1, (uint64_t[]){ d0 });

	raw_send_register(r, &h, &s, 1);
	/* Control messages of one socket are served in order: the reply means it arrived. */
	json_decref(admin_call(r->fd, 900, "{\"cmd\":\"jobs\"}", 14));
}

/* Rank `r` registers group "g" of one fp32 param "w" of `rows` elements. */
static void send_register_w(struct raw *r, uint64_t rows)
{
	raw_send_register(r, (struct shardd_register_group[]){ reg_hdr("g", 1) },
			  (struct shardd_param_spec[]){
				  pspec("w", SHARDD_DTYPE_FP32, 1, (uint64_t[]){ rows }) },
			  1);
}

/* Ranks a and b register the same "g" ([6]), get the same group id, and close. */
static void register_pair_and_close(struct raw *a, struct raw *b)
{
	raw_register_arrived(a, "g", 6);
	send_register_w(b, 6);
	cr_assert_eq(raw_recv_group(a), raw_recv_group(b));
	raw_close(a);
	raw_close(b);
}

/*
 * A client that shut down its reading side: the daemon's next send to it
 * fails at once (EPIPE) and drops it, here while a registration fails.
 */
Test(hostile, registration_failing_while_a_reply_cannot_be_sent_keeps_the_daemon_sound)
{
	struct raw a, b;

	/* The mismatching rank cannot be answered. */
	raw_attach(&a, "reg-epipe", 0, 1, 2, 0);
	raw_attach(&b, "reg-epipe", 1, 1, 2, 0);
	raw_register_arrived(&a, "g", 6);
	cr_assert_eq(shutdown(b.fd, SHUT_RD), 0);
	send_register_w(&b, 7);
	expect_error(a.fd, a.seq, -SHARDD_E_MISMATCH, NEEDLES("shape", "[6]", "[7]"),
		     "rank 0 of a failed registration");
	/* Exactly one reply: the next message on rank 0's socket answers the next request. */
	json_decref(admin_call(a.fd, 901, "{\"cmd\":\"status\"}", 16));
	assert_daemon_alive();
	raw_close(&b);
	raw_attach(&b, "reg-epipe", 1, 1, 2, 0);
	register_pair_and_close(&a, &b);

	/* The rank that arrived first cannot be answered. */
	raw_attach(&a, "reg-epipe2", 0, 1, 2, 0);
	raw_attach(&b, "reg-epipe2", 1, 1, 2, 0);
	raw_register_arrived(&a, "g", 6);
	cr_assert_eq(shutdown(a.fd, SHUT_RD), 0);
	send_register_w(&b, 7);
	expect_error(b.fd, b.seq, -SHARDD_E_MISMATCH, NEEDLES("shape"),
		     "rank 1 of a failed registration");
	json_decref(admin_call(b.fd, 902, "{\"cmd\":\"status\"}", 16));
	assert_daemon_alive();
	raw_close(&a);
	raw_attach(&a, "reg-epipe2", 0, 1, 2, 0);
	register_pair_and_close(&a, &b);
	assert_others_served();
}
