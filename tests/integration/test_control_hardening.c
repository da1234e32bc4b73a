/* SPDX-License-Identifier: MIT */
/*
 * The control socket against descriptor floods and refusals, on a real
 * shardd. Raw clients (socket + sendmsg, no libshardd) send what a hostile
 * process could: zero-length datagrams carrying fds, more fds than the
 * protocol allows, fds the daemon cannot take because it is at its fd
 * limit (set on the running daemon with prlimit), connections it must
 * accept at that limit. Every fd the daemon receives must be closed (its
 * /proc/PID/fd count returns to the baseline), each cause must be named in
 * the reply and the log, and a well-behaved client must still attach.
 *
 * Refusals: the daemon's ERROR must reach the client every time, also when
 * the client's request is still unread at the refusal (a refused HELLO
 * followed by another request, the uid refusal at accept): the first read
 * of a plain recv(), with no retry, must be that ERROR. The uid refusal and
 * the EACCES message run in a child as uid 65534 (the tests run as root in
 * CI; elsewhere those tests are skipped).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <jansson.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "shardd_ctrl.h"

#define REPLY_MS  5000
#define FLOOD     200   /* connections each sending a zero-length datagram with 8 fds */
#define REFUSALS  200   /* refused connections that must each get their ERROR */
#define NOBODY    65534 /* the uid and gid of the refused children */
#define LINGER_MS 2000  /* shardd's SHD_SESSION_LINGER_MS: a refused socket's last wait */

static struct harness_daemon daemon_;

static void start_daemon(void)
{
	harness_daemon_start_or_fail(&daemon_, NULL);
}

/* The harness fails the suite on a sanitizer report in the daemon's log. */
static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(control_hardening, .init = start_daemon, .fini = stop_daemon, .timeout = 60);

/* ------------------------------------------------------------------ */
/* The daemon: its log, its descriptors, its limit                     */
/* ------------------------------------------------------------------ */

/* Wait up to REPLY_MS for the daemon to have logged `needle`. */
static void wait_log(const char *needle)
{
	harness_wait_log(&daemon_, needle, REPLY_MS);
}

static int log_contains(const char *needle)
{
	return harness_log_contains(&daemon_, needle);
}

/* The daemon's open descriptors: how many, and the `nth` (0-based) free number. */
static int daemon_fds(int nth_free, int *free_no)
{
	return harness_daemon_fds(&daemon_, nth_free, free_no);
}

static int daemon_fd_count(void)
{
	return daemon_fds(0, NULL);
}

/* Set the daemon's RLIMIT_NOFILE soft limit; returns the old limits. */
static struct rlimit daemon_set_nofile(rlim_t soft)
{
	struct rlimit old, now;

	cr_assert_eq(prlimit(daemon_.pid, RLIMIT_NOFILE, NULL, &old), 0, "prlimit: %s",
		     strerror(errno));
	now = old;
	now.rlim_cur = soft;
	cr_assert_eq(prlimit(daemon_.pid, RLIMIT_NOFILE, &now, NULL), 0, "prlimit %llu: %s",
		     (unsigned long long)soft, strerror(errno));
	return old;
}

/* ------------------------------------------------------------------ */
/* Raw control connections                                             */
/* ------------------------------------------------------------------ */

static int raw_connect(void)
{
	int fd = harness_raw_connect(daemon_.socket);

	cr_assert_geq(fd, 0, "connect %s: %s", daemon_.socket, strerror(-fd));
	return fd;
}

static struct shardd_hello make_hello(const char *job, uint16_t major)
{
	struct shardd_hello h = { .major = major, .minor = SHARDD_PROTO_MINOR };

	h.pid = (uint32_t)getpid();
	snprintf(h.job, sizeof(h.job), "%s", job);
	h.replicate = 1;
	h.shard = 1;
	h.device = SHARDD_HELLO_DEVICE_HOST;
	return h;
}

/* A whole message (header and payload) as one datagram, with `nfds` fds. */
static ssize_t send_msg_fds(int sock, uint16_t type, uint32_t seq, const void *payload,
			    uint32_t len, const int *fds, int nfds)
{
	struct shardd_msg_hdr h = {
		.magic = SHARDD_MAGIC, .type = type, .length = len, .seq = seq
	};
	uint8_t buf[sizeof(h) + 512];

	cr_assert_leq(len, 512);
	memcpy(buf, &h, sizeof(h));
	memcpy(buf + sizeof(h), payload, len);
	return harness_send_fds(sock, buf, sizeof(h) + len, fds, nfds);
}

