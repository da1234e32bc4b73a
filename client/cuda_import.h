/* SPDX-License-Identifier: MIT */
/*
 * libshardd internals: mapping a group buffer of the daemon's cuda backend
 * into this process's device address space.
 *
 * The daemon sends, per buffer (the GROUP reply's export_kind), a POSIX
 * file descriptor of a driver virtual-memory allocation
 * (cuMemExportToShareableHandle), which the client imports and maps on its
 * device, or a legacy CUDA IPC handle (cudaIpcGetMemHandle), which it opens
 * in its device's primary context. libshardd does not link CUDA: the
 * driver (libcuda.so.1) is opened at the first import, so host-only
 * programs never need it.
 */
#ifndef SHARDD_CLIENT_CUDA_IMPORT_H
#define SHARDD_CLIENT_CUDA_IMPORT_H

#include <stdint.h>

#include "internal.h"

/* One imported buffer. */
struct shardd_cuda_mapping {
	uint64_t ptr;   /* device address (a CUdeviceptr); 0 when nothing is mapped */
	uint64_t size;  /* FD: bytes reserved and mapped, the buffer's size rounded up to the
			    granularity; CUDA_IPC: the buffer's size (the driver maps the allocation) */
	uint32_t kind;  /* enum shardd_export_kind: how it was imported, so how it is unmapped */
	int32_t device; /* CUDA_IPC: the device whose primary context opened it */
};

/*
 * Import `fd` (not consumed: the caller closes it) as a buffer of `bytes`
 * (> 0) on CUDA device `device`, mapped read-write there. 0, or a negative
 * errno / -SHARDD_E_BACKEND with the error context set: no driver, a build
 * without CUDA headers, or the driver's refusal.
 */
SHARDD_HIDDEN int shardd_cuda_import(int fd, int device, uint64_t bytes,
				     struct shardd_cuda_mapping *out);

/*
 * Open a legacy CUDA IPC handle (another process's cudaIpcGetMemHandle) of
 * a buffer of `bytes` (> 0) on CUDA device `device`, in that device's
 * primary context (the one the CUDA runtime, PyTorch's included, uses), so
 * the pointer is valid in the runtime's calls. The driver counts opens of
 * one handle in one context: a second import of the same handle in this
 * process (a group opened again) returns the same pointer, and each
 * mapping's unmap drops one count. 0, or a negative errno /
 * -SHARDD_E_BACKEND with the error context set.
 */
SHARDD_HIDDEN int shardd_cuda_import_ipc(const struct shardd_cuda_ipc_handle *handle, int device,
					 uint64_t bytes, struct shardd_cuda_mapping *out);

/* Unmap or close, as it was imported; also takes a mapping that holds nothing (ptr 0). */
SHARDD_HIDDEN void shardd_cuda_unmap(struct shardd_cuda_mapping *m);

/*
 * Copy `bytes` of host memory to device address `dst` on `device`, and
 * wait until they are there. 0 or a code with context.
 */
SHARDD_HIDDEN int shardd_cuda_copy_in(int device, uint64_t dst, const void *src, uint64_t bytes);

/*
 * Stream fences (shardd_stream_set): interprocess events in the primary
 * context of the rank's device. Ours, one per SQ slot, are recorded on the
 * trainer's stream before a submission; the daemon's, one per CQ slot, are
 * waited on when a completion is reaped.
 */
struct shardd_cuda_fences;

/* Make `nrecord` events on `device`; their handles go to `handles`. 0 or a code with context. */
SHARDD_HIDDEN int shardd_cuda_fences_create(int device, uint32_t nrecord,
					    struct shardd_cuda_ipc_handle *handles,
					    struct shardd_cuda_fences **out);
/* Open the daemon's `nwait` events. 0 or a code with context; free `f` either way. */
SHARDD_HIDDEN int shardd_cuda_fences_open(struct shardd_cuda_fences *f, uint32_t nwait,
					  const struct shardd_cuda_ipc_handle *handles);
/* Also takes NULL. */
SHARDD_HIDDEN void shardd_cuda_fences_free(struct shardd_cuda_fences *f);
/* Record our event of SQ slot `slot` on `stream` (a CUstream; NULL: the legacy default stream). */
SHARDD_HIDDEN int shardd_cuda_fence_record(struct shardd_cuda_fences *f, uint32_t slot,
					   void *stream);
/*
 * The daemon's event of CQ slot `slot`: make `stream` wait on it
 * (on_stream), or wait for it on this thread.
 */
SHARDD_HIDDEN int shardd_cuda_fence_wait(struct shardd_cuda_fences *f, uint32_t slot, int on_stream,
					 void *stream);

#endif /* SHARDD_CLIENT_CUDA_IMPORT_H */
