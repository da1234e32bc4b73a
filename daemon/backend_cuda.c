/* SPDX-License-Identifier: MIT */
/*
 * Cuda backend: a group's buffers live in device memory; the kernels of
 * shardd_cuda_kernels.h move their bytes.
 *
 * Memory: the driver's virtual memory API. cuMemCreate makes a physical
 * allocation that can be exported as a POSIX file descriptor
 * (cuMemExportToShareableHandle), which travels to clients over the same
 * SCM_RIGHTS path as a host memfd; the daemon maps it at an address range
 * of its own (cuMemAddressReserve, cuMemMap, cuMemSetAccess). Sizes are
 * rounded up to the device's minimum allocation granularity; a client
 * importing the fd rounds the same way (client/cuda_import.c).
 *
 * A device allocation has no per-importer protection: the fd of the
 * unsharded buffer lets a client map it writable. The host backend's
 * read-only guarantee becomes a convention here (docs/CUDA.md).
 *
 * Work: one non-blocking stream per device. Every call queues its kernels
 * and waits for the stream before returning, so a completion means the
 * result is in device memory (backend.h's contract). Interprocess events,
 * which would let the trainer's stream wait instead of a CPU, are a later
 * step. A buffer lives on the device its rank named in its hello (the
 * unsharded buffer on its replica's first rank's device). Several ranks on
 * one device (the single-GPU case) are served with device copies and
 * kernels; ranks on different devices would need NCCL, which this backend
 * does not drive yet, so an op whose buffers sit on different devices fails
 * with an error saying so.
 *
 * The daemon links libcudart but not libcuda (which exists only where a
 * driver is installed): driver calls go through entry points that the
 * runtime resolves, so shardd starts, and fails cleanly, without a driver.
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/backend.h"
#include "daemon/backend_cuda.h"
#include "daemon/log.h"
#include "shardd_cuda_kernels.h"

/*
 * The driver ABI asked for: the PFN_*_v10020 typedefs below (the virtual
 * memory API as introduced in CUDA 10.2) are unchanged as of CUDA 12.0,
 * which every driver that runs this build's runtime (13.x) provides.
 */
#define CUDA_DRIVER_ABI 12000

struct cuda_driver {
	PFN_cuGetErrorString_v6000                 get_error_string;
	PFN_cuDeviceGet_v2000                      device_get;
	PFN_cuDeviceGetAttribute_v2000             device_get_attribute;
	PFN_cuMemGetAllocationGranularity_v10020   granularity;
	PFN_cuMemCreate_v10020                     create;
	PFN_cuMemRelease_v10020                    release;
	PFN_cuMemAddressReserve_v10020             address_reserve;
	PFN_cuMemAddressFree_v10020                address_free;
	PFN_cuMemMap_v10020                        map;
	PFN_cuMemUnmap_v10020                      unmap;
	PFN_cuMemSetAccess_v10020                  set_access;
	PFN_cuMemExportToShareableHandle_v10020    export_handle;
};

/* Per device, set up on its first allocation. */
struct cuda_device {
	int          ready;
	cudaStream_t stream;      /* every kernel of this backend on the device */
	size_t       granularity; /* minimum allocation granularity, bytes */
};

struct cuda_backend {
	struct shardd_backend_ctx base;
	struct cuda_driver drv;
	int ndevices;
	pthread_mutex_t lock;         /* device set-up */
	struct cuda_device *devices;  /* [ndevices] */
};

/* What buf->priv points to. */
struct cuda_buf {
	CUdeviceptr                  ptr;    /* the daemon's mapping */
	size_t                       size;   /* reserved and mapped: bytes rounded to the granularity */
	CUmemGenericAllocationHandle handle;
	int                          device;
};

/* Where the buffers of a rank that named no device (SHARDD_HELLO_DEVICE_HOST) go. */
#define CUDA_DEFAULT_DEVICE 0

/* ------------------------------------------------------------------ */
/* Errors                                                              */
/* ------------------------------------------------------------------ */

