/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend's buffers (backend_cuda_int.h), in one of two export
 * kinds chosen per device when it is set up (--cuda-export auto|fd|ipc;
 * auto takes fd where the device can; backend_cuda_device.c):
 *
 * - fd (SHARDD_EXPORT_FD): the driver's virtual memory API. cuMemCreate
 *   makes a physical allocation that can be exported as a POSIX file
 *   descriptor (cuMemExportToShareableHandle), which travels to clients
 *   over the same SCM_RIGHTS path as a host memfd; the daemon maps it at an
 *   address range of its own (cuMemAddressReserve, cuMemMap,
 *   cuMemSetAccess). Sizes are rounded up to the device's minimum
 *   allocation granularity by shardd_cuda_alloc_size (proto/shardd_cuda.h),
 *   which a client importing the fd calls too (client/cuda_import.c). A
 *   client's mapping keeps the memory alive after the daemon frees it.
 * - ipc (SHARDD_EXPORT_CUDA_IPC), for devices without that API or without
 *   POSIX fd handles: each buffer is its own cudaMalloc of exactly its
 *   size, exported with cudaIpcGetMemHandle; the 64-byte handle travels in
 *   the GROUP reply's payload and a client opens it with
 *   cuIpcOpenMemHandle. The memory goes when the daemon frees it, open or
 *   not (docs/CUDA.md).
 *
 * A device allocation has no per-importer protection: the fd or handle of
 * the unsharded buffer lets a client map it writable. The host backend's
 * read-only guarantee becomes a convention here (docs/CUDA.md).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend_cuda_int.h"
#include "log.h"
#include "placement.h"
#include "shardd_cuda.h"
#include "shardd_cuda_kernels.h"

_Static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(struct shardd_cuda_ipc_handle),
	       "a CUDA IPC handle travels as struct shardd_cuda_ipc_handle");

void *shd_backend_cuda_ptr(const struct shd_buf *buf)
{
	return buf->priv ? dptr(buf, 0) : NULL;
}

/*
 * An fd-kind allocation of cu->size bytes: physical memory, mapped
 * read-write at an address range of the daemon's, and its exported fd in
 * *fd. 0, or an error with nothing left allocated.
 */
static int cuda_alloc_vmm(struct cuda_backend *cb, struct cuda_device *d, const char *ctx,
			  struct cuda_buf *cu, int *fd)
{
	CUmemAccessDesc access;
	CUmemAllocationProp prop;
	CUresult r;
	int ret;

	*fd = -1;
	cuda_vmm_prop(&prop, cu->device);
	r = cb->drv.create(&cu->handle, cu->size, &prop, 0);
	if (r != CUDA_SUCCESS)
		return cuda_drv_fail(cb, ctx, r);
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
	access.location.id = cu->device;
	access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	r = cb->drv.set_access(cu->ptr, cu->size, &access, 1);
	if (r == CUDA_SUCCESS)
		r = cb->drv.export_handle(fd, cu->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
					  0);
	if (r != CUDA_SUCCESS) {
		ret = cuda_drv_fail(cb, ctx, r);
		goto err_unmap;
	}
	/* The driver does not promise FD_CLOEXEC; nothing the daemon runs may inherit a buffer. */
	if (fcntl(*fd, F_SETFD, FD_CLOEXEC) < 0) {
		ret = -errno;
		goto err_close;
	}
	return 0;

err_close:
	close(*fd);
	*fd = -1;
err_unmap:
	cb->drv.unmap(cu->ptr, cu->size);
err_address:
	cb->drv.address_free(cu->ptr, cu->size);
err_release:
	cb->drv.release(cu->handle);
	return ret;
}

/*
 * An ipc-kind allocation of cu->size bytes on the current device and its
 * handle. Each buffer is its own cudaMalloc, so cu->ptr is the allocation's
 * base: cudaIpcGetMemHandle exports a whole allocation, and a client's
 * cuIpcOpenMemHandle maps it at its base, where every layout offset of the
 * GROUP reply counts from (docs/DESIGN.md: legacy IPC exports the base). 0, or
 * an error with nothing left allocated.
 */
