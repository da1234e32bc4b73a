/* SPDX-License-Identifier: MIT */
/*
 * train_mlp: a real FSDP2 (ZeRO-3) training run through shardd.
 *
 * A 3-layer MLP (32 -> 64 -> 64 -> 1, tanh on the hidden layers) learns a
 * fixed random teacher network on synthetic data. Each linear layer is one
 * parameter group ("fc0", "fc1", "fc2", params "weight" [out x in] and
 * "bias" [out], fp32), sharded by the daemon along dim 0. Every rank runs
 * FSDP2's schedule with reshard_after_forward=True:
 *
 *   forward,  layer l = 0..2:  unshard(l) (l+1 prefetched while l computes),
 *                              forward, reshard(l)
 *   backward, layer l = 2..0:  unshard(l) again (l-1 prefetched), backward
 *                              into the grad buffer, reshard(l), reduce(l)
 *   once every reduce of the step succeeded: SGD on the rank's own flat
 *   shard with its sharded grad, then zero_grad.
 *
 * unshard and reduce are keyed by step, and the forward and the backward
 * unshard of one training step are two different collectives, so each gets
 * its own key: op_key(t, attempt, phase) = 16 t + 2 attempt + phase, phase 0
 * for the forward unshard and 1 for the backward unshard and the reduce. The
 * attempt makes a retried step (after a rank died) use fresh keys, and the
 * keys grow monotonically over the run.
 *
 * Reproducibility: the initial params, the teacher and each rank's batch at
 * step t are functions of (seed, rank, t) through splitmix64/xoshiro256**,
 * so --reference can replay the same run in one process on the union of the
 * ranks' batches. Averaging the ranks' mean-loss gradients is the gradient
 * of the mean loss over the union (equal batch sizes), which is what the
 * reduce computes.
 *
 * Backends: on the host backend the ranks compute on the group buffers'
 * mappings directly. On the cuda backend (--device N) those are device
 * memory; the model still runs on the CPU, so each rank copies an
 * unsharded layer to host memory after its unshard, its grads to the
 * device before its reduce, and its shard around the SGD update.
 *
 * Dump format (--dump FILE): raw little-endian fp32, for each layer in order
 * fc0, fc1, fc2: weight (out x in, row-major), then bias (out). 32*64+64 +
 * 64*64+64 + 64*1+1 = 6337 floats.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shardd.h"

#ifdef SHARDD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

/* ------------------------------------------------------------------ */
/* Model and run constants                                             */
/* ------------------------------------------------------------------ */

#define MLP_LAYERS      3
#define MLP_BATCH       32          /* samples per rank per step */
#define MLP_MAX_DIM     64
#define MLP_TEACHER_HID 16
#define MLP_LR          0.1f
#define MLP_SEED        0x5eedf5d2u
#define MLP_MAX_ATTEMPTS 4          /* tries of one step; attempt < 8 fits op_key */
#define MLP_DEFAULT_STEPS 20
#define MLP_DEFAULT_JOB "train_mlp"
#define MLP_RECONNECT_MS 10000      /* restarted rank: wait for the daemon to drop its old session */

/* 32 -> 64 -> 64 -> 1: 64 rows shard unevenly over 3 ranks, 1 row over any world > 1. */
static const uint32_t mlp_dims[MLP_LAYERS + 1] = { 32, 64, 64, 1 };
static const char *const mlp_group_names[MLP_LAYERS] = { "fc0", "fc1", "fc2" };

/* PRNG stream tags: distinct streams for init, teacher and data. */
enum { STREAM_INIT = 1, STREAM_TEACHER = 2, STREAM_DATA = 3 };

static uint64_t op_key(uint64_t t, uint32_t attempt, uint32_t phase)
{
	return t * 16 + (uint64_t)attempt * 2 + phase;
}

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

static uint32_t layer_in(uint32_t l) { return mlp_dims[l]; }
static uint32_t layer_out(uint32_t l) { return mlp_dims[l + 1]; }
static int layer_act(uint32_t l) { return l + 1 < MLP_LAYERS; } /* tanh on hidden layers */

/* Params of the whole model, for initialisation and the reference. */
struct mlp_params {
	float w[MLP_LAYERS][MLP_MAX_DIM * MLP_MAX_DIM];
	float b[MLP_LAYERS][MLP_MAX_DIM];
};

/* One rank's batch and the activations of one forward/backward pass. */
struct mlp_work {
	float x[MLP_BATCH * MLP_MAX_DIM];                   /* inputs */
	float target[MLP_BATCH];
	float act[MLP_LAYERS][MLP_BATCH * MLP_MAX_DIM];     /* output of layer l */
	float delta[2][MLP_BATCH * MLP_MAX_DIM];            /* dL/d(output), ping-pong */
};

/* PyTorch's nn.Linear default: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias. */
static void mlp_init(struct mlp_params *p, uint64_t seed)
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

/* The teacher: 32 -> 16 tanh -> 1, fixed by the seed. */
struct teacher {
	float w1[MLP_TEACHER_HID * 32];
	float b1[MLP_TEACHER_HID];
	float w2[MLP_TEACHER_HID];
};

static void teacher_init(struct teacher *tc, uint64_t seed)
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

/* Rank `rank`'s batch of step t: inputs of unit variance, teacher targets. */
static void batch_make(struct mlp_work *wk, const struct teacher *tc, uint64_t seed,
		       uint32_t rank, uint64_t t)
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

static void layer_forward(struct mlp_work *wk, uint32_t l, const float *w, const float *b)
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

/* Mean squared error over the batch; seeds the backward pass with dL/dy. */
static double loss_and_seed(struct mlp_work *wk)
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

/*
 * Backward of layer l: reads dL/d(output) from delta[l & 1], writes the
 * weight and bias grads (assigning, not accumulating) and, for l > 0,
 * dL/d(input) into delta[(l - 1) & 1].
 */
static void layer_backward(struct mlp_work *wk, uint32_t l, const float *w, float *gw, float *gb)
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

