/* SPDX-License-Identifier: MIT */
/*
 * Cuda backend: a group's buffers live in device memory; the kernels of
 * shardd_cuda_kernels.h move their bytes.
 *
 * Memory, in one of two export kinds chosen per device when it is set up
 * (--cuda-export auto|fd|ipc; auto takes fd where the device can):
 *
 * - fd (SHARDD_EXPORT_FD): the driver's virtual memory API. cuMemCreate
 *   makes a physical allocation that can be exported as a POSIX file
 *   descriptor (cuMemExportToShareableHandle), which travels to clients
 *   over the same SCM_RIGHTS path as a host memfd; the daemon maps it at an
 *   address range of its own (cuMemAddressReserve, cuMemMap,
 *   cuMemSetAccess). Sizes are rounded up to the device's minimum
 *   allocation granularity; a client importing the fd rounds the same way
 *   (client/cuda_import.c). A client's mapping keeps the memory alive after
 *   the daemon frees it.
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
 *
 * Work: one non-blocking stream per device. Unshard, reduce and zero queue
 * their kernels and return; the engine calls `sync` before a completion
 * that promises results in memory, and a client that set a stream gets
 * fences instead: interprocess events (cudaEventInterprocess) that its
 * stream records before an op and waits on after it, so neither side
 * waits on a CPU. A buffer lives on the device its rank named in its hello (the
 * unsharded buffer on its replica's first rank's device, or each rank's own
 * where its shard group runs NCCL).
 *
 * Collectives (placement.h): the members of an op (a shard group, or a
 * replicate group) all on one device are served with device copies and
 * kernels on that device's stream; members on pairwise distinct devices
 * with NCCL (backend_cuda_nccl.c), through a second stream per device: the
 * device's NCCL stream waits for an event recorded on its stream after the
 * op's inputs (copy-in kernels, or the client's fence), NCCL runs there,
 * and the device's stream waits for an event recorded after the collective
 * before the copy-out kernels. So the device's stream orders everything as
 * before (sync, fences), and no kernel of another op ever enters a stream
 * NCCL is still queueing into (non-blocking communicators forbid that). An
 * NCCL op is queued whole (copy-in, collective, copy-out, on every device)
 * under one daemon-wide lock: NCCL collectives reach every device's
 * streams in one order, so two of them can never wait for each other
 * across devices. Its staging buffer is per device (S flat shards for an
 * all-gather, S shards in the reduce dtype for a reduce-scatter), grown to
 * the largest op and used under that lock only.
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
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/backend.h"
#include "daemon/backend_cuda.h"
#include "daemon/backend_cuda_nccl.h"
#include "daemon/log.h"
#include "daemon/placement.h"
#include "daemon/rendezvous.h"
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
	PFN_cuDeviceGetName_v2000                  device_get_name;
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
	uint32_t     export_kind; /* enum shardd_export_kind of every buffer on the device */
	cudaStream_t stream;      /* every kernel of this backend on the device */
	size_t       granularity; /* fd kind: minimum allocation granularity, bytes */
	/* NCCL, made at the device's first collective across devices; used under nccl_lock. */
	int          nccl_ready;
	cudaStream_t nccl_stream; /* NCCL's collectives on the device */
	cudaEvent_t  staged;      /* on stream: the op's inputs are ready; nccl_stream waits on it */
	cudaEvent_t  collected;   /* on nccl_stream: the collective is done; stream waits on it */
	struct shardd_buf staging;
	/* Set once nccl_ready: waits on the device are bounded by the collective timeout. */
	atomic_int   nccl_used;
};

struct cuda_backend {
	struct shardd_backend_ctx base;
	struct cuda_driver drv;
	uint32_t mode;                /* --cuda-export: enum shardd_cuda_export */
	uint64_t timeout_ns;          /* the collective timeout: bounds every wait on NCCL */
	int ndevices;
	pthread_mutex_t lock;         /* device set-up */
	struct cuda_device *devices;  /* [ndevices] */
	/*
	 * Every NCCL call, and each NCCL op queued whole (backend_cuda_nccl.h).
	 * Taken before `lock` where both are held.
	 */
	pthread_mutex_t nccl_lock;
	struct shardd_nccl *nccl;     /* the communicators of every job */
};

/* A job's state: its name, and the key of its communicators. */
struct shardd_backend_job {
	char name[SHARDD_NAME_MAX];
};

/* One session's fences (backend.h): events on the session's device, indexed by ring slot. */
struct shardd_fences {
	int          device;
	uint32_t     nwait, nsignal;
	cudaEvent_t *wait;   /* [nwait]: the client's events, opened; NULL where not (yet) opened */
	cudaEvent_t *signal; /* [nsignal]: ours, exported to the client */
};

/* What buf->priv points to. */
struct cuda_buf {
	uint32_t                     kind;   /* enum shardd_export_kind: its device's */
	CUdeviceptr                  ptr;    /* the daemon's address: fd kind a mapping, ipc the cudaMalloc base */
	size_t                       size;   /* fd: reserved and mapped, bytes rounded to the granularity;
						ipc: allocated, the buffer's bytes */
	CUmemGenericAllocationHandle handle; /* fd kind */
	struct shardd_cuda_ipc_handle ipc;   /* ipc kind: from cudaIpcGetMemHandle */
	int                          device;
};

_Static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(struct shardd_cuda_ipc_handle),
	       "a CUDA IPC handle travels as struct shardd_cuda_ipc_handle");

/*
 * How often a wait on a device that runs NCCL collectives asks the
 * communicators for asynchronous errors, and how long it sleeps between
 * looks at the stream.
 */
#define CUDA_NCCL_CHECK_NS 10000000ull
#define CUDA_WAIT_POLL_NS  20000

/* This thread holds nccl_lock: a wait it makes checks the communicators without taking it again. */
static _Thread_local int nccl_lock_held;

static void nccl_lock(struct cuda_backend *cb)
{
	pthread_mutex_lock(&cb->nccl_lock);
	nccl_lock_held = 1;
}

static void nccl_unlock(struct cuda_backend *cb)
{
	nccl_lock_held = 0;
	pthread_mutex_unlock(&cb->nccl_lock);
}

