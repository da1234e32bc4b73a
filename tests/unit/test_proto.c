/* SPDX-License-Identifier: MIT */
/*
 * The wire layout, checked against offsets counted out by hand rather
 * than against the header's own _Static_asserts: a field moved in
 * shardd_proto.h breaks every client in another language, so it must
 * break this test. Also the names of dtypes, ops and error codes.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stddef.h>
#include <string.h>

#include "shardd.h"
#include "shardd_exec.h"
#include "shardd_ring.h"

#define OFF(type, field) offsetof(struct type, field)

Test(proto, msg_hdr_layout, .timeout = 5)
{
	cr_assert_eq(sizeof(struct shardd_msg_hdr), 16);
	cr_assert_eq(OFF(shardd_msg_hdr, magic), 0);
	cr_assert_eq(OFF(shardd_msg_hdr, type), 4);
	cr_assert_eq(OFF(shardd_msg_hdr, flags), 6);
	cr_assert_eq(OFF(shardd_msg_hdr, length), 8);
	cr_assert_eq(OFF(shardd_msg_hdr, seq), 12);
}

Test(proto, hello_layout, .timeout = 5)
{
	cr_assert_eq(sizeof(struct shardd_hello), 112);
	cr_assert_eq(OFF(shardd_hello, major), 0);
	cr_assert_eq(OFF(shardd_hello, minor), 2);
	cr_assert_eq(OFF(shardd_hello, pid), 4);
	cr_assert_eq(OFF(shardd_hello, job), 8);
	cr_assert_eq(OFF(shardd_hello, rank), 72);
	cr_assert_eq(OFF(shardd_hello, replicate), 76);
	cr_assert_eq(OFF(shardd_hello, shard), 80);
	cr_assert_eq(OFF(shardd_hello, device), 84);
	cr_assert_eq(OFF(shardd_hello, sq_entries), 88);
	cr_assert_eq(OFF(shardd_hello, flags), 92);
	cr_assert_eq(OFF(shardd_hello, rsvd), 96);
}

Test(proto, welcome_and_error_layout, .timeout = 5)
{
	cr_assert_eq(sizeof(struct shardd_welcome), 64);
	cr_assert_eq(OFF(shardd_welcome, major), 0);
	cr_assert_eq(OFF(shardd_welcome, minor), 2);
	cr_assert_eq(OFF(shardd_welcome, client_id), 4);
	cr_assert_eq(OFF(shardd_welcome, backend), 8);
	cr_assert_eq(OFF(shardd_welcome, sq_entries), 12);
	cr_assert_eq(OFF(shardd_welcome, cq_entries), 16);
	cr_assert_eq(OFF(shardd_welcome, daemon_pid), 20);
	cr_assert_eq(OFF(shardd_welcome, ring_size), 24);
	cr_assert_eq(OFF(shardd_welcome, collective_timeout_ms), 32);
	cr_assert_eq(OFF(shardd_welcome, rsvd0), 36);
	cr_assert_eq(OFF(shardd_welcome, rsvd), 40);

	cr_assert_eq(sizeof(struct shardd_error_msg), 8);
	cr_assert_eq(OFF(shardd_error_msg, code), 0);
	cr_assert_eq(OFF(shardd_error_msg, msg_len), 4);
}

Test(proto, group_messages_layout, .timeout = 5)
{
	cr_assert_eq(sizeof(struct shardd_param_spec), 160);
	cr_assert_eq(OFF(shardd_param_spec, name), 0);
	cr_assert_eq(OFF(shardd_param_spec, dtype), 80);
	cr_assert_eq(OFF(shardd_param_spec, ndim), 84);
	cr_assert_eq(OFF(shardd_param_spec, shard_dim), 88);
	cr_assert_eq(OFF(shardd_param_spec, flags), 92);
	cr_assert_eq(OFF(shardd_param_spec, shape), 96);

	cr_assert_eq(sizeof(struct shardd_register_group), 88);
	cr_assert_eq(OFF(shardd_register_group, name), 0);
	cr_assert_eq(OFF(shardd_register_group, nparams), 64);
	cr_assert_eq(OFF(shardd_register_group, param_dtype), 68);
	cr_assert_eq(OFF(shardd_register_group, reduce_dtype), 72);
	cr_assert_eq(OFF(shardd_register_group, init), 76);
	cr_assert_eq(OFF(shardd_register_group, flags), 80);
	cr_assert_eq(OFF(shardd_register_group, exec), 84);

	cr_assert_eq(sizeof(struct shardd_open_group), 64);

	cr_assert_eq(sizeof(struct shardd_param_layout), 64);
	cr_assert_eq(OFF(shardd_param_layout, unsharded_offset), 0);
	cr_assert_eq(OFF(shardd_param_layout, unsharded_bytes), 8);
	cr_assert_eq(OFF(shardd_param_layout, grad_offset), 16);
	cr_assert_eq(OFF(shardd_param_layout, grad_bytes), 24);
	cr_assert_eq(OFF(shardd_param_layout, shard_offset), 32);
	cr_assert_eq(OFF(shardd_param_layout, shard_bytes), 40);
	cr_assert_eq(OFF(shardd_param_layout, shard_row_begin), 48);
	cr_assert_eq(OFF(shardd_param_layout, shard_rows_valid), 56);

	cr_assert_eq(sizeof(struct shardd_group_reply), 80);
	cr_assert_eq(OFF(shardd_group_reply, group_id), 0);
	cr_assert_eq(OFF(shardd_group_reply, nparams), 4);
	cr_assert_eq(OFF(shardd_group_reply, param_dtype), 8);
	cr_assert_eq(OFF(shardd_group_reply, reduce_dtype), 12);
	cr_assert_eq(OFF(shardd_group_reply, grad_dtype), 16);
	cr_assert_eq(OFF(shardd_group_reply, shard_world), 20);
	cr_assert_eq(OFF(shardd_group_reply, unsharded_size), 24);
	cr_assert_eq(OFF(shardd_group_reply, grad_size), 32);
	cr_assert_eq(OFF(shardd_group_reply, shard_size), 40);
	cr_assert_eq(OFF(shardd_group_reply, export_kind), 48);
	cr_assert_eq(sizeof(((struct shardd_group_reply *)0)->export_kind), SHARDD_GROUP_BUFS);
	cr_assert_eq(OFF(shardd_group_reply, optimizer), 52);
	cr_assert_eq(OFF(shardd_group_reply, last_step), 56);
	cr_assert_eq(OFF(shardd_group_reply, peer_last_step), 64);
	cr_assert_eq(SHARDD_GROUP_REPLY_SIZE_V3, 64);
	cr_assert_eq(OFF(shardd_group_reply, exec), 72);
	cr_assert_eq(SHARDD_GROUP_REPLY_SIZE_V4, 72);
	cr_assert_eq(sizeof(struct shardd_exec_map), 8);
	cr_assert_eq(sizeof(struct shardd_exec_map_reply), 32);
	cr_assert_eq(OFF(shardd_exec_map_reply, shard_map_size), 16);
	cr_assert_eq(OFF(shardd_exec_sync, epoch), 64);
	cr_assert_eq(OFF(shardd_exec_sync, changes), 72);
	cr_assert_eq(OFF(shardd_exec_sync, gen), 128);
	cr_assert_eq(OFF(shardd_exec_slot, seq), 0);
	cr_assert_eq(OFF(shardd_exec_slot, step), 8);
	cr_assert_eq(OFF(shardd_exec_slot, op), 16);
	cr_assert_eq(OFF(shardd_exec_slot, what), 24);
	cr_assert_eq(OFF(shardd_exec_slot, done), 64);
	cr_assert_eq(OFF(shardd_exec_slot, unshards), 128);
	cr_assert_eq(OFF(shardd_exec_slot, gave_up), 152);
	cr_assert_eq(OFF(shardd_exec_slot, gave_up_step), 160);
	cr_assert_eq(OFF(shardd_exec_slot, cleared), 192);
	cr_assert_eq(OFF(shardd_exec_slot, wait_op), 256);
	cr_assert_eq(OFF(shardd_exec_slot, wait_since_ns), 264);
	cr_assert_eq(OFF(shardd_exec_slot, sleeping), 272);
	cr_assert_eq(shardd_exec_sync_size(1), 4096);
	cr_assert_eq(shardd_exec_sync_size(992), 4096);
	cr_assert_eq(shardd_exec_sync_size(993), 8192);
	cr_assert_eq(shardd_exec_slot_offset(1), 4096);
	cr_assert_eq(shardd_exec_slot_offset(4096), 4096);
	cr_assert_eq(shardd_exec_grad_map_size(4097), 12288);
	cr_assert(shardd_exec_reached(shardd_exec_word(3, 7), 3, 7));
	cr_assert(shardd_exec_reached(shardd_exec_word(3, 8), 3, 7), "a peer one op ahead");
	cr_assert(!shardd_exec_reached(shardd_exec_word(3, 6), 3, 7));
	cr_assert(!shardd_exec_reached(shardd_exec_word(2, 9), 3, 7), "another epoch");
	cr_assert_eq(sizeof(struct shardd_optim_config), 72);
	cr_assert_eq(sizeof(struct shardd_cuda_ipc_handle), 64);
}

Test(proto, sqe_and_cqe_layout, .timeout = 5)
{
	cr_assert_eq(sizeof(struct shardd_sqe), 64);
	cr_assert_eq(OFF(shardd_sqe, op), 0);
	cr_assert_eq(OFF(shardd_sqe, fence), 1);
	cr_assert_eq(OFF(shardd_sqe, rsvd0), 2);
	cr_assert_eq(OFF(shardd_sqe, group), 4);
	cr_assert_eq(OFF(shardd_sqe, step), 8);
	cr_assert_eq(OFF(shardd_sqe, user_data), 16);
	cr_assert_eq(OFF(shardd_sqe, flags), 24);
	cr_assert_eq(OFF(shardd_sqe, rsvd1), 28);
	cr_assert_eq(OFF(shardd_sqe, arg), 32);

	cr_assert_eq(sizeof(struct shardd_cqe), 64);
	cr_assert_eq(OFF(shardd_cqe, user_data), 0);
	cr_assert_eq(OFF(shardd_cqe, res), 8);
	cr_assert_eq(OFF(shardd_cqe, op), 12);
	cr_assert_eq(OFF(shardd_cqe, has_msg), 13);
	cr_assert_eq(OFF(shardd_cqe, fence), 14);
	cr_assert_eq(OFF(shardd_cqe, rsvd0), 15);
	cr_assert_eq(OFF(shardd_cqe, group), 16);
	cr_assert_eq(OFF(shardd_cqe, rsvd1), 20);
	cr_assert_eq(OFF(shardd_cqe, step), 24);
	cr_assert_eq(OFF(shardd_cqe, result), 32);
}

Test(proto, ring_header_layout_puts_each_writer_on_its_own_line, .timeout = 5)
{
	cr_assert_eq(sizeof(struct shardd_ring_hdr), 512);
	cr_assert_eq(OFF(shardd_ring_hdr, magic), 0);
	cr_assert_eq(OFF(shardd_ring_hdr, version), 4);
	cr_assert_eq(OFF(shardd_ring_hdr, sq_entries), 8);
	cr_assert_eq(OFF(shardd_ring_hdr, cq_entries), 12);
	cr_assert_eq(OFF(shardd_ring_hdr, sq_off), 16);
	cr_assert_eq(OFF(shardd_ring_hdr, cq_off), 20);
	cr_assert_eq(OFF(shardd_ring_hdr, msg_off), 24);
	cr_assert_eq(OFF(shardd_ring_hdr, msg_size), 28);
	cr_assert_eq(OFF(shardd_ring_hdr, region_size), 32);
	cr_assert_eq(OFF(shardd_ring_hdr, daemon_pid), 40);
	cr_assert_eq(OFF(shardd_ring_hdr, client_id), 44);
	cr_assert_eq(OFF(shardd_ring_hdr, sq_head), 64);
	cr_assert_eq(OFF(shardd_ring_hdr, sq_tail), 128);
	cr_assert_eq(OFF(shardd_ring_hdr, cq_head), 192);
	cr_assert_eq(OFF(shardd_ring_hdr, cq_waiters), 196);
	cr_assert_eq(OFF(shardd_ring_hdr, cq_tail), 256);
	cr_assert_eq(OFF(shardd_ring_hdr, flags), 320);
	cr_assert_eq(OFF(shardd_ring_hdr, daemon_last_op), 324);
	cr_assert_eq(OFF(shardd_ring_hdr, daemon_last_step), 328);
	cr_assert_eq(OFF(shardd_ring_hdr, daemon_heartbeat_ns), 336);
	cr_assert_eq(OFF(shardd_ring_hdr, client_last_op), 384);
	cr_assert_eq(OFF(shardd_ring_hdr, rsvd6), 388);
	cr_assert_eq(OFF(shardd_ring_hdr, client_last_step), 392);
	cr_assert_eq(OFF(shardd_ring_hdr, pad7), 448);
}

Test(proto, constants_have_their_documented_values, .timeout = 5)
{
	uint32_t magic = SHARDD_MAGIC, ring_magic = SHARDD_RING_MAGIC;

	/* Little-endian bytes spell the names, as a hex dump of a socket shows them. */
	cr_assert_eq(memcmp(&magic, "SHRD", 4), 0);
	cr_assert_eq(memcmp(&ring_magic, "RING", 4), 0);
	cr_assert_eq(SHARDD_PROTO_MAJOR, 1);
	cr_assert_eq(SHARDD_NAME_MAX, 64);
	cr_assert_eq(SHARDD_PARAM_NAME_MAX, 80);
	cr_assert_eq(SHARDD_MAX_DIMS, 8);
	cr_assert_eq(SHARDD_ALIGN, 64);
	cr_assert_eq(SHARDD_RING_MSG_SIZE, 256);
	cr_assert_eq(SHARDD_CTRL_CHUNK, 61440);
	cr_assert_eq(SHARDD_HELLO_DEVICE_HOST, -1);
	cr_assert_eq(SHARDD_DTYPE_FP32, 1);
	cr_assert_eq(SHARDD_DTYPE_BF16, 2);
	cr_assert_eq(SHARDD_DTYPE_FP16, 3);
	cr_assert_eq(SHARDD_OP_NOP, 1);
	cr_assert_eq(SHARDD_OP_BARRIER, 2);
	cr_assert_eq(SHARDD_OP_UNSHARD, 3);
	cr_assert_eq(SHARDD_OP_REDUCE, 4);
	cr_assert_eq(SHARDD_OP_RESHARD, 5);
	cr_assert_eq(SHARDD_OP_ZERO_GRAD, 6);
	cr_assert_eq(SHARDD_MSG_HELLO, 1);
	cr_assert_eq(SHARDD_MSG_WELCOME, 2);
	cr_assert_eq(SHARDD_MSG_ERROR, 3);
	cr_assert_eq(SHARDD_MSG_GOODBYE, 4);
	cr_assert_eq(SHARDD_MSG_REGISTER_GROUP, 5);
	cr_assert_eq(SHARDD_MSG_OPEN_GROUP, 6);
	cr_assert_eq(SHARDD_MSG_GROUP, 7);
	cr_assert_eq(SHARDD_GROUP_BUFS, 4);
	/* Zero is an fd: the host backend's replies keep the meaning they had before the field. */
	cr_assert_eq(SHARDD_EXPORT_FD, 0);
	cr_assert_eq(SHARDD_EXPORT_CUDA_IPC, 1);
	cr_assert_eq(SHARDD_E_MAGIC, 1001);
	cr_assert_eq(SHARDD_E_NOJOB, 1016);
	/* Project codes must never collide with an errno. */
	cr_assert_gt(SHARDD_E_BASE, EHWPOISON);
}