/* Write the model in the documented dump order. 0 or -errno. */
static int dump_write(const char *path, const float *const w[MLP_LAYERS],
		      const float *const b[MLP_LAYERS])
{
	FILE *f = fopen(path, "wb");
	int ret = 0;

	if (!f) {
		ret = -errno;
		fprintf(stderr, "train_mlp: cannot create dump file '%s': %s\n", path, strerror(errno));
		return ret;
	}
	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		size_t nw = (size_t)layer_out(l) * layer_in(l), nb = layer_out(l);

		if (fwrite(w[l], sizeof(float), nw, f) != nw || fwrite(b[l], sizeof(float), nb, f) != nb)
			ret = -EIO;
	}
	if (fclose(f) != 0 && ret == 0)
		ret = -errno;
	if (ret)
		fprintf(stderr, "train_mlp: writing dump file '%s' failed: %s\n", path, strerror(-ret));
	return ret;
}

/* ------------------------------------------------------------------ */
/* Options                                                             */
/* ------------------------------------------------------------------ */

struct opts {
	uint32_t spawn;        /* --spawn N: supervisor of N ranks; 0: not */
	int reference;         /* --reference */
	int64_t rank;          /* --rank R; -1: not given */
	uint32_t world;        /* --world N */
	uint64_t steps;        /* --steps K */
	const char *socket;    /* --socket PATH; NULL: library default */
	const char *job;       /* --job NAME */
	const char *dump;      /* --dump FILE */
	int64_t kill_rank;     /* --kill-rank R; -1: none */
	uint64_t kill_step;    /* --kill-step T */
	int64_t resume_step;   /* --resume-step T; -1: fresh start */
	uint32_t attempt;      /* --attempt A: with --resume-step, the attempt to join */
	int32_t device;        /* --device N; SHARDD_HELLO_DEVICE_HOST: none */
};

static void usage(FILE *f)
{
	fprintf(f,
"usage: train_mlp --spawn N [--steps K] [--socket PATH] [--job NAME] [--dump FILE]\n"
"                 [--device N] [--kill-rank R --kill-step T]\n"
"       train_mlp --rank R --world N [--steps K] [--socket PATH] [--job NAME] [--dump FILE]\n"
"                 [--device N] [--resume-step T [--attempt A]]\n"
"       train_mlp --reference --world N [--steps K] [--dump FILE]\n"
"\n"
"Trains a 32-64-64-1 tanh MLP on a fixed random teacher, FSDP2-style, through\n"
"a running shardd daemon: one parameter group per layer, unshard with prefetch,\n"
"reshard after forward, reduce after each layer's backward, SGD on each rank's\n"
"own shard. Prints 'step N loss X' (mean over the ranks) per step.\n"
"\n"
"  --spawn N         fork N rank processes and supervise them\n"
"  --rank R          run rank R of --world N (prints 'rank R step N loss X')\n"
"  --reference       train the same model in this process, no daemon, on the\n"
"                    union of the N ranks' batches\n"
"  --steps K         training steps (default %d)\n"
"  --socket PATH     daemon socket (default: $SHARDD_SOCKET, else the default path)\n"
"  --job NAME        job name (default '%s')\n"
"  --device N        attach on CUDA device N: needed when the daemon runs\n"
"                    --backend cuda (the buffers are then device memory)\n"
"  --dump FILE       write the final params as raw little-endian fp32: per layer\n"
"                    fc0, fc1, fc2 the weight (out x in, row-major) then the bias;\n"
"                    with --rank, rank 0 writes it\n"
"  --kill-rank R --kill-step T\n"
"                    (tests) at step T every rank meets at a barrier, the others\n"
"                    after submitting their reduce of fc0; rank R then raises\n"
"                    SIGKILL instead of submitting it. The survivors' reduce\n"
"                    fails naming rank R, the supervisor restarts rank R with\n"
"                    --resume-step T, and every rank retries step T\n"
"  --resume-step T   re-attach to a running job (groups opened, not registered)\n"
"                    and join the retry of step T\n"
"  --attempt A       with --resume-step: the attempt number of the retry (default 1)\n"
"  --version         print the version and exit\n",
		MLP_DEFAULT_STEPS, MLP_DEFAULT_JOB);
}

static int parse_u64(const char *s, const char *what, uint64_t max, uint64_t *out)
{
	char *end;
	unsigned long long v;

	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || end == s || *end || s[0] == '-' || v > max) {
		fprintf(stderr, "train_mlp: %s '%s' is not an integer in 0..%" PRIu64 "\n", what, s, max);
		return -EINVAL;
	}
	*out = v;
	return 0;
}

