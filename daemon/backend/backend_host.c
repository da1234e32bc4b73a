/* SPDX-License-Identifier: MIT */
/*
 * Host backend: buffers are sealed memfds mapped in the daemon, clients map
 * the same pages (the unsharded buffer sealed read-only: host_seal_export);
 * kernels run on host pointers, split across the worker pool.
 *
 * An op is planned as a list of pieces (a cast of a range of one param's
 * elements, a chunk-cat of some outer indices, a reduction of a range of
 * one param's valid shard elements, a padding fill), each about one grain
 * of work, grouped into batches of about one grain; the pool runs the
 * batches in parallel. Many small params share a batch, one large param
 * spans many. The grain is HOST_GRAIN elements, coarser for an op so large
 * that the plan would pass HOST_PLAN_PIECES pieces: a plan holds at most
 * about 2 * HOST_PLAN_PIECES + 2 pieces per param, whatever the sizes, so
 * planning a 1 TiB group takes a few MiB, not hundreds. A param with no
 * elements (a zero-size dim) is never visited: no work, and no division by
 * a count of 0.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend.h"
#include "pool.h"

/* Elements of work per batch: large enough to amortize a claim, small enough to balance 2..64 cores. */
#define HOST_GRAIN ((uint64_t)1 << 15)
/* Pieces a plan aims at, at most, besides two per param (24 bytes each, 8 per batch: a few MiB). */
#define HOST_PLAN_PIECES ((uint64_t)1 << 16)
/*
 * An op of at most this much work runs on the calling thread alone: 128 Ki
 * elements is about 10 us of fp32->bf16 cast on the 2-core CI VM, less
 * than the 30-60 us a sleeping worker takes to wake, so a helper would
 * arrive after the work is done. A larger task on the loop thread
 * (HOST_INLINE_MAX_BYTES) enlists workers, without waiting for them.
 */
#define HOST_SOLO_WORK (4 * HOST_GRAIN)
/*
 * A task that reads and writes at most this many bytes runs on the
 * engine's loop thread (inline_max_bytes, backend.h), which calls the
 * kernels itself; above HOST_SOLO_WORK it splits them with shd_pool_for,
 * where idle workers join in and the loop thread never waits for one to
 * wake (helpers not yet taken are withdrawn). A task on the pool instead
 * pays a sleeping worker's wake-up before any work and the loop's own
 * wake-up (the engine's eventfd) after it: 30 - 60 us each on the 2-core
 * CI VM. Measured there with `shardbench latency` (docs/BENCHMARKS.md,
 * "Small collectives"), 2 ranks, p50 of the whole op: 16 MiB instead of
 * 256 KiB took 256 KiB unshard / reduce from 54 / 196 us to 39 / 145,
 * 1 MiB and 2 MiB 25 - 30 % faster, 4 MiB unshard (12 MiB moved) ~1.5x;
 * larger ops are memory-bound and gain nothing. The price: while such a
 * task runs (at most ~1 ms at this size) the loop serves no other ring.
 */
#define HOST_INLINE_MAX_BYTES ((uint64_t)16 << 20)
/* Bytes per range of a parallel zero-fill: a zero of at most one range wakes no worker. */
#define HOST_ZERO_GRAIN ((size_t)1 << 20)
/*
 * An op whose output is at least this large writes it with streaming
 * stores (shardd_k_cast_stream, shardd_k_reduce_stream): it cannot stay in
 * a 32 MiB last-level cache for its reader anyway, and skipping the read
 * of each output line that a normal store causes measured +15-20 % on a
 * memory-bound cast. Smaller outputs stay cached for the trainer that
 * reads them next. A constant, not sysconf's L3 size: in VMs that reports
 * the host's total (384 MiB on the CI machine, whose guest has 32).
 */
#define HOST_STREAM_MIN_BYTES ((uint64_t)32 << 20)

struct host_backend {
	struct shd_backend_ctx base;
	struct shd_pool *pool;
	unsigned colors; /* buffers mapped so far: the next one's colour (host_map_colored) */
};

enum host_piece_kind {
	PIECE_CAST = 1,  /* unshard, dim 0: elements [begin, begin + n) of the unsharded param */
	PIECE_CHUNK_CAT, /* unshard, Shard(i > 0): outer indices [begin, begin + n) */
	PIECE_REDUCE,    /* reduce: elements [begin, begin + n) of the valid rows of every outer
			    index of the output shard, outer index by outer index */
	PIECE_ZERO, /* reduce: elements [begin, begin + n) of the output shard (its padding rows) */
	PIECE_REDUCE_STEP, /* reduce_step: as PIECE_REDUCE, the sum fed to the step's update */
};

struct host_piece {
	uint32_t kind;
	uint32_t param;
	uint64_t begin;
	uint64_t n;
};

