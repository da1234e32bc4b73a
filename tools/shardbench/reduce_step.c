/* SPDX-License-Identifier: MIT */
/*
 * `shardbench reduce-step`: a REDUCE with SHARDD_REDUCE_STEP, which the
 * host backend runs as one fused pass (each block of the ranks' summed
 * grads goes straight into the AdamW update; the sharded grad is neither
 * written, read back nor cleared), against REDUCE then STEP, the two ops
 * that compute the same bytes, through the daemon with o->ranks forked
 * rank processes, fp32 params and grads.
 *
 * Each rank registers two groups of one 1-D param of the size's fp32 bytes
 * with the same AdamW, "separate" and "fused", and writes the same grads
 * into both once. Every iteration runs, each after a job barrier, reduce +
 * step on "separate" and reduce with the step flag on "fused": alternated,
 * so both see the same machine. Time of one = last rank's completion -
 * first rank's submit (CLOCK_MONOTONIC, one clock for every process); a row
 * shows the median of each over the timed iterations and their ratio.
 * Both groups start from zeroed params and take the same steps with the
 * same grads, so afterwards their shards must be equal bit for bit: each
 * rank counts the elements that are not (#wrong).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "shardd.h"

#define RS_WAIT_MS   60000        /* a completion later than this fails the run */
#define RS_REAP_MS   (900 * 1000) /* a rank process still running after this is killed */
#define RS_ITERS     20           /* timed iterations without -n: the median needs more than 5 */
#define RS_MAX_SIZES 64
#define RS_TARGET    1.2 /* issue 33: the fused op at least 1.2x reduce + step */

struct rs_sample {
	uint64_t t0, t1; /* submit of the first op, completion of the last */
};

/* What the rank processes write; one MAP_SHARED region, laid out once before fork. */
struct rs_shared {
	uint32_t nranks, nsizes, total;
	int32_t err[SHARDD_MAX_WORLD];
	char msg[SHARDD_MAX_WORLD][512];
	uint64_t wrong[RS_MAX_SIZES];
	struct rs_sample *samples; /* [size][mode: 0 separate, 1 fused][rank][iter] */
};

static struct rs_sample *rs_at(struct rs_shared *sh, uint32_t k, uint32_t mode, uint32_t rank,
			       uint32_t it)
{
	return &sh->samples[(((size_t)k * 2 + mode) * sh->nranks + rank) * sh->total + it];
}

static int rs_fail(struct rs_shared *sh, uint32_t rank, int err, const char *what)
{
	const char *why = shardd_last_error();

	sh->err[rank] = err;
	snprintf(sh->msg[rank], sizeof(sh->msg[rank]), "rank %u: %s: %s", rank, what,
		 why && why[0] ? why : shardd_strerror(err));
	return err;
}

/* The AdamW both groups use: torch's defaults with decoupled decay. */
static const struct shardd_optim_config rs_adamw = {
	.kind = SHARDD_OPTIM_ADAMW,
	.weight_decay = 0.01,
	.beta1 = 0.9,
	.beta2 = 0.999,
	.eps = 1e-8,
};

#define RS_LR 1e-3

/* Reduce then step on `sep`, timed into *s. */
static int rs_separate(struct rs_shared *sh, uint32_t rank, struct shardd_group *sep, uint64_t step,
		       struct rs_sample *s)
{
	int ret;

	s->t0 = bench_now_ns();
	ret = shardd_reduce(sep, step, 0);
	if (ret)
		return rs_fail(sh, rank, ret, "reduce of group 'separate'");
	ret = shardd_step(sep, step, RS_LR, 0, 0, 0);
	s->t1 = bench_now_ns();
	if (ret != SHARDD_STEP_APPLIED)
		return rs_fail(sh, rank, ret < 0 ? ret : -EPROTO, "step of group 'separate'");
	return 0;
}

/* The reduce with the step flag on `fused`, timed into *s. */
static int rs_fused(struct rs_shared *sh, uint32_t rank, struct shardd_client *c,
		    struct shardd_group *fused, uint64_t step, struct rs_sample *s)
{
	struct shardd_completion cqe;
	int ret;