static int opts_parse(int argc, char **argv, struct opts *o)
{
	static const struct option longopts[] = {
		{ "spawn", required_argument, NULL, 's' },
		{ "rank", required_argument, NULL, 'r' },
		{ "world", required_argument, NULL, 'w' },
		{ "steps", required_argument, NULL, 'k' },
		{ "socket", required_argument, NULL, 'S' },
		{ "job", required_argument, NULL, 'j' },
		{ "dump", required_argument, NULL, 'd' },
		{ "reference", no_argument, NULL, 'R' },
		{ "kill-rank", required_argument, NULL, 'K' },
		{ "kill-step", required_argument, NULL, 'T' },
		{ "resume-step", required_argument, NULL, 'U' },
		{ "attempt", required_argument, NULL, 'A' },
		{ "device", required_argument, NULL, 'D' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 },
	};
	uint64_t v;
	int c, have_kill_step = 0;

	memset(o, 0, sizeof(*o));
	o->rank = -1;
	o->steps = MLP_DEFAULT_STEPS;
	o->job = MLP_DEFAULT_JOB;
	o->kill_rank = -1;
	o->resume_step = -1;
	o->attempt = 1;
	o->device = SHARDD_HELLO_DEVICE_HOST;
	while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
		switch (c) {
		case 's':
			if (parse_u64(optarg, "--spawn", SHARDD_MAX_WORLD, &v) || v == 0)
				goto bad;
			o->spawn = (uint32_t)v;
			break;
		case 'r':
			if (parse_u64(optarg, "--rank", SHARDD_MAX_WORLD - 1, &v))
				goto bad;
			o->rank = (int64_t)v;
			break;
		case 'w':
			if (parse_u64(optarg, "--world", SHARDD_MAX_WORLD, &v) || v == 0)
				goto bad;
			o->world = (uint32_t)v;
			break;
		case 'k':
			if (parse_u64(optarg, "--steps", 1u << 24, &v))
				goto bad;
			o->steps = v;
			break;
		case 'S': o->socket = optarg; break;
		case 'j': o->job = optarg; break;
		case 'd': o->dump = optarg; break;
		case 'R': o->reference = 1; break;
		case 'K':
			if (parse_u64(optarg, "--kill-rank", SHARDD_MAX_WORLD - 1, &v))
				goto bad;
			o->kill_rank = (int64_t)v;
			break;
		case 'T':
			if (parse_u64(optarg, "--kill-step", 1u << 24, &v))
				goto bad;
			o->kill_step = v;
			have_kill_step = 1;
			break;
		case 'U':
			if (parse_u64(optarg, "--resume-step", 1u << 24, &v))
				goto bad;
			o->resume_step = (int64_t)v;
			break;
		case 'D':
			if (parse_u64(optarg, "--device", 1023, &v))
				goto bad;
			o->device = (int32_t)v;
			break;
		case 'A':
			if (parse_u64(optarg, "--attempt", MLP_MAX_ATTEMPTS - 1, &v) || v == 0)
				goto bad;
			o->attempt = (uint32_t)v;
			break;
		case 'h':
			usage(stdout);
			exit(0);
		case 'V':
			printf("train_mlp (shardd %s, protocol %d.%d)\n", SHARDD_VERSION,
			       SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR);
			exit(0);
		default:
			goto bad;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "train_mlp: unexpected argument '%s'\n", argv[optind]);
		goto bad;
	}
	if (!!o->spawn + !!o->reference + (o->rank >= 0) != 1) {
		fprintf(stderr, "train_mlp: give exactly one of --spawn N, --rank R --world N, --reference --world N\n");
		goto bad;
	}
	if (o->spawn)
		o->world = o->spawn;
	if (!o->world) {
		fprintf(stderr, "train_mlp: --world N is required with --rank and --reference\n");
		goto bad;
	}
	if (o->rank >= (int64_t)o->world) {
		fprintf(stderr, "train_mlp: --rank %" PRId64 " is not below --world %u\n", o->rank, o->world);
		goto bad;
	}
	if ((o->kill_rank >= 0) != have_kill_step || (o->kill_rank >= 0 && !o->spawn)) {
		fprintf(stderr, "train_mlp: --kill-rank and --kill-step go together, with --spawn\n");
		goto bad;
	}
	if (o->kill_rank >= (int64_t)o->world || (o->kill_rank >= 0 && o->kill_step >= o->steps)) {
		fprintf(stderr, "train_mlp: --kill-rank %" PRId64 " --kill-step %" PRIu64
			" must name a rank below %u and a step below --steps %" PRIu64 "\n",
			o->kill_rank, o->kill_step, o->world, o->steps);
		goto bad;
	}
	if (o->resume_step >= (int64_t)o->steps) {
		fprintf(stderr, "train_mlp: --resume-step %" PRId64 " is not below --steps %" PRIu64 "\n",
			o->resume_step, o->steps);
		goto bad;
	}
	return 0;
bad:
	fprintf(stderr, "train_mlp: see --help\n");
	return -EINVAL;
}

/* ------------------------------------------------------------------ */
/* Reference: the same training in one process, no daemon              */
/* ------------------------------------------------------------------ */

static int reference_main(const struct opts *o)
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
	for (uint64_t t = 0; t < o->steps; t++) {
		double loss = 0.0;

		memset(gsum, 0, sizeof(*gsum));
		for (uint32_t r = 0; r < o->world; r++) {
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
				p->w[l][i] -= MLP_LR * (gsum->w[l][i] / (float)o->world);
			for (uint32_t i = 0; i < layer_out(l); i++)
				p->b[l][i] -= MLP_LR * (gsum->b[l][i] / (float)o->world);
		}
		printf("step %" PRIu64 " loss %.6f\n", t, loss / o->world);
		fflush(stdout);
	}
	if (o->dump) {
		const float *w[MLP_LAYERS], *b[MLP_LAYERS];

		for (uint32_t l = 0; l < MLP_LAYERS; l++) {
			w[l] = p->w[l];
			b[l] = p->b[l];
		}
		ret = dump_write(o->dump, w, b);
	}
out:
	free(wk);
	free(g);
	free(gsum);
	free(p);
	return ret;
}

/* ------------------------------------------------------------------ */
/* Rank: one trainer process attached to shardd                        */
/* ------------------------------------------------------------------ */

#define RANK_INFLIGHT 16 /* ops one rank has in flight at most: 3 layers x few ops */

struct inflight {
	int used;
	int done;
	int res;
	uint32_t op;
	uint32_t layer;   /* MLP_LAYERS for barrier */
	uint64_t step;
};

/* Loss report from a rank to its supervisor, one atomic pipe write. */
struct loss_report {
	uint32_t rank;
	uint32_t rsvd;
	uint64_t step;
	double loss;
};

struct rank {
	const struct opts *o;
	uint32_t rank;
	int report_fd;                /* supervisor's pipe; -1: print */
	int kill_armed;               /* this incarnation dies at the kill point */
	struct shardd_client *c;
	struct shardd_group *g[MLP_LAYERS];
	struct inflight ops[RANK_INFLIGHT];
	int wait_ms;                  /* per completion: collective timeout + slack */
	int failed;                   /* first error of this attempt, 0 if none */
	char fail_msg[512];
	struct teacher tc;
	struct mlp_work wk;
	int cuda;                     /* the daemon runs the cuda backend */
	void *unsharded[MLP_LAYERS];  /* cuda: host copies of the unsharded buffers */
	void *grad[MLP_LAYERS];       /* cuda: host copies of the grad buffers */
};

static const char *op_what(const struct inflight *f, char *buf, size_t len)
{
	if (f->layer < MLP_LAYERS)
		snprintf(buf, len, "%s(group '%s', step %" PRIu64 ")", shardd_op_name(f->op),
			 mlp_group_names[f->layer], f->step);
	else
		snprintf(buf, len, "%s(%" PRIu64 ")", shardd_op_name(f->op), f->step);
	return buf;
}