Test(proto, dtype_sizes_and_names, .timeout = 5)
{
	cr_assert_eq(shardd_dtype_size(SHARDD_DTYPE_FP32), 4);
	cr_assert_eq(shardd_dtype_size(SHARDD_DTYPE_BF16), 2);
	cr_assert_eq(shardd_dtype_size(SHARDD_DTYPE_FP16), 2);
	cr_assert_eq(shardd_dtype_size(SHARDD_DTYPE_NONE), 0);
	cr_assert_eq(shardd_dtype_size(SHARDD_DTYPE_COUNT), 0);
	cr_assert_eq(shardd_dtype_size(9), 0);
	cr_assert_str_eq(shardd_dtype_name(SHARDD_DTYPE_NONE), "none");
	cr_assert_str_eq(shardd_dtype_name(SHARDD_DTYPE_FP32), "fp32");
	cr_assert_str_eq(shardd_dtype_name(SHARDD_DTYPE_BF16), "bf16");
	cr_assert_str_eq(shardd_dtype_name(SHARDD_DTYPE_FP16), "fp16");
	cr_assert_null(shardd_dtype_name(SHARDD_DTYPE_COUNT));
	cr_assert_null(shardd_dtype_name(UINT32_MAX));
}

Test(proto, op_names, .timeout = 5)
{
	static const char *const want[] = {
		NULL,      "nop",       "barrier", "unshard",   "reduce",
		"reshard", "zero_grad", "step",    "grad_norm", "checkpoint",
	};

	cr_assert_eq(SHARDD_OP_STEP, 7);
	cr_assert_eq(SHARDD_OP_GRAD_NORM, 8);
	cr_assert_eq(SHARDD_OP_CHECKPOINT, 9);
	cr_assert_eq(SHARDD_OP_COUNT, 10);
	for (uint32_t op = 1; op < SHARDD_OP_COUNT; op++)
		cr_assert_str_eq(shardd_op_name(op), want[op], "op %u", op);
	cr_assert_null(shardd_op_name(0));
	cr_assert_null(shardd_op_name(SHARDD_OP_COUNT));
}

