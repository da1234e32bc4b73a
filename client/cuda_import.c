/* SPDX-License-Identifier: MIT */
/*
 * Import of the cuda backend's buffers, and the client's half of stream
 * fences (cuda_import.h).
 *
 * The driver is reached through dlopen("libcuda.so.1") and its own
 * cuGetProcAddress, never by linking: a host-only trainer must load
 * libshardd where no NVIDIA driver exists. libcuda.so.1 is what every
 * CUDA program on the machine already loads (the runtime libraries of
 * PyTorch included), so no toolkit needs to be on the loader's path.
 *
 * An fd buffer is mapped with the buffer's size rounded up to the
 * device's minimum granularity for a POSIX-fd allocation: exactly what the
 * daemon allocated (daemon/backend/cuda/backend_cuda_memory.c rounds with the same
 * function, shardd_cuda_alloc_size, and the granularity of the same
 * allocation properties on the same device). A legacy IPC handle is
 * opened in the device's primary context, which stays retained while the
 * mapping lives; the driver maps the whole allocation, at least the
 * buffer's size, and the group uses that size. Entry points are resolved
 * as the daemon's are (shardd_cuda_resolve, proto/shardd_cuda.h).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_import.h"
#include "shardd_cuda.h"

#ifdef SHARDD_HAVE_CUDA

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>

/*
 * The driver's entry points libshardd calls, asked of cuGetProcAddress at
 * SHARDD_CUDA_DRIVER_ABI: those the daemon calls too, then its own.
 */
#define CUDA_IMPORT_DRIVER(X, type)                                    \
	SHARDD_CUDA_DRIVER_SHARED(X, type)                             \
	X(type, init, cuInit, 2000)                                    \
	X(type, primary_ctx_retain, cuDevicePrimaryCtxRetain, 7000)    \
	X(type, primary_ctx_release, cuDevicePrimaryCtxRelease, 11000) \
	X(type, ctx_push, cuCtxPushCurrent, 4000)                      \
	X(type, ctx_pop, cuCtxPopCurrent, 4000)                        \
	X(type, ipc_open, cuIpcOpenMemHandle, 11000)                   \
	X(type, ipc_close, cuIpcCloseMemHandle, 4010)                  \
	X(type, import_handle, cuMemImportFromShareableHandle, 10020)  \
	X(type, event_create, cuEventCreate, 2000)                     \
	X(type, event_destroy, cuEventDestroy, 4000)                   \
	X(type, ipc_get_event, cuIpcGetEventHandle, 4010)              \
	X(type, ipc_open_event, cuIpcOpenEventHandle, 4010)            \
	X(type, event_record, cuEventRecord, 2000)                     \
	X(type, stream_wait_event, cuStreamWaitEvent, 3020)            \
	X(type, event_synchronize, cuEventSynchronize, 2000)           \
	X(type, memcpy_htod, cuMemcpyHtoD, 3020)                       \
	X(type, ctx_synchronize, cuCtxSynchronize, 2000)               \
	X(type, device_get_attribute, cuDeviceGetAttribute, 2000)      \
	X(type, ctx_get_exec_affinity, cuCtxGetExecAffinity, 11040)

struct cuda_driver {
	CUDA_IMPORT_DRIVER(SHARDD_CUDA_DRIVER_FIELD, struct cuda_driver)
};

static struct cuda_driver drv;

static const struct shardd_cuda_symbol drv_symbols[] = { CUDA_IMPORT_DRIVER(
	SHARDD_CUDA_DRIVER_SYMBOL, struct cuda_driver) };

static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static int drv_status;      /* 0 once every entry point resolved and cuInit succeeded */
static char drv_error[256]; /* why not, when drv_status < 0 */

/* A shardd_cuda_lookup_fn: the driver's cuGetProcAddress, at `ctx` (a PFN_cuGetProcAddress_v12000 *). */
static int drv_lookup(void *ctx, const char *name, void **fn, char *err, size_t errlen)
{
	PFN_cuGetProcAddress_v12000 get_proc = *(PFN_cuGetProcAddress_v12000 *)ctx;
	CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	CUresult r;

	r = get_proc(name, fn, SHARDD_CUDA_DRIVER_ABI, CU_GET_PROC_ADDRESS_DEFAULT, &found);
	if (r == CUDA_SUCCESS && found == CU_GET_PROC_ADDRESS_SUCCESS && *fn)
		return 0;
	snprintf(err, errlen, "the NVIDIA driver does not provide %s (CUresult %d, status %d)",
		 name, (int)r, (int)found);
	return -SHARDD_E_BACKEND;
}

