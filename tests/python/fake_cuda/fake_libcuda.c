/* SPDX-License-Identifier: MIT */
/*
 * A stand-in for libcuda.so.1 that records every call, so that the Python
 * client's import of cuda buffers and its stream fences (shardd/cuda.py)
 * are checked call by call on a machine without a driver
 * (tests/python/test_cuda_import.py builds it with `cc -shared`).
 *
 * Each call is defined against the real <cuda.h> prototype (the compiler
 * refuses a definition whose types differ), appends one line to a log, and
 * returns CUDA_SUCCESS unless fake_cuda_fail() armed it. It keeps counts of
 * what is live (context retains, reserved ranges, mapped handles, events)
 * so a test can assert that close released everything. Addresses are
 * made up: nothing is ever dereferenced.
 */
#include <cuda.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#define LOG_MAX (1 << 20)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char log_buf[LOG_MAX];
static size_t log_len;
static char fail_name[64];
static CUresult fail_code;
static size_t gran = 2u << 20;
static unsigned long long next_handle = 1, next_range, next_ipc, next_event;
static int retained[8], live_ranges, live_handles, live_ipc, live_events, ctx_depth;

static void logf_(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	if (log_len < LOG_MAX)
		log_len += (size_t)vsnprintf(log_buf + log_len, LOG_MAX - log_len, fmt, ap);
	va_end(ap);
	if (log_len > LOG_MAX)
		log_len = LOG_MAX;
}

/* The armed failure of `name`, once; CUDA_SUCCESS otherwise. */
static CUresult armed(const char *name)
{
	CUresult r = CUDA_SUCCESS;

	if (fail_code != CUDA_SUCCESS && strcmp(name, fail_name) == 0) {
		r = fail_code;
		fail_code = CUDA_SUCCESS;
	}
	return r;
}

#define ENTER(name)                                 \
	CUresult r_;                                \
	pthread_mutex_lock(&lock);                  \
	r_ = armed(name);                           \
	if (r_ != CUDA_SUCCESS) {                   \
		logf_("%s -> %d\n", name, (int)r_); \
		pthread_mutex_unlock(&lock);        \
		return r_;                          \
	}
#define LEAVE()                      \
	pthread_mutex_unlock(&lock); \
	return CUDA_SUCCESS

/* ---- what a test calls ---- */

const char *fake_cuda_log(void)
{
	return log_buf;
}

void fake_cuda_reset(void)
{
	pthread_mutex_lock(&lock);
	log_len = 0;
	log_buf[0] = '\0';
	fail_code = CUDA_SUCCESS;
	pthread_mutex_unlock(&lock);
}

void fake_cuda_fail(const char *name, int code)
{
	pthread_mutex_lock(&lock);
	snprintf(fail_name, sizeof(fail_name), "%s", name);
	fail_code = (CUresult)code;
	pthread_mutex_unlock(&lock);
}

void fake_cuda_set_granularity(size_t g)
{
	gran = g;
}

/* What is still held: retains of device 0's primary context, ranges, handles, ipc opens, events, pushed contexts. */
void fake_cuda_live(int out[6])
{
	pthread_mutex_lock(&lock);
	out[0] = retained[0];
	out[1] = live_ranges;
	out[2] = live_handles;
	out[3] = live_ipc;
	out[4] = live_events;
	out[5] = ctx_depth;
	pthread_mutex_unlock(&lock);
}

/* ---- the driver's calls ---- */

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr)
{
	switch (error) {
	case CUDA_ERROR_INVALID_VALUE:
		*pStr = "CUDA_ERROR_INVALID_VALUE";
		return CUDA_SUCCESS;
	case CUDA_ERROR_OUT_OF_MEMORY:
		*pStr = "CUDA_ERROR_OUT_OF_MEMORY";
		return CUDA_SUCCESS;
	default:
		*pStr = NULL;
		return CUDA_ERROR_INVALID_VALUE;
	}
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr)
{
	switch (error) {
	case CUDA_ERROR_INVALID_VALUE:
		*pStr = "invalid argument";
		return CUDA_SUCCESS;
	case CUDA_ERROR_OUT_OF_MEMORY:
		*pStr = "out of memory";
		return CUDA_SUCCESS;
	default:
		*pStr = NULL;
		return CUDA_ERROR_INVALID_VALUE;
	}
}

CUresult CUDAAPI cuInit(unsigned int Flags)
{
	ENTER("cuInit");
	logf_("cuInit flags=%u\n", Flags);
	LEAVE();
}

CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal)
{
	ENTER("cuDeviceGet");
	*device = ordinal;
	logf_("cuDeviceGet ordinal=%d\n", ordinal);
	LEAVE();
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
	ENTER("cuDevicePrimaryCtxRetain");
	*pctx = (CUcontext)(uintptr_t)(0xc000 + dev);
	retained[dev & 7]++;
	logf_("cuDevicePrimaryCtxRetain dev=%d\n", dev);
	LEAVE();
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev)
{
	ENTER("cuDevicePrimaryCtxRelease");
	retained[dev & 7]--;
	logf_("cuDevicePrimaryCtxRelease dev=%d\n", dev);
	LEAVE();
}

CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx)
{
	ENTER("cuCtxPushCurrent");
	ctx_depth++;
	logf_("cuCtxPushCurrent ctx=%#lx\n", (unsigned long)(uintptr_t)ctx);
	LEAVE();
}

CUresult CUDAAPI cuCtxPopCurrent(CUcontext *pctx)
{
	ENTER("cuCtxPopCurrent");
	ctx_depth--;
	*pctx = NULL;
	logf_("cuCtxPopCurrent\n");
	LEAVE();
}

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
					       CUmemAllocationGranularity_flags option)
{
	ENTER("cuMemGetAllocationGranularity");
	*granularity = gran;
	logf_("cuMemGetAllocationGranularity type=%d handles=%d loc=%d:%d win32=%p option=%d\n",
	      (int)prop->type, (int)prop->requestedHandleTypes, (int)prop->location.type,
	      prop->location.id, prop->win32HandleMetaData, (int)option);
	LEAVE();
}

CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
						void *osHandle,
						CUmemAllocationHandleType shHandleType)
{
	int fd = (int)(uintptr_t)osHandle;
	struct stat st;

	ENTER("cuMemImportFromShareableHandle");
	if (fstat(fd, &st)) {
		logf_("cuMemImportFromShareableHandle fd=%d not open\n", fd);
		pthread_mutex_unlock(&lock);
		return CUDA_ERROR_INVALID_VALUE;
	}
	*handle = next_handle++;
	live_handles++;
	logf_("cuMemImportFromShareableHandle fd_size=%lld type=%d -> handle=%llu\n",
	      (long long)st.st_size, (int)shHandleType, *handle);
	LEAVE();
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
				     CUdeviceptr addr, unsigned long long flags)
{
	ENTER("cuMemAddressReserve");
	*ptr = 0x7f0000000000ull + (next_range++ << 32);
	live_ranges++;
	logf_("cuMemAddressReserve size=%zu align=%zu addr=%llu flags=%llu -> %#llx\n", size,
	      alignment, (unsigned long long)addr, flags, (unsigned long long)*ptr);
	LEAVE();
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
			  CUmemGenericAllocationHandle handle, unsigned long long flags)
{
	ENTER("cuMemMap");
	logf_("cuMemMap ptr=%#llx size=%zu offset=%zu handle=%llu flags=%llu\n",
	      (unsigned long long)ptr, size, offset, handle, flags);
	LEAVE();
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
				size_t count)
{
	ENTER("cuMemSetAccess");
	logf_("cuMemSetAccess ptr=%#llx size=%zu loc=%d:%d flags=%d count=%zu\n",
	      (unsigned long long)ptr, size, (int)desc->location.type, desc->location.id,
	      (int)desc->flags, count);
	LEAVE();
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle)
{
	ENTER("cuMemRelease");
	live_handles--;
	logf_("cuMemRelease handle=%llu\n", handle);
	LEAVE();
}

CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size)
{
	ENTER("cuMemUnmap");
	logf_("cuMemUnmap ptr=%#llx size=%zu\n", (unsigned long long)ptr, size);
	LEAVE();
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
	ENTER("cuMemAddressFree");
	live_ranges--;
	logf_("cuMemAddressFree ptr=%#llx size=%zu\n", (unsigned long long)ptr, size);
	LEAVE();
}

CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
	ENTER("cuIpcOpenMemHandle");
	*pdptr = 0x7e0000000000ull + (next_ipc++ << 32);
	live_ipc++;
	logf_("cuIpcOpenMemHandle handle=%.16s flags=%u depth=%d -> %#llx\n", handle.reserved,
	      Flags, ctx_depth, (unsigned long long)*pdptr);
	LEAVE();
}

CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr)
{
	ENTER("cuIpcCloseMemHandle");
	live_ipc--;
	logf_("cuIpcCloseMemHandle ptr=%#llx depth=%d\n", (unsigned long long)dptr, ctx_depth);
	LEAVE();
}

CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
	ENTER("cuEventCreate");
	*phEvent = (CUevent)(uintptr_t)(0xe000 + next_event++);
	live_events++;
	logf_("cuEventCreate flags=%u depth=%d -> %#lx\n", Flags, ctx_depth,
	      (unsigned long)(uintptr_t)*phEvent);
	LEAVE();
}

