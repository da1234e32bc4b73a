/* SPDX-License-Identifier: MIT */
/*
 * train_mlp_faults: train_mlp --spawn with a planned crash in the middle of
 * a reduce, for tests/integration/test_train.c. It is train_mlp's launcher
 * (client/examples/mlp/) with two hooks, so the example carries no fault
 * injection of its own.
 *
 *   train_mlp_faults --kill-rank R --kill-step T --spawn N [train_mlp's options]
 *
 * At step T every rank meets at a barrier, the others after submitting
 * their reduce of fc0; rank R then raises SIGKILL instead of submitting it.
 * The survivors' reduce fails naming rank R, the launcher restarts rank R
 * with --resume-step T (attempt 1), and every rank retries step T.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "launch.h"
#include "model.h"
#include "shardd.h"
#include "trainer.h"

struct faults {
	int64_t kill_rank;     /* --kill-rank R; -1: not given */
	int64_t kill_step;     /* --kill-step T; -1: not given */
};

/*
 * In place of the reduce of fc0 at attempt 0 of step T. Every rank meets at
 * barrier `key` (the reduce's own key) first, the survivors after
 * submitting their reduce: the daemon takes a ring's entries in order, so
 * once the barrier completes it holds every survivor's arrival in that
 * reduce, and rank R dies while they wait in it. Without the barrier a
 * survivor could submit after the daemon noticed the death and wait for the
 * collective timeout instead. A restarted rank R joins at attempt 1, so the
 * point never fires in it.
 */
static int kill_point(struct rank *rk, uint64_t t, uint32_t attempt, uint32_t layer, uint64_t key,
		      void *arg)
{
	const struct faults *f = arg;
	int armed = (int64_t)rank_id(rk) == f->kill_rank;

	if (layer != 0 || attempt != 0 || (int64_t)t != f->kill_step)
		return 0;
	if (!armed && rank_submit(rk, SHARDD_OP_REDUCE, 0, key, 0) < 0)
		return -1;
	if (rank_sync_op(rk, SHARDD_OP_BARRIER, MLP_LAYERS, key) < 0)
		return -1;
	if (armed) {
		fprintf(stderr, "train_mlp: rank %u: raising SIGKILL instead of reduce(group '%s', step %" PRIu64 ")\n",
			rank_id(rk), mlp_group_names[0], key);
		fflush(NULL);
		raise(SIGKILL);
	}
	return 1;
}

/* The launcher starts rank R again when it died as planned, to join the retry of step T. */
static int restart_killed(void *arg, uint32_t rank, int status, struct trainer_opts *ro)
{
	const struct faults *f = arg;

	if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL || (int64_t)rank != f->kill_rank)
		return 0;
	fprintf(stderr, "train_mlp: rank %u killed itself (SIGKILL) at step %" PRId64
		" as planned; restarting it with --resume-step %" PRId64 "\n",
		rank, f->kill_step, f->kill_step);
	ro->resume_step = f->kill_step;
	ro->attempt = 1;
	return 1;
}

static int parse_flag(const char *s, const char *what, uint64_t max, int64_t *out)
{
	char *end;
	unsigned long long v;

	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || end == s || *end || s[0] == '-' || v > max) {
		fprintf(stderr, "train_mlp_faults: %s '%s' is not an integer in 0..%" PRIu64 "\n",
			what, s, max);
		return -EINVAL;
	}
	*out = (int64_t)v;
	return 0;
}

int main(int argc, char **argv)
{
	struct faults f = { .kill_rank = -1, .kill_step = -1 };
	const struct rank_hooks rh = { .before_reduce = kill_point, .arg = &f };
	const struct launch_hooks lh = { .rank = &rh, .restart = restart_killed, .arg = &f };
	struct launch_opts o;
	char **rest = calloc((size_t)argc + 1, sizeof(*rest));
	int nrest = 0, ret = 2;

	if (!rest) {
		fprintf(stderr, "train_mlp_faults: out of memory\n");
		return 1;
	}
	/* Take the two flags of ours out; the launcher parses the rest. */
	rest[nrest++] = argv[0];
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--kill-rank") && i + 1 < argc) {
			if (parse_flag(argv[++i], "--kill-rank", SHARDD_MAX_WORLD - 1, &f.kill_rank))
				goto out;
		} else if (!strcmp(argv[i], "--kill-step") && i + 1 < argc) {
			if (parse_flag(argv[++i], "--kill-step", 1u << 24, &f.kill_step))
				goto out;
		} else {
			rest[nrest++] = argv[i];
		}
	}
	if (launch_opts_parse(nrest, rest, &o) < 0)
		goto out;
	if (f.kill_rank < 0 || f.kill_step < 0 || !o.spawn) {
		fprintf(stderr, "train_mlp_faults: give --kill-rank R --kill-step T with --spawn N\n");
		goto out;
	}
	if (f.kill_rank >= (int64_t)o.t.world || (uint64_t)f.kill_step >= o.t.steps) {
		fprintf(stderr, "train_mlp_faults: --kill-rank %" PRId64 " --kill-step %" PRId64
			" must name a rank below %u and a step below --steps %" PRIu64 "\n",
			f.kill_rank, f.kill_step, o.t.world, o.t.steps);
		goto out;
	}
	ret = launch_spawn(&o.t, &lh) < 0 ? 1 : 0;
out:
	free(rest);
	return ret;
}
