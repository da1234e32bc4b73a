/* SPDX-License-Identifier: MIT */
/*
 * fuzz_engine: ring entries driving the op engine. One to three jobs are
 * attached first (meshes up to 2x3, one client per rank); then the input
 * registers and opens groups with fuzzed specs from several ranks, submits
 * ring entries with fuzzed op codes, group ids, flags, steps, fences and
 * reserved fields (alone, or the same op from every rank so that
 * collectives run), writes bytes into lent buffers, kills ranks and
 * re-attaches them, sends admin requests, and fires collective timeouts.
 * Invariants: fuzz_daemon.h.
 */
#include <stddef.h>
#include <stdint.h>

#include "fuzz_daemon.h"

static const enum fuzz_action actions[] = {
	FZ_REGISTER_ALL, FZ_REGISTER, FZ_OPEN,  FZ_SQE,      FZ_SQE,     FZ_SQE_BURST,
	FZ_SQE_BURST,    FZ_EXEC_MAP, FZ_CLOSE, FZ_REATTACH, FZ_GOODBYE, FZ_ADMIN,
	FZ_WRITE_BUF,    FZ_TURN,     FZ_CRON,  FZ_MSG,
};

const struct fuzz_target fuzz_target = {
	.name = "fuzz_engine",
	.actions = actions,
	.nactions = sizeof(actions) / sizeof(actions[0]),
	.attach_jobs = 3,
};
