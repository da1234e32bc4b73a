# SPDX-License-Identifier: MIT
"""make install into a temporary prefix, as a new user would use it: an
external C program built with nothing but pkg-config attaches to the
installed shardd and runs ops; the library exports the calls of shardd.h
and nothing else; the man pages render with man -l; the systemd units pass
systemd-analyze verify; make uninstall removes every file it installed."""

import os
import re
import select
import shutil
import subprocess
import tempfile
import time

import pytest

from conftest import ROOT, shardd_build

MAKE_TIMEOUT_S = 240
RUN_TIMEOUT_S = 30
READY_TIMEOUT_S = 15
MAN_PAGES = ["man1/shardctl.1", "man1/shardbench.1", "man3/libshardd.3", "man8/shardd.8"]

# An external program: attach, nop, register a 4x3 fp32 param in a one-rank
# job, load it, unshard, and compare the unsharded copy with what it wrote.
APP_C = r"""
#include <stdio.h>
#include <shardd.h>

int main(int argc, char **argv)
{
	struct shardd_attach_opts o = { .socket_path = argv[1], .job = "ext", .rank = 0,
					.replicate = 1, .shard = 1,
					.device = SHARDD_HELLO_DEVICE_HOST };
	struct shardd_param_desc p = { .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2,
				       .shape = { 4, 3 } };
	struct shardd_precision prec = { SHARDD_DTYPE_NONE, SHARDD_DTYPE_NONE };
	struct shardd_client *c;
	struct shardd_group *g;
	float full[12];
	const float *u;

	if (argc != 2)
		return 2;
	for (int i = 0; i < 12; i++)
		full[i] = (float)i * 1.5f - 4.0f;
	if (shardd_connect(&o, &c) < 0 || shardd_nop(c) < 0 ||
	    shardd_group_register(c, "layer", &p, 1, &prec, NULL, &g) < 0 ||
	    shardd_group_load_full(g, 0, full) < 0 || shardd_unshard(g, 1) < 0) {
		fprintf(stderr, "ext: %s\n", shardd_last_error());
		return 1;
	}
	u = shardd_group_unsharded(g, 0);
	for (int i = 0; i < 12; i++)
		if (u[i] != full[i]) {
			fprintf(stderr, "ext: unsharded[%d] = %g, wrote %g\n", i, u[i], full[i]);
			return 1;
		}
	shardd_group_close(g);
	shardd_close(c);
	printf("ext ok\n");
	return 0;
}
"""


def run(cmd, env=None, timeout=RUN_TIMEOUT_S, check=True, cwd=None):
    p = subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if check and p.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}")
    return p


def make_args(prefix):
    build = os.path.abspath(shardd_build())
    args = ["make", "-C", ROOT, f"BUILD={build}", f"PREFIX={prefix}"]
    if os.path.basename(build) == "build-san":
        args.append("SANITIZE=1")
    return args


@pytest.fixture(scope="module")
def prefix():
    d = tempfile.mkdtemp(prefix="shardd-prefix-")
    run(make_args(d) + ["install"], timeout=MAKE_TIMEOUT_S)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def pkg_config(prefix, *args):
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(prefix, "lib", "pkgconfig"))
    return run(["pkg-config", *args, "shardd"], env=env).stdout.split()