static void drv_load(void)
{
	PFN_cuGetProcAddress_v12000 get_proc;
	void *lib, *fn;
	CUresult r;

	drv_status = -SHARDD_E_BACKEND;
	lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		snprintf(drv_error, sizeof(drv_error), "no NVIDIA driver: dlopen libcuda.so.1: %s",
			 dlerror());
		return;
	}
	/* cuda.h maps cuGetProcAddress to this name, so every driver from 12.0 on exports it. */
	fn = dlsym(lib, "cuGetProcAddress_v2");
	if (!fn) {
		snprintf(
			drv_error, sizeof(drv_error),
			"the NVIDIA driver is older than CUDA 12.0 (no cuGetProcAddress_v2); update it");
		return;
	}
	/* dlsym's void * becomes a function pointer as POSIX specifies. */
	get_proc = (PFN_cuGetProcAddress_v12000)fn;
	if (shardd_cuda_resolve(&drv, drv_symbols, sizeof(drv_symbols) / sizeof(drv_symbols[0]),
				drv_lookup, &get_proc, drv_error, sizeof(drv_error)))
		return;
	r = drv.init(0);
	if (r != CUDA_SUCCESS) {
		snprintf(drv_error, sizeof(drv_error), "cuInit failed (CUresult %d)", (int)r);
		return;
	}
	/* libcuda stays loaded for the life of the process: mappings made through it outlive any call. */
	drv_status = 0;
}

static int drv_fail(CUresult r, const char *what, int device, uint64_t bytes)
{
	const char *s = NULL;

	if (drv.get_error_string(r, &s) != CUDA_SUCCESS || !s)
		s = "unknown driver error";
	return shardd_err_set(
		r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -SHARDD_E_BACKEND,
		"import a cuda buffer of %llu bytes on device %d: %s: %s (CUresult %d)",
		(unsigned long long)bytes, device, what, s, (int)r);
}

static void primary_ctx_pop(CUdevice dev);
static CUresult primary_ctx_push(CUdevice dev);

/*
 * A trainer that is an MPS client with every SM to itself: its GEMMs'
 * persistent kernels hold all of them, and the daemon's ops (MPS clients
 * of the same server) wait behind them. Measured on an H100 (docs/CUDA.md,
 * "MPS"): p90 ~1.4 ms per op uncapped, against 0.1-0.2 ms with the trainer
 * at 90 %. Said once per process, on stderr, when this process's context on
 * `device` is an MPS client that may use every SM of the device.
 */
static void mps_advise(int device)
{
	static atomic_int advised;
	CUexecAffinityParam aff;
	CUdevice dev;
	int mps = 0, sms = 0;

	if (atomic_exchange(&advised, 1) || drv.device_get(&dev, device) != CUDA_SUCCESS ||
	    drv.device_get_attribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, dev) != CUDA_SUCCESS ||
	    !mps ||
	    drv.device_get_attribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) !=
		    CUDA_SUCCESS)
		return;
	/* The context's own share: the environment's percentage or the control daemon's default. */
	if (primary_ctx_push(dev) != CUDA_SUCCESS)
		return;
	if (drv.ctx_get_exec_affinity(&aff, CU_EXEC_AFFINITY_TYPE_SM_COUNT) != CUDA_SUCCESS)
		aff.param.smCount.val = 0;
	primary_ctx_pop(dev);
	if (aff.param.smCount.val == 0 || aff.param.smCount.val < (unsigned)sms)
		return;
	fprintf(stderr,
		"libshardd: this process is a CUDA MPS client that may use all %d SMs of device %d: its "
		"kernels can hold every SM and shardd's ops then wait behind them; start it with "
		"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=90 (docs/CUDA.md, \"MPS\")\n",
		sms, device);
}

