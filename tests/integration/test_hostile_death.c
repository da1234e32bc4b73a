/* SPDX-License-Identifier: MIT */
/*
 * Hostile clients against a real shardd, 3: clients that die mid-message
 * or holding an unsharded copy, and connection churn. Each bad input must get an error naming the
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
/* 3. Mid-stream death                                                 */
/* ------------------------------------------------------------------ */

struct child_args {
	int report_fd; /* write end: the child says it is in place */
	int hold_fd;   /* read end: the child blocks here until killed */
};

#define HALF_PARAMS 1000u

/* Attach rank 0 of "half", send the first datagram of a 3-datagram registration, wait to die. */
static int half_register_child(void *arg)
{
	const struct child_args *a = arg;
	struct shardd_hello h = make_hello("half", 0, 1, 2, 0);
	struct shardd_register_group rg = reg_hdr("big", HALF_PARAMS);
	struct shardd_ctrl_rx rx = { 0 };
	struct shardd_msg_hdr mh = {
		.magic = SHARDD_MAGIC,
		.type = SHARDD_MSG_REGISTER_GROUP,
		.length = (uint32_t)(sizeof(rg) + HALF_PARAMS * sizeof(struct shardd_param_spec)),
		.seq = 2,
	};
	uint8_t *first = calloc(1, SHARDD_CTRL_CHUNK);
	char c;
	int fd = harness_raw_connect(hostile_daemon.socket);

	CHILD_CHECK(fd >= 0 && first, "connect");
	CHILD_CHECK(shardd_ctrl_send(fd, SHARDD_MSG_HELLO, 1, &h, sizeof(h), NULL, 0) == 0,
		    "hello");
	CHILD_CHECK(shardd_ctrl_recv(fd, &rx, REPLY_MS) == 0 && rx.hdr.type == SHARDD_MSG_WELCOME,
		    "no welcome");
	shardd_ctrl_rx_reset(&rx);
	memcpy(first, &mh, sizeof(mh));
	memcpy(first + sizeof(mh), &rg, sizeof(rg));
	CHILD_CHECK(send(fd, first, SHARDD_CTRL_CHUNK, MSG_NOSIGNAL) == SHARDD_CTRL_CHUNK,
		    "first datagram");
	CHILD_CHECK(harness_signal(a->report_fd, 'h') == 0, "report");
	(void)!read(a->hold_fd, &c, 1);
	return 0;
}

/* Fork `fn`, wait for its report byte, SIGKILL it, reap it. */
static void run_child_and_kill(int (*fn)(void *))
{
	struct child_args a;
	int rep[2], hold[2], status;
	char c;
	pid_t pid;
	int ret;

	cr_assert_eq(pipe(rep), 0);
	cr_assert_eq(pipe(hold), 0);
	a = (struct child_args){ .report_fd = rep[1], .hold_fd = hold[0] };
	pid = harness_fork(fn, &a);
	cr_assert_gt(pid, 0);
	close(rep[1]);
	close(hold[0]);
	ret = harness_read_full(rep[0], &c, 1, REPLY_MS * 2);
	if (ret < 0) {
		kill(pid, SIGKILL);
		waitpid(pid, &status, 0);
		harness_daemon_dump_log(&hostile_daemon);
	}
	cr_assert_eq(ret, 0, "the child never reported: %s", strerror(-ret));
	kill(pid, SIGKILL);
	cr_assert_eq(harness_wait_pid(pid, REPLY_MS, &status), 0);
	cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "child %s",
		  harness_status_str(status));
	close(rep[0]);
	close(hold[1]);
}

Test(hostile, client_dying_in_the_middle_of_a_multi_datagram_registration)
{
	struct shardd_param_spec *specs = calloc(HALF_PARAMS, sizeof(*specs));
	struct shardd_register_group h = reg_hdr("big", HALF_PARAMS);
	int admin = raw_connect();
	int64_t base = admin_connections(admin);
	int fds = daemon_fd_count();
	struct raw a, b;

	cr_assert_not_null(specs);
	run_child_and_kill(half_register_child);
	wait_connections(admin, base);
	cr_assert_eq(daemon_fd_count(), fds, "the daemon holds %d fds, %d before",
		     daemon_fd_count(), fds);

	/* Rank 0 comes back and both ranks register the whole group. */
	for (uint32_t i = 0; i < HALF_PARAMS; i++) {
		char name[32];

		snprintf(name, sizeof(name), "p%u", i);
		specs[i] = pspec(name, SHARDD_DTYPE_FP16, 2, (uint64_t[]){ 1 + i % 3, 2 });
	}
	raw_attach(&a, "half", 0, 1, 2, 0);
	raw_attach(&b, "half", 1, 1, 2, 0);
	raw_send_register(&a, &h, specs, HALF_PARAMS);
	raw_send_register(&b, &h, specs, HALF_PARAMS);
	cr_assert_eq(raw_recv_group(&a), raw_recv_group(&b));
	raw_close(&a);
	raw_close(&b);
	free(specs);
	close(admin);
	assert_others_served();
}

