/* SPDX-License-Identifier: MIT */
/*
 * Cuda backend: a group's buffers live in device memory; the kernels of
 * shardd_cuda_kernels.h move their bytes. This file is its ops table:
 * create and destroy, jobs, and each op routed by where its members sit.
 * The rest lives in files named for it (backend_cuda_int.h lists them):
 * device set-up and waits (backend_cuda_device.c), buffers and their
 * export as fds or legacy IPC handles (backend_cuda_memory.c), the
 * kernels over a layout (backend_cuda_kernels.c), ops across GPUs with
 * NCCL (backend_cuda_nccl_ops.c over backend_cuda_nccl.c), stream fences
 * (backend_cuda_fence.c), the optimizer step and grad norm
 * (backend_cuda_step.c), collectives across nodes (backend_cuda_world.c).
 *
 * Work: one non-blocking stream per device. Unshard, reduce, step and
 * zero queue their kernels and return; the engine calls `sync` before a completion
 * that promises results in memory, and a client that set a stream gets
 * fences instead (backend_cuda_fence.c), so neither side waits on a CPU.
 * A buffer lives on the device its rank named in its hello (the unsharded
 * buffer on its replica's first rank's device, or each rank's own where
 * its shard group runs NCCL).
 *
 * Collectives (placement.h): the members of an op (a shard group, or a
 * replicate group) all on one device are served here, with device copies
 * and kernels on that device's stream; members on pairwise distinct
 * devices with NCCL (backend_cuda_nccl_ops.c).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend_cuda_int.h"
#include "log.h"
#include "placement.h"
#include "shardd_cuda_kernels.h"

/* ------------------------------------------------------------------ */
/* Ops                                                                 */
/* ------------------------------------------------------------------ */

static int cuda_unshard(struct shd_backend_ctx *b, const struct shd_unshard_args *a)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	int32_t devices[SHARDD_MAX_WORLD];
	uint8_t *src[SHARDD_MAX_WORLD];
	struct cuda_device *d;
	uint32_t kind;
	int ret = 0;

	if (a->nshards == 0 || a->nshards > SHARDD_MAX_WORLD)
		return -EINVAL;
	for (uint32_t s = 0; s < a->nshards; s++)
		devices[s] = cbuf(a->shards[s])->device;
	ret = cuda_placement(devices, a->nshards, "unshard", a->err, a->errlen, &kind);
	if (ret)
		return ret;
	if (kind == SHD_PLACE_NCCL)
		return cuda_unshard_nccl(cb, a, devices);
	for (uint32_t s = 0; s < a->nshards && !ret; s++)
		ret = cuda_on_device(a->unsharded[s], devices[0], s, "unsharded buffer", a->err,
				     a->errlen, "unshard");
	if (!ret)
		ret = cuda_device_get(cb, devices[0], &d);
	if (ret)
		return ret;
	for (uint32_t s = 0; s < a->nshards; s++)
		src[s] = dptr(a->shards[s], 0);
	/* Each distinct output once: ranks that share an unsharded buffer alias it. */
	for (uint32_t s = 0; s < a->nshards && !ret; s++) {
		uint32_t t = 0;

		while (t < s && a->unsharded[t] != a->unsharded[s])
			t++;
		if (t == s)
			ret = cuda_copy_out(a->layout, a->nshards, src, a->unsharded[s], d->stream);
	}
	return cuda_queued(ret, "unshard");
}

static int cuda_reduce(struct shd_backend_ctx *b, const struct shd_reduce_args *a)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	int32_t devices[SHARDD_MAX_WORLD];
	struct cuda_device *d;
	uint32_t kind;
	int ret = 0;

	if (a->n == 0 || a->n > SHARDD_MAX_WORLD)
		return -EINVAL;
	for (uint32_t k = 0; k < a->n; k++)
		devices[k] =
			cbuf(a->src == SHD_REDUCE_SRC_GRAD ? a->grads[k] : a->views[k].buf)->device;
	ret = cuda_placement(devices, a->n, "reduce", a->err, a->errlen, &kind);
	if (ret)
		return ret;
	if (kind == SHD_PLACE_NCCL)
		return cuda_reduce_nccl(cb, a, devices);
	if (a->n > SHARDD_CUDA_MAX_INPUTS)
		return cuda_op_fail(-EINVAL, a->err, a->errlen, "reduce",
				    "%u inputs on one device: the kernels take 1 to %d", a->n,
				    SHARDD_CUDA_MAX_INPUTS);
	for (uint32_t k = 0; k < a->n && !ret; k++) {
		ret = cuda_on_device(a->outs[k].buf, devices[0], k, "output", a->err, a->errlen,
				     "reduce");
		if (!ret && cuda_reduce_add(a, k))
			ret = cuda_on_device(a->adds[k].buf, devices[0], k, "addend", a->err,
					     a->errlen, "reduce");
	}
	if (!ret)
		ret = cuda_device_get(cb, devices[0], &d);
	for (uint32_t k = 0; k < a->n && !ret; k++)
		for (uint32_t i = 0; i < a->layout->nparams && !ret; i++)
			ret = cuda_reduce_param(a, k, i, d->stream);
	return cuda_queued(ret, "reduce");
}

