# SPDX-License-Identifier: MIT
"""The Python client's cuda import (shardd/cuda.py, cuda_group.py,
stream.py) on a machine without a driver: the size rounding against
proto/shardd_cuda.h compiled by cc, the constants, struct layouts and
ctypes signatures against <cuda.h>, and the call sequence of every import,
unmap, fence and failure against a fake libcuda.so.1 (fake_cuda/, built
here with cc against the real cuda.h, so its definitions are cuda.h's
prototypes) that logs each call. The GPU suites (test_torch_cuda.py) run
the same code on a real driver."""

import ctypes
import errno
import gc
import mmap
import os
import re
import shutil
import subprocess
import types

import pytest

import shardd
from shardd import cuda
from shardd import proto as P
from shardd.cuda_group import CudaGroup
from shardd.ring import Ring

from conftest import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
CC = shutil.which("cc") or shutil.which("gcc")


def cuda_include():
    """The folder of the toolkit's cuda.h, or None."""
    for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if d and os.path.exists(os.path.join(d, "include", "cuda.h")):
            return os.path.join(d, "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        d = os.path.join(os.path.dirname(os.path.dirname(nvcc)), "include")
        if os.path.exists(os.path.join(d, "cuda.h")):
            return d
    return None


INC = cuda_include()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler (cc) to build the reference")
needs_cuda_h = pytest.mark.skipif(CC is None or INC is None,
                                  reason="no cuda.h (CUDA toolkit) and cc: the fake driver and the "
                                         "signature checks are built against it")


def build(tmp, source, out, *flags):
    src = os.path.join(tmp, "probe.c")
    if source is not None:
        with open(src, "w") as f:
            f.write(source)
    else:
        src = os.path.join(HERE, "fake_cuda", "fake_libcuda.c")
    path = os.path.join(tmp, out)
    r = subprocess.run([CC, "-Wall", "-Wextra", "-Werror", "-o", path, src, *flags],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return path


# ---------------------------------------------------------------- references

@needs_cc
def test_alloc_size_rounds_as_the_c_header(tmp_path):
    """cuda.alloc_size against shardd_cuda_alloc_size compiled from proto/shardd_cuda.h."""
    exe = build(str(tmp_path), """
#include <inttypes.h>
#include <stdio.h>
#include "shardd_cuda.h"
int main(void)
{
	unsigned long long b, g;
	while (scanf("%llu %llu", &b, &g) == 2)
		printf("%" PRIu64 "\\n", shardd_cuda_alloc_size(b, g));
	return 0;
}
""", "round", "-I" + os.path.join(ROOT, "proto"))
    two_mib = 2 << 20
    cases = [(b, g) for g in (1, 4096, 65536, two_mib, 3 << 20)
             for b in (1, 2, g - 1, g, g + 1, 7 * g - 1, 7 * g, 123456789, (1 << 62) - 1)
             if b >= 1]
    out = subprocess.run([exe], input="".join(f"{b} {g}\n" for b, g in cases),
                         capture_output=True, text=True, timeout=30, check=True).stdout.split()
    assert [cuda.alloc_size(b, g) for b, g in cases] == [int(x) for x in out]
    assert cuda.alloc_size(1, two_mib) == two_mib and cuda.alloc_size(two_mib + 1, two_mib) == 2 * two_mib


@needs_cuda_h
def test_constants_and_struct_layouts_are_cuda_hs(tmp_path):
    consts = ["CUDA_SUCCESS", "CUDA_ERROR_OUT_OF_MEMORY", "CU_GET_PROC_ADDRESS_DEFAULT",
              "CU_GET_PROC_ADDRESS_SUCCESS", "CU_MEM_ALLOCATION_TYPE_PINNED",
              "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", "CU_MEM_LOCATION_TYPE_DEVICE",
              "CU_MEM_ALLOC_GRANULARITY_MINIMUM", "CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
              "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS", "CU_EVENT_DISABLE_TIMING",
              "CU_EVENT_INTERPROCESS"]
    layouts = {"CUmemLocation": ("type", "id"),
               "CUmemAllocationProp": ("type", "requestedHandleTypes", "location",
                                       "win32HandleMetaData", "allocFlags"),
               "CUmemAccessDesc": ("location", "flags"),
               "CUipcMemHandle": ("reserved",), "CUipcEventHandle": ("reserved",)}
    lines = [f'printf("{c} %lld\\n", (long long){c});' for c in consts]
    for t, fields in layouts.items():
        lines.append(f'printf("{t} %zu\\n", sizeof({t}));')
        lines += [f'printf("{t}.{f} %zu\\n", offsetof({t}, {f}));' for f in fields]
    lines += [f'printf("{t} %zu\\n", sizeof({t}));' for t in
              ("CUdeviceptr", "CUmemGenericAllocationHandle", "CUdevice", "CUresult")]
    exe = build(str(tmp_path), "#include <cuda.h>\n#include <stddef.h>\n#include <stdio.h>\n"
                "int main(void) {\n" + "\n".join(lines) + "\nreturn 0; }\n", "consts", "-I" + INC)
    ref = dict(line.split() for line in subprocess.run(
        [exe], capture_output=True, text=True, timeout=30, check=True).stdout.splitlines())
    for c in consts:
        assert getattr(cuda, c) == int(ref[c]), c
    for t, fields in layouts.items():
        cls = getattr(cuda, t)
        assert ctypes.sizeof(cls) == int(ref[t]), t
        for f in fields:
            assert getattr(cls, f).offset == int(ref[f"{t}.{f}"]), f"{t}.{f}"
    for t in ("CUdeviceptr", "CUmemGenericAllocationHandle", "CUdevice", "CUresult"):
        assert ctypes.sizeof(getattr(cuda, t)) == int(ref[t]), t


# How cuda.h spells each parameter type, as ctypes.
C_TYPES = {
    "CUresult": cuda.CUresult, "const char **": ctypes.POINTER(ctypes.c_char_p),
    "unsigned int": ctypes.c_uint, "int": ctypes.c_int, "CUdevice": cuda.CUdevice,
    "CUdevice *": ctypes.POINTER(cuda.CUdevice), "CUcontext": cuda.CUcontext,
    "CUcontext *": ctypes.POINTER(cuda.CUcontext), "size_t": ctypes.c_size_t,
    "size_t *": ctypes.POINTER(ctypes.c_size_t),
    "const CUmemAllocationProp *": ctypes.POINTER(cuda.CUmemAllocationProp),
    "CUmemAllocationGranularity_flags": ctypes.c_int,
    "CUmemGenericAllocationHandle": cuda.CUmemGenericAllocationHandle,
    "CUmemGenericAllocationHandle *": ctypes.POINTER(cuda.CUmemGenericAllocationHandle),
    "void *": ctypes.c_void_p, "CUmemAllocationHandleType": ctypes.c_int,
    "CUdeviceptr": cuda.CUdeviceptr, "CUdeviceptr *": ctypes.POINTER(cuda.CUdeviceptr),
    "unsigned long long": ctypes.c_ulonglong,
    "const CUmemAccessDesc *": ctypes.POINTER(cuda.CUmemAccessDesc),
    "CUipcMemHandle": cuda.CUipcMemHandle, "CUipcEventHandle": cuda.CUipcEventHandle,
    "CUipcEventHandle *": ctypes.POINTER(cuda.CUipcEventHandle), "CUevent": cuda.CUevent,
    "CUevent *": ctypes.POINTER(cuda.CUevent), "CUstream": cuda.CUstream,
}


@needs_cuda_h
def test_ctypes_signatures_are_cuda_hs_prototypes():
    """Each call's restype and argtypes against its prototype in cuda.h:
    a missing, extra or mistyped argument is a wrong call through ctypes."""
    with open(os.path.join(INC, "cuda.h")) as f:
        header = f.read()
    for name, (restype, argtypes) in cuda.SIGNATURES.items():
        m = re.search(r"^(\w+) CUDAAPI " + name + r"\(([^)]*)\);", header, re.M)
        assert m, f"{name} has no prototype in cuda.h"
        assert restype is C_TYPES[m.group(1)], name
        params = [re.sub(r"\s*\b\w+$", "", p.strip()).replace(" *", " *").strip()
                  for p in m.group(2).split(",")]
        params = [re.sub(r"\s+\*", " *", p) for p in params]
        assert len(params) == len(argtypes), f"{name}: cuda.h has {params}"
        for i, (c, t) in enumerate(zip(params, argtypes)):
            assert C_TYPES[c] is t or C_TYPES[c] == t, f"{name} argument {i}: cuda.h {c}"


# ---------------------------------------------------------------- the fake driver

@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """(the fake libcuda's path, a ctypes handle on it, a Driver over it)."""
    if CC is None or INC is None:
        pytest.skip("no cuda.h (CUDA toolkit) and cc: the fake driver is built against it")
    path = build(str(tmp_path_factory.mktemp("fakecuda")), None, "libcuda.so.1", "-shared",
                 "-fPIC", "-I" + INC, "-lpthread")
    lib = ctypes.CDLL(path)
    lib.fake_cuda_log.restype = ctypes.c_char_p
    lib.fake_cuda_fail.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.fake_cuda_set_granularity.argtypes = [ctypes.c_size_t]
    drv = cuda.Driver(path)
    return types.SimpleNamespace(path=path, lib=lib, drv=drv)


@pytest.fixture
def drv(fake, monkeypatch):
    """The fake Driver as the process's driver, its log and failures cleared."""
    fake.lib.fake_cuda_reset()
    fake.lib.fake_cuda_set_granularity(2 << 20)
    monkeypatch.setattr(cuda, "_driver", fake.drv)
    monkeypatch.setattr(cuda, "_driver_error", None)
    yield fake
    assert live(fake) == [0] * 6, "the test left driver objects held"


def calls(fake):
    """The log since the last reset, one call a line."""
    return fake.lib.fake_cuda_log().decode().splitlines()


def live(fake):
    out = (ctypes.c_int * 6)()
    fake.lib.fake_cuda_live(out)
    return list(out)


def memfd(size):
    fd = os.memfd_create("buf")
    os.ftruncate(fd, size)
    return fd


def test_driver_resolves_every_signature_through_cuGetProcAddress(drv):
    """Each entry point's ctypes function carries SIGNATURES' types (the fake
    resolves only at ABI 12000 with the default search, as libshardd asks)."""
    assert set(drv.drv.fn) == set(cuda.SIGNATURES)
    for name, (restype, argtypes) in cuda.SIGNATURES.items():
        fn = drv.drv.fn[name]
        assert fn.restype is restype and list(fn.argtypes) == argtypes, name


def test_a_missing_driver_is_an_error_naming_the_library(tmp_path):
    with pytest.raises(shardd.ShardError) as ei:
        cuda.Driver(str(tmp_path / "libcuda.so.1"))
    assert ei.value.code == -P.E_BACKEND and "no NVIDIA driver: dlopen" in ei.value.text


def test_the_process_driver_is_loaded_once_and_its_absence_said_each_time(monkeypatch):
    """driver() loads libcuda.so.1 on first use, never at import, and keeps
    a failure (as libshardd's pthread_once): every later call says it again."""
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has libcuda.so.1: its absence cannot be shown here")
    except OSError:
        pass
    monkeypatch.setattr(cuda, "_driver", None)
    monkeypatch.setattr(cuda, "_driver_error", None)
    texts = []
    for _ in range(2):
        with pytest.raises(shardd.ShardError) as ei:
            cuda.driver()
        texts.append(ei.value.text)
    assert ei.value.code == -P.E_BACKEND and texts[0] == texts[1]
    assert texts[0].startswith("the daemon runs the cuda backend: no NVIDIA driver: dlopen "
                               "libcuda.so.1")


def test_fd_buffer_is_imported_mapped_at_the_rounded_size_and_released_on_close(drv):
    fd = memfd(5 << 20)
    m = cuda.import_fd(fd, 0, (4 << 20) + 1)
    os.close(fd)
    assert m.kind == P.EXPORT_FD and m.size == 6 << 20 and m.ptr
    m.close()
    log = calls(drv)
    ptr = log[2].split("-> ")[1]
    handle = log[1].split("handle=")[1]
    assert log == [
        "cuMemGetAllocationGranularity type=1 handles=1 loc=1:0 win32=(nil) option=0",
        f"cuMemImportFromShareableHandle fd_size=5242880 type=1 -> handle={handle}",
        f"cuMemAddressReserve size=6291456 align=2097152 addr=0 flags=0 -> {ptr}",
        f"cuMemMap ptr={ptr} size=6291456 offset=0 handle={handle} flags=0",
        f"cuMemSetAccess ptr={ptr} size=6291456 loc=1:0 flags=3 count=1",
        f"cuMemRelease handle={handle}",
        f"cuMemUnmap ptr={ptr} size=6291456",
        f"cuMemAddressFree ptr={ptr} size=6291456",
    ]


def test_ipc_buffer_is_opened_and_closed_in_the_devices_primary_context(drv):
    m = cuda.import_ipc(b"IPCHANDLE-of-buf" + bytes(48), 0, 1000)
    assert m.kind == P.EXPORT_CUDA_IPC and m.size == 1000
    assert live(drv)[0] == 1, "the mapping holds a retain of the primary context"
    m.close()
    log = calls(drv)
    ptr = log[3].split("-> ")[1]
    assert log == [
        "cuDeviceGet ordinal=0", "cuDevicePrimaryCtxRetain dev=0", "cuCtxPushCurrent ctx=0xc000",
        f"cuIpcOpenMemHandle handle=IPCHANDLE-of-buf flags=1 depth=1 -> {ptr}", "cuCtxPopCurrent",
        "cuDevicePrimaryCtxRetain dev=0", "cuCtxPushCurrent ctx=0xc000",
        f"cuIpcCloseMemHandle ptr={ptr} depth=1", "cuCtxPopCurrent",
        "cuDevicePrimaryCtxRelease dev=0", "cuDevicePrimaryCtxRelease dev=0"]


@pytest.mark.parametrize("failing, undone", [
    ("cuMemImportFromShareableHandle", []),
    ("cuMemAddressReserve", ["cuMemRelease"]),
    ("cuMemMap", ["cuMemAddressFree", "cuMemRelease"]),
    ("cuMemSetAccess", ["cuMemUnmap", "cuMemAddressFree", "cuMemRelease"]),
])
def test_a_failed_import_step_undoes_the_steps_before_it(drv, failing, undone):
    """As libshardd's goto ladder: in reverse order, and the error names the call and the code."""
    fd = memfd(2 << 20)
    drv.lib.fake_cuda_fail(failing.encode(), 2)
    with pytest.raises(shardd.ShardError) as ei:
        cuda.import_fd(fd, 0, 100)
    os.close(fd)
    assert ei.value.code == -errno.ENOMEM
    assert ei.value.text == (f"import a cuda buffer of 100 bytes on device 0: {failing} failed: "
                             f"CUDA_ERROR_OUT_OF_MEMORY: out of memory (CUresult 2)")
    log = [line.split()[0] for line in calls(drv)]
    assert log[log.index(failing) + 1:] == undone


def test_an_unknown_cuResult_is_named_by_its_number(drv):
    drv.lib.fake_cuda_fail(b"cuIpcOpenMemHandle", 999)
    with pytest.raises(shardd.ShardError) as ei:
        cuda.import_ipc(bytes(64), 0, 64)
    assert ei.value.code == -P.E_BACKEND
    assert ei.value.text.endswith("cuIpcOpenMemHandle failed: an unknown CUresult (CUresult 999)")


def test_import_without_a_device_or_of_a_bad_handle_is_refused_before_the_driver(drv):
    with pytest.raises(shardd.ShardError) as ei:
        cuda.import_fd(0, -1, 64)
    assert ei.value.code == -errno.EINVAL and "hello.device = -1" in ei.value.text
    with pytest.raises(shardd.ShardError) as ei:
        cuda.import_ipc(bytes(63), 0, 64)
    assert ei.value.code == -P.E_MALFORMED and "63 bytes, expected 64" in ei.value.text
    assert calls(drv) == []


def test_a_mapping_closed_while_viewed_is_unmapped_when_the_last_view_goes(drv):
    fd = memfd(2 << 20)
    m = cuda.import_fd(fd, 0, 4096)
    os.close(fd)
    a = m.view(64, 128, (32,), "<f4", 4)
    b = m.view(0, 4096, (2, 1024), "<f2", 2)
    assert a.__cuda_array_interface__ == {"shape": (32,), "typestr": "<f4", "data": (m.ptr + 64, False),
                                          "version": 3, "strides": None, "stream": None}
    with pytest.raises(ValueError):
        m.view(m.size - 2, 4, (1,), "<f4", 4)      # past the mapping
    m.close()
    del a
    gc.collect()
    assert not any(line.startswith("cuMemUnmap") for line in calls(drv))
    del b
    gc.collect()
    assert [line.split()[0] for line in calls(drv)][-2:] == ["cuMemUnmap", "cuMemAddressFree"]


def test_fences_record_and_wait_on_the_events_of_their_slots(drv):
    f = cuda.Fences(0, 4)
    assert len(f.handles) == 4 * 64
    f.open(f.handles[:2 * 64] + b"daemon-ev-2" + bytes(53) + b"daemon-ev-3" + bytes(53), 4)
    f.record(2, 0x5151)
    f.wait(3, 0x5151)
    f.wait(1, None)
    with pytest.raises(shardd.ShardError) as ei:
        f.wait(4, 0x5151)
    assert ei.value.code == -errno.EPROTO and "CQ slot 4" in ei.value.text
    f.close()
    log = calls(drv)
    created = [line.split("-> ")[1] for line in log if line.startswith("cuEventCreate")]
    opened = [line.split("-> ")[1] for line in log if line.startswith("cuIpcOpenEventHandle")]
    assert all("flags=6 depth=1" in line for line in log if line.startswith("cuEventCreate"))
    assert "cuIpcOpenEventHandle handle=daemon-ev-3 depth=1 -> " + opened[3] in log
    i = log.index(f"cuEventRecord {created[2]} stream=0x5151 depth=1")
    assert log[i - 1:i + 2] == ["cuCtxPushCurrent ctx=0xc000", log[i], "cuCtxPopCurrent"]
    assert f"cuStreamWaitEvent stream=0x5151 {opened[3]} flags=0 depth=1" in log
    assert f"cuEventSynchronize {opened[1]} depth=1" in log
    assert sorted(line.split()[1] for line in log if line.startswith("cuEventDestroy")) == \
        sorted(created + opened)
    assert log[-1] == "cuDevicePrimaryCtxRelease dev=0"


def test_fences_refuse_handles_of_the_wrong_length(drv):
    f = cuda.Fences(0, 2)
    with pytest.raises(shardd.ShardError) as ei:
        f.open(bytes(64 * 2 - 1), 2)
    assert ei.value.code == -errno.EPROTO
    f.close()


# ---------------------------------------------------------------- GROUP replies

LAYOUTS = [P.PARAM_LAYOUT.pack(0, 40, 0, 40, 0, 24, 0, 3),       # w: fp32 [5, 2], rows 0..2
           P.PARAM_LAYOUT.pack(64, 12, 64, 12, 64, 12, 0, 3)]     # b: fp32 [3]
SPECS = [P.PARAM_SPEC.pack(b"w", P.DTYPE_FP32, 2, 0, 0, 5, 2, 0, 0, 0, 0, 0, 0),
         P.PARAM_SPEC.pack(b"b", P.DTYPE_FP32, 1, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0)]
SIZES = (128, 128, 76)


def reply(kinds, nhandles=None, exec=P.EXEC_DAEMON):
    """A GROUP reply of two params, export kinds `kinds`, and one 64-byte handle
    per CUDA_IPC buffer ('ipc-handle-<i>'), built as the daemon does."""
    head = P.GROUP_REPLY.pack(7, 2, P.DTYPE_NONE, P.DTYPE_NONE, P.DTYPE_FP32, 2, *SIZES,
                              bytes(kinds), 0, 3, 4, exec, 0)
    ipc = [i for i, k in enumerate(kinds) if k == P.EXPORT_CUDA_IPC]
    if nhandles is not None:
        ipc = ipc[:nhandles]
    handles = b"".join(f"ipc-handle-{i}".encode().ljust(64, b"\0") for i in ipc)
    return head + b"".join(LAYOUTS) + b"".join(SPECS) + handles


def cuda_client(device=0):
    return types.SimpleNamespace(backend=P.BACKEND_CUDA, daemon_minor=P.PROTO_MINOR, device=device)


@pytest.mark.parametrize("kinds", [(0, 0, 0, 0), (1, 1, 1, 1), (1, 0, 1, 0)],
                         ids=["fd", "ipc", "mixed"])
def test_group_reply_of_each_kind_imports_every_buffer_in_buffer_order(drv, kinds):
    fds = [memfd((2 << 20) + 4096 * i) for i, k in enumerate(kinds) if k == P.EXPORT_FD]
    g = CudaGroup(cuda_client(), "g", reply(kinds), list(fds), None, "register group 'g'")
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)       # the reply's fds are closed once imported
    assert (g.id, g.nparams, g.last_step, g.peer_last_step) == (7, 2, 3, 4)
    assert [p.name for p in g.params] == ["w", "b"] and g.params[0].shape == (5, 2)
    sizes = SIZES + (SIZES[2],)
    for i, (kind, m) in enumerate(zip(kinds, g.maps)):
        assert m.kind == kind and m.device == 0
        assert m.size == (2 << 20 if kind == P.EXPORT_FD else sizes[i])
    log = calls(drv)
    opened = [line.split()[1] for line in log if line.startswith("cuIpcOpenMemHandle")]
    assert opened == [f"handle=ipc-handle-{i}" for i, k in enumerate(kinds) if k]
    imported = [line.split()[1] for line in log if line.startswith("cuMemImportFromShareableHandle")]
    assert imported == [f"fd_size={(2 << 20) + 4096 * i}" for i, k in enumerate(kinds) if not k]
    g.close()


@pytest.mark.parametrize("kinds, fds, nhandles, exec, code, text", [
    ((0, 0, 0, 0), 3, None, P.EXEC_DAEMON, P.E_MALFORMED, "carries 3 fds, but its export_kind"),
    ((1, 0, 0, 0), 4, None, P.EXEC_DAEMON, P.E_MALFORMED, "carries 4 fds"),
    ((1, 1, 0, 0), 2, 1, P.EXEC_DAEMON, P.E_MALFORMED, "and 2 CUDA IPC handles, expected"),
    ((0, 0, 2, 0), 4, None, P.EXEC_DAEMON, P.E_MALFORMED, "export_kind[2] = 2 is not an export kind"),
    ((0, 0, 0, 0), 5, None, P.EXEC_RANKS, P.E_MALFORMED, "exec = ranks, which the cuda backend"),
])
def test_a_malformed_cuda_group_reply_is_refused_naming_the_field(drv, kinds, fds, nhandles, exec,
                                                                  code, text):
    fds = [memfd(2 << 20) for _ in range(fds)]
    with pytest.raises(shardd.ShardError) as ei:
        CudaGroup(cuda_client(), "g", reply(kinds, nhandles, exec), fds, None, "open group 'g'")
    assert ei.value.code == -code and text in ei.value.text, ei.value.text
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_failed_import_unmaps_the_buffers_imported_before_it(drv):
    drv.lib.fake_cuda_fail(b"cuIpcOpenMemHandle", 2)
    fds = [memfd(2 << 20) for _ in range(3)]
    with pytest.raises(shardd.ShardError) as ei:
        CudaGroup(cuda_client(), "g", reply((0, 0, 1, 0)), fds, None, "register group 'g'")
    assert ei.value.code == -errno.ENOMEM
    assert "register group 'g': buffer 2 (cuda ipc): import a cuda buffer of 76 bytes" in ei.value.text
    assert sum(line.startswith("cuMemUnmap") for line in calls(drv)) == 2


def test_a_dead_daemon_is_said_to_take_the_ipc_buffers_along(drv):
    """fd-kind buffers outlive the daemon (the client's mapping holds them);
    ipc-kind ones were its memory: a DaemonGone says so, naming the groups."""
    fds = [memfd(2 << 20) for _ in range(4)]
    fd_group = CudaGroup(cuda_client(), "fdg", reply((0, 0, 0, 0)), fds, None, "open group 'fdg'")
    ipc_group = CudaGroup(cuda_client(), "ipcg", reply((0, 1, 0, 0)),
                          [memfd(2 << 20) for _ in range(3)], None, "open group 'ipcg'")
    c = types.SimpleNamespace(daemon_code=0, daemon_pid=4242, groups=[fd_group])
    text = str(shardd.Client._detached_error(c, "unshard(step 3)"))
    assert text.endswith("is gone or dropped this client [ECONNRESET]")
    c.groups.append(ipc_group)
    err = shardd.Client._detached_error(c, "unshard(step 3)")
    assert isinstance(err, shardd.DaemonGone)
    assert "the cuda ipc buffers of groups ['ipcg'] were the daemon's memory" in err.text
    fd_group.close()
    ipc_group.close()


def test_a_cuda_group_needs_the_client_to_name_a_device(drv):
    with pytest.raises(shardd.ShardError) as ei:
        CudaGroup(cuda_client(-1), "g", reply((0, 0, 0, 0)), [memfd(64) for _ in range(4)], None,
                  "register group 'g'")
    assert ei.value.code == -errno.EINVAL and "pass device= to Client" in ei.value.text


# ---------------------------------------------------------------- fences on the ring

def ring(entries=4):
    """A ring region laid out as the daemon lays it out (shardd_ring_init)."""
    size = P.ring_region_size(entries, entries)
    mem = mmap.mmap(-1, size)
    u32 = memoryview(mem).cast("I")
    for off, v in ((P.RH_MAGIC, P.RING_MAGIC), (P.RH_SQ_ENTRIES, entries),
                   (P.RH_CQ_ENTRIES, entries), (P.RH_SQ_OFF, P.RING_HDR_SIZE),
                   (P.RH_CQ_OFF, P.RING_HDR_SIZE + entries * P.SQE.size),
                   (P.RH_MSG_OFF, P.RING_HDR_SIZE + entries * (P.SQE.size + P.CQE.size)),
                   (P.RH_MSG_SIZE, P.RING_MSG_SIZE), (P.RH_VERSION, P.PROTO_MAJOR << 16)):
        u32[off // 4] = v
    u32.release()
    return mem, Ring(mem, size)


def test_a_fenced_entry_carries_its_fence_bits_in_sqe_fence():
    mem, r = ring()
    assert r.sq_next_slot() == 0
    assert r.sq_push(P.OP_UNSHARD, 3, 9, 77, 0, (0, 0), P.FENCE_WAIT | P.FENCE_SIGNAL)
    assert r.sq_next_slot() == 1
    raw = mem[P.RING_HDR_SIZE:P.RING_HDR_SIZE + P.SQE.size]
    assert raw[0] == P.OP_UNSHARD and raw[1] == 3 and raw[2:4] == b"\0\0"
    for _ in range(3):
        r.sq_push(P.OP_NOP, 0, 0, 0, 0)
    assert r.sq_next_slot() is None and not r.sq_push(P.OP_NOP, 0, 0, 0, 0)
    r.release()


def test_a_fenced_completion_is_ordered_before_its_slot_goes_back():
    mem, r = ring()
    cq_off = P.RING_HDR_SIZE + 4 * P.SQE.size
    seen = []

    def on_fence(slot):
        # The slot is still the client's: cq_head has not moved yet.
        seen.append((slot, memoryview(mem).cast("I")[P.RH_CQ_HEAD // 4]))
        return None

    for slot, fence in ((0, 1), (1, 0), (2, 1)):
        P.CQE.pack_into(mem, cq_off + slot * P.CQE.size, 50 + slot, 0, P.OP_UNSHARD, 0, fence, 3, 0,
                        9, 0, 0, 0, 0)
    memoryview(mem).cast("I")[P.RH_CQ_TAIL // 4] = 3
    got = [r.cq_pop(on_fence) for _ in range(3)]
    assert [c.user_data for c in got] == [50, 51, 52] and seen == [(0, 0), (2, 2)]
    # An ordering that failed fails the op; a fence without a stream is a protocol error.
    P.CQE.pack_into(mem, cq_off + 3 * P.CQE.size, 53, 0, P.OP_REDUCE, 0, 1, 3, 0, 9, 0, 0, 0, 0)
    P.CQE.pack_into(mem, cq_off, 54, 0, P.OP_REDUCE, 0, 1, 3, 0, 9, 0, 0, 0, 0)
    memoryview(mem).cast("I")[P.RH_CQ_TAIL // 4] = 5
    c = r.cq_pop(lambda slot: (-P.E_BACKEND, f"slot {slot} cannot be ordered"))
    assert (c.res, c.msg) == (-P.E_BACKEND, "slot 3 cannot be ordered")
    c = r.cq_pop()
    assert c.res == -errno.EPROTO and "set up no stream" in c.msg
    r.release()


def test_set_stream_on_the_host_backend_is_refused_naming_it(daemon, request):
    from conftest import job_name
    with shardd.Client(job_name(request), 0, 1, socket_path=daemon.socket) as c:
        with pytest.raises(shardd.ShardError) as ei:
            c.set_stream(0)
        assert ei.value.code == -errno.ENOTSUP and "host backend" in ei.value.text
        with pytest.raises(TypeError):
            c.set_stream("stream 0")
        c.nop()
