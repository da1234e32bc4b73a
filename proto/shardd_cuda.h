/* SPDX-License-Identifier: MIT */
/*
 * What the daemon's cuda backend and libshardd must do the same way, in
 * one place: which driver entry points both call, how a table of CUDA (or
 * NCCL) entry points is resolved by name, and how a buffer's size is
 * rounded to an allocation granularity.
 *
 * Why here: proto/ is the one folder both daemon/ and client/ may
 * include (the repository's layout rules), and it may include libc only:
 * so sizes travel as uint64_t, entry points as void *, and each caller
 * brings its own lookup (the CUDA runtime's
 * cudaGetDriverEntryPointByVersion in the daemon, the driver's
 * cuGetProcAddress in libshardd, dlsym for NCCL). Why a header: a source
 * compiled into both libraries would define the same symbols twice in
 * programs that link both (the test binaries do), so everything here is
 * `static inline`.
 */
#ifndef SHARDD_CUDA_H
#define SHARDD_CUDA_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "shardd_proto.h"

/*
 * The driver ABI both sides ask for (cuGetProcAddress's and
 * cudaGetDriverEntryPointByVersion's version argument): the PFN_*_v10020
 * virtual memory calls as introduced in CUDA 10.2, unchanged as of CUDA
 * 12.0, and the newest versions of the context and IPC calls at 12.0
 * (cuIpcOpenMemHandle_v2 of CUDA 11.0, which counts repeated opens of a
 * handle in one context instead of failing them). Every driver that runs
 * this build's runtime (13.x) provides them.
 */
#define SHARDD_CUDA_DRIVER_ABI 12000

/*
 * The bytes reserved and mapped for an fd-kind buffer of `bytes`: rounded
 * up to `granularity`, the device's minimum allocation granularity
 * (CU_MEM_ALLOC_GRANULARITY_MINIMUM) for a pinned device allocation with
 * POSIX fd handles on the buffer's device. The daemon allocates this much
 * and a client maps exactly this much of the fd it receives, so both call
 * this one function with the granularity the driver gave each of them.
 * `granularity` > 0 and `bytes` <= UINT64_MAX / 2 (both sides refuse
 * larger buffers before), so nothing overflows.
 */
static inline uint64_t shardd_cuda_alloc_size(uint64_t bytes, uint64_t granularity)
{
	return (bytes + granularity - 1) / granularity * granularity;
}

/* One entry point of a caller's table: its name, and where its pointer goes. */
struct shardd_cuda_symbol {
	const char *name;
	size_t offset; /* offsetof(the caller's struct of function pointers, the field) */
};

#define SHARDD_CUDA_SYMBOL(type, field, sym) \
	{                                    \
		sym, offsetof(type, field)   \
	}

/*
 * The driver's entry points that the cuda backend and libshardd both call,
 * as X(type, field, symbol, version): the field of the caller's struct
 * `type` of function pointers, the driver's name of the call, and the
 * version in the name of its PFN_ typedef (cudaTypedefs.h, which the
 * caller includes). A caller lists its own after these and expands the
 * whole list twice: with SHARDD_CUDA_DRIVER_FIELD inside its struct, and
 * with SHARDD_CUDA_DRIVER_SYMBOL into the table shardd_cuda_resolve fills
 * the struct from, so every field has its name.
 */
#define SHARDD_CUDA_DRIVER_SHARED(X, type)                         \
	X(type, get_error_string, cuGetErrorString, 6000)          \
	X(type, device_get, cuDeviceGet, 2000)                     \
	X(type, granularity, cuMemGetAllocationGranularity, 10020) \
	X(type, release, cuMemRelease, 10020)                      \
	X(type, address_reserve, cuMemAddressReserve, 10020)       \
	X(type, address_free, cuMemAddressFree, 10020)             \
	X(type, map, cuMemMap, 10020)                              \
	X(type, unmap, cuMemUnmap, 10020)                          \
	X(type, set_access, cuMemSetAccess, 10020)

#define SHARDD_CUDA_DRIVER_FIELD(type, field, sym, version)  PFN_##sym##_v##version field;
#define SHARDD_CUDA_DRIVER_SYMBOL(type, field, sym, version) SHARDD_CUDA_SYMBOL(type, field, #sym),

/*
 * How one library finds an entry point: 0 with *fn set (never NULL), or
 * nonzero with `err` naming the symbol, why it is missing and what to do.
 */
typedef int (*shardd_cuda_lookup_fn)(void *ctx, const char *name, void **fn, char *err,
				     size_t errlen);

/*
 * POSIX (XSH 2.12.3) gives every function pointer the representation of a
 * void *, which dlsym and cuGetProcAddress rely on; the copy below relies
 * on it too.
 */
_Static_assert(sizeof(void *) == sizeof(void (*)(void)),
	       "a function pointer travels as a void *, as dlsym's does");

/*
 * Fill `table`, a struct of function pointers only, with the `n` entry
 * points of `syms` found by `lookup` (given `ctx`). 0, or -SHARDD_E_BACKEND
 * with `err` as the lookup wrote it for the first one missing; `table` may
 * then be partly filled. Every field of `table` needs its row in `syms`:
 * a caller builds both from one list (SHARDD_CUDA_DRIVER_SHARED), or
 * checks that n * sizeof(void *) == sizeof(*table).
 */
static inline int shardd_cuda_resolve(void *table, const struct shardd_cuda_symbol *syms, size_t n,
				      shardd_cuda_lookup_fn lookup, void *ctx, char *err,
				      size_t errlen)
{
	for (size_t i = 0; i < n; i++) {
		void *fn = NULL;

		if (lookup(ctx, syms[i].name, &fn, err, errlen))
			return -SHARDD_E_BACKEND;
		memcpy((char *)table + syms[i].offset, &fn, sizeof(fn));
	}
	return 0;
}

#endif /* SHARDD_CUDA_H */