/*
 * The first datagram read with one plain recv() (no retry after ECONNRESET,
 * as a simple client reads) within REPLY_MS: 0 and the ERROR's code and text,
 * or -errno of that read (-ECONNRESET: the reply was lost), -EPIPE on EOF,
 * -ETIMEDOUT, -EPROTO for another message.
 */
static int first_read_error(int sock, int32_t *code, char *text, size_t len)
{
	struct pollfd p = { .fd = sock, .events = POLLIN };
	uint8_t buf[SHARDD_CTRL_CHUNK];
	struct shardd_msg_hdr h;
	struct shardd_error_msg em;
	ssize_t n;
	size_t t;

	if (poll(&p, 1, REPLY_MS) == 0)
		return -ETIMEDOUT;
	n = recv(sock, buf, sizeof(buf), MSG_DONTWAIT);
	if (n < 0)
		return -errno;
	if (n == 0)
		return -EPIPE;
	if ((size_t)n < sizeof(h) + sizeof(em))
		return -EPROTO;
	memcpy(&h, buf, sizeof(h));
	memcpy(&em, buf + sizeof(h), sizeof(em));
	if (h.magic != SHARDD_MAGIC || h.type != SHARDD_MSG_ERROR ||
	    em.msg_len != (size_t)n - sizeof(h) - sizeof(em))
		return -EPROTO;
	*code = em.code;
	t = em.msg_len < len - 1 ? em.msg_len : len - 1;
	memcpy(text, buf + sizeof(h) + sizeof(em), t);
	text[t] = '\0';
	return 0;
}

/* The first read is an ERROR of `code` whose text holds `needle`; then EOF. */
static void expect_refusal(int sock, int32_t code, const char *needle, const char *what)
{
	char text[1100];
	int32_t got = 0;
	int ret = first_read_error(sock, &got, text, sizeof(text));

	if (ret < 0)
		harness_daemon_dump_log(&daemon_);
	cr_assert_eq(ret, 0, "%s: the first read gave %s, not the daemon's ERROR", what,
		     ret == -EPIPE ? "EOF" : strerror(-ret));
	cr_assert_eq(got, code, "%s: ERROR code %d, want %d (%s)", what, got, code, text);
	cr_assert_not_null(strstr(text, needle), "%s: ERROR '%s' lacks '%s'", what, text, needle);
	ret = harness_expect_eof(sock, REPLY_MS);
	cr_assert_eq(ret, 0, "%s: no EOF after the ERROR: %s", what, strerror(-ret));
}

/* The daemon's count of open connections (admin status) on `sock`. */
static int64_t admin_connections(int sock, uint32_t seq)
{
	const char req[] = "{\"cmd\":\"status\"}";
	struct shardd_ctrl_rx rx = { 0 };
	json_error_t jerr;
	int64_t n;
	json_t *r;

	cr_assert_eq(shardd_ctrl_send(sock, SHARDD_MSG_ADMIN, seq, req, sizeof(req) - 1, NULL, 0),
		     0);
	cr_assert_eq(shardd_ctrl_recv(sock, &rx, REPLY_MS), 0, "no admin reply");
	cr_assert_eq(rx.hdr.type, SHARDD_MSG_ADMIN_REPLY);
	r = json_loadb((const char *)rx.payload, rx.hdr.length, 0, &jerr);
	cr_assert_not_null(r, "admin reply: %s", jerr.text);
	n = json_integer_value(json_object_get(r, "connections"));
	json_decref(r);
	shardd_ctrl_rx_reset(&rx);
	return n;
}

/*
 * Wait (request after request, no sleeping) until the daemon counts `want`
 * connections: it has closed every connection we gave up, lingering ones too.
 */
static void wait_connections(int sock, int64_t want)
{
	int64_t deadline = harness_now_ms() + REPLY_MS, n;
	uint32_t seq = 100;

	while ((n = admin_connections(sock, seq++)) != want && harness_now_ms() < deadline)
		sched_yield();
	cr_assert_eq(n, want, "the daemon still counts %lld connections, want %lld", (long long)n,
		     (long long)want);
}

