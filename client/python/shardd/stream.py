# SPDX-License-Identifier: MIT
"""Stream ordering under the cuda backend (Client.set_stream): the
client's half of the fences of PROTOCOL.md 5.7, as the C client's
client/stream.c.

Event slots are ring slots, so the ring's own flow control makes reuse
safe: our event of SQ slot i is recorded again only after the daemon
released the slot, which it does after queueing its wait on the event; the
daemon records its event of CQ slot i again only after we released the
slot, which we do after queueing our stream's wait on it (Ring.cq_pop's
on_fence)."""

import errno
import os

from . import cuda
from . import proto as P
from .error import ShardError, shard_error

# The daemon opens one event per SQ slot and makes one per CQ slot before it answers.
STREAM_TIMEOUT_S = 30.0


def stream_handle(stream):
    """A CUstream as an int from `stream`: an int (0: the legacy default
    stream) or an object with .cuda_stream (torch.cuda.Stream)."""
    handle = getattr(stream, "cuda_stream", stream)
    if type(handle) is not int or handle < 0:
        raise TypeError(f"set_stream: {stream!r} is neither a CUstream (an int) nor a "
                        f"torch.cuda.Stream")
    return handle


def setup(client):
    """Make our events, send STREAM, open the daemon's: the client's Fences."""
    where = f"set a stream on device {client.device}"
    nsq, ncq = client.ring.sq_entries, client.ring.cq_entries
    try:
        fences = cuda.Fences(client.device, nsq)
    except ShardError as e:
        raise shard_error(e.code, f"{where}: {e.text}") from None
    try:
        _t, reply, fds = client._request(P.MSG_STREAM, P.STREAM_REQ.pack(nsq, 0) + fences.handles,
                                         STREAM_TIMEOUT_S, P.MSG_STREAM_REPLY, where)
        for fd in fds:
            os.close(fd)
        if len(reply) < P.STREAM_REQ.size:
            raise shard_error(-errno.EPROTO, f"{where}: STREAM_REPLY of {len(reply)} bytes is "
                                             f"shorter than its header")
        nevents, _rsvd = P.STREAM_REQ.unpack_from(reply)
        if nevents != ncq or len(reply) != P.STREAM_REQ.size + ncq * P.CUDA_IPC_HANDLE_SIZE:
            raise shard_error(-errno.EPROTO, f"{where}: STREAM_REPLY carries {nevents} events in "
                                             f"{len(reply)} bytes; the CQ has {ncq} slots")
        fences.open(reply[P.STREAM_REQ.size:], ncq)
    except ShardError as e:
        fences.close()
        if e.text.startswith(where):
            raise
        raise shard_error(e.code, f"{where}: {e.text}") from None
    except BaseException:
        fences.close()
        raise
    return fences


def reap(client, slot):
    """Ring.cq_pop's on_fence: order after the daemon's event of CQ slot
    `slot` (the stream waits; the CPU when the stream was cleared since).
    None, or the (res, msg) of a completion whose results cannot be ordered."""
    if client._fences is None:
        return (-errno.EPROTO, "the daemon fenced a completion of this client, which set up no "
                               "stream")
    try:
        client._fences.wait(slot, client._stream)
    except ShardError as e:
        return (e.code, f"the op completed but its results cannot be ordered: {e.text}")
    return None