/* ------------------------------------------------------------------ */
/* Errors                                                              */
/* ------------------------------------------------------------------ */

static int cuda_rt_fail(const char *what, cudaError_t e)
{
	shardd_log_error("shardd: cuda backend: %s: %s (%s)", what, cudaGetErrorString(e),
			 cudaGetErrorName(e));
	return e == cudaErrorMemoryAllocation ? -ENOMEM : -SHARDD_E_BACKEND;
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

static const char *cuda_export_mode_name(uint32_t mode)
{
	return mode == SHARDD_CUDA_EXPORT_FD ? "fd" : mode == SHARDD_CUDA_EXPORT_IPC ? "ipc" : "auto";
}

static const char *yes_no(int v)
{
	return v ? "yes" : "no";
}

/*
 * The export kind of `device` under cb->mode, from what it supports: fd
 * needs the virtual memory API with POSIX fd handles, legacy IPC needs
 * unified addressing (cuIpcGetMemHandle's condition on Linux). 0 and *kind,
 * or -SHARDD_E_BACKEND after logging why and which flag would work.
 */
static int cuda_export_choose(const struct cuda_backend *cb, int device, const char *name, int vmm,
			      int posix_fd, int uva, uint32_t *kind)
{
	int fd_ok = vmm && posix_fd;

	if (cb->mode != SHARDD_CUDA_EXPORT_IPC && fd_ok) {
		*kind = SHARDD_EXPORT_FD;
		return 0;
	}
	if (cb->mode != SHARDD_CUDA_EXPORT_FD && uva) {
		*kind = SHARDD_EXPORT_CUDA_IPC;
		return 0;
	}
	if (cb->mode == SHARDD_CUDA_EXPORT_FD)
		shardd_log_error("shardd: cuda backend: device %d (%s) cannot export memory as file "
				 "descriptors (virtual memory management %s, POSIX fd handles %s); use "
				 "--cuda-export auto or ipc, or --backend host", device, name, yes_no(vmm),
				 yes_no(posix_fd));
	else if (cb->mode == SHARDD_CUDA_EXPORT_IPC)
		shardd_log_error("shardd: cuda backend: device %d (%s) cannot export legacy CUDA IPC "
				 "handles (no unified addressing); use --cuda-export auto or fd, or "
				 "--backend host", device, name);
	else
		shardd_log_error("shardd: cuda backend: device %d (%s) can export memory neither as file "
				 "descriptors (virtual memory management %s, POSIX fd handles %s) nor as "
				 "legacy CUDA IPC handles (unified addressing no); use --backend host",
				 device, name, yes_no(vmm), yes_no(posix_fd));
	return -SHARDD_E_BACKEND;
}

/*
 * First use of `device`: choose how its buffers are exported (logged once),
 * make its stream. Caller holds cb->lock.
 */
static int cuda_device_setup(struct cuda_backend *cb, int device, struct cuda_device *d)
{
	CUmemAllocationProp prop;
	CUdevice dev;
	CUresult r;
	cudaError_t e;
	int vmm = 0, posix_fd = 0, uva = 0, ret;
	char what[96], name[256];

	snprintf(what, sizeof(what), "set up device %d", device);
	e = cudaSetDevice(device);
	if (e != cudaSuccess)
		return cuda_rt_fail(what, e);
	r = cb->drv.device_get(&dev, device);
	if (r == CUDA_SUCCESS)
		r = cb->drv.device_get_name(name, (int)sizeof(name), dev);
	if (r == CUDA_SUCCESS)
		r = cb->drv.device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
						 dev);
	if (r == CUDA_SUCCESS)
		r = cb->drv.device_get_attribute(&posix_fd,
						 CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
						 dev);
	if (r == CUDA_SUCCESS)
		r = cb->drv.device_get_attribute(&uva, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, dev);
	if (r != CUDA_SUCCESS)
		return cuda_drv_fail(cb, what, r);
	/* The driver writes a NUL-terminated name; make sure of it before printing. */
	name[sizeof(name) - 1] = '\0';
	ret = cuda_export_choose(cb, device, name, vmm, posix_fd, uva, &d->export_kind);
	if (ret)
		return ret;
	if (d->export_kind == SHARDD_EXPORT_FD) {
		cuda_prop(&prop, device);
		r = cb->drv.granularity(&d->granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
		if (r != CUDA_SUCCESS)
			return cuda_drv_fail(cb, what, r);
		if (d->granularity == 0) {
			shardd_log_error("shardd: cuda backend: device %d reports an allocation granularity of 0",
					 device);
			return -SHARDD_E_BACKEND;
		}
	}
	/* Non-blocking: the legacy default stream of other threads must not serialise with ours. */
	e = cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking);
	if (e != cudaSuccess)
		return cuda_rt_fail(what, e);
	d->ready = 1;
	shardd_log_info("cuda backend: device %d (%s) exports its buffers as %s (--cuda-export %s; "
			"virtual memory management %s, POSIX fd handles %s, unified addressing %s)",
			device, name,
			d->export_kind == SHARDD_EXPORT_FD ? "POSIX file descriptors of cuMemCreate allocations"
							   : "legacy CUDA IPC handles of cudaMalloc allocations",
			cuda_export_mode_name(cb->mode), yes_no(vmm), yes_no(posix_fd), yes_no(uva));
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

/* Wait for everything queued on the device's stream. */
static int cuda_stream_sync(struct cuda_device *d, const char *what)
{
	cudaError_t e = cudaStreamSynchronize(d->stream);

	return e == cudaSuccess ? 0 : cuda_rt_fail(what, e);
}

/*
 * Wait for everything queued on the stream of `device` (current on this
 * thread). A device that runs NCCL collectives is polled instead, so that
 * a collective that never ends cannot hang the wait: its communicators are
 * asked for asynchronous errors every CUDA_NCCL_CHECK_NS, and at the
 * collective timeout every clique with a member on the device is aborted
 * (NCCL then stops its kernels). 0, or an error with `err` (may be NULL)
 * naming the device and the communicators.
 */
static int cuda_device_wait(struct cuda_backend *cb, int device, struct cuda_device *d, const char *what,
			    char *err, size_t errlen)
{
	struct timespec pause = { 0, CUDA_WAIT_POLL_NS };
	uint64_t now, deadline, check;
	cudaError_t e;
	char why[512];

	if (!atomic_load_explicit(&d->nccl_used, memory_order_relaxed))
		return cuda_stream_sync(d, what);
	now = shardd_now_ns();
	deadline = now + cb->timeout_ns;
	check = now + CUDA_NCCL_CHECK_NS;
	for (;;) {
		e = cudaStreamQuery(d->stream);
		if (e == cudaSuccess)
			return 0;
		if (e != cudaErrorNotReady)
			return cuda_rt_fail(what, e);
		/* Not ready is no failure: leave no trace of it for the next launch check. */
		(void)cudaGetLastError();
		now = shardd_now_ns();
		if (now >= check) {
			int late = now >= deadline;
			uint32_t aborted;

			if (!nccl_lock_held)
				pthread_mutex_lock(&cb->nccl_lock);
			aborted = shardd_nccl_check_device(cb->nccl, device, late, why, sizeof(why));
			if (!nccl_lock_held)
				pthread_mutex_unlock(&cb->nccl_lock);
			if (aborted) {
				shardd_log_error("shardd: cuda backend: %s: device %d: %s; aborted %u NCCL "
						 "communicator set(s): %s", what, device,
						 late ? "its work did not finish within the collective timeout"
						      : "NCCL reported an error", aborted, why);
				if (err)
					snprintf(err, errlen, "device %d %s; its NCCL communicators were aborted: %s",
						 device, late ? "did not finish within the collective timeout"
							      : "reported an NCCL error", why);
				return -SHARDD_E_BACKEND;
			}
			/* No collective left on the device: what remains are kernels, which end. */
			if (late)
				return cuda_stream_sync(d, what);
			check = now + CUDA_NCCL_CHECK_NS;
		}
		nanosleep(&pause, NULL);
	}
}

/* `ret`: the result of queueing an op's kernels. Their execution is checked by sync or a fence. */
static int cuda_queued(int ret, const char *what)
{
	if (ret)
		shardd_log_error("shardd: cuda backend: %s: a kernel launch failed (%d)", what, ret);
	return ret;
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
	cuda_prop(&prop, cu->device);
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
		r = cb->drv.export_handle(fd, cu->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
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
		shardd_log_warn("shardd: cuda backend: cudaFree of a buffer on device %d: %s", cu->device,
				cudaGetErrorString(e));
		(void)cudaGetLastError();
	}
}

static int cuda_alloc(struct shardd_backend_ctx *b, uint64_t bytes, int32_t device, const char *what,
		      struct shardd_buf *out)
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
	device = shardd_placement_device(device);
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
		cu->size = (size_t)(bytes + d->granularity - 1) / d->granularity * d->granularity;
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

static void cuda_free(struct shardd_backend_ctx *b, struct shardd_buf *buf)
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
	shardd_buf_forget(buf);
}