static int cuda_rt_fail(const char *what, cudaError_t e)
{
	shardd_log_error("shardd: cuda backend: %s: %s (%s)", what, cudaGetErrorString(e),
			 cudaGetErrorName(e));
	return -SHARDD_E_BACKEND;
}

static int cuda_drv_fail(const struct cuda_backend *cb, const char *what, CUresult r)
{
	const char *s = NULL;

	if (cb->drv.get_error_string(r, &s) != CUDA_SUCCESS || !s)
		s = "unknown driver error";
	shardd_log_error("shardd: cuda backend: %s: %s (CUresult %d)", what, s, (int)r);
	return r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -SHARDD_E_BACKEND;
}

/* ------------------------------------------------------------------ */
/* Devices and buffers                                                 */
/* ------------------------------------------------------------------ */

static void cuda_prop(CUmemAllocationProp *prop, int device)
{
	memset(prop, 0, sizeof(*prop));
	prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop->location.id = device;
}

/* First use of `device`: check it can export fds, make its stream. Caller holds cb->lock. */
static int cuda_device_setup(struct cuda_backend *cb, int device, struct cuda_device *d)
{
	CUmemAllocationProp prop;
	CUdevice dev;
	CUresult r;
	cudaError_t e;
	int vmm = 0, posix_fd = 0;
	char what[96];

	snprintf(what, sizeof(what), "set up device %d", device);
	e = cudaSetDevice(device);
	if (e != cudaSuccess)
		return cuda_rt_fail(what, e);
	r = cb->drv.device_get(&dev, device);
	if (r == CUDA_SUCCESS)
		r = cb->drv.device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
						 dev);
	if (r == CUDA_SUCCESS)
		r = cb->drv.device_get_attribute(&posix_fd,
						 CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
						 dev);
	if (r != CUDA_SUCCESS)
		return cuda_drv_fail(cb, what, r);
	if (!vmm || !posix_fd) {
		shardd_log_error("shardd: cuda backend: device %d cannot export memory as file descriptors "
				 "(virtual memory management %s, POSIX fd handles %s); use --backend host",
				 device, vmm ? "yes" : "no", posix_fd ? "yes" : "no");
		return -SHARDD_E_BACKEND;
	}
	cuda_prop(&prop, device);
	r = cb->drv.granularity(&d->granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (r != CUDA_SUCCESS)
		return cuda_drv_fail(cb, what, r);
	if (d->granularity == 0) {
		shardd_log_error("shardd: cuda backend: device %d reports an allocation granularity of 0",
				 device);
		return -SHARDD_E_BACKEND;
	}
	/* Non-blocking: the legacy default stream of other threads must not serialise with ours. */
	e = cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking);
	if (e != cudaSuccess)
		return cuda_rt_fail(what, e);
	d->ready = 1;
	return 0;
}

/* The ready device `device`, set current on the calling thread. 0 or -SHARDD_E_BACKEND. */
static int cuda_device_get(struct cuda_backend *cb, int device, struct cuda_device **out)
{
	struct cuda_device *d;
	cudaError_t e;
	int ret = 0;

	if (device < 0 || device >= cb->ndevices) {
		shardd_log_error("shardd: cuda backend: device %d does not exist (%d visible)", device,
				 cb->ndevices);
		return -SHARDD_E_BACKEND;
	}
	d = &cb->devices[device];
	pthread_mutex_lock(&cb->lock);
	if (!d->ready)
		ret = cuda_device_setup(cb, device, d);
	pthread_mutex_unlock(&cb->lock);
	if (ret)
		return ret;
	/* The current device is per thread, and pool threads serve every device. */
	e = cudaSetDevice(device);
	if (e != cudaSuccess)
		return cuda_rt_fail("cudaSetDevice", e);
	*out = d;
	return 0;
}

static inline const struct cuda_buf *cbuf(const struct shardd_buf *b)
{
	return b->priv;
}

