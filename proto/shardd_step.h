/* SPDX-License-Identifier: MIT */
/*
 * The fields of a step that its submitter can get wrong, checked in one
 * place: by the daemon when a STEP, or a REDUCE with SHARDD_REDUCE_STEP,
 * is submitted to it, and by libshardd when a rank-executed reduce that
 * asks for its step is submitted (refused before it waits for its peers,
 * as the daemon refuses it before its rendezvous), in the same words.
 */
#ifndef SHARDD_STEP_H
#define SHARDD_STEP_H

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "shardd_proto.h"

/*
 * A step of group `group` (registered with optimizer `optimizer`, enum
 * shardd_optim_kind) as submitted: `op` (SHARDD_OP_STEP, or
 * SHARDD_OP_REDUCE with SHARDD_REDUCE_STEP), its step number, flags and
 * sqe.arg[0..1]. 0, or -SHARDD_E_STATE (no optimizer) or
 * -SHARDD_E_INVALID (the field and value named) with the message in err.
 */
static inline int shardd_step_check(uint32_t op, const char *group, uint32_t optimizer,
				    uint64_t step, uint32_t flags, const uint64_t arg[2], char *err,
				    size_t errlen)
{
	const char *name = shardd_op_name(op);
	unsigned long long n = (unsigned long long)step;
	double lr, clip = 1, max_norm = 1;

	memcpy(&lr, &arg[SHARDD_SQE_STEP_LR], sizeof(lr));
	if (op == SHARDD_OP_STEP && (flags & SHARDD_STEP_CLIP))
		memcpy(&clip, &arg[SHARDD_SQE_STEP_CLIP], sizeof(clip));
	if (op == SHARDD_OP_STEP && (flags & SHARDD_STEP_CLIP_JOB))
		memcpy(&max_norm, &arg[SHARDD_SQE_STEP_CLIP], sizeof(max_norm));
	if (optimizer == SHARDD_OPTIM_NONE) {
		snprintf(err, errlen,
			 "shardd: %s(group '%s'): the group was registered without an optimizer; "
			 "register it with one (SHARDD_REGISTER_OPTIMIZER) or update its shards in "
			 "the trainer",
			 name, group);
		return -SHARDD_E_STATE;
	}
	if (step == 0)
		snprintf(err, errlen, "shardd: %s(group '%s'): step = 0; steps are numbered from 1",
			 name, group);
	else if (!(lr >= 0) || lr > 1e300)
		snprintf(err, errlen,
			 "shardd: %s(group '%s', step %llu): lr = %g; the learning rate must be "
			 "finite and >= 0",
			 name, group, n, lr);
	else if ((flags & SHARDD_STEP_CLIP) && (flags & SHARDD_STEP_CLIP_JOB))
		snprintf(
			err, errlen,
			"shardd: %s(group '%s', step %llu): flags = 0x%x has both SHARDD_STEP_CLIP "
			"(a coefficient) and SHARDD_STEP_CLIP_JOB (max_norm): give one",
			name, group, n, flags);
	else if ((flags & SHARDD_STEP_CLIP_JOB) && !(max_norm > 0 && isfinite(max_norm)))
		snprintf(err, errlen,
			 "shardd: %s(group '%s', step %llu): max_norm = %g (sqe.arg[%d] with "
			 "SHARDD_STEP_CLIP_JOB); it must be finite and > 0",
			 name, group, n, max_norm, SHARDD_SQE_STEP_CLIP);
	else if (!(clip >= 0) || clip > 1e30)
		snprintf(err, errlen,
			 "shardd: %s(group '%s', step %llu): clip coefficient = %g; it must be "
			 "finite and >= 0 (clip_grad_norm_'s max_norm / (total_norm + 1e-6), at "
			 "most 1)",
			 name, group, n, clip);
	else if (op == SHARDD_OP_STEP && !(flags & (SHARDD_STEP_CLIP | SHARDD_STEP_CLIP_JOB)) &&
		 arg[SHARDD_SQE_STEP_CLIP])
		snprintf(err, errlen,
			 "shardd: %s(group '%s', step %llu): sqe.arg[%d] = 0x%llx without "
			 "SHARDD_STEP_CLIP or SHARDD_STEP_CLIP_JOB: set a flag or leave it 0",
			 name, group, n, SHARDD_SQE_STEP_CLIP,
			 (unsigned long long)arg[SHARDD_SQE_STEP_CLIP]);
	else
		return 0;
	return -SHARDD_E_INVALID;
}

#endif
