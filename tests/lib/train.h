/* SPDX-License-Identifier: MIT */
/*
 * Running client/examples/train_mlp from tests: FSDP2 training through a
 * real shardd against train_mlp's single-process reference, and the
 * comparison of their final params and losses.
 *
 * Tolerance. Both sides run the same fp32 forward/backward code on the
 * same batches, so each rank's gradients are bit-identical to the
 * reference's for that rank as long as the params are. The reference sums
 * the ranks' gradients in fp32 in rank order and divides the sum by the
 * world size, which is the reduce's specified numerics (fp32 sum and
 * divide, one rounding per collective); SGD is the same fp32 expression on
 * both sides. docs/DESIGN.md does not fix the order in which the daemon adds
 * the ranks' contributions: another order changes one reduce's result by
 * at most (N-1) roundings, ~2.4e-7 relative for N = 4, and the later steps
 * carry that difference. TRAIN_PARITY_RTOL is 1e-5 relative to the param's
 * size (|ref| floored at TRAIN_PARITY_FLOOR, since params pass through
 * zero): room for such reordering over 20 steps of lr 0.1, while one
 * missing or extra SGD step moves the params by ~1e-1 relative and a wrong
 * divide factor by more. Each comparison logs its measurement.
 */
#ifndef SHARDD_TEST_TRAIN_H
#define SHARDD_TEST_TRAIN_H

#include "harness.h"

#define TRAIN_PARITY_RTOL    1e-5
#define TRAIN_PARITY_FLOOR   0.1
#define TRAIN_STEPS          20
#define TRAIN_NPARAMS        (32 * 64 + 64 + 64 * 64 + 64 + 64 * 1 + 1) /* dump floats */
#define TRAIN_RUN_TIMEOUT_MS 25000 /* one train_mlp run; measured under 0.2 s on the host */

struct train_run {
	int status;
	char out[1 << 16]; /* stdout and stderr together */
};

/* Where a comparison's two dumps go: in the daemon's temporary directory. */
struct train_paths {
	char got[160];
	char ref[160];
};

/* SHARDD_BUILD/examples/train_mlp with args (NULL-terminated); its output and exit status. */
void train_run(struct train_run *r, const char *const *args);
/* The same with train_mlp_faults, its launcher with a planned crash (--kill-rank, --kill-step). */
void train_run_faults(struct train_run *r, const char *const *args);
int train_run_ok(const struct train_run *r);
/* The "step N loss X" lines of a run, in order; how many (asserts they are in order). */
int train_parse_losses(const char *out, double *loss, int max);
/* Largest relative difference over every param of two dumps, expected within TRAIN_PARITY_RTOL. */
/* A dump of train_mlp --dump (TRAIN_NPARAMS floats) into v, asserting its size. */
void train_read_dump(const char *path, float *v);
/*
 * A fault suite's seed: $env when set (to replay a failure), else from the
 * clock and pid. train_draw: splitmix64, each draw a function of the seed
 * and the number of draws before it.
 */
uint64_t train_seed(const char *env);
uint64_t train_draw(uint64_t *state);
void train_expect_params_match(const char *got_path, const char *ref_path, const char *what);
/* Per-step mean losses within TRAIN_PARITY_RTOL of the reference's. */
void train_expect_losses_match(const double *a, const double *b, const char *what);
void train_paths_make(struct train_paths *p, const struct harness_daemon *d);
void train_paths_remove(const struct train_paths *p);

/*
 * Start a daemon (extra flags `daemon_args`, may be NULL), train TRAIN_STEPS
 * steps with `world` ranks in `replicate` replicas (1: FSDP, more: HSDP)
 * through it (`device`: train_mlp's --device, or NULL) and in the
 * reference, compare the params; the losses go to fsdp_loss and ref_loss.
 * Stops the daemon.
 */
void train_parity(unsigned world, unsigned replicate, const char *const *daemon_args,
		  const char *device, double *fsdp_loss, double *ref_loss);

#endif /* SHARDD_TEST_TRAIN_H */