	s->t0 = bench_now_ns();
	ret = shardd_reduce_step_submit(fused, step, 0, RS_LR, step);
	if (!ret)
		ret = shardd_wait(c, &cqe, RS_WAIT_MS);
	s->t1 = bench_now_ns();
	if (ret)
		return rs_fail(sh, rank, ret, "reduce with the step flag of group 'fused'");
	if (cqe.user_data != step || cqe.res != SHARDD_STEP_APPLIED) {
		snprintf(
			sh->msg[rank], sizeof(sh->msg[rank]),
			"rank %u: reduce with the step flag of group 'fused', step %llu: completion "
			"of user_data %llu, res %d (%.200s)",
			rank, (unsigned long long)step, (unsigned long long)cqe.user_data, cqe.res,
			cqe.msg);
		sh->err[rank] = cqe.res < 0 ? cqe.res : -EPROTO;
		return sh->err[rank];
	}
	return 0;
}

/* A deterministic grad value in [-1, 1) for element i of rank r. */
static float rs_grad(uint64_t i, uint32_t r)
{
	uint64_t h = (i + 1) * 0x9e3779b97f4a7c15ull ^ ((uint64_t)(r + 1) << 40);

	h ^= h >> 31;
	h *= 0xbf58476d1ce4e5b9ull;
	h ^= h >> 29;
	return (float)((int64_t)(h >> 40) - (1 << 23)) * 0x1p-23f;
}

static int rs_size(const struct bench_opts *o, struct rs_shared *sh, const char *socket_path,
		   uint32_t rank, uint32_t k, uint64_t count)
{
	struct shardd_client *c = NULL;
	struct shardd_group *sep = NULL, *fused = NULL;
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
	struct shardd_group_opts go = { .optimizer = &rs_adamw };

	/* A job per size, so the daemon frees the previous size's groups. */
	snprintf(job, sizeof(job), "shardbench.%d.reduce-step.%u", (int)getppid(), k);
	ret = shardd_connect(&ao, &c);
	if (ret)
		return rs_fail(sh, rank, ret, "attach");
	ret = shardd_group_register(c, "separate", &param, 1, NULL, &go, &sep);
	if (ret) {
		rs_fail(sh, rank, ret, "register group 'separate'");
		goto out;
	}
	ret = shardd_group_register(c, "fused", &param, 1, NULL, &go, &fused);
	if (ret) {
		rs_fail(sh, rank, ret, "register group 'fused'");
		goto out;
	}
	for (uint64_t i = 0; i < count; i++)
		((float *)shardd_group_grad(sep, 0))[i] =
			((float *)shardd_group_grad(fused, 0))[i] = rs_grad(i, rank);
	for (uint32_t it = 0; it < sh->total && !ret; it++) {
		ret = shardd_barrier(c, barrier++);
		if (!ret)
			ret = rs_separate(sh, rank, sep, it + 1, rs_at(sh, k, 0, rank, it));
		else
			rs_fail(sh, rank, ret, "barrier");
		if (ret)
			break;
		ret = shardd_barrier(c, barrier++);
		if (!ret)
			ret = rs_fused(sh, rank, c, fused, it + 1, rs_at(sh, k, 1, rank, it));
		else
			rs_fail(sh, rank, ret, "barrier");
	}
	if (!ret && o->check) {
		const struct shardd_param_layout *l = shardd_group_layout(sep, 0);
		const uint32_t *a = shardd_group_shard(sep, 0), *b = shardd_group_shard(fused, 0);
		uint64_t wrong = 0;

		/* The whole shard, padding included: neither may write there. */
		for (uint64_t i = 0; i < l->shard_bytes / sizeof(float); i++)
			wrong += a[i] != b[i];
		__atomic_fetch_add(&sh->wrong[k], wrong, __ATOMIC_RELAXED);
	}
out:
	shardd_group_close(fused);
	shardd_group_close(sep);
	shardd_close(c);
	return ret;
}

static int rs_rank(const struct bench_opts *o, struct rs_shared *sh, const char *socket_path,
		   uint32_t rank, const uint64_t *counts)
{
	int ret = 0;

	for (uint32_t k = 0; k < sh->nsizes && !ret; k++)
		ret = rs_size(o, sh, socket_path, rank, k, counts[k]);
	return ret;
}

static int rs_cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

/* Median over the timed iterations of (last rank's completion - first rank's submit), in ns. */
static uint64_t rs_median(struct rs_shared *sh, const struct bench_opts *o, uint32_t k,
			  uint32_t mode)
{
	uint64_t t[1024];
	uint32_t n = 0;

	for (uint32_t it = (uint32_t)o->warmup; it < sh->total && n < 1024; it++) {
		uint64_t first = UINT64_MAX, last = 0;

		for (uint32_t r = 0; r < sh->nranks; r++) {
			const struct rs_sample *s = rs_at(sh, k, mode, r, it);

			first = s->t0 < first ? s->t0 : first;
			last = s->t1 > last ? s->t1 : last;
		}
		t[n++] = last - first;
	}
	qsort(t, n, sizeof(t[0]), rs_cmp_u64);
	return n ? t[n / 2] : 0;
}