/*
 * How a client receives a buffer: as its device's export kind says, a
 * duplicate of the exported fd or the IPC handle (which only another
 * process can open). `readonly` cannot be honoured by either: whoever holds
 * the fd or the handle may map the allocation read-write (see the file
 * comment).
 */
static int cuda_export_buf(struct shardd_backend_ctx *b, const struct shardd_buf *buf, int readonly,
			   struct shardd_buf_export *out)
{
	const struct cuda_buf *cu = cbuf(buf);

	(void)b;
	(void)readonly;
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

/* ------------------------------------------------------------------ */
/* Ops                                                                 */
/* ------------------------------------------------------------------ */

/*
 * An op's failure that the op's completion names: `err` (the args') gets
 * the text, the log gets it with the op. Returns `ret`.
 */
__attribute__((format(printf, 5, 6)))
static int cuda_op_fail(int ret, char *err, size_t errlen, const char *op, const char *fmt, ...)
{
	char text[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	shardd_log_error("shardd: cuda backend: %s: %s", op, text);
	if (err && errlen)
		snprintf(err, errlen, "%s", text);
	return ret;
}

/* 0 when member k's buffer `b` (`role`) sits on `device`, the member's device; else the error. */
static int cuda_on_device(const struct shardd_buf *b, int device, uint32_t k, const char *role, char *err,
			  size_t errlen, const char *op)
{
	if (cbuf(b)->device == device)
		return 0;
	return cuda_op_fail(-SHARDD_E_BACKEND, err, errlen, op,
			    "member %u's %s is on device %d but its input on device %d: an op's buffers of "
			    "one rank must share its device", k, role, cbuf(b)->device, device);
}

/*
 * How the `n` members of an op sit, from the devices of their inputs:
 * SHARED (all on devices[0]) or NCCL; MIXED, which registration refuses
 * (placement.h), fails here too.
 */
static int cuda_placement(const int32_t *devices, uint32_t n, const char *op, char *err, size_t errlen,
			  uint32_t *kind)
{
	*kind = shardd_placement_classify(devices, n);
	if (*kind != SHARDD_PLACE_MIXED)
		return 0;
	return cuda_op_fail(-SHARDD_E_BACKEND, err, errlen, op,
			    "its %u ranks' buffers partly share GPUs (devices %d and %d, ...): all must be on "
			    "one GPU or each on its own", n, devices[0], devices[1]);
}

/*
 * Copy-out of an all-gather into `out`: param by param, shard s's rows from
 * flat shard s at src[s] (device addresses), cast to the unsharded dtype,
 * padding rows dropped (dim 0), or chunk-cat (Shard(i > 0)).
 */
static int cuda_copy_out(const struct shardd_layout *l, uint32_t nshards, uint8_t *const *src,
			 const struct shardd_buf *out, cudaStream_t stream)
{
	const void *chunks[SHARDD_MAX_WORLD];
	int ret = 0;

	for (uint32_t i = 0; i < l->nparams && !ret; i++) {
		const struct shardd_layout_param *p = &l->params[i];
		size_t us = shardd_dtype_size(p->unsharded_dtype);
		uint64_t chunk = p->rows * p->inner; /* elements of one shard of this param */

		if (p->shard_dim == 0) {
			/* Shard s is rows [s*rows, s*rows + valid) of the param: one cast, padding dropped. */
			for (uint32_t s = 0; s < nshards && !ret; s++)
				ret = shardd_cuda_cast(dptr(out, p->unsharded_offset + s * chunk * us),
						       p->unsharded_dtype, src[s] + p->shard_offset, p->dtype,
						       shardd_layout_rows_valid(p, s) * p->inner, stream);
		} else {
			for (uint32_t s = 0; s < nshards; s++)
				chunks[s] = src[s] + p->shard_offset;
			ret = shardd_cuda_chunk_cat(dptr(out, p->unsharded_offset), p->unsharded_dtype, chunks,
						    p->dtype, nshards, p->outer, chunk, stream);
		}
	}
	return ret;
}

/* ---- NCCL ops: everything under nccl_lock ---- */

/* The members of one NCCL op: their devices, NCCL streams and staging buffers. */
struct cuda_nccl_op {
	struct shardd_nccl_clique *clique;
	const int32_t *devices;                     /* [n]: member k's device, NCCL rank k */
	uint32_t n;
	struct cuda_device *d[SHARDD_MAX_WORLD];
	uint8_t *staging[SHARDD_MAX_WORLD];         /* NULL without staging */
	void *streams[SHARDD_MAX_WORLD];            /* NCCL streams */
};

/* Make `device`'s NCCL stream and events once; `device` is current. */
static int cuda_nccl_device(struct cuda_device *d)
{
	cudaError_t e;

	if (d->nccl_ready)
		return 0;
	/* Non-blocking, as the device's stream: no implicit sync with the legacy default stream. */
	e = cudaStreamCreateWithFlags(&d->nccl_stream, cudaStreamNonBlocking);
	if (e != cudaSuccess)
		return cuda_rt_fail("make an NCCL stream", e);
	e = cudaEventCreateWithFlags(&d->staged, cudaEventDisableTiming);
	if (e == cudaSuccess) {
		e = cudaEventCreateWithFlags(&d->collected, cudaEventDisableTiming);
		if (e != cudaSuccess)
			cudaEventDestroy(d->staged);
	}
	if (e != cudaSuccess) {
		cudaStreamDestroy(d->nccl_stream);
		return cuda_rt_fail("make the events of an NCCL stream", e);
	}
	d->nccl_ready = 1;
	atomic_store_explicit(&d->nccl_used, 1, memory_order_relaxed);
	return 0;
}

/* `device`'s staging buffer, grown to at least `bytes`. */
static int cuda_staging(struct cuda_backend *cb, int device, struct cuda_device *d, uint64_t bytes,
			uint8_t **out)
{
	char what[96];
	int ret;

	if (d->staging.bytes < bytes) {
		/* Waits for the work queued on the device, the last op's use of the old buffer with it. */
		cuda_free(&cb->base, &d->staging);
		snprintf(what, sizeof(what), "the NCCL staging buffer of device %d", device);
		ret = cuda_alloc(&cb->base, bytes, device, what, &d->staging);
		if (ret)
			return ret;
	}
	*out = dptr(&d->staging, 0);
	return 0;
}

/*
 * Start an NCCL op of `job` over members on `devices` (pairwise distinct):
 * each device ready for NCCL with a staging buffer of `staging` bytes (0:
 * none), and the job's clique over the devices. 0, or an error with `err`.
 */
static int nccl_op_begin(struct cuda_backend *cb, struct shardd_backend_job *job, const int32_t *devices,
			 uint32_t n, uint64_t staging, struct cuda_nccl_op *op, char *err, size_t errlen)
{
	int ret;

	/* Communicators belong to a job: a call without one (tools, tests) has none to use. */
	if (!job) {
		snprintf(err, errlen, "a collective across devices needs the job its communicators belong to");
		return -EINVAL;
	}
	op->devices = devices;
	op->n = n;
	for (uint32_t k = 0; k < n; k++) {
		op->staging[k] = NULL;
		ret = cuda_device_get(cb, devices[k], &op->d[k]);
		if (!ret)
			ret = cuda_nccl_device(op->d[k]);
		if (!ret && staging)
			ret = cuda_staging(cb, devices[k], op->d[k], staging, &op->staging[k]);
		if (ret) {
			snprintf(err, errlen, "device %d cannot take part in NCCL collectives (see the daemon's log)",
				 devices[k]);
			return ret;
		}
		op->streams[k] = op->d[k]->nccl_stream;
	}
	return shardd_nccl_clique(cb->nccl, job, job->name, devices, n, &op->clique, err, errlen);
}

/*
 * Hand the op to NCCL (`to_nccl`: each NCCL stream waits for the work
 * queued so far on its device's stream, the op's inputs) or back (each
 * device's stream waits for its NCCL stream, the collective).
 */
static int nccl_op_handover(struct cuda_nccl_op *op, int to_nccl)
{
	cudaError_t e = cudaSuccess;

	for (uint32_t k = 0; k < op->n && e == cudaSuccess; k++) {
		struct cuda_device *d = op->d[k];
		cudaEvent_t ev = to_nccl ? d->staged : d->collected;

		/* An event is recorded on a stream of its own device. */
		e = cudaSetDevice(op->devices[k]);
		if (e == cudaSuccess)
			e = cudaEventRecord(ev, to_nccl ? d->stream : d->nccl_stream);
		if (e == cudaSuccess)
			e = cudaStreamWaitEvent(to_nccl ? d->nccl_stream : d->stream, ev, 0);
	}
	return e == cudaSuccess ? 0 : cuda_rt_fail("order a device's stream with its NCCL stream", e);
}

/* "devices 0,1" */
static void devices_str(const int32_t *devices, uint32_t n, char *buf, size_t len)
{
	size_t off = (size_t)snprintf(buf, len, "devices");

	for (uint32_t k = 0; k < n && off < len; k++)
		off += (size_t)snprintf(buf + off, len - off, "%s%d", k ? "," : " ", devices[k]);
}

/*
 * Unshard of a shard group whose ranks sit on distinct devices: the flat
 * shards all-gathered as bytes into each device's staging buffer, then
 * copied out into each rank's own unsharded buffer on its device.
 */
static int cuda_unshard_nccl(struct cuda_backend *cb, const struct shardd_unshard_args *a,
			     const int32_t *devices)
{
	const struct shardd_layout *l = a->layout;
	uint32_t n = a->nshards;
	struct cuda_nccl_op op;
	void *send[SHARDD_MAX_WORLD], *recv[SHARDD_MAX_WORLD];
	uint8_t *src[SHARDD_MAX_WORLD];
	char why[512] = "", devs[128];
	int ret = 0;

	for (uint32_t k = 0; k < n && !ret; k++)
		ret = cuda_on_device(a->unsharded[k], devices[k], k, "unsharded buffer", a->err, a->errlen,
				     "unshard");
	if (ret)
		return ret;
	nccl_lock(cb);
	ret = nccl_op_begin(cb, a->job, devices, n, shardd_placement_staging_bytes(n, l->shard_size, 0), &op,
			    why, sizeof(why));
	if (!ret)
		ret = nccl_op_handover(&op, 1);
	for (uint32_t k = 0; k < n && !ret; k++) {
		send[k] = dptr(a->shards[k], 0);
		recv[k] = op.staging[k];
	}
	if (!ret)
		ret = shardd_nccl_collective(cb->nccl, op.clique, SHARDD_NCCL_ALL_GATHER, send, recv,
					     l->shard_size, SHARDD_DTYPE_NONE, op.streams, why, sizeof(why));
	if (!ret)
		ret = nccl_op_handover(&op, 0);
	/* Each device copies out of its own staging buffer, where shard s sits at s x shard_size. */
	for (uint32_t k = 0; k < n && !ret; k++) {
		for (uint32_t s = 0; s < n; s++)
			src[s] = op.staging[k] + s * l->shard_size;
		ret = cudaSetDevice(devices[k]) == cudaSuccess ? 0 : -SHARDD_E_BACKEND;
		if (!ret)
			ret = cuda_queued(cuda_copy_out(l, n, src, a->unsharded[k], op.d[k]->stream), "unshard");
	}
	nccl_unlock(cb);
	if (ret) {
		devices_str(devices, n, devs, sizeof(devs));
		cuda_op_fail(ret, a->err, a->errlen, "unshard", "all-gather on %s: %s", devs,
			     why[0] ? why : "a CUDA call failed (see the daemon's log)");
	}
	return ret;
}

static int cuda_unshard(struct shardd_backend_ctx *b, const struct shardd_unshard_args *a)
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
	if (kind == SHARDD_PLACE_NCCL)
		return cuda_unshard_nccl(cb, a, devices);
	for (uint32_t s = 0; s < a->nshards && !ret; s++)
		ret = cuda_on_device(a->unsharded[s], devices[0], s, "unsharded buffer", a->err, a->errlen,
				     "unshard");
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

/* Member k's addend view, or NULL. */
static const struct shardd_shard_view *reduce_add(const struct shardd_reduce_args *a, uint32_t k)
{
	return a->adds && a->adds[k].buf ? &a->adds[k] : NULL;
}

/* Queue member k's output of param i on one device, one launch per outer index, and zero its padding. */
static int cuda_reduce_param(const struct shardd_reduce_args *a, uint32_t k, uint32_t i, cudaStream_t stream)
{
	const struct shardd_layout_param *p = &a->layout->params[i];
	const struct shardd_shard_view *out = &a->outs[k], *add = reduce_add(a, k);
	uint32_t shard_rank = a->src == SHARDD_REDUCE_SRC_GRAD ? k : a->shard_rank;
	uint32_t odt = shardd_shard_view_dtype(out, p);
	size_t os = shardd_dtype_size(odt), rs = shardd_dtype_size(a->math.reduce_dtype);
	uint64_t valid = shardd_layout_rows_valid(p, shard_rank);
	const void *in[SHARDD_CUDA_MAX_INPUTS];
	struct shardd_reduce_math m = a->math;
	uint32_t idt = a->src == SHARDD_REDUCE_SRC_GRAD ? p->grad_dtype : a->in_dtype;
	size_t is = shardd_dtype_size(idt);
	int ret = 0;

	for (uint64_t o = 0; o < p->outer && !ret; o++) {
		uint64_t at = o * p->rows * p->inner; /* element in the output shard */

		if (a->src == SHARDD_REDUCE_SRC_GRAD) {
			/* Shard s of the unsharded grad: rows [s*rows, s*rows + valid) of shard_dim. */
			uint64_t e = o * p->dim * p->inner + (uint64_t)shard_rank * p->rows * p->inner;

			for (uint32_t j = 0; j < a->n; j++)
				in[j] = dptr(a->grads[j], p->grad_offset + e * is);
		} else {
			for (uint32_t j = 0; j < a->n; j++)
				in[j] = dptr(a->views[j].buf, a->views[j].offsets[i] + at * is);
		}
		m.add = add ? dptr(add->buf, add->offsets[i] + at * rs) : NULL;
		ret = shardd_cuda_reduce(dptr(out->buf, out->offsets[i] + at * os), odt, a->accumulate[k], in,
					 a->n, idt, valid * p->inner, &m, stream);
	}
	/* Padding rows exist for dim 0 only, where outer == 1. */
	if (!ret && valid < p->rows)
		ret = shardd_cuda_zero(dptr(out->buf, out->offsets[i] + valid * p->inner * os),
				       (p->rows - valid) * p->inner * os, stream);
	return ret;
}

/*
 * Copy-in of a reduce-scatter on member k's device: its grad rows of every
 * destination shard s, cast to the reduce dtype and pre-divided (FSDP2's
 * fp16 factor), into block s of its staging buffer (rank-major: the block
 * NCCL rank s receives the sum of).
 */
static int nccl_copy_in(const struct shardd_reduce_args *a, uint32_t k, uint8_t *staging, cudaStream_t stream)
{
	const struct shardd_reduce_math pre = {
		.reduce_dtype = a->math.reduce_dtype, .pre = a->math.pre, .avg = 1, .post = 1,
	};
	uint32_t rd = a->math.reduce_dtype;
	size_t rs = shardd_dtype_size(rd);
	int ret = 0;

	for (uint32_t s = 0; s < a->n && !ret; s++) {
		for (uint32_t i = 0; i < a->layout->nparams && !ret; i++) {
			const struct shardd_layout_param *p = &a->layout->params[i];
			uint64_t n = shardd_layout_rows_valid(p, s) * p->inner;
			size_t gs = shardd_dtype_size(p->grad_dtype);

			for (uint64_t o = 0; o < p->outer && !ret; o++) {
				uint8_t *dst = staging + s * a->reduce_shard_size + a->reduce_offsets[i] +
					       o * p->rows * p->inner * rs;
				const void *src = dptr(a->grads[k], p->grad_offset +
							   (o * p->dim + (uint64_t)s * p->rows) * p->inner * gs);

				/* x = round(round(g) / pre), as every input of the host's reduce. */
				if (pre.pre > 1)
					ret = shardd_cuda_reduce(dst, rd, 0, &src, 1, p->grad_dtype, n, &pre, stream);
				else
					ret = shardd_cuda_cast(dst, rd, src, p->grad_dtype, n, stream);
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
static int nccl_post(const struct shardd_reduce_args *a, uint32_t k, const uint8_t *sum,
		     const uint64_t *offsets, uint32_t shard_rank, cudaStream_t stream)
{
	const struct shardd_shard_view *out = &a->outs[k], *add = reduce_add(a, k);
	struct shardd_reduce_math m = a->math;
	size_t rs = shardd_dtype_size(m.reduce_dtype);
	int ret = 0;

	/* The inputs were pre-divided before the sum. */
	m.pre = 1;
	for (uint32_t i = 0; i < a->layout->nparams && !ret; i++) {
		const struct shardd_layout_param *p = &a->layout->params[i];
		uint32_t odt = shardd_shard_view_dtype(out, p);
		size_t os = shardd_dtype_size(odt);
		uint64_t valid = shardd_layout_rows_valid(p, shard_rank);

		for (uint64_t o = 0; o < p->outer && !ret; o++) {
			uint64_t at = o * p->rows * p->inner;
			const void *in = sum + offsets[i] + at * rs;

			m.add = add ? dptr(add->buf, add->offsets[i] + at * rs) : NULL;
			ret = shardd_cuda_reduce(dptr(out->buf, out->offsets[i] + at * os), odt, a->accumulate[k],
						 &in, 1, m.reduce_dtype, valid * p->inner, &m, stream);
		}
		if (!ret && valid < p->rows)
			ret = shardd_cuda_zero(dptr(out->buf, out->offsets[i] + valid * p->inner * os),
					       (p->rows - valid) * p->inner * os, stream);
	}
	return ret;
}

/*
 * Reduce of members on distinct devices. SRC_GRAD (a shard group's
 * reduce-scatter): copy-in into each device's staging buffer, an in-place
 * ncclReduceScatter with ncclSum in the reduce dtype (member k's block k),
 * then the post kernel into its output. SRC_SHARD (a replicate group's
 * all-reduce of HSDP partials): an in-place ncclAllReduce of each member's
 * view buffer, then the post kernel. Summation order and rounding are
 * NCCL's (in the reduce dtype), not the host's (docs/CUDA.md).
 */
static int cuda_reduce_nccl(struct cuda_backend *cb, const struct shardd_reduce_args *a,
			    const int32_t *devices)
{
	uint32_t rd = a->math.reduce_dtype, n = a->n, grad = a->src == SHARDD_REDUCE_SRC_GRAD;
	size_t rs = shardd_dtype_size(rd);
	uint64_t shard_bytes = a->reduce_shard_size;
	void *send[SHARDD_MAX_WORLD], *recv[SHARDD_MAX_WORLD];
	struct cuda_nccl_op op;
	char why[512] = "", devs[128];
	int ret = 0;

	if (!rs || !a->reduce_offsets || !shard_bytes || shard_bytes % rs ||
	    (!grad && (a->in_dtype != rd || a->math.pre > 1)))
		return cuda_op_fail(-EINVAL, a->err, a->errlen, "reduce",
				    "NCCL reduce of %u members: reduce dtype %u, shard of %llu bytes, inputs in "
				    "dtype %u with pre-divide %g: the shard must hold whole elements, and an "
				    "all-reduce takes shards in the reduce dtype, divided before", n, rd,
				    (unsigned long long)shard_bytes, a->in_dtype, (double)a->math.pre);
	for (uint32_t k = 0; k < n && !ret; k++) {
		ret = cuda_on_device(a->outs[k].buf, devices[k], k, "output", a->err, a->errlen, "reduce");
		if (!ret && reduce_add(a, k))
			ret = cuda_on_device(a->adds[k].buf, devices[k], k, "addend", a->err, a->errlen, "reduce");
		if (!ret && !grad && a->views[k].buf->bytes < shard_bytes)
			ret = cuda_op_fail(-EINVAL, a->err, a->errlen, "reduce",
					   "member %u's view buffer holds %llu bytes, less than a shard's %llu", k,
					   (unsigned long long)a->views[k].buf->bytes, (unsigned long long)shard_bytes);
	}
	if (ret)
		return ret;
	nccl_lock(cb);
	ret = nccl_op_begin(cb, a->job, devices, n,
			    grad ? shardd_placement_staging_bytes(n, 0, shard_bytes) : 0, &op, why, sizeof(why));
	for (uint32_t k = 0; k < n && !ret && grad; k++) {
		ret = cudaSetDevice(devices[k]) == cudaSuccess ? 0 : -SHARDD_E_BACKEND;
		if (!ret)
			ret = cuda_queued(nccl_copy_in(a, k, op.staging[k], op.d[k]->stream), "reduce");
	}
	if (!ret)
		ret = nccl_op_handover(&op, 1);
	for (uint32_t k = 0; k < n && !ret; k++) {
		/* In place: NCCL rank k's block k of its staging buffer, or the whole view buffer. */
		send[k] = grad ? (void *)op.staging[k] : dptr(a->views[k].buf, 0);
		recv[k] = grad ? (void *)(op.staging[k] + k * shard_bytes) : send[k];
	}
	if (!ret)
		ret = shardd_nccl_collective(cb->nccl, op.clique,
					     grad ? SHARDD_NCCL_REDUCE_SCATTER : SHARDD_NCCL_ALL_REDUCE, send, recv,
					     shard_bytes / rs, rd, op.streams, why, sizeof(why));
	if (!ret)
		ret = nccl_op_handover(&op, 0);
	for (uint32_t k = 0; k < n && !ret; k++) {
		ret = cudaSetDevice(devices[k]) == cudaSuccess ? 0 : -SHARDD_E_BACKEND;
		if (!ret)
			ret = cuda_queued(grad ? nccl_post(a, k, recv[k], a->reduce_offsets, k, op.d[k]->stream)
					       : nccl_post(a, k, recv[k], a->views[k].offsets, a->shard_rank,
							   op.d[k]->stream),
					  "reduce");
	}
	nccl_unlock(cb);
	if (ret) {
		devices_str(devices, n, devs, sizeof(devs));
		cuda_op_fail(ret, a->err, a->errlen, "reduce", "%s on %s: %s",
			     grad ? "reduce-scatter" : "all-reduce", devs,
			     why[0] ? why : "a CUDA call failed (see the daemon's log)");
	}
	return ret;
}

static int cuda_reduce(struct shardd_backend_ctx *b, const struct shardd_reduce_args *a)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	int32_t devices[SHARDD_MAX_WORLD];
	struct cuda_device *d;
	uint32_t kind;
	int ret = 0;

	if (a->n == 0 || a->n > SHARDD_MAX_WORLD)
		return -EINVAL;
	for (uint32_t k = 0; k < a->n; k++)
		devices[k] = cbuf(a->src == SHARDD_REDUCE_SRC_GRAD ? a->grads[k] : a->views[k].buf)->device;
	ret = cuda_placement(devices, a->n, "reduce", a->err, a->errlen, &kind);
	if (ret)
		return ret;
	if (kind == SHARDD_PLACE_NCCL)
		return cuda_reduce_nccl(cb, a, devices);
	if (a->n > SHARDD_CUDA_MAX_INPUTS)
		return cuda_op_fail(-EINVAL, a->err, a->errlen, "reduce",
				    "%u inputs on one device: the kernels take 1 to %d", a->n, SHARDD_CUDA_MAX_INPUTS);
	for (uint32_t k = 0; k < a->n && !ret; k++) {
		ret = cuda_on_device(a->outs[k].buf, devices[0], k, "output", a->err, a->errlen, "reduce");
		if (!ret && reduce_add(a, k))
			ret = cuda_on_device(a->adds[k].buf, devices[0], k, "addend", a->err, a->errlen, "reduce");
	}
	if (!ret)
		ret = cuda_device_get(cb, devices[0], &d);
	for (uint32_t k = 0; k < a->n && !ret; k++)
		for (uint32_t i = 0; i < a->layout->nparams && !ret; i++)
			ret = cuda_reduce_param(a, k, i, d->stream);
	return cuda_queued(ret, "reduce");
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
	return cuda_queued(shardd_cuda_zero(dptr(buf, offset), (size_t)bytes, d->stream), "zero");
}

static int cuda_sync(struct shardd_backend_ctx *b, const struct shardd_buf *const *on, uint32_t n, char *err,
		     size_t errlen)
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
			ret = cuda_device_wait(cb, device, d, "wait for an op's kernels", err, errlen);
	}
	return ret;
}

/* ------------------------------------------------------------------ */
/* Fences                                                              */
/* ------------------------------------------------------------------ */

static void cuda_fences_close(struct shardd_backend_ctx *b, struct shardd_fences *f)
{
	(void)b;
	if (!f)
		return;
	/*
	 * The events were made or opened with this device current. A destroyed
	 * event that queued work still records or waits on lives until that work
	 * is done (cudaEventDestroy), so no sync is needed first.
	 */
	(void)cudaSetDevice(f->device);
	for (uint32_t i = 0; i < f->nwait; i++)
		if (f->wait[i])
			cudaEventDestroy(f->wait[i]);
	for (uint32_t i = 0; i < f->nsignal; i++)
		if (f->signal[i])
			cudaEventDestroy(f->signal[i]);
	free(f->wait);
	free(f->signal);
	free(f);
}

static int cuda_fences_open(struct shardd_backend_ctx *b, int32_t device, uint32_t nwait,
			    const struct shardd_cuda_ipc_handle *wait_events, uint32_t nsignal,
			    struct shardd_cuda_ipc_handle *signal_events, struct shardd_fences **out,
			    char *err, size_t errlen)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	struct shardd_fences *f;
	struct cuda_device *d;
	cudaError_t e = cudaSuccess;
	uint32_t i;
	int ret;

	_Static_assert(sizeof(cudaIpcEventHandle_t) == sizeof(struct shardd_cuda_ipc_handle),
		       "an event handle travels as struct shardd_cuda_ipc_handle");
	*out = NULL;
	ret = cuda_device_get(cb, device, &d);
	if (ret) {
		snprintf(err, errlen, "device %d cannot be used (see the daemon's log)", device);
		return ret;
	}
	f = calloc(1, sizeof(*f));
	if (f) {
		f->wait = calloc(nwait, sizeof(*f->wait));
		f->signal = calloc(nsignal, sizeof(*f->signal));
	}
	if (!f || !f->wait || !f->signal) {
		snprintf(err, errlen, "out of memory for %u + %u events", nwait, nsignal);
		ret = -ENOMEM;
		goto err;
	}
	f->device = device;
	f->nwait = nwait;
	f->nsignal = nsignal;
	for (i = 0; i < nwait && e == cudaSuccess; i++) {
		cudaIpcEventHandle_t h;

		memcpy(&h, &wait_events[i], sizeof(h));
		e = cudaIpcOpenEventHandle(&f->wait[i], h);
		if (e != cudaSuccess) {
			f->wait[i] = NULL; /* not opened: close skips it */
			snprintf(err, errlen, "open the client's event of SQ slot %u: %s (%s)", i,
				 cudaGetErrorString(e), cudaGetErrorName(e));
		}
	}
	for (i = 0; i < nsignal && e == cudaSuccess; i++) {
		cudaIpcEventHandle_t h;

		e = cudaEventCreateWithFlags(&f->signal[i], cudaEventInterprocess | cudaEventDisableTiming);
		if (e != cudaSuccess)
			f->signal[i] = NULL;
		else
			e = cudaIpcGetEventHandle(&h, f->signal[i]);
		if (e == cudaSuccess)
			memcpy(&signal_events[i], &h, sizeof(h));
		else
			snprintf(err, errlen, "make the event of CQ slot %u: %s (%s)", i,
				 cudaGetErrorString(e), cudaGetErrorName(e));
	}
	if (e != cudaSuccess) {
		shardd_log_error("shardd: cuda backend: stream fences on device %d: %s", device, err);
		ret = -SHARDD_E_BACKEND;
		goto err;
	}
	*out = f;
	return 0;

err:
	cuda_fences_close(b, f);
	return ret;
}

static int cuda_fence_wait(struct shardd_backend_ctx *b, struct shardd_fences *f, uint32_t slot)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	struct cuda_device *d;
	cudaError_t e;
	int ret;

	if (slot >= f->nwait)
		return -EINVAL;
	ret = cuda_device_get(cb, f->device, &d);
	if (ret)
		return ret;
	e = cudaStreamWaitEvent(d->stream, f->wait[slot], 0);
	return e == cudaSuccess ? 0 : cuda_rt_fail("wait on a client's stream event", e);
}

static int cuda_fence_signal(struct shardd_backend_ctx *b, struct shardd_fences *f, uint32_t slot)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	struct cuda_device *d;
	cudaError_t e;
	int ret;