/* Device address `offset` bytes into a buffer. */
static inline void *dptr(const struct shardd_buf *b, uint64_t offset)
{
	return (void *)(uintptr_t)(cbuf(b)->ptr + offset);
}

void *shardd_backend_cuda_ptr(const struct shardd_buf *buf)
{
	return buf->priv ? dptr(buf, 0) : NULL;
}

/* Wait for the stream; `ret` is the result of queueing the work. */
static int cuda_finish(struct cuda_device *d, int ret, const char *what)
{
	cudaError_t e = cudaStreamSynchronize(d->stream);

	if (e != cudaSuccess)
		return cuda_rt_fail(what, e);
	if (ret)
		shardd_log_error("shardd: cuda backend: %s: a kernel launch failed (%d)", what, ret);
	return ret;
}

static int cuda_alloc(struct shardd_backend_ctx *b, uint64_t bytes, int32_t device, const char *what,
		      struct shardd_buf *out)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	CUmemAccessDesc access;
	CUmemAllocationProp prop;
	struct cuda_device *d;
	struct cuda_buf *cu;
	int fd = -1, ret;
	CUresult r;
	char ctx[224];

	out->fd = -1;
	out->priv = NULL;
	out->bytes = 0;
	if (bytes == 0 || bytes > SIZE_MAX / 2)
		return -EINVAL;
	if (device == SHARDD_HELLO_DEVICE_HOST)
		device = CUDA_DEFAULT_DEVICE;
	ret = cuda_device_get(cb, device, &d);
	if (ret)
		return ret;
	cu = calloc(1, sizeof(*cu));
	if (!cu)
		return -ENOMEM;
	cu->device = device;
	cu->size = (size_t)(bytes + d->granularity - 1) / d->granularity * d->granularity;
	snprintf(ctx, sizeof(ctx), "allocate %s (%llu bytes on device %d)", what,
		 (unsigned long long)bytes, device);
	cuda_prop(&prop, device);
	r = cb->drv.create(&cu->handle, cu->size, &prop, 0);
	if (r != CUDA_SUCCESS) {
		ret = cuda_drv_fail(cb, ctx, r);
		goto err_free;
	}
	r = cb->drv.address_reserve(&cu->ptr, cu->size, d->granularity, 0, 0);
	if (r != CUDA_SUCCESS) {
		ret = cuda_drv_fail(cb, ctx, r);
		goto err_release;
	}
	r = cb->drv.map(cu->ptr, cu->size, 0, cu->handle, 0);
	if (r != CUDA_SUCCESS) {
		ret = cuda_drv_fail(cb, ctx, r);
		goto err_address;
	}
	memset(&access, 0, sizeof(access));
	access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	access.location.id = device;
	access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	r = cb->drv.set_access(cu->ptr, cu->size, &access, 1);
	if (r == CUDA_SUCCESS)
		r = cb->drv.export_handle(&fd, cu->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	if (r != CUDA_SUCCESS) {
		ret = cuda_drv_fail(cb, ctx, r);
		goto err_unmap;
	}
	/* The driver does not promise FD_CLOEXEC; nothing the daemon runs may inherit a buffer. */
	if (fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) {
		ret = -errno;
		goto err_close;
	}
	/* Buffers start zeroed (backend.h); physical pages from cuMemCreate do not. */
	ret = cuda_finish(d, shardd_cuda_zero((void *)(uintptr_t)cu->ptr, cu->size, d->stream), ctx);
	if (ret)
		goto err_close;
	out->fd = fd;
	out->priv = cu;
	out->bytes = bytes;
	return 0;

err_close:
	close(fd);
err_unmap:
	cb->drv.unmap(cu->ptr, cu->size);
err_address:
	cb->drv.address_free(cu->ptr, cu->size);
err_release:
	cb->drv.release(cu->handle);
err_free:
	free(cu);
	return ret;
}

