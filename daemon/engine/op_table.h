/* SPDX-License-Identifier: MIT */
/*
 * What an op is: one entry per enum shardd_op (proto/shardd_proto.h) with
 * its name, its scope (who completes it), who runs its work, the flags it
 * takes and which sqe.arg words it reads. Pure data and the one check of
 * a ring entry against it. The ring service (session/ring.c) runs that
 * check on every entry it takes and routes by scope; the engine reads the
 * table for its dispatch and names and trusts what the ring gave it.
 */
#ifndef SHD_OP_TABLE_H
#define SHD_OP_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "shardd_proto.h"

/* Where an op completes; the ring service routes an entry by it. */
enum shd_op_scope {
	SHD_OP_SCOPE_RING = 1, /* in the ring service, at once (nop); sqe.group 0 */
	SHD_OP_SCOPE_JOB,      /* over every rank of the job (session/job.c); sqe.group 0 */
	SHD_OP_SCOPE_GROUP,    /* on the registered group sqe.group names (the engine) */
};

/* Who runs an op's work. */
enum shd_op_executor {
	SHD_OP_EXEC_DAEMON = 1, /* the daemon: its loop thread, its pool, its backend */
};

struct shd_op_info {
	const char *name;       /* as shardd_op_name spells it, for every message */
	uint8_t scope;          /* enum shd_op_scope */
	uint8_t executor;       /* enum shd_op_executor */
	uint8_t rendezvous;     /* runs when every rank of its set arrived with the same key */
	uint8_t training_step;  /* sqe.step is the training step the rank is at (what the
				   reports show as its progress); other ops carry 0, their own
				   number (barrier) or a step they act on */
	uint32_t flags;         /* the sqe.flags bits it takes */
	uint32_t nargs;         /* sqe.arg[0 .. nargs - 1] may be nonzero, the rest must be 0 */
	uint32_t args_flag;     /* with one of these sqe.flags bits set ... */
	uint32_t nargs_flagged; /* ... sqe.arg[0 .. nargs_flagged - 1] may be nonzero instead */
};

/* The entry of `op` (any value, a client's): NULL when it is not a shardd op. */
const struct shd_op_info *shd_op_info(uint32_t op);

/* Does `op` carry the training step a rank is at (shd_op_info's training_step; 0 for a non-op)? */
int shd_op_carries_step(uint32_t op);

/*
 * What a ring entry must be, from the table: a shardd op, reserved fields
 * zero, arg words the op does not read zero, and an op outside a group
 * with no group and no flags. Returns 0, or -SHARDD_E_INVALID with `err`
 * naming the field and its value. What depends on the group an entry names (that it is
 * registered, the flags of a group op, named with the group) is the
 * engine's to check.
 */
int shd_op_check(const struct shardd_sqe *sqe, char *err, size_t errlen);

#endif /* SHD_OP_TABLE_H */