	if (slot >= f->nsignal)
		return -EINVAL;
	ret = cuda_device_get(cb, f->device, &d);
	if (ret)
		return ret;
	e = cudaEventRecord(f->signal[slot], d->stream);
	return e == cudaSuccess ? 0 : cuda_rt_fail("record a stream event for a client", e);
}

/* ------------------------------------------------------------------ */
/* Jobs                                                                */
/* ------------------------------------------------------------------ */

static int cuda_multi_device(struct shardd_backend_ctx *b, char *err, size_t errlen)
{
	(void)b;
	return shardd_nccl_load(err, errlen);
}

static int cuda_job_open(struct shardd_backend_ctx *b, const char *job, struct shardd_backend_job **out)
{
	struct shardd_backend_job *bj = calloc(1, sizeof(*bj));

	(void)b;
	if (!bj)
		return -ENOMEM;
	snprintf(bj->name, sizeof(bj->name), "%s", job);
	*out = bj;
	return 0;
}

static void cuda_job_close(struct shardd_backend_ctx *b, struct shardd_backend_job *bj)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;

	nccl_lock(cb);
	shardd_nccl_job_end(cb->nccl, bj);
	nccl_unlock(cb);
	free(bj);
}

/* ------------------------------------------------------------------ */
/* Create and destroy                                                  */
/* ------------------------------------------------------------------ */