struct host_plan {
	struct host_piece *pieces;
	size_t npieces, cap;
	size_t *batches; /* batch b is pieces [batches[b], batches[b + 1]) */
	size_t nbatches, bcap;
	uint64_t grain;  /* work per piece and per batch: HOST_GRAIN, or coarser (plan_init) */
	uint64_t weight; /* work in the open batch */
	uint64_t total;  /* work in all batches */
};

struct host_op {
	const struct shd_unshard_args *unshard;
	const struct shd_reduce_args *reduce;
	const struct host_plan *plan;
	int stream; /* write the output with streaming stores */
	/* The output this run writes: an unshard's (distinct) unsharded buffer, or member k of a reduce. */
	struct shd_buf *unsharded;
	const struct shd_shard_view *out, *add; /* add: NULL for none */
	uint32_t shard_rank;                    /* reduce: the rows of out */
	int accumulate;
	const struct shd_step_args *step; /* reduce_step: member k's step, fed from its sum */
};

static inline uint8_t *host_ptr(const struct shd_buf *b)
{
	return b->priv;
}

/* An empty plan for an op of `work` elements of work in all. */
static void plan_init(struct host_plan *pl, uint64_t work)
{
	uint64_t grain = work / HOST_PLAN_PIECES + 1;

	memset(pl, 0, sizeof(*pl));
	pl->grain = grain > HOST_GRAIN ? grain : HOST_GRAIN;
}

static int plan_add(struct host_plan *pl, const struct host_piece *pc, uint64_t weight)
{
	if (pl->npieces == pl->cap) {
		size_t cap = pl->cap ? pl->cap * 2 : 256;
		struct host_piece *np = realloc(pl->pieces, cap * sizeof(*np));

		if (!np)
			return -ENOMEM;
		pl->pieces = np;
		pl->cap = cap;
	}
	if (pl->nbatches + 2 > pl->bcap) {
		size_t cap = pl->bcap ? pl->bcap * 2 : 64;
		size_t *nb = realloc(pl->batches, cap * sizeof(*nb));

		if (!nb)
			return -ENOMEM;
		pl->batches = nb;
		pl->bcap = cap;
	}
	if (pl->weight == 0)
		pl->batches[pl->nbatches] = pl->npieces;
	pl->pieces[pl->npieces++] = *pc;
	weight = weight ? weight : 1;
	pl->weight += weight;
	pl->total += weight;
	if (pl->weight >= pl->grain) {
		pl->nbatches++;
		pl->weight = 0;
	}
	return 0;
}

/* Close the open batch; afterwards batches[nbatches] ends the last one. */
static void plan_close(struct host_plan *pl)
{
	if (pl->weight) {
		pl->nbatches++;
		pl->weight = 0;
	}
	if (pl->batches)
		pl->batches[pl->nbatches] = pl->npieces;
}

static void plan_free(struct host_plan *pl)
{
	free(pl->pieces);
	free(pl->batches);
}

/*
 * Add [begin, begin + n) of a piece template in pieces of about one grain
 * of work, each unit weighing `unit`. Nothing to add when n or unit is 0
 * (a param without elements): no piece, and no division by 0.
 */
static int plan_split(struct host_plan *pl, struct host_piece pc, uint64_t begin, uint64_t n,
		      uint64_t unit)
{
	uint64_t step;
	int ret;

	if (!n || !unit)
		return 0;
	step = pl->grain / unit ? pl->grain / unit : 1;
	for (uint64_t at = 0; at < n; at += step) {
		pc.begin = begin + at;
		pc.n = n - at < step ? n - at : step;
		ret = plan_add(pl, &pc, pc.n * unit);
		if (ret)
			return ret;
	}
	return 0;
}

/*
 * Planned only for params with elements, so `chunk` (a shard's elements
 * per outer index) is not 0.
 */
