#!/bin/bash
# SPDX-License-Identifier: MIT
# The GPU check: make gpu-check copies this file to build/gpu-check/run
# (tools/setup/gpu_check.sh; docs/CUDA.md "The GPU check").
#
#   run OUTDIR
#
# On a machine with an NVIDIA GPU, in at most 7 minutes, every step bounded
# by timeout(1) and by what is left of the whole:
#   1. every GPU suite (in parallel: each starts its own daemons on its own
#      sockets), compute-sanitizer memcheck on the in-process suites when
#      it exists, train_mlp on --backend cuda against --backend host
#      (final params compared byte for byte), and the Python GPU suites
#      (python/tests, pytest under the machine's python3 and torch);
#   2. then alone on the GPU: shardbench gpu, the overlap measurement
#      (shardbench gpu --load) and the PyTorch benchmark (train_gpt with 2
#      ranks on one GPU through shardd, and PyTorch's FSDP2) time-sliced
#      and, when nvidia-cuda-mps-control exists, under MPS: its own control
#      daemon in a private pipe directory, the ranks at
#      CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=90 and the daemon uncapped. The
#      system's GPU settings are never touched.
# Full logs go to OUTDIR/<step>.log, the summary table last on stdout and
# in OUTDIR/summary.txt. Exit status 0 when every step passed or skipped.
# Without a GPU (no nvidia-smi, or it lists none), or in a bundle built
# without CUDA, every step is skipped, saying why, with exit status 0.
set -u

here=$(cd "$(dirname "$0")" && pwd)
self=$here/$(basename "$0")
BUDGET_S=420
SIZES=(-b 4K -e 256M -f 16)

# ---- internal steps (the script runs itself under timeout) ----------------

# Print the log's last line matching $2 within 30 s of $1 (a pid), or fail.
wait_log() {
	local log=$1 what=$2 pid=$3
	for _ in $(seq 300); do
		grep -q "$what" "$log" 2>/dev/null && return 0
		kill -0 "$pid" 2>/dev/null || return 1
		sleep 0.1
	done
	return 1
}

# train_mlp --spawn 2 against a host daemon and a cuda daemon: same final params.
train_compare() {
	local out=$1 b pid args
	for b in host cuda; do
		"$here/build/shardd" --backend "$b" --socket "$out/train-$b.sock" 2> "$out/train-shardd-$b.log" &
		pid=$!
		if ! wait_log "$out/train-shardd-$b.log" "ready on" "$pid"; then
			echo "shardd --backend $b did not start: see train-shardd-$b.log"
			kill "$pid" 2>/dev/null
			return 1
		fi
		args=(--spawn 2 --steps 50 --socket "$out/train-$b.sock" --dump "$out/train-params-$b.bin")
		[ "$b" = cuda ] && args+=(--device 0)
		echo "== train_mlp ${args[*]}"
		"$here/build/examples/train_mlp" "${args[@]}" || { kill "$pid"; return 1; }
		kill "$pid"
		wait "$pid"
	done
	if cmp "$out/train-params-host.bin" "$out/train-params-cuda.bin"; then
		echo "final params bit-identical ($(stat -c %s "$out/train-params-host.bin") bytes)"
		return 0
	fi
	echo "final params differ between --backend host and --backend cuda"
	return 1
}

# A private MPS control daemon for this process and its children ($mps: its
# directory, for mps_stop).
mps_start() {
	mps=$(mktemp -d "${TMPDIR:-/tmp}/shardd-mps.XXXXXX")
	mkdir -p "$mps/pipe" "$mps/log"
	export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
	unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
	if ! nvidia-cuda-mps-control -d; then
		echo "nvidia-cuda-mps-control -d failed"
		rm -rf "$mps"
		return 1
	fi
}

