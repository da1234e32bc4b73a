/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend's own header, shared by its files and by nothing else
 * (the engine and the tools see backend_cuda.h). Names here start with
 * cuda_; they are private to these files:
 *
 *   backend_cuda.c           the ops table: create, destroy, jobs, and the
 *                            ops on one device (each op routed by placement)
 *   backend_cuda_device.c    the driver's entry points, errors, a device's
 *                            set-up (export kind, streams) and the waits on it
 *   backend_cuda_memory.c    buffers: VMM allocations exported as fds, or
 *                            cudaMalloc exported as legacy IPC handles
 *   backend_cuda_kernels.c   the kernels of an op over a group's layout, and
 *                            the checks and messages every op shares
 *   backend_cuda_nccl_ops.c  unshard and reduce across devices with NCCL:
 *                            staging, stream hand-over, the one NCCL lock
 *   backend_cuda_nccl.c      NCCL itself: the library and the communicators
 *   backend_cuda_world.c      collectives across nodes: communicators over the
 *                            daemon world, bootstrapped through it (world_boot.c)
 *   backend_cuda_fence.c     stream fences: interprocess events per ring slot
 *   backend_cuda_step.c      the optimizer step and the grad-norm part of
 *                            one rank's shard, on its device
 *
 * Calls between them go one way, never in a circle: backend_cuda.c calls
 * every other file; nccl_ops and span call kernels, memory, device and nccl
 * (span also world_boot.c and world.c, outside the backend); step
 * calls kernels and device;
 * memory and fence call device; device calls nccl; kernels and nccl call
 * none of them.
 */
#ifndef SHD_BACKEND_CUDA_INT_H
#define SHD_BACKEND_CUDA_INT_H

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "backend_cuda.h"
#include "backend_cuda_nccl.h"
#include "shardd_cuda.h"

/*
 * The driver's entry points this backend calls, resolved at create
 * (backend_cuda_device.c): those libshardd calls too, then its own.
 */
#define CUDA_DRIVER_ENTRY_POINTS(X, type)                         \
	SHARDD_CUDA_DRIVER_SHARED(X, type)                        \
	X(type, device_get_attribute, cuDeviceGetAttribute, 2000) \
	X(type, device_get_name, cuDeviceGetName, 2000)           \
	X(type, create, cuMemCreate, 10020)                       \
	X(type, export_handle, cuMemExportToShareableHandle, 10020)

struct cuda_driver {
	CUDA_DRIVER_ENTRY_POINTS(SHARDD_CUDA_DRIVER_FIELD, struct cuda_driver)
};

/* Per device, set up on its first allocation. */
struct cuda_device {
	int ready;
	uint32_t export_kind; /* enum shardd_export_kind of every buffer on the device */
	cudaStream_t stream;  /* every kernel of this backend on the device */
	size_t granularity;   /* fd kind: minimum allocation granularity, bytes */
	/* NCCL, made at the device's first collective across devices; used under nccl_lock. */
	int nccl_ready;
	cudaStream_t nccl_stream; /* NCCL's collectives on the device */
	cudaEvent_t staged;    /* on stream: the op's inputs are ready; nccl_stream waits on it */
	cudaEvent_t collected; /* on nccl_stream: the collective is done; stream waits on it */
	struct shd_buf staging;
	/* Set once nccl_ready: waits on the device are bounded by the collective timeout. */
	atomic_int nccl_used;
};

struct cuda_backend {
	struct shd_backend_ctx base;
	struct cuda_driver drv;
	uint32_t mode;       /* --cuda-export: enum shd_cuda_export */
	uint64_t timeout_ns; /* the collective timeout: bounds every wait on NCCL */
	int ndevices;
	pthread_mutex_t lock;        /* device set-up */
	struct cuda_device *devices; /* [ndevices] */
	/*
	 * Every NCCL call, and each NCCL op queued whole (backend_cuda_nccl.h).
	 * Taken before `lock` where both are held.
	 */
	pthread_mutex_t nccl_lock;
	struct shd_nccl *nccl; /* the communicators of every job */
	/* groups' members across nodes (backend_cuda_world.c); under nccl_lock */
	struct cuda_span *spans;
	char gpu_sharing[192]; /* base.gpu_sharing points here */
};

