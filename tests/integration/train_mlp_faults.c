/* SPDX-License-Identifier: MIT */
/*
 * train_mlp_faults: train_mlp --spawn with a planned crash or pause, for
 * tests/integration/test_train.c, test_step_kill.c and test_step_pause.c.
 * It is train_mlp's launcher (client/examples/mlp/) with hooks, so the
 * example carries no fault injection of its own.
 *
 *   train_mlp_faults --kill-rank R --kill-step T --spawn N [train_mlp's options]
 *
 * At step T every rank meets at a barrier, the others after submitting
 * their reduce of fc0; rank R then raises SIGKILL instead of submitting it.
 * The survivors' reduce fails naming rank R, the launcher restarts rank R
 * into the survivors' retry of step T (attempt 1).
 *
 *   train_mlp_faults --kill-rank R --kill-point P --spawn N [train_mlp's options]
 *
 * Rank R raises SIGKILL at the P-th point of its schedule where the
 * trainer calls rank_hooks.at (0-based; RANK_POINTS_PER_STEP per step
 * attempt: in an unshard, in a reduce, between the last reduce and the
 * step, in a step, after the steps). The survivors fail wherever the death
 * finds them; the launcher restarts rank R into the step and attempt they
 * retry, or, alone, after its last step in the daemon.
 *
 *   train_mlp_faults --pause-rank R --pause-point P --pause-ms M --spawn N [train_mlp's options]
 *
 * At its P-th point rank R forks a helper that stops it (SIGSTOP) there
 * and continues it (SIGCONT) M ms later. Nothing is restarted: with M
 * past the collective timeout the others fail naming rank R and retry, and
 * rank R, once continued, learns that they gave up on it and joins them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "launch.h"
#include "model.h"
#include "shardd.h"
#include "trainer.h"

struct faults {
	int64_t kill_rank;   /* --kill-rank R; -1: not given */
	int64_t kill_step;   /* --kill-step T; -1: not given */
	int64_t kill_point;  /* --kill-point P; -1: not given */
	int64_t pause_rank;  /* --pause-rank R; -1: not given */
	int64_t pause_point; /* --pause-point P */
	int64_t pause_ms;    /* --pause-ms M */
	int64_t points;      /* in a rank's process: the points it passed */
	int restarted; /* rank R was restarted (the replacement inherits it: no second kill) */
};

static const char *const point_names[] = {
	[RANK_AT_UNSHARD] = "in the unshard",
	[RANK_AT_REDUCE] = "in the reduce",
	[RANK_AT_BEFORE_STEP] = "between the last reduce and the step",
	[RANK_AT_STEP] = "in the step",
	[RANK_AT_STEP_DONE] = "after the steps",
};

/*
 * A helper process stops this one (SIGSTOP) and continues it (SIGCONT)
 * `ms` later; this one waits for the helper's word that it was continued,
 * so it is stopped here, with what it submitted in flight, and nowhere
 * later. The helper holds none of the rank's other descriptors: the
 * launcher reads its report pipe up to EOF.
 */
static void pause_self(int64_t ms)
{
	const struct timespec pause = { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000 };
	pid_t parent = getpid(), helper;
	int sync[2];
	char b = 0;

	fflush(NULL);
	if (pipe(sync) < 0 || (helper = fork()) < 0) {
		fprintf(stderr, "train_mlp_faults: starting the pause helper failed: %s\n",
			strerror(errno));
		exit(1);
	}
	if (helper == 0) {
		if (sync[1] > 0)
			close_range(0, (unsigned)sync[1] - 1, 0);
		close_range((unsigned)sync[1] + 1, ~0u, 0);
		kill(parent, SIGSTOP);
		nanosleep(&pause, NULL);
		kill(parent, SIGCONT);
		_exit(write(sync[1], "c", 1) == 1 ? 0 : 1);
	}
	close(sync[1]);
	while (read(sync[0], &b, 1) < 0 && errno == EINTR)
		;
	close(sync[0]);
	waitpid(helper, NULL, 0);
}

/* Rank R's P-th point: SIGKILL, in its first life only; or a pause of M ms. */
static void fault_at(struct rank *rk, uint32_t point, uint64_t t, uint32_t attempt, uint32_t layer,
		     void *arg)
{
	struct faults *f = arg;

	if ((int64_t)rank_id(rk) == f->pause_rank && f->points++ == f->pause_point) {
		fprintf(stderr,
			"train_mlp: rank %u: SIGSTOP for %" PRId64 " ms at point %" PRId64
			": %s of layer %u,"
			" step %" PRIu64 " attempt %u\n",
			rank_id(rk), f->pause_ms, f->pause_point, point_names[point], layer, t,
			attempt);
		pause_self(f->pause_ms);
		return;
	}
	if ((int64_t)rank_id(rk) != f->kill_rank || f->restarted || f->kill_point < 0 ||
	    f->points++ != f->kill_point)
		return;
	fprintf(stderr,
		"train_mlp: rank %u: raising SIGKILL at point %" PRId64
		": %s of layer %u, step %" PRIu64 " attempt %u\n",
		rank_id(rk), f->kill_point, point_names[point], layer, t, attempt);
	fflush(NULL);
	raise(SIGKILL);
}

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
	if (!armed && rank_submit(rk, SHARDD_OP_REDUCE, 0, key, rank_reduce_flags(rk)) < 0)
		return -1;
	if (rank_sync_op(rk, SHARDD_OP_BARRIER, MLP_LAYERS, key) < 0)
		return -1;
	if (armed) {
		fprintf(stderr,
			"train_mlp: rank %u: raising SIGKILL instead of reduce(group '%s', step %" PRIu64
			")\n",
			rank_id(rk), mlp_group_names[0], key);
		fflush(NULL);
		raise(SIGKILL);
	}
	return 1;
}