static int cuda_zero(struct shd_backend_ctx *b, struct shd_buf *buf, uint64_t offset,
		     uint64_t bytes)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	struct cuda_device *d;
	int ret;

	if (offset > buf->bytes || bytes > buf->bytes - offset)
		return -EINVAL;
	ret = cuda_device_get(cb, cbuf(buf)->device, &d);
	if (ret)
		return ret;
	return cuda_queued(shardd_cuda_zero(dptr(buf, offset), (size_t)bytes, d->stream), "zero");
}

static int cuda_sync(struct shd_backend_ctx *b, const struct shd_buf *const *on, uint32_t n,
		     char *err, size_t errlen)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	struct cuda_device *d;
	int ret = 0;

	/* Each device once: most ops have every buffer on one. */
	for (uint32_t k = 0; k < n && !ret; k++) {
		int device = cbuf(on[k])->device;
		uint32_t j = 0;

		while (j < k && cbuf(on[j])->device != device)
			j++;
		if (j < k)
			continue;
		ret = cuda_device_get(cb, device, &d);
		if (!ret)
			ret = cuda_device_wait(cb, device, d, "wait for an op's kernels", err,
					       errlen);
	}
	return ret;
}

/* ------------------------------------------------------------------ */
/* Jobs                                                                */
/* ------------------------------------------------------------------ */

static int cuda_multi_device(struct shd_backend_ctx *b, char *err, size_t errlen)
{
	(void)b;
	return shd_nccl_load(err, errlen);
}

static int cuda_job_open(struct shd_backend_ctx *b, const char *job, struct shd_backend_job **out)
{
	struct shd_backend_job *bj = calloc(1, sizeof(*bj));

	(void)b;
	if (!bj)
		return -ENOMEM;
	snprintf(bj->name, sizeof(bj->name), "%s", job);
	*out = bj;
	return 0;
}

static void cuda_job_close(struct shd_backend_ctx *b, struct shd_backend_job *bj)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;

	cuda_nccl_lock(cb);
	cuda_span_job_end(cb, bj);
	shd_nccl_job_end(cb->nccl, bj);
	cuda_nccl_unlock(cb);
	free(bj);
}

/* ------------------------------------------------------------------ */
/* Create and destroy                                                  */
/* ------------------------------------------------------------------ */

static void cuda_destroy(struct shd_backend_ctx *b)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;

	/* Staging buffers first: freeing one waits on its device, which may ask the communicators. */
	cuda_nccl_lock(cb);
	cuda_span_job_end(cb, NULL);
	cuda_nccl_unlock(cb);
	cuda_nccl_staging_free(cb);
	shd_nccl_destroy(cb->nccl);
	cuda_devices_destroy(cb);
	pthread_mutex_destroy(&cb->nccl_lock);
	pthread_mutex_destroy(&cb->lock);
	free(cb->devices);
	free(cb);
}

static const struct shd_backend_ops cuda_ops = {
	.name = "cuda",
	/* Every call queues device work from a pool thread, whose CUDA context it set up. */
	.inline_max_bytes = 0,
	.alloc = cuda_alloc,
	.free = cuda_free,
	.export_buf = cuda_export_buf,
	.unshard = cuda_unshard,
	.reduce = cuda_reduce,
	.zero = cuda_zero,
	.read = cuda_read,
	.write = cuda_write,
	.step = cuda_step,
	.grad_norm = cuda_grad_norm,
	.sync = cuda_sync,
	.fences_open = cuda_fences_open,
	.fence_wait = cuda_fence_wait,
	.fence_signal = cuda_fence_signal,
	.fences_close = cuda_fences_close,
	.multi_device = cuda_multi_device,
	.job_open = cuda_job_open,
	.job_close = cuda_job_close,
	.destroy = cuda_destroy,
	.span_unshard = cuda_span_unshard,
	.span_reduce = cuda_span_reduce,
};

