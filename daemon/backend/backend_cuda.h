/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend (backend_cuda*.c; backend_cuda_int.h lists its files):
 * group buffers in device memory, exported to clients as POSIX file
 * descriptors of the driver's virtual memory API or, where a device cannot
 * do that, as legacy CUDA IPC handles; unshard/reduce/zero and the
 * optimizer step and grad norm with the CUDA kernels. Built only with SHARDD_HAVE_CUDA (make CUDA=auto|1); this
 * header declares nothing that needs CUDA, so main.c parses --cuda-export
 * in every build.
 */
#ifndef SHD_BACKEND_CUDA_H
#define SHD_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* --cuda-export: how the cuda backend allocates and exports buffers. */
enum shd_cuda_export {
	SHD_CUDA_EXPORT_AUTO = 0, /* per device at its set-up: fd where it can, else ipc */
	SHD_CUDA_EXPORT_FD = 1,   /* cuMemCreate with POSIX fd handles; the fd travels */
	SHD_CUDA_EXPORT_IPC = 2,  /* cudaMalloc + cudaIpcGetMemHandle; the handle travels */
};

/*
 * 0, or -SHARDD_E_BACKEND with `err` saying why (no driver, no device, a
 * driver without the virtual memory API), or -ENOMEM. `mode` is an enum
 * shd_cuda_export; `timeout_ns` (the collective timeout) bounds every
 * wait on NCCL. Touches no device: a device is set up, and its export
 * kind chosen, when its first buffer is allocated; NCCL is loaded at the
 * first collective across devices.
 */
int shd_backend_cuda_create(uint32_t mode, uint64_t timeout_ns, struct shd_backend_ctx **out,
			    char *err, size_t errlen);

/* The daemon's device address of a buffer this backend allocated, or NULL (tools and tests). */
void *shd_backend_cuda_ptr(const struct shd_buf *buf);

#endif /* SHD_BACKEND_CUDA_H */
