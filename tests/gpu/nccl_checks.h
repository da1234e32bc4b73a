/* SPDX-License-Identifier: MIT */
/*
 * The values and per-param checks of the NCCL suites (test_nccl.c, one
 * daemon; test_nccl_span.c, daemons across nodes): the registered value and
 * each rank's grad of every element, a group registered and loaded with
 * those values, and a rank process's checks of what the daemon gathered
 * and reduced against the reference computed here in double (reference.h). The tolerance of the sharded grads is the one both
 * files' comments give: N x steps ulps of the reduce dtype at the magnitude
 * of steps x the sum of |grads| (N ranks, steps reduces), plus one fp32 ulp
 * of the result per step; padding rows exactly zero; gathered values exact.
 *
 * The checks run in rank processes: a failed one reports on stderr and
 * returns 1 (CHILD_CHECK), which the caller returns as its exit status.
 * `who` names the rank (and the group) at the head of each message.
 */
#ifndef SHARDD_TESTS_NCCL_CHECKS_H
#define SHARDD_TESTS_NCCL_CHECKS_H

/*
 * Why a test that needs more GPUs than the machine has skips: NCCL (2.28
 * on the machines lent to us) refuses two ranks of a communicator on one
 * GPU, so a collective across ranks needs a GPU each.
 */
#define NCCL_ONE_RANK_PER_GPU                                                               \
	"NCCL before 2.30 refuses two ranks of a communicator on one GPU (NCCL 2.30's "     \
	"experimental NCCL_MULTI_RANK_GPU_ENABLE lifts that); test_nccl_one_gpu runs what " \
	"one GPU can"

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "inproc.h"
#include "reference.h"
#include "shardd.h"

/* The most elements of a param (and of a shard) the suites register. */
#define MAX_NUMEL 4096

static inline struct ref_param ref_of(const struct shardd_param_desc *p)
{
	struct ref_param r = { .ndim = p->ndim, .shard_dim = p->shard_dim, .dtype = p->dtype };

	memcpy(r.shape, p->shape, sizeof(p->shape));
	return r;
}

/* The registered value of element i of param `pi` (representable in fp32). */
static inline double param_value(uint32_t pi, uint64_t i)
{
	return ref_round(3.0 * sin(0.01 * (double)i + pi), SHARDD_DTYPE_FP32);
}

/* Rank r's grad of element i of param `pi`, representable in `dtype`. */
static inline double grad_value(uint32_t pi, uint32_t r, uint64_t i, uint32_t dtype)
{
	return ref_round((r + 1) * cos(0.013 * (double)i + 0.7 * r + pi), dtype);
}

/* Group `name` of `params` registered on `c` in `precision` (NULL: none), every param loaded with its values. */
static inline int register_loaded(struct shardd_client *c, const char *name,
				  const struct shardd_param_desc *params, uint32_t nparams,
				  const struct shardd_precision *precision, struct shardd_group **g)
{
	static float full[MAX_NUMEL];

	CHILD_CHECK_SHARDD(shardd_group_register(c, name, params, nparams, precision, NULL, g));
	for (uint32_t pi = 0; pi < nparams; pi++) {
		uint64_t n = inproc_numel(&params[pi]);

		CHILD_CHECK(n <= MAX_NUMEL, "param %u: %llu elements", pi, (unsigned long long)n);
		for (uint64_t i = 0; i < n; i++)
			full[i] = (float)param_value(pi, i);
		CHILD_CHECK_SHARDD(shardd_group_load_full(*g, pi, full));
	}
	return 0;
}

