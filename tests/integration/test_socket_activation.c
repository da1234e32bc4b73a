/* SPDX-License-Identifier: MIT */
/*
 * Socket activation, against the real binary: the LISTEN_FDS protocol, as
 * systemd and systemd-socket-activate speak it.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "harness.h"
#include "opsd.h"

TestSuite(operations, .timeout = 60);

/* ------------------------------------------------------------------ */
/* Socket activation                                                   */
/* ------------------------------------------------------------------ */

/* A listening socket of `type` at path, as systemd's .socket unit makes it. */
static int listening_socket(const char *path, int type)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);

	cr_assert_geq(fd, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0, "bind %s: %s", path,
		     strerror(errno));
	cr_assert_eq(listen(fd, 16), 0);
	return fd;
}

Test(operations, socket_activated_daemon_serves_the_passed_socket)
{
	char base[64], sock[128];
	struct stat st;
	struct opd d;
	int fd;

	make_base(base, sizeof(base));
	snprintf(sock, sizeof(sock), "%s/activated.sock", base);
	fd = listening_socket(sock, SOCK_SEQPACKET);
	{
		/* No --socket: the passed socket's own path is the one served and announced. */
		const char *args[] = { "--log-level", "info", NULL };

		cr_assert_eq(opd_start(&d, args, fd, 0, sock), 0, "shardd did not start:\n%s",
			     d.log);
	}
	cr_assert_eq(client_run_ops(sock, "act"), 0, "a client of the activated daemon failed");
	opd_stop_clean(&d);
	/* systemd owns the socket: it outlives the daemon, and still accepts for the next one. */
	cr_assert_eq(lstat(sock, &st), 0, "shardd removed the socket systemd passed: %s\n%s",
		     strerror(errno), d.log);
	cr_assert(S_ISSOCK(st.st_mode));
	{
		const char *args[] = { NULL };

		cr_assert_eq(opd_start(&d, args, fd, 0, sock), 0, "second start:\n%s", d.log);
	}
	cr_assert_eq(client_run_ops(sock, "act2"), 0, "a client of the restarted daemon failed");
	opd_stop_clean(&d);
	close(fd);
	remove_tree(base);
}

Test(operations, socket_activation_with_a_stream_socket_is_refused)
{
	char base[64], sock[128];
	struct opd d;
	int fd, status;

	make_base(base, sizeof(base));
	snprintf(sock, sizeof(sock), "%s/stream.sock", base);
	fd = listening_socket(sock, SOCK_STREAM);
	cr_assert_eq(opd_start(&d, NULL, fd, 0, sock), -EPIPE, "shardd served a stream socket:\n%s",
		     d.log);
	status = opd_stop(&d);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 1, "%s", harness_status_str(status));
	cr_assert_not_null(strstr(d.log, "ListenSequentialPacket"), "%s", d.log);
	close(fd);
	remove_tree(base);
}
