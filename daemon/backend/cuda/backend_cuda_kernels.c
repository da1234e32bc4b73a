/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend's kernels over a group's layout (backend_cuda_int.h):
 * which kernel of shardd_cuda_kernels.h each param of an op takes, with
 * which device addresses, on one device or around an NCCL collective; and
 * the checks and messages every op shares. Nothing here waits or takes a
 * lock: each function queues kernels on the stream it is given.
 */
#include <stdarg.h>
#include <stdio.h>

#include "backend_cuda_int.h"
#include "log.h"
#include "placement.h"
#include "shardd_cuda_kernels.h"

/* ------------------------------------------------------------------ */
/* Checks and messages                                                 */
/* ------------------------------------------------------------------ */

/*
 * An op's failure that the op's completion names: `err` (the args') gets
 * the text, the log gets it with the op. Returns `ret`.
 */
int cuda_op_fail(int ret, char *err, size_t errlen, const char *op, const char *fmt, ...)
{
	char text[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	shd_log_error("shardd: cuda backend: %s: %s", op, text);
	if (err && errlen)
		snprintf(err, errlen, "%s", text);
	return ret;
}

/* 0 when member k's buffer `b` (`role`) sits on `device`, the member's device; else the error. */
int cuda_on_device(const struct shd_buf *b, int device, uint32_t k, const char *role, char *err,
		   size_t errlen, const char *op)
{
	if (cbuf(b)->device == device)
		return 0;
	return cuda_op_fail(
		-SHARDD_E_BACKEND, err, errlen, op,
		"member %u's %s is on device %d but its input on device %d: an op's buffers of "
		"one rank must share its device",
		k, role, cbuf(b)->device, device);
}

/*
 * How the `n` members of an op sit, from the devices of their inputs:
 * SHARED (all on devices[0]) or NCCL; MIXED, which registration refuses
 * (placement.h), fails here too.
 */
int cuda_placement(const int32_t *devices, uint32_t n, const char *op, char *err, size_t errlen,
		   uint32_t *kind)
{
	*kind = shd_placement_classify(devices, n);
	if (*kind != SHD_PLACE_MIXED)
		return 0;
	return cuda_op_fail(
		-SHARDD_E_BACKEND, err, errlen, op,
		"its %u ranks' buffers partly share GPUs (devices %d and %d, ...): all must be on "
		"one GPU or each on its own",
		n, devices[0], devices[1]);
}

/* Member k's addend view, or NULL. */
const struct shd_shard_view *cuda_reduce_add(const struct shd_reduce_args *a, uint32_t k)
{
	return a->adds && a->adds[k].buf ? &a->adds[k] : NULL;
}

/* ------------------------------------------------------------------ */
/* Unshard                                                             */
/* ------------------------------------------------------------------ */

/*
 * Copy-out of an all-gather into `out`: param by param, shard s's rows from
 * flat shard s at src[s] (device addresses), cast to the unsharded dtype,
 * padding rows dropped (dim 0), or chunk-cat (Shard(i > 0)).
 */
int cuda_copy_out(const struct shd_layout *l, uint32_t nshards, uint8_t *const *src,
		  const struct shd_buf *out, cudaStream_t stream)
{
	const void *chunks[SHARDD_MAX_WORLD];
	int ret = 0;

	for (uint32_t i = 0; i < l->nparams && !ret; i++) {
		const struct shd_layout_param *p = &l->params[i];
		size_t us = shardd_dtype_size(p->unsharded_dtype);
		uint64_t chunk = p->rows * p->inner; /* elements of one shard of this param */

		if (p->shard_dim == 0) {
			/* Shard s is rows [s*rows, s*rows + valid) of the param: one cast, padding dropped. */
			for (uint32_t s = 0; s < nshards && !ret; s++)
				ret = shardd_cuda_cast(
					dptr(out, p->unsharded_offset + s * chunk * us),
					p->unsharded_dtype, src[s] + p->shard_offset, p->dtype,
					shd_layout_rows_valid(p, s) * p->inner, stream);
		} else {
			for (uint32_t s = 0; s < nshards; s++)
				chunks[s] = src[s] + p->shard_offset;
			ret = shardd_cuda_chunk_cat(dptr(out, p->unsharded_offset),
						    p->unsharded_dtype, chunks, p->dtype, nshards,
						    p->outer, chunk, stream);
		}
	}
	return ret;
}

/* ------------------------------------------------------------------ */
/* Reduce                                                              */
/* ------------------------------------------------------------------ */

/* Queue member k's output of param i on one device, one launch per outer index, and zero its padding. */
int cuda_reduce_param(const struct shd_reduce_args *a, uint32_t k, uint32_t i, cudaStream_t stream)
{
	const struct shd_layout_param *p = &a->layout->params[i];
	const struct shd_shard_view *out = &a->outs[k], *add = cuda_reduce_add(a, k);
	uint32_t shard_rank = a->src == SHD_REDUCE_SRC_GRAD ? k : a->shard_rank;
	uint32_t odt = shd_shard_view_dtype(out, p);
	size_t os = shardd_dtype_size(odt), rs = shardd_dtype_size(a->math.reduce_dtype);
	uint64_t valid = shd_layout_rows_valid(p, shard_rank);
	const void *in[SHARDD_CUDA_MAX_INPUTS];
	struct shardd_reduce_math m = a->math;
	uint32_t idt = a->src == SHD_REDUCE_SRC_GRAD ? p->grad_dtype : a->in_dtype;
	size_t is = shardd_dtype_size(idt);
	int ret = 0;

	for (uint64_t o = 0; o < p->outer && !ret; o++) {
		uint64_t at = o * p->rows * p->inner; /* element in the output shard */

		if (a->src == SHD_REDUCE_SRC_GRAD) {
			/* Shard s of the unsharded grad: rows [s*rows, s*rows + valid) of shard_dim. */
			uint64_t e =
				o * p->dim * p->inner + (uint64_t)shard_rank * p->rows * p->inner;

			for (uint32_t j = 0; j < a->n; j++)
				in[j] = dptr(a->grads[j], p->grad_offset + e * is);
		} else {
			for (uint32_t j = 0; j < a->n; j++)
				in[j] = dptr(a->views[j].buf, a->views[j].offsets[i] + at * is);
		}
		m.add = add ? dptr(add->buf, add->offsets[i] + at * rs) : NULL;
		ret = shardd_cuda_reduce(dptr(out->buf, out->offsets[i] + at * os), odt,
					 a->accumulate[k], in, a->n, idt, valid * p->inner, &m,
					 stream);
	}
	/* Padding rows exist for dim 0 only, where outer == 1. */
	if (!ret && valid < p->rows)
		ret = shardd_cuda_zero(dptr(out->buf, out->offsets[i] + valid * p->inner * os),
				       (p->rows - valid) * p->inner * os, stream);
	return ret;
}

/*
 * Copy-in of a reduce-scatter on member k's device: its grad rows of every
 * destination shard s of `nshards` (the members, or every rank of a shard
 * group across nodes), cast to the reduce dtype and pre-divided (FSDP2's
 * fp16 factor), into block s of its staging buffer (rank-major: the block
 * NCCL rank s receives the sum of).
 */
int cuda_reduce_copy_in(const struct shd_reduce_args *a, uint32_t k, uint32_t nshards,
			uint8_t *staging, cudaStream_t stream)
{
	const struct shardd_reduce_math pre = {
		.reduce_dtype = a->math.reduce_dtype,
		.pre = a->math.pre,
		.avg = 1,
		.post = 1,
	};
	uint32_t rd = a->math.reduce_dtype;
	size_t rs = shardd_dtype_size(rd);
	int ret = 0;

	for (uint32_t s = 0; s < nshards && !ret; s++) {
		for (uint32_t i = 0; i < a->layout->nparams && !ret; i++) {
			const struct shd_layout_param *p = &a->layout->params[i];
			uint64_t n = shd_layout_rows_valid(p, s) * p->inner;
			size_t gs = shardd_dtype_size(p->grad_dtype);

			for (uint64_t o = 0; o < p->outer && !ret; o++) {
				uint8_t *dst = staging + s * a->reduce_shard_size +
					       a->reduce_offsets[i] + o * p->rows * p->inner * rs;
				const void *src =
					dptr(a->grads[k],
					     p->grad_offset + (o * p->dim + (uint64_t)s * p->rows) *
								      p->inner * gs);

				/* x = round(round(g) / pre), as every input of the host's reduce. */
				if (pre.pre > 1)
					ret = shardd_cuda_reduce(dst, rd, 0, &src, 1, p->grad_dtype,
								 n, &pre, stream);
				else
					ret = shardd_cuda_cast(dst, rd, src, p->grad_dtype, n,
							       stream);
			}
		}
	}
	return ret;
}

/*
 * After the collective, member k's output from its sum at `sum` (one shard
 * in the reduce dtype, laid out as `offsets`, of shard `shard_rank`):
 * out = [accumulate] cast(round(round(sum / avg) [+ add]) / post), valid
 * rows only, padding rows zeroed: one kernel (a reduce of one input) per
 * param and outer index.
 */
int cuda_reduce_post(const struct shd_reduce_args *a, uint32_t k, const uint8_t *sum,
		     const uint64_t *offsets, uint32_t shard_rank, cudaStream_t stream)
{
	const struct shd_shard_view *out = &a->outs[k], *add = cuda_reduce_add(a, k);
	struct shardd_reduce_math m = a->math;
	size_t rs = shardd_dtype_size(m.reduce_dtype);
	int ret = 0;

	/* The inputs were pre-divided before the sum. */
	m.pre = 1;
	for (uint32_t i = 0; i < a->layout->nparams && !ret; i++) {
		const struct shd_layout_param *p = &a->layout->params[i];
		uint32_t odt = shd_shard_view_dtype(out, p);
		size_t os = shardd_dtype_size(odt);
		uint64_t valid = shd_layout_rows_valid(p, shard_rank);

		for (uint64_t o = 0; o < p->outer && !ret; o++) {
			uint64_t at = o * p->rows * p->inner;
			const void *in = sum + offsets[i] + at * rs;

			m.add = add ? dptr(add->buf, add->offsets[i] + at * rs) : NULL;
			ret = shardd_cuda_reduce(dptr(out->buf, out->offsets[i] + at * os), odt,
						 a->accumulate[k], &in, 1, m.reduce_dtype,
						 valid * p->inner, &m, stream);
		}
		if (!ret && valid < p->rows)
			ret = shardd_cuda_zero(
				dptr(out->buf, out->offsets[i] + valid * p->inner * os),
				(p->rows - valid) * p->inner * os, stream);
	}
	return ret;
}