/* The test's shard values: full[i] of a [6, 2] fp32 param, rank r writes its rows. */
static void hold_full(float *full)
{
	for (int i = 0; i < 12; i++)
		full[i] = 100.0f + (float)i;
}

static const struct shardd_param_desc hold_param = {
	.name = "w",
	.dtype = SHARDD_DTYPE_FP32,
	.ndim = 2,
	.shape = { 6, 2 },
};

/* Rank 0 of "hold": register, write its shard, unshard step 1, report, hold it until killed. */
static int holder_child(void *arg)
{
	const struct child_args *a = arg;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	float full[12];
	char ch;

	hold_full(full);
	CHILD_CHECK(harness_attach(&hostile_daemon, "hold", 0, 1, 2, &c) == 0, "attach");
	CHILD_CHECK(shardd_group_register(c, "g", &hold_param, 1, NULL, NULL, &g) == 0,
		    "register: %s", shardd_last_error());
	CHILD_CHECK(shardd_group_load_full(g, 0, full) == 0, "load");
	CHILD_CHECK(shardd_unshard(g, 1) == 0, "unshard: %s", shardd_last_error());
	CHILD_CHECK(memcmp(shardd_group_unsharded(g, 0), full, sizeof(full)) == 0, "values");
	CHILD_CHECK(harness_signal(a->report_fd, 'u') == 0, "report");
	(void)!read(a->hold_fd, &ch, 1);
	return 0;
}

static struct shardd_client *hold_parent;
static struct shardd_group *hold_group;

/* Rank 1's failure, copied out of its thread's thread-local error. */
static char hold_err[512];

/* Rank 1 registers alongside the child and unshards step 1 with it. */
static void *hold_rank1(void *arg)
{
	float full[12];

	(void)arg;
	hold_full(full);
	if (harness_attach(&hostile_daemon, "hold", 1, 1, 2, &hold_parent) ||
	    shardd_group_register(hold_parent, "g", &hold_param, 1, NULL, NULL, &hold_group) ||
	    shardd_group_load_full(hold_group, 0, full) || shardd_unshard(hold_group, 1)) {
		snprintf(hold_err, sizeof(hold_err), "%s", shardd_last_error());
		return hold_err;
	}
	return NULL;
}

static json_t *show_hold_group(int admin)
{
	static const char req[] = "{\"cmd\":\"show\",\"job\":\"hold\",\"group\":\"g\"}";
	json_t *r = admin_call(admin, 3, req, sizeof(req) - 1);

	cr_assert(json_is_true(json_object_get(r, "ok")), "show: %s",
		  json_string_value(json_object_get(r, "error")));
	return r;
}

/* While the child holds its copy: both ranks are holders. */
static int hold_admin = -1;

static void holders_are_both(void)
{
	json_t *r = show_hold_group(hold_admin);

	cr_assert_eq(json_integer_value(json_object_get(r, "unsharded_refcount")), 2);
	json_decref(r);
}

