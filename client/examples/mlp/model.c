/* SPDX-License-Identifier: MIT */
/* The model of train_mlp and its single-process reference (model.h). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"

const uint32_t mlp_dims[MLP_LAYERS + 1] = { 32, 64, 64, 1 };
const char *const mlp_group_names[MLP_LAYERS] = { "fc0", "fc1", "fc2" };

/* PRNG stream tags: distinct streams for init, teacher and data. */
enum {
	STREAM_INIT = 1,
	STREAM_TEACHER = 2,
	STREAM_DATA = 3
};

/* ------------------------------------------------------------------ */
/* PRNG: splitmix64 seeds xoshiro256**                                 */
/* ------------------------------------------------------------------ */

struct rng {
	uint64_t s[4];
};

static uint64_t splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint64_t rotl64(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

/* The stream for (seed, stream, a, b): each input is mixed in turn. */
static void rng_init(struct rng *r, uint64_t seed, uint64_t stream, uint64_t a, uint64_t b)
{
	uint64_t x = seed;

	x = splitmix64(&x) ^ stream;
	x = splitmix64(&x) ^ a;
	x = splitmix64(&x) ^ b;
	for (int i = 0; i < 4; i++)
		r->s[i] = splitmix64(&x);
}

static uint64_t rng_next(struct rng *r)
{
	uint64_t *s = r->s;
	uint64_t out = rotl64(s[1] * 5, 7) * 9;
	uint64_t t = s[1] << 17;

	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl64(s[3], 45);
	return out;
}

/* Uniform in [-a, a): 24 random bits, exact in fp32. */
static float rng_uniform(struct rng *r, float a)
{
	float u = (float)(rng_next(r) >> 40) * (1.0f / 16777216.0f);

	return (2.0f * u - 1.0f) * a;
}

/* ------------------------------------------------------------------ */
/* The model: forward, loss, backward, in fp32 with a fixed order      */
/* ------------------------------------------------------------------ */

static int layer_act(uint32_t l)
{
	return l + 1 < MLP_LAYERS;
} /* tanh on hidden layers */

void mlp_init(struct mlp_params *p, uint64_t seed)
{
	struct rng r;

	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		float a = 1.0f / sqrtf((float)layer_in(l));

		rng_init(&r, seed, STREAM_INIT, l, 0);
		for (uint32_t i = 0; i < layer_out(l) * layer_in(l); i++)
			p->w[l][i] = rng_uniform(&r, a);
		for (uint32_t i = 0; i < layer_out(l); i++)
			p->b[l][i] = rng_uniform(&r, a);
	}
}

void teacher_init(struct teacher *tc, uint64_t seed)
{
	struct rng r;

	rng_init(&r, seed, STREAM_TEACHER, 0, 0);
	for (uint32_t i = 0; i < MLP_TEACHER_HID * 32; i++)
		tc->w1[i] = rng_uniform(&r, sqrtf(3.0f / 32.0f));
	for (uint32_t i = 0; i < MLP_TEACHER_HID; i++)
		tc->b1[i] = rng_uniform(&r, 0.5f);
	for (uint32_t i = 0; i < MLP_TEACHER_HID; i++)
		tc->w2[i] = rng_uniform(&r, sqrtf(3.0f / MLP_TEACHER_HID) * 2.0f);
}

void batch_make(struct mlp_work *wk, const struct teacher *tc, uint64_t seed, uint32_t rank,
		uint64_t t)
{
	struct rng r;

	rng_init(&r, seed, STREAM_DATA, rank, t);
	for (uint32_t i = 0; i < MLP_BATCH * mlp_dims[0]; i++)
		wk->x[i] = rng_uniform(&r, sqrtf(3.0f));
	for (uint32_t n = 0; n < MLP_BATCH; n++) {
		const float *x = &wk->x[n * mlp_dims[0]];
		float y = 0.0f;

		for (uint32_t h = 0; h < MLP_TEACHER_HID; h++) {
			float s = tc->b1[h];

			for (uint32_t i = 0; i < 32; i++)
				s += tc->w1[h * 32 + i] * x[i];
			y += tc->w2[h] * tanhf(s);
		}
		wk->target[n] = y;
	}
}

static const float *layer_input(const struct mlp_work *wk, uint32_t l)
{
	return l == 0 ? wk->x : wk->act[l - 1];
}

void layer_forward(struct mlp_work *wk, uint32_t l, const float *w, const float *b)
{
	uint32_t in = layer_in(l), out = layer_out(l);
	const float *x = layer_input(wk, l);
	float *y = wk->act[l];

	for (uint32_t n = 0; n < MLP_BATCH; n++) {
		for (uint32_t o = 0; o < out; o++) {
			float s = b[o];

			for (uint32_t i = 0; i < in; i++)
				s += w[o * in + i] * x[n * in + i];
			y[n * out + o] = layer_act(l) ? tanhf(s) : s;
		}
	}
}

double loss_and_seed(struct mlp_work *wk)
{
	const float *y = wk->act[MLP_LAYERS - 1];
	float *dy = wk->delta[(MLP_LAYERS - 1) & 1];
	double loss = 0.0;

	for (uint32_t n = 0; n < MLP_BATCH; n++) {
		float e = y[n] - wk->target[n];

		loss += (double)e * (double)e;
		dy[n] = 2.0f * e / (float)MLP_BATCH;
	}
	return loss / MLP_BATCH;
}

