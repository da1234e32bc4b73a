#!/usr/bin/env bash
# The "may include" rules of docs/DESIGN.md's layout table, checked against
# the include paths the Makefile gives each folder (INC_*, passed in the
# environment by tests/includes/includes.mk; make test runs it).
#
# A probe is a one-line file, `#include "H"`, compiled with folder F's
# include path from a directory holding no header, as a file of F that
# includes H by its bare name would be. A header F may include must
# compile; one it may not must fail as not found, so the build refuses it.
# Also: no header name appears twice in the folders the tests see by bare
# name, and no include walks around the path with "../".
#
#   check_includes.sh WORKDIR     (CC, INC_proto ... INC_tests from the environment)
set -euo pipefail

work=${1:?usage: check_includes.sh WORKDIR}
cc=${CC:-cc}
cflags=(-std=gnu11 -Wall -Wextra -Werror -fsyntax-only)
fails=0
mkdir -p "$work"
probe="$work/probe.c"

# folder|its include path|headers it may include|headers it may not
rules=(
	"proto|$INC_proto|shardd_proto.h shardd_ring.h shardd_ctrl.h shardd_socket.h shardd_cuda.h|shardd_kernels.h log.h shardd.h harness.h"
	"kernels|$INC_kernels|shardd_kernels.h shardd_cuda_kernels.h shardd_proto.h|log.h engine.h shardd.h internal.h harness.h"
	"daemon|$INC_daemon|server.h admin.h session.h engine.h backend.h log.h shardd_kernels.h shardd_proto.h shardd_ring.h|backend_cuda_int.h shardd.h internal.h cuda_import.h harness.h bench.h client/shardd.h"
	"daemon/admin|$INC_admin|admin.h state.h session.h engine.h log.h|server.h shardd.h"
	"daemon/session|$INC_session|session.h job.h metrics.h engine.h backend.h world.h memlimit.h|admin.h state.h server.h"
	"daemon/engine|$INC_engine|engine_int.h safetensors.h backend.h world.h layout.h pool.h shardd_kernels.h|session.h job.h admin.h server.h backend_cuda_int.h"
	"daemon/backend|$INC_backend|backend.h backend_cuda.h world_boot.h placement.h pool.h shardd_kernels.h|engine.h engine_int.h group.h backend_cuda_int.h session.h"
	"daemon/backend/cuda|$INC_cuda|backend_cuda_int.h backend.h world.h placement.h log.h|engine.h group.h safetensors.h session.h"
	"daemon/ckpt|$INC_ckpt|safetensors.h ckpt_files.h layout.h log.h|engine.h engine_int.h backend.h world.h session.h"
	"daemon/world|$INC_world|world.h world_boot.h clock.h log.h shardd_proto.h|layout.h backend.h engine.h session.h shardd_kernels.h"
	"daemon/layout|$INC_layout|layout.h placement.h log.h shardd_proto.h|world.h backend.h engine.h shardd_kernels.h"
	"daemon/core|$INC_core|log.h loop.h pool.h clock.h memlimit.h config.h shardd_proto.h|layout.h world.h backend.h engine.h session.h admin.h shardd_kernels.h"
	"client|$INC_client|shardd.h internal.h shardd_proto.h shardd_ring.h shardd_exec.h shardd_kernels.h|log.h engine.h harness.h daemon/core/log.h"
	"tools|$INC_tools|shardd.h shardd_proto.h shardd_socket.h|log.h engine.h shardd_kernels.h harness.h"
	"tools/shardbench|$INC_shardbench|bench.h shardd.h shardd_cuda_kernels.h|log.h engine.h harness.h"
	"tests|$INC_tests|harness.h engine.h shardd.h internal.h shardd_kernels.h shardd_proto.h launch.h|"
)

for rule in "${rules[@]}"; do
	IFS='|' read -r folder inc allowed forbidden <<<"$rule"
	read -r -a incv <<<"$inc"
	for h in $allowed; do
		printf '#include "%s"\n' "$h" >"$probe"
		if ! out=$("$cc" "${cflags[@]}" "${incv[@]}" "$probe" 2>&1); then
			echo "check_includes: $folder/ may include \"$h\" but it does not compile with $inc:"
			echo "$out" | head -5
			fails=$((fails + 1))
		fi
	done
	for h in $forbidden; do
		printf '#include "%s"\n' "$h" >"$probe"
		if out=$("$cc" "${cflags[@]}" "${incv[@]}" "$probe" 2>&1); then
			echo "check_includes: $folder/ may not include \"$h\" (docs/DESIGN.md) but it compiles with $inc"
			fails=$((fails + 1))
		elif ! grep -qE "$h: No such file|'$h' file not found" <<<"$out"; then
			echo "check_includes: \"$h\" from $folder/ failed for another reason than not being found:"
			echo "$out" | head -5
			fails=$((fails + 1))
		fi
	done
done

# The tests see these folders by bare name: a header name in two of them would hide one.
dup=$(for d in $INC_tests; do [ "$d" = -iquote ] || ls "$d"/*.h; done | xargs -n1 basename | sort | uniq -d)
if [ -n "$dup" ]; then
	echo "check_includes: header names in more than one folder on the tests' path ($INC_tests): $dup"
	fails=$((fails + 1))
fi

up=$(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"\.\./' proto kernels daemon client tools tests \
	--include='*.c' --include='*.h' --include='*.cu' || true)
if [ -n "$up" ]; then
	echo "check_includes: includes that walk around the include path with \"../\":"
	echo "$up"
	fails=$((fails + 1))
fi

rm -f "$probe"
if [ "$fails" -ne 0 ]; then
	echo "check_includes: $fails failure(s)"
	exit 1
fi
echo "check_includes: every folder includes only what docs/DESIGN.md allows"