static void rank_fail(struct rank *rk, int res, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Record the attempt's first error and print it: the run's log names every failure. */
static void rank_fail(struct rank *rk, int res, const char *fmt, ...)
{
	char text[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	fprintf(stderr, "train_mlp: rank %u: %s\n", rk->rank, text);
	if (!rk->failed) {
		rk->failed = res;
		snprintf(rk->fail_msg, sizeof(rk->fail_msg), "%s", text);
	}
}

/* ------------------------------------------------------------------ */
/* Group buffers seen from this process                                */
/* ------------------------------------------------------------------ */

/*
 * Copy n bytes between this process's memory and a cuda-backend group
 * buffer (device memory), finished before returning: without a stream set
 * (shardd_set_stream), the daemon's work does not wait for this process's
 * copies. 0, or the error recorded with rank_fail.
 */
static int rank_copy(struct rank *rk, void *dst, const void *src, size_t n, int to_device)
{
#ifdef SHARDD_HAVE_CUDA
	cudaError_t e = cudaMemcpy(dst, src, n, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);

	/* A copy to the device from pageable memory may return before its DMA lands; one from it may not. */
	if (e == cudaSuccess && to_device)
		e = cudaDeviceSynchronize();
	if (e == cudaSuccess)
		return 0;
	rank_fail(rk, -EIO, "copying %zu bytes %s the device failed: %s", n, to_device ? "to" : "from",
		  cudaGetErrorString(e));
#else
	(void)dst;
	(void)src;
	(void)to_device;
	rank_fail(rk, -ENOTSUP, "copying %zu bytes of device memory: this train_mlp was built "
		  "without CUDA", n);
#endif
	return rk->failed;
}

/* Param i of layer l's unsharded params, where the CPU reads them. */
static const float *rank_unsharded(const struct rank *rk, uint32_t l, uint32_t i)
{
	if (!rk->cuda)
		return shardd_group_unsharded(rk->g[l], i);
	return (const float *)((const char *)rk->unsharded[l] +
			       shardd_group_layout(rk->g[l], i)->unsharded_offset);
}

/* Param i of layer l's grads, where the CPU writes them. */
static float *rank_grad(const struct rank *rk, uint32_t l, uint32_t i)
{
	if (!rk->cuda)
		return shardd_group_grad(rk->g[l], i);
	return (float *)((char *)rk->grad[l] + shardd_group_layout(rk->g[l], i)->grad_offset);
}

/* After layer l's unshard completed: cuda, copy the gathered params where rank_unsharded reads. */
static int rank_fetch_unsharded(struct rank *rk, uint32_t l)
{
	const char *dev = shardd_group_unsharded(rk->g[l], 0);

	if (!rk->cuda)
		return 0;
	return rank_copy(rk, rk->unsharded[l], dev - shardd_group_layout(rk->g[l], 0)->unsharded_offset,
			 (size_t)shardd_group_info(rk->g[l])->unsharded_size, 0);
}

/* Before layer l's reduce: cuda, copy the grads backward wrote where the daemon reads them. */
static int rank_put_grad(struct rank *rk, uint32_t l)
{
	char *dev = shardd_group_grad(rk->g[l], 0);

	if (!rk->cuda)
		return 0;
	return rank_copy(rk, dev - shardd_group_layout(rk->g[l], 0)->grad_offset, rk->grad[l],
			 (size_t)shardd_group_info(rk->g[l])->grad_size, 1);
}

/* Reap one completion into its in-flight slot. 0 or the wait's error. */
static int rank_reap(struct rank *rk)
{
	struct shardd_completion cqe;
	struct inflight *f;
	char what[160];
	int ret;

	ret = shardd_wait(rk->c, &cqe, rk->wait_ms);
	if (ret < 0) {
		size_t n = 0;
		char pending[256] = "";

		for (unsigned i = 0; i < RANK_INFLIGHT && n < sizeof(pending) - 64; i++)
			if (rk->ops[i].used && !rk->ops[i].done)
				n += snprintf(pending + n, sizeof(pending) - n, "%s%s", n ? ", " : "",
					      op_what(&rk->ops[i], what, sizeof(what)));
		rank_fail(rk, ret, "waiting up to %d ms for %s: %s",
			  rk->wait_ms, pending, shardd_last_error()[0] ? shardd_last_error() : shardd_strerror(ret));
		return ret;
	}
	if (cqe.user_data == 0 || cqe.user_data > RANK_INFLIGHT ||
	    !rk->ops[cqe.user_data - 1].used || rk->ops[cqe.user_data - 1].done) {
		rank_fail(rk, -EPROTO, "completion with unexpected user_data %" PRIu64 " (op %u, step %" PRIu64 ")",
			  cqe.user_data, cqe.op, cqe.step);
		return -EPROTO;
	}
	f = &rk->ops[cqe.user_data - 1];
	f->done = 1;
	f->res = cqe.res;
	if (cqe.res < 0)
		rank_fail(rk, cqe.res, "%s failed: %s", op_what(f, what, sizeof(what)),
			  cqe.msg[0] ? cqe.msg : shardd_strerror(cqe.res));
	return 0;
}

/*
 * Submit an op; returns its slot (>= 0) or a negative error. A full SQ is
 * not an error: reap a completion and retry.
 */
static int rank_submit(struct rank *rk, uint32_t op, uint32_t layer, uint64_t step, uint32_t flags)
{
	uint32_t group = layer < MLP_LAYERS ? shardd_group_id(rk->g[layer]) : 0;
	struct inflight *f = NULL;
	char what[160];
	int slot, ret;

	for (slot = 0; slot < RANK_INFLIGHT; slot++) {
		if (!rk->ops[slot].used) {
			f = &rk->ops[slot];
			break;
		}
	}
	if (!f) {
		rank_fail(rk, -ENOSPC, "more than %d ops in flight", RANK_INFLIGHT);
		return -ENOSPC;
	}
	*f = (struct inflight){ .used = 1, .op = op, .layer = layer, .step = step };
	while ((ret = shardd_submit(rk->c, op, group, step, flags, (uint64_t)slot + 1)) == -EAGAIN) {
		ret = rank_reap(rk); /* reports its own failure */
		if (ret < 0)
			goto err;
	}
	if (ret < 0) {
		rank_fail(rk, ret, "submit %s: %s", op_what(f, what, sizeof(what)), shardd_last_error());
		goto err;
	}
	return slot;
err:
	f->used = 0;
	return ret;
}

/* Wait for the op in `slot`, free the slot; its result. */
static int rank_wait(struct rank *rk, int slot)
{
	struct inflight *f = &rk->ops[slot];
	int ret;

	while (!f->done) {
		ret = rank_reap(rk);
		if (ret < 0)
			return ret;
	}
	f->used = 0;
	return f->res;
}

/* Wait for every op in flight. The attempt's first error, or 0. */
static int rank_drain(struct rank *rk)
{
	for (int i = 0; i < RANK_INFLIGHT; i++) {
		if (rk->ops[i].used && rank_wait(rk, i) < 0 && !rk->ops[i].done) {
			/* The wait itself failed: nothing more will complete. */
			for (int j = 0; j < RANK_INFLIGHT; j++)
				rk->ops[j].used = 0;
			break;
		}
	}
	return rk->failed;
}

static int rank_sync_op(struct rank *rk, uint32_t op, uint32_t layer, uint64_t step)
{
	int slot = rank_submit(rk, op, layer, step, 0);

	return slot < 0 ? slot : rank_wait(rk, slot);
}

/* p -= lr * grad over n floats: the whole shard, padding included (its grad is zero). */
static void sgd(float *p, const float *gr, uint64_t n)
{
	for (uint64_t k = 0; k < n; k++)
		p[k] -= MLP_LR * gr[k];
}

/* SGD on this rank's flat shards; cuda: through host copies of the shard and its grad. */
static int rank_sgd(struct rank *rk)
{
	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		for (uint32_t i = 0; i < 2; i++) {
			float *p = shardd_group_shard(rk->g[l], i);
			float *gr = shardd_group_shard_grad(rk->g[l], i);
			size_t bytes = (size_t)shardd_group_layout(rk->g[l], i)->shard_bytes;
			float *hp, *hg;

			if (!rk->cuda) {
				sgd(p, gr, bytes / sizeof(float));
				continue;
			}
			hp = malloc(bytes);
			hg = malloc(bytes);
			if (!hp || !hg)
				rank_fail(rk, -ENOMEM, "out of memory for a %zu-byte shard", bytes);
			else if (!rank_copy(rk, hp, p, bytes, 0) && !rank_copy(rk, hg, gr, bytes, 0)) {
				sgd(hp, hg, bytes / sizeof(float));
				rank_copy(rk, p, hp, bytes, 1);
			}
			free(hp);
			free(hg);
			if (rk->failed)
				return rk->failed;
		}
	}
	return 0;
}

/*
 * The planned crash of --kill-rank R --kill-step T, in place of submitting
 * the reduce of fc0 at step T. Every rank meets at barrier op_key(T, 0, 1)
 * first, the survivors after submitting their reduce: the daemon takes a
 * ring's entries in order, so once the barrier completes it holds every
 * survivor's arrival in that reduce, and rank R dies while they wait in it.
 * Without the barrier a survivor could submit after the daemon noticed the
 * death and wait for the collective timeout instead. Returns nonzero when
 * the step failed (survivors), never returns in rank R.
 */
static int rank_kill_point(struct rank *rk, uint64_t t)
{
	const uint64_t kb = op_key(t, 0, 1);

	if (!rk->kill_armed && rank_submit(rk, SHARDD_OP_REDUCE, 0, kb, 0) < 0)
		return 1;
	if (rank_sync_op(rk, SHARDD_OP_BARRIER, MLP_LAYERS, kb) < 0)
		return 1;
	if (rk->kill_armed) {
		fprintf(stderr, "train_mlp: rank %u: raising SIGKILL instead of reduce(group '%s', step %" PRIu64 ")\n",
			rk->rank, mlp_group_names[0], kb);
		fflush(NULL);
		raise(SIGKILL);
	}
	return 0;
}

/*
 * One attempt of training step t. On success the rank's shards hold the
 * step's update. On failure nothing was applied: SGD runs only after every
 * reduce of the step succeeded, so a retried step starts from the same
 * shards.
 */
static int rank_step(struct rank *rk, uint64_t t, uint32_t attempt, double *loss)
{
	const uint64_t kf = op_key(t, attempt, 0), kb = op_key(t, attempt, 1);
	struct mlp_work *wk = &rk->wk;
	int slot;

	rk->failed = 0;
	batch_make(wk, &rk->tc, MLP_SEED, rk->rank, t);

	/* Forward: unshard layer l+1 while layer l computes, reshard after use. */
	slot = rank_submit(rk, SHARDD_OP_UNSHARD, 0, kf, 0);
	for (uint32_t l = 0; l < MLP_LAYERS && slot >= 0; l++) {
		if (rank_wait(rk, slot) < 0 || rank_fetch_unsharded(rk, l))
			break;
		slot = l + 1 < MLP_LAYERS ? rank_submit(rk, SHARDD_OP_UNSHARD, l + 1, kf, 0) : 0;
		layer_forward(wk, l, rank_unsharded(rk, l, 0), rank_unsharded(rk, l, 1));
		if (rank_submit(rk, SHARDD_OP_RESHARD, l, kf, 0) < 0)
			break;
	}
	if (rk->failed)
		return rank_drain(rk);
	*loss = loss_and_seed(wk);

	/* Backward: unshard again (new key), prefetch l-1, reduce each layer's grads. */
	slot = rank_submit(rk, SHARDD_OP_UNSHARD, MLP_LAYERS - 1, kb, 0);
	for (uint32_t l = MLP_LAYERS; l-- > 0 && slot >= 0;) {
		if (rank_wait(rk, slot) < 0 || rank_fetch_unsharded(rk, l))
			break;
		slot = l > 0 ? rank_submit(rk, SHARDD_OP_UNSHARD, l - 1, kb, 0) : 0;
		layer_backward(wk, l, rank_unsharded(rk, l, 0), rank_grad(rk, l, 0), rank_grad(rk, l, 1));
		if (rank_put_grad(rk, l) || rank_submit(rk, SHARDD_OP_RESHARD, l, kb, 0) < 0 || rk->failed)
			break;
		if (l == 0 && attempt == 0 && rk->o->kill_rank >= 0 && t == rk->o->kill_step) {
			if (rank_kill_point(rk, t))
				break;
			continue;
		}
		if (rank_submit(rk, SHARDD_OP_REDUCE, l, kb, 0) < 0)
			break;
	}
	if (rank_drain(rk))
		return rk->failed;

	if (rank_sgd(rk))
		return rk->failed;
	for (uint32_t l = 0; l < MLP_LAYERS; l++)
		if (rank_sync_op(rk, SHARDD_OP_ZERO_GRAD, l, 0) < 0)
			return rk->failed;
	return 0;
}

/*
 * Before a retry of step t: clear the sharded grads that the failed attempt's
 * successful reduces assigned (a reduce accumulates into present grads),
 * then meet every rank, the restarted one included, at a barrier whose
 * number is unique to (t, attempt).
 */
static int rank_resync(struct rank *rk, uint64_t t, uint32_t attempt)
{
	rk->failed = 0;
	for (uint32_t l = 0; l < MLP_LAYERS; l++)
		if (rank_sync_op(rk, SHARDD_OP_ZERO_GRAD, l, 0) < 0)
			return rk->failed;
	if (rank_sync_op(rk, SHARDD_OP_BARRIER, MLP_LAYERS, op_key(t, attempt, 0)) < 0)
		return rk->failed;
	return 0;
}

static int rank_report(struct rank *rk, uint64_t t, double loss)
{
	struct loss_report rep = { .rank = rk->rank, .step = t, .loss = loss };

	if (rk->report_fd < 0) {
		printf("rank %u step %" PRIu64 " loss %.6f\n", rk->rank, t, loss);
		fflush(stdout);
		return 0;
	}
	/* One write under PIPE_BUF is atomic: reports of ranks never interleave. */
	if (write(rk->report_fd, &rep, sizeof(rep)) != (ssize_t)sizeof(rep)) {
		fprintf(stderr, "train_mlp: rank %u: loss report to the supervisor failed: %s\n",
			rk->rank, strerror(errno));
		return -EPIPE;
	}
	return 0;
}

/* Attach; a restarted rank retries while the daemon still holds its old session. */
static int rank_connect(struct rank *rk)
{
	struct shardd_attach_opts ao = {
		.socket_path = rk->o->socket,
		.job = rk->o->job,
		.rank = rk->rank,
		.replicate = 1,
		.shard = rk->o->world,
		.device = rk->o->device,
	};
	struct timespec pause = { .tv_nsec = 10 * 1000 * 1000 };
	int ret;

	for (int waited = 0;; waited += 10) {
		ret = shardd_connect(&ao, &rk->c);
		if (ret != -SHARDD_E_RANK_TAKEN || rk->o->resume_step < 0 || waited >= MLP_RECONNECT_MS)
			break;
		nanosleep(&pause, NULL);
	}
	if (ret < 0) {
		fprintf(stderr, "train_mlp: rank %u: attach to job '%s' failed: %s\n",
			rk->rank, rk->o->job, shardd_last_error());
		return ret;
	}
	rk->cuda = shardd_backend(rk->c) == SHARDD_BACKEND_CUDA;
	if (rk->cuda && rk->o->device < 0) {
		fprintf(stderr, "train_mlp: rank %u: the daemon runs --backend cuda: give --device N\n",
			rk->rank);
		return -EINVAL;
	}
#ifdef SHARDD_HAVE_CUDA
	if (rk->cuda && cudaSetDevice(rk->o->device) != cudaSuccess) {
		fprintf(stderr, "train_mlp: rank %u: cudaSetDevice(%d) failed\n", rk->rank, rk->o->device);
		return -ENODEV;
	}
#endif
	return 0;
}

/* cuda: host copies of every layer's unsharded and grad buffers. */
static int rank_host_copies(struct rank *rk)
{
	for (uint32_t l = 0; l < MLP_LAYERS && rk->cuda; l++) {
		rk->unsharded[l] = malloc((size_t)shardd_group_info(rk->g[l])->unsharded_size);
		rk->grad[l] = malloc((size_t)shardd_group_info(rk->g[l])->grad_size);
		if (!rk->unsharded[l] || !rk->grad[l]) {
			fprintf(stderr, "train_mlp: rank %u: out of memory for host copies\n", rk->rank);
			return -ENOMEM;
		}
	}
	return 0;
}

static int rank_groups(struct rank *rk)
{
	struct mlp_params *init = NULL;
	int ret = 0;

	if (rk->o->resume_step < 0) {
		init = malloc(sizeof(*init));
		if (!init)
			return -ENOMEM;
		/* Every rank builds the same full init from the seed and loads its rows. */
		mlp_init(init, MLP_SEED);
	}
	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		struct shardd_param_desc pd[2] = {
			{ .name = "weight", .dtype = SHARDD_DTYPE_FP32, .ndim = 2,
			  .shape = { layer_out(l), layer_in(l) } },
			{ .name = "bias", .dtype = SHARDD_DTYPE_FP32, .ndim = 1,
			  .shape = { layer_out(l) } },
		};
		struct shardd_policy policy = { SHARDD_DTYPE_NONE, SHARDD_DTYPE_NONE };

		if (!init) {
			/* Re-attached: the daemon kept this rank's shards. */
			ret = shardd_group_open(rk->c, mlp_group_names[l], &rk->g[l]);
		} else {
			ret = shardd_group_register(rk->c, mlp_group_names[l], pd, 2, &policy, &rk->g[l]);
			if (ret == 0)
				ret = shardd_group_load_full(rk->g[l], 0, init->w[l]);
			if (ret == 0)
				ret = shardd_group_load_full(rk->g[l], 1, init->b[l]);
		}
		if (ret < 0) {
			fprintf(stderr, "train_mlp: rank %u: group '%s': %s\n", rk->rank,
				mlp_group_names[l], shardd_last_error());
			break;
		}
		if (shardd_group_nparams(rk->g[l]) != 2 ||
		    shardd_group_layout(rk->g[l], 0)->unsharded_bytes != sizeof(float) * layer_out(l) * layer_in(l) ||
		    shardd_group_layout(rk->g[l], 1)->unsharded_bytes != sizeof(float) * layer_out(l)) {
			fprintf(stderr, "train_mlp: rank %u: group '%s' in the daemon does not have this"
				" model's shape (%ux%u weight, %u bias); use a fresh --job name\n",
				rk->rank, mlp_group_names[l], layer_out(l), layer_in(l), layer_out(l));
			ret = -SHARDD_E_MISMATCH;
			break;
		}
	}
	free(init);
	return ret;
}