static void cuda_destroy(struct shardd_backend_ctx *b)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;

	/* Staging buffers first: freeing one waits on its device, which may ask the communicators. */
	for (int i = 0; i < cb->ndevices; i++)
		cuda_free(b, &cb->devices[i].staging);
	shardd_nccl_destroy(cb->nccl);
	for (int i = 0; i < cb->ndevices; i++) {
		struct cuda_device *d = &cb->devices[i];

		if (!d->ready)
			continue;
		/* A stream or event belongs to its device's context: destroy it with that device current. */
		if (cudaSetDevice(i) != cudaSuccess)
			continue;
		cudaStreamDestroy(d->stream);
		if (d->nccl_ready) {
			cudaStreamDestroy(d->nccl_stream);
			cudaEventDestroy(d->staged);
			cudaEventDestroy(d->collected);
		}
	}
	pthread_mutex_destroy(&cb->nccl_lock);
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
	.sync = cuda_sync,
	.fences_open = cuda_fences_open,
	.fence_wait = cuda_fence_wait,
	.fence_signal = cuda_fence_signal,
	.fences_close = cuda_fences_close,
	.multi_device = cuda_multi_device,
	.job_open = cuda_job_open,
	.job_close = cuda_job_close,
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

int shardd_backend_cuda_create(uint32_t mode, uint64_t timeout_ns, struct shardd_backend_ctx **out,
			       char *err, size_t errlen)
{
	struct cuda_backend *cb;
	cudaError_t e;
	void *fn;
	int n = 0, ret;

	if (mode != SHARDD_CUDA_EXPORT_AUTO && mode != SHARDD_CUDA_EXPORT_FD && mode != SHARDD_CUDA_EXPORT_IPC) {
		snprintf(err, errlen, "shardd: --cuda-export: mode %u is not one of auto (%d), fd (%d), ipc (%d)",
			 mode, SHARDD_CUDA_EXPORT_AUTO, SHARDD_CUDA_EXPORT_FD, SHARDD_CUDA_EXPORT_IPC);
		return -SHARDD_E_BACKEND;
	}
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
	if (!cb->devices || shardd_nccl_create(timeout_ns, &cb->nccl))
		goto err_nomem;
	/* Unallocated, and no fd for shardd_buf_forget to close. */
	for (int i = 0; i < n; i++)
		cb->devices[i].staging.fd = -1;
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
	CUDA_RESOLVE(device_get_name, "cuDeviceGetName");
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
	cb->mode = mode;
	cb->timeout_ns = timeout_ns;
	cb->ndevices = n;
	pthread_mutex_init(&cb->lock, NULL);
	pthread_mutex_init(&cb->nccl_lock, NULL);
	*out = &cb->base;
	return 0;

err_nomem:
	snprintf(err, errlen, "shardd: --backend cuda: out of memory for the backend of %d devices", n);
	ret = -ENOMEM;
err_free:
	if (cb) {
		shardd_nccl_destroy(cb->nccl);
		free(cb->devices);
	}
	free(cb);
	return ret;
}