static void host_run_piece_unshard(const struct host_op *op, const struct host_piece *pc)
{
	const struct shd_unshard_args *a = op->unshard;
	const struct shd_layout_param *p = &a->layout->params[pc->param];
	size_t us = shardd_dtype_size(p->unsharded_dtype), ds = shardd_dtype_size(p->dtype);
	uint8_t *dst = host_ptr(op->unsharded) + p->unsharded_offset;
	uint64_t chunk = p->rows * p->inner;

	if (pc->kind == PIECE_CAST) {
		/* Dim 0: element e of the param is element e % chunk of shard e / chunk. */
		for (uint64_t e = pc->begin, end = pc->begin + pc->n; e < end;) {
			uint64_t s = e / chunk, off = e % chunk;
			uint64_t n = end - e < chunk - off ? end - e : chunk - off;
			const uint8_t *src = host_ptr(a->shards[s]) + p->shard_offset + off * ds;

			if (op->stream)
				shardd_k_cast_stream(dst + e * us, p->unsharded_dtype, src,
						     p->dtype, n);
			else
				shardd_k_cast(dst + e * us, p->unsharded_dtype, src, p->dtype, n);
			e += n;
		}
	} else if (!a->part_count) {
		const void *src[SHARDD_MAX_WORLD];

		for (uint32_t r = 0; r < a->nshards; r++)
			src[r] = host_ptr(a->shards[r]) + p->shard_offset + pc->begin * chunk * ds;
		shardd_k_chunk_cat(dst + pc->begin * a->nshards * chunk * us, p->unsharded_dtype,
				   src, p->dtype, a->nshards, pc->n, chunk);
	} else {
		/* A part of the shards: their runs of each outer index, as the chunk-cat places them. */
		for (uint64_t o = pc->begin; o < pc->begin + pc->n; o++)
			for (uint32_t r = a->part_first; r < a->part_first + a->part_count; r++)
				shardd_k_cast(
					dst + (o * a->nshards + r) * chunk * us, p->unsharded_dtype,
					host_ptr(a->shards[r]) + p->shard_offset + o * chunk * ds,
					p->dtype, chunk);
	}
}

/* Reduce `n` elements from element `off` of outer index `o`'s valid rows of the output shard. */
static void host_reduce_run(const struct host_op *op, const struct shd_layout_param *p,
			    uint32_t param, uint64_t o, uint64_t off, uint64_t n)
{
	const struct shd_reduce_args *a = op->reduce;
	uint32_t odt = shd_shard_view_dtype(op->out, p);
	uint64_t at = o * p->rows * p->inner + off; /* element in the output shard */
	uint8_t *out =
		host_ptr(op->out->buf) + op->out->offsets[param] + at * shardd_dtype_size(odt);
	const void *in[SHARDD_MAX_WORLD];
	struct shardd_reduce_math m = a->math;
	uint32_t idt;

	if (a->src == SHD_REDUCE_SRC_GRAD) {
		/* Shard s of the unsharded grad: rows [s*rows, s*rows + valid) of shard_dim, per outer index. */
		uint64_t e =
			o * p->dim * p->inner + (uint64_t)op->shard_rank * p->rows * p->inner + off;
		size_t gs = shardd_dtype_size(p->grad_dtype);

		idt = p->grad_dtype;
		for (uint32_t k = 0; k < a->n; k++)
			in[k] = host_ptr(a->grads[k]) + p->grad_offset + e * gs;
	} else {
		idt = a->in_dtype;
		for (uint32_t k = 0; k < a->n; k++)
			in[k] = host_ptr(a->views[k].buf) + a->views[k].offsets[param] +
				at * shardd_dtype_size(idt);
	}
	m.add = op->add ? host_ptr(op->add->buf) + op->add->offsets[param] +
				  at * shardd_dtype_size(a->math.reduce_dtype)
			: NULL;
	if (op->stream)
		shardd_k_reduce_stream(out, odt, op->accumulate, in, a->n, idt, n, &m);
	else
		shardd_k_reduce(out, odt, op->accumulate, in, a->n, idt, n, &m);
}

/*
 * Planned only where the output shard has valid elements, so `block` (the
 * valid elements per outer index) is not 0.
 */
static void host_run_piece_reduce(const struct host_op *op, const struct host_piece *pc)
{
	const struct shd_layout_param *p = &op->reduce->layout->params[pc->param];
	uint64_t block = shd_layout_rows_valid(p, op->shard_rank) * p->inner;

	if (pc->kind == PIECE_ZERO) {
		size_t os = shardd_dtype_size(shd_shard_view_dtype(op->out, p));

		shardd_k_zero(host_ptr(op->out->buf) + op->out->offsets[pc->param] + pc->begin * os,
			      pc->n * os);
		return;
	}
	for (uint64_t e = pc->begin, end = pc->begin + pc->n; e < end;) {
		uint64_t o = e / block, off = e % block;
		uint64_t n = end - e < block - off ? end - e : block - off;

		host_reduce_run(op, p, pc->param, o, off, n);
		e += n;
	}
}

/*
 * Elements summed at a time by a fused reduce-and-step: the sum waits in
 * an 8 KiB stack buffer (L1) between the reduce kernel and the optimizer
 * kernel, which reads it as the grad; a whole number of SHARDD_K_BLOCKs.
 */
#define HOST_FUSE_CHUNK 2048