Test(proto, ring_region_size_is_header_entries_and_text_slots, .timeout = 5)
{
	/* 512 header + 4 SQEs * 64 + 8 CQEs * 64 + 8 text slots * 256 */
	cr_assert_eq(shardd_ring_region_size(4, 8), 3328);
	cr_assert_eq(shardd_ring_region_size(1024, 1024), 512 + 65536 + 65536 + 262144);
}

Test(proto, strerror_names_every_project_code_distinctly, .timeout = 5)
{
	const char *seen[SHARDD_E_MAX - SHARDD_E_BASE] = { 0 };

	for (int e = SHARDD_E_BASE + 1; e < SHARDD_E_MAX; e++) {
		const char *s = shardd_strerror(-e);

		cr_assert_not_null(s);
		cr_assert_gt(strlen(s), 5, "code %d", e);
		cr_assert_null(strstr(s, "unknown error"), "code %d has no text: %s", e, s);
		cr_assert_str_eq(shardd_strerror(e), s, "positive code %d", e);
		for (int k = 0; k < e - SHARDD_E_BASE - 1; k++)
			cr_assert_str_neq(seen[k], s, "codes %d and %d share '%s'",
					  SHARDD_E_BASE + 1 + k, e, s);
		seen[e - SHARDD_E_BASE - 1] = s;
	}
}

