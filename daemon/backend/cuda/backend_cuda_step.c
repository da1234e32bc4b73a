/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend's optimizer (backend_cuda_int.h): the step of one
 * rank's shard and the grad-norm part of one rank's sharded grad, with the
 * kernels of kernels/optim.cu on the device that holds the rank's buffers.
 *
 * The step queues one kernel per param (its valid rows; padding rows are
 * never read or written) on the device's stream and returns, as unshard
 * and reduce do: the engine's zero of the grad and its sync (or the
 * client's fence) follow on the same stream. The kernels are the CPU's
 * sequence of fp32 operations written with round-to-nearest intrinsics,
 * which nvcc never contracts into fused multiply-adds, with the scalars
 * from the same host functions: param and state are the host backend's
 * bits (tests/gpu/test_cuda_step.c). The optimizer state is three buffers
 * of the group (group.c), allocated by cuda_alloc on the rank's device and
 * counted with its other buffers.
 *
 * Skip-on-non-finite and the grad norm need an answer on the host before
 * they return, so they wait for the device's stream (cuda_device_wait:
 * bounded where the device runs NCCL) and copy a few bytes back. Their
 * device scratch comes from the stream-ordered allocator, per call, so
 * concurrent calls on one device share nothing; cudaFreeAsync, unlike
 * cudaFree, does not wait for the whole device.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend_cuda_int.h"
#include "shardd_cuda_kernels.h"

/* Elements of real data in param p's shard `shard_rank`: its valid rows, a prefix of the shard. */
static uint64_t valid_numel(const struct shd_layout_param *p, uint32_t shard_rank)
{
	return p->numel ? p->outer * shd_layout_rows_valid(p, shard_rank) * p->inner : 0;
}

/* Stream-ordered device scratch of `bytes`; 0 or the error in err. */
static int scratch_alloc(void **out, size_t bytes, cudaStream_t stream, const char *op, char *err,
			 size_t errlen)
{
	cudaError_t e = cudaMallocAsync(out, bytes, stream);

	if (e == cudaSuccess)
		return 0;
	(void)cudaGetLastError();
	return cuda_op_fail(e == cudaErrorMemoryAllocation ? -ENOMEM : -SHARDD_E_BACKEND, err,
			    errlen, op, "cudaMallocAsync of %zu bytes of scratch failed: %s", bytes,
			    cudaGetErrorString(e));
}

/*
 * Wait for the stream of `device` (which ran the kernels that fill `src`),
 * then copy `bytes` of `src` into `dst` (each of `rows` rows of `width`
 * bytes, `pitch` apart in `src`), and free `src`. 0 or the error in err.
 */
static int scratch_collect(struct cuda_backend *cb, int device, struct cuda_device *d, void *src,
			   size_t width, size_t pitch, size_t rows, void *dst, const char *op,
			   char *err, size_t errlen)
{
	cudaError_t e;
	int ret;

	ret = cuda_device_wait(cb, device, d, op, err, errlen);
	if (!ret) {
		/* The stream is idle: a plain copy on the legacy stream waits for nothing else. */
		e = cudaMemcpy2D(dst, width, src, pitch, width, rows, cudaMemcpyDeviceToHost);
		if (e != cudaSuccess) {
			(void)cudaGetLastError();
			ret = cuda_op_fail(-SHARDD_E_BACKEND, err, errlen, op,
					   "copying %zu bytes of its result back "
					   "from device %d failed: %s",
					   width * rows, device, cudaGetErrorString(e));
		}
	}
	e = cudaFreeAsync(src, d->stream);
	if (e != cudaSuccess) {
		(void)cudaGetLastError();
		if (!ret)
			ret = cuda_op_fail(-SHARDD_E_BACKEND, err, errlen, op,
					   "cudaFreeAsync of its scratch on "
					   "device %d failed: %s",
					   device, cudaGetErrorString(e));
	}
	return ret;
}

/* 0 when the step's buffers all sit on `device`, the shard's; else the error. */
static int step_buffers_on(const struct shd_step_args *a, int device)
{
	static const char *const roles[3] = { "optimizer state 0", "optimizer state 1",
					      "optimizer state 2" };
	int ret = cuda_on_device(a->grad, device, a->shard_rank, "sharded grad", a->err, a->errlen,
				 "step");

	for (uint32_t k = 0; k < 3 && !ret; k++)
		if (a->state[k])
			ret = cuda_on_device(a->state[k], device, a->shard_rank, roles[k], a->err,
					     a->errlen, "step");
	return ret;
}

/* *skipped = some valid grad element is NaN or Inf (waits for the device). */
static int step_nonfinite(struct cuda_backend *cb, const struct shd_step_args *a, int device,
			  struct cuda_device *d, int *skipped)
{
	const struct shd_layout *l = a->layout;
	uint32_t *flag, host = 0;
	int ret;

	ret = scratch_alloc((void **)&flag, sizeof(*flag), d->stream, "step", a->err, a->errlen);
	if (ret)
		return ret;
	if (cudaMemsetAsync(flag, 0, sizeof(*flag), d->stream) != cudaSuccess)
		ret = -SHARDD_E_BACKEND;
	for (uint32_t i = 0; i < l->nparams && !ret; i++) {
		const struct shd_layout_param *p = &l->params[i];

		ret = shardd_cuda_nonfinite(dptr(a->grad, p->shard_offset), SHARDD_DTYPE_FP32, 0,
					    (size_t)valid_numel(p, a->shard_rank), flag, d->stream);
	}
	if (ret) {
		(void)cudaGetLastError();
		(void)cudaFreeAsync(flag, d->stream);
		return cuda_op_fail(ret, a->err, a->errlen, "step",
				    "queueing the non-finite check of rank %u's "
				    "grad on device %d failed",
				    a->shard_rank, device);
	}
	ret = scratch_collect(cb, device, d, flag, sizeof(host), sizeof(host), 1, &host, "step",
			      a->err, a->errlen);
	*skipped = host != 0;
	return ret;
}

