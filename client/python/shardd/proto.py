# SPDX-License-Identifier: MIT
"""The shardd protocol in Python: constants, enumerations and the fixed
little-endian layouts of proto/shardd_proto.h.

Every layout below is a :mod:`struct` format whose size is checked against the
C header's ``_Static_assert`` at import time, so a drift between the two is an
ImportError, not a silent corruption.
"""

import errno as _errno
import os as _os
import struct

MAGIC = 0x44524853        # "SHRD"
RING_MAGIC = 0x474E4952   # "RING"
PROTO_MAJOR = 1
PROTO_MINOR = 5

NAME_MAX = 64
PARAM_NAME_MAX = 80
MAX_DIMS = 8
MAX_WORLD = 1024
MAX_PARAMS = 65536
ALIGN = 64

CTRL_CHUNK = 60 * 1024
CTRL_MAX = 64 * 1024 * 1024
CTRL_MAX_FDS = 8

RING_ENTRIES_DEFAULT = 1024
RING_MSG_SIZE = 256
CACHELINE = 64

HELLO_DEVICE_HOST = -1

# enum shardd_dtype
DTYPE_NONE = 0
DTYPE_FP32 = 1
DTYPE_BF16 = 2
DTYPE_FP16 = 3
DTYPE_COUNT = 4

DTYPE_NAMES = {DTYPE_NONE: "none", DTYPE_FP32: "fp32", DTYPE_BF16: "bf16", DTYPE_FP16: "fp16"}
DTYPE_SIZES = {DTYPE_FP32: 4, DTYPE_BF16: 2, DTYPE_FP16: 2}

# enum shardd_backend
BACKEND_HOST = 1
BACKEND_CUDA = 2

# enum shardd_export_kind: how each buffer of a GROUP reply travels
EXPORT_FD = 0        # an fd in SCM_RIGHTS (every buffer of the host backend)
EXPORT_CUDA_IPC = 1  # no fd: a 64-byte CUDA IPC handle after the param specs
EXPORT_NAMES = {EXPORT_FD: "fd", EXPORT_CUDA_IPC: "cuda ipc"}
GROUP_BUFS = 4       # unsharded, grad, flat shard, sharded grad
CUDA_IPC_HANDLE_SIZE = 64

# enum shardd_op
OP_NOP = 1
OP_BARRIER = 2
OP_UNSHARD = 3
OP_REDUCE = 4
OP_RESHARD = 5
OP_ZERO_GRAD = 6
OP_STEP = 7
OP_GRAD_NORM = 8
OP_CHECKPOINT = 9
OP_COUNT = 10

OP_NAMES = {OP_NOP: "nop", OP_BARRIER: "barrier", OP_UNSHARD: "unshard",
            OP_REDUCE: "reduce", OP_RESHARD: "reshard", OP_ZERO_GRAD: "zero_grad", OP_STEP: "step",
            OP_GRAD_NORM: "grad_norm", OP_CHECKPOINT: "checkpoint"}

REDUCE_ALL_REDUCE = 1 << 0
REDUCE_STEP = 1 << 1          # step each shard after the reduce (lr in sqe.arg[0])
REDUCE_FLAGS_MASK = REDUCE_ALL_REDUCE | REDUCE_STEP

# SHARDD_OP_STEP: flags, results (cqe.res >= 0), optimizers (struct shardd_optim_config)
STEP_SKIP_NONFINITE = 1 << 0
STEP_CLIP = 1 << 1
STEP_CLIP_JOB = 1 << 2            # sqe.arg[1] is max_norm; the job's grad_norm of the step gives the coefficient
STEP_SKIP_JOB_NONFINITE = 1 << 3  # skip on every rank when the job's grad_norm of the step was non-finite
STEP_REPLAY = 1 << 4              # as another rank of the group submitted this step (alone, lr 0)
STEP_APPLIED, STEP_SKIPPED, STEP_ALREADY = 0, 1, 2
STEP_RESULT_NAMES = {STEP_APPLIED: "applied", STEP_SKIPPED: "skipped", STEP_ALREADY: "already applied"}
OPTIM_NONE, OPTIM_SGD, OPTIM_ADAMW = 0, 1, 2
OPTIM_NESTEROV, OPTIM_MAXIMIZE, OPTIM_AMSGRAD = 1 << 0, 1 << 1, 1 << 2
REGISTER_OPTIMIZER = 1 << 0