/* 0 when a buffer of `bytes` can be imported on `device`: the arguments and the driver. */
static int import_check(int device, uint64_t bytes)
{
	if (device < 0 || bytes == 0 || bytes > SIZE_MAX / 2)
		return shardd_err_set(
			-EINVAL, "import a cuda buffer of %llu bytes on device %d: %s",
			(unsigned long long)bytes, device,
			device < 0 ? "the client attached without a CUDA device (hello.device)"
				   : "bad size");
	pthread_once(&drv_once, drv_load);
	if (drv_status)
		return shardd_err_set(drv_status, "the daemon runs the cuda backend: %s",
				      drv_error);
	mps_advise(device);
	return 0;
}

/*
 * Make `dev`'s primary context current on this thread, on top of whatever
 * the caller had (with a retain of its own, which primary_ctx_pop releases).
 */
static CUresult primary_ctx_push(CUdevice dev)
{
	CUcontext ctx;
	CUresult r = drv.primary_ctx_retain(&ctx, dev);

	if (r != CUDA_SUCCESS)
		return r;
	r = drv.ctx_push(ctx);
	if (r != CUDA_SUCCESS)
		drv.primary_ctx_release(dev);
	return r;
}

/* Back to the caller's current context. */
static void primary_ctx_pop(CUdevice dev)
{
	CUcontext popped;

	drv.ctx_pop(&popped);
	drv.primary_ctx_release(dev);
}

