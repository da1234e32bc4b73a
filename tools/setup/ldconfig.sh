#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# After make install / uninstall: refresh the run-time linker's cache so
# programs find libshardd.so.0, or say what to do when that is not ours to do.
#   ldconfig.sh install|uninstall LIBDIR DESTDIR
set -euo pipefail

if [[ $# -ne 3 || ( $1 != install && $1 != uninstall ) ]]; then
	echo "usage: $0 install|uninstall LIBDIR DESTDIR" >&2
	exit 2
fi
what=$1 libdir=$2 destdir=$3

# A staged install (DESTDIR, a package build) is the packager's to register.
[[ -n $destdir ]] && exit 0

# Does ld.so search libdir? Its trusted directories, or one listed in ld.so.conf.
searched=0
case $libdir in
/lib | /usr/lib | /lib64 | /usr/lib64) searched=1 ;;
*)
	if ldconfig -v -N 2>/dev/null | grep -q "^${libdir}:"; then
		searched=1
	fi
	;;
esac

if [[ $searched -eq 1 && $(id -u) -eq 0 ]]; then
	ldconfig
elif [[ $what == install ]]; then
	if [[ $searched -eq 1 ]]; then
		echo "note: run 'ldconfig' as root so programs find libshardd.so.0 in $libdir"
	else
		echo "note: $libdir is not in the run-time linker's path; run programs with"
		echo "      LD_LIBRARY_PATH=$libdir, link them with -Wl,-rpath,$libdir, or add"
		echo "      $libdir to a file in /etc/ld.so.conf.d/ and run ldconfig as root"
	fi
fi