/*
 * The daemon has processed every close (it counts `base` connections again)
 * and holds as many fds as the `base_fds` it held before; `admin` is closed.
 */
static void assert_fds_back(int admin, int64_t base, int base_fds)
{
	wait_connections(admin, base);
	cr_assert_eq(daemon_fd_count(), base_fds, "the daemon holds %d fds, %d before",
		     daemon_fd_count(), base_fds);
	close(admin);
}

/* A well-behaved client attaches and runs a nop and a barrier. */
static void assert_others_served(const char *job)
{
	struct shardd_client *c = NULL;

	cr_assert_eq(harness_attach(&daemon_, job, 0, 1, 1, &c), 0,
		     "a good client cannot attach: %s", shardd_last_error());
	cr_assert_eq(shardd_nop(c), 0, "nop: %s", shardd_last_error());
	cr_assert_eq(shardd_barrier(c, 1), 0, "barrier: %s", shardd_last_error());
	shardd_close(c);
}

/* Eight fds to pass: both ends of four pipes. */
static void open_eight(int fds[8])
{
	for (int i = 0; i < 8; i += 2)
		cr_assert_eq(pipe2(fds + i, O_CLOEXEC), 0);
}

static void close_all(const int *fds, int n)
{
	for (int i = 0; i < n; i++)
		close(fds[i]);
}

/* ------------------------------------------------------------------ */
/* 1. Descriptors received are closed on every path                    */
/* ------------------------------------------------------------------ */

Test(control_hardening, zero_length_datagrams_carrying_fds_are_refused_and_leak_no_descriptor)
{
	int admin = raw_connect(), fds[8], base_fds, fd;
	int64_t base = admin_connections(admin, 1);

	base_fds = daemon_fd_count();
	open_eight(fds);
	for (int i = 0; i < FLOOD; i++) {
		fd = raw_connect();
		cr_assert_eq(harness_send_fds(fd, NULL, 0, fds, 8), 0, "sendmsg: %s",
			     strerror(errno));
		expect_refusal(fd, -SHARDD_E_MALFORMED, "zero-length datagram",
			       "zero-length datagram with 8 fds");
		close(fd);
	}
	/* Without fds it is a protocol error too, told apart from an EOF. */
	fd = raw_connect();
	cr_assert_eq(harness_send_fds(fd, NULL, 0, NULL, 0), 0, "sendmsg: %s", strerror(errno));
	expect_refusal(fd, -SHARDD_E_MALFORMED, "zero-length datagram", "zero-length datagram");
	close(fd);
	close_all(fds, 8);

	wait_connections(admin, base);
	cr_assert_eq(daemon_fd_count(), base_fds,
		     "the daemon holds %d fds after %d zero-length datagrams with 8 fds each, "
		     "%d before",
		     daemon_fd_count(), FLOOD, base_fds);
	cr_assert(!log_contains("larger than"), "the log blames the datagram's size");
	close(admin);
	assert_others_served("after-flood");
}

Test(control_hardening, datagram_with_more_fds_than_the_protocol_allows_is_refused_naming_the_count)
{
	struct shardd_hello h = make_hello("fds", SHARDD_PROTO_MAJOR);
	int admin = raw_connect(), fds[12], base_fds, fd;
	int64_t base = admin_connections(admin, 1);

	base_fds = daemon_fd_count();
	open_eight(fds);
	for (int i = 8; i < 12; i += 2)
		cr_assert_eq(pipe2(fds + i, O_CLOEXEC), 0);
	for (int i = 0; i < 20; i++) {
		fd = raw_connect();
		/* 12 fds: past proto's limit, so harness_send_fds builds the control data. */
		cr_assert_gt(send_msg_fds(fd, SHARDD_MSG_HELLO, 1, &h, sizeof(h), fds, 12), 0,
			     "sendmsg: %s", strerror(errno));
		expect_refusal(fd, -SHARDD_E_MALFORMED, "more than 8 file descriptors",
			       "HELLO with 12 fds");
		close(fd);
	}
	close_all(fds, 12);
	assert_fds_back(admin, base, base_fds);
	assert_others_served("after-many-fds");
}

