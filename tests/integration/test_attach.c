/* SPDX-License-Identifier: MIT */
/*
 * Attaching to a real shardd: the handshake's answers to every kind of bad
 * HELLO (each an ERROR naming the field and value, then a close), the
 * daemon still serving a good client after each, rank and mesh conflicts
 * through libshardd, the uid check, and the command line's --help and
 * --version.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <grp.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "shardd_ctrl.h"

#define REPLY_TIMEOUT_MS 5000

static struct harness_daemon daemon_;

static void start_daemon(void)
{
	harness_daemon_start_or_fail(&daemon_, NULL);
}

static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(attach, .init = start_daemon, .fini = stop_daemon, .timeout = 30);

static struct shardd_hello good_hello(const char *job, uint32_t rank, uint32_t replicate,
				      uint32_t shard)
{
	struct shardd_hello h = {
		.major = SHARDD_PROTO_MAJOR,
		.minor = SHARDD_PROTO_MINOR,
		.pid = (uint32_t)getpid(),
		.rank = rank,
		.replicate = replicate,
		.shard = shard,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};

	snprintf(h.job, sizeof(h.job), "%s", job);
	return h;
}

/* The daemon's own words in a libshardd error chain: what follows "daemon: ". */
static const char *daemon_text(void)
{
	const char *d = strstr(shardd_last_error(), "daemon: ");

	cr_assert_not_null(d, "no daemon text in '%s'", shardd_last_error());
	return d + strlen("daemon: ");
}

/* A good client of a fresh job attaches and gets a nop answered. */
static void assert_daemon_still_serves(const char *job)
{
	struct shardd_client *c = NULL;

	cr_assert_eq(harness_attach(&daemon_, job, 0, 1, 1, &c), 0,
		     "daemon stopped serving good clients: %s", shardd_last_error());
	cr_assert_eq(shardd_nop(c), 0, "%s", shardd_last_error());
	shardd_close(c);
}

/*
 * Send `len` raw bytes as the first datagram of a connection, then expect
 * an ERROR with `code` whose text holds every needle, then a close.
 */
static void expect_rejection(const void *dgram, size_t len, int32_t code,
			     const char *const *needles)
{
	int fd = harness_raw_connect(daemon_.socket);
	char text[512];
	uint16_t type = 0;
	int32_t got = 0;
	int ret;

	cr_assert_geq(fd, 0, "connect: %s", strerror(-fd));
	cr_assert_eq(send(fd, dgram, len, MSG_NOSIGNAL), (ssize_t)len);
	ret = harness_recv_error(fd, REPLY_TIMEOUT_MS, &type, &got, text, sizeof(text));
	cr_assert_eq(ret, 0, "no ERROR reply: %s (message type %u)", strerror(-ret), type);
	cr_assert_eq(got, code, "ERROR code %d (%s), want %d (%s); text: %s", got,
		     shardd_strerror(got), code, shardd_strerror(code), text);
	for (int i = 0; needles && needles[i]; i++)
		cr_assert_not_null(strstr(text, needles[i]), "ERROR text '%s' lacks '%s'", text,
				   needles[i]);
	cr_assert_eq(harness_expect_eof(fd, REPLY_TIMEOUT_MS), 0,
		     "the daemon must close a rejected connection");
	close(fd);
}

/* A HELLO message (header + payload of `len` bytes of h) as one datagram. */
static size_t hello_dgram(void *buf, uint32_t magic, const struct shardd_hello *h, uint32_t len)
{
	struct shardd_msg_hdr hdr = {
		.magic = magic,
		.type = SHARDD_MSG_HELLO,
		.length = len,
		.seq = 1,
	};

	memcpy(buf, &hdr, sizeof(hdr));
	memcpy((char *)buf + sizeof(hdr), h, len);
	return sizeof(hdr) + len;
}

/* ------------------------------------------------------------------ */
/* Handshake rejections                                                */
/* ------------------------------------------------------------------ */

Test(attach, wrong_magic_is_rejected_and_the_daemon_goes_on, .timeout = 30)
{
	struct shardd_hello h = good_hello("j", 0, 1, 1);
	const char *needles[] = { "magic", NULL };
	char buf[256];

	expect_rejection(buf, hello_dgram(buf, 0xdeadbeefu, &h, sizeof(h)), -SHARDD_E_MAGIC,
			 needles);
	assert_daemon_still_serves("after-magic");
}

