/* SPDX-License-Identifier: MIT */
/*
 * Hostile clients against a real shardd, 5: the holes of the adversarial
 * audit (docs/RELIABILITY.md, "Bad input"), each driven from a client
 * through the protocol itself (tests/lib/rawproto.h: proto/ only, nothing
 * in libshardd filters what reaches the daemon). Each test ends with the
 * daemon alive, free of sanitizer reports, and serving a well-behaved
 * client. The other hostile suites: test_hostile_{ring,control,death,replies}.c.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "hostile.h"

TestSuite(hostile, .init = start_daemon, .fini = stop_daemon, .timeout = 30);

/*
 * A job's name becomes a directory under --state-dir (its checkpoints, and
 * the --keep retention that deletes old ones): a name that is a path
 * ("..", "a/b", "../x") would reach outside it, or into another job's.
 */
Test(hostile, job_name_that_is_a_path_is_refused_at_hello)
{
	static const char *const names[] = {
		".", "..", "../escaped", "a/b", "/abs", "x/..", "job/"
	};

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		struct shardd_hello h = make_hello(names[i], 0, 1, 1, 0);
		char quoted[80];
		int fd = raw_connect();

		snprintf(quoted, sizeof(quoted), "'%s'", names[i]);
		send_msg(fd, SHARDD_MSG_HELLO, 7, &h, sizeof(h));
		expect_refused(fd, 7, -SHARDD_E_INVALID, NEEDLES("hello.job", quoted), names[i]);
	}
	/* Dots and slashes elsewhere stay allowed: only a name that is a path is refused. */
	{
		struct raw r;

		raw_attach(&r, "run.1..v2", 0, 1, 1, 0);
		raw_nop_ok(&r, 1);
		raw_close(&r);
	}
	assert_others_served();
}

/*
 * Every group holds a few descriptors (memfds) in the daemon for as long as
 * its job lives, and a group of one element counts 64 bytes against
 * --max-memory: one client registering group after group must be refused
 * before the daemon runs out of descriptors, not leave it unable to accept
 * anyone else.
 */
Test(hostile, registering_groups_without_end_is_refused_before_the_fd_limit)
{
	const struct rlimit lim = { 512, 512 };
	struct shardd_param_spec s = pspec("w", SHARDD_DTYPE_FP32, 1, (uint64_t[]){ 1 });
	struct shardd_ctrl_rx rx;
	struct raw r;
	int refused = 0, n;

	cr_assert_eq(prlimit(hostile_daemon.pid, RLIMIT_NOFILE, &lim, NULL), 0, "prlimit: %s",
		     strerror(errno));
	raw_attach(&r, "greedy", 0, 1, 1, 0);
	for (n = 0; n < 600 && !refused; n++) {
		struct shardd_register_group h;
		char name[32];

		snprintf(name, sizeof(name), "g%d", n);
		h = reg_hdr(name, 1);
		raw_send_register(&r, &h, &s, 1);
		recv_msg(r.fd, &rx);
		cr_assert_eq(rx.hdr.seq, r.seq);
		if (rx.hdr.type == SHARDD_MSG_ERROR) {
			check_error(&rx, r.seq, -EMFILE,
				    NEEDLES("descriptors", "RLIMIT_NOFILE", "512", "'greedy'"),
				    "registration past the descriptor budget");
			refused = 1;
		} else {
			cr_assert_eq(rx.hdr.type, SHARDD_MSG_GROUP, "reply type %u", rx.hdr.type);
			shardd_ctrl_rx_reset(&rx);
		}
	}
	cr_assert(refused,
		  "%d groups of one element each were all registered under a limit of "
		  "512 descriptors",
		  n);
	/* The job still works, and the daemon still takes connections and attaches. */
	raw_nop_ok(&r, 2);
	{
		struct raw other;

		raw_attach(&other, "other", 0, 1, 1, 0);
		raw_nop_ok(&other, 3);
		raw_close(&other);
	}
	/* Ending the job gives its descriptors back: others register groups again. */
	{
		static const char req[] = "{\"cmd\":\"end\",\"job\":\"greedy\"}";
		int fd = raw_connect();
		json_t *rep = admin_call(fd, 1, req, sizeof(req) - 1);

		cr_assert(json_is_true(json_object_get(rep, "ok")), "end greedy failed");
		json_decref(rep);
		close(fd);
	}
	raw_close(&r);
	assert_others_served();
}

