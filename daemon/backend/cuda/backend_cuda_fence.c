/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend's stream fences (backend.h, backend_cuda_int.h): a
 * client that set a stream gets interprocess events (cudaEventInterprocess)
 * instead of a CPU wait. Its stream records one of its events (one per SQ
 * slot) before an op and the device's stream waits on it; the device's
 * stream records one of ours (one per CQ slot) after the op and the
 * client's stream waits on it. So neither side waits on a CPU. The
 * client's half is client/cuda_import.c.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda_int.h"
#include "log.h"

/* One session's fences (backend.h): events on the session's device, indexed by ring slot. */
struct shd_fences {
	int device;
	uint32_t nwait, nsignal;
	cudaEvent_t *wait;   /* [nwait]: the client's events, opened; NULL where not (yet) opened */
	cudaEvent_t *signal; /* [nsignal]: ours, exported to the client */
};

void cuda_fences_close(struct shd_backend_ctx *b, struct shd_fences *f)
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

int cuda_fences_open(struct shd_backend_ctx *b, int32_t device, uint32_t nwait,
		     const struct shardd_cuda_ipc_handle *wait_events, uint32_t nsignal,
		     struct shardd_cuda_ipc_handle *signal_events, struct shd_fences **out,
		     char *err, size_t errlen)
{
	struct cuda_backend *cb = (struct cuda_backend *)b;
	struct shd_fences *f;
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

		e = cudaEventCreateWithFlags(&f->signal[i],
					     cudaEventInterprocess | cudaEventDisableTiming);
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
		shd_log_error("shardd: cuda backend: stream fences on device %d: %s", device, err);
		ret = -SHARDD_E_BACKEND;
		goto err;
	}
	*out = f;
	return 0;

err:
	cuda_fences_close(b, f);
	return ret;
}

int cuda_fence_wait(struct shd_backend_ctx *b, struct shd_fences *f, uint32_t slot)
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

int cuda_fence_signal(struct shd_backend_ctx *b, struct shd_fences *f, uint32_t slot)
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
