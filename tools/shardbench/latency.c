/* SPDX-License-Identifier: MIT */
/*
 * `shardbench latency`: where the time of one small collective goes, seen
 * from the clients. o->ranks forked rank processes attach to one job,
 * register one 1-D fp32 param of -b bytes (in -d), and run -w + -n
 * iterations of unshard and then of reduce, each: a job barrier (so the
 * ranks start together and the daemon is awake, as in a training loop),
 * then per rank
 *
 *   t0  shardd_submit  t1  shardd_wait  t2   (then the undo, off the clock)
 *
 * on CLOCK_MONOTONIC, one clock for every process of the machine. The
 * table shows p50, p90 and p99 over iterations of the stages those
 * bound. With --trace FILE every sample is written there too, one line
 * per rank and iteration, for tools/shardbench/trace_latency.py, which
 * joins them with the daemon's own events (perf uprobes, same clock) by
 * op and step.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "shardd.h"

#define LAT_WAIT_MS 30000 /* a completion later than this fails the run, naming the op */
/*
 * Samples per op without -n: p99 is then the 10th largest (nearest rank),
 * so one preempted iteration moves it by one place instead of being it;
 * with 100 it would sit on the largest two, with 5 (the sweep's -n) it is
 * the maximum. 1000 iterations of a 4 KiB op take about a second.
 */
#define LAT_SAMPLES   1000
#define LAT_STEP_BASE 1000000 /* reduce steps start here, unshard steps at 1: distinct in a trace */
#define LAT_REAP_MS   (600 * 1000) /* a rank process still running after this is killed */

struct lat_sample {
	uint64_t t0; /* before shardd_submit */
	uint64_t t1; /* after it returned */
	uint64_t t2; /* after shardd_wait returned the op's completion */
};

struct lat_shared {
	uint32_t nranks, total;
	int32_t err[SHARDD_MAX_WORLD];
	char msg[SHARDD_MAX_WORLD][512];
	struct lat_sample *samples; /* [op][rank][iter] */
};

static const uint32_t lat_ops[2] = { SHARDD_OP_UNSHARD, SHARDD_OP_REDUCE };

static struct lat_sample *lat_at(struct lat_shared *sh, uint32_t op, uint32_t rank, uint32_t it)
{
	return &sh->samples[((size_t)op * sh->nranks + rank) * sh->total + it];
}

static int lat_fail(struct lat_shared *sh, uint32_t rank, int err, const char *what)
{
	const char *why = shardd_last_error();

	sh->err[rank] = err;
	snprintf(sh->msg[rank], sizeof(sh->msg[rank]), "rank %u: %s: %s", rank, what,
		 why && why[0] ? why : shardd_strerror(err));
	return err;
}

/* One op of the run: submit, wait for its completion, check it, undo it. */
static int lat_one(struct lat_shared *sh, uint32_t rank, struct shardd_client *c,
		   struct shardd_group *g, uint32_t opi, uint64_t step, struct lat_sample *s)
{
	struct shardd_completion cqe;
	char what[96];
	int ret;

	snprintf(what, sizeof(what), "%s(step %llu)", shardd_op_name(lat_ops[opi]),
		 (unsigned long long)step);
	s->t0 = bench_now_ns();
	ret = shardd_group_submit(g, lat_ops[opi], step, 0, step);
	s->t1 = bench_now_ns();
	if (ret)
		return lat_fail(sh, rank, ret, what);
	ret = shardd_wait(c, &cqe, LAT_WAIT_MS);
	s->t2 = bench_now_ns();
	if (ret)
		return lat_fail(sh, rank, ret, what);
	if (cqe.user_data != step || cqe.res) {
		snprintf(sh->msg[rank], sizeof(sh->msg[rank]),
			 "rank %u: %s: completion of user_data %llu,"
			 " res %d (%.200s)",
			 rank, what, (unsigned long long)cqe.user_data, cqe.res, cqe.msg);
		sh->err[rank] = cqe.res ? cqe.res : -EPROTO;
		return sh->err[rank];
	}
	ret = opi == 0 ? shardd_reshard(g, step) : shardd_zero_grad(g);
	if (ret)
		return lat_fail(sh, rank, ret, opi == 0 ? "reshard" : "zero_grad");
	return 0;
}