Test(attach, other_major_version_is_rejected_naming_both_versions, .timeout = 30)
{
	struct shardd_hello h = good_hello("j", 0, 1, 1);
	const char *needles[] = { "42.", "1.", NULL };
	char buf[256];

	h.major = 42;
	expect_rejection(buf, hello_dgram(buf, SHARDD_MAGIC, &h, sizeof(h)), -SHARDD_E_VERSION,
			 needles);
	assert_daemon_still_serves("after-version");
}

Test(attach, truncated_hello_is_rejected_naming_its_size, .timeout = 30)
{
	struct shardd_hello h = good_hello("j", 0, 1, 1);
	const char *needles[] = { "50", "112", NULL };
	char buf[256];

	expect_rejection(buf, hello_dgram(buf, SHARDD_MAGIC, &h, 50), -SHARDD_E_MALFORMED, needles);
	assert_daemon_still_serves("after-truncated");
}

Test(attach, header_announcing_more_than_arrives_is_not_a_hello, .timeout = 30)
{
	struct shardd_hello h = good_hello("j", 0, 1, 1);
	struct shardd_msg_hdr hdr;
	char buf[256];
	size_t n = hello_dgram(buf, SHARDD_MAGIC, &h, sizeof(h));
	int fd = harness_raw_connect(daemon_.socket);

	/* Announce a longer payload, send the hello's bytes, then hang up mid-message. */
	memcpy(&hdr, buf, sizeof(hdr));
	hdr.length = sizeof(h) + 100;
	memcpy(buf, &hdr, sizeof(hdr));
	cr_assert_geq(fd, 0);
	cr_assert_eq(send(fd, buf, n, MSG_NOSIGNAL), (ssize_t)n);
	close(fd);
	assert_daemon_still_serves("after-half-message");
}

Test(attach, job_name_without_nul_is_rejected, .timeout = 30)
{
	struct shardd_hello h = good_hello("j", 0, 1, 1);
	const char *needles[] = { "job", NULL };
	char buf[256];

	memset(h.job, 'A', sizeof(h.job));
	expect_rejection(buf, hello_dgram(buf, SHARDD_MAGIC, &h, sizeof(h)), -SHARDD_E_INVALID,
			 needles);
	assert_daemon_still_serves("after-job-name");
}

Test(attach, rank_outside_the_mesh_is_rejected_naming_rank_and_mesh, .timeout = 30)
{
	struct shardd_hello h = good_hello("j", 6, 2, 3);
	const char *needles[] = { "rank", "6", "2x3", NULL };
	char buf[256];

	expect_rejection(buf, hello_dgram(buf, SHARDD_MAGIC, &h, sizeof(h)), -SHARDD_E_INVALID,
			 needles);
	assert_daemon_still_serves("after-rank");
}

Test(attach, empty_mesh_dimensions_are_rejected, .timeout = 30)
{
	struct shardd_hello h = good_hello("j", 0, 0, 4);
	const char *rep[] = { "replicate", NULL };
	const char *shard[] = { "shard", NULL };
	char buf[256];

	expect_rejection(buf, hello_dgram(buf, SHARDD_MAGIC, &h, sizeof(h)), -SHARDD_E_INVALID,
			 rep);
	h = good_hello("j", 0, 4, 0);
	expect_rejection(buf, hello_dgram(buf, SHARDD_MAGIC, &h, sizeof(h)), -SHARDD_E_INVALID,
			 shard);
	assert_daemon_still_serves("after-mesh-zero");
}

Test(attach, second_client_for_an_attached_rank_is_refused_naming_job_and_rank, .timeout = 30)
{
	struct shardd_client *first = NULL, *second = NULL;
	const char *text;

	cr_assert_eq(harness_attach(&daemon_, "train", 1, 1, 2, &first), 0);
	cr_assert_eq(harness_attach(&daemon_, "train", 1, 1, 2, &second), -SHARDD_E_RANK_TAKEN,
		     "%s", shardd_last_error());
	cr_assert_null(second);
	text = daemon_text();
	cr_assert_not_null(strstr(text, "'train'"), "%s", text);
	cr_assert_not_null(strstr(text, "rank 1"), "%s", text);
	/* The holder is unaffected; the other rank is still free. */
	cr_assert_eq(shardd_nop(first), 0, "%s", shardd_last_error());
	cr_assert_eq(harness_attach(&daemon_, "train", 0, 1, 2, &second), 0);
	shardd_close(second);
	shardd_close(first);
	assert_daemon_still_serves("after-rank-taken");
}