static int cuda_alloc_ipc(const char *ctx, struct cuda_buf *cu)
{
	cudaIpcMemHandle_t h;
	void *p = NULL;
	cudaError_t e;
	int ret;

	e = cudaMalloc(&p, cu->size);
	if (e != cudaSuccess)
		goto err;
	e = cudaIpcGetMemHandle(&h, p);
	if (e != cudaSuccess) {
		cudaFree(p);
		goto err;
	}
	memcpy(cu->ipc.bytes, &h, sizeof(cu->ipc.bytes));
	cu->ptr = (CUdeviceptr)(uintptr_t)p;
	return 0;

err:
	ret = cuda_rt_fail(ctx, e);
	/* The runtime keeps a failed call as this thread's last error: the next launch check must not see it. */
	(void)cudaGetLastError();
	return ret;
}

/* Give back what cuda_alloc_vmm or cuda_alloc_ipc allocated. No queued work may still use it. */
static void cuda_release(struct cuda_backend *cb, struct cuda_buf *cu)
{
	cudaError_t e;

	/* Driver and runtime calls act on the calling thread's current device's context. */
	(void)cudaSetDevice(cu->device);
	if (cu->kind == SHARDD_EXPORT_FD) {
		cb->drv.unmap(cu->ptr, cu->size);
		cb->drv.address_free(cu->ptr, cu->size);
		/* Clients that imported the fd keep the physical memory alive until they unmap it. */
		cb->drv.release(cu->handle);
		return;
	}
	/*
	 * Legacy IPC keeps nothing alive for importers: a client that still has
	 * the handle open must not touch it after this (cuIpcOpenMemHandle calls
	 * that undefined behaviour); docs/CUDA.md tells trainers to close first.
	 */
	e = cudaFree((void *)(uintptr_t)cu->ptr);
	if (e != cudaSuccess) {
		shd_log_warn("shardd: cuda backend: cudaFree of a buffer on device %d: %s",
			     cu->device, cudaGetErrorString(e));
		(void)cudaGetLastError();
	}
}

int cuda_alloc(struct shd_backend_ctx *b, uint64_t bytes, int32_t device, const char *what,
	       struct shd_buf *out)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	struct cuda_device *d;
	struct cuda_buf *cu;
	int fd = -1, ret;
	char ctx[224];

	out->fd = -1;
	out->priv = NULL;
	out->bytes = 0;
	if (bytes == 0 || bytes > SIZE_MAX / 2)
		return -EINVAL;
	device = shd_placement_device(device);
	ret = cuda_device_get(cb, device, &d);
	if (ret)
		return ret;
	cu = calloc(1, sizeof(*cu));
	if (!cu)
		return -ENOMEM;
	cu->device = device;
	cu->kind = d->export_kind;
	snprintf(ctx, sizeof(ctx), "allocate %s (%llu bytes on device %d)", what,
		 (unsigned long long)bytes, device);
	if (cu->kind == SHARDD_EXPORT_FD) {
		cu->size = (size_t)shardd_cuda_alloc_size(bytes, d->granularity);
		ret = cuda_alloc_vmm(cb, d, ctx, cu, &fd);
	} else {
		/* No granularity here: a client maps exactly the size its GROUP reply gives. */
		cu->size = (size_t)bytes;
		ret = cuda_alloc_ipc(ctx, cu);
	}
	if (ret)
		goto err_free;
	/* Buffers start zeroed (backend.h); neither cuMemCreate's pages nor cudaMalloc's are. */
	ret = cuda_queued(shardd_cuda_zero((void *)(uintptr_t)cu->ptr, cu->size, d->stream), ctx);
	if (!ret)
		ret = cuda_device_wait(cb, device, d, ctx, NULL, 0);
	if (ret)
		goto err_release;
	out->fd = fd;
	out->priv = cu;
	out->bytes = bytes;
	return 0;

