#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# The main job (make train): a real FSDP2 training run through shardd.
#
#   tools/train.sh BUILD
#
# Starts BUILD/shardd on a private socket with a private --state-dir, waits
# for its "shardd: ready on PATH" line, and trains the MLP of
# client/examples/mlp/ (train_mlp) with TRAIN_RANKS (default 4) rank
# processes, printing "step N loss X" per step, in two runs that show a
# checkpoint and a resume (docs/CHECKPOINTS.md):
#
#   1. train_mlp --resume --checkpoint-every TRAIN_EVERY (default 10) for
#      two thirds of TRAIN_STEPS (default 30) steps: the daemon writes a
#      checkpoint every TRAIN_EVERY steps; then the daemon is killed with
#      SIGKILL, as a crash would, and started again on the same --state-dir;
#   2. the same command for TRAIN_STEPS steps: it prints "resume at step N"
#      (the newest checkpoint's step) and trains from there to the end.
#
# Checks that the second run resumed at the expected step and that the loss
# fell to under half its first value, and stops the daemon with SIGTERM.
# Exits non-zero on any failure; the daemon and the temporary directory are
# cleaned up on every exit path.
set -euo pipefail

usage="usage: tools/train.sh BUILD   (the build directory, e.g. build; TRAIN_RANKS, TRAIN_STEPS, TRAIN_EVERY)"
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
every=${TRAIN_EVERY:-10}
ready_timeout_s=30
first_steps=$((steps * 2 / 3))
if ! [[ $every =~ ^[0-9]+$ ]] || (( every < 1 || every > first_steps )); then
	echo "train.sh: TRAIN_EVERY=$every is not a number of steps in 1..$first_steps (two thirds of" \
	     "TRAIN_STEPS=$steps, where the first run stops)" >&2
	exit 2
fi
resume_at=$((first_steps / every * every))

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

state=$tmp/state

# Start the daemon (the nth time), on a socket of its own (a killed daemon's
# socket may take a moment to be released): its stderr goes through a FIFO
# so that this script can wait for its ready line, then keeps flowing to
# our stderr.
start_daemon() {
	local fifo=$tmp/daemon$1.log ready=0 deadline line

	sock=$tmp/shardd$1.sock
	mkfifo "$fifo"
	"$build/shardd" --socket "$sock" --state-dir "$state" 2>"$fifo" &
	daemon_pid=$!
	exec 3<"$fifo"
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
	exec 3<&-
}

train() {
	"$build/examples/train_mlp" --spawn "$ranks" --steps "$1" --socket "$sock" \
		--job train_mlp --checkpoint-every "$every" --resume
}

start_daemon 1
echo "train.sh: training a 32-64-64-1 MLP with $ranks ranks for $first_steps of $steps steps" \
     "through shardd, a checkpoint every $every steps into $state" >&2
train "$first_steps" | tee "$tmp/loss1.txt"

echo "train.sh: killing shardd (pid $daemon_pid) with SIGKILL, as a crash would; starting it" \
     "again on the same --state-dir" >&2
kill -KILL "$daemon_pid"
wait "$daemon_pid" 2>/dev/null || true
wait "$drain_pid" 2>/dev/null || true
daemon_pid=
drain_pid=
start_daemon 2
echo "train.sh: the same command for $steps steps resumes from the newest checkpoint" >&2
train "$steps" | tee "$tmp/loss2.txt"
if ! grep -qx "resume at step $resume_at of $steps" "$tmp/loss2.txt"; then
	echo "train.sh: the second run did not print 'resume at step $resume_at of $steps'" >&2
	exit 1
fi

first=$(awk '$1 == "step" { print $4; exit }' "$tmp/loss1.txt")
last=$(awk '$1 == "step" { v = $4 } END { print v }' "$tmp/loss2.txt")
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