static int lat_rank(const struct bench_opts *o, struct lat_shared *sh, const char *socket_path,
		    uint32_t rank, uint64_t count)
{
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	char job[SHARDD_NAME_MAX];
	uint64_t barrier = 1;
	int ret;
	struct shardd_attach_opts ao = {
		.socket_path = socket_path,
		.job = job,
		.rank = rank,
		.replicate = 1,
		.shard = o->ranks,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_param_desc param = {
		.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { count }
	};
	struct shardd_precision precision = {
		.param_dtype = o->dtype == SHARDD_DTYPE_FP32 ? SHARDD_DTYPE_NONE : o->dtype,
		.reduce_dtype = SHARDD_DTYPE_NONE,
	};
	struct shardd_group_opts gopts = { .exec = o->exec };

	snprintf(job, sizeof(job), "shardbench.%d.latency", (int)getppid());
	ret = shardd_connect(&ao, &c);
	if (ret)
		return lat_fail(sh, rank, ret, "attach");
	ret = shardd_group_register(c, "latency", &param, 1, &precision, &gopts, &g);
	if (ret) {
		lat_fail(sh, rank, ret, "register group 'latency'");
		goto out;
	}
	/* Inputs: zero shards and grads are as good as any for timing; nothing is checked here. */
	for (uint32_t opi = 0; opi < 2 && !ret; opi++) {
		for (uint32_t it = 0; it < sh->total && !ret; it++) {
			uint64_t step = (opi ? LAT_STEP_BASE : 1) + it;

			ret = shardd_barrier(c, barrier++);
			if (ret) {
				lat_fail(sh, rank, ret, "barrier");
				break;
			}
			ret = lat_one(sh, rank, c, g, opi, step, lat_at(sh, opi, rank, it));
		}
	}
out:
	shardd_group_close(g);
	shardd_close(c);
	return ret;
}

/* p50, p90, p99 of v (sorted in place), in us. */
static void lat_print_stage(const char *name, uint64_t *v, size_t n, const char *what)
{
	bench_sort_u64(v, n);
	printf("  %-22s %9.2f %9.2f %9.2f  %s\n", name, bench_percentile(v, n, 50) / 1e3,
	       bench_percentile(v, n, 90) / 1e3, bench_percentile(v, n, 99) / 1e3, what);
}

static void lat_report(const struct bench_opts *o, struct lat_shared *sh, FILE *trace)
{
	size_t n = (size_t)o->iters;
	uint64_t *skew = calloc(n, sizeof(uint64_t)), *total = calloc(n, sizeof(uint64_t));
	uint64_t *after = calloc(n, sizeof(uint64_t)), *reap = calloc(n, sizeof(uint64_t));
	uint64_t *sub = calloc(n * sh->nranks, sizeof(uint64_t));

	if (!skew || !total || !after || !reap || !sub)
		goto out;
	for (uint32_t opi = 0; opi < 2; opi++) {
		for (uint32_t it = (uint32_t)o->warmup, i = 0; it < sh->total; it++, i++) {
			uint64_t first0 = UINT64_MAX, last0 = 0, first2 = UINT64_MAX, last2 = 0;

			for (uint32_t r = 0; r < sh->nranks; r++) {
				const struct lat_sample *s = lat_at(sh, opi, r, it);

				first0 = s->t0 < first0 ? s->t0 : first0;
				last0 = s->t0 > last0 ? s->t0 : last0;
				first2 = s->t2 < first2 ? s->t2 : first2;
				last2 = s->t2 > last2 ? s->t2 : last2;
				sub[(size_t)i * sh->nranks + r] = s->t1 - s->t0;
				if (trace)
					fprintf(trace, "%s %llu %u %llu %llu %llu\n",
						shardd_op_name(lat_ops[opi]),
						(unsigned long long)((opi ? LAT_STEP_BASE : 1) +
								     it),
						r, (unsigned long long)s->t0,
						(unsigned long long)s->t1,
						(unsigned long long)s->t2);
			}
			skew[i] = last0 - first0;
			after[i] = first2 - last0;
			reap[i] = last2 - first2;
			total[i] = last2 - first0;
		}
		printf("# %s: %u ranks, %llu bytes, %d samples\n", shardd_op_name(lat_ops[opi]),
		       sh->nranks, (unsigned long long)o->min_bytes, o->iters);
		printf("# %-22s %9s %9s %9s\n", "stage", "p50(us)", "p90(us)", "p99(us)");
		lat_print_stage("arrival skew", skew, n,
				"first rank's submit -> last rank's submit");
		lat_print_stage("submit call", sub, n * sh->nranks, "shardd_submit, each rank");
		lat_print_stage("last submit->first reap", after, n,
				"the daemon's part, the last client's wake-up included");
		lat_print_stage("first reap->last reap", reap, n,
				"the other ranks' completions and wake-ups");
		lat_print_stage("total", total, n, "first submit -> last reaped completion");
	}
	fflush(stdout);
out:
	free(skew);
	free(total);
	free(after);
	free(reap);
	free(sub);
}

int bench_latency_run(const struct bench_opts *opts, const char *socket_path,
		      const char *trace_path)
{
	struct bench_opts with_samples = *opts;
	const struct bench_opts *o = &with_samples;
	uint64_t count = o->min_bytes / shardd_dtype_size(o->dtype);
	struct lat_shared *sh;
	size_t len;
	pid_t pids[SHARDD_MAX_WORLD] = { 0 };
	FILE *trace = NULL;
	int ret = 0, failed = 0;

	if (!opts->iters_set)
		with_samples.iters = LAT_SAMPLES;

	if (count == 0 || count % o->ranks || o->ranks > SHARDD_MAX_WORLD) {
		fprintf(stderr,
			"shardbench: latency: -b %llu is not a multiple of %u %s elements\n",
			(unsigned long long)o->min_bytes, o->ranks, shardd_dtype_name(o->dtype));
		return -EINVAL;
	}
	len = sizeof(*sh) +
	      sizeof(struct lat_sample) * 2 * o->ranks * (size_t)(o->warmup + o->iters);
	/* Shared, not private: the rank processes write here after fork. */
	sh = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED)
		return -errno;
	sh->nranks = o->ranks;
	sh->total = (uint32_t)(o->warmup + o->iters);
	sh->samples = (struct lat_sample *)(sh + 1);
	printf("#\n# shardbench latency: %u rank processes, one 1-D fp32 param of %llu bytes in %s;"
	       " per iteration a barrier,\n#   then each rank: t0 submit t1 wait t2 (the undo off the clock);"
	       " warm-up %d, samples %d\n",
	       o->ranks, (unsigned long long)o->min_bytes, shardd_dtype_name(o->dtype), o->warmup,
	       o->iters);
	fflush(NULL);
	for (uint32_t r = 0; r < o->ranks; r++) {
		pids[r] = fork();
		if (pids[r] < 0) {
			ret = -errno;
			fprintf(stderr, "shardbench: latency: fork of rank %u: %s\n", r,
				strerror(errno));
			break;
		}
		if (pids[r] == 0)
			_exit(lat_rank(o, sh, socket_path, r, count) ? 1 : 0);
	}
	for (uint32_t r = 0; r < o->ranks; r++) {
		int st;

		if (pids[r] <= 0)
			continue;
		/* Every op has its own LAT_WAIT_MS; this bounds a rank stuck outside them. */
		st = bench_reap_pid(pids[r], LAT_REAP_MS);
		if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) {
			failed = 1;
			printf("# latency: rank %u failed: %s\n", r,
			       sh->msg[r][0] ? sh->msg[r] : "killed or stuck");
		}
	}
	if (!ret && !failed) {
		if (trace_path && !(trace = fopen(trace_path, "w")))
			fprintf(stderr, "shardbench: latency: --trace %s: %s\n", trace_path,
				strerror(errno));
		lat_report(o, sh, trace);
		if (trace)
			fclose(trace);
	}
	munmap(sh, len);
	return ret ? ret : failed ? -EIO : 0;
}