/* Every element of param `pi` (`p`) as gathered at `dev`: the registered value, cast to `udt`. */
static inline int check_unsharded_param(const char *who, uint32_t pi,
					const struct shardd_param_desc *p, uint32_t udt,
					const struct shardd_param_layout *l, const void *dev)
{
	static uint8_t host[MAX_NUMEL * 4];
	uint64_t n = inproc_numel(p);

	CHILD_CHECK(l->unsharded_bytes == n * ref_dtype_size(udt) &&
			    l->unsharded_bytes <= sizeof(host),
		    "param %u: %llu unsharded bytes", pi, (unsigned long long)l->unsharded_bytes);
	CHILD_CHECK_CUDA(cudaMemcpy(host, dev, l->unsharded_bytes, cudaMemcpyDeviceToHost));
	for (uint64_t i = 0; i < n; i++) {
		double got = ref_load(host + i * ref_dtype_size(udt), udt);
		double want = ref_round(param_value(pi, i), udt);

		CHILD_CHECK(got == want, "%s param %u element %llu: unsharded %g, want %g", who, pi,
			    (unsigned long long)i, got, want);
	}
	return 0;
}

/* Rank `rank`'s grads of param `pi` (`p`) in `gdt`, written to its grad buffer at `dev`. */
static inline int write_grad_param(uint32_t rank, uint32_t pi, const struct shardd_param_desc *p,
				   uint32_t gdt, void *dev)
{
	static uint8_t host[MAX_NUMEL * 4];
	uint64_t n = inproc_numel(p);

	CHILD_CHECK(n <= MAX_NUMEL, "param %u: %llu elements", pi, (unsigned long long)n);
	for (uint64_t i = 0; i < n; i++)
		ref_store(host + i * ref_dtype_size(gdt), gdt, grad_value(pi, rank, i, gdt));
	CHILD_CHECK_CUDA(cudaMemcpy(dev, host, n * ref_dtype_size(gdt), cudaMemcpyHostToDevice));
	return 0;
}

/*
 * Shard s of param `pi` (`p`, grads in `gdt`, reduced in `rd`) over
 * `shard` shards, as reduced at `dev` after `steps` reduces of the same
 * grads of `world` ranks: steps x the average over every rank, within the
 * tolerance above; padding rows zero.
 */
static inline int check_shard_grad_param(const char *who, uint32_t pi,
					 const struct shardd_param_desc *p, uint32_t gdt,
					 uint32_t rd, uint32_t shard, uint32_t s, uint32_t world,
					 uint32_t steps, const struct shardd_param_layout *l,
					 const void *dev)
{
	static double sum[MAX_NUMEL], mag[MAX_NUMEL], want[MAX_NUMEL], wmag[MAX_NUMEL];
	static float got[MAX_NUMEL];
	struct ref_param rp = ref_of(p);
	uint64_t n = inproc_numel(p);
	struct ref_dims d;

	ref_dims(&rp, shard, &d);
	CHILD_CHECK(l->shard_bytes == d.shard_numel * 4 && d.shard_numel <= MAX_NUMEL,
		    "param %u: %llu shard bytes", pi, (unsigned long long)l->shard_bytes);
	for (uint64_t i = 0; i < n; i++) {
		sum[i] = mag[i] = 0;
		for (uint32_t r = 0; r < world; r++) {
			sum[i] += grad_value(pi, r, i, gdt);
			mag[i] += fabs(grad_value(pi, r, i, gdt));
		}
	}
	ref_shard(&d, s, sum, want);
	ref_shard(&d, s, mag, wmag);
	CHILD_CHECK_CUDA(cudaMemcpy(got, dev, l->shard_bytes, cudaMemcpyDeviceToHost));
	for (uint64_t j = 0; j < d.shard_numel; j++) {
		/* Shard rows past the param's last row (dim 0) are padding. */
		int pad = d.outer == 1 && j / d.inner >= ref_rows_valid(&d, s);
		double w = pad ? 0 : steps * want[j] / world;
		double tol = pad ? 0
				 : (double)world * steps * ref_ulp(steps * wmag[j], rd) +
					     steps * ref_ulp(fabs(w), SHARDD_DTYPE_FP32);

		CHILD_CHECK(fabs((double)got[j] - w) <= tol,
			    "%s param %u shard element %llu%s: %.9g, want %.9g within %.3g", who,
			    pi, (unsigned long long)j, pad ? " (padding)" : "", (double)got[j], w,
			    tol);
	}
	return 0;
}

#endif /* SHARDD_TESTS_NCCL_CHECKS_H */
