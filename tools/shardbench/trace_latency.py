#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Where the time of one small unshard and reduce goes, daemon included.

Runs `shardbench latency` under `perf record` with uprobes on a copy of
shardd (rendezvous arrival, task launch, kernel, completion push, loop
wake-up) and of shardbench (the client's futex sleep), plus the scheduler's
switch and wake-up tracepoints, all on CLOCK_MONOTONIC like the clients'
own timestamps (--trace), then joins them by op and step and prints the
p50/p90 of each stage of the critical path, from the first rank's submit to
the last rank's reaped completion. Needs root (uprobes, tracepoints), perf,
and a build with debug info (the default -g). Changes nothing in the
daemon: the probes live in the kernel and go with the copies.

usage: trace_latency.py [--build DIR] [-b SIZE] [-n N] [-r RANKS] [-d DTYPE]
"""
import argparse
import bisect
import os
import re
import shutil
import subprocess
import sys
import tempfile

PROBES_DAEMON = [
    "eng_submit=shd_engine_submit rank op=sqe->op:u32 step=sqe->step:u64",
    "coll_launch",
    "task_exec",
    "task_exec_ret=task_exec%return",
    "cq_done=shd_session_complete op=sqe->op:u32 step=sqe->step:u64",
    "after_sleep=server_after_sleep",
    "pool_submit=shd_pool_submit",
    "task_run",
]
PROBES_CLIENT = ["sleep_cq", "sleep_cq_ret=sleep_cq%return"]
OPS = {"unshard": 3, "reduce": 4}

LINE = re.compile(r"^\s*(?P<comm>.+?)\s+(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<sec>\d+)\.(?P<ns>\d{9}):\s+"
                  r"(?P<event>\S+):\s*(?P<rest>.*)$")


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, **kw)


def add_probes(binary, group, probes):
    for p in probes:
        run(["perf", "probe", "-q", "-x", binary, "-a", p], stdout=subprocess.DEVNULL)
    return group


def del_probes(group):
    subprocess.run(["perf", "probe", "-q", "-d", group + ":*"], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def pct(v, p):
    if not v:
        return float("nan")
    v = sorted(v)
    k = max(1, min(len(v), int(p / 100.0 * len(v) + 0.999999)))
    return v[k - 1]


def parse(script_out, daemon_comm, client_comm):
    ev = []
    for line in script_out.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        t = int(m["sec"]) * 1000000000 + int(m["ns"])
        ev.append((t, m["comm"].strip(), int(m["tid"]), int(m["cpu"]), m["event"], m["rest"]))
    ev.sort(key=lambda e: e[0])
    return ev


def kv(rest):
    return dict(re.findall(r"(\w+)=(\S+)", rest))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("-b", default="4K")
    ap.add_argument("-n", default="500")
    ap.add_argument("-r", default="2")
    ap.add_argument("-d", default="bf16")
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="trace_latency.")
    daemon = os.path.join(tmp, "shd_daemon")
    bench = os.path.join(tmp, "shd_bench")
    shutil.copy(os.path.join(a.build, "shardd"), daemon)
    shutil.copy(os.path.join(a.build, "shardbench"), bench)
    gd, gc = "probe_shd_daemon", "probe_shd_bench"
    samples = os.path.join(tmp, "samples.txt")
    data = os.path.join(tmp, "perf.data")
    try:
        add_probes(daemon, gd, PROBES_DAEMON)
        add_probes(bench, gc, PROBES_CLIENT)
        out = run(["perf", "record", "-q", "-a", "-k", "CLOCK_MONOTONIC", "-o", data,
                   "-e", gd + ":*", "-e", gc + ":*", "-e", "sched:sched_switch", "-e", "sched:sched_wakeup",
                   "--", bench, "--shardd", daemon, "-b", a.b, "-n", a.n, "-r", a.r, "-d", a.d,
                   "latency", "--trace", samples], capture_output=True).stdout
        sys.stdout.write(out)
        script = run(["perf", "script", "-i", data, "-F", "comm,tid,cpu,time,event,trace", "--ns"],
                     capture_output=True).stdout
    finally:
        del_probes(gd)
        del_probes(gc)
    report(parse(script, "shd_daemon", "shd_bench"), samples, int(a.r))
    shutil.rmtree(tmp, ignore_errors=True)


def report(ev, samples_path, nranks):
    # Client samples: op step rank t0 t1 t2.
    samples = {}
    for line in open(samples_path):
        op, step, rank, t0, t1, t2 = line.split()
        samples.setdefault((OPS[op], int(step)), {})[int(rank)] = (int(t0), int(t1), int(t2))
    ours = set()
    arrive, done = {}, {}
    daemon_ev = []
    sleeps = []          # (tid, begin, end) of client futex sleeps
    open_sleep = {}
    after_sleep = []
    for t, comm, tid, cpu, name, rest in ev:
        if comm.startswith("shd_"):
            ours.add(tid)
        if name.endswith(":eng_submit"):
            f = kv(rest)
            arrive.setdefault((int(f["op"]), int(f["step"])), {}).setdefault(int(f["rank"], 0), t)
        elif name.endswith(":cq_done"):
            f = kv(rest)
            done.setdefault((int(f["op"]), int(f["step"])), []).append(t)
        elif name.endswith(":after_sleep"):
            after_sleep.append(t)
        elif name.endswith(":sleep_cq"):
            open_sleep[tid] = t
        elif name.endswith(":sleep_cq_ret__return") and tid in open_sleep:
            sleeps.append((tid, open_sleep.pop(tid), t))
        if comm == "shd_daemon" and name.split(":")[-1] in ("coll_launch", "task_exec", "task_exec_ret__return",
                                                             "pool_submit", "task_run"):
            daemon_ev.append((t, name.split(":")[-1]))
    # Foreign CPU time: per CPU, intervals that ran a task not ours.
    running = {}
    foreign = {}  # cpu -> [(begin, end)], in time order
    for t, comm, tid, cpu, name, rest in ev:
        if name != "sched:sched_switch":
            continue
        f = kv(rest)
        nxt = int(f.get("next_pid", -1))
        if cpu in running and running[cpu][1] not in ours and running[cpu][1] != 0:
            foreign.setdefault(cpu, []).append((running[cpu][0], t))
        running[cpu] = (t, nxt)
    fends = {cpu: [e for b, e in v] for cpu, v in foreign.items()}
    sleeps.sort(key=lambda x: x[2])
    sleep_ends = [e for tid, b, e in sleeps]

    def foreign_in(lo, hi):
        tot = 0
        for cpu, v in foreign.items():
            for b, e in v[bisect.bisect_left(fends[cpu], lo):]:
                if b >= hi:
                    break
                tot += max(0, min(e, hi) - max(b, lo))
        return tot

    def client_slept(lo, hi):
        for tid, b, e in sleeps[bisect.bisect_left(sleep_ends, lo):]:
            if b < hi:
                return True
            if e > hi + 10**9:
                break
        return False

    stages = ["arrival skew (clients)", "last submit -> daemon takes it", "rendezvous -> kernel start",
              "kernel (task_exec)", "kernel end -> last completion pushed", "last push -> last client reaped",
              "total"]
    dtimes = [d[0] for d in daemon_ev]
    for opname, opcode in OPS.items():
        rows = {s: [] for s in stages}
        slept_d = slept_c = pool = 0
        fshare = []
        n = 0
        for (op, step), per in sorted(samples.items()):
            if op != opcode or len(per) != nranks or (op, step) not in arrive or len(done.get((op, step), [])) < nranks:
                continue
            t0 = [per[r][0] for r in per]
            t2 = [per[r][2] for r in per]
            first0, last0, last2 = min(t0), max(t0), max(t2)
            last_arr = max(arrive[(op, step)].values())
            i = bisect.bisect_left(dtimes, last_arr)
            ex0 = ex1 = None
            for t, nm in daemon_ev[i:i + 8]:
                if nm == "task_exec" and ex0 is None:
                    ex0 = t
                elif nm == "task_exec_ret__return" and ex0 is not None:
                    ex1 = t
                    break
                elif nm == "pool_submit":
                    pool += 1
            last_done = max(done[(op, step)][:nranks])
            if ex0 is None or ex1 is None or not (last0 <= last_arr <= ex0 <= ex1 <= last_done <= last2):
                continue
            n += 1
            vals = [last0 - first0, last_arr - last0, ex0 - last_arr, ex1 - ex0, last_done - ex1,
                    last2 - last_done, last2 - first0]
            for s, v in zip(stages, vals):
                rows[s].append(v)
            if any(first0 <= t <= last_arr for t in after_sleep[bisect.bisect_left(after_sleep, first0):][:4]):
                slept_d += 1
            if client_slept(first0, last2):
                slept_c += 1
            fshare.append(foreign_in(first0, last2) / max(1, last2 - first0))
        print(f"# {opname}: {n} ops joined with the daemon's events (perf uprobes, CLOCK_MONOTONIC)")
        print(f"# {'stage':40s} {'p50(us)':>9s} {'p90(us)':>9s} {'mean(us)':>9s}")
        for s in stages:
            v = rows[s]
            mean = sum(v) / len(v) / 1e3 if v else float("nan")
            print(f"  {s:40s} {pct(v, 50) / 1e3:9.2f} {pct(v, 90) / 1e3:9.2f} {mean:9.2f}")
        if n:
            print(f"#   ops where the daemon woke from sleep before the last arrival: {100.0 * slept_d / n:.0f} %;"
                  f" where a client futex-slept: {100.0 * slept_c / n:.0f} %; pool hand-offs: {pool}")
            print(f"#   CPU time other processes took during the op (both cores, share of the op's time):"
                  f" p50 {100.0 * pct(fshare, 50):.0f} %")
    # Wake-up to running: how long our woken threads waited for a CPU, and who held it.
    cur, pending, waits = {}, {}, {}
    daemon_tids = {tid for t, comm, tid, cpu, name, rest in ev if comm == "shd_daemon"}
    for t, comm, tid, cpu, name, rest in ev:
        f = kv(rest)
        if name == "sched:sched_wakeup":
            w = int(f["pid"])
            if w in ours:
                tc = int(f.get("target_cpu", cpu))
                holder = cur.get(tc, 0)
                kind = ("idle" if holder == 0 else "a client" if holder in ours and holder not in daemon_tids
                        else "the daemon" if holder in daemon_tids else "another process")
                pending[w] = (t, kind)
        elif name == "sched:sched_switch":
            nxt = int(f.get("next_pid", -1))
            cur[cpu] = nxt
            if nxt in pending:
                t0, kind = pending.pop(nxt)
                who = "daemon" if nxt in daemon_tids else "client"
                waits.setdefault(who, []).append((t - t0, kind))
    for who in ("daemon", "client"):
        v = waits.get(who, [])
        if not v:
            continue
        kinds = {}
        for d, k in v:
            kinds.setdefault(k, []).append(d)
        desc = ", ".join(f"{k} {100.0 * len(x) / len(v):.0f} % (p50 {pct(x, 50) / 1e3:.1f} us)"
                         for k, x in sorted(kinds.items(), key=lambda kx: -len(kx[1])))
        print(f"# {who} wake-up -> running: {len(v)} wake-ups, p50 {pct([d for d, k in v], 50) / 1e3:.2f} us;"
              f" the CPU it was woken on was running: {desc}")
    # Where the clients' futex sleeps sat: how long each lasted.
    durs = [e - b for tid, b, e in sleeps]
    if durs:
        print(f"# client futex sleeps: {len(durs)}, p50 {pct(durs, 50) / 1e3:.2f} us")


if __name__ == "__main__":
    main()