Test(control_hardening, fds_dropped_at_the_fd_limit_are_logged_with_the_real_cause)
{
	struct shardd_hello h = make_hello("limit", SHARDD_PROTO_MAJOR);
	int admin = raw_connect(), fds[8], base_fds, third_free, fd;
	int64_t base = admin_connections(admin, 1);
	struct rlimit old;
	char want[64];

	/* Room for the connection and two of the eight fds: the kernel drops six. */
	base_fds = daemon_fds(2, &third_free);
	old = daemon_set_nofile((rlim_t)third_free + 1);
	open_eight(fds);
	fd = raw_connect();
	cr_assert_gt(send_msg_fds(fd, SHARDD_MSG_HELLO, 1, &h, sizeof(h), fds, 8), 0, "sendmsg: %s",
		     strerror(errno));
	expect_refusal(fd, -SHARDD_E_MALFORMED, "fd limit", "HELLO with 8 fds at the fd limit");
	close(fd);
	close_all(fds, 8);
	snprintf(want, sizeof(want), "RLIMIT_NOFILE=%d", third_free + 1);
	wait_log("control data truncated: file descriptors dropped by the kernel");
	wait_log(want);
	cr_assert(!log_contains("larger than"), "the log blames the datagram's size");

	cr_assert_eq(prlimit(daemon_.pid, RLIMIT_NOFILE, &old, NULL), 0);
	assert_fds_back(admin, base, base_fds);
	assert_others_served("after-truncation");
}

Test(control_hardening, connection_at_the_fd_limit_is_answered_with_the_cause_and_serving_resumes)
{
	struct shardd_hello h = make_hello("full", SHARDD_PROTO_MAJOR);
	int admin = raw_connect(), base_fds, first_free, fd;
	int64_t base = admin_connections(admin, 1);
	struct rlimit old;

	/* No descriptor number left: accept() itself fails with EMFILE. */
	base_fds = daemon_fds(0, &first_free);
	old = daemon_set_nofile((rlim_t)first_free);
	for (int i = 0; i < 3; i++) {
		uint16_t type = 0;
		int32_t code = 0;
		char text[1100];
		int ret;

		fd = raw_connect();
		/* The daemon may have answered and closed already: EPIPE is fine here. */
		send_msg_fds(fd, SHARDD_MSG_HELLO, 1, &h, sizeof(h), NULL, 0);
		/*
		 * Read as libshardd reads: at its fd limit the daemon cannot linger
		 * (that would hold its reserve descriptor), so a HELLO arriving just
		 * before its close may cost the client one ECONNRESET first.
		 */
		ret = harness_recv_error(fd, REPLY_MS, &type, &code, text, sizeof(text));
		if (ret < 0)
			harness_daemon_dump_log(&daemon_);
		cr_assert_eq(ret, 0, "connection at the fd limit: no ERROR (%s)", strerror(-ret));
		cr_assert_eq(code, -EMFILE, "ERROR code %d: %s", code, text);
		cr_assert_not_null(strstr(text, "out of file descriptors"), "%s", text);
		cr_assert_not_null(strstr(text, "RLIMIT_NOFILE="), "%s", text);
		close(fd);
	}
	wait_log("at its fd limit (RLIMIT_NOFILE=");
	cr_assert_eq(prlimit(daemon_.pid, RLIMIT_NOFILE, &old, NULL), 0);
	assert_others_served("after-emfile");
	assert_fds_back(admin, base, base_fds);
}

/* ------------------------------------------------------------------ */
/* 2. A refusal's ERROR reaches the client before the close            */
/* ------------------------------------------------------------------ */

/* Stop the daemon and wait until it is stopped: what we send next is all queued when it reads. */
static void daemon_stop_signal(void)
{
	siginfo_t si = { 0 };

	cr_assert_eq(kill(daemon_.pid, SIGSTOP), 0);
	cr_assert_eq(waitid(P_PID, (id_t)daemon_.pid, &si, WSTOPPED | WNOWAIT), 0, "waitid: %s",
		     strerror(errno));
}