/* The final params, from one more unshard; rank 0 writes them when --dump was given. */
static int rank_final(struct rank *rk)
{
	const float *w[MLP_LAYERS], *b[MLP_LAYERS];
	const uint64_t key = op_key(rk->o->steps, 0, 0);
	int ret = 0;

	rk->failed = 0;
	for (uint32_t l = 0; l < MLP_LAYERS; l++)
		if (rank_submit(rk, SHARDD_OP_UNSHARD, l, key, 0) < 0)
			break;
	if (rank_drain(rk))
		return rk->failed;
	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		if (rank_fetch_unsharded(rk, l))
			return rk->failed;
		w[l] = rank_unsharded(rk, l, 0);
		b[l] = rank_unsharded(rk, l, 1);
	}
	if (rk->rank == 0 && rk->o->dump)
		ret = dump_write(rk->o->dump, w, b);
	for (uint32_t l = 0; l < MLP_LAYERS; l++)
		if (rank_submit(rk, SHARDD_OP_RESHARD, l, key, 0) < 0)
			break;
	if (rank_drain(rk))
		return rk->failed;
	return ret;
}

static int rank_main(const struct opts *o, uint32_t rank, int report_fd, int kill_armed)
{
	struct rank *rk = calloc(1, sizeof(*rk));
	uint64_t t;
	uint32_t attempt = 0;
	int ret;

	if (!rk) {
		fprintf(stderr, "train_mlp: rank %u: out of memory\n", rank);
		return -ENOMEM;
	}
	rk->o = o;
	rk->rank = rank;
	rk->report_fd = report_fd;
	rk->kill_armed = kill_armed;
	teacher_init(&rk->tc, MLP_SEED);
	ret = rank_connect(rk);
	if (ret < 0)
		goto out;
	rk->wait_ms = (int)shardd_collective_timeout_ms(rk->c) + 10000;
	ret = rank_groups(rk);
	if (ret == 0)
		ret = rank_host_copies(rk);
	if (ret < 0)
		goto out;

	t = 0;
	if (o->resume_step >= 0) {
		t = (uint64_t)o->resume_step;
		attempt = o->attempt;
		ret = rank_resync(rk, t, attempt);
		if (ret < 0)
			goto out;
		fprintf(stderr, "train_mlp: rank %u: re-attached; joining attempt %u of step %" PRIu64 "\n",
			rank, attempt, t);
	}
	while (t < o->steps) {
		double loss = 0.0;

		ret = rank_step(rk, t, attempt, &loss);
		if (ret == 0) {
			ret = rank_report(rk, t, loss);
			if (ret < 0)
				goto out;
			t++;
			attempt = 0;
			continue;
		}
		/* A rank died mid-step: it will come back, and the step is redone. */
		if ((ret != -SHARDD_E_PEER_DIED && ret != -SHARDD_E_TIMEOUT) || attempt + 1 >= MLP_MAX_ATTEMPTS)
			goto out;
		attempt++;
		fprintf(stderr, "train_mlp: rank %u: step %" PRIu64 " failed (%s); nothing applied,"
			" retrying it as attempt %u once every rank is back\n", rank, t, rk->fail_msg, attempt);
		ret = rank_resync(rk, t, attempt);
		if (ret < 0)
			goto out;
	}
	/* Every rank takes part: the final unshard is a collective even where only rank 0 dumps. */
	ret = rank_final(rk);
out:
	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		shardd_group_close(rk->g[l]);
		free(rk->unsharded[l]);
		free(rk->grad[l]);
	}
	shardd_close(rk->c);
	free(rk);
	return ret;
}

