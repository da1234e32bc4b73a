/* SPDX-License-Identifier: MIT */
/*
 * fuzz_ctrl: the control plane. Clients connect, send datagrams (framed or
 * raw, with or without fds, split over several datagrams or not), HELLO with
 * valid and mutated fields, register and open groups, send admin requests,
 * say goodbye, hang up or die, while the daemon's loop turns and its crons
 * fire early. Invariants: fuzz_daemon.h.
 */
#include <stddef.h>
#include <stdint.h>

#include "fuzz_daemon.h"

static const enum fuzz_action actions[] = {
	FZ_CONNECT, FZ_HELLO, FZ_MSG,     FZ_RAW,  FZ_SPLIT, FZ_REGISTER, FZ_OPEN,  FZ_ADMIN,
	FZ_GOODBYE, FZ_CLOSE, FZ_SHUT_WR, FZ_TURN, FZ_CRON,  FZ_CONNECT,  FZ_HELLO, FZ_EXEC_MAP,
};

const struct fuzz_target fuzz_target = {
	.name = "fuzz_ctrl",
	.actions = actions,
	.nactions = sizeof(actions) / sizeof(actions[0]),
	.attach_jobs = 0,
};