int bench_reduce_step_run(const struct bench_opts *o, const char *socket_path)
{
	uint64_t counts[RS_MAX_SIZES], bytes_of[RS_MAX_SIZES];
	uint32_t nsizes = 0, iters = o->iters_set ? (uint32_t)o->iters : RS_ITERS;
	pid_t pids[SHARDD_MAX_WORLD] = { 0 };
	double worst = 1e9;
	uint64_t wrong = 0;
	struct rs_shared *sh;
	size_t len;
	int ret = 0, failed = 0;

	for (uint64_t b = o->min_bytes; b <= o->max_bytes && nsizes < RS_MAX_SIZES;
	     b *= o->factor) {
		if (b / sizeof(float) < o->ranks)
			continue;
		bytes_of[nsizes] = b;
		counts[nsizes++] = b / sizeof(float);
	}
	if (iters > 1024 - (uint32_t)o->warmup)
		iters = 1024 - (uint32_t)o->warmup;
	len = sizeof(*sh) + sizeof(struct rs_sample) * 2 * o->ranks * (size_t)nsizes *
				    (size_t)(o->warmup + iters);
	/* Shared, not private: the rank processes write here after fork. */
	sh = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED)
		return -errno;
	sh->nranks = o->ranks;
	sh->nsizes = nsizes;
	sh->total = (uint32_t)o->warmup + iters;
	sh->samples = (struct rs_sample *)(sh + 1);
	printf("#\n# shardbench reduce-step: %u rank processes, one 1-D fp32 param per size (fp32 grads),"
	       " AdamW (lr %g, wd 0.01);\n#   separate: reduce then step; fused: reduce with"
	       " SHARDD_REDUCE_STEP, on an absent grad (the fused pass);\n#   alternated, each after a"
	       " job barrier; median of %u after %d warm-up; fused/sep: separate time / fused time,\n"
	       "#   bytes/sep: the same for the bytes each moves (the ratio a memory-bound pass reaches)\n",
	       o->ranks, RS_LR, iters, o->warmup);
	printf("#   bytes per param element, all ranks: separate %u (reduce %u, step 28, clearing 4),"
	       " fused %u\n",
	       4 * o->ranks + 4 + 28 + 4, 4 * o->ranks + 4, 4 * o->ranks + 24);
	printf("# %12s %12s %12s %12s %9s %9s %6s\n", "size(B)", "count", "separate(us)",
	       "fused(us)", "fused/sep", "bytes/sep", "#wrong");
	fflush(NULL);
	for (uint32_t r = 0; r < o->ranks; r++) {
		pids[r] = fork();
		if (pids[r] < 0) {
			ret = -errno;
			fprintf(stderr, "shardbench: reduce-step: fork of rank %u: %s\n", r,
				strerror(errno));
			break;
		}
		if (pids[r] == 0)
			_exit(rs_rank(o, sh, socket_path, r, counts) ? 1 : 0);
	}
	for (uint32_t r = 0; r < o->ranks; r++) {
		int st;

		if (pids[r] <= 0)
			continue;
		st = bench_reap_pid(pids[r], RS_REAP_MS);
		if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) {
			failed = 1;
			printf("# reduce-step: rank %u failed: %s\n", r,
			       sh->msg[r][0] ? sh->msg[r] : "killed or stuck");
		}
	}
	for (uint32_t k = 0; k < nsizes && !ret && !failed; k++) {
		uint64_t sep = rs_median(sh, o, k, 0), fus = rs_median(sh, o, k, 1);
		double ratio = fus ? (double)sep / (double)fus : 0;

		worst = ratio < worst ? ratio : worst;
		wrong += sh->wrong[k];
		printf("  %12llu %12llu %12.1f %12.1f %8.2fx %8.2fx %6llu\n",
		       (unsigned long long)bytes_of[k], (unsigned long long)counts[k],
		       (double)sep / 1e3, (double)fus / 1e3, ratio,
		       (double)(4 * o->ranks + 36) / (double)(4 * o->ranks + 24),
		       (unsigned long long)sh->wrong[k]);
	}
	if (!ret && !failed && nsizes)
		printf("# fused vs reduce + step: worst %.2fx (target >= %.1fx: %s)\n", worst,
		       RS_TARGET, worst >= RS_TARGET ? "met" : "MISSED");
	fflush(stdout);
	munmap(sh, len);
	return ret ? ret : failed ? -EIO : wrong ? 1 : 0;
}