/* One chunk's update: member k's step on shard elements [e, e + n) of param p, `grad` its sum. */
static void host_fuse_update(const struct shd_step_args *s, const struct shd_layout_param *p,
			     uint64_t e, uint64_t n, const float *grad)
{
	uint64_t off = p->shard_offset + e * sizeof(float);
	float *param = (float *)(host_ptr(s->shard) + off);

	if (s->kind == SHARDD_OPTIM_SGD) {
		struct shardd_sgd a = s->sgd;

		a.param = param;
		a.grad = grad;
		a.grad_dtype = SHARDD_DTYPE_FP32;
		a.momentum_buffer = s->state[0] ? (float *)(host_ptr(s->state[0]) + off) : NULL;
		shardd_k_sgd(&a, 0, n);
	} else {
		struct shardd_adamw a = s->adamw;

		a.param = param;
		a.grad = grad;
		a.grad_dtype = SHARDD_DTYPE_FP32;
		a.exp_avg = (float *)(host_ptr(s->state[0]) + off);
		a.exp_avg_sq = (float *)(host_ptr(s->state[1]) + off);
		a.max_exp_avg_sq = s->state[2] ? (float *)(host_ptr(s->state[2]) + off) : NULL;
		shardd_k_adamw(&a, 0, n);
	}
}

/*
 * A PIECE_REDUCE_STEP: the piece's valid elements of member k's shard in
 * chunks, each summed as host_reduce_run sums it (assigning, no addend,
 * into fp32) and stepped at once. The valid elements are a prefix of the
 * shard in the output's order (padding rows exist only where outer is 1),
 * so element e of the piece is element e of the shard, as the step sees it.
 */
static void host_run_piece_reduce_step(const struct host_op *op, const struct host_piece *pc)
{
	const struct shd_reduce_args *a = op->reduce;
	const struct shd_layout_param *p = &a->layout->params[pc->param];
	uint64_t block = shd_layout_rows_valid(p, op->shard_rank) * p->inner;
	size_t gs = shardd_dtype_size(p->grad_dtype);
	struct shardd_reduce_math m = a->math;
	float sum[HOST_FUSE_CHUNK] __attribute__((aligned(64)));
	const void *in[SHARDD_MAX_WORLD];

	m.add = NULL;
	for (uint64_t e = pc->begin, end = pc->begin + pc->n; e < end;) {
		uint64_t o = e / block, off = e % block;
		uint64_t n = end - e < block - off ? end - e : block - off;
		/* Shard s of the unsharded grad: rows [s*rows, s*rows + valid) of shard_dim, per outer index. */
		uint64_t at =
			o * p->dim * p->inner + (uint64_t)op->shard_rank * p->rows * p->inner + off;

		n = n < HOST_FUSE_CHUNK ? n : HOST_FUSE_CHUNK;
		for (uint32_t k = 0; k < a->n; k++)
			in[k] = host_ptr(a->grads[k]) + p->grad_offset + at * gs;
		shardd_k_reduce(sum, SHARDD_DTYPE_FP32, 0, in, a->n, p->grad_dtype, n, &m);
		host_fuse_update(op->step, p, e, n, sum);
		e += n;
	}
}

static void host_run_batches(void *arg, size_t begin, size_t end)
{
	const struct host_op *op = arg;

	for (size_t b = begin; b < end; b++) {
		for (size_t i = op->plan->batches[b]; i < op->plan->batches[b + 1]; i++) {
			if (op->unshard)
				host_run_piece_unshard(op, &op->plan->pieces[i]);
			else if (op->step)
				host_run_piece_reduce_step(op, &op->plan->pieces[i]);
			else
				host_run_piece_reduce(op, &op->plan->pieces[i]);
		}
	}
}

/* Run a closed plan: on the calling thread alone when small (HOST_SOLO_WORK), else across the pool. */
static void host_run_plan(struct host_backend *hb, struct host_op *op)
{
	if (op->plan->total <= HOST_SOLO_WORK)
		host_run_batches(op, 0, op->plan->nbatches);
	else
		shd_pool_for(hb->pool, op->plan->nbatches, 1, host_run_batches, op);
}

