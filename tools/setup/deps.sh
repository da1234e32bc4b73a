#!/usr/bin/env bash
# Debian packages shardd needs to build, test and benchmark.
#   deps.sh check [packages]    exit 0 when everything is installed, else list what is missing
#   deps.sh install [packages]  install what is missing with apt-get (root), or print the command
# With `packages`, only the Debian packages: what `make train` needs, so that it
# runs offline once they are there. Without it, also the virtual environment of
# the PyPI packages some tests use (below), which needs PyPI.
set -euo pipefail

PACKAGES=(
	gcc make pkg-config
	liburing-dev        # daemon event loop
	libcriterion-dev    # C test suites
	libjansson-dev      # admin requests and shardctl --json
	zlib1g-dev          # checkpoint file checksums (crc32)
	libmicrohttpd-dev   # shardd --metrics-listen (Prometheus over HTTP)
	scdoc man-db        # man pages: built from man/*.scd, rendered by the install test
	clang libclang-rt-dev  # libFuzzer targets (tests/fuzz/): clang and its matching runtimes
	clang-format        # the C style (.clang-format): make format, checked by make test
	libopenmpi-dev openmpi-bin   # shardd --world mpi (daemon/world/world.c), shardbench's Open MPI comparator
	python3 python3-numpy python3-pytest python3-torch   # Python client tests (/usr/bin/python3)
	python3-venv        # the virtual environment of the PyPI test packages below
	bible-kjv bible-kjv-text   # train_gpt.py's corpus (the `bible` program decodes the text)
)

# PyPI packages the Python tests need (tests/python/test_checkpoint.py: the
# safetensors interop), in a virtual environment that also sees Debian's
# packages (numpy): $SHARDD_VENV, default build/venv.
PYPI=(safetensors)
VENV="${SHARDD_VENV:-build/venv}"
venv_ok() {
	[ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import safetensors" 2>/dev/null
}
venv_install() {
	venv_ok && return 0
	/usr/bin/python3 -m venv --system-site-packages "$VENV" &&
		"$VENV/bin/pip" install -q "${PYPI[@]}"
}

missing=()
for p in "${PACKAGES[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done

case "${2:-all}" in
all) with_venv=1 ;;
packages) with_venv=0 ;;
*)
	echo "usage: $0 check|install [packages]" >&2
	exit 2
	;;
esac

case "${1:-check}" in
check)
	if [ ${#missing[@]} -gt 0 ]; then
		echo "shardd: missing Debian packages: ${missing[*]}" >&2
		exit 1
	fi
	if [ "$with_venv" -eq 1 ] && ! venv_ok; then
		echo "shardd: missing the virtual environment $VENV with PyPI packages: ${PYPI[*]}" >&2
		exit 1
	fi
	;;
install)
	if [ ${#missing[@]} -eq 0 ]; then
		[ "$with_venv" -eq 0 ] || venv_install
		exit
	fi
	cmd="apt-get install -y --no-install-recommends ${missing[*]}"
	if [ "$(id -u)" -ne 0 ]; then
		echo "shardd: missing Debian packages; run as root:" >&2
		echo "  apt-get update && $cmd" >&2
		exit 1
	fi
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	$cmd
	[ "$with_venv" -eq 0 ] || venv_install
	;;
*)
	echo "usage: $0 check|install [packages]" >&2
	exit 2
	;;
esac
