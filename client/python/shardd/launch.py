# SPDX-License-Identifier: MIT
"""A private shardd for a script or a test: start one and wait for its
readiness line, stop one (or any child process) within a bound.

    proc, sock = shardd.launch.start_private("shardd", workdir)
    ...
    shardd.launch.stop(proc)

The daemon's stderr is a pipe the caller keeps reading (or closes) after
start_daemon returns; its stdout and stdin are /dev/null.
"""

import os
import select
import subprocess
import time

READY = "shardd: ready on "


class DaemonStartError(RuntimeError):
    """The daemon exited, or did not print its readiness line in time."""


def stop(proc, timeout_s=10.0):
    """SIGTERM `proc` and wait up to timeout_s; SIGKILL and reap it if it stays."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


def start_daemon(argv, env=None, timeout_s=15.0, socket=None):
    """Run argv (a shardd command line with --foreground) and wait up to
    timeout_s for its whole 'shardd: ready on PATH' line (naming `socket`
    when given). Returns (process, PATH, its stderr so far as text). On
    timeout or exit the daemon is stopped and DaemonStartError names the
    binary, the wait and what it printed."""
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    want = f"{READY}{socket}\n" if socket is not None else None
    buf, deadline = b"", time.monotonic() + timeout_s
    while True:
        text = buf.decode(errors="replace")
        lines = [ln for ln in text.splitlines(keepends=True)
                 if ln.startswith(READY) and ln.endswith("\n")]
        if lines and (want is None or want in lines):
            return proc, (want or lines[0])[len(READY):-1], text
        left = deadline - time.monotonic()
        if left <= 0:
            stop(proc)
            shown = want.rstrip("\n") if want else READY + "PATH"
            raise DaemonStartError(f"{argv[0]} did not print '{shown}' within {timeout_s:g} s; "
                                   f"stderr: {text!r}")
        if not select.select([proc.stderr], [], [], left)[0]:
            continue
        chunk = os.read(proc.stderr.fileno(), 4096)
        if not chunk:
            rc = proc.wait(timeout=10)
            raise DaemonStartError(f"{argv[0]} exited with {rc} before it was ready; "
                                   f"stderr: {text!r}")
        buf += chunk


def start_private(binary, workdir, *extra, timeout_s=15.0):
    """`binary` on workdir/shardd.sock (--foreground --log-level warn, then
    the `extra` arguments), ready: returns (process, socket path). Raises
    DaemonStartError as start_daemon does."""
    sock = os.path.join(workdir, "shardd.sock")
    proc, _path, _text = start_daemon([binary, "--socket", sock, "--foreground", "--log-level",
                                       "warn", *extra], timeout_s=timeout_s, socket=sock)
    return proc, sock


def mesh_shape(ap, ranks, replicate, shard):
    """The examples' --ranks N --replicate R [--shard S]: N rank processes in
    R replicas of S shards (S defaults to N / R). Returns S; a shape that
    does not add up is an argparse error (ap.error) naming the flags."""
    if ranks < 1 or replicate < 1:
        ap.error(f"--ranks {ranks} --replicate {replicate}: both must be >= 1")
    if shard is None:
        if ranks % replicate:
            ap.error(f"--ranks {ranks} is not a multiple of --replicate {replicate}")
        shard = ranks // replicate
    if replicate * shard != ranks:
        ap.error(f"--replicate {replicate} x --shard {shard} = {replicate * shard} "
                 f"ranks, but --ranks is {ranks}")
    return shard