/* The daemon's count of jobs, through `status`. */
static int64_t admin_jobs(int sock)
{
	static const char req[] = "{\"cmd\":\"status\"}";
	json_t *rep = admin_call(sock, 2, req, sizeof(req) - 1);
	int64_t n = json_integer_value(json_object_get(rep, "jobs"));

	json_decref(rep);
	return n;
}

/*
 * A job lingers for --job-linger (an hour by default) once its last rank
 * is gone, so that the rank can come back for its params. A client that
 * attaches job after job (each a 32x32 mesh) and leaves must not make the
 * daemon keep them all: a job that holds no group has nothing to come
 * back for. One that holds a group still lingers.
 */
Test(hostile, jobs_attached_and_left_without_a_group_are_not_kept)
{
	int fd = raw_connect();
	struct raw r;

	for (int i = 0; i < 200; i++) {
		char job[32];

		snprintf(job, sizeof(job), "ghost-%d", i);
		raw_attach(&r, job, (uint32_t)i % 1024, 32, 32, 0);
		raw_nop_ok(&r, 1);
		raw_close(&r);
	}
	raw_attach(&r, "kept", 0, 1, 1, 0);
	raw_register_small(&r, "g");
	raw_close(&r);
	/* Every EOF above is processed once only our admin connection is left. */
	wait_connections(fd, 1);
	cr_assert_eq(admin_jobs(fd), 1,
		     "the daemon still holds %lld jobs; want only 'kept', which "
		     "holds a group",
		     (long long)admin_jobs(fd));
	{
		static const char req[] = "{\"cmd\":\"jobs\"}";
		json_t *rep = admin_call(fd, 3, req, sizeof(req) - 1);
		char *text = json_dumps(rep, JSON_COMPACT);

		cr_assert_not_null(strstr(text, "\"kept\""), "jobs: %s", text);
		free(text);
		json_decref(rep);
	}
	close(fd);
	assert_others_served();
}

/*
 * Send `req` (len bytes) to 127.0.0.1:port and read the response until EOF
 * or within_ms; the response (NUL-terminated) into out. Returns the ms it
 * took, or -1 when no EOF came within_ms.
 */
static int64_t http_exchange(int port, const char *req, size_t len, char *out, size_t outlen,
			     int within_ms)
{
	struct sockaddr_in sa = { .sin_family = AF_INET,
				  .sin_port = htons((uint16_t)port),
				  .sin_addr = { htonl(INADDR_LOOPBACK) } };
	int64_t start = harness_now_ms();
	size_t have = 0, sent = 0;
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	cr_assert_geq(fd, 0);
	cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "connect to port %d: %s",
		     port, strerror(errno));
	out[0] = '\0';
	for (;;) {
		struct pollfd p = { .fd = fd, .events = POLLIN | (sent < len ? POLLOUT : 0) };
		int64_t left = start + within_ms - harness_now_ms();
		ssize_t n;

		if (left <= 0 || poll(&p, 1, (int)left) <= 0) {
			close(fd);
			return -1;
		}
		if (p.revents & POLLOUT) {
			n = send(fd, req + sent, len - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
			if (n > 0)
				sent += (size_t)n;
		}
		if (!(p.revents & (POLLIN | POLLHUP | POLLERR)))
			continue;
		n = recv(fd, out + have, outlen - 1 - have, MSG_DONTWAIT);
		if (n <= 0 && !(n < 0 && errno == EAGAIN))
			break;
		if (n > 0)
			have += (size_t)n;
		out[have] = '\0';
		if (have == outlen - 1)
			break;
	}
	close(fd);
	return harness_now_ms() - start;
}