Test(control_hardening, refused_hello_followed_by_another_request_still_gets_its_error)
{
	struct shardd_hello h = make_hello("version", SHARDD_PROTO_MAJOR + 1);
	const char req[] = "{\"cmd\":\"status\"}";
	int admin = raw_connect();
	int64_t base = admin_connections(admin, 1);

	for (int i = 0; i < REFUSALS; i++) {
		/* Every other time the daemon is stopped, so both datagrams wait for it. */
		int held = i % 2 == 0, fd;

		if (held)
			daemon_stop_signal();
		fd = raw_connect();
		cr_assert_gt(send_msg_fds(fd, SHARDD_MSG_HELLO, 1, &h, sizeof(h), NULL, 0), 0);
		/* The daemon may have refused and closed already: EPIPE is fine here. */
		send_msg_fds(fd, SHARDD_MSG_ADMIN, 2, req, sizeof(req) - 1, NULL, 0);
		if (held)
			cr_assert_eq(kill(daemon_.pid, SIGCONT), 0);
		expect_refusal(fd, -SHARDD_E_VERSION, "client speaks protocol", "refused HELLO");
		close(fd);
	}
	wait_connections(admin, base);
	close(admin);
	assert_others_served("after-refusals");
}

Test(control_hardening, refused_connection_that_never_closes_is_closed_after_the_linger)
{
	struct shardd_hello h = make_hello("linger", SHARDD_PROTO_MAJOR + 1);
	int admin = raw_connect(), fd;
	int64_t base = admin_connections(admin, 1), t0;

	fd = raw_connect();
	cr_assert_gt(send_msg_fds(fd, SHARDD_MSG_HELLO, 1, &h, sizeof(h), NULL, 0), 0);
	expect_refusal(fd, -SHARDD_E_VERSION, "client speaks protocol", "refused HELLO");
	/*
	 * We keep our end open: the daemon closes its own (POLLHUP; its EOF
	 * came with the ERROR) once the linger is over.
	 */
	t0 = harness_now_ms();
	{
		struct pollfd p = { .fd = fd, .events = 0 };
		int r = poll(&p, 1, LINGER_MS + REPLY_MS);

		cr_assert_eq(r, 1, "the refused connection was not closed within %d ms",
			     LINGER_MS + REPLY_MS);
		cr_assert(p.revents & POLLHUP, "revents 0x%x", p.revents);
	}
	cr_assert_leq(harness_now_ms() - t0, LINGER_MS + REPLY_MS);
	wait_connections(admin, base);
	close(fd);
	close(admin);
}

/* The refused children: uid 65534 connecting to a socket everyone may use. */
static void open_socket_to_all(void)
{
	cr_assert_eq(chmod(daemon_.dir, 0711), 0, "chmod %s: %s", daemon_.dir, strerror(errno));
	cr_assert_eq(chmod(daemon_.socket, 0777), 0, "chmod %s: %s", daemon_.socket,
		     strerror(errno));
}

static int become_nobody(void)
{
	if (setgroups(0, NULL) < 0 || setgid(NOBODY) < 0 || setuid(NOBODY) < 0) {
		fprintf(stderr, "child: cannot become uid %d: %s\n", NOBODY, strerror(errno));
		return -1;
	}
	return 0;
}

static int refused_raw_child(void *arg)
{
	struct shardd_hello h = make_hello("nobody", SHARDD_PROTO_MAJOR);
	char text[1100];

	(void)arg;
	CHILD_CHECK(become_nobody() == 0, "setuid");
	h.pid = (uint32_t)getpid();
	for (int i = 0; i < REFUSALS; i++) {
		int32_t code = 0;
		int fd = harness_raw_connect(daemon_.socket), ret;

		CHILD_CHECK(fd >= 0, "connect %s: %s", daemon_.socket, strerror(-fd));
		/* Sent at once, as clients do: the refusal at accept races with it. */
		send_msg_fds(fd, SHARDD_MSG_HELLO, 1, &h, sizeof(h), NULL, 0);
		ret = first_read_error(fd, &code, text, sizeof(text));
		CHILD_CHECK(ret == 0, "attempt %d: the first read gave %s, not the daemon's ERROR",
			    i, ret == -EPIPE ? "EOF" : strerror(-ret));
		CHILD_CHECK(code == -SHARDD_E_PERM && strstr(text, "uid 65534 is not allowed"),
			    "attempt %d: ERROR %d '%s'", i, code, text);
		close(fd);
	}
	return 0;
}