# enum shardd_error
E_BASE = 1000
E_MAGIC = 1001
E_VERSION = 1002
E_MALFORMED = 1003
E_PERM = 1004
E_RANK_TAKEN = 1005
E_MESH = 1006
E_INVALID = 1007
E_TIMEOUT = 1008
E_PEER_DIED = 1009
E_MISMATCH = 1010
E_SHUTDOWN = 1011
E_NOGROUP = 1012
E_STATE = 1013
E_NOMEM = 1014
E_BACKEND = 1015
E_NOJOB = 1016

ERROR_NAMES = {
    E_MAGIC: "SHARDD_E_MAGIC", E_VERSION: "SHARDD_E_VERSION",
    E_MALFORMED: "SHARDD_E_MALFORMED", E_PERM: "SHARDD_E_PERM",
    E_RANK_TAKEN: "SHARDD_E_RANK_TAKEN", E_MESH: "SHARDD_E_MESH",
    E_INVALID: "SHARDD_E_INVALID", E_TIMEOUT: "SHARDD_E_TIMEOUT",
    E_PEER_DIED: "SHARDD_E_PEER_DIED", E_MISMATCH: "SHARDD_E_MISMATCH",
    E_SHUTDOWN: "SHARDD_E_SHUTDOWN", E_NOGROUP: "SHARDD_E_NOGROUP",
    E_STATE: "SHARDD_E_STATE", E_NOMEM: "SHARDD_E_NOMEM",
    E_BACKEND: "SHARDD_E_BACKEND", E_NOJOB: "SHARDD_E_NOJOB",
}

# enum shardd_msg_type
MSG_HELLO = 1
MSG_WELCOME = 2
MSG_ERROR = 3
MSG_GOODBYE = 4
MSG_REGISTER_GROUP = 5
MSG_OPEN_GROUP = 6
MSG_GROUP = 7
MSG_ADMIN = 8
MSG_ADMIN_REPLY = 9
MSG_STREAM = 10         # cuda backend: the client's fence events (PROTOCOL.md 5.7)
MSG_STREAM_REPLY = 11   # the daemon's fence events
MSG_EXEC_MAP = 12        # minor 5: rank-executed groups' mappings (PROTOCOL.md 3.8)
MSG_EXEC_MAP_REPLY = 13

MSG_NAMES = {MSG_HELLO: "HELLO", MSG_WELCOME: "WELCOME", MSG_ERROR: "ERROR",
             MSG_GOODBYE: "GOODBYE", MSG_REGISTER_GROUP: "REGISTER_GROUP",
             MSG_OPEN_GROUP: "OPEN_GROUP", MSG_GROUP: "GROUP", MSG_ADMIN: "ADMIN",
             MSG_ADMIN_REPLY: "ADMIN_REPLY", MSG_STREAM: "STREAM",
             MSG_STREAM_REPLY: "STREAM_REPLY", MSG_EXEC_MAP: "EXEC_MAP",
             MSG_EXEC_MAP_REPLY: "EXEC_MAP_REPLY"}

# enum shardd_exec: who moves a group's bytes (register_group.exec, group_reply.exec; minor 5)
EXEC_AUTO = 0     # the daemon picks: ranks up to shardd --rank-exec-max, else daemon
EXEC_DAEMON = 1   # the daemon runs unshard, reduce and reshard on its worker pool
EXEC_RANKS = 2    # each rank runs them in its own process, on the job's buffers (exec.py)
EXEC_COUNT = 3
EXEC_NAMES = {EXEC_AUTO: "auto", EXEC_DAEMON: "daemon", EXEC_RANKS: "ranks"}

INIT_ZERO = 0
INIT_RESTORE = 1
RESTORE_PATH_MAX = 4096
RESTORE = struct.Struct("<II")  # path_len rsvd, then the path

# sqe.fence: ordering with the client's CUDA stream (after MSG_STREAM; PROTOCOL.md 5.7)
FENCE_WAIT = 1 << 0     # the op waits on the client's event of its SQ slot
FENCE_SIGNAL = 1 << 1   # complete when queued; the daemon records its event of the CQ slot

# ring flags (written by the daemon)
RING_NEED_WAKEUP = 1 << 0
RING_DEAD = 1 << 1

# ---------------------------------------------------------------- layouts