/* A job's state: its name, and the key of its communicators. */
struct shd_backend_job {
	char name[SHARDD_NAME_MAX];
};

/* What buf->priv points to. */
struct cuda_buf {
	uint32_t kind;   /* enum shardd_export_kind: its device's */
	CUdeviceptr ptr; /* the daemon's address: fd kind a mapping, ipc the cudaMalloc base */
	size_t size;     /* fd: reserved and mapped, bytes rounded to the granularity;
						ipc: allocated, the buffer's bytes */
	CUmemGenericAllocationHandle handle; /* fd kind */
	struct shardd_cuda_ipc_handle ipc;   /* ipc kind: from cudaIpcGetMemHandle */
	int device;
};

static inline const struct cuda_buf *cbuf(const struct shd_buf *b)
{
	return b->priv;
}

/* Device address `offset` bytes into a buffer. */
static inline void *dptr(const struct shd_buf *b, uint64_t offset)
{
	return (void *)(uintptr_t)(cbuf(b)->ptr + offset);
}

/* ---- backend_cuda_device.c: the driver, errors, devices ---- */

/* Resolve every entry point of `drv`. 0, or -SHARDD_E_BACKEND with `err` naming the one missing. */
int cuda_driver_resolve(struct cuda_driver *drv, char *err, size_t errlen);
/* Log a runtime call's failure; -ENOMEM for an allocation, else -SHARDD_E_BACKEND. */
int cuda_rt_fail(const char *what, cudaError_t e);
/* Log a driver call's failure; -ENOMEM for an allocation, else -SHARDD_E_BACKEND. */
int cuda_drv_fail(const struct cuda_backend *cb, const char *what, CUresult r);
/* `ret`: the result of queueing an op's kernels, logged when it failed. Returns `ret`. */
int cuda_queued(int ret, const char *what);
/* The properties of an fd-kind allocation on `device` (its granularity is the device's). */
void cuda_vmm_prop(CUmemAllocationProp *prop, int device);
/* The ready device `device`, set up on first use and set current on the calling thread. */
int cuda_device_get(struct cuda_backend *cb, int device, struct cuda_device **out);
/*
 * Wait for everything queued on the stream of `device` (current on this
 * thread), bounded by the collective timeout where the device runs NCCL.
 * 0, or an error with `err` (may be NULL) naming the device and the
 * communicators.
 */
int cuda_device_wait(struct cuda_backend *cb, int device, struct cuda_device *d, const char *what,
		     char *err, size_t errlen);
/* Make `d`'s NCCL stream and events once; its device is current. Under nccl_lock. */
int cuda_device_nccl_setup(struct cuda_device *d);
/* Destroy every ready device's streams and events (the backend's end). */
void cuda_devices_destroy(struct cuda_backend *cb);
/* Take and drop cb->nccl_lock; a wait made while it is held checks the communicators without it. */
void cuda_nccl_lock(struct cuda_backend *cb);
void cuda_nccl_unlock(struct cuda_backend *cb);

/* ---- backend_cuda_memory.c: buffers and their export ---- */

int cuda_alloc(struct shd_backend_ctx *b, uint64_t bytes, int32_t device, const char *what,
	       struct shd_buf *out);
void cuda_free(struct shd_backend_ctx *b, struct shd_buf *buf);
int cuda_export_buf(struct shd_backend_ctx *b, const struct shd_buf *buf, int mode,
		    struct shd_buf_export *out);
int cuda_write(struct shd_backend_ctx *b, struct shd_buf *buf, uint64_t offset, uint64_t bytes,
	       const void *src);
int cuda_read(struct shd_backend_ctx *b, const struct shd_buf *buf, uint64_t offset, uint64_t bytes,
	      void *dst);

/* ---- backend_cuda_kernels.c: an op's kernels and checks ---- */

/* An op's failure: `err` gets the text, the log gets it with the op. Returns `ret`. */
__attribute__((format(printf, 5, 6))) int cuda_op_fail(int ret, char *err, size_t errlen,
						       const char *op, const char *fmt, ...);
