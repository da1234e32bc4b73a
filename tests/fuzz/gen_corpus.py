#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Write the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/).

Each seed is a small program in the input format the fuzz harness reads (harness_actions.c): an
action byte (an index into the target's action table) followed by that
action's bytes. The seeds reach the interesting states on purpose (a job
attached, a group registered by every rank, collectives run, a rank killed
and re-attached, each malformed-framing case once) so that the fuzzer starts
from there. Run from the repository root: python3 tests/fuzz/gen_corpus.py
"""
import os
import struct

# Action indices: the order of each target's actions[] table.
C_CONNECT, C_HELLO, C_MSG, C_RAW, C_SPLIT, C_REGISTER, C_OPEN, C_ADMIN = range(8)
C_GOODBYE, C_CLOSE, C_SHUT_WR, C_TURN, C_CRON = range(8, 13)
E_REGISTER_ALL, E_REGISTER, E_OPEN, E_SQE, E_BURST = 0, 1, 2, 3, 5
E_CLOSE, E_REATTACH, E_GOODBYE, E_ADMIN, E_WRITE_BUF, E_TURN, E_CRON, E_MSG = range(8, 16)

# Dims by index (harness_actions.c dims[]).
D = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 7: 6, 8: 7, 16: 8, 17: 9, 63: 10, 64: 11, 100: 12,
     1000: 13}
# Burst ops by index (act_sqe_burst ops[]).
UNSHARD, REDUCE, RESHARD, ZERO_GRAD, BARRIER, NOP = 0, 1, 2, 3, 4, 7
MSG_HELLO, MSG_GOODBYE, MSG_REGISTER, MSG_OPEN, MSG_ADMIN, MSG_STREAM = 1, 4, 5, 6, 8, 10


def hello(c=0, job=0, rank=0, rep=0, shard=1, sq=0, mut=15, extra=b""):
    """HELLO from client c: mesh (1 + rep) x (1 + shard); mut < 11 mutates a field."""
    return bytes([C_HELLO, c, job, rank, rep, shard, sq, mut]) + extra


def spec(dims, dtype=0, shard_dim=None, sel=0):
    """One param: dtype index 0..2 = fp32, bf16, fp16; shape by value."""
    if shard_dim is not None:
        sel |= 0x40
    out = bytes([sel, dtype, len(dims)])
    if shard_dim is not None:
        out += bytes([shard_dim])
    return out + bytes(D[d] for d in dims)


def register_body(specs, group=0, pdt=0, rdt=0, mut=0, extra=b""):
    return bytes([len(specs) - 1, mut, group, pdt, rdt]) + extra + b"".join(specs)


def admin(c, sel, job=0, group=0, param=0, extra=b""):
    return bytes([C_ADMIN, c, sel, 0, job, group, param]) + extra


def msg(c, typ, payload=b"", flags=None):
    head = bytes([C_MSG, c, typ]) + (bytes([0]) + struct.pack("<H", flags) if flags else b"\xff")
    return head + struct.pack("<H", len(payload)) + payload


def burst(job, op, group=0, step=1, flags=0, skip=0xff):
    out = bytes([E_BURST, job, op, group, skip, step])
    return out + (bytes([flags]) if op in (REDUCE, 6) else b"")


def sqe(c, op, mut=0, tag=0, group_sel=0, step=1, flags=0, extra=b""):
    out = bytes([E_SQE, c, mut]) + struct.pack("<I", tag) + bytes([op])
    if op > 2:
        out += bytes([group_sel])
    return out + bytes([step, flags]) + extra


def setup(*meshes):
    """Jobs attached by fuzz_engine before the program: (replicate, shard) each."""
    out = bytes([len(meshes) - 1])
    for r, s in meshes:
        out += bytes([r - 1, s - 1])
    return out


def attached(c=0, job=0, rank=0, rep=0, shard=0):
    return bytes([C_CONNECT]) + hello(c, job, rank, rep, shard)


W = [spec([8, 4]), spec([5]), spec([3, 7], dtype=1)]

CTRL = {
    "attach-register-open-goodbye": attached() + bytes([C_REGISTER, 0]) +
    register_body([spec([8, 4])]) + bytes([C_OPEN, 0, 0]) + admin(0, 0) +
    bytes([C_GOODBYE, 0]),
    "two-ranks-register": attached(0, 0, 0, 0, 1) + attached(1, 0, 1, 0, 1) +
    bytes([C_REGISTER, 0]) + register_body(W) + bytes([C_REGISTER, 1]) + register_body(W) +
    bytes([C_OPEN, 1, 0]) + bytes([C_CLOSE, 0]) + bytes([C_TURN, 1]),
    "rank-taken-and-mesh-mismatch": attached() + bytes([C_CONNECT]) + hello(1) +
    bytes([C_CONNECT]) + hello(2, 0, 0, 1, 2),
    "admin-commands": bytes([C_CONNECT]) + admin(0, 0) + admin(0, 1) + admin(0, 2) +
    admin(0, 3) + admin(0, 4) + admin(0, 5, extra=b"\x00\x04\x00\x08\x00\x00\x00") +
    admin(0, 6) + admin(0, 7),
    "admin-raw-json": bytes([C_CONNECT]) + bytes([C_ADMIN, 0, 8, 0, 0, 0, 0, 22]) +
    b'{"cmd":"dump","job":1}' + bytes([C_ADMIN, 0, 9, 0, 0, 0, 0, 5]) + b"[1,2]",
    "msg-before-hello": bytes([C_CONNECT]) + msg(0, MSG_REGISTER, b"\0" * 40),
    "msg-flags": attached() + msg(0, MSG_ADMIN, b'{"cmd":"status"}', flags=1),
    "msg-unknown-type": attached() + msg(0, 12, b"x") + msg(0, 0),
    "stream-on-host": attached() + msg(0, MSG_STREAM, struct.pack("<II", 8, 0)),
    "raw-short-header": bytes([C_CONNECT, C_RAW, 0, 0, 5, 0, 0]) + b"\x00" * 4 + b"abcde",
    "raw-bad-magic": bytes([C_CONNECT, C_RAW, 0, 0, 16, 0, 0]) + b"\x00" * 4 + b"X" * 16,
    "raw-with-fds": bytes([C_CONNECT, C_RAW, 0, 3, 40, 0, 3, 0, 1, 2, 3]) + b"H" * 24,
    "raw-own-socket-fd": attached() + bytes([C_RAW, 0, 3, 30, 0, 1, 2, 2, 2, 2]) + b"h" * 14,
    "raw-oversized": bytes([C_CONNECT, C_RAW, 0, 0x80, 7, 0, 0, 0, 0, 0]),
    "split-ok": attached() + bytes([C_SPLIT, 0, MSG_ADMIN, 2, 0]) + b"{" * 64,
    "split-fd-on-continuation": attached() + bytes([C_SPLIT, 0, MSG_ADMIN, 2, 1]) + b"a" * 64,
    "split-overlong": attached() + bytes([C_SPLIT, 0, MSG_OPEN, 1, 2]) + b"b" * 64,
    "split-truncated": attached() + bytes([C_SPLIT, 0, MSG_REGISTER, 3, 3]) + b"\0" * 64,
    "split-too-long": bytes([C_CONNECT, C_SPLIT, 0, MSG_HELLO, 0, 4]) + b"c" * 64,
    "handshake-timeout": bytes([C_CONNECT, C_CONNECT]) + admin(1, 0) + bytes([C_CRON, 1]),
    "shut-wr": attached() + bytes([C_SHUT_WR, 0, C_TURN, 2]),
    "goodbye-then-reattach": attached() + bytes([C_GOODBYE, 0]) + attached(1),
    # F2 (docs/RELIABILITY.md): a datagram that lands after the session closed, before
    # the loop cancelled its poll, left the poll armed and the socket held for ever.
    "regress-f2-send-after-goodbye": attached() + bytes([C_GOODBYE, 0]) +
    msg(0, MSG_ADMIN, b'{"cmd":"status"}'),
    "regress-f2-raw-after-goodbye": attached() + bytes([C_GOODBYE, 0]) +
    bytes([C_RAW, 0, 0, 5, 0, 0, 0, 0, 0]) + b"abcde",
}
# Past --max-job-memory (the harness runs the daemon with 16 MiB per job, 32 MiB in all).
CTRL["register-past-max-job-memory"] = attached() + bytes([C_REGISTER, 0]) + \
    register_body([spec([1000, 1000, 100])])
for k in range(11):
    CTRL["hello-mut-%02d" % k] = bytes([C_CONNECT]) + hello(mut=k, extra=b"\x07\x00\x00\x00" * 4)
for name, specs in {
    "register-bad-dtype": [spec([4], sel=1) + b"\x09\x00\x00\x00"],
    "register-bad-ndim": [spec([4], sel=2) + b"\x09\x00\x00\x00"],
    "register-dup-names": [spec([4]), spec([4], sel=0x80)],
    "register-shard-dim": [spec([4, 8], shard_dim=1)],
    "register-0d": [spec([])],
}.items():
    CTRL[name] = attached() + bytes([C_REGISTER, 0]) + register_body(specs)

ENGINE = {
    "fsdp2-step": setup((1, 2)) + bytes([E_REGISTER_ALL, 0, 0xff, 0, 0]) + register_body(W) +
    burst(0, UNSHARD) + burst(0, REDUCE) + burst(0, RESHARD) + burst(0, ZERO_GRAD) +
    burst(0, UNSHARD, step=2),
    "hsdp-bf16-reduce-fp32": setup((2, 2)) + bytes([E_REGISTER_ALL, 0, 0xff, 0, 0]) +
    register_body([spec([16, 3]), spec([5])], pdt=2, rdt=1) + burst(0, UNSHARD) +
    burst(0, REDUCE, flags=0) + burst(0, REDUCE, flags=1) + burst(0, RESHARD),
    "fp16-reduce": setup((1, 3)) + bytes([E_REGISTER_ALL, 0, 0xff, 0, 0]) +
    register_body([spec([17, 4], dtype=2)], rdt=3) + burst(0, REDUCE) + burst(0, REDUCE),
    "shard-dim-1": setup((1, 2)) + bytes([E_REGISTER_ALL, 0, 0xff, 0, 0]) +
    register_body([spec([3, 8], shard_dim=1)]) + burst(0, UNSHARD) + burst(0, REDUCE),
    "register-mismatch": setup((1, 2)) + bytes([E_REGISTER_ALL, 0, 0, 30, 1]) +
    register_body(W),
    "rank-dies-mid-unshard": setup((1, 2)) + bytes([E_REGISTER_ALL, 0, 0xff, 0, 0]) +
    register_body(W) + sqe(0, 3) + bytes([E_CLOSE, 1]) + bytes([E_REATTACH, 0, 1]) +
    bytes([E_OPEN, 2, 0]) + burst(0, UNSHARD, step=2),
    "collective-timeout": setup((1, 2)) + bytes([E_REGISTER_ALL, 0, 0xff, 0, 0]) +
    register_body(W) + sqe(0, 3) + sqe(0, 2) + bytes([E_CRON, 2]),
    "registration-timeout": setup((1, 2)) + bytes([E_REGISTER, 0]) + register_body(W) +
    bytes([E_CRON, 2]),
    "bad-sqes": setup((1, 1)) + sqe(0, 0) + sqe(0, 7) + sqe(0, 3, mut=1, extra=b"\x03") +
    sqe(0, 1, mut=3, extra=b"\x01\0\0\0") + sqe(0, 3, mut=5, extra=b"\x63\0\0\0") +
    sqe(0, 2, mut=4, extra=b"\x01" + b"\x05" * 8),
    "barrier-and-nop": setup((2, 1)) + burst(0, BARRIER) + burst(0, NOP) +
    burst(0, BARRIER, skip=1) + bytes([E_CLOSE, 1]),
    "nan-grads": setup((1, 2)) + bytes([E_REGISTER_ALL, 0, 0xff, 0, 0]) +
    register_body([spec([8, 4], dtype=1)]) + bytes([E_WRITE_BUF, 0, 0, 0, 0, 8]) +
    b"\x00\x00\xc0\x7f\x00\x00\x80\x7f" + burst(0, REDUCE),
    "two-jobs-admin": setup((1, 2), (1, 1)) + bytes([E_REGISTER_ALL, 1, 0xff, 0, 0]) +
    register_body([spec([4])]) + bytes([E_ADMIN, 2, 4, 0, 1, 0, 0]) +
    bytes([E_ADMIN, 2, 5, 0, 1, 0, 0]) + b"\x00\x02\x00\x08\x00\x01\x00" +
    bytes([E_ADMIN, 0, 2, 0, 0, 0, 0]),
    "all-goodbye": setup((1, 2)) + bytes([E_REGISTER_ALL, 0, 0xff, 0, 0]) +
    register_body(W) + bytes([E_GOODBYE, 0, E_GOODBYE, 1]) + bytes([E_TURN, 1]),
    "zero-size-param": setup((1, 2)) + bytes([E_REGISTER_ALL, 0, 0xff, 0, 0]) +
    register_body([spec([0, 4]), spec([4])]) + burst(0, UNSHARD) + burst(0, REDUCE),
    "pipelined-unshards": setup((1, 2)) + bytes([E_REGISTER_ALL, 0, 0xff, 0, 0]) +
    register_body([spec([64, 64])]) + burst(0, UNSHARD, step=1) + burst(0, UNSHARD, step=2) +
    burst(0, REDUCE, step=2) + burst(0, UNSHARD, step=3),
}

# Three jobs of 15.3 MiB of buffers each: the third passes --max-memory (32 MiB).
ENGINE["three-jobs-past-max-memory"] = setup((1, 1), (1, 1), (1, 1)) + b"".join(
    bytes([E_REGISTER_ALL, j, 0xff, 0, 0]) + register_body([spec([1000, 1000])]) for j in range(3)) + \
    burst(2, UNSHARD) + burst(1, UNSHARD)


# fuzz_ckpt: a selector byte (even: a safetensors file, odd: a manifest), then the file.
def safetensors(header, data=b""):
    return b"\x00" + struct.pack("<Q", len(header)) + header + data


MANIFEST = b"""{"format": "shardd-checkpoint", "version": 1, "job": "j", "step": 3,
 "mesh": {"replicate": 1, "shard": 2},
 "groups": [{"name": "g", "param_dtype": "none", "reduce_dtype": "none",
   "optimizer": {"kind": "adamw", "nesterov": false, "maximize": false, "amsgrad": true,
     "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.01, "beta1": 0.9, "beta2": 0.999,
     "eps": 1e-8},
   "params": [{"name": "w", "dtype": "fp32", "shape": [4, 3], "shard_dim": 0},
     {"name": "b", "dtype": "bf16", "shape": [], "shard_dim": 0}],
   "last_step": 3, "optim_steps": 3, "file": "model.safetensors", "optim_file": "optim.safetensors"}],
 "files": [{"name": "model.safetensors", "bytes": 100, "crc32": "0a1b2c3d"},
   {"name": "optim.safetensors", "bytes": 200, "crc32": "ffffffff"}]}"""
CKPT = {
    "two-tensors": safetensors(b'{"__metadata__":{"format":"pt"},'
                               b'"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
                               b'"b":{"dtype":"BF16","shape":[],"data_offsets":[16,18]}}  ', bytes(18)),
    "zero-size": safetensors(b'{"e":{"dtype":"F16","shape":[0,5],"data_offsets":[0,0]}}'),
    "overlap": safetensors(b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                           b'"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', bytes(12)),
    "manifest": b"\x01" + MANIFEST,
    "manifest-sgd": b"\x01" + MANIFEST.replace(b'"optimizer": {"kind": "adamw"', b'"optimizer": null, "x": {"kind": "adamw"'),
}


def write(target, seeds):
    d = os.path.join("tests", "fuzz", "corpus", target)
    os.makedirs(d, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    write("fuzz_ctrl", CTRL)
    write("fuzz_engine", ENGINE)
    write("fuzz_ckpt", CKPT)
