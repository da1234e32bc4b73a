/* SPDX-License-Identifier: MIT */
/*
 * socket_path "" in the attach options means the default ($SHARDD_SOCKET).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdlib.h>

#include "harness.h"
#include "shardd.h"

TestSuite(operations, .timeout = 60);

/* ------------------------------------------------------------------ */
/* socket_path "" is the default                                        */
/* ------------------------------------------------------------------ */

Test(operations, empty_socket_path_means_the_default)
{
	struct harness_daemon hd = { 0 };
	struct shardd_attach_opts o = {
		.socket_path = "",
		.job = "empty",
		.rank = 0,
		.replicate = 1,
		.shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_client *c = NULL;
	int ret;

	cr_assert_eq(harness_daemon_start(&hd, NULL), 0, "shardd did not start");
	setenv("SHARDD_SOCKET", hd.socket, 1);
	ret = shardd_connect(&o, &c);
	unsetenv("SHARDD_SOCKET");
	cr_assert_eq(ret, 0, "socket_path \"\" did not mean $SHARDD_SOCKET: %s",
		     shardd_last_error());
	cr_assert_eq(shardd_nop(c), 0, "%s", shardd_last_error());
	shardd_close(c);
	harness_daemon_stop_expect_clean(&hd);
}