/*
 * libmicrohttpd's epoll is edge-triggered: a request line longer than its
 * buffer (32 KiB) left the connection with work and no new event, so the
 * scraper got no answer, not even after the connection timeout, and held
 * one of the 16 connection slots until it hung up.
 */
Test(hostile, metrics_request_line_past_the_buffer_gets_414_not_a_hang)
{
	static char resp[4096];
	const char *extra[] = { "--metrics-listen", "0", "--log-level", "info", NULL };
	const char *tail = " HTTP/1.1\r\nHost: x\r\n\r\n";
	struct harness_daemon d = { 0 };
	size_t n = 40000;
	char *req = malloc(n + 64);
	const char *p;
	int port;

	cr_assert_not_null(req);
	harness_daemon_start_or_fail(&d, extra);
	harness_wait_log(&d, "metrics on http://127.0.0.1:", REPLY_MS);
	pthread_mutex_lock(&d.lock);
	p = strstr(d.log, "metrics on http://127.0.0.1:");
	port = atoi(p + strlen("metrics on http://127.0.0.1:"));
	pthread_mutex_unlock(&d.lock);
	memcpy(req, "GET /", 5);
	memset(req + 5, 'a', n);
	memcpy(req + 5 + n, tail, strlen(tail));
	cr_assert_geq(http_exchange(port, req, 5 + n + strlen(tail), resp, sizeof(resp), 5000), 0,
		      "no answer within 5 s to a %zu-byte request line: %.200s", n + 5, resp);
	cr_assert_not_null(strstr(resp, "HTTP/1.1 414"), "%.300s", resp);
	free(req);
	/* And the scrape after it is served. */
	cr_assert_geq(
		http_exchange(port, "GET /metrics HTTP/1.0\r\n\r\n", 25, resp, sizeof(resp), 5000),
		0, "no answer to a scrape");
	cr_assert_not_null(strstr(resp, "HTTP/1.1 200"), "%.300s", resp);
	harness_daemon_stop_expect_clean(&d);
	assert_others_served();
}

/*
 * Every GROUP reply carries four descriptors, which the daemon holds
 * (duplicated) while the reply waits in the client's output queue; the
 * queue was bounded in bytes only (64 MiB, some 600 000 GROUP replies). A
 * client asking OPEN_GROUP again and again without reading took the daemon
 * to its fd limit: 5 000 unread replies are 20 000 descriptors. It must be
 * dropped long before, and the daemon must hold no more descriptors than
 * it did before the flood.
 */
Test(hostile, open_group_flood_without_reading_replies_is_dropped_early)
{
	struct shardd_open_group og = { 0 };
	int before, peak = 0, sent, fd;
	struct raw r;

	raw_attach(&r, "opener", 0, 1, 1, 0);
	raw_register_small(&r, "g");
	before = daemon_fd_count();
	snprintf(og.name, sizeof(og.name), "g");
	for (sent = 0; sent < 2000; sent++) {
		struct shardd_msg_hdr h = { .magic = SHARDD_MAGIC,
					    .type = SHARDD_MSG_OPEN_GROUP,
					    .length = sizeof(og),
					    .seq = 100u + (uint32_t)sent };
		struct iovec iov[2] = { { &h, sizeof(h) }, { &og, sizeof(og) } };
		struct msghdr mh = { .msg_iov = iov, .msg_iovlen = 2 };
		int now;

		if (sendmsg(r.fd, &mh, MSG_NOSIGNAL) < 0)
			break; /* dropped: the daemon closed the connection */
		if (sent % 50 == 0) {
			now = daemon_fd_count();
			peak = now > peak ? now : peak;
		}
	}
	cr_assert_lt(peak - before, 600,
		     "%d unread GROUP replies made the daemon hold %d more "
		     "descriptors",
		     sent, peak - before);
	cr_assert_lt(sent, 2000,
		     "the daemon never dropped a client that reads none of its "
		     "replies (%d sent)",
		     sent);
	raw_close(&r);
	/* Its queue was freed with it: every descriptor of the flood is back. */
	fd = raw_connect();
	wait_connections(fd, 1);
	close(fd);
	cr_assert_leq(daemon_fd_count(), before, "the daemon holds %d descriptors, %d before",
		      daemon_fd_count(), before);
	assert_others_served();
}