static int host_unshard(struct shd_backend_ctx *b, const struct shd_unshard_args *a)
{
	struct host_backend *hb = (struct host_backend *)b;
	struct host_plan pl;
	struct host_op op = { .unshard = a, .plan = &pl };
	uint32_t first = a->part_count ? a->part_first : 0;
	uint32_t count = a->part_count ? a->part_count : a->nshards;
	uint64_t work = 0;
	int ret = 0;

	if (first > a->nshards || count > a->nshards - first)
		return -EINVAL;
	/* Layout counts are below 2^38 per param and 2^16 params: no sum overflows. */
	for (uint32_t i = 0; i < a->layout->nparams; i++)
		work += a->layout->params[i].numel;
	plan_init(&pl, work);
	for (uint32_t i = 0; i < a->layout->nparams && !ret; i++) {
		const struct shd_layout_param *p = &a->layout->params[i];
		uint64_t chunk = p->rows * p->inner;
		struct host_piece pc = { .param = i };

		if (!p->numel)
			continue;
		if (p->shard_dim == 0) {
			/* Dim 0: shard s's elements are [s * chunk, (s + 1) * chunk), padding rows dropped. */
			uint64_t lo = first * chunk < p->numel ? first * chunk : p->numel;
			uint64_t hi = (first + count) * chunk < p->numel ? (first + count) * chunk
									 : p->numel;

			pc.kind = PIECE_CAST;
			ret = plan_split(&pl, pc, lo, hi - lo, 1);
		} else {
			pc.kind = PIECE_CHUNK_CAT;
			ret = plan_split(&pl, pc, 0, p->outer, (uint64_t)count * chunk);
		}
	}
	if (!ret) {
		plan_close(&pl);
		op.stream = a->layout->unsharded_size >= HOST_STREAM_MIN_BYTES;
		/* Each distinct output once: ranks that share an unsharded buffer alias it. */
		for (uint32_t s = 0; s < a->nshards; s++) {
			uint32_t t = 0;

			while (t < s && a->unsharded[t] != a->unsharded[s])
				t++;
			if (t < s)
				continue;
			op.unsharded = a->unsharded[s];
			host_run_plan(hb, &op);
		}
	}
	plan_free(&pl);
	return ret;
}

/* Plan and run member k's output of a reduce. */
static int host_reduce_one(struct host_backend *hb, const struct shd_reduce_args *a, uint32_t k)
{
	struct host_plan pl;
	struct host_op op = {
		.reduce = a,
		.plan = &pl,
		.out = &a->outs[k],
		.add = a->adds && a->adds[k].buf ? &a->adds[k] : NULL,
		.shard_rank = a->src == SHD_REDUCE_SRC_GRAD ? k : a->shard_rank,
		.accumulate = a->accumulate[k],
	};
	uint64_t out_bytes = 0, work = 0;
	int ret = 0;

	/* Layout counts are below 2^38 per param, 2^16 params, n <= 1024 inputs: no sum overflows. */
	for (uint32_t i = 0; i < a->layout->nparams; i++)
		work += a->layout->params[i].shard_numel * (a->n + 1);
	plan_init(&pl, work);
	for (uint32_t i = 0; i < a->layout->nparams && !ret; i++) {
		const struct shd_layout_param *p = &a->layout->params[i];
		uint64_t valid = shd_layout_rows_valid(p, op.shard_rank);
		struct host_piece pc = { .param = i, .kind = PIECE_REDUCE };

		if (!p->shard_numel)
			continue;
		out_bytes += p->shard_numel * shardd_dtype_size(shd_shard_view_dtype(op.out, p));
		ret = plan_split(&pl, pc, 0, p->outer * valid * p->inner, a->n);
		if (!ret && valid < p->rows) {
			/* Padding rows exist for dim 0 only, where outer == 1. */
			pc.kind = PIECE_ZERO;
			ret = plan_split(&pl, pc, valid * p->inner, (p->rows - valid) * p->inner,
					 1);
		}
	}
	if (!ret) {
		plan_close(&pl);
		/* Accumulating reads every output line anyway: nothing to save. */
		op.stream = !op.accumulate && out_bytes >= HOST_STREAM_MIN_BYTES;
		host_run_plan(hb, &op);
	}
	plan_free(&pl);
	return ret;
}

static int host_reduce(struct shd_backend_ctx *b, const struct shd_reduce_args *a)
{
	struct host_backend *hb = (struct host_backend *)b;
	int ret = 0;

	if (a->n == 0 || a->n > SHARDD_MAX_WORLD)
		return -EINVAL;
	for (uint32_t k = 0; k < a->n && !ret; k++)
		ret = host_reduce_one(hb, a, k);
	return ret;
}

/* One param's optimizer step: its args with the pointers set, run over [begin, end) of its valid elements. */
struct host_step_param {
	const struct shd_step_args *a;
	struct shardd_sgd sgd;
	struct shardd_adamw adamw;
};

static void host_step_range(void *arg, size_t begin, size_t end)
{
	const struct host_step_param *sp = arg;

	if (sp->a->kind == SHARDD_OPTIM_SGD)
		shardd_k_sgd(&sp->sgd, begin, end);
	else
		shardd_k_adamw(&sp->adamw, begin, end);
}

static float *host_state_at(struct shd_buf *buf, uint64_t offset)
{
	return buf ? (float *)(host_ptr(buf) + offset) : NULL;
}

