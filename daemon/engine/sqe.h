/* SPDX-License-Identifier: MIT */
/*
 * What a ring entry must be. One check, run by the ring service on every
 * entry it takes (ring.c) and again at the engine's door
 * (shd_engine_submit), so both say the same about the same entry.
 */
#ifndef SHD_SQE_H
#define SHD_SQE_H

#include <stddef.h>

#include "shardd_proto.h"

/*
 * A shardd op, reserved fields zero, nop and barrier with no group and no
 * flags. Returns 0, or -1 with `why` naming the field and its value. What
 * depends on the op's group (flags of group ops, the group id) is the
 * engine's to check.
 */
int shd_sqe_check(const struct shardd_sqe *sqe, char *why, size_t len);

#endif /* SHD_SQE_H */
