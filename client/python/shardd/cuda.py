# SPDX-License-Identifier: MIT
"""The cuda backend's buffers and stream fences from Python, through the
NVIDIA driver API by ctypes: the Python twin of the C client's
client/cuda_import.c (read it for the why of each step).

The driver is loaded on first use (driver()), never at import: importing
shardd needs no CUDA. As libshardd does, only libcuda.so.1 is opened, and
every entry point is asked of the driver's own cuGetProcAddress at the ABI
both sides of shardd use (SHARDD_CUDA_DRIVER_ABI, proto/shardd_cuda.h), so
the versioned calls (cuIpcOpenMemHandle_v2, ...) are the ones libshardd
gets. SIGNATURES holds each call's ctypes restype and argtypes, as cuda.h
declares them.

- An fd buffer (PROTOCOL.md 3.7, SHARDD_EXPORT_FD) is imported with
  cuMemImportFromShareableHandle, mapped over alloc_size(bytes,
  granularity) bytes, the size the daemon allocated (both sides round with
  shardd_cuda_alloc_size), with cuMemAddressReserve / cuMemMap /
  cuMemSetAccess; the mapping keeps the memory alive after the daemon
  frees it (its death included), until closed.
- A legacy IPC buffer (SHARDD_EXPORT_CUDA_IPC) is opened with
  cuIpcOpenMemHandle in the device's primary context, which stays retained
  while it is open; the daemon frees that memory when its job ends, open or
  not, and a daemon that dies takes it along: close such a group first.
- Views of a mapping are torch CUDA tensors without a copy, through
  ``__cuda_array_interface__``; a mapping closed while views live is
  unmapped when the last of them is gone, as the host backend's mmaps are.
- Fences: one interprocess event per SQ slot made here, one per CQ slot
  opened from the daemon's handles, recorded on and waited for by the
  trainer's stream (PROTOCOL.md 5.7; client/stream.c).

Every CUresult other than CUDA_SUCCESS becomes a ShardError naming the
call, the driver's name of the code and its number."""

import ctypes
import errno
import threading
import weakref

from . import proto as P
from .error import ShardError, shard_error

# proto/shardd_cuda.h: the driver ABI libshardd and the daemon ask for.
DRIVER_ABI = 12000

# cuda.h's constants this module passes (tests/python/test_cuda_import.py checks them against cuda.h).
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_GET_PROC_ADDRESS_DEFAULT = 0
CU_GET_PROC_ADDRESS_SUCCESS = 0
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_EVENT_DISABLE_TIMING = 2
CU_EVENT_INTERPROCESS = 4

CUresult = ctypes.c_int
CUdevice = ctypes.c_int
CUdeviceptr = ctypes.c_ulonglong            # unsigned long long on every 64-bit target
CUmemGenericAllocationHandle = ctypes.c_ulonglong
CUcontext = CUevent = CUstream = ctypes.c_void_p


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * P.CUDA_IPC_HANDLE_SIZE)]


class CUipcEventHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * P.CUDA_IPC_HANDLE_SIZE)]


_p = ctypes.POINTER

# Every driver call this module makes: (restype, argtypes), in cuda.h's order of parameters.
SIGNATURES = {
    "cuGetErrorString": (CUresult, [CUresult, _p(ctypes.c_char_p)]),
    "cuGetErrorName": (CUresult, [CUresult, _p(ctypes.c_char_p)]),
    "cuInit": (CUresult, [ctypes.c_uint]),
    "cuDeviceGet": (CUresult, [_p(CUdevice), ctypes.c_int]),
    "cuDevicePrimaryCtxRetain": (CUresult, [_p(CUcontext), CUdevice]),
    "cuDevicePrimaryCtxRelease": (CUresult, [CUdevice]),
    "cuCtxPushCurrent": (CUresult, [CUcontext]),
    "cuCtxPopCurrent": (CUresult, [_p(CUcontext)]),
    "cuMemGetAllocationGranularity": (CUresult, [_p(ctypes.c_size_t), _p(CUmemAllocationProp),
                                                 ctypes.c_int]),
    "cuMemImportFromShareableHandle": (CUresult, [_p(CUmemGenericAllocationHandle),
                                                  ctypes.c_void_p, ctypes.c_int]),
    "cuMemAddressReserve": (CUresult, [_p(CUdeviceptr), ctypes.c_size_t, ctypes.c_size_t,
                                       CUdeviceptr, ctypes.c_ulonglong]),
    "cuMemMap": (CUresult, [CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t,
                            CUmemGenericAllocationHandle, ctypes.c_ulonglong]),
    "cuMemSetAccess": (CUresult, [CUdeviceptr, ctypes.c_size_t, _p(CUmemAccessDesc),
                                  ctypes.c_size_t]),
    "cuMemRelease": (CUresult, [CUmemGenericAllocationHandle]),
    "cuMemUnmap": (CUresult, [CUdeviceptr, ctypes.c_size_t]),
    "cuMemAddressFree": (CUresult, [CUdeviceptr, ctypes.c_size_t]),
    "cuIpcOpenMemHandle": (CUresult, [_p(CUdeviceptr), CUipcMemHandle, ctypes.c_uint]),
    "cuIpcCloseMemHandle": (CUresult, [CUdeviceptr]),
    "cuEventCreate": (CUresult, [_p(CUevent), ctypes.c_uint]),
    "cuEventDestroy": (CUresult, [CUevent]),
    "cuIpcGetEventHandle": (CUresult, [_p(CUipcEventHandle), CUevent]),
    "cuIpcOpenEventHandle": (CUresult, [_p(CUevent), CUipcEventHandle]),
    "cuEventRecord": (CUresult, [CUevent, CUstream]),
    "cuStreamWaitEvent": (CUresult, [CUstream, CUevent, ctypes.c_uint]),
    "cuEventSynchronize": (CUresult, [CUevent]),
}