void layer_backward(struct mlp_work *wk, uint32_t l, const float *w, float *gw, float *gb)
{
	uint32_t in = layer_in(l), out = layer_out(l);
	const float *x = layer_input(wk, l);
	const float *y = wk->act[l];
	float *dz = wk->delta[l & 1];

	if (layer_act(l))
		for (uint32_t k = 0; k < MLP_BATCH * out; k++)
			dz[k] *= 1.0f - y[k] * y[k];
	for (uint32_t o = 0; o < out; o++) {
		float sb = 0.0f;

		for (uint32_t i = 0; i < in; i++) {
			float s = 0.0f;

			for (uint32_t n = 0; n < MLP_BATCH; n++)
				s += dz[n * out + o] * x[n * in + i];
			gw[o * in + i] = s;
		}
		for (uint32_t n = 0; n < MLP_BATCH; n++)
			sb += dz[n * out + o];
		gb[o] = sb;
	}
	if (l == 0)
		return;
	float *dx = wk->delta[(l - 1) & 1];

	for (uint32_t n = 0; n < MLP_BATCH; n++) {
		for (uint32_t i = 0; i < in; i++) {
			float s = 0.0f;

			for (uint32_t o = 0; o < out; o++)
				s += w[o * in + i] * dz[n * out + o];
			dx[n * in + i] = s;
		}
	}
}

int mlp_dump_write(const char *path, const float *const w[MLP_LAYERS],
		   const float *const b[MLP_LAYERS])
{
	FILE *f = fopen(path, "wb");
	int ret = 0;

	if (!f) {
		ret = -errno;
		fprintf(stderr, "train_mlp: cannot create dump file '%s': %s\n", path,
			strerror(errno));
		return ret;
	}
	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		size_t nw = (size_t)layer_out(l) * layer_in(l), nb = layer_out(l);

		if (fwrite(w[l], sizeof(float), nw, f) != nw ||
		    fwrite(b[l], sizeof(float), nb, f) != nb)
			ret = -EIO;
	}
	if (fclose(f) != 0 && ret == 0)
		ret = -errno;
	if (ret)
		fprintf(stderr, "train_mlp: writing dump file '%s' failed: %s\n", path,
			strerror(-ret));
	return ret;
}

/* ------------------------------------------------------------------ */
/* Reference: the same training in one process, no daemon              */
/* ------------------------------------------------------------------ */

int mlp_reference(uint32_t world, uint64_t steps, const char *dump)
{
	struct mlp_params *p = calloc(1, sizeof(*p));
	struct mlp_params *gsum = calloc(1, sizeof(*gsum));
	struct mlp_params *g = calloc(1, sizeof(*g));
	struct mlp_work *wk = calloc(1, sizeof(*wk));
	struct teacher tc;
	int ret = 0;

	if (!p || !gsum || !g || !wk) {
		fprintf(stderr, "train_mlp: reference: out of memory\n");
		ret = -ENOMEM;
		goto out;
	}
	mlp_init(p, MLP_SEED);
	teacher_init(&tc, MLP_SEED);
	for (uint64_t t = 0; t < steps; t++) {
		double loss = 0.0;

		memset(gsum, 0, sizeof(*gsum));
		for (uint32_t r = 0; r < world; r++) {
			batch_make(wk, &tc, MLP_SEED, r, t);
			for (uint32_t l = 0; l < MLP_LAYERS; l++)
				layer_forward(wk, l, p->w[l], p->b[l]);
			loss += loss_and_seed(wk);
			for (uint32_t l = MLP_LAYERS; l-- > 0;)
				layer_backward(wk, l, p->w[l], g->w[l], g->b[l]);
			/* Sum in fp32 in rank order, as the host reduce does. */
			for (uint32_t l = 0; l < MLP_LAYERS; l++) {
				for (uint32_t i = 0; i < layer_out(l) * layer_in(l); i++)
					gsum->w[l][i] += g->w[l][i];
				for (uint32_t i = 0; i < layer_out(l); i++)
					gsum->b[l][i] += g->b[l][i];
			}
		}
		/* FSDP2 fp32 average: divide the sum by the group size, then SGD. */
		for (uint32_t l = 0; l < MLP_LAYERS; l++) {
			for (uint32_t i = 0; i < layer_out(l) * layer_in(l); i++)
				p->w[l][i] -= MLP_LR * (gsum->w[l][i] / (float)world);
			for (uint32_t i = 0; i < layer_out(l); i++)
				p->b[l][i] -= MLP_LR * (gsum->b[l][i] / (float)world);
		}
		printf("step %" PRIu64 " loss %.6f\n", t, loss / world);
		fflush(stdout);
	}
	if (dump) {
		const float *w[MLP_LAYERS], *b[MLP_LAYERS];

		for (uint32_t l = 0; l < MLP_LAYERS; l++) {
			w[l] = p->w[l];
			b[l] = p->b[l];
		}
		ret = mlp_dump_write(dump, w, b);
	}
out:
	free(wk);
	free(g);
	free(gsum);
	free(p);
	return ret;
}