Test(attach, rank_is_free_again_after_its_client_says_goodbye, .timeout = 30)
{
	struct shardd_client *c = NULL;

	cr_assert_eq(harness_attach(&daemon_, "again", 0, 1, 2, &c), 0);
	shardd_close(c);
	c = NULL;
	cr_assert_eq(harness_attach(&daemon_, "again", 0, 1, 2, &c), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_nop(c), 0);
	shardd_close(c);
}

Test(attach, mesh_mismatch_is_refused_naming_both_shapes, .timeout = 30)
{
	struct shardd_client *a = NULL, *b = NULL;
	const char *text;

	cr_assert_eq(harness_attach(&daemon_, "meshy", 0, 1, 4, &a), 0);
	cr_assert_eq(harness_attach(&daemon_, "meshy", 1, 2, 2, &b), -SHARDD_E_MESH, "%s",
		     shardd_last_error());
	text = daemon_text();
	cr_assert_not_null(strstr(text, "1x4"), "%s", text);
	cr_assert_not_null(strstr(text, "2x2"), "%s", text);
	cr_assert_not_null(strstr(text, "'meshy'"), "%s", text);
	shardd_close(a);
	assert_daemon_still_serves("after-mesh");
}

/* Run as another uid: the daemon (root here) must refuse before the handshake. */
static int attach_as_nobody(void *arg)
{
	struct harness_daemon *d = arg;
	struct shardd_client *c = NULL;
	int ret;

	CHILD_CHECK(setgroups(0, NULL) == 0 && setgid(65534) == 0 && setuid(65534) == 0,
		    "drop to uid 65534: %s", strerror(errno));
	ret = harness_attach(d, "uidjob", 0, 1, 1, &c);
	CHILD_CHECK(ret == -SHARDD_E_PERM, "attach as uid 65534 gave %d (%s): %s", ret,
		    shardd_strerror(ret), shardd_last_error());
	CHILD_CHECK(strstr(shardd_last_error(), "uid 65534"), "%s", shardd_last_error());
	return 0;
}

Test(attach, client_of_another_uid_is_refused, .timeout = 30)
{
	int status = 0;
	pid_t pid;

	if (geteuid() != 0)
		cr_skip_test("needs root to run a client as another uid");
	/* Let uid 65534 reach the socket, so the daemon's check is what refuses it. */
	cr_assert_eq(chmod(daemon_.dir, 0755), 0);
	cr_assert_eq(chmod(daemon_.socket, 0777), 0);
	pid = harness_fork(attach_as_nobody, &daemon_);
	cr_assert_gt(pid, 0);
	cr_assert_eq(harness_wait_or_kill(pid, 10000, &status), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child %s",
		  harness_status_str(status));
	assert_daemon_still_serves("after-uid");
}

/* ------------------------------------------------------------------ */
/* A good attach                                                       */
/* ------------------------------------------------------------------ */

Test(attach, good_client_gets_a_ring_and_its_nops_answered, .timeout = 30)
{
	struct shardd_attach_opts o = {
		.socket_path = daemon_.socket,
		.job = "ok",
		.rank = 2,
		.replicate = 2,
		.shard = 2,
		.device = SHARDD_HELLO_DEVICE_HOST,
		.ring_entries = 64,
	};
	struct shardd_client *c = NULL, *d = NULL;
	struct shardd_ring_status st;

	cr_assert_eq(shardd_connect(&o, &c), 0, "%s", shardd_last_error());
	cr_assert_gt(shardd_client_id(c), 0);
	cr_assert_eq(shardd_client_ring_entries(c), 64);
	cr_assert_gt(shardd_client_collective_timeout_ms(c), 0);
	for (int i = 0; i < 1000; i++)
		cr_assert_eq(shardd_nop(c), 0, "nop %d: %s", i, shardd_last_error());
	cr_assert_eq(shardd_client_ring_status(c, &st), 0);
	cr_assert_eq(st.sq_pending, 0);
	cr_assert_eq(st.cq_ready, 0);
	cr_assert_eq(st.client_last_op, SHARDD_OP_NOP);
	cr_assert_eq(st.daemon_last_op, SHARDD_OP_NOP);
	/* A second rank of the job gets its own id. */
	o.rank = 3;
	o.ring_entries = 0;
	cr_assert_eq(shardd_connect(&o, &d), 0, "%s", shardd_last_error());
	cr_assert_neq(shardd_client_id(d), shardd_client_id(c));
	cr_assert_eq(shardd_client_ring_entries(d), SHARDD_RING_ENTRIES_DEFAULT);
	shardd_close(d);
	shardd_close(c);
}