static void cuda_free(struct shardd_backend_ctx *b, struct shardd_buf *buf)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	struct cuda_buf *cu = buf->priv;

	/* Every call waited for its stream, so no queued work still uses the memory. */
	if (cu) {
		/* Driver calls act on the calling thread's current context. */
		(void)cudaSetDevice(cu->device);
		cb->drv.unmap(cu->ptr, cu->size);
		cb->drv.address_free(cu->ptr, cu->size);
		/* Clients that imported the fd keep the physical memory alive until they unmap it. */
		cb->drv.release(cu->handle);
		free(cu);
	}
	shardd_buf_forget(buf);
}

/*
 * How a client receives a buffer: a duplicate of the exported fd.
 * `readonly` cannot be honoured: whoever holds the fd may map the
 * allocation read-write (see the file comment).
 */
static int cuda_export_buf(struct shardd_backend_ctx *b, const struct shardd_buf *buf, int readonly,
			   struct shardd_buf_export *out)
{
	(void)b;
	(void)readonly;
	memset(out, 0, sizeof(*out));
	out->kind = SHARDD_EXPORT_FD;
	out->fd = fcntl(buf->fd, F_DUPFD_CLOEXEC, 0);
	return out->fd < 0 ? -errno : 0;
}

/* ------------------------------------------------------------------ */
/* Ops                                                                 */
/* ------------------------------------------------------------------ */

/* 0 when every buffer of an op lives on `device`; else the error of a multi-device op. */
static int cuda_same_device(const struct shardd_buf *b, int device, const char *op)
{
	if (cbuf(b)->device == device)
		return 0;
	shardd_log_error("shardd: cuda backend: %s spans devices %d and %d; ranks of one group on "
			 "different GPUs need NCCL, which this backend does not drive yet: run them on "
			 "one device or use --backend host", op, device, cbuf(b)->device);
	return -SHARDD_E_BACKEND;
}

static int cuda_unshard(struct shardd_backend_ctx *b, const struct shardd_unshard_args *a)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	const void *src[SHARDD_MAX_WORLD];
	int device = cbuf(a->unsharded)->device;
	struct cuda_device *d;
	int ret;

	if (a->nshards == 0 || a->nshards > SHARDD_MAX_WORLD)
		return -EINVAL;
	for (uint32_t s = 0; s < a->nshards; s++) {
		ret = cuda_same_device(a->shards[s], device, "unshard");
		if (ret)
			return ret;
	}
	ret = cuda_device_get(cb, device, &d);
	if (ret)
		return ret;
	for (uint32_t i = 0; i < a->layout->nparams && !ret; i++) {
		const struct shardd_layout_param *p = &a->layout->params[i];
		size_t us = shardd_dtype_size(p->unsharded_dtype);
		uint64_t chunk = p->rows * p->inner; /* elements of one shard of this param */

		if (p->shard_dim == 0) {
			/* Shard s is rows [s*rows, s*rows + valid) of the param: one cast, padding dropped. */
			for (uint32_t s = 0; s < a->nshards && !ret; s++)
				ret = shardd_cuda_cast(dptr(a->unsharded, p->unsharded_offset + s * chunk * us),
						       p->unsharded_dtype, dptr(a->shards[s], p->shard_offset),
						       p->dtype, shardd_layout_rows_valid(p, s) * p->inner,
						       d->stream);
		} else {
			for (uint32_t s = 0; s < a->nshards; s++)
				src[s] = dptr(a->shards[s], p->shard_offset);
			ret = shardd_cuda_chunk_cat(dptr(a->unsharded, p->unsharded_offset), p->unsharded_dtype,
						    src, p->dtype, a->nshards, p->outer, chunk, d->stream);
		}
	}
	return cuda_finish(d, ret, "unshard");
}