static int refused_client_child(void *arg)
{
	(void)arg;
	CHILD_CHECK(become_nobody() == 0, "setuid");
	for (int i = 0; i < REFUSALS / 4; i++) {
		struct shardd_attach_opts o = {
			.socket_path = daemon_.socket,
			.job = "nobody",
			.replicate = 1,
			.shard = 1,
			.device = SHARDD_HELLO_DEVICE_HOST,
			.timeout_ms = REPLY_MS,
		};
		struct shardd_client *c = NULL;
		int ret = shardd_connect(&o, &c);

		CHILD_CHECK(ret == -SHARDD_E_PERM, "attempt %d: attach gave %d: %s", i, ret,
			    shardd_last_error());
		CHILD_CHECK(strstr(shardd_last_error(), "uid 65534 is not allowed") &&
				    strstr(shardd_last_error(), "--allow-gid 65534"),
			    "attempt %d: %s", i, shardd_last_error());
	}
	return 0;
}

static int refused_shardctl_child(void *arg)
{
	const char *build = arg;
	char bin[512], out[4096];

	CHILD_CHECK(become_nobody() == 0, "setuid");
	snprintf(bin, sizeof(bin), "%s/shardctl", build);
	for (int i = 0; i < 20; i++) {
		const char *argv[] = { bin, "--socket", daemon_.socket, "status", NULL };
		int status = 0, ret = harness_run(argv, REPLY_MS, &status, out, sizeof(out));

		CHILD_CHECK(ret == 0, "run shardctl: %s", strerror(-ret));
		CHILD_CHECK(strstr(out, "uid 65534 is not allowed"), "run %d: %s", i, out);
	}
	return 0;
}

static void run_child(int (*fn)(void *), void *arg)
{
	harness_run_children(fn, arg, 0, 1, 60000, &daemon_);
}

Test(control_hardening, uid_refusal_text_reaches_every_client)
{
	const char *build = getenv("SHARDD_BUILD");

	if (geteuid() != 0)
		cr_skip_test("needs root to run a client as uid %d", NOBODY);
	cr_assert_not_null(build, "SHARDD_BUILD is not set: run through make test");
	open_socket_to_all();
	run_child(refused_raw_child, NULL);
	run_child(refused_client_child, NULL);
	run_child(refused_shardctl_child, (void *)build);
	assert_others_served("after-uid-refusals");
}

/* ------------------------------------------------------------------ */
/* 3. EACCES names the owner and the flag                              */
/* ------------------------------------------------------------------ */

static int denied_child(void *arg)
{
	const char *const *needles = arg;
	struct shardd_client *c = NULL;
	int ret;

	struct shardd_attach_opts o = {
		.socket_path = daemon_.socket,
		.job = "denied",
		.replicate = 1,
		.shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
		.timeout_ms = REPLY_MS,
	};

	CHILD_CHECK(become_nobody() == 0, "setuid");
	ret = shardd_connect(&o, &c);
	CHILD_CHECK(ret == -EACCES, "attach gave %d: %s", ret, shardd_last_error());
	for (int i = 0; needles[i]; i++)
		CHILD_CHECK(strstr(shardd_last_error(), needles[i]), "'%s' lacks '%s'",
			    shardd_last_error(), needles[i]);
	return 0;
}

Test(control_hardening, eacces_on_connect_names_the_socket_owner_and_the_flag)
{
	static const char *const socket_needles[] = {
		"the socket belongs to uid 0 gid 0, mode 0755",
		"runs as uid 65534 gid 65534",
		"--allow-gid 65534",
		"group-accessible",
		NULL,
	};
	static const char *const dir_needles[] = {
		"belongs to uid 0 gid 0, mode 0700",
		"--allow-gid 65534",
		NULL,
	};

	if (geteuid() != 0)
		cr_skip_test("needs root to run a client as uid %d", NOBODY);
	cr_assert_eq(chmod(daemon_.dir, 0711), 0);
	cr_assert_eq(chmod(daemon_.socket, 0755), 0);
	run_child(denied_child, (void *)socket_needles);
	cr_assert_eq(chmod(daemon_.dir, 0700), 0);
	run_child(denied_child, (void *)dir_needles);
}