Test(hostile, client_dying_while_holding_the_unsharded_copy_releases_its_hold)
{
	struct child_args a;
	float full[12];
	pthread_t t;
	void *err = NULL;
	json_t *r;
	int rep[2], hold[2], status;
	char ch;
	pid_t pid;

	hold_full(full);
	hold_admin = raw_connect();
	cr_assert_eq(pipe(rep), 0);
	cr_assert_eq(pipe(hold), 0);
	a = (struct child_args){ .report_fd = rep[1], .hold_fd = hold[0] };
	pid = harness_fork(holder_child, &a);
	cr_assert_gt(pid, 0);
	close(rep[1]);
	close(hold[0]);
	/* Rank 1 in a thread: registration and unshard are collectives with the child. */
	cr_assert_eq(pthread_create(&t, NULL, hold_rank1, NULL), 0);
	pthread_join(t, &err);
	cr_assert_null(err, "rank 1: %s", (const char *)err);
	cr_assert_eq(harness_read_full(rep[0], &ch, 1, REPLY_MS * 2), 0, "rank 0 never unsharded");
	cr_assert_eq(memcmp(shardd_group_unsharded(hold_group, 0), full, sizeof(full)), 0);
	holders_are_both();

	kill(pid, SIGKILL);
	cr_assert_eq(harness_wait_pid(pid, REPLY_MS, &status), 0);
	close(rep[0]);
	close(hold[1]);

	/* Rank 1 reshards; the dead rank's hold is gone with it. */
	cr_assert_eq(shardd_reshard(hold_group, 1), 0, "%s", shardd_last_error());
	wait_connections(hold_admin, 2); /* rank 1 and the admin connection */
	r = show_hold_group(hold_admin);
	cr_assert_eq(json_integer_value(json_object_get(r, "unsharded_refcount")), 0,
		     "a dead rank still holds the unsharded copy");
	json_decref(r);
	/* Rank 0 is gone: rank 1's next unshard fails at once, naming it. */
	cr_assert_eq(shardd_unshard(hold_group, 2), -SHARDD_E_PEER_DIED, "%s", shardd_last_error());
	cr_assert_not_null(strstr(shardd_last_error(), "rank 0"), "%s", shardd_last_error());

	/* A restarted rank 0 opens the group and both unshard the values kept by the daemon. */
	{
		struct shardd_client *c0 = NULL;
		struct shardd_group *g0 = NULL;
		struct shardd_completion cp;

		cr_assert_eq(harness_attach(&hostile_daemon, "hold", 0, 1, 2, &c0), 0);
		cr_assert_eq(shardd_group_open(c0, "g", &g0), 0, "%s", shardd_last_error());
		cr_assert_eq(shardd_group_submit(g0, SHARDD_OP_UNSHARD, 2, 0, 7), 0);
		cr_assert_eq(shardd_unshard(hold_group, 2), 0, "%s", shardd_last_error());
		cr_assert_eq(shardd_wait(c0, &cp, REPLY_MS), 0);
		cr_assert_eq(cp.res, 0, "%s", cp.msg);
		cr_assert_eq(memcmp(shardd_group_unsharded(hold_group, 0), full, sizeof(full)), 0,
			     "the unsharded copy after the restart differs");
		cr_assert_eq(memcmp(shardd_group_unsharded(g0, 0), full, sizeof(full)), 0);
		shardd_group_close(g0);
		shardd_close(c0);
	}
	shardd_group_close(hold_group);
	shardd_close(hold_parent);
	close(hold_admin);
	assert_others_served();
}

#define CHURN 50

Test(hostile, fifty_clients_connecting_and_leaving_leak_no_descriptors)
{
	int admin = raw_connect();
	int64_t base = admin_connections(admin);
	int fds = daemon_fd_count(), now;

	for (int i = 0; i < CHURN; i++) {
		struct shardd_client *c = NULL;
		struct shardd_group *g = NULL;
		struct raw r;
		int fd;

		switch (i % 4) {
		case 0: /* a full life: register a group (memfds), unshard, goodbye */
			cr_assert_eq(harness_attach(&hostile_daemon, "churn", 0, 1, 1, &c), 0);
			cr_assert_eq(shardd_group_register(c, "g", &hold_param, 1, NULL, NULL, &g),
				     0, "%s", shardd_last_error());
			cr_assert_eq(shardd_unshard(g, 1), 0, "%s", shardd_last_error());
			shardd_group_close(g);
			shardd_close(c);
			break;
		case 1: /* attach and vanish without goodbye; the job stays for it */
			raw_attach(&r, "churn-vanish", 0, 1, 1, 0);
			raw_nop_ok(&r, 1);
			raw_close(&r);
			break;
		case 2: /* connect and hang up */
			close(raw_connect());
			break;
		default: /* half a message with an fd, then hang up */
			fd = raw_connect();
			send_hdr(fd, SHARDD_MAGIC, SHARDD_MSG_ADMIN, 0, 100, 1, "{", 1, fd);
			close(fd);
			break;
		}
	}
	/* The vanished rank's job ends when it comes back and says goodbye. */
	{
		struct shardd_client *c = NULL;

		cr_assert_eq(harness_attach(&hostile_daemon, "churn-vanish", 0, 1, 1, &c), 0);
		shardd_close(c);
	}
	wait_connections(admin, base);
	now = daemon_fd_count();
	cr_assert_eq(now, fds, "the daemon holds %d fds after %d clients came and went, %d before",
		     now, CHURN, fds);
	close(admin);
	assert_others_served();
}
