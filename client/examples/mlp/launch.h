/* SPDX-License-Identifier: MIT */
/*
 * The launcher of train_mlp: its command line, and --spawn N, a supervisor
 * that forks N rank processes (trainer.h), watches them through pidfds,
 * takes their loss reports through a pipe and prints each step's mean loss
 * over the ranks ("step N loss X") once every rank reported it. With
 * hooks that restart a dead rank, it restarts it into the retry the other
 * ranks wait in (launch_hooks.restart).
 */
#ifndef SHARDD_EXAMPLE_MLP_LAUNCH_H
#define SHARDD_EXAMPLE_MLP_LAUNCH_H

#include <stdint.h>

#include "trainer.h"

#define MLP_DEFAULT_STEPS 20
#define MLP_DEFAULT_JOB   "train_mlp"

struct launch_opts {
	uint32_t spawn;        /* --spawn N: supervisor of N ranks; 0: not */
	int reference;         /* --reference */
	int64_t rank;          /* --rank R; -1: not given */
	struct trainer_opts t; /* the rest: what each rank trains (t.world = N with --spawn) */
};

/* Parse train_mlp's command line (--help prints the usage and exits). 0 or -EINVAL, printed. */
int launch_opts_parse(int argc, char **argv, struct launch_opts *o);

/* What a caller of launch_spawn adds to the run: the tests' fault injection. */
struct launch_hooks {
	const struct rank_hooks *rank; /* every rank's hooks; NULL: none */
	/*
	 * Rank `rank` ended with wait status `status` (not a clean exit) while
	 * the run had not failed yet: 1 to start it once more with the options
	 * in *ro (the run's, to be changed), 0 to fail the run. Asked each time
	 * a rank ends so. NULL: never restart.
	 *
	 * A rank to restart is started once every other running rank reported
	 * the retry its death caused (struct loss_report, attempt > 0), with
	 * ro->resume_step and ro->attempt set to the step and attempt they all
	 * wait in; with no other rank running, ro->resume_step is
	 * MLP_RESUME_OWN.
	 */
	int (*restart)(void *arg, uint32_t rank, int status, struct trainer_opts *ro);
	void *arg;
};

/*
 * Fork o->world ranks and supervise them until every one exited; `hooks`
 * may be NULL. 0 when every rank exited cleanly and reported every step,
 * else -1 (every failure printed).
 */
int launch_spawn(const struct trainer_opts *o, const struct launch_hooks *hooks);

#endif /* SHARDD_EXAMPLE_MLP_LAUNCH_H */