/* ------------------------------------------------------------------ */
/* Supervisor: --spawn N                                               */
/* ------------------------------------------------------------------ */

struct child {
	pid_t pid;   /* 0: exited */
	int pidfd;
	int restarted;
};

/* Fork rank `rank`: it trains and reports losses on report_fd. */
static pid_t spawn_rank(struct opts *o, uint32_t rank, int report_rd, int report_wr, int kill_armed)
{
	pid_t pid;

	fflush(NULL);
	pid = fork();
	if (pid < 0) {
		fprintf(stderr, "train_mlp: fork of rank %u failed: %s\n", rank, strerror(errno));
		return -errno;
	}
	if (pid == 0) {
		int ret;

		close(report_rd);
		ret = rank_main(o, rank, report_wr, kill_armed);
		fflush(NULL);
		_exit(ret < 0 ? 1 : 0);
	}
	return pid;
}

static void kill_children(struct child *ch, uint32_t n)
{
	for (uint32_t r = 0; r < n; r++)
		if (ch[r].pid > 0)
			kill(ch[r].pid, SIGTERM);
}

/* Take loss reports; print each step's mean once every rank reported it. */
static int take_reports(int fd, const struct opts *o, double *loss, uint32_t *have, uint64_t *next)
{
	struct loss_report rep;
	ssize_t n;

	while ((n = read(fd, &rep, sizeof(rep))) == (ssize_t)sizeof(rep)) {
		if (rep.rank >= o->world || rep.step >= o->steps) {
			fprintf(stderr, "train_mlp: bad loss report (rank %u, step %" PRIu64 ")\n",
				rep.rank, rep.step);
			return -EPROTO;
		}
		loss[rep.step * o->world + rep.rank] = rep.loss;
		have[rep.step]++;
		while (*next < o->steps && have[*next] == o->world) {
			double sum = 0.0;

			for (uint32_t r = 0; r < o->world; r++)
				sum += loss[*next * o->world + r];
			printf("step %" PRIu64 " loss %.6f\n", *next, sum / o->world);
			fflush(stdout);
			(*next)++;
		}
	}
	if (n < 0 && errno != EAGAIN) {
		fprintf(stderr, "train_mlp: reading loss reports: %s\n", strerror(errno));
		return -errno;
	}
	return n == 0 ? 1 : 0; /* 1: EOF */
}

