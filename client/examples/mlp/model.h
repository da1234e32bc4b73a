/* SPDX-License-Identifier: MIT */
/*
 * The model of train_mlp: a 3-layer MLP (32 -> 64 -> 64 -> 1, tanh on the
 * hidden layers) that learns a fixed random teacher network on synthetic
 * data, in fp32 with a fixed order of operations. No daemon here: the
 * trainer (trainer.h) runs these functions on the group buffers, and
 * mlp_reference replays the same run in one process.
 *
 * Reproducibility: the initial params, the teacher and each rank's batch at
 * step t are functions of (seed, rank, t) through splitmix64/xoshiro256**,
 * so the reference can replay a run on the union of the ranks' batches.
 * Averaging the ranks' mean-loss gradients is the gradient of the mean loss
 * over the union (equal batch sizes), which is what the reduce computes.
 *
 * Dump format (mlp_dump_write): raw little-endian fp32, for each layer in
 * order fc0, fc1, fc2: weight (out x in, row-major), then bias (out).
 * 32*64+64 + 64*64+64 + 64*1+1 = 6337 floats.
 */
#ifndef SHARDD_EXAMPLE_MLP_MODEL_H
#define SHARDD_EXAMPLE_MLP_MODEL_H

#include <stdint.h>

#define MLP_LAYERS      3
#define MLP_BATCH       32 /* samples per rank per step */
#define MLP_MAX_DIM     64
#define MLP_TEACHER_HID 16
#define MLP_LR          0.1f
#define MLP_SEED        0x5eedf5d2u

/* 32 -> 64 -> 64 -> 1: 64 rows shard unevenly over 3 ranks, 1 row over any world > 1. */
extern const uint32_t mlp_dims[MLP_LAYERS + 1];
/* One parameter group per layer, params "<group>.weight" [out x in] and "<group>.bias" [out]. */
extern const char *const mlp_group_names[MLP_LAYERS];

static inline uint32_t layer_in(uint32_t l)
{
	return mlp_dims[l];
}
static inline uint32_t layer_out(uint32_t l)
{
	return mlp_dims[l + 1];
}

/* Params of the whole model, for initialisation and the reference. */
struct mlp_params {
	float w[MLP_LAYERS][MLP_MAX_DIM * MLP_MAX_DIM];
	float b[MLP_LAYERS][MLP_MAX_DIM];
};

/* One rank's batch and the activations of one forward/backward pass. */
struct mlp_work {
	float x[MLP_BATCH * MLP_MAX_DIM]; /* inputs */
	float target[MLP_BATCH];
	float act[MLP_LAYERS][MLP_BATCH * MLP_MAX_DIM]; /* output of layer l */
	float delta[2][MLP_BATCH * MLP_MAX_DIM];        /* dL/d(output), ping-pong */
};

/* The teacher: 32 -> 16 tanh -> 1, fixed by the seed. */
struct teacher {
	float w1[MLP_TEACHER_HID * 32];
	float b1[MLP_TEACHER_HID];
	float w2[MLP_TEACHER_HID];
};

/* PyTorch's nn.Linear default: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias. */
void mlp_init(struct mlp_params *p, uint64_t seed);
void teacher_init(struct teacher *tc, uint64_t seed);
/* Rank `rank`'s batch of step t: inputs of unit variance, teacher targets. */
void batch_make(struct mlp_work *wk, const struct teacher *tc, uint64_t seed, uint32_t rank,
		uint64_t t);
void layer_forward(struct mlp_work *wk, uint32_t l, const float *w, const float *b);
/* Mean squared error over the batch; seeds the backward pass with dL/dy. */
double loss_and_seed(struct mlp_work *wk);
/*
 * Backward of layer l: reads dL/d(output) from delta[l & 1], writes the
 * weight and bias grads (assigning, not accumulating) and, for l > 0,
 * dL/d(input) into delta[(l - 1) & 1].
 */
void layer_backward(struct mlp_work *wk, uint32_t l, const float *w, float *gw, float *gb);
/* Write the model in the documented dump order. 0 or -errno. */
int mlp_dump_write(const char *path, const float *const w[MLP_LAYERS],
		   const float *const b[MLP_LAYERS]);

/*
 * The reference: the same training in one process, no daemon, on the union
 * of `world` ranks' batches; prints "step N loss X" per step and, when
 * `dump` is not NULL, writes the final params there. 0 or -errno.
 */
int mlp_reference(uint32_t world, uint64_t steps, const char *dump);

#endif /* SHARDD_EXAMPLE_MLP_MODEL_H */