/* The accessors' old names, kept one release, answer as the shardd_client_* ones. */
Test(attach, deprecated_accessors_answer_as_the_client_ones, .timeout = 30)
{
	struct shardd_attach_opts o = {
		.socket_path = daemon_.socket,
		.job = "oldnames",
		.rank = 0,
		.replicate = 1,
		.shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
		.ring_entries = 32,
	};
	struct shardd_ring_status st, old;
	struct shardd_client *c = NULL;

	cr_assert_eq(shardd_connect(&o, &c), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_nop(c), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_client_ring_status(c, &st), 0);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
	cr_assert_eq(shardd_ring_entries(c), shardd_client_ring_entries(c));
	cr_assert_eq(shardd_collective_timeout_ms(c), shardd_client_collective_timeout_ms(c));
	cr_assert_eq(shardd_backend(c), shardd_client_backend(c));
	cr_assert_eq(shardd_ring_status(c, &old), 0);
#pragma GCC diagnostic pop
	cr_assert_eq(old.sq_entries, 32);
	cr_assert_eq(old.client_last_op, st.client_last_op);
	cr_assert_eq(old.daemon_last_op, st.daemon_last_op);
	shardd_close(c);
}

Test(attach, stream_ordering_is_refused_on_the_host_backend_and_ops_go_on, .timeout = 30)
{
	struct shardd_attach_opts o = {
		.socket_path = daemon_.socket,
		.job = "nostream",
		.rank = 0,
		.replicate = 1,
		.shard = 1,
		.device = 0,
	};
	struct shardd_client *c = NULL;

	cr_assert_eq(shardd_connect(&o, &c), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_client_backend(c), SHARDD_BACKEND_HOST);
	cr_assert_eq(shardd_stream_set(c, NULL), -ENOTSUP);
	cr_assert_not_null(strstr(shardd_last_error(), "host backend"), "%s", shardd_last_error());
	/* Nothing was set: ops go out unfenced, which the daemon would refuse otherwise. */
	for (int i = 0; i < 10; i++)
		cr_assert_eq(shardd_nop(c), 0, "nop %d: %s", i, shardd_last_error());
	shardd_stream_clear(c);
	cr_assert_eq(shardd_barrier(c, 1), 0, "%s", shardd_last_error());
	shardd_close(c);
}

Test(attach, socket_from_the_environment_is_used_when_no_path_is_given, .timeout = 30)
{
	struct shardd_attach_opts o = {
		.job = "env",
		.rank = 0,
		.replicate = 1,
		.shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_client *c = NULL;

	cr_assert_eq(setenv("SHARDD_SOCKET", daemon_.socket, 1), 0);
	cr_assert_eq(shardd_connect(&o, &c), 0, "%s", shardd_last_error());
	cr_assert_eq(shardd_nop(c), 0);
	shardd_close(c);
}

/* ------------------------------------------------------------------ */
/* Command line                                                        */
/* ------------------------------------------------------------------ */

Test(cli, help_and_version_exit_zero, .timeout = 20)
{
	const char *bin = getenv("SHARDD_BIN");
	const char *help[] = { bin, "--help", NULL };
	const char *version[] = { bin, "--version", NULL };
	const char *bogus[] = { bin, "--no-such-flag", NULL };
	char out[4096], want[32];
	int status = 0;

	cr_assert_not_null(bin, "SHARDD_BIN is not set");
	cr_assert_eq(harness_run(help, 5000, &status, out, sizeof(out)), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "--help %s",
		  harness_status_str(status));
	cr_assert_not_null(strstr(out, "--socket"), "--help does not list --socket: %s", out);
	cr_assert_not_null(strstr(out, "--collective-timeout"), "%s", out);

	cr_assert_eq(harness_run(version, 5000, &status, out, sizeof(out)), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "--version %s",
		  harness_status_str(status));
	snprintf(want, sizeof(want), "protocol %d.%d", SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR);
	cr_assert_eq(strncmp(out, "shardd ", 7), 0, "%s", out);
	cr_assert_not_null(strstr(out, want), "--version does not name %s: %s", want, out);

	cr_assert_eq(harness_run(bogus, 5000, &status, out, sizeof(out)), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0, "unknown flag %s",
		  harness_status_str(status));
	cr_assert_not_null(strstr(out, "--no-such-flag"), "%s", out);
}
