#!/bin/sh
# SPDX-License-Identifier: MIT
# Build the GPU check bundle (make gpu-check; docs/CUDA.md "The GPU check").
#
#   tools/setup/gpu_check.sh BUILD HAVE_CUDA OUT [gpu test binaries...]
#
# OUT becomes one self-contained folder for a bare GPU machine (Ubuntu
# 24.04, the NVIDIA driver, CUDA and NCCL, python3 with torch and numpy, no
# Debian package of ours):
#   run                  the check itself (tools/setup/gpu_check_run.sh)
#   build/               shardd, shardctl, shardbench, examples/, tests/gpu/,
#                        laid out as BUILD is, so SHARDD_BUILD=OUT/build works
#   lib/                 every shared library they load that the target lacks
#   python/              the Python client (shardd/) and examples (examples/), the
#                        Python GPU suites (tests/), the PyTorch benchmark
#                        (gpu_torch_bench.py) and its corpus (corpus.txt: this
#                        repository's docs), and vendor/: pytest and what it
#                        imports, from $PYTHON, for a target python3 without it
#   CUDA                 HAVE_CUDA of this build (1: built with the cuda backend)
# Libraries left out come from the target, which must have its own: glibc
# (the target's 2.39 is newer than this build's, and one process cannot mix
# two), libstdc++ and libgcc_s (a python with torch in the same environment
# needs the target's newer ones), and the driver's (libcuda, libnvidia-*).
# Fails if OUT would exceed 60 MiB.
set -eu

if [ $# -lt 3 ]; then
	echo "usage: $0 BUILD HAVE_CUDA OUT [gpu test binaries...]" >&2
	exit 2
fi
build=$1
have_cuda=$2
out=$3
shift 3
limit=$((60 * 1024 * 1024))
src=$(cd "$(dirname "$0")/../.." && pwd)

rm -rf "$out"
mkdir -p "$out/build/examples" "$out/build/tests/gpu" "$out/lib" "$out/python/examples"

bins=
for b in shardd shardctl shardbench; do
	cp "$build/$b" "$out/build/$b"
	bins="$bins $out/build/$b"
done
for b in "$build"/examples/*; do
	[ -f "$b" ] && [ -x "$b" ] || continue
	cp "$b" "$out/build/examples/"
	bins="$bins $out/build/examples/$(basename "$b")"
done
for t in "$@"; do
	cp "$t" "$out/build/tests/gpu/"
	bins="$bins $out/build/tests/gpu/$(basename "$t")"
done

# Every library ldd resolves for any binary, but those the target provides.
# shellcheck disable=SC2086 # $bins is a list of paths without spaces
ldd $bins 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | sort -u |
while read -r name path; do
	case $name in
	ld-linux*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libresolv.so.*|\
	libutil.so.*|libanl.so.*|libmvec.so.*|libstdc++.so.*|libgcc_s.so.*|libcuda.so.*|libnvidia*)
		continue ;;
	esac
	cp -L "$path" "$out/lib/$name"
done

cp -R "$src/client/python/shardd" "$out/python/"
cp "$src/client/python/README.md" "$out/python/"
cp "$src"/client/examples/*.py "$out/python/examples/"
# The GPU suites with what they import; the benchmark and a corpus that needs no bible-kjv.
mkdir -p "$out/python/tests"
for f in conftest.py torch_net.py cuda_rank.py test_torch_cuda.py; do
	cp "$src/tests/python/$f" "$out/python/tests/"
done
cp "$src/tools/setup/gpu_torch_bench.py" "$out/python/"
cat "$src/README.md" "$src"/docs/*.md > "$out/python/corpus.txt"
# pytest, pure Python, for a target whose python3 has torch but no pytest.
python=${PYTHON:-python3}
if vendor=$("$python" -c 'import sys, _pytest, pytest, pluggy, iniconfig, py, attr, packaging
print(" ".join(m.__path__[0] for m in (_pytest, pytest, pluggy, iniconfig, py, attr, packaging)))' \
	2>/dev/null); then
	mkdir -p "$out/python/vendor"
	# shellcheck disable=SC2086 # paths without spaces, one per package
	cp -R $vendor "$out/python/vendor/"
else
	echo "gpu-check: $python has no pytest (python3-pytest): the bundle carries none, so the" \
	     "Python GPU suites need the target's own" >&2
fi
find "$out/python" -name __pycache__ -prune -exec rm -rf {} +
cp "$src/tools/setup/gpu_check_run.sh" "$out/run"
chmod 755 "$out/run"
echo "$have_cuda" > "$out/CUDA"

size=$(du -sb "$out" | cut -f1)
if [ "$size" -gt "$limit" ]; then
	echo "gpu-check: $out is $size bytes, over the 60 MiB a GPU session can carry;" \
	     "see what lib/ holds (ls -lS $out/lib)" >&2
	exit 1
fi
echo "gpu-check: $out ready ($((size / 1024 / 1024)) MiB, $(ls "$out/lib" | wc -l) libraries);" \
     "run it on a GPU machine: $out/run OUTDIR"
