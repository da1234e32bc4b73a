/* SPDX-License-Identifier: MIT */
/*
 * The ranks of one job as clients of this one process (integration and
 * GPU suites): attach every rank, register a group on every rank at once
 * (a registration waits for every rank of the job, so each runs on its own
 * thread), random values, and the portable kernels' optimizer step as the
 * reference a daemon's step is held to, bit for bit. Every call asserts
 * (Criterion) what it needs, so a test reads as its own steps.
 */
#ifndef SHARDD_TEST_INPROC_H
#define SHARDD_TEST_INPROC_H

#include <stdint.h>

#include "harness.h"
#include "shardd.h"

/*
 * Start `hd` with the NULL-terminated `extra` arguments, then attach ranks
 * 0 .. replicate * shard - 1 of `job` on CUDA device `device` (or
 * SHARDD_HELLO_DEVICE_HOST) into c[].
 */
void inproc_start(struct harness_daemon *hd, const char *const *extra, const char *job,
		  uint32_t replicate, uint32_t shard, int32_t device, struct shardd_client **c);

/* One rank's registration: the caller fills the first six fields. */
struct inproc_reg {
	struct shardd_client *c;
	const char *name;
	const struct shardd_param_desc *params;
	uint32_t nparams;
	struct shardd_precision precision;
	struct shardd_group_opts opts;
	struct shardd_group *g; /* the group, when ret is 0 */
	int ret;                /* shardd_group_register's result */
	char err[1024];         /* shardd_last_error() when ret is not 0 */
};

/* Run the `n` registrations at once, each on its own thread, and wait for all of them. */
void inproc_register(struct inproc_reg *reg, uint32_t n);
/*
 * Register group `name` (params, precision and opts; NULL: the defaults,
 * no optimizer) on c[0..n-1] at once and assert each rank succeeded
 * ("rank R register: ERROR"); the groups into g[].
 */
void inproc_register_ok(struct shardd_client **c, uint32_t n, const char *name,
			const struct shardd_param_desc *params, uint32_t nparams,
			const struct shardd_precision *precision,
			const struct shardd_group_opts *opts, struct shardd_group **g);
/*
 * One completion of each of the n ranks' clients, into cps[r]: polled in
 * turn, as one thread must drive several ranks (a rank-executed op runs
 * when its client polls, and needs its peers to run theirs). Asserts
 * within timeout_ms.
 */
void inproc_wait_each(struct shardd_client **c, uint32_t n, struct shardd_completion *cps,
		      int timeout_ms);

/*
 * Submit the reduce of `step` (with `flags`) of g[r] on every client c[r]
 * before reaping any, then assert each completed ("rank R reduce STEP: MSG").
 */
void inproc_reduce(struct shardd_client **c, struct shardd_group *const *g, uint32_t n,
		   uint64_t step, uint32_t flags);
/*
 * Submit the checkpoint of `step` on every client c[0..n-1] before reaping
 * any, then assert each completed ("rank R checkpoint STEP: MSG").
 */
void inproc_checkpoint(struct shardd_client **c, uint32_t n, uint64_t step);
/* Close g[0..n-1] and c[0..n-1], then stop `hd`, asserting it stopped clean. */
void inproc_finish(struct harness_daemon *hd, struct shardd_client **c, struct shardd_group **g,
		   uint32_t n);

/* Next of the xorshift64 generator `state`: a float in [-1, 1). */
float inproc_rnd(uint64_t *state);
/* Elements of the full param `d` (1 for a 0-d one). */
uint64_t inproc_numel(const struct shardd_param_desc *d);
/* Elements of real data in `g`'s shard of param i (params[i]): a prefix of the shard. */
uint64_t inproc_valid_numel(const struct shardd_group *g, const struct shardd_param_desc *params,
			    uint32_t i);

/* Bounds of an inproc_ref: ranks of the job, params of its group. */
#define INPROC_REF_RANKS  4
#define INPROC_REF_PARAMS 8

/*
 * The reference a daemon's optimizer is held to: per rank and param the
 * params and 3 state arrays (inproc_ref_step's `state`), and per rank the
 * steps taken. Zero it before inproc_ref_alloc.
 */
struct inproc_ref {
	float *p[INPROC_REF_RANKS][INPROC_REF_PARAMS], *s[INPROC_REF_RANKS][INPROC_REF_PARAMS][3];
	uint64_t nsteps[INPROC_REF_RANKS];
};

/* Zeroed params and state of `n` elements (one more, so that n may be 0) for param i of rank r. */
void inproc_ref_alloc(struct inproc_ref *ref, int r, uint32_t i, uint64_t n);
/* Free every array of `ref`. */
void inproc_ref_free(struct inproc_ref *ref);

/*
 * The reference of the daemon's step: optimizer `o` on the `n` elements of
 * `param` with fp32 `grad`, through the kernels' portable path. `state`
 * holds 3 arrays (momentum, or exp_avg, exp_avg_sq, max_exp_avg_sq).
 */
void inproc_ref_step(const struct shardd_optim_config *o, float *param, const float *grad,
		     float *const state[3], uint64_t step, double lr, float scale, uint64_t n);
/*
 * A shard after a step: its `n` elements of real data equal `ref` bit for
 * bit, its padding up to `all` is zero, and its sharded grad `grad` is zero
 * (messages name `what`, rank `rank` and param `name`).
 */
void inproc_expect_shard(const char *what, int rank, const char *name, const float *shard,
			 const float *ref, const float *grad, uint64_t n, uint64_t all);

#endif /* SHARDD_TEST_INPROC_H */