/* Queue the reduction of one param's valid rows, one launch per outer index, and zero its padding. */
static int cuda_reduce_param(const struct shardd_reduce_args *a, uint32_t i, cudaStream_t stream)
{
	const struct shardd_layout_param *p = &a->layout->params[i];
	uint32_t odt = shardd_shard_view_dtype(a->out, p);
	size_t os = shardd_dtype_size(odt), rs = shardd_dtype_size(a->math.reduce_dtype);
	uint64_t valid = shardd_layout_rows_valid(p, a->shard_rank);
	const void *in[SHARDD_CUDA_MAX_INPUTS];
	struct shardd_reduce_math m = a->math;
	uint32_t idt = a->src == SHARDD_REDUCE_SRC_GRAD ? p->grad_dtype : a->in_dtype;
	size_t is = shardd_dtype_size(idt);
	int ret = 0;

	for (uint64_t o = 0; o < p->outer && !ret; o++) {
		uint64_t at = o * p->rows * p->inner; /* element in the output shard */

		if (a->src == SHARDD_REDUCE_SRC_GRAD) {
			/* Shard s of the unsharded grad: rows [s*rows, s*rows + valid) of shard_dim. */
			uint64_t e = o * p->dim * p->inner + (uint64_t)a->shard_rank * p->rows * p->inner;

			for (uint32_t k = 0; k < a->nin; k++)
				in[k] = dptr(a->grads[k], p->grad_offset + e * is);
		} else {
			for (uint32_t k = 0; k < a->nin; k++)
				in[k] = dptr(a->views[k].buf, a->views[k].offsets[i] + at * is);
		}
		m.add = a->add ? dptr(a->add->buf, a->add->offsets[i] + at * rs) : NULL;
		ret = shardd_cuda_reduce(dptr(a->out->buf, a->out->offsets[i] + at * os), odt, a->accumulate,
					 in, a->nin, idt, valid * p->inner, &m, stream);
	}
	/* Padding rows exist for dim 0 only, where outer == 1. */
	if (!ret && valid < p->rows)
		ret = shardd_cuda_zero(dptr(a->out->buf, a->out->offsets[i] + valid * p->inner * os),
				       (p->rows - valid) * p->inner * os, stream);
	return ret;
}

static int cuda_reduce(struct shardd_backend_ctx *b, const struct shardd_reduce_args *a)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	int device = cbuf(a->out->buf)->device;
	struct cuda_device *d;
	int ret = 0;

	if (a->nin == 0 || a->nin > SHARDD_CUDA_MAX_INPUTS) {
		shardd_log_error("shardd: cuda backend: reduce of %u inputs: the kernels take 1 to %d",
				 a->nin, SHARDD_CUDA_MAX_INPUTS);
		return -EINVAL;
	}
	for (uint32_t k = 0; k < a->nin && !ret; k++)
		ret = cuda_same_device(a->src == SHARDD_REDUCE_SRC_GRAD ? a->grads[k] : a->views[k].buf,
				       device, "reduce");
	if (!ret && a->add)
		ret = cuda_same_device(a->add->buf, device, "reduce");
	if (!ret)
		ret = cuda_device_get(cb, device, &d);
	if (ret)
		return ret;
	for (uint32_t i = 0; i < a->layout->nparams && !ret; i++)
		ret = cuda_reduce_param(a, i, d->stream);
	return cuda_finish(d, ret, "reduce");
}

static int cuda_zero(struct shardd_backend_ctx *b, struct shardd_buf *buf, uint64_t offset, uint64_t bytes)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	struct cuda_device *d;
	int ret;

	if (offset > buf->bytes || bytes > buf->bytes - offset)
		return -EINVAL;
	ret = cuda_device_get(cb, cbuf(buf)->device, &d);
	if (ret)
		return ret;
	return cuda_finish(d, shardd_cuda_zero(dptr(buf, offset), (size_t)bytes, d->stream), "zero");
}

/* ------------------------------------------------------------------ */
/* Create and destroy                                                  */
/* ------------------------------------------------------------------ */