Test(proto, strerror_of_errno_and_of_unknown_codes, .timeout = 5)
{
	cr_assert_str_eq(shardd_strerror(0), "success");
	cr_assert_str_eq(shardd_strerror(-ENOENT), "No such file or directory");
	cr_assert_str_eq(shardd_strerror(-ECONNRESET), "Connection reset by peer");
	cr_assert_str_eq(shardd_strerror(-ETIMEDOUT), "Connection timed out");
	cr_assert_str_eq(shardd_strerror(-SHARDD_E_BASE), "unknown error -1000");
	cr_assert_str_eq(shardd_strerror(-SHARDD_E_MAX), "unknown error -1017");
	cr_assert_str_eq(shardd_strerror(-900), "unknown error -900");
	cr_assert_str_eq(shardd_strerror(INT32_MIN), "unknown error -2147483648");
}

Test(proto, last_error_starts_empty_and_keeps_context, .timeout = 5)
{
	struct shardd_attach_opts o = { .socket_path = "/nonexistent/dir/shardd.sock",
					.job = "j",
					.rank = 0,
					.replicate = 1,
					.shard = 1,
					.device = SHARDD_HELLO_DEVICE_HOST };
	struct shardd_client *c = NULL;

	cr_assert_str_eq(shardd_last_error(), "");
	cr_assert_eq(shardd_connect(&o, &c), -ENOENT);
	cr_assert_null(c);
	cr_assert_not_null(strstr(shardd_last_error(), "attach job 'j' rank 0 (mesh 1x1) at "
						       "/nonexistent/dir/shardd.sock: connect to"),
			   "%s", shardd_last_error());
	cr_assert_not_null(strstr(shardd_last_error(), "is shardd running?"), "%s",
			   shardd_last_error());
}

Test(proto, connect_rejects_overlong_names_before_touching_the_socket, .timeout = 5)
{
	char job[SHARDD_NAME_MAX + 1], path[200];
	struct shardd_attach_opts o = { .job = job, .replicate = 1, .shard = 1 };
	struct shardd_client *c = NULL;

	memset(job, 'j', sizeof(job) - 1);
	job[sizeof(job) - 1] = '\0';
	cr_assert_eq(shardd_connect(&o, &c), -EINVAL);
	cr_assert_not_null(strstr(shardd_last_error(), "job name too long"), "%s",
			   shardd_last_error());
	memset(path, 'p', sizeof(path) - 1);
	path[sizeof(path) - 1] = '\0';
	o.job = "j";
	o.socket_path = path;
	cr_assert_eq(shardd_connect(&o, &c), -ENAMETOOLONG);
	cr_assert_not_null(strstr(shardd_last_error(), "is 199 bytes, the limit is 107"), "%s",
			   shardd_last_error());
}