/* 0 when member k's buffer `b` (`role`) sits on `device`, the member's device; else the error. */
int cuda_on_device(const struct shd_buf *b, int device, uint32_t k, const char *role, char *err,
		   size_t errlen, const char *op);
/* SHARED or NCCL for `n` members on `devices`; MIXED fails with the error. */
int cuda_placement(const int32_t *devices, uint32_t n, const char *op, char *err, size_t errlen,
		   uint32_t *kind);
/* Member k's addend view of a reduce, or NULL. */
const struct shd_shard_view *cuda_reduce_add(const struct shd_reduce_args *a, uint32_t k);
/* An all-gather's copy-out from the flat shards at src[s] into the unsharded buffer `out`. */
int cuda_copy_out(const struct shd_layout *l, uint32_t nshards, uint8_t *const *src,
		  const struct shd_buf *out, cudaStream_t stream);
/* Member k's reduce output of param i, its n inputs on one device. */
int cuda_reduce_param(const struct shd_reduce_args *a, uint32_t k, uint32_t i, cudaStream_t stream);
/* A reduce-scatter's copy-in of member k's grad into its staging buffer (`nshards` rank-major blocks). */
int cuda_reduce_copy_in(const struct shd_reduce_args *a, uint32_t k, uint32_t nshards,
			uint8_t *staging, cudaStream_t stream);
/* Member k's output from its sum at `sum` (one shard in the reduce dtype, laid out as `offsets`). */
int cuda_reduce_post(const struct shd_reduce_args *a, uint32_t k, const uint8_t *sum,
		     const uint64_t *offsets, uint32_t shard_rank, cudaStream_t stream);

/* ---- backend_cuda_nccl_ops.c: ops across devices ---- */

/* Unshard of a shard group whose ranks (shard s on devices[s]) sit on distinct devices. */
int cuda_unshard_nccl(struct cuda_backend *cb, const struct shd_unshard_args *a,
		      const int32_t *devices);
/* Reduce of members (member k on devices[k]) on distinct devices. */
int cuda_reduce_nccl(struct cuda_backend *cb, const struct shd_reduce_args *a,
		     const int32_t *devices);
/* Free every device's staging buffer (the backend's end, before the communicators go). */
void cuda_nccl_staging_free(struct cuda_backend *cb);

/* ---- backend_cuda_world.c: ops across nodes (backend.h span_unshard, span_reduce) ---- */

int cuda_span_unshard(struct shd_backend_ctx *b, const struct shd_world_boot *span,
		      const struct shd_unshard_args *a);
int cuda_span_reduce(struct shd_backend_ctx *b, const struct shd_world_boot *span,
		     const struct shd_reduce_args *a);
/* Free the streams and staging across nodes of `job` (NULL: of every job). Under nccl_lock. */
void cuda_span_job_end(struct cuda_backend *cb, const struct shd_backend_job *job);

/* ---- backend_cuda_fence.c: stream fences ---- */

int cuda_fences_open(struct shd_backend_ctx *b, int32_t device, uint32_t nwait,
		     const struct shardd_cuda_ipc_handle *wait_events, uint32_t nsignal,
		     struct shardd_cuda_ipc_handle *signal_events, struct shd_fences **out,
		     char *err, size_t errlen);
int cuda_fence_wait(struct shd_backend_ctx *b, struct shd_fences *f, uint32_t slot);
int cuda_fence_signal(struct shd_backend_ctx *b, struct shd_fences *f, uint32_t slot);
void cuda_fences_close(struct shd_backend_ctx *b, struct shd_fences *f);

/* ---- backend_cuda_step.c: the optimizer ---- */

int cuda_step(struct shd_backend_ctx *b, const struct shd_step_args *a);
int cuda_grad_norm(struct shd_backend_ctx *b, const struct shd_layout *l, uint32_t shard_rank,
		   const struct shd_buf *grad, struct shardd_grad_norm_part *out, char *err,
		   size_t errlen);

#endif /* SHD_BACKEND_CUDA_INT_H */