MSG_HDR = struct.Struct("<IHHII")                 # magic type flags length seq
HELLO = struct.Struct("<HHI64sIIIiII16s")         # major minor pid job rank replicate shard device sq_entries flags rsvd
WELCOME = struct.Struct("<HHIIIIIQII24s")         # major minor client_id backend sq cq daemon_pid ring_size timeout rsvd0 rsvd
ERROR_MSG = struct.Struct("<iI")                  # code msg_len
PARAM_SPEC = struct.Struct("<80sIIII8Q")          # name dtype ndim shard_dim flags shape[8]
REGISTER_GROUP = struct.Struct("<64sIIIIII")      # name nparams param_dtype reduce_dtype init flags exec
OPEN_GROUP = struct.Struct("<64s")
PARAM_LAYOUT = struct.Struct("<8Q")               # see ParamLayout
GROUP_REPLY = struct.Struct("<IIIIIIQQQ4sIQQII")  # ... shard_size export_kind[4] optimizer last_step peer_last_step exec rsvd
GROUP_REPLY_V4 = struct.Struct("<IIIIIIQQQ4sIQQ")   # minor 4: without exec
GROUP_REPLY_V3 = struct.Struct("<IIIIIIQQQ4sIQ")    # minor < 4: without peer_last_step either
EXEC_MAP = struct.Struct("<II")                     # group_id peer
EXEC_MAP_REPLY = struct.Struct("<IIIIQQ")           # group_id peer gen nfds shard_map_size grad_map_size
OPTIM_CONFIG = struct.Struct("<II6d2Q")           # kind flags momentum dampening weight_decay beta1 beta2 eps rsvd[2]
SQE = struct.Struct("<BB2xIQQII4Q")               # op fence (rsvd0) group step user_data flags rsvd1 arg[4]
CQE = struct.Struct("<QiBBBxIIQ4Q")               # user_data res op has_msg fence (rsvd0) group rsvd1 step result[4]
STREAM_REQ = struct.Struct("<II")                 # nevents rsvd (STREAM and STREAM_REPLY), then the handles
RING_HDR_SIZE = 8 * CACHELINE

# Byte offsets of the ring header fields (struct shardd_ring_hdr).
RH_MAGIC = 0
RH_VERSION = 4
RH_SQ_ENTRIES = 8
RH_CQ_ENTRIES = 12
RH_SQ_OFF = 16
RH_CQ_OFF = 20
RH_MSG_OFF = 24
RH_MSG_SIZE = 28
RH_REGION_SIZE = 32
RH_DAEMON_PID = 40
RH_CLIENT_ID = 44
RH_SQ_HEAD = 1 * CACHELINE
RH_SQ_TAIL = 2 * CACHELINE
RH_CQ_HEAD = 3 * CACHELINE
RH_CQ_WAITERS = 3 * CACHELINE + 4
RH_CQ_TAIL = 4 * CACHELINE
RH_FLAGS = 5 * CACHELINE
RH_DAEMON_LAST_OP = 5 * CACHELINE + 4
RH_DAEMON_LAST_STEP = 5 * CACHELINE + 8
RH_DAEMON_HEARTBEAT_NS = 5 * CACHELINE + 16
RH_CLIENT_LAST_OP = 6 * CACHELINE
RH_CLIENT_LAST_STEP = 6 * CACHELINE + 8

# Rank-executed groups (proto/shardd_exec.h): the daemon's sync page and each rank's slot.
EXEC_MAGIC = 0x43455853     # "SXEC"
EXEC_VERSION = 2
EXEC_PAGE = 4096            # slot size and alignment; sync page granule
EXEC_GONE = 0xFFFFFFFF      # gen[r] of a rank that left and has not attached again
EXEC_SYNC_HDR = 2 * CACHELINE
# Byte offsets in struct shardd_exec_sync.
XS_MAGIC = 0
XS_VERSION = 4
XS_WORLD = 8
XS_GROUP_ID = 12
XS_EPOCH = CACHELINE
XS_DEAD_RANK = CACHELINE + 4
XS_CHANGES = CACHELINE + 8
XS_GEN = EXEC_SYNC_HDR      # u32 [world]
# Byte offsets in struct shardd_exec_slot.
XL_SEQ = 0
XL_STEP = 8
XL_OP = 16
XL_WHAT = 24             # the sequence word op and step belong to (a seqlock)
XL_DONE = CACHELINE
XL_UNSHARDS = 2 * CACHELINE
XL_REDUCES = 2 * CACHELINE + 8
XL_RESHARDS = 2 * CACHELINE + 16
XL_GAVE_UP = 2 * CACHELINE + 24
XL_GAVE_UP_STEP = 2 * CACHELINE + 32
XL_CLEARED = 3 * CACHELINE
XL_WAIT_OP = 4 * CACHELINE
XL_WAIT_PEER = 4 * CACHELINE + 4
XL_WAIT_SINCE_NS = 4 * CACHELINE + 8
XL_SLEEPING = 4 * CACHELINE + 16