/*
 * Whether this process's CUDA contexts are MPS clients: the driver connects
 * to an MPS control daemon (CUDA_MPS_PIPE_DIRECTORY's, else the system's)
 * when CUDA initialises, before any context exists, and reports it per
 * device (cudaDevAttrMpsEnabled). Fills cb->base's gpu_* fields and logs
 * the outcome once. Time-sliced, each op waits for the GPU's slice while
 * a trainer computes; under MPS it runs beside, on the SMs left to it.
 */
static void cuda_sharing_detect(struct cuda_backend *cb)
{
	const char *pct = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
	int on = 0, v;

	for (int i = 0; i < cb->ndevices; i++) {
		/* A driver older than the attribute answers an error: no MPS known. */
		if (cudaDeviceGetAttribute(&v, cudaDevAttrMpsEnabled, i) == cudaSuccess && v)
			on++;
	}
	cb->base.gpu_mps = cb->ndevices > 0 && on == cb->ndevices;
	cb->base.gpu_sm_percent = 100;
	if (cb->base.gpu_mps && pct && *pct) {
		v = atoi(pct);
		if (v > 0 && v < 100)
			cb->base.gpu_sm_percent = v;
	}
	if (cb->base.gpu_mps && cb->base.gpu_sm_percent < 100)
		snprintf(cb->gpu_sharing, sizeof(cb->gpu_sharing),
			 "MPS: ops run beside the trainers' compute on up to %d%% of the SMs "
			 "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)",
			 cb->base.gpu_sm_percent);
	else if (cb->base.gpu_mps)
		snprintf(
			cb->gpu_sharing, sizeof(cb->gpu_sharing),
			"MPS: ops run beside the trainers' compute (SM share uncapped; the trainers "
			"need CUDA_MPS_ACTIVE_THREAD_PERCENTAGE below 100, docs/CUDA.md)");
	else
		snprintf(cb->gpu_sharing, sizeof(cb->gpu_sharing),
			 "time-sliced: ops wait for the trainers' compute, docs/CUDA.md");
	cb->base.gpu_sharing = cb->gpu_sharing;
	if (on && on < cb->ndevices)
		shd_log_warn(
			"cuda backend: only %d of %d devices run this daemon's contexts under MPS; "
			"the others are time-sliced",
			on, cb->ndevices);
	shd_log_info("cuda backend: %s", cb->gpu_sharing);
}

int shd_backend_cuda_create(uint32_t mode, uint64_t timeout_ns, struct shd_backend_ctx **out,
			    char *err, size_t errlen)
{
	struct cuda_backend *cb;
	cudaError_t e;
	int n = 0, ret;

	if (mode != SHD_CUDA_EXPORT_AUTO && mode != SHD_CUDA_EXPORT_FD &&
	    mode != SHD_CUDA_EXPORT_IPC) {
		snprintf(
			err, errlen,
			"shardd: --cuda-export: mode %u is not one of auto (%d), fd (%d), ipc (%d)",
			mode, SHD_CUDA_EXPORT_AUTO, SHD_CUDA_EXPORT_FD, SHD_CUDA_EXPORT_IPC);
		return -SHARDD_E_BACKEND;
	}
	e = cudaGetDeviceCount(&n);
	if (e != cudaSuccess || n <= 0) {
		snprintf(err, errlen,
			 "shardd: --backend cuda: no CUDA device usable (cudaGetDeviceCount: %s); "
			 "use --backend host",
			 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
		return -SHARDD_E_BACKEND;
	}
	cb = calloc(1, sizeof(*cb));
	if (!cb)
		goto err_nomem;
	cb->devices = calloc((size_t)n, sizeof(*cb->devices));
	if (!cb->devices || shd_nccl_create(timeout_ns, &cb->nccl))
		goto err_nomem;
	/* Unallocated, and no fd for shd_buf_forget to close. */
	for (int i = 0; i < n; i++)
		cb->devices[i].staging.fd = -1;
	ret = cuda_driver_resolve(&cb->drv, err, errlen);
	if (ret)
		goto err_free;
	cb->base.ops = &cuda_ops;
	cb->mode = mode;
	cb->timeout_ns = timeout_ns;
	cb->ndevices = n;
	pthread_mutex_init(&cb->lock, NULL);
	pthread_mutex_init(&cb->nccl_lock, NULL);
	cuda_sharing_detect(cb);
	*out = &cb->base;
	return 0;

err_nomem:
	snprintf(err, errlen, "shardd: --backend cuda: out of memory for the backend of %d devices",
		 n);
	ret = -ENOMEM;
err_free:
	if (cb) {
		shd_nccl_destroy(cb->nccl);
		free(cb->devices);
	}
	free(cb);
	return ret;
}
