#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# The main job (make train): a real FSDP2 training run through shardd.
#
#   tools/train.sh BUILD
#
# Starts BUILD/shardd on a private socket, waits for its "shardd: ready on
# PATH" line, trains the MLP of client/examples/mlp/ (train_mlp) with
# TRAIN_RANKS (default 4) rank processes for TRAIN_STEPS (default 30) steps,
# printing "step N loss X" per step, checks that the loss fell to under half
# its first value, and stops the daemon with SIGTERM. Exits non-zero on any
# failure; the daemon and the temporary directory are cleaned up on every
# exit path.
set -euo pipefail

usage="usage: tools/train.sh BUILD   (the build directory, e.g. build; TRAIN_RANKS, TRAIN_STEPS)"
if [[ $# -eq 1 && $1 == --help ]]; then
	echo "$usage"
	exit 0
fi
if [[ $# -ne 1 ]]; then
	echo "$usage" >&2
	exit 2
fi
build=$1
ranks=${TRAIN_RANKS:-4}
steps=${TRAIN_STEPS:-30}
ready_timeout_s=30

for bin in "$build/shardd" "$build/examples/train_mlp"; do
	if [[ ! -x $bin ]]; then
		echo "train.sh: $bin is missing; run 'make BUILD=$build' first" >&2
		exit 1
	fi
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/shardd-train.XXXXXX")
daemon_pid=
drain_pid=

cleanup() {
	local rc=$?
	trap - EXIT INT TERM
	if [[ -n $daemon_pid ]] && kill -0 "$daemon_pid" 2>/dev/null; then
		kill -TERM "$daemon_pid" 2>/dev/null || true
		wait "$daemon_pid" 2>/dev/null || true
	fi
	if [[ -n $drain_pid ]]; then
		wait "$drain_pid" 2>/dev/null || true
	fi
	exec 3<&- 2>/dev/null || true
	rm -rf "$tmp"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

sock=$tmp/shardd.sock
# The daemon's stderr goes through a FIFO so that this script can wait for
# its ready line, then keeps flowing to our stderr.
mkfifo "$tmp/daemon.log"
"$build/shardd" --socket "$sock" 2>"$tmp/daemon.log" &
daemon_pid=$!
exec 3<"$tmp/daemon.log"

ready=0
deadline=$((SECONDS + ready_timeout_s))
while (( SECONDS < deadline )) && IFS= read -r -t "$((deadline - SECONDS))" -u 3 line; do
	printf '%s\n' "$line" >&2
	if [[ $line == "shardd: ready on "* ]]; then
		ready=1
		break
	fi
done
if (( !ready )); then
	echo "train.sh: shardd (pid $daemon_pid) did not print 'shardd: ready on $sock'" \
	     "within ${ready_timeout_s} s or exited; its log is above" >&2
	exit 1
fi
cat <&3 >&2 &
drain_pid=$!

echo "train.sh: training a 32-64-64-1 MLP with $ranks ranks for $steps steps through shardd" >&2
"$build/examples/train_mlp" --spawn "$ranks" --steps "$steps" --socket "$sock" \
	--job train_mlp | tee "$tmp/loss.txt"

first=$(awk '$1 == "step" { print $4; exit }' "$tmp/loss.txt")
last=$(awk '$1 == "step" { v = $4 } END { print v }' "$tmp/loss.txt")
if [[ -z $first || -z $last ]]; then
	echo "train.sh: train_mlp printed no 'step N loss X' lines" >&2
	exit 1
fi
if ! awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f / 2) }'; then
	echo "train.sh: the loss did not fall to under half: first $first, last $last" >&2
	exit 1
fi
echo "train.sh: loss fell from $first to $last" >&2

kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=
if (( rc != 0 )); then
	echo "train.sh: shardd exited with status $rc after SIGTERM (expected 0)" >&2
	exit 1
fi
