# SPDX-License-Identifier: MIT
"""Errors of shardd calls, as the C client's (client/error.c): every failure
is a ShardError carrying the code the C API would return."""

import errno

from . import proto as P


class ShardError(Exception):
    """A failed shardd call.

    .code  0 > code: -errno or -SHARDD_E_* (as in the C API)
    .name  the code's name: 'SHARDD_E_TIMEOUT', 'ECONNRESET', ...
    .text  what failed, with the daemon's own message when it sent one
    .result  a failed completion's result words (cqe.result[0..1]): a barrier
           mismatch's [0] is the barrier number met; None for other errors
    """

    def __init__(self, code, text, result=None):
        self.code = code
        self.name = P.error_name(code)
        self.text = text
        self.result = result
        super().__init__(f"{text} [{self.name}]")


class DaemonGone(ShardError, ConnectionResetError):
    """The daemon died or dropped this client without saying why (code
    -ECONNRESET). A client it detached with a notice (a job ended by
    `shardctl end`) gets a ShardError with the notice's code instead."""


def shard_error(code, text, result=None):
    """The exception for `code`: DaemonGone for -ECONNRESET, else ShardError."""
    if code == -errno.ECONNRESET:
        return DaemonGone(code, text)
    return ShardError(code, text, result)