for _s, _n in ((MSG_HDR, 16), (HELLO, 112), (WELCOME, 64), (ERROR_MSG, 8),
               (PARAM_SPEC, 160), (REGISTER_GROUP, 88), (OPTIM_CONFIG, 72), (OPEN_GROUP, 64),
               (PARAM_LAYOUT, 64), (GROUP_REPLY, 80), (GROUP_REPLY_V4, 72), (GROUP_REPLY_V3, 64),
               (EXEC_MAP, 8), (EXEC_MAP_REPLY, 32), (SQE, 64), (CQE, 64), (STREAM_REQ, 8)):
    if _s.size != _n:
        raise ImportError(f"shardd.proto: layout {_s.format!r} is {_s.size} bytes, "
                          f"shardd_proto.h says {_n}")


def ring_region_size(sq_entries, cq_entries):
    """Bytes of a ring region with these capacities (shardd_ring_region_size)."""
    return RING_HDR_SIZE + sq_entries * SQE.size + cq_entries * (CQE.size + RING_MSG_SIZE)


def cstr(s, size, what):
    """`s` as the bytes of a NUL-terminated char[size] field (a job, group or
    param name); ValueError naming `what` when it does not fit."""
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    if not b or len(b) >= size or b"\0" in b:
        raise ValueError(f"{what} {s!r} must be 1..{size - 1} bytes without NUL")
    return b


def f64_bits(x):
    """The bits of `x` as an IEEE double: how an sqe.arg word carries an lr,
    a clip coefficient, max_norm or a norm_type."""
    return struct.unpack("<Q", struct.pack("<d", float(x)))[0]


def error_name(code):
    """Name of 0, -errno or -SHARDD_E_* : 'SHARDD_E_TIMEOUT', 'ECONNRESET', 'OK'."""
    if code == 0:
        return "OK"
    c = -code if code < 0 else code
    if c in ERROR_NAMES:
        return ERROR_NAMES[c]
    return _errno.errorcode.get(c, f"error {code}")


ERROR_TEXTS = {
    E_MAGIC: "wrong magic number", E_VERSION: "protocol major version differs",
    E_MALFORMED: "truncated or malformed message", E_PERM: "peer credentials not allowed",
    E_RANK_TAKEN: "another live client holds this rank", E_MESH: "mesh differs from the job's",
    E_INVALID: "a field has an invalid value", E_TIMEOUT: "collective timeout: ranks missing",
    E_PEER_DIED: "a rank of the rendezvous died",
    E_MISMATCH: "ranks disagree on step, flags or spec",
    E_SHUTDOWN: "the daemon is shutting down", E_NOGROUP: "unknown group id or name",
    E_STATE: "op not allowed in this state", E_NOMEM: "daemon could not allocate",
    E_BACKEND: "backend failure", E_NOJOB: "unknown job",
}


def error_text(code):
    """Short human description of a code, like shardd_strerror()."""
    c = -code if code < 0 else code
    return ERROR_TEXTS.get(c) or _os.strerror(c)


def exec_sync_size(world):
    """Bytes of a rank-executed group's sync page for `world` ranks: whole pages."""
    b = EXEC_SYNC_HDR + world * 4
    return -(-b // EXEC_PAGE) * EXEC_PAGE


def exec_slot_offset(grad_size):
    """Where a rank's slot begins in its grad buffer of grad_size bytes."""
    return -(-grad_size // EXEC_PAGE) * EXEC_PAGE


def exec_grad_map_size(grad_size):
    """Bytes of a rank-executed group's grad buffer: its grads, then its slot."""
    return exec_slot_offset(grad_size) + EXEC_PAGE


def exec_word(epoch, n):
    """A sequence word: op n of epoch."""
    return (epoch << 32) | n


def exec_reached(seen, epoch, n):
    """A peer's sequence word `seen` says it reached op n of epoch (it may run one op ahead)."""
    return seen >> 32 == epoch and seen & 0xFFFFFFFF >= n