/* Elements of real data in param p's shard `shard_rank`: its valid rows, a prefix of the shard. */
static uint64_t host_valid_numel(const struct shd_layout_param *p, uint32_t shard_rank)
{
	return p->numel ? p->outer * shd_layout_rows_valid(p, shard_rank) * p->inner : 0;
}

static int host_step(struct shd_backend_ctx *b, const struct shd_step_args *a)
{
	struct host_backend *hb = (struct host_backend *)b;
	const struct shd_layout *l = a->layout;
	struct host_step_param sp = { .a = a, .sgd = a->sgd, .adamw = a->adamw };

	*a->skipped = 0;
	if (a->skip_nonfinite) {
		for (uint32_t i = 0; i < l->nparams && !*a->skipped; i++) {
			const struct shd_layout_param *p = &l->params[i];
			struct shardd_grad_norm_part part;
			uint64_t n = host_valid_numel(p, a->shard_rank);

			if (!n)
				continue;
			shardd_k_grad_norm_part(host_ptr(a->grad) + p->shard_offset,
						SHARDD_DTYPE_FP32, 0, n, &part);
			*a->skipped = part.nonfinite;
		}
		if (*a->skipped)
			return 0;
	}
	for (uint32_t i = 0; i < l->nparams; i++) {
		const struct shd_layout_param *p = &l->params[i];
		uint64_t n = host_valid_numel(p, a->shard_rank), off = p->shard_offset;

		if (!n)
			continue;
		sp.sgd.param = sp.adamw.param = (float *)(host_ptr(a->shard) + off);
		sp.sgd.grad = sp.adamw.grad = host_ptr(a->grad) + off;
		sp.sgd.grad_dtype = sp.adamw.grad_dtype = SHARDD_DTYPE_FP32;
		sp.sgd.momentum_buffer = host_state_at(a->state[0], off);
		sp.adamw.exp_avg = host_state_at(a->state[0], off);
		sp.adamw.exp_avg_sq = host_state_at(a->state[1], off);
		sp.adamw.max_exp_avg_sq = host_state_at(a->state[2], off);
		if (n <= HOST_SOLO_WORK)
			host_step_range(&sp, 0, n);
		else
			shd_pool_for(hb->pool, n, HOST_GRAIN, host_step_range, &sp);
	}
	return 0;
}

/* Plan member k's reduce_step: its valid elements in pieces, each summed and stepped. */
static int host_reduce_step_plan(const struct shd_reduce_args *a, uint32_t k, struct host_plan *pl)
{
	uint64_t work = 0;
	int ret = 0;

	/* The reduce's n + 1 streams and the step's 6 (AdamW: param, exp_avg, exp_avg_sq read and written). */
	for (uint32_t i = 0; i < a->layout->nparams; i++)
		work += a->layout->params[i].shard_numel * (a->n + 6);
	plan_init(pl, work);
	for (uint32_t i = 0; i < a->layout->nparams && !ret; i++) {
		const struct shd_layout_param *p = &a->layout->params[i];
		struct host_piece pc = { .param = i, .kind = PIECE_REDUCE_STEP };

		if (p->shard_numel)
			ret = plan_split(pl, pc, 0, host_valid_numel(p, k), a->n + 6);
	}
	if (!ret)
		plan_close(pl);
	return ret;
}

/*
 * Every member's plan is made before any runs: a failure (-ENOMEM) leaves
 * every shard as it was, so no rank's step is half applied and none is
 * applied without the engine's record of it.
 */
static int host_reduce_step(struct shd_backend_ctx *b, const struct shd_reduce_args *a,
			    const struct shd_step_args *steps)
{
	struct host_backend *hb = (struct host_backend *)b;
	struct host_plan *plans;
	int ret = 0;

	if (a->n == 0 || a->n > SHARDD_MAX_WORLD || a->src != SHD_REDUCE_SRC_GRAD || a->adds)
		return -EINVAL;
	for (uint32_t k = 0; k < a->n; k++) {
		if (a->accumulate[k] || steps[k].skip_nonfinite)
			return -EINVAL;
		for (uint32_t i = 0; i < a->layout->nparams; i++)
			if (shd_shard_view_dtype(&a->outs[k], &a->layout->params[i]) !=
			    SHARDD_DTYPE_FP32)
				return -EINVAL;
	}
	plans = calloc(a->n, sizeof(*plans));
	if (!plans)
		return -ENOMEM;
	for (uint32_t k = 0; k < a->n && !ret; k++)
		ret = host_reduce_step_plan(a, k, &plans[k]);
	for (uint32_t k = 0; k < a->n && !ret; k++) {
		struct host_op op = {
			.reduce = a, .plan = &plans[k], .shard_rank = k, .step = &steps[k]
		};

		*steps[k].skipped = 0;
		host_run_plan(hb, &op);
	}
	for (uint32_t k = 0; k < a->n; k++)
		plan_free(&plans[k]);
	free(plans);
	return ret;
}

