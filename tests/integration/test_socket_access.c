/* SPDX-License-Identifier: MIT */
/*
 * The socket and its directory under --allow-gid / --socket-mode /
 * --socket-group (issue 11, hole 7), against the real binary: a client of
 * another uid in the allowed group attaches and runs ops; without the flag
 * it is refused.
 *
 * Tests that change uids need root (they skip otherwise), as the rest of
 * the integration suites do.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "opsd.h"
#include "shardd.h"

#define CHILD_MS  20000
#define OTHER_GID 4343u
#define NOBODY    65534u /* the unprivileged uid the clients switch to */

struct client_arg {
	const char *socket;
	gid_t group;           /* supplementary group of the client */
	int want;              /* 0: attach and run ops; else the attach error expected */
	const char *want_text; /* with want != 0: a string the error must hold */
};

/* Become uid NOBODY with `group` as its only supplementary group, then attach. */
static int other_uid_client_main(void *p)
{
	const struct client_arg *a = p;
	struct shardd_attach_opts o = {
		.socket_path = a->socket,
		.job = "othr",
		.rank = 0,
		.replicate = 1,
		.shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_client *c = NULL;
	gid_t groups[1] = { a->group };
	int ret;

	CHILD_CHECK(setgroups(1, groups) == 0 && setgid(NOBODY) == 0 && setuid(NOBODY) == 0,
		    "become uid %u with group %u: %s", NOBODY, (unsigned)a->group, strerror(errno));
	if (a->want == 0)
		return client_run_ops(a->socket, "othr");
	ret = shardd_connect(&o, &c);
	CHILD_CHECK(ret == a->want, "attach gave %d (%s), expected %d: %s", ret,
		    shardd_strerror(ret), a->want, shardd_last_error());
	CHILD_CHECK(strstr(shardd_last_error(), a->want_text), "'%s' does not say '%s'",
		    shardd_last_error(), a->want_text);
	return 0;
}

static void run_other_uid_client(struct client_arg *a, struct opd *d)
{
	int status = 0;
	pid_t pid = harness_fork(other_uid_client_main, a);

	cr_assert_gt(pid, 0);
	cr_assert_eq(harness_wait_or_kill(pid, CHILD_MS, &status), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		  "the uid %u client %s; shardd's output:\n%s", NOBODY, harness_status_str(status),
		  d->log);
}

/* run_other_uid_client, then the daemon stopped (exit 0) and the base directory removed. */
static void other_uid_client_then_stop(struct client_arg *a, struct opd *d, const char *base)
{
	run_other_uid_client(a, d);
	opd_stop_clean(d);
	remove_tree(base);
}

static void assert_mode(const char *path, unsigned mode, gid_t gid)
{
	struct stat st;

	cr_assert_eq(stat(path, &st), 0, "stat %s: %s", path, strerror(errno));
	cr_assert_eq(st.st_mode & 07777, mode, "%s has mode %04o, expected %04o", path,
		     st.st_mode & 07777, mode);
	cr_assert_eq(st.st_gid, gid, "%s has group %u, expected %u", path, (unsigned)st.st_gid,
		     (unsigned)gid);
}

TestSuite(operations, .timeout = 60);

/* ------------------------------------------------------------------ */
/* --allow-gid, --socket-mode, --socket-group (issue 11, hole 7)        */
/* ------------------------------------------------------------------ */

Test(operations, allowed_group_client_of_another_uid_attaches_and_runs_ops)
{
	char base[64], dir[96], sock[128], gid[16];
	struct client_arg a = { .socket = sock, .group = ALLOWED_GID };
	struct opd d;

	require_root();
	make_base(base, sizeof(base));
	snprintf(dir, sizeof(dir), "%s/run", base);
	snprintf(sock, sizeof(sock), "%s/shardd.sock", dir);
	snprintf(gid, sizeof(gid), "%u", ALLOWED_GID);
	opd_start_or_fail(&d, (const char *const[]){ "--socket", sock, "--allow-gid", gid, NULL },
			  sock);
	/* The directory shardd created lets the group search it; the socket lets it connect. */
	assert_mode(dir, 0750, ALLOWED_GID);
	assert_mode(sock, 0660, ALLOWED_GID);
	other_uid_client_then_stop(&a, &d, base);
}

Test(operations, other_uid_without_allow_gid_cannot_reach_the_socket)
{
	char base[64], dir[96], sock[128];
	struct client_arg a = {
		.socket = sock, .group = ALLOWED_GID, .want = -EACCES, .want_text = sock
	};
	struct opd d;

	require_root();
	make_base(base, sizeof(base));
	snprintf(dir, sizeof(dir), "%s/run", base);
	snprintf(sock, sizeof(sock), "%s/shardd.sock", dir);
	opd_start_or_fail(&d, (const char *const[]){ "--socket", sock, NULL }, sock);
	/* Without --allow-gid only shardd's own uid reaches the socket. */
	assert_mode(dir, 0700, getgid());
	assert_mode(sock, 0600, getgid());
	other_uid_client_then_stop(&a, &d, base);
}

Test(operations, open_socket_mode_still_refuses_a_uid_not_allowed_naming_the_flag)
{
	char base[64], sock[128];
	struct client_arg a = { .socket = sock,
				.group = OTHER_GID,
				.want = -SHARDD_E_PERM,
				.want_text = "--allow-gid" };
	struct opd d;

	require_root();
	make_base(base, sizeof(base));
	snprintf(sock, sizeof(sock), "%s/run/shardd.sock", base);
	opd_start_or_fail(
		&d, (const char *const[]){ "--socket", sock, "--socket-mode", "0666", NULL }, sock);
	/* The socket is open to all, so the daemon's own check answers, in words. */
	assert_mode(sock, 0666, getgid());
	other_uid_client_then_stop(&a, &d, base);
}

Test(operations, socket_group_flag_picks_the_group_among_several_allowed)
{
	char base[64], dir[96], sock[128], g1[16], g2[16];
	struct client_arg a = { .socket = sock, .group = OTHER_GID };
	struct opd d;

	require_root();
	make_base(base, sizeof(base));
	snprintf(dir, sizeof(dir), "%s/run", base);
	snprintf(sock, sizeof(sock), "%s/shardd.sock", dir);
	snprintf(g1, sizeof(g1), "%u", ALLOWED_GID);
	snprintf(g2, sizeof(g2), "%u", OTHER_GID);
	opd_start_or_fail(&d,
			  (const char *const[]){ "--socket", sock, "--allow-gid", g1, "--allow-gid",
						 g2, "--socket-group", g2, NULL },
			  sock);
	assert_mode(dir, 0750, OTHER_GID);
	assert_mode(sock, 0660, OTHER_GID);
	other_uid_client_then_stop(&a, &d, base);
}

Test(operations, existing_private_directory_is_kept_and_warned_about)
{
	char base[64], dir[96], sock[128], gid[16];
	struct opd d;

	make_base(base, sizeof(base));
	snprintf(dir, sizeof(dir), "%s/run", base);
	snprintf(sock, sizeof(sock), "%s/shardd.sock", dir);
	snprintf(gid, sizeof(gid), "%u", ALLOWED_GID);
	cr_assert_eq(mkdir(dir, 0700), 0);
	cr_assert_eq(chmod(dir, 0700), 0);
	opd_start_or_fail(&d, (const char *const[]){ "--socket", sock, "--allow-gid", gid, NULL },
			  sock);
	/* Not shardd's to change (it may be a home or /tmp), but the log says why clients fail. */
	assert_mode(dir, 0700, getgid());
	cr_assert_not_null(strstr(d.log, "cannot be searched by group 4242"), "%s", d.log);
	cr_assert_not_null(strstr(d.log, dir), "%s", d.log);
	opd_stop_clean(&d);
	remove_tree(base);
}

Test(operations, bad_socket_mode_is_a_usage_error)
{
	expect_usage_error("--socket-mode", "0066", "--socket-mode: '0066'");
}