int shardd_cuda_import(int fd, int device, uint64_t bytes, struct shardd_cuda_mapping *out)
{
	CUmemGenericAllocationHandle handle;
	CUmemAllocationProp prop;
	CUmemAccessDesc access;
	CUdeviceptr ptr = 0;
	size_t gran = 0, size;
	CUresult r;
	int ret;

	memset(out, 0, sizeof(*out));
	ret = import_check(device, bytes);
	if (ret)
		return ret;

	/* The daemon's allocation properties (cuda_vmm_prop): the granularity must be the one it rounded with. */
	memset(&prop, 0, sizeof(prop));
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = device;
	r = drv.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (r != CUDA_SUCCESS)
		return drv_fail(r, "cuMemGetAllocationGranularity", device, bytes);
	if (gran == 0)
		return shardd_err_set(-SHARDD_E_BACKEND,
				      "device %d reports an allocation granularity of 0", device);
	size = (size_t)shardd_cuda_alloc_size(bytes, gran);

	/* A POSIX fd handle travels as the fd's value in the pointer argument. */
	r = drv.import_handle(&handle, (void *)(uintptr_t)fd,
			      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (r != CUDA_SUCCESS)
		return drv_fail(r, "cuMemImportFromShareableHandle", device, bytes);
	r = drv.address_reserve(&ptr, size, gran, 0, 0);
	if (r != CUDA_SUCCESS) {
		ret = drv_fail(r, "cuMemAddressReserve", device, bytes);
		goto err_release;
	}
	r = drv.map(ptr, size, 0, handle, 0);
	if (r != CUDA_SUCCESS) {
		ret = drv_fail(r, "cuMemMap", device, bytes);
		goto err_address;
	}
	memset(&access, 0, sizeof(access));
	access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	access.location.id = device;
	access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	r = drv.set_access(ptr, size, &access, 1);
	if (r != CUDA_SUCCESS) {
		ret = drv_fail(r, "cuMemSetAccess", device, bytes);
		goto err_unmap;
	}
	/* The mapping holds the memory from here; the handle is no longer needed. */
	drv.release(handle);
	out->ptr = ptr;
	out->size = size;
	out->kind = SHARDD_EXPORT_FD;
	out->device = device;
	return 0;

err_unmap:
	drv.unmap(ptr, size);
err_address:
	drv.address_free(ptr, size);
err_release:
	drv.release(handle);
	return ret;
}

int shardd_cuda_import_ipc(const struct shardd_cuda_ipc_handle *handle, int device, uint64_t bytes,
			   struct shardd_cuda_mapping *out)
{
	CUipcMemHandle h;
	CUdeviceptr ptr = 0;
	CUcontext ctx, popped;
	CUdevice dev;
	CUresult r;
	int ret;

	_Static_assert(sizeof(h) == sizeof(handle->bytes), "CUipcMemHandle is 64 bytes");
	memset(out, 0, sizeof(*out));
	ret = import_check(device, bytes);
	if (ret)
		return ret;
	r = drv.device_get(&dev, device);
	if (r != CUDA_SUCCESS)
		return drv_fail(r, "cuDeviceGet", device, bytes);
	/* This retain is the mapping's: it keeps the context the memory is mapped in alive. */
	r = drv.primary_ctx_retain(&ctx, dev);
	if (r != CUDA_SUCCESS)
		return drv_fail(r, "cuDevicePrimaryCtxRetain", device, bytes);
	/* On top of the caller's current context, which the pop below restores. */
	r = drv.ctx_push(ctx);
	if (r != CUDA_SUCCESS) {
		ret = drv_fail(r, "cuCtxPushCurrent", device, bytes);
		goto err_release;
	}
	memcpy(&h, handle->bytes, sizeof(h));
	/* Memory of another device than this rank's is reached through peer access, enabled as needed. */
	r = drv.ipc_open(&ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
	drv.ctx_pop(&popped);
	if (r != CUDA_SUCCESS) {
		ret = drv_fail(r, "cuIpcOpenMemHandle", device, bytes);
		goto err_release;
	}
	out->ptr = ptr;
	out->size = bytes;
	out->kind = SHARDD_EXPORT_CUDA_IPC;
	out->device = device;
	return 0;

err_release:
	drv.primary_ctx_release(dev);
	return ret;
}

void shardd_cuda_unmap(struct shardd_cuda_mapping *m)
{
	CUdevice dev;

	/* A mapping exists only after drv_load succeeded. */
	if (m->ptr && m->kind == SHARDD_EXPORT_CUDA_IPC) {
		/* The handle is closed in the context that opened it; then the mapping's retain goes. */
		if (drv.device_get(&dev, m->device) == CUDA_SUCCESS) {
			if (primary_ctx_push(dev) == CUDA_SUCCESS) {
				drv.ipc_close((CUdeviceptr)m->ptr);
				primary_ctx_pop(dev);
			}
			drv.primary_ctx_release(dev);
		}
	} else if (m->ptr) {
		drv.unmap((CUdeviceptr)m->ptr, (size_t)m->size);
		drv.address_free((CUdeviceptr)m->ptr, (size_t)m->size);
	}
	memset(m, 0, sizeof(*m));
}

int shardd_cuda_copy_in(int device, uint64_t dst, const void *src, uint64_t bytes)
{
	CUdevice dev;
	CUresult r;

	pthread_once(&drv_once, drv_load);
	if (drv_status)
		return shardd_err_set(drv_status, "copy %llu bytes to device %d: %s",
				      (unsigned long long)bytes, device, drv_error);
	r = drv.device_get(&dev, device);
	if (r != CUDA_SUCCESS)
		return drv_fail(r, "cuDeviceGet", device, bytes);
	r = primary_ctx_push(dev);
	if (r != CUDA_SUCCESS)
		return drv_fail(r, "the device's primary context", device, bytes);
	/*
	 * A copy from pageable memory may return before its DMA lands, and the
	 * daemon's stream does not wait for this context's work: wait here.
	 */
	r = drv.memcpy_htod((CUdeviceptr)dst, src, (size_t)bytes);
	if (r == CUDA_SUCCESS)
		r = drv.ctx_synchronize();
	primary_ctx_pop(dev);
	return r == CUDA_SUCCESS ? 0 : drv_fail(r, "cuMemcpyHtoD", device, bytes);
}

/* ---------------- fences ---------------- */

/*
 * Events live in the device's primary context, the one the runtime (and so
 * PyTorch) uses: the trainer's streams are there, and the legacy default
 * stream (a NULL stream) is the current context's.
 */
struct shardd_cuda_fences {
	int device;
	CUcontext ctx;    /* the device's primary context, retained */
	uint32_t nrecord; /* ours, one per SQ slot */
	uint32_t nwait;   /* the daemon's, one per CQ slot; 0 until opened */
	CUevent *record;
	CUevent *wait;
};

static int fence_fail(CUresult r, const char *what, int device)
{
	const char *s = NULL;

	if (drv.get_error_string(r, &s) != CUDA_SUCCESS || !s)
		s = "unknown driver error";
	return shardd_err_set(r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -SHARDD_E_BACKEND,
			      "stream fences on device %d: %s: %s (CUresult %d)", device, what, s,
			      (int)r);
}

static int fence_push(struct shardd_cuda_fences *f)
{
	CUresult r = drv.ctx_push(f->ctx);

	return r == CUDA_SUCCESS ? 0 : fence_fail(r, "cuCtxPushCurrent", f->device);
}

static void fence_pop(void)
{
	CUcontext ctx;

	drv.ctx_pop(&ctx);
}

void shardd_cuda_fences_free(struct shardd_cuda_fences *f)
{
	if (!f)
		return;
	if (f->ctx && fence_push(f) == 0) {
		/* An event that queued work still records or waits on lives until that work is done. */
		for (uint32_t i = 0; i < f->nrecord; i++)
			if (f->record[i])
				drv.event_destroy(f->record[i]);
		for (uint32_t i = 0; i < f->nwait; i++)
			if (f->wait[i])
				drv.event_destroy(f->wait[i]);
		fence_pop();
	}
	if (f->ctx) {
		CUdevice dev;

		if (drv.device_get(&dev, f->device) == CUDA_SUCCESS)
			drv.primary_ctx_release(dev);
	}
	free(f->record);
	free(f->wait);
	free(f);
}

int shardd_cuda_fences_create(int device, uint32_t nrecord, struct shardd_cuda_ipc_handle *handles,
			      struct shardd_cuda_fences **out)
{
	struct shardd_cuda_fences *f;
	CUdevice dev;
	CUresult r;
	int ret;

	_Static_assert(sizeof(CUipcEventHandle) == sizeof(struct shardd_cuda_ipc_handle),
		       "an event handle travels as struct shardd_cuda_ipc_handle");
	*out = NULL;
	if (device < 0)
		return shardd_err_set(-EINVAL,
				      "stream fences: this client attached without a CUDA "
				      "device (opts.device = %d); attach with its stream's device",
				      device);
	pthread_once(&drv_once, drv_load);
	if (drv_status)
		return shardd_err_set(drv_status, "stream fences: %s", drv_error);
	f = calloc(1, sizeof(*f));
	if (f)
		f->record = calloc(nrecord, sizeof(*f->record));
	if (!f || !f->record) {
		shardd_cuda_fences_free(f);
		return shardd_err_set(-ENOMEM, "stream fences: out of memory for %u events",
				      nrecord);
	}
	f->device = device;
	r = drv.device_get(&dev, device);
	if (r == CUDA_SUCCESS)
		r = drv.primary_ctx_retain(&f->ctx, dev);
	if (r != CUDA_SUCCESS) {
		f->ctx = NULL;
		ret = fence_fail(r, "the device's primary context", device);
		goto err;
	}
	ret = fence_push(f);
	if (ret)
		goto err;
	for (uint32_t i = 0; i < nrecord; i++) {
		CUipcEventHandle h;

		r = drv.event_create(&f->record[i],
				     CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
		if (r != CUDA_SUCCESS) {
			f->record[i] = NULL;
			ret = fence_fail(r, "cuEventCreate", device);
			break;
		}
		f->nrecord = i + 1;
		r = drv.ipc_get_event(&h, f->record[i]);
		if (r != CUDA_SUCCESS) {
			ret = fence_fail(r, "cuIpcGetEventHandle", device);
			break;
		}
		memcpy(&handles[i], &h, sizeof(h));
	}
	fence_pop();
	if (ret)
		goto err;
	*out = f;
	return 0;

err:
	shardd_cuda_fences_free(f);
	return ret;
}

int shardd_cuda_fences_open(struct shardd_cuda_fences *f, uint32_t nwait,
			    const struct shardd_cuda_ipc_handle *handles)
{
	int ret;

	f->wait = calloc(nwait, sizeof(*f->wait));
	if (!f->wait)
		return shardd_err_set(-ENOMEM, "stream fences: out of memory for %u events", nwait);
	ret = fence_push(f);
	if (ret)
		return ret;
	for (uint32_t i = 0; i < nwait && !ret; i++) {
		CUipcEventHandle h;
		CUresult r;

		memcpy(&h, &handles[i], sizeof(h));
		r = drv.ipc_open_event(&f->wait[i], h);
		if (r != CUDA_SUCCESS) {
			f->wait[i] = NULL;
			ret = fence_fail(r, "cuIpcOpenEventHandle of the daemon's event",
					 f->device);
		}
		f->nwait = i + 1;
	}
	fence_pop();
	return ret;
}

int shardd_cuda_fence_record(struct shardd_cuda_fences *f, uint32_t slot, void *stream)
{
	CUresult r;
	int ret = fence_push(f);

	if (ret)
		return ret;
	r = drv.event_record(f->record[slot], (CUstream)stream);
	fence_pop();
	return r == CUDA_SUCCESS ? 0
				 : fence_fail(r, "cuEventRecord on the client's stream", f->device);
}

int shardd_cuda_fence_wait(struct shardd_cuda_fences *f, uint32_t slot, int on_stream, void *stream)
{
	CUresult r;
	int ret;

	if (slot >= f->nwait || !f->wait[slot])
		return shardd_err_set(-EPROTO,
				      "stream fences: the daemon fenced CQ slot %u, which has "
				      "no event (%u opened)",
				      slot, f->nwait);
	ret = fence_push(f);
	if (ret)
		return ret;
	if (on_stream)
		r = drv.stream_wait_event((CUstream)stream, f->wait[slot], 0);
	else
		r = drv.event_synchronize(f->wait[slot]);
	fence_pop();
	return r == CUDA_SUCCESS
		       ? 0
		       : fence_fail(r, on_stream ? "cuStreamWaitEvent" : "cuEventSynchronize",
				    f->device);
}

#else /* !SHARDD_HAVE_CUDA */

static int no_cuda(int device, uint64_t bytes, struct shardd_cuda_mapping *out)
{
	memset(out, 0, sizeof(*out));
	return shardd_err_set(
		-ENOTSUP,
		"import a cuda buffer of %llu bytes on device %d: the daemon runs the cuda "
		"backend but this libshardd was built without CUDA (rebuild with make CUDA=1)",
		(unsigned long long)bytes, device);
}

int shardd_cuda_import(int fd, int device, uint64_t bytes, struct shardd_cuda_mapping *out)
{
	(void)fd;
	return no_cuda(device, bytes, out);
}

int shardd_cuda_import_ipc(const struct shardd_cuda_ipc_handle *handle, int device, uint64_t bytes,
			   struct shardd_cuda_mapping *out)
{
	(void)handle;
	return no_cuda(device, bytes, out);
}

void shardd_cuda_unmap(struct shardd_cuda_mapping *m)
{
	memset(m, 0, sizeof(*m));
}

int shardd_cuda_copy_in(int device, uint64_t dst, const void *src, uint64_t bytes)
{
	(void)dst;
	(void)src;
	return shardd_err_set(-ENOTSUP,
			      "copy %llu bytes to device %d: this libshardd was built "
			      "without CUDA (rebuild with make CUDA=1)",
			      (unsigned long long)bytes, device);
}

/* Fences are never made in this build, so only their creation can be called. */
int shardd_cuda_fences_create(int device, uint32_t nrecord, struct shardd_cuda_ipc_handle *handles,
			      struct shardd_cuda_fences **out)
{
	(void)nrecord;
	(void)handles;
	*out = NULL;
	return shardd_err_set(-ENOTSUP,
			      "stream fences on device %d: the daemon runs the cuda "
			      "backend but this libshardd was built without CUDA (rebuild with "
			      "make CUDA=1)",
			      device);
}

void shardd_cuda_fences_free(struct shardd_cuda_fences *f)
{
	(void)f;
}

int shardd_cuda_fences_open(struct shardd_cuda_fences *f, uint32_t nwait,
			    const struct shardd_cuda_ipc_handle *handles)
{
	(void)f;
	(void)nwait;
	(void)handles;
	return -ENOTSUP;
}

int shardd_cuda_fence_record(struct shardd_cuda_fences *f, uint32_t slot, void *stream)
{
	(void)f;
	(void)slot;
	(void)stream;
	return -ENOTSUP;
}

int shardd_cuda_fence_wait(struct shardd_cuda_fences *f, uint32_t slot, int on_stream, void *stream)
{
	(void)f;
	(void)slot;
	(void)on_stream;
	(void)stream;
	return -ENOTSUP;
}

#endif /* SHARDD_HAVE_CUDA */