# cuGetProcAddress_v2 (cuda.h maps cuGetProcAddress to it from CUDA 12.0 on).
_GET_PROC = (CUresult, [ctypes.c_char_p, _p(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                        _p(ctypes.c_int)])


def alloc_size(nbytes, granularity):
    """shardd_cuda_alloc_size of proto/shardd_cuda.h: the bytes an fd-kind
    buffer of `nbytes` takes, rounded up to `granularity` (> 0)."""
    return (nbytes + granularity - 1) // granularity * granularity


class Driver:
    """libcuda.so.1 (or `path`), its entry points resolved and cuInit done.
    Its methods are SIGNATURES' calls with the CUresult checked (check())."""

    def __init__(self, path="libcuda.so.1"):
        try:
            self.lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        except OSError as e:
            raise shard_error(-P.E_BACKEND, f"no NVIDIA driver: dlopen {path}: {e}") from None
        try:
            get_proc = ctypes.CFUNCTYPE(_GET_PROC[0], *_GET_PROC[1])(("cuGetProcAddress_v2", self.lib))
        except AttributeError:
            raise shard_error(-P.E_BACKEND, f"the NVIDIA driver {path} is older than CUDA 12.0 "
                                            f"(no cuGetProcAddress_v2); update it") from None
        self.fn = {}
        for name, (restype, argtypes) in SIGNATURES.items():
            ptr, found = ctypes.c_void_p(), ctypes.c_int(-1)
            r = get_proc(name.encode(), ctypes.byref(ptr), DRIVER_ABI, CU_GET_PROC_ADDRESS_DEFAULT,
                         ctypes.byref(found))
            if r != CUDA_SUCCESS or found.value != CU_GET_PROC_ADDRESS_SUCCESS or not ptr.value:
                raise shard_error(-P.E_BACKEND, f"the NVIDIA driver does not provide {name} "
                                                f"(CUresult {r}, status {found.value})")
            self.fn[name] = ctypes.CFUNCTYPE(restype, *argtypes)(ptr.value)
        self.check("cuInit", "start the CUDA driver", 0)

    def error_text(self, code):
        """'CUDA_ERROR_X: its description' of a CUresult, as the driver names it."""
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        if self.fn["cuGetErrorName"](code, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return "an unknown CUresult"
        if self.fn["cuGetErrorString"](code, ctypes.byref(text)) != CUDA_SUCCESS or not text.value:
            return name.value.decode()
        return f"{name.value.decode()}: {text.value.decode()}"

    def error(self, call, code, where):
        """The ShardError of `call` returning CUresult `code` while doing `where`."""
        return shard_error(-errno.ENOMEM if code == CUDA_ERROR_OUT_OF_MEMORY else -P.E_BACKEND,
                           f"{where}: {call} failed: {self.error_text(code)} (CUresult {code})")

    def check(self, call, where, *args):
        r = self.fn[call](*args)
        if r != CUDA_SUCCESS:
            raise self.error(call, r, where)

    def quietly(self, call, *args):
        """A release on a path that already fails or closes: its own error adds nothing."""
        return self.fn[call](*args)

    # ------------------------------------------------------------ contexts
    def device(self, ordinal, where):
        dev = CUdevice()
        self.check("cuDeviceGet", where, ctypes.byref(dev), ordinal)
        return dev.value

    def primary_push(self, dev, where):
        """Retain `dev`'s primary context (the one the CUDA runtime and torch use)
        and make it current on this thread; primary_pop undoes both."""
        ctx = CUcontext()
        self.check("cuDevicePrimaryCtxRetain", where, ctypes.byref(ctx), dev)
        r = self.fn["cuCtxPushCurrent"](ctx)
        if r != CUDA_SUCCESS:
            self.quietly("cuDevicePrimaryCtxRelease", dev)
            raise self.error("cuCtxPushCurrent", r, where)
        return ctx

    def primary_pop(self, dev):
        self.quietly("cuCtxPopCurrent", ctypes.byref(CUcontext()))
        self.quietly("cuDevicePrimaryCtxRelease", dev)


_driver = None
_driver_error = None
_driver_lock = threading.Lock()


def driver():
    """The process's Driver, loaded on first use; a failure is kept and raised
    again (as libshardd's pthread_once)."""
    global _driver, _driver_error
    with _driver_lock:
        if _driver is None and _driver_error is None:
            try:
                _driver = Driver()
            except ShardError as e:
                _driver_error = e
        if _driver_error is not None:
            raise shard_error(_driver_error.code, f"the daemon runs the cuda backend: "
                                                  f"{_driver_error.text}")
        return _driver


# torch dtype -> (__cuda_array_interface__ typestr, element size); bf16 travels as its int16 bits.
def _typestr(dtype):
    import torch
    table = {torch.float32: ("<f4", None), torch.float16: ("<f2", None),
             torch.bfloat16: ("<i2", torch.bfloat16)}
    return table[dtype]


class _DeviceView:
    """A range of a Mapping as an array torch takes without a copy
    (torch.as_tensor reads __cuda_array_interface__ and keeps this object,
    and so the mapping, alive for as long as the tensor lives)."""

    def __init__(self, mapping, ptr, shape, typestr):
        self.mapping = mapping
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (ptr, False), "version": 3, "strides": None,
                                         "stream": None}


class Mapping:
    """One imported buffer: its device address `ptr`, the bytes mapped
    (`size`: the fd kind's rounded size, the ipc kind's exact one), its
    export kind and device. tensor() gives views; close() unmaps once no
    view is alive."""

    def __init__(self, drv, kind, device, ptr, size, dev=None):
        self.drv, self.kind, self.device, self.ptr, self.size = drv, kind, device, ptr, size
        self._dev = dev              # the ipc kind's CUdevice, whose primary context it holds
        self._views = 0
        self._closing = False
        self._lock = threading.Lock()

    def view(self, offset, nbytes, shape, typestr, itemsize):
        """Bytes [offset, offset + nbytes) as an object with
        __cuda_array_interface__ (`shape` of `typestr` elements of
        `itemsize` bytes); the mapping stays until every such view is gone."""
        numel = 1
        for s in shape:
            numel *= s
        if numel == 0 or offset < 0 or nbytes < numel * itemsize or offset + nbytes > self.size:
            raise ValueError(f"view [{offset}, {offset + nbytes}) of {numel} x {itemsize} bytes "
                             f"does not fit the {self.size}-byte cuda buffer")
        with self._lock:
            if self.ptr is None:
                raise ValueError("the cuda buffer is closed")
            view = _DeviceView(self, self.ptr + offset, shape, typestr)
            self._views += 1
        weakref.finalize(view, self._view_gone).atexit = False
        return view

    def tensor(self, offset, nbytes, dtype, shape):
        """A torch tensor of `dtype` and `shape` over bytes [offset, offset +
        nbytes) of the buffer, on its device, no copy."""
        import torch
        device = torch.device("cuda", self.device)
        if any(s == 0 for s in shape):
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        typestr, view_as = _typestr(dtype)
        item = torch.empty((), dtype=dtype).element_size()
        t = torch.as_tensor(self.view(offset, nbytes, shape, typestr, item), device=device)
        return t.view(view_as) if view_as is not None else t

    def _view_gone(self):
        with self._lock:
            self._views -= 1
            last = self._closing and self._views == 0
        if last:
            self._unmap()

    def close(self):
        """Unmap now, or when the last view is gone."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            now = self._views == 0
        if now:
            self._unmap()

    def _unmap(self):
        ptr, self.ptr = self.ptr, None
        if ptr is None:
            return
        d = self.drv
        if self.kind == P.EXPORT_CUDA_IPC:
            # Closed in the context that opened it; then the mapping's retain goes.
            try:
                d.primary_push(self._dev, "close a cuda ipc buffer")
            except Exception:
                d.quietly("cuDevicePrimaryCtxRelease", self._dev)
                return
            d.quietly("cuIpcCloseMemHandle", ptr)
            d.primary_pop(self._dev)
            d.quietly("cuDevicePrimaryCtxRelease", self._dev)
        else:
            d.quietly("cuMemUnmap", ptr, self.size)
            d.quietly("cuMemAddressFree", ptr, self.size)


def _check(device, nbytes, where):
    if device < 0:
        raise shard_error(-errno.EINVAL, f"{where}: the client attached without a CUDA device "
                                         f"(hello.device = {device}); attach with the device the "
                                         f"rank computes on")
    if nbytes <= 0 or nbytes > (1 << 63) // 2:
        raise shard_error(-errno.EINVAL, f"{where}: bad size {nbytes}")


def granularity(drv, device, where):
    """The minimum granularity of a pinned POSIX-fd allocation on `device`:
    the daemon's allocation properties (cuda_vmm_prop), so the one it rounded with."""
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    gran = ctypes.c_size_t()
    drv.check("cuMemGetAllocationGranularity", where, ctypes.byref(gran), ctypes.byref(prop),
              CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    if gran.value == 0:
        raise shard_error(-P.E_BACKEND, f"{where}: device {device} reports an allocation "
                                        f"granularity of 0")
    return gran.value


def import_fd(fd, device, nbytes, drv=None):
    """Map the fd-kind buffer `fd` of `nbytes` on `device`: a Mapping of
    alloc_size(nbytes, granularity) bytes. The fd stays the caller's."""
    where = f"import a cuda buffer of {nbytes} bytes on device {device}"
    _check(device, nbytes, where)
    drv = drv or driver()
    gran = granularity(drv, device, where)
    size = alloc_size(nbytes, gran)
    handle = CUmemGenericAllocationHandle()
    # A POSIX fd handle travels as the fd's value in the pointer argument.
    drv.check("cuMemImportFromShareableHandle", where, ctypes.byref(handle), ctypes.c_void_p(fd),
              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    ptr = CUdeviceptr()
    try:
        drv.check("cuMemAddressReserve", where, ctypes.byref(ptr), size, gran, 0, 0)
        try:
            drv.check("cuMemMap", where, ptr, size, 0, handle, 0)
            access = CUmemAccessDesc()
            access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = device
            access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            try:
                drv.check("cuMemSetAccess", where, ptr, size, ctypes.byref(access), 1)
            except BaseException:
                drv.quietly("cuMemUnmap", ptr, size)
                raise
        except BaseException:
            drv.quietly("cuMemAddressFree", ptr, size)
            raise
    finally:
        # The mapping holds the memory from here (or nothing does): the handle goes.
        drv.quietly("cuMemRelease", handle)
    return Mapping(drv, P.EXPORT_FD, device, ptr.value, size)


def import_ipc(handle, device, nbytes, drv=None):
    """Open the 64-byte legacy IPC handle `handle` (bytes) of a buffer of
    `nbytes` on `device`, in its primary context (retained until closed)."""
    where = f"import a cuda buffer of {nbytes} bytes on device {device}"
    _check(device, nbytes, where)
    if len(handle) != P.CUDA_IPC_HANDLE_SIZE:
        raise shard_error(-P.E_MALFORMED, f"{where}: a CUDA IPC handle of {len(handle)} bytes, "
                                          f"expected {P.CUDA_IPC_HANDLE_SIZE}")
    drv = drv or driver()
    dev = drv.device(device, where)
    # This retain is the mapping's: it keeps the context the memory is mapped in alive.
    ctx = CUcontext()
    drv.check("cuDevicePrimaryCtxRetain", where, ctypes.byref(ctx), dev)
    ptr = CUdeviceptr()
    try:
        drv.check("cuCtxPushCurrent", where, ctx)
        h = CUipcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, P.CUDA_IPC_HANDLE_SIZE)
        # Memory of another device than this rank's is reached through peer access, enabled as needed.
        r = drv.fn["cuIpcOpenMemHandle"](ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        drv.quietly("cuCtxPopCurrent", ctypes.byref(CUcontext()))
        if r != CUDA_SUCCESS:
            raise drv.error("cuIpcOpenMemHandle", r, where)
    except BaseException:
        drv.quietly("cuDevicePrimaryCtxRelease", dev)
        raise
    return Mapping(drv, P.EXPORT_CUDA_IPC, device, ptr.value, nbytes, dev)


class Fences:
    """A client's stream fences on `device` (client/cuda_import.c's struct
    shardd_cuda_fences): `nrecord` interprocess events of its own, one per
    SQ slot, whose handles (`handles`, bytes) go to the daemon in STREAM,
    and the daemon's, one per CQ slot, opened from STREAM_REPLY (open()).
    All live in the device's primary context, where torch's streams are."""

    def __init__(self, device, nrecord, drv=None):
        where = f"stream fences on device {device}"
        if device < 0:
            raise shard_error(-errno.EINVAL, f"{where}: this client attached without a CUDA "
                                             f"device; attach with its stream's device")
        self.drv = drv or driver()
        self.device = device
        self.record_events, self.wait_events = [], []
        self.ctx = None
        self.dev = self.drv.device(device, where)
        ctx = CUcontext()
        self.drv.check("cuDevicePrimaryCtxRetain", where, ctypes.byref(ctx), self.dev)
        self.ctx = ctx
        handles = []
        try:
            with self._current(where):
                for _ in range(nrecord):
                    ev = CUevent()
                    self.drv.check("cuEventCreate", where, ctypes.byref(ev),
                                   CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING)
                    self.record_events.append(ev.value)
                    h = CUipcEventHandle()
                    self.drv.check("cuIpcGetEventHandle", where, ctypes.byref(h), ev)
                    handles.append(bytes(h))
        except BaseException:
            self.close()
            raise
        self.handles = b"".join(handles)

    class _Current:
        def __init__(self, f, where):
            self.f, self.where = f, where

        def __enter__(self):
            self.f.drv.check("cuCtxPushCurrent", self.where, self.f.ctx)

        def __exit__(self, *exc):
            self.f.drv.quietly("cuCtxPopCurrent", ctypes.byref(CUcontext()))

    def _current(self, where):
        return self._Current(self, where)

    def open(self, handles, nwait):
        """Open the daemon's `nwait` events from their handles (bytes)."""
        where = f"stream fences on device {self.device}"
        if len(handles) != nwait * P.CUDA_IPC_HANDLE_SIZE:
            raise shard_error(-errno.EPROTO, f"{where}: {len(handles)} bytes of event handles "
                                             f"for {nwait} events")
        with self._current(where):
            for i in range(nwait):
                h = CUipcEventHandle()
                ctypes.memmove(ctypes.addressof(h), handles[i * P.CUDA_IPC_HANDLE_SIZE:],
                               P.CUDA_IPC_HANDLE_SIZE)
                ev = CUevent()
                self.drv.check("cuIpcOpenEventHandle", f"{where}: the daemon's event of CQ slot {i}",
                               ctypes.byref(ev), h)
                self.wait_events.append(ev.value)

    def record(self, slot, stream):
        """Record our event of SQ slot `slot` on `stream` (a CUstream as an int, 0: legacy default)."""
        where = f"stream fences on device {self.device}"
        with self._current(where):
            self.drv.check("cuEventRecord", f"{where}: record on the client's stream",
                           self.record_events[slot], stream)

    def wait(self, slot, stream):
        """Order after the daemon's event of CQ slot `slot`: `stream` waits on
        it, or the CPU does when `stream` is None (a stream cleared since the
        submission)."""
        where = f"stream fences on device {self.device}"
        if slot >= len(self.wait_events):
            raise shard_error(-errno.EPROTO, f"{where}: the daemon fenced CQ slot {slot}, which "
                                             f"has no event ({len(self.wait_events)} opened)")
        with self._current(where):
            if stream is None:
                self.drv.check("cuEventSynchronize", where, self.wait_events[slot])
            else:
                self.drv.check("cuStreamWaitEvent", where, stream, self.wait_events[slot], 0)

    def close(self):
        """Destroy every event (one that queued work still waits on lives until
        that work is done: the driver's rule), then release the context."""
        if self.ctx is None:
            return
        try:
            with self._current("free stream fences"):
                for ev in self.record_events + self.wait_events:
                    self.drv.quietly("cuEventDestroy", ev)
        except Exception:
            pass
        self.record_events, self.wait_events = [], []
        self.drv.quietly("cuDevicePrimaryCtxRelease", self.dev)
        self.ctx = None