/* Queue param i's update; 0 or the kernels' error. */
static int step_param(const struct shd_step_args *a, uint32_t i, cudaStream_t stream)
{
	const struct shd_layout_param *p = &a->layout->params[i];
	uint64_t n = valid_numel(p, a->shard_rank), off = p->shard_offset;

	if (!n)
		return 0;
	if (a->kind == SHARDD_OPTIM_SGD) {
		struct shardd_sgd s = a->sgd;

		s.param = dptr(a->shard, off);
		s.grad = dptr(a->grad, off);
		s.grad_dtype = SHARDD_DTYPE_FP32;
		s.momentum_buffer = a->state[0] ? dptr(a->state[0], off) : NULL;
		return shardd_cuda_sgd(&s, 0, (size_t)n, stream);
	} else {
		struct shardd_adamw w = a->adamw;

		w.param = dptr(a->shard, off);
		w.grad = dptr(a->grad, off);
		w.grad_dtype = SHARDD_DTYPE_FP32;
		w.exp_avg = a->state[0] ? dptr(a->state[0], off) : NULL;
		w.exp_avg_sq = a->state[1] ? dptr(a->state[1], off) : NULL;
		w.max_exp_avg_sq = a->state[2] ? dptr(a->state[2], off) : NULL;
		return shardd_cuda_adamw(&w, 0, (size_t)n, stream);
	}
}

int cuda_step(struct shd_backend_ctx *b, const struct shd_step_args *a)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	int device = cbuf(a->shard)->device, ret;
	struct cuda_device *d;

	*a->skipped = 0;
	if (a->kind != SHARDD_OPTIM_SGD && a->kind != SHARDD_OPTIM_ADAMW)
		return cuda_op_fail(-EINVAL, a->err, a->errlen, "step",
				    "optimizer kind %u is neither SGD (%d) nor "
				    "AdamW (%d)",
				    a->kind, SHARDD_OPTIM_SGD, SHARDD_OPTIM_ADAMW);
	ret = step_buffers_on(a, device);
	if (!ret)
		ret = cuda_device_get(cb, device, &d);
	if (!ret && a->skip_nonfinite)
		ret = step_nonfinite(cb, a, device, d, a->skipped);
	if (ret || *a->skipped)
		return ret;
	for (uint32_t i = 0; i < a->layout->nparams && !ret; i++) {
		ret = step_param(a, i, d->stream);
		if (ret == -SHARDD_E_INVALID)
			return cuda_op_fail(ret, a->err, a->errlen, "step",
					    "param %u of rank %u: the kernel refused "
					    "its arguments (an optimizer state buffer is missing)",
					    i, a->shard_rank);
	}
	return cuda_queued(ret, "step");
}

int cuda_grad_norm(struct shd_backend_ctx *b, const struct shd_layout *l, uint32_t shard_rank,
		   const struct shd_buf *grad, struct shardd_grad_norm_part *out, char *err,
		   size_t errlen)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	int device = cbuf(grad)->device, ret;
	uint32_t nonempty = 0, k = 0;
	struct cuda_device *d;
	double *ws, (*parts)[2];

	*out = (struct shardd_grad_norm_part){ 0 };
	for (uint32_t i = 0; i < l->nparams; i++)
		nonempty += valid_numel(&l->params[i], shard_rank) != 0;
	if (!nonempty)
		return 0;
	ret = cuda_device_get(cb, device, &d);
	if (ret)
		return ret;
	parts = calloc(nonempty, sizeof(*parts));
	if (!parts)
		return cuda_op_fail(-ENOMEM, err, errlen, "grad_norm", "out of memory for %u parts",
				    nonempty);
	/* One workspace per param with elements; ws[0] and ws[1] of each are its part. */
	ret = scratch_alloc((void **)&ws, (size_t)nonempty * SHARDD_CUDA_NORM_WS * sizeof(double),
			    d->stream, "grad_norm", err, errlen);
	if (ret) {
		free(parts);
		return ret;
	}
	for (uint32_t i = 0; i < l->nparams && !ret; i++) {
		const struct shd_layout_param *p = &l->params[i];
		uint64_t n = valid_numel(p, shard_rank);

		if (n)
			ret = shardd_cuda_grad_norm_part(
				dptr(grad, p->shard_offset), SHARDD_DTYPE_FP32, 0, (size_t)n,
				ws + (size_t)k++ * SHARDD_CUDA_NORM_WS, d->stream);
	}
	if (ret) {
		(void)cudaGetLastError();
		(void)cudaFreeAsync(ws, d->stream);
		free(parts);
		return cuda_op_fail(ret, err, errlen, "grad_norm",
				    "queueing the norm of rank %u's grad on device "
				    "%d failed",
				    shard_rank, device);
	}
	ret = scratch_collect(cb, device, d, ws, sizeof(parts[0]),
			      SHARDD_CUDA_NORM_WS * sizeof(double), nonempty, parts, "grad_norm",
			      err, errlen);
	for (uint32_t i = 0; i < nonempty && !ret; i++) {
		/* The max of fp32 magnitudes, widened exactly: narrowing it back is exact too. */
		struct shardd_grad_norm_part part = {
			.sumsq = parts[i][0],
			.max_abs = (float)parts[i][1],
			.nonfinite = !isfinite(parts[i][0]),
		};

		shardd_k_grad_norm_merge(out, &part);
	}
	free(parts);
	return ret;
}
