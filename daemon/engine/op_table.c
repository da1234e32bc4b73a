/* SPDX-License-Identifier: MIT */
#include <stdio.h>

#include "op_table.h"

static const struct shd_op_info op_table[SHARDD_OP_COUNT] = {
	[SHARDD_OP_NOP] = {
		.name = "nop", .scope = SHD_OP_SCOPE_RING, .executor = SHD_OP_EXEC_DAEMON,
	},
	[SHARDD_OP_BARRIER] = {
		.name = "barrier", .scope = SHD_OP_SCOPE_JOB, .executor = SHD_OP_EXEC_DAEMON,
		.rendezvous = 1,
	},
	[SHARDD_OP_UNSHARD] = {
		.name = "unshard", .scope = SHD_OP_SCOPE_GROUP, .executor = SHD_OP_EXEC_DAEMON,
		.training_step = 1,
		.rendezvous = 1,
	},
	/* A reduce with SHARDD_REDUCE_STEP carries its step's lr. */
	[SHARDD_OP_REDUCE] = {
		.name = "reduce", .scope = SHD_OP_SCOPE_GROUP, .executor = SHD_OP_EXEC_DAEMON,
		.training_step = 1,
		.rendezvous = 1,
		.flags = SHARDD_REDUCE_FLAGS_MASK,
		.args_flag = SHARDD_REDUCE_STEP, .nargs_flagged = SHARDD_SQE_STEP_LR + 1,
	},
	[SHARDD_OP_RESHARD] = {
		.name = "reshard", .scope = SHD_OP_SCOPE_GROUP, .executor = SHD_OP_EXEC_DAEMON,
		.training_step = 1,
	},
	[SHARDD_OP_ZERO_GRAD] = {
		.name = "zero_grad", .scope = SHD_OP_SCOPE_GROUP, .executor = SHD_OP_EXEC_DAEMON,
	},
	/* Its learning rate and its clip word. */
	[SHARDD_OP_STEP] = {
		.name = "step", .scope = SHD_OP_SCOPE_GROUP, .executor = SHD_OP_EXEC_DAEMON,
		.flags = SHARDD_STEP_FLAGS_MASK, .nargs = SHARDD_SQE_STEP_CLIP + 1,
	},
	/* Its norm type. */
	[SHARDD_OP_GRAD_NORM] = {
		.name = "grad_norm", .scope = SHD_OP_SCOPE_JOB, .executor = SHD_OP_EXEC_DAEMON,
		.rendezvous = 1,
		.nargs = SHARDD_SQE_GRAD_NORM_TYPE + 1,
	},
	[SHARDD_OP_CHECKPOINT] = {
		.name = "checkpoint", .scope = SHD_OP_SCOPE_JOB, .executor = SHD_OP_EXEC_DAEMON,
		.rendezvous = 1,
	},
};

const struct shd_op_info *shd_op_info(uint32_t op)
{
	return op < SHARDD_OP_COUNT && op_table[op].name ? &op_table[op] : NULL;
}

int shd_op_carries_step(uint32_t op)
{
	const struct shd_op_info *o = shd_op_info(op);

	return o && o->training_step;
}

int shd_op_check(const struct shardd_sqe *sqe, char *err, size_t errlen)
{
	const struct shd_op_info *o = shd_op_info(sqe->op);
	uint32_t nargs;

	if (!o) {
		snprintf(err, errlen, "op %u is not a shardd op", sqe->op);
		return -SHARDD_E_INVALID;
	}
	for (int i = 0; i < (int)sizeof(sqe->rsvd0); i++) {
		if (sqe->rsvd0[i]) {
			snprintf(err, errlen, "sqe.rsvd0[%d] = 0x%x: reserved, must be 0", i,
				 sqe->rsvd0[i]);
			return -SHARDD_E_INVALID;
		}
	}
	if (sqe->rsvd1) {
		snprintf(err, errlen, "sqe.rsvd1 = 0x%x: reserved, must be 0", sqe->rsvd1);
		return -SHARDD_E_INVALID;
	}
	nargs = sqe->flags & o->args_flag ? o->nargs_flagged : o->nargs;
	for (uint32_t i = nargs; i < sizeof(sqe->arg) / sizeof(sqe->arg[0]); i++) {
		if (sqe->arg[i]) {
			snprintf(err, errlen, "sqe.arg[%u] = 0x%llx: reserved, must be 0", i,
				 (unsigned long long)sqe->arg[i]);
			return -SHARDD_E_INVALID;
		}
	}
	if (o->scope == SHD_OP_SCOPE_GROUP)
		return 0;
	if (sqe->group) {
		snprintf(err, errlen, "sqe.group = %u: must be 0 for %s", sqe->group, o->name);
		return -SHARDD_E_INVALID;
	}
	if (sqe->flags & ~o->flags) {
		snprintf(err, errlen, "sqe.flags = 0x%x: %s takes no flags", sqe->flags, o->name);
		return -SHARDD_E_INVALID;
	}
	return 0;
}