err_release:
	if (fd >= 0)
		close(fd);
	cuda_release(cb, cu);
err_free:
	free(cu);
	return ret;
}

void cuda_free(struct shd_backend_ctx *b, struct shd_buf *buf)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	struct cuda_buf *cu = buf->priv;

	if (cu) {
		struct cuda_device *d;

		/* Ops only queue their kernels: wait for those that may still use the memory. */
		if (cuda_device_get(cb, cu->device, &d) == 0)
			(void)cuda_device_wait(cb, cu->device, d, "free a buffer", NULL, 0);
		cuda_release(cb, cu);
		free(cu);
	}
	shd_buf_forget(buf);
}

/*
 * How a client receives a buffer: as its device's export kind says, a
 * duplicate of the exported fd or the IPC handle (which only another
 * process can open). SHD_EXPORT_RO cannot be honoured by either: whoever holds
 * the fd or the handle may map the allocation read-write (see the file
 * comment).
 */
int cuda_export_buf(struct shd_backend_ctx *b, const struct shd_buf *buf, int mode,
		    struct shd_buf_export *out)
{
	const struct cuda_buf *cu = cbuf(buf);

	(void)b;
	(void)mode;
	memset(out, 0, sizeof(*out));
	out->kind = cu->kind;
	out->fd = -1;
	if (cu->kind == SHARDD_EXPORT_CUDA_IPC) {
		out->ipc = cu->ipc;
		return 0;
	}
	out->fd = fcntl(buf->fd, F_DUPFD_CLOEXEC, 0);
	return out->fd < 0 ? -errno : 0;
}

/*
 * A synchronous copy between `buf` at `offset` and host memory on the
 * runtime's default stream: `kind` cudaMemcpyDeviceToHost into `to_host`,
 * or cudaMemcpyHostToDevice from `from_host`. 0, -EINVAL (outside the
 * buffer) or the runtime's error.
 */
static int cuda_copy(const struct shd_buf *buf, uint64_t offset, uint64_t bytes,
		     enum cudaMemcpyKind kind, void *to_host, const void *from_host)
{
	const struct cuda_buf *cu = cbuf(buf);
	cudaError_t e;
	char ctx[96];
	int ret;

	if (offset > buf->bytes || bytes > buf->bytes - offset)
		return -EINVAL;
	e = cudaSetDevice(cu->device);
	if (e == cudaSuccess)
		e = kind == cudaMemcpyDeviceToHost
			    ? cudaMemcpy(to_host, dptr(buf, offset), (size_t)bytes, kind)
			    : cudaMemcpy(dptr(buf, offset), from_host, (size_t)bytes, kind);
	if (e == cudaSuccess)
		return 0;
	snprintf(ctx, sizeof(ctx), "%s %llu bytes of a buffer on device %d",
		 kind == cudaMemcpyDeviceToHost ? "read" : "write", (unsigned long long)bytes,
		 cu->device);
	ret = cuda_rt_fail(ctx, e);
	/* The runtime keeps a failed call as this thread's last error: the next launch check must not see it. */
	(void)cudaGetLastError();
	return ret;
}

/*
 * A copy to host memory on the runtime's default stream: it waits for no
 * op queued on the device's own stream, so the bytes are a snapshot like
 * the host backend's (backend.h).
 */
int cuda_read(struct shd_backend_ctx *b, const struct shd_buf *buf, uint64_t offset, uint64_t bytes,
	      void *dst)
{
	(void)b;
	return cuda_copy(buf, offset, bytes, cudaMemcpyDeviceToHost, dst, NULL);
}

/* A copy from host memory on the runtime's default stream, synchronous (a restore). */
int cuda_write(struct shd_backend_ctx *b, struct shd_buf *buf, uint64_t offset, uint64_t bytes,
	       const void *src)
{
	(void)b;
	return cuda_copy(buf, offset, bytes, cudaMemcpyHostToDevice, NULL, src);
}