static int spawn_main(struct opts *o)
{
	uint32_t n = o->world, live = 0;
	struct child *ch = calloc(n, sizeof(*ch));
	struct pollfd *pfd = calloc(n + 1, sizeof(*pfd));
	double *loss = calloc(o->steps ? o->steps * n : 1, sizeof(*loss));
	uint32_t *have = calloc(o->steps ? o->steps : 1, sizeof(*have));
	uint64_t next = 0;
	int pipefd[2] = { -1, -1 }, failed = 0, ret;

	if (!ch || !pfd || !loss || !have) {
		fprintf(stderr, "train_mlp: out of memory\n");
		failed = 1;
		goto out;
	}
	/* Non-blocking read end: take_reports reads what is there, poll says when. */
	if (pipe2(pipefd, O_CLOEXEC) < 0 || fcntl(pipefd[0], F_SETFL, O_NONBLOCK) < 0) {
		fprintf(stderr, "train_mlp: pipe: %s\n", strerror(errno));
		failed = 1;
		goto out;
	}
	for (uint32_t r = 0; r < n; r++)
		ch[r].pidfd = -1;
	for (uint32_t r = 0; r < n; r++) {
		ch[r].pid = spawn_rank(o, r, pipefd[0], pipefd[1], o->kill_rank == (int64_t)r);
		if (ch[r].pid > 0)
			ch[r].pidfd = pidfd_open(ch[r].pid, 0);
		if (ch[r].pid <= 0 || ch[r].pidfd < 0) {
			if (ch[r].pid > 0)
				fprintf(stderr, "train_mlp: pidfd_open(rank %u): %s\n", r, strerror(errno));
			failed = 1;
			kill_children(ch, n);
			break;
		}
		live++;
	}
	/*
	 * Children's liveness is watched through pidfds (pfd[r + 1]; -1, which
	 * poll skips, once rank r is gone), reports through the pipe.
	 */
	while (live > 0) {
		pfd[0] = (struct pollfd){ .fd = pipefd[0], .events = POLLIN };
		for (uint32_t r = 0; r < n; r++)
			pfd[r + 1] = (struct pollfd){ .fd = ch[r].pid > 0 ? ch[r].pidfd : -1,
						      .events = POLLIN };
		if (poll(pfd, n + 1, -1) < 0) {
			if (errno == EINTR)
				continue;
			fprintf(stderr, "train_mlp: poll: %s\n", strerror(errno));
			failed = 1;
			kill_children(ch, n);
			break;
		}
		if (pfd[0].revents & POLLIN) {
			if (take_reports(pipefd[0], o, loss, have, &next) < 0) {
				failed = 1;
				kill_children(ch, n);
			}
		}
		for (uint32_t r = 0; r < n; r++) {
			int st;

			if (ch[r].pid <= 0 || !pfd[r + 1].revents)
				continue;
			if (waitpid(ch[r].pid, &st, 0) < 0) {
				fprintf(stderr, "train_mlp: waitpid(rank %u): %s\n", r, strerror(errno));
				st = 0xff00;
			}
			close(ch[r].pidfd);
			ch[r].pidfd = -1;
			ch[r].pid = 0;
			live--;
			if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
				continue;
			if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL && o->kill_rank == (int64_t)r &&
			    !ch[r].restarted && !failed) {
				struct opts ro = *o;

				fprintf(stderr, "train_mlp: rank %u killed itself (SIGKILL) at step %" PRIu64
					" as planned; restarting it with --resume-step %" PRIu64 "\n",
					r, o->kill_step, o->kill_step);
				ro.resume_step = (int64_t)o->kill_step;
				ro.attempt = 1;
				ro.kill_rank = -1;
				ch[r].restarted = 1;
				ch[r].pid = spawn_rank(&ro, r, pipefd[0], pipefd[1], 0);
				if (ch[r].pid > 0)
					ch[r].pidfd = pidfd_open(ch[r].pid, 0);
				if (ch[r].pid > 0 && ch[r].pidfd >= 0) {
					live++;
					continue;
				}
				if (ch[r].pid > 0)
					kill(ch[r].pid, SIGKILL);
				ch[r].pid = 0;
			} else if (WIFSIGNALED(st)) {
				fprintf(stderr, "train_mlp: rank %u killed by signal %d\n", r, WTERMSIG(st));
			} else {
				fprintf(stderr, "train_mlp: rank %u exited with status %d\n", r, WEXITSTATUS(st));
			}
			if (!failed)
				kill_children(ch, n);
			failed = 1;
		}
	}
	/* Every writer but ours is gone: read what is left up to EOF. */
	close(pipefd[1]);
	pipefd[1] = -1;
	if (!failed && (ret = take_reports(pipefd[0], o, loss, have, &next)) != 1)
		failed = 1;
	if (!failed && next != o->steps) {
		fprintf(stderr, "train_mlp: only %" PRIu64 " of %" PRIu64 " steps were reported by every rank\n",
			next, o->steps);
		failed = 1;
	}
out:
	if (pipefd[0] >= 0)
		close(pipefd[0]);
	if (pipefd[1] >= 0)
		close(pipefd[1]);
	free(have);
	free(loss);
	free(pfd);
	free(ch);
	return failed ? -1 : 0;
}

int main(int argc, char **argv)
{
	struct opts o;
	int ret;

	if (opts_parse(argc, argv, &o) < 0)
		return 2;
	if (o.reference)
		ret = reference_main(&o);
	else if (o.spawn)
		ret = spawn_main(&o);
	else
		ret = rank_main(&o, (uint32_t)o.rank, -1, 0);
	return ret < 0 ? 1 : 0;
}
