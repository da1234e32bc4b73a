#!/bin/sh
# SPDX-License-Identifier: MIT
# Run the GPU test binaries, or skip cleanly where they cannot run.
#
#   tools/setup/test_gpu.sh BUILD HAVE_CUDA [gpu test binaries...]
#
# Skips (exit 0, one "skipped: ..." line saying why) when the build has no
# CUDA, when nvidia-smi is missing or fails, or when it lists no GPU.
# Otherwise runs every binary and fails if any fails.
set -u

if [ $# -lt 2 ]; then
	echo "usage: $0 BUILD HAVE_CUDA [gpu test binaries...]" >&2
	exit 2
fi
build=$1
have_cuda=$2
shift 2

if [ "$have_cuda" != 1 ]; then
	echo "skipped: GPU tests: built without CUDA (HAVE_CUDA=$have_cuda; needs nvcc and nccl.h, or make CUDA=1)"
	exit 0
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
	echo "skipped: GPU tests: nvidia-smi not found (no NVIDIA driver on this machine)"
	exit 0
fi
if ! gpus=$(nvidia-smi -L 2>&1); then
	echo "skipped: GPU tests: nvidia-smi -L failed: $(echo "$gpus" | head -n 1)"
	exit 0
fi
if ! echo "$gpus" | grep -q '^GPU '; then
	echo "skipped: GPU tests: nvidia-smi -L lists no GPU"
	exit 0
fi
if [ $# -eq 0 ]; then
	echo "test_gpu: no GPU test binaries were built in $build; nothing ran" >&2
	exit 1
fi

failed=
for t in "$@"; do
	echo "== $t"
	if ! SHARDD_BUILD=$build "$t" --jobs 1; then
		failed="$failed $t"
	fi
done
if [ -n "$failed" ]; then
	echo "test_gpu: failed:$failed" >&2
	exit 1
fi
echo "test_gpu: all $# GPU suites passed"
