# SPDX-License-Identifier: MIT
"""Ops in flight: what Client.start() returns, reaped by its wait()."""


class Pending:
    """Ops submitted by Client.start(): wait(timeout) reaps them."""

    __slots__ = ("client", "ops", "completions")

    def __init__(self, client, ops):
        self.client = client
        self.ops = ops
        self.completions = None

    def wait(self, timeout=None):
        """Wait for every op (timeout in seconds; None: the daemon's collective
        timeout plus 10 s) and raise the first failure; returns the
        completions in submission order. A second wait returns them again."""
        if self.completions is None:
            self.completions = self.client._finish(self.ops, timeout)
        return self.completions

    def done(self):
        return self.completions is not None