/* hostile_daemon with two engine workers, so that a test can name how many it takes to block them. */
static void start_daemon_two_workers(void)
{
	const char *extra[] = { "--collective-timeout", COLLECTIVE_S, "--workers", "2", NULL };

	harness_daemon_start_or_fail(&hostile_daemon, extra);
	rawproto_use(&hostile_daemon);
}

/* REGISTER_GROUP of one fp32 [4, 2] param, restored from `path`, on r (no reply read). */
static void raw_send_register_restore(struct raw *r, const char *name, const char *path)
{
	struct shardd_register_group h = reg_hdr(name, 1);
	struct shardd_param_spec s = pspec("w", SHARDD_DTYPE_FP32, 2, (uint64_t[]){ 4, 2 });
	struct shardd_restore rs = { .path_len = (uint32_t)strlen(path) };
	uint32_t len;
	uint8_t *base, *p;

	h.init = SHARDD_INIT_RESTORE;
	base = reg_payload(&h, &s, 1, &len);
	p = malloc(len + sizeof(rs) + rs.path_len);
	cr_assert_not_null(p);
	memcpy(p, base, len);
	memcpy(p + len, &rs, sizeof(rs));
	memcpy(p + len + sizeof(rs), path, rs.path_len);
	send_msg(r->fd, SHARDD_MSG_REGISTER_GROUP, ++r->seq, p,
		 len + (uint32_t)sizeof(rs) + rs.path_len);
	free(p);
	free(base);
}

/*
 * A client names the checkpoint a group restores from: a directory whose
 * manifest.json is a FIFO made a worker's open() wait for a writer that
 * never comes, for ever; one such group per worker and no op of any job
 * ran again. The restore must refuse what is not a regular file.
 */
Test(hostile, restore_from_a_fifo_is_refused_not_a_blocked_worker, .init = start_daemon_two_workers)
{
	char dir[] = "/tmp/shardd-fifo-XXXXXX", fifo[64];
	struct raw r[3];

	cr_assert_not_null(mkdtemp(dir));
	snprintf(fifo, sizeof(fifo), "%s/manifest.json", dir);
	cr_assert_eq(mkfifo(fifo, 0600), 0, "mkfifo: %s", strerror(errno));
	for (int i = 0; i < 3; i++) {
		char job[32];

		snprintf(job, sizeof(job), "fifo-%d", i);
		raw_attach(&r[i], job, 0, 1, 1, 0);
		raw_send_register_restore(&r[i], "g", dir);
	}
	for (int i = 0; i < 3; i++) {
		expect_error(r[i].fd, r[i].seq, -SHARDD_E_INVALID,
			     NEEDLES(fifo, "not a regular file"), "restore from a FIFO");
		raw_close(&r[i]);
	}
	assert_others_served();
	unlink(fifo);
	rmdir(dir);
}

/* hostile_daemon with --max-memory 64M: the rings of all clients may hold 256 MiB. */
static void start_daemon_64m(void)
{
	const char *extra[] = { "--collective-timeout", COLLECTIVE_S, "--max-memory", "64M", NULL };

	harness_daemon_start_or_fail(&hostile_daemon, extra);
	rawproto_use(&hostile_daemon);
}

