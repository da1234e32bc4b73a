/* SPDX-License-Identifier: MIT */
/*
 * libshardd's check of how a GROUP reply's buffers travel
 * (shardd_group_check_exports, client/group.c): export kinds, the fds that
 * came with the reply and the CUDA IPC handles after its param specs must
 * agree, and each mismatch is an error that names the field and the value.
 * No daemon: the replies are built here, as a faulty or hostile daemon
 * could send them.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "internal.h"

#define HANDLE ((size_t)sizeof(struct shardd_cuda_ipc_handle))

static struct shardd_group_reply reply_with(uint8_t k0, uint8_t k1, uint8_t k2, uint8_t k3)
{
	struct shardd_group_reply r;

	memset(&r, 0, sizeof(r));
	r.export_kind[0] = k0;
	r.export_kind[1] = k1;
	r.export_kind[2] = k2;
	r.export_kind[3] = k3;
	return r;
}

/* The check fails with -SHARDD_E_MALFORMED and an error that contains `want`. */
static void expect_malformed(int ret, const char *want)
{
	cr_assert_eq(ret, -SHARDD_E_MALFORMED, "want -SHARDD_E_MALFORMED, got %d (%s)", ret,
		     shardd_last_error());
	cr_assert_not_null(strstr(shardd_last_error(), want), "the error '%s' does not say '%s'",
			   shardd_last_error(), want);
}

Test(client_group, host_reply_of_four_fds_and_no_handles_is_accepted, .timeout = 5)
{
	struct shardd_group_reply r = reply_with(0, 0, 0, 0);

	cr_assert_eq(shardd_group_check_exports(&r, SHARDD_BACKEND_HOST, 4, 0), 0, "%s",
		     shardd_last_error());
}

Test(client_group, cuda_reply_mixing_fds_and_ipc_handles_counts_its_handles, .timeout = 5)
{
	struct shardd_group_reply r = reply_with(SHARDD_EXPORT_CUDA_IPC, SHARDD_EXPORT_FD,
						 SHARDD_EXPORT_CUDA_IPC, SHARDD_EXPORT_FD);
	struct shardd_group_reply all = reply_with(1, 1, 1, 1);

	cr_assert_eq(shardd_group_check_exports(&r, SHARDD_BACKEND_CUDA, 2, 2 * HANDLE), 2, "%s",
		     shardd_last_error());
	cr_assert_eq(shardd_group_check_exports(&all, SHARDD_BACKEND_CUDA, 0, 4 * HANDLE), 4, "%s",
		     shardd_last_error());
}

Test(client_group, unknown_export_kind_is_malformed_naming_the_field_and_value, .timeout = 5)
{
	struct shardd_group_reply r = reply_with(0, 0, 2, 0);

	expect_malformed(shardd_group_check_exports(&r, SHARDD_BACKEND_CUDA, 3, 0),
			 "export_kind[2] = 2 is not an export kind");
	r = reply_with(0, 0, 0, 255);
	expect_malformed(shardd_group_check_exports(&r, SHARDD_BACKEND_HOST, 4, 0),
			 "export_kind[3] = 255");
}

Test(client_group, ipc_handle_from_a_host_backend_is_malformed, .timeout = 5)
{
	struct shardd_group_reply r = reply_with(SHARDD_EXPORT_CUDA_IPC, 0, 0, 0);

	expect_malformed(shardd_group_check_exports(&r, SHARDD_BACKEND_HOST, 3, HANDLE),
			 "export_kind[0] = 1 (cuda ipc) for the unsharded buffer, but the daemon's "
			 "backend is 1, not cuda");
}

Test(client_group, fds_that_do_not_number_the_fd_buffers_are_malformed, .timeout = 5)
{
	struct shardd_group_reply r = reply_with(SHARDD_EXPORT_CUDA_IPC, 0, 0, 0);

	expect_malformed(
		shardd_group_check_exports(&r, SHARDD_BACKEND_CUDA, 4, HANDLE),
		"carries 4 fds, but its export_kind {1, 0, 0, 0} says 3 buffers travel as fds");
	r = reply_with(0, 0, 0, 0);
	expect_malformed(shardd_group_check_exports(&r, SHARDD_BACKEND_HOST, 0, 0),
			 "carries 0 fds");
}

Test(client_group, handle_bytes_that_do_not_match_the_ipc_buffers_are_malformed, .timeout = 5)
{
	struct shardd_group_reply r =
		reply_with(SHARDD_EXPORT_CUDA_IPC, SHARDD_EXPORT_CUDA_IPC, 0, 0);

	expect_malformed(
		shardd_group_check_exports(&r, SHARDD_BACKEND_CUDA, 2, HANDLE),
		"64 bytes after its param specs, but its export_kind {1, 1, 0, 0} says 2 CUDA "
		"IPC handles of 64 bytes follow");
	expect_malformed(shardd_group_check_exports(&r, SHARDD_BACKEND_CUDA, 2, 2 * HANDLE + 1),
			 "129 bytes after");
	/* A host reply with trailing bytes is as malformed as one with handles it cannot use. */
	r = reply_with(0, 0, 0, 0);
	expect_malformed(shardd_group_check_exports(&r, SHARDD_BACKEND_HOST, 4, HANDLE),
			 "says 0 CUDA IPC handles");
}
