#!/usr/bin/env bash
# Debian packages shardd needs to build, test and benchmark.
#   deps.sh check    exit 0 when everything is installed, else list what is missing
#   deps.sh install  install what is missing with apt-get (root), or print the command
set -euo pipefail

PACKAGES=(
	gcc make pkg-config
	liburing-dev        # daemon event loop
	libcriterion-dev    # C test suites
	libjansson-dev      # admin requests and shardctl --json
	libmicrohttpd-dev   # shardd --metrics-listen (Prometheus over HTTP)
	scdoc man-db        # man pages: built from man/*.scd, rendered by the install test
	clang libclang-rt-dev  # libFuzzer targets (tests/fuzz/): clang and its matching runtimes
	libopenmpi-dev openmpi-bin   # shardd --world mpi (daemon/world.c), shardbench's Open MPI comparator
	python3 python3-numpy python3-pytest python3-torch   # Python client tests (/usr/bin/python3)
	bible-kjv bible-kjv-text   # train_gpt.py's corpus (the `bible` program decodes the text)
)

missing=()
for p in "${PACKAGES[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done

case "${1:-check}" in
check)
	if [ ${#missing[@]} -gt 0 ]; then
		echo "shardd: missing Debian packages: ${missing[*]}" >&2
		exit 1
	fi
	;;
install)
	[ ${#missing[@]} -eq 0 ] && exit 0
	cmd="apt-get install -y --no-install-recommends ${missing[*]}"
	if [ "$(id -u)" -ne 0 ]; then
		echo "shardd: missing Debian packages; run as root:" >&2
		echo "  apt-get update && $cmd" >&2
		exit 1
	fi
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	$cmd
	;;
*)
	echo "usage: $0 check|install" >&2
	exit 2
	;;
esac
