/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend's devices (backend_cuda_int.h): the driver's entry
 * points, the errors of runtime and driver calls, a device's set-up on its
 * first use (which export kind its buffers take, its streams), and the
 * waits on a device's stream, bounded where NCCL runs there.
 *
 * The daemon links libcudart but not libcuda (which exists only where a
 * driver is installed): driver calls go through entry points that the
 * runtime resolves (cudaGetDriverEntryPointByVersion, through the resolver
 * libshardd uses too: proto/shardd_cuda.h), so shardd starts, and fails
 * cleanly, without a driver.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "backend_cuda_int.h"
#include "clock.h"
#include "log.h"
#include "shardd_cuda.h"

/*
 * How often a wait on a device that runs NCCL collectives asks the
 * communicators for asynchronous errors, and how long it sleeps between
 * looks at the stream.
 */
#define CUDA_NCCL_CHECK_NS 10000000ull
#define CUDA_WAIT_POLL_NS  20000

/* This thread holds nccl_lock: a wait it makes checks the communicators without taking it again. */
static _Thread_local int nccl_lock_held;

void cuda_nccl_lock(struct cuda_backend *cb)
{
	pthread_mutex_lock(&cb->nccl_lock);
	nccl_lock_held = 1;
}

void cuda_nccl_unlock(struct cuda_backend *cb)
{
	nccl_lock_held = 0;
	pthread_mutex_unlock(&cb->nccl_lock);
}

/* ------------------------------------------------------------------ */
/* The driver                                                          */
/* ------------------------------------------------------------------ */

static const struct shardd_cuda_symbol cuda_driver_symbols[] = { CUDA_DRIVER_ENTRY_POINTS(
	SHARDD_CUDA_DRIVER_SYMBOL, struct cuda_driver) };

/* A shardd_cuda_lookup_fn: the runtime's own lookup of a driver entry point. */
static int cuda_driver_lookup(void *ctx, const char *name, void **fn, char *err, size_t errlen)
{
	enum cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
	cudaError_t e;

	(void)ctx;
	e = cudaGetDriverEntryPointByVersion(name, fn, SHARDD_CUDA_DRIVER_ABI, cudaEnableDefault,
					     &status);
	if (e == cudaSuccess && status == cudaDriverEntryPointSuccess && *fn)
		return 0;
	snprintf(
		err, errlen,
		"shardd: --backend cuda: the CUDA driver does not provide %s (%s, query status %d); "
		"update the NVIDIA driver or use --backend host",
		name, e == cudaSuccess ? "no such symbol" : cudaGetErrorString(e), (int)status);
	return -SHARDD_E_BACKEND;
}

int cuda_driver_resolve(struct cuda_driver *drv, char *err, size_t errlen)
{
	return shardd_cuda_resolve(drv, cuda_driver_symbols,
				   sizeof(cuda_driver_symbols) / sizeof(cuda_driver_symbols[0]),
				   cuda_driver_lookup, NULL, err, errlen);
}

/* ------------------------------------------------------------------ */
/* Errors                                                              */
/* ------------------------------------------------------------------ */

int cuda_rt_fail(const char *what, cudaError_t e)
{
	shd_log_error("shardd: cuda backend: %s: %s (%s)", what, cudaGetErrorString(e),
		      cudaGetErrorName(e));
	return e == cudaErrorMemoryAllocation ? -ENOMEM : -SHARDD_E_BACKEND;
}

int cuda_drv_fail(const struct cuda_backend *cb, const char *what, CUresult r)
{
	const char *s = NULL;

	if (cb->drv.get_error_string(r, &s) != CUDA_SUCCESS || !s)
		s = "unknown driver error";
	shd_log_error("shardd: cuda backend: %s: %s (CUresult %d)", what, s, (int)r);
	return r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -SHARDD_E_BACKEND;
}

/* `ret`: the result of queueing an op's kernels. Their execution is checked by sync or a fence. */
int cuda_queued(int ret, const char *what)
{
	if (ret)
		shd_log_error("shardd: cuda backend: %s: a kernel launch failed (%d)", what, ret);
	return ret;
}

/* ------------------------------------------------------------------ */
/* Set-up                                                              */
/* ------------------------------------------------------------------ */

/*
 * Pinned device memory with POSIX fd handles: libshardd asks the
 * granularity of the same properties (client/cuda_import.c), so both
 * round a buffer's size alike (shardd_cuda_alloc_size).
 */
void cuda_vmm_prop(CUmemAllocationProp *prop, int device)
{
	memset(prop, 0, sizeof(*prop));
	prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop->location.id = device;
}