CUresult CUDAAPI cuEventDestroy(CUevent hEvent)
{
	ENTER("cuEventDestroy");
	live_events--;
	logf_("cuEventDestroy %#lx\n", (unsigned long)(uintptr_t)hEvent);
	LEAVE();
}

CUresult CUDAAPI cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event)
{
	ENTER("cuIpcGetEventHandle");
	memset(pHandle, 0, sizeof(*pHandle));
	snprintf(pHandle->reserved, sizeof(pHandle->reserved), "ev%#lx",
		 (unsigned long)(uintptr_t)event);
	logf_("cuIpcGetEventHandle %#lx\n", (unsigned long)(uintptr_t)event);
	LEAVE();
}

CUresult CUDAAPI cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle)
{
	ENTER("cuIpcOpenEventHandle");
	*phEvent = (CUevent)(uintptr_t)(0xd000 + next_event++);
	live_events++;
	logf_("cuIpcOpenEventHandle handle=%.16s depth=%d -> %#lx\n", handle.reserved, ctx_depth,
	      (unsigned long)(uintptr_t)*phEvent);
	LEAVE();
}

CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream)
{
	ENTER("cuEventRecord");
	logf_("cuEventRecord %#lx stream=%#lx depth=%d\n", (unsigned long)(uintptr_t)hEvent,
	      (unsigned long)(uintptr_t)hStream, ctx_depth);
	LEAVE();
}

CUresult CUDAAPI cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
	ENTER("cuStreamWaitEvent");
	logf_("cuStreamWaitEvent stream=%#lx %#lx flags=%u depth=%d\n",
	      (unsigned long)(uintptr_t)hStream, (unsigned long)(uintptr_t)hEvent, Flags,
	      ctx_depth);
	LEAVE();
}

CUresult CUDAAPI cuEventSynchronize(CUevent hEvent)
{
	ENTER("cuEventSynchronize");
	logf_("cuEventSynchronize %#lx depth=%d\n", (unsigned long)(uintptr_t)hEvent, ctx_depth);
	LEAVE();
}

/* The driver's own resolver: by the names without version suffix, at the one ABI shardd asks for. */
CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
				  CUdriverProcAddressQueryResult *symbolStatus)
{
	static const struct {
		const char *name;
		void *fn;
	} table[] = {
		{ "cuGetErrorName", (void *)cuGetErrorName },
		{ "cuGetErrorString", (void *)cuGetErrorString },
		{ "cuInit", (void *)cuInit },
		{ "cuDeviceGet", (void *)cuDeviceGet },
		{ "cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain },
		{ "cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease },
		{ "cuCtxPushCurrent", (void *)cuCtxPushCurrent },
		{ "cuCtxPopCurrent", (void *)cuCtxPopCurrent },
		{ "cuMemGetAllocationGranularity", (void *)cuMemGetAllocationGranularity },
		{ "cuMemImportFromShareableHandle", (void *)cuMemImportFromShareableHandle },
		{ "cuMemAddressReserve", (void *)cuMemAddressReserve },
		{ "cuMemMap", (void *)cuMemMap },
		{ "cuMemSetAccess", (void *)cuMemSetAccess },
		{ "cuMemRelease", (void *)cuMemRelease },
		{ "cuMemUnmap", (void *)cuMemUnmap },
		{ "cuMemAddressFree", (void *)cuMemAddressFree },
		{ "cuIpcOpenMemHandle", (void *)cuIpcOpenMemHandle },
		{ "cuIpcCloseMemHandle", (void *)cuIpcCloseMemHandle },
		{ "cuEventCreate", (void *)cuEventCreate },
		{ "cuEventDestroy", (void *)cuEventDestroy },
		{ "cuIpcGetEventHandle", (void *)cuIpcGetEventHandle },
		{ "cuIpcOpenEventHandle", (void *)cuIpcOpenEventHandle },
		{ "cuEventRecord", (void *)cuEventRecord },
		{ "cuStreamWaitEvent", (void *)cuStreamWaitEvent },
		{ "cuEventSynchronize", (void *)cuEventSynchronize },
	};

	*pfn = NULL;
	*symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	/* shardd asks for every call at SHARDD_CUDA_DRIVER_ABI with the default search. */
	if (cudaVersion != 12000 || flags != CU_GET_PROC_ADDRESS_DEFAULT)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
		if (strcmp(symbol, table[i].name) == 0) {
			*pfn = table[i].fn;
			*symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
			return CUDA_SUCCESS;
		}
	}
	return CUDA_ERROR_NOT_FOUND;
}