def start_installed_shardd(prefix, sock):
    """The installed daemon on `sock`; returns the process once it is ready."""
    proc = subprocess.Popen([os.path.join(prefix, "bin", "shardd"), "--socket", sock],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    want = f"shardd: ready on {sock}".encode()
    buf = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while want not in buf:
        left = deadline - time.monotonic()
        r, _, _ = select.select([proc.stderr], [], [], max(left, 0))
        chunk = os.read(proc.stderr.fileno(), 4096) if r else b""
        if left <= 0 or not chunk:
            proc.kill()
            proc.wait(timeout=10)
            pytest.fail(f"installed shardd did not get ready: {buf.decode(errors='replace')}")
        buf += chunk
    return proc


def test_pc_carries_the_install_prefix(prefix):
    assert pkg_config(prefix, "--variable=prefix") == [prefix]
    assert pkg_config(prefix, "--cflags") == [f"-I{prefix}/include"]
    assert pkg_config(prefix, "--libs") == [f"-L{prefix}/lib", "-lshardd"]


@pytest.mark.timeout_s(120)
def test_external_program_builds_with_pkg_config_and_runs(prefix, tmp_path):
    src = tmp_path / "ext.c"
    src.write_text(APP_C)
    exe = tmp_path / "ext"
    flags = pkg_config(prefix, "--cflags", "--libs")
    libdir = pkg_config(prefix, "--variable=libdir")[0]
    lib = os.path.join(libdir, "libshardd.so")
    # A sanitizer build's library needs its runtime first in the program too.
    if "libasan" in run(["ldd", lib]).stdout:
        flags = ["-fsanitize=address,undefined"] + flags
    run(["cc", "-std=gnu11", "-Wall", "-Werror", str(src), "-o", str(exe), *flags])
    env = dict(os.environ, LD_LIBRARY_PATH=libdir)
    # The shared library of the prefix, not a static copy or a system one.
    ldd = run(["ldd", str(exe)], env=env).stdout
    assert f"libshardd.so.0 => {libdir}/libshardd.so.0" in ldd, ldd
    sock = str(tmp_path / "shardd.sock")
    proc = start_installed_shardd(prefix, sock)
    try:
        out = run([str(exe), sock], env=env, check=False)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert out.returncode == 0, out.stdout
    assert out.stdout.strip() == "ext ok"
    assert proc.returncode == 0


def test_installed_library_exports_the_calls_of_its_header_at_shardd_0_1(prefix):
    """client/libshardd.map: each call declared in shardd.h, versioned
    SHARDD_0.1, and no other symbol."""
    lib = os.path.join(pkg_config(prefix, "--variable=libdir")[0], "libshardd.so")
    lines = run(["nm", "-D", "--defined-only", lib]).stdout.splitlines()
    exported = {line.split()[-1] for line in lines if line.strip()}
    with open(os.path.join(prefix, "include", "shardd.h")) as f:
        declared = set(re.findall(r"^[a-z][\w \t*]*?\b(shardd_\w+)\(", f.read(), re.M))
    assert "shardd_connect" in declared
    assert exported == {"SHARDD_0.1"} | {f"{name}@@SHARDD_0.1" for name in declared}


def test_man_page_documents_every_call_of_the_header():
    """man/libshardd.3.scd names each call of shardd.h, deprecated ones included."""
    with open(os.path.join(ROOT, "client", "shardd.h")) as f:
        declared = set(re.findall(r"^[a-z][\w \t*]*?\b(shardd_\w+)\(", f.read(), re.M))
    with open(os.path.join(ROOT, "man", "libshardd.3.scd")) as f:
        documented = set(re.findall(r"\*(shardd_\w+)\*\(", f.read()))
    assert declared - documented == set()


def test_installed_man_pages_render(prefix):
    for page in MAN_PAGES:
        path = os.path.join(prefix, "share", "man", page)
        name = os.path.basename(page).rsplit(".", 1)[0]
        p = subprocess.run(["man", "-l", path], env=dict(os.environ, MANWIDTH="80"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=RUN_TIMEOUT_S)
        assert p.returncode == 0, f"man -l {path}: {p.stderr}"
        assert p.stderr == "", f"man -l {path} warned: {p.stderr}"
        assert "NAME" in p.stdout and f"{name} - " in p.stdout, p.stdout[:400]
        assert "SEE ALSO" in p.stdout, p.stdout


def test_installed_units_pass_systemd_analyze_verify(prefix):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is missing: install the Debian package systemd to verify the units")
    units = os.path.join(prefix, "lib", "systemd", "system")
    service = open(os.path.join(units, "shardd.service")).read()
    assert f"ExecStart={prefix}/bin/shardd --state-dir ${{STATE_DIRECTORY}} " in service, service
    # Under ProtectSystem=strict the state dir is the one path shardd may write.
    assert "ProtectSystem=strict" in service and "\nStateDirectory=shardd\n" in service, service
    # verify runs man for Documentation=man:shardd(8): point it at the prefix.
    env = dict(os.environ, MANPATH=os.path.join(prefix, "share", "man"))
    p = run([tool, "verify", os.path.join(units, "shardd.socket"),
             os.path.join(units, "shardd.service")], env=env, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "", p.stdout


def test_uninstall_removes_every_installed_file():
    d = tempfile.mkdtemp(prefix="shardd-prefix-")
    try:
        run(make_args(d) + ["install"], timeout=MAKE_TIMEOUT_S)
        installed = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
        assert len(installed) >= 15, installed
        run(make_args(d) + ["uninstall"], timeout=MAKE_TIMEOUT_S)
        left = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
        assert left == [], left
    finally:
        shutil.rmtree(d, ignore_errors=True)
