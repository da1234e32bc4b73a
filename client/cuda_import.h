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
	uint64_t ptr;    /* device address (a CUdeviceptr); 0 when nothing is mapped */
	uint64_t size;   /* FD: bytes reserved and mapped, the buffer's size rounded up to the
			    granularity; CUDA_IPC: the buffer's size (the driver maps the allocation) */
	uint32_t kind;   /* enum shardd_export_kind: how it was imported, so how it is unmapped */
	int32_t  device; /* CUDA_IPC: the device whose primary context opened it */
};

/*
 * Import `fd` (not consumed: the caller closes it) as a buffer of `bytes`
 * (> 0) on CUDA device `device`, mapped read-write there. 0, or a negative
 * errno / -SHARDD_E_BACKEND with the error context set: no driver, a build
 * without CUDA headers, or the driver's refusal.
 */
SHARDD_HIDDEN int shardd_cuda_import(int fd, int device, uint64_t bytes, struct shardd_cuda_mapping *out);

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

#endif /* SHARDD_CLIENT_CUDA_IMPORT_H */
