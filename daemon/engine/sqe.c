/* SPDX-License-Identifier: MIT */
#include <stdio.h>

#include "sqe.h"

int shd_sqe_check(const struct shardd_sqe *sqe, char *why, size_t len)
{
	if (sqe->op == 0 || sqe->op >= SHARDD_OP_COUNT) {
		snprintf(why, len, "op %u is not a shardd op", sqe->op);
		return -1;
	}
	for (int i = 0; i < (int)sizeof(sqe->rsvd0); i++) {
		if (sqe->rsvd0[i]) {
			snprintf(why, len, "sqe.rsvd0[%d] = 0x%x: reserved, must be 0", i,
				 sqe->rsvd0[i]);
			return -1;
		}
	}
	if (sqe->rsvd1) {
		snprintf(why, len, "sqe.rsvd1 = 0x%x: reserved, must be 0", sqe->rsvd1);
		return -1;
	}
	/* step carries its learning rate and clip coefficient in arg[0..1], a reduce with STEP its lr. */
	for (int i = sqe->op == SHARDD_OP_STEP ? SHARDD_SQE_STEP_CLIP + 1 :
		     sqe->op == SHARDD_OP_REDUCE && (sqe->flags & SHARDD_REDUCE_STEP) ? SHARDD_SQE_STEP_LR + 1 :
		     sqe->op == SHARDD_OP_GRAD_NORM ? SHARDD_SQE_GRAD_NORM_TYPE + 1 : 0;
	     i < (int)(sizeof(sqe->arg) / sizeof(sqe->arg[0])); i++) {
		if (sqe->arg[i]) {
			snprintf(why, len, "sqe.arg[%d] = 0x%llx: reserved, must be 0", i,
				 (unsigned long long)sqe->arg[i]);
			return -1;
		}
	}
	if (sqe->op == SHARDD_OP_NOP || sqe->op == SHARDD_OP_BARRIER || sqe->op == SHARDD_OP_GRAD_NORM ||
	    sqe->op == SHARDD_OP_CHECKPOINT) {
		if (sqe->group) {
			snprintf(why, len, "sqe.group = %u: must be 0 for %s", sqe->group,
				 shardd_op_name(sqe->op));
			return -1;
		}
		if (sqe->flags) {
			snprintf(why, len, "sqe.flags = 0x%x: %s takes no flags", sqe->flags,
				 shardd_op_name(sqe->op));
			return -1;
		}
	}
	return 0;
}