# Quit it, keeping its log as $1.
mps_stop() {
	echo quit | nvidia-cuda-mps-control
	cat "$mps"/log/*.log > "$1" 2>/dev/null
	rm -rf "$mps"
}

# The PyTorch benchmark (python/gpu_torch_bench.py) with its step label $2
# and any further arguments.
torch_bench() {
	local label=$1
	shift
	python3 "$here/python/gpu_torch_bench.py" --shardd "$here/build/shardd" \
		--train-gpt "$here/python/examples/train_gpt.py" --text "$here/python/corpus.txt" \
		--label "$label" "$@"
}

# train_gpt under MPS: the ranks at 90 % of the SMs, the daemon uncapped.
torch_bench_mps() {
	local out=$1 mps ret=0
	mps_start || return 1
	torch_bench "MPS, ranks at 90 % of the SMs" \
		--rank-env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=90 || ret=1
	mps_stop "$out/torch-bench-mps-server.log"
	return $ret
}

# The overlap measurement under MPS: a private control daemon, shardd
# uncapped, the ranks (the trainers) at 90 % of the SMs.
overlap_mps() {
	local out=$1 mps pid ret=0
	mps_start || return 1
	"$here/build/shardd" --backend cuda --socket "$mps/shardd.sock" 2> "$out/overlap-mps-shardd.log" &
	pid=$!
	if wait_log "$out/overlap-mps-shardd.log" "ready on" "$pid"; then
		# The daemon must have found itself an MPS client (docs/CUDA.md, "MPS").
		if ! "$here/build/shardctl" --socket "$mps/shardd.sock" status | tee "$out/overlap-mps-status.txt" |
			grep '^gpu      MPS: '; then
			echo "shardd does not report MPS under its own control daemon: see overlap-mps-status.txt"
			ret=1
		fi
		CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=90 "$here/build/shardbench" gpu --load "${SIZES[@]}" -n 20 \
			--socket "$mps/shardd.sock" || ret=1
		"$here/build/tests/gpu/test_cuda_sharing" --jobs 1 --verbose || ret=1
	else
		echo "shardd under MPS did not start: see overlap-mps-shardd.log"
		ret=1
	fi
	kill "$pid" 2>/dev/null
	wait "$pid" 2>/dev/null
	mps_stop "$out/overlap-mps-server.log"
	return $ret
}

# The Python GPU suites under the machine's python3 and torch; pytest its
# own, or the bundle's (python/vendor) when it has none.
torch_pytest() {
	local path=$here/python
	python3 -c 'import pytest' 2> /dev/null || path=$path:$here/python/vendor
	PYTHONPATH=$path python3 -m pytest -q -rs -p no:cacheprovider "$here/python/tests"
}

case ${1:-} in
__train) train_compare "$2"; exit ;;
__mps) overlap_mps "$2"; exit ;;
__torch_pytest) torch_pytest; exit ;;
__torch_bench) torch_bench time-sliced --fsdp2; exit ;;
__torch_bench_mps) torch_bench_mps "$2"; exit ;;
-h | --help)
	echo "usage: $0 OUTDIR"
	echo "Run shardd's GPU check (every GPU suite, compute-sanitizer, train_mlp cuda"
	echo "against host, the Python GPU suites, shardbench gpu, the overlap under load and"
	echo "train_gpt against FSDP2, with and without MPS) in at most 7 minutes; full logs"
	echo "in OUTDIR, the summary table last (docs/CUDA.md)."
	echo "Without a GPU every step is skipped, with exit status 0."
	exit 0
	;;
-*)
	echo "$0: unknown option '$1' (usage: $0 OUTDIR)" >&2
	exit 2
	;;
esac
if [ $# -ne 1 ]; then
	echo "usage: $0 OUTDIR" >&2
	exit 2
fi

# ---- the check -------------------------------------------------------------

mkdir -p "$1" || exit 1
out=$(cd "$1" && pwd)
start=$(date +%s)
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SHARDD_BIN=$here/build/shardd SHARDD_BUILD=$here/build PYTHONPATH=$here/python
rm -f "$out/summary.tsv"

suites=()
for t in "$here"/build/tests/gpu/test_*; do
	[ -x "$t" ] && suites+=("$(basename "$t")")
done
# In-process suites: the backend and kernels in this process, no daemon.
memcheck=(test_cuda_kernels test_cuda_backend test_cuda_step)
steps=("${suites[@]}")
for t in "${memcheck[@]}"; do steps+=("memcheck:$t"); done
steps+=(train_mlp_cuda_vs_host torch_pytest shardbench_gpu overlap_time_sliced torch_bench
	overlap_mps torch_bench_mps)

record() {
	printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$out/summary.tsv"
}

summary() {
	local s line
	{
		printf '\n# shardd GPU check: %s\n' "$(date -u '+%Y-%m-%d %H:%M:%S UTC')"
		printf '# %s\n' "$gpu_line"
		printf '%-34s %-8s %6s  %s\n' step status secs note
		for s in "${steps[@]}"; do
			line=$(awk -F'\t' -v s="$s" '$1 == s' "$out/summary.tsv" | tail -n 1)
			[ -n "$line" ] || line=$(printf '%s\tSKIP\t0\tnot reached' "$s")
			IFS=$'\t' read -r name st secs note <<< "$line"
			printf '%-34s %-8s %6s  %s\n' "$name" "$st" "$secs" "$note"
		done
		printf '# total %s s; logs in %s\n' "$(($(date +%s) - start))" "$out"
	} | tee "$out/summary.txt"
}

skip_all() {
	local s
	gpu_line="no GPU check: $1"
	echo "shardd GPU check skipped: $1"
	for s in "${steps[@]}"; do record "$s" SKIP 0 "$1"; done
	summary
	exit 0
}

if [ "$(cat "$here/CUDA" 2>/dev/null)" != 1 ]; then
	skip_all "this bundle was built without CUDA (make CUDA=1 gpu-check needs nvcc and nccl.h)"
fi
if ! command -v nvidia-smi > /dev/null 2>&1; then
	skip_all "nvidia-smi not found (no NVIDIA driver on this machine)"
fi
if ! gpus=$(nvidia-smi -L 2>&1); then
	skip_all "nvidia-smi -L failed: $(echo "$gpus" | head -n 1)"
fi
if ! echo "$gpus" | grep -q '^GPU '; then
	skip_all "nvidia-smi -L lists no GPU"
fi
gpu_line="$(echo "$gpus" | grep -c '^GPU ') GPU(s): $(echo "$gpus" | grep '^GPU ' | head -n 1);"
gpu_line="$gpu_line driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)"
nvidia-smi > "$out/nvidia-smi.log" 2>&1

# step NAME CAP_S CMD...: CMD under timeout, bounded by what is left of the budget.
step() {
	local name=$1 cap=$2 left t0 rc st note log
	shift 2
	log="$out/${name//:/-}.log"
	left=$((BUDGET_S - ($(date +%s) - start)))
	[ "$left" -lt "$cap" ] && cap=$left
	if [ "$cap" -lt 10 ]; then
		record "$name" SKIP 0 "no time left in the ${BUDGET_S} s budget"
		return
	fi
	t0=$(date +%s)
	timeout -k 5 "$cap" "$@" > "$log" 2>&1
	rc=$?
	case $rc in
	0) st=PASS ;;
	124|137) st=TIMEOUT ;;
	*) st=FAIL ;;
	esac
	note=$(grep -a 'Synthesis:' "$log" | tail -n 1 | sed 's/.*Synthesis: //')
	[ -n "$note" ] && note="$note | skipped: $(grep -ac '\[SKIP\]' "$log")"
	if grep -aq 'ERROR SUMMARY' "$log"; then
		note="$note | sanitizer: $(grep -a 'ERROR SUMMARY' "$log" | grep -avc ' 0 errors') of"
		note="$note $(grep -ac 'ERROR SUMMARY' "$log") processes with errors"
	fi
	[ -z "$note" ] && note=$(grep -a -E 'bit-identical|differ|skipped|passed|failed|^shardd [0-9]+ ranks' \
		"$log" | tail -n 1)
	[ "$st" = TIMEOUT ] && note="killed after $cap s; $note"
	record "$name" "$st" "$(($(date +%s) - t0))" "${note:-rc $rc}"
}

# 1. Correctness, in parallel.
for t in "${suites[@]}"; do
	step "$t" 170 "$here/build/tests/gpu/$t" --jobs 1 --verbose &
done
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
for t in "${memcheck[@]}"; do
	if [ -z "$sanitizer" ]; then
		record "memcheck:$t" SKIP 0 "compute-sanitizer not found"
	elif [ ! -x "$here/build/tests/gpu/$t" ]; then
		record "memcheck:$t" SKIP 0 "$t not in this bundle"
	else
		step "memcheck:$t" 170 "$sanitizer" --tool memcheck --error-exitcode 99 \
			--target-processes all "$here/build/tests/gpu/$t" --jobs 1 &
	fi
done
step train_mlp_cuda_vs_host 120 "$self" __train "$out" &
# The machine's python3 must have torch and numpy (the bundle carries neither).
if ! python3 -c 'import torch, numpy' > /dev/null 2>&1; then
	no_torch="python3 lacks torch or numpy ($(command -v python3 || echo 'no python3'))"
	record torch_pytest SKIP 0 "$no_torch"
else
	no_torch=
	step torch_pytest 240 "$self" __torch_pytest &
fi
wait

# 2. Measurements, one at a time on an otherwise idle GPU.
step shardbench_gpu 45 "$here/build/shardbench" gpu "${SIZES[@]}" -n 20
step overlap_time_sliced 45 "$here/build/shardbench" gpu --load "${SIZES[@]}" -n 20
if [ -n "$no_torch" ]; then
	record torch_bench SKIP 0 "$no_torch"
else
	step torch_bench 120 "$self" __torch_bench
fi
if command -v nvidia-cuda-mps-control > /dev/null 2>&1; then
	step overlap_mps 60 "$self" __mps "$out"
	if [ -n "$no_torch" ]; then
		record torch_bench_mps SKIP 0 "$no_torch"
	else
		step torch_bench_mps 120 "$self" __torch_bench_mps "$out"
	fi
else
	record overlap_mps SKIP 0 "nvidia-cuda-mps-control not found"
	record torch_bench_mps SKIP 0 "nvidia-cuda-mps-control not found"
fi

summary
! awk -F'\t' '$2 == "FAIL" || $2 == "TIMEOUT" { bad = 1 } END { exit !bad }' "$out/summary.tsv"