/*
 * A ring of 65 536 SQ entries is a 44 MiB memfd the daemon maps and writes
 * (every CQ slot and its message text), counted nowhere: a client opening
 * connection after connection, each attached with the largest ring, made
 * the daemon hold 44 MiB per socket it spent, past any --max-memory. The
 * rings of all clients are bounded; past the bound a HELLO is refused
 * naming its sq_entries, and a client with the default ring still attaches.
 */
Test(hostile, largest_rings_on_many_connections_are_refused_past_a_bound, .init = start_daemon_64m)
{
	struct raw r[16];
	int n, refused = 0, fd;

	for (n = 0; n < 16 && !refused; n++) {
		struct shardd_hello h = make_hello("rings", (uint32_t)n, 1, 16, 65536);
		struct shardd_ctrl_rx rx;

		memset(&r[n], 0, sizeof(r[n]));
		r[n].fd = raw_connect();
		r[n].doorbell = -1;
		send_msg(r[n].fd, SHARDD_MSG_HELLO, 1, &h, sizeof(h));
		recv_msg(r[n].fd, &rx);
		if (rx.hdr.type == SHARDD_MSG_ERROR) {
			check_error(&rx, 1, -SHARDD_E_NOMEM,
				    NEEDLES("hello.sq_entries = 65536", "--max-memory"),
				    "one ring too many");
			refused = 1;
		}
		shardd_ctrl_rx_reset(&rx);
	}
	cr_assert(refused,
		  "16 rings of 65536 entries (%d MiB) were all created under --max-memory 64M",
		  16 * 44);
	cr_assert_geq(n, 4, "refused at ring %d already: the bound is 256 MiB", n);
	assert_others_served();
	/* The rings of closed connections are given back. */
	for (int i = 0; i < n; i++)
		raw_close(&r[i]);
	fd = raw_connect();
	wait_connections(fd, 1);
	close(fd);
	raw_attach(&r[0], "rings-again", 0, 1, 1, 65536);
	raw_nop_ok(&r[0], 1);
	raw_close(&r[0]);
}

/* Child: attach as rank 0 of the 1x1 job `arg`, then die without goodbye. */
static int attach_and_die(void *arg)
{
	struct shardd_client *c = NULL;

	return harness_attach(&hostile_daemon, arg, 0, 1, 1, &c) == 0 ? 0 : 1;
}

/*
 * A rank whose client died re-attaches at once, as a restarted trainer
 * does, maybe before the daemon has seen the old client's EOF: the HELLO
 * then closes the old client itself. A job that holds no group ends with
 * its last rank, so that close may end the job under the HELLO, which
 * must then start it anew (not attach to the job just freed).
 */
Test(hostile, rank_reattaching_over_its_dead_client_in_a_job_without_groups)
{
	for (int i = 0; i < 40; i++) {
		struct shardd_client *c = NULL;
		char job[32];
		int status, ret;
		int64_t until;
		pid_t pid;

		snprintf(job, sizeof(job), "phoenix-%d", i % 4);
		pid = harness_fork(attach_and_die, job);
		cr_assert_gt(pid, 0);
		cr_assert_eq(harness_wait_or_kill(pid, REPLY_MS, &status), 0);
		cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child: %s",
			  harness_status_str(status));
		/* Right away: the daemon may or may not have seen the child's EOF yet. */
		until = harness_now_ms() + REPLY_MS;
		while ((ret = harness_attach(&hostile_daemon, job, 0, 1, 1, &c)) != 0) {
			cr_assert(strstr(shardd_last_error(), "already attached"),
				  "re-attach %d: %s", i, shardd_last_error());
			cr_assert_lt(harness_now_ms(), until, "rank 0 of '%s' never freed", job);
		}
		cr_assert_eq(shardd_nop(c), 0, "nop: %s", shardd_last_error());
		shardd_close(c);
	}
	assert_others_served();
}