/* The launcher starts rank R again once, when it died as planned; it joins the others' retry. */
static int restart_killed(void *arg, uint32_t rank, int status, struct trainer_opts *ro)
{
	struct faults *f = arg;

	(void)ro;
	if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL || (int64_t)rank != f->kill_rank ||
	    f->restarted)
		return 0;
	f->restarted = 1;
	if (f->kill_step >= 0)
		fprintf(stderr,
			"train_mlp: rank %u killed itself (SIGKILL) at step %" PRId64
			" as planned; restarting it\n",
			rank, f->kill_step);
	else
		fprintf(stderr,
			"train_mlp: rank %u killed itself (SIGKILL) at point %" PRId64
			" as planned; restarting it\n",
			rank, f->kill_point);
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
	struct faults f = { .kill_rank = -1,
			    .kill_step = -1,
			    .kill_point = -1,
			    .pause_rank = -1,
			    .pause_point = -1,
			    .pause_ms = -1 };
	const struct rank_hooks rh = { .before_reduce = kill_point, .at = fault_at, .arg = &f };
	const struct launch_hooks lh = { .rank = &rh, .restart = restart_killed, .arg = &f };
	struct launch_opts o;
	char **rest = calloc((size_t)argc + 1, sizeof(*rest));
	int nrest = 0, ret = 2;

	if (!rest) {
		fprintf(stderr, "train_mlp_faults: out of memory\n");
		return 1;
	}
	/* Take the flags of ours out; the launcher parses the rest. */
	rest[nrest++] = argv[0];
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--kill-rank") && i + 1 < argc) {
			if (parse_flag(argv[++i], "--kill-rank", SHARDD_MAX_WORLD - 1,
				       &f.kill_rank))
				goto out;
		} else if (!strcmp(argv[i], "--kill-step") && i + 1 < argc) {
			if (parse_flag(argv[++i], "--kill-step", 1u << 24, &f.kill_step))
				goto out;
		} else if (!strcmp(argv[i], "--kill-point") && i + 1 < argc) {
			if (parse_flag(argv[++i], "--kill-point", 1u << 30, &f.kill_point))
				goto out;
		} else if (!strcmp(argv[i], "--pause-rank") && i + 1 < argc) {
			if (parse_flag(argv[++i], "--pause-rank", SHARDD_MAX_WORLD - 1,
				       &f.pause_rank))
				goto out;
		} else if (!strcmp(argv[i], "--pause-point") && i + 1 < argc) {
			if (parse_flag(argv[++i], "--pause-point", 1u << 30, &f.pause_point))
				goto out;
		} else if (!strcmp(argv[i], "--pause-ms") && i + 1 < argc) {
			if (parse_flag(argv[++i], "--pause-ms", 3600000, &f.pause_ms))
				goto out;
		} else {
			rest[nrest++] = argv[i];
		}
	}
	if (launch_opts_parse(nrest, rest, &o) < 0)
		goto out;
	if (f.pause_rank >= 0) {
		if (f.kill_rank >= 0 || f.kill_step >= 0 || f.kill_point >= 0 ||
		    f.pause_point < 0 || f.pause_ms < 0 || f.pause_rank >= (int64_t)o.t.world ||
		    !o.spawn) {
			fprintf(stderr,
				"train_mlp_faults: give --pause-rank R (below --spawn N), --pause-point P"
				" and --pause-ms M, and no --kill-*\n");
			goto out;
		}
		ret = launch_spawn(&o.t, &lh) < 0 ? 1 : 0;
		goto out;
	}
	if (f.kill_rank < 0 || (f.kill_step < 0) == (f.kill_point < 0) || !o.spawn) {
		fprintf(stderr,
			"train_mlp_faults: give --kill-rank R and one of --kill-step T, --kill-point P"
			" with --spawn N, or --pause-rank R --pause-point P --pause-ms M\n");
		goto out;
	}
	if (f.kill_rank >= (int64_t)o.t.world ||
	    (f.kill_step >= 0 && (uint64_t)f.kill_step >= o.t.steps)) {
		fprintf(stderr,
			"train_mlp_faults: --kill-rank %" PRId64 " --kill-step %" PRId64
			" must name a rank below %u and a step below --steps %" PRIu64 "\n",
			f.kill_rank, f.kill_step, o.t.world, o.t.steps);
		goto out;
	}
	ret = launch_spawn(&o.t, &lh) < 0 ? 1 : 0;
out:
	free(rest);
	return ret;
}