static const char *cuda_export_mode_name(uint32_t mode)
{
	return mode == SHD_CUDA_EXPORT_FD ? "fd" : mode == SHD_CUDA_EXPORT_IPC ? "ipc" : "auto";
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

	if (cb->mode != SHD_CUDA_EXPORT_IPC && fd_ok) {
		*kind = SHARDD_EXPORT_FD;
		return 0;
	}
	if (cb->mode != SHD_CUDA_EXPORT_FD && uva) {
		*kind = SHARDD_EXPORT_CUDA_IPC;
		return 0;
	}
	if (cb->mode == SHD_CUDA_EXPORT_FD)
		shd_log_error(
			"shardd: cuda backend: device %d (%s) cannot export memory as file "
			"descriptors (virtual memory management %s, POSIX fd handles %s); use "
			"--cuda-export auto or ipc, or --backend host",
			device, name, yes_no(vmm), yes_no(posix_fd));
	else if (cb->mode == SHD_CUDA_EXPORT_IPC)
		shd_log_error("shardd: cuda backend: device %d (%s) cannot export legacy CUDA IPC "
			      "handles (no unified addressing); use --cuda-export auto or fd, or "
			      "--backend host",
			      device, name);
	else
		shd_log_error(
			"shardd: cuda backend: device %d (%s) can export memory neither as file "
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
		r = cb->drv.device_get_attribute(
			&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
	if (r == CUDA_SUCCESS)
		r = cb->drv.device_get_attribute(
			&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
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
		cuda_vmm_prop(&prop, device);
		r = cb->drv.granularity(&d->granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
		if (r != CUDA_SUCCESS)
			return cuda_drv_fail(cb, what, r);
		if (d->granularity == 0) {
			shd_log_error(
				"shardd: cuda backend: device %d reports an allocation granularity of 0",
				device);
			return -SHARDD_E_BACKEND;
		}
	}
	/* Non-blocking: the legacy default stream of other threads must not serialise with ours. */
	e = cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking);
	if (e != cudaSuccess)
		return cuda_rt_fail(what, e);
	d->ready = 1;
	shd_log_info("cuda backend: device %d (%s) exports its buffers as %s (--cuda-export %s; "
		     "virtual memory management %s, POSIX fd handles %s, unified addressing %s)",
		     device, name,
		     d->export_kind == SHARDD_EXPORT_FD
			     ? "POSIX file descriptors of cuMemCreate allocations"
			     : "legacy CUDA IPC handles of cudaMalloc allocations",
		     cuda_export_mode_name(cb->mode), yes_no(vmm), yes_no(posix_fd), yes_no(uva));
	return 0;
}

/* The ready device `device`, set current on the calling thread. 0 or -SHARDD_E_BACKEND. */
int cuda_device_get(struct cuda_backend *cb, int device, struct cuda_device **out)
{
	struct cuda_device *d;
	cudaError_t e;
	int ret = 0;

	if (device < 0 || device >= cb->ndevices) {
		shd_log_error("shardd: cuda backend: device %d does not exist (%d visible)", device,
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

/* ------------------------------------------------------------------ */
/* Waits                                                               */
/* ------------------------------------------------------------------ */

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
int cuda_device_wait(struct cuda_backend *cb, int device, struct cuda_device *d, const char *what,
		     char *err, size_t errlen)
{
	struct timespec pause = { 0, CUDA_WAIT_POLL_NS };
	uint64_t now, deadline, check;
	cudaError_t e;
	char why[512];

	if (!atomic_load_explicit(&d->nccl_used, memory_order_relaxed))
		return cuda_stream_sync(d, what);
	now = shd_now_ns();
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
		now = shd_now_ns();
		if (now >= check) {
			int late = now >= deadline;
			uint32_t aborted;

			if (!nccl_lock_held)
				pthread_mutex_lock(&cb->nccl_lock);
			aborted = shd_nccl_check_device(cb->nccl, device, late, why, sizeof(why));
			if (!nccl_lock_held)
				pthread_mutex_unlock(&cb->nccl_lock);
			if (aborted) {
				shd_log_error(
					"shardd: cuda backend: %s: device %d: %s; aborted %u NCCL "
					"communicator set(s): %s",
					what, device,
					late ? "its work did not finish within the collective timeout"
					     : "NCCL reported an error",
					aborted, why);
				if (err)
					snprintf(
						err, errlen,
						"device %d %s; its NCCL communicators were aborted: %s",
						device,
						late ? "did not finish within the collective timeout"
						     : "reported an NCCL error",
						why);
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

/* ------------------------------------------------------------------ */
/* NCCL streams, and the end                                           */
/* ------------------------------------------------------------------ */

/* Make the device's NCCL stream and events once; the device is current. */
int cuda_device_nccl_setup(struct cuda_device *d)
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

void cuda_devices_destroy(struct cuda_backend *cb)
{
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
}
