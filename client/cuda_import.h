/* SPDX-License-Identifier: MIT */
/*
 * libshardd internals: mapping a group buffer of the daemon's cuda backend
 * into this process's device address space.
 *
 * The daemon sends a POSIX file descriptor of a driver virtual-memory
 * allocation (cuMemExportToShareableHandle); the client imports it and maps
 * it on its device. libshardd does not link CUDA: the driver (libcuda.so.1)
 * is opened at the first import, so host-only programs never need it.
 */
#ifndef SHARDD_CLIENT_CUDA_IMPORT_H
#define SHARDD_CLIENT_CUDA_IMPORT_H

#include <stdint.h>

#include "internal.h"

/* One imported buffer. */
struct shardd_cuda_mapping {
	uint64_t ptr;  /* device address (a CUdeviceptr); 0 when nothing is mapped */
	uint64_t size; /* bytes reserved and mapped: the buffer's size rounded up to the granularity */
};

/*
 * Import `fd` (not consumed: the caller closes it) as a buffer of `bytes`
 * (> 0) on CUDA device `device`, mapped read-write there. 0, or a negative
 * errno / -SHARDD_E_BACKEND with the error context set: no driver, a build
 * without CUDA headers, or the driver's refusal.
 */
SHARDD_HIDDEN int shardd_cuda_import(int fd, int device, uint64_t bytes, struct shardd_cuda_mapping *out);

/* Unmap; also takes a mapping that holds nothing (ptr 0). */
SHARDD_HIDDEN void shardd_cuda_unmap(struct shardd_cuda_mapping *m);

#endif /* SHARDD_CLIENT_CUDA_IMPORT_H */