/* `arg`: the first byte to zero. */
static void host_zero_range(void *arg, size_t begin, size_t end)
{
	shardd_k_zero((uint8_t *)arg + begin, end - begin);
}

static int host_zero(struct shd_backend_ctx *b, struct shd_buf *buf, uint64_t offset,
		     uint64_t bytes)
{
	struct host_backend *hb = (struct host_backend *)b;

	if (offset > buf->bytes || bytes > buf->bytes - offset)
		return -EINVAL;
	shd_pool_for(hb->pool, bytes, HOST_ZERO_GRAIN, host_zero_range, host_ptr(buf) + offset);
	return 0;
}

/* The daemon's own mapping of the memfd holds the bytes. */
static int host_read(struct shd_backend_ctx *b, const struct shd_buf *buf, uint64_t offset,
		     uint64_t bytes, void *dst)
{
	(void)b;
	if (offset > buf->bytes || bytes > buf->bytes - offset)
		return -EINVAL;
	memcpy(dst, host_ptr(buf) + offset, (size_t)bytes);
	return 0;
}

static int host_write(struct shd_backend_ctx *b, struct shd_buf *buf, uint64_t offset,
		      uint64_t bytes, const void *src)
{
	(void)b;
	if (offset > buf->bytes || bytes > buf->bytes - offset)
		return -EINVAL;
	memcpy(host_ptr(buf) + offset, src, (size_t)bytes);
	return 0;
}

/*
 * Each buffer's mapping starts at one of HOST_COLORS page offsets: mapping
 * k starts (k * 17 mod HOST_COLORS) pages into a reservation HOST_COLORS
 * pages longer than it. Plain mmaps of equal power-of-two sizes land exactly
 * that far apart, so the same element of every rank's buffer had the same
 * virtual address bits 12-27, and a kernel reading several such streams
 * at once ran at half speed on the CI VM's Zen 3 (likely its L1 way
 * predictor, which hashes those bits): a 4-input bf16 reduce of 128 Mi
 * elements on 2 threads, 17.6 - 18.4 GB/s mapped plainly, 33.4 - 34.5
 * coloured; a 4-rank 256 MiB reduce through the daemon 2x faster
 * (docs/BENCHMARKS.md). Only address space is spent; the unused ends of
 * the reservation are unmapped at once.
 */
#define HOST_COLORS 64u

static void *host_map_colored(struct host_backend *hb, int fd, size_t bytes)
{
	size_t page = (size_t)sysconf(_SC_PAGESIZE);
	size_t span = bytes + HOST_COLORS * page, head, whole = (bytes + page - 1) / page * page;
	unsigned k = __atomic_fetch_add(&hb->colors, 1, __ATOMIC_RELAXED);
	char *base, *map;

	base = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (base == MAP_FAILED)
		return MAP_FAILED;
	head = (size_t)(k * 17u % HOST_COLORS) * page;
	map = mmap(base + head, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
	if (map == MAP_FAILED) {
		int err = errno;

		munmap(base, span);
		errno = err;
		return MAP_FAILED;
	}
	/* The reservation before the mapping, and after its last (whole) page: at least one page. */
	if (head)
		munmap(base, head);
	munmap(map + whole, span - head - whole);
	return map;
}

static int host_alloc(struct shd_backend_ctx *b, uint64_t bytes, int32_t device, const char *what,
		      struct shd_buf *out)
{
	struct host_backend *hb = (struct host_backend *)b;
	char name[96];
	void *map;
	int fd, ret;

	(void)device;
	out->fd = -1;
	out->priv = NULL;
	out->bytes = 0;
	if (bytes == 0 || bytes > SIZE_MAX / 2)
		return -EINVAL;
	snprintf(name, sizeof(name), "shardd:%s", what);
	fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)bytes) < 0)
		goto err_errno;
	/*
	 * Commit the pages now: a sparse memfd would get them at the first op
	 * that touches them, where running out of memory is a SIGBUS or an
	 * OOM kill of the daemon mid-op instead of a refused registration.
	 */
	do
		ret = fallocate(fd, 0, 0, (off_t)bytes);
	while (ret < 0 && errno == EINTR);
	if (ret < 0)
		goto err_errno;
	/*
	 * Clients map these pages: no one may shrink them under the daemon's
	 * mapping. F_SEAL_SEAL waits for the first export (host_seal_export),
	 * which may add F_SEAL_FUTURE_WRITE after the mapping below exists.
	 */
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0)
		goto err_errno;
	map = host_map_colored(hb, fd, (size_t)bytes);
	if (map == MAP_FAILED)
		goto err_errno;
		/*
	 * Map every page now, in one call: a fallocated memfd page is zeroed
	 * and mapped at its first touch, one fault per 4 KiB, which held a
	 * restore writing into fresh buffers (and a group's first op) to
	 * under 1 GB/s on a VM. Before Linux 5.14 (EINVAL) they fault as before.
	 */