static void cuda_destroy(struct shardd_backend_ctx *b)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;

	for (int i = 0; i < cb->ndevices; i++) {
		if (!cb->devices[i].ready)
			continue;
		/* A stream belongs to its device's context: destroy it with that device current. */
		if (cudaSetDevice(i) == cudaSuccess)
			cudaStreamDestroy(cb->devices[i].stream);
	}
	pthread_mutex_destroy(&cb->lock);
	free(cb->devices);
	free(cb);
}

static const struct shardd_backend_ops cuda_ops = {
	.name = "cuda",
	.alloc = cuda_alloc,
	.free = cuda_free,
	.export_buf = cuda_export_buf,
	.unshard = cuda_unshard,
	.reduce = cuda_reduce,
	.zero = cuda_zero,
	.destroy = cuda_destroy,
};

/* Resolve one driver entry point. 0, or -SHARDD_E_BACKEND with err. */
static int cuda_symbol(const char *name, void **fn, char *err, size_t errlen)
{
	enum cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
	cudaError_t e;

	e = cudaGetDriverEntryPointByVersion(name, fn, CUDA_DRIVER_ABI, cudaEnableDefault, &status);
	if (e == cudaSuccess && status == cudaDriverEntryPointSuccess && *fn)
		return 0;
	snprintf(err, errlen,
		 "shardd: --backend cuda: the CUDA driver does not provide %s (%s, query status %d); "
		 "update the NVIDIA driver or use --backend host",
		 name, e == cudaSuccess ? "no such symbol" : cudaGetErrorString(e), (int)status);
	return -SHARDD_E_BACKEND;
}

int shardd_backend_cuda_create(struct shardd_backend_ctx **out, char *err, size_t errlen)
{
	struct cuda_backend *cb;
	cudaError_t e;
	void *fn;
	int n = 0, ret;

	e = cudaGetDeviceCount(&n);
	if (e != cudaSuccess || n <= 0) {
		snprintf(err, errlen, "shardd: --backend cuda: no CUDA device usable (cudaGetDeviceCount: %s); "
			 "use --backend host", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
		return -SHARDD_E_BACKEND;
	}
	cb = calloc(1, sizeof(*cb));
	if (!cb)
		goto err_nomem;
	cb->devices = calloc((size_t)n, sizeof(*cb->devices));
	if (!cb->devices)
		goto err_nomem;
	/* A driver entry point comes back as void *, converted to its PFN type as POSIX's dlsym. */
#define CUDA_RESOLVE(field, name)                                            \
	do {                                                                 \
		ret = cuda_symbol(name, &fn, err, errlen);                   \
		if (ret)                                                     \
			goto err_free;                                       \
		cb->drv.field = (__typeof__(cb->drv.field))fn;               \
	} while (0)
	CUDA_RESOLVE(get_error_string, "cuGetErrorString");
	CUDA_RESOLVE(device_get, "cuDeviceGet");
	CUDA_RESOLVE(device_get_attribute, "cuDeviceGetAttribute");
	CUDA_RESOLVE(granularity, "cuMemGetAllocationGranularity");
	CUDA_RESOLVE(create, "cuMemCreate");
	CUDA_RESOLVE(release, "cuMemRelease");
	CUDA_RESOLVE(address_reserve, "cuMemAddressReserve");
	CUDA_RESOLVE(address_free, "cuMemAddressFree");
	CUDA_RESOLVE(map, "cuMemMap");
	CUDA_RESOLVE(unmap, "cuMemUnmap");
	CUDA_RESOLVE(set_access, "cuMemSetAccess");
	CUDA_RESOLVE(export_handle, "cuMemExportToShareableHandle");
#undef CUDA_RESOLVE
	cb->base.ops = &cuda_ops;
	cb->ndevices = n;
	pthread_mutex_init(&cb->lock, NULL);
	*out = &cb->base;
	return 0;

err_nomem:
	snprintf(err, errlen, "shardd: --backend cuda: out of memory for the backend of %d devices", n);
	ret = -ENOMEM;
err_free:
	if (cb)
		free(cb->devices);
	free(cb);
	return ret;
}