#ifdef MADV_POPULATE_WRITE
	madvise(map, (size_t)bytes, MADV_POPULATE_WRITE);
#endif
	out->fd = fd;
	out->priv = map;
	out->bytes = bytes;
	return 0;

err_errno:
	ret = -errno;
	close(fd);
	return ret;
}

static void host_free(struct shd_backend_ctx *b, struct shd_buf *buf)
{
	(void)b;
	if (buf->priv)
		munmap(buf->priv, (size_t)buf->bytes);
	shd_buf_forget(buf);
}

/*
 * Seal a buffer for its first export, before any client can hold it:
 * F_SEAL_SEAL, and for a buffer lent read-only F_SEAL_FUTURE_WRITE, so that
 * no descriptor of it, not even one a client reopens O_RDWR through
 * /proc/self/fd, can write it, punch a hole in it or map it writable. The
 * daemon goes on writing through the mapping host_alloc made before the
 * seal. A buffer keeps the role of its first export: exporting it the other
 * way later is -EPERM. SHD_EXPORT_OWNER leaves F_SEAL_SEAL off, so that
 * host_seal_readonly can still add F_SEAL_FUTURE_WRITE once the owner has
 * mapped it writable; until then the owner may seal it itself, which only
 * makes that call fail. 0 or -errno (-EINVAL: a kernel older than 5.1 has
 * no F_SEAL_FUTURE_WRITE).
 */
static int host_seal_export(int fd, int mode)
{
	int readonly = mode == SHD_EXPORT_RO;
	int want = F_SEAL_SHRINK | F_SEAL_GROW | (mode == SHD_EXPORT_OWNER ? 0 : F_SEAL_SEAL) |
		   (readonly ? F_SEAL_FUTURE_WRITE : 0);
	int seals = fcntl(fd, F_GET_SEALS);

	if (seals < 0)
		return -errno;
	if (!(seals & F_SEAL_SEAL)) {
		if (fcntl(fd, F_ADD_SEALS, want & ~seals) < 0)
			return -errno;
		seals |= want;
	}
	if ((seals & want) != want || (!readonly && (seals & F_SEAL_FUTURE_WRITE)))
		return -EPERM;
	return 0;
}

/* Every host buffer travels as its memfd, sealed by host_seal_export. */
static int host_export_buf(struct shd_backend_ctx *b, const struct shd_buf *buf, int mode,
			   struct shd_buf_export *out)
{
	char path[64];
	int fd, ret;

	(void)b;
	memset(out, 0, sizeof(*out));
	out->kind = SHARDD_EXPORT_FD;
	out->fd = -1;
	ret = host_seal_export(buf->fd, mode);
	if (ret < 0)
		return ret;
	if (mode != SHD_EXPORT_RO) {
		fd = fcntl(buf->fd, F_DUPFD_CLOEXEC, 0);
	} else {
		/* A new open file description opened read-only as well: writes fail with EBADF. */
		snprintf(path, sizeof(path), "/proc/self/fd/%d", buf->fd);
		fd = open(path, O_RDONLY | O_CLOEXEC);
	}
	out->fd = fd;
	return fd < 0 ? -errno : 0;
}

static int host_seal_readonly(struct shd_backend_ctx *b, const struct shd_buf *buf)
{
	(void)b;
	return host_seal_export(buf->fd, SHD_EXPORT_RO);
}

static void *host_map(struct shd_backend_ctx *b, const struct shd_buf *buf)
{
	(void)b;
	return host_ptr(buf);
}

static void host_destroy(struct shd_backend_ctx *b)
{
	free(b);
}

static const struct shd_backend_ops host_ops = {
	.name = "host",
	.inline_max_bytes = HOST_INLINE_MAX_BYTES,
	.alloc = host_alloc,
	.free = host_free,
	.export_buf = host_export_buf,
	.seal_readonly = host_seal_readonly,
	.host_map = host_map,
	.unshard = host_unshard,
	.reduce = host_reduce,
	.zero = host_zero,
	.read = host_read,
	.write = host_write,
	.step = host_step,
	.reduce_step = host_reduce_step,
	.destroy = host_destroy,
};

int shd_backend_host_create(struct shd_pool *pool, struct shd_backend_ctx **out)
{
	struct host_backend *hb = calloc(1, sizeof(*hb));

	if (!hb)
		return -ENOMEM;
	hb->base.ops = &host_ops;
	hb->pool = pool;
	*out = &hb->base;
	return 0;
}
