# The include rules of docs/DESIGN.md's layout table, checked against the
# Makefile's per-folder include paths (INC_*), and the WERROR switch;
# included by the top Makefile, run by make test.
.PHONY: test-includes

test-includes:
	@CC='$(CC)' INC_proto='$(INC_proto)' INC_kernels='$(INC_kernels)' \
		INC_daemon='$(INC_daemon)' INC_admin='$(INC_daemon/admin)' \
		INC_session='$(INC_daemon/session)' INC_engine='$(INC_daemon/engine)' \
		INC_backend='$(INC_daemon/backend)' INC_cuda='$(INC_daemon/backend/cuda)' \
		INC_ckpt='$(INC_daemon/ckpt)' INC_world='$(INC_daemon/world)' \
		INC_layout='$(INC_daemon/layout)' INC_core='$(INC_daemon/core)' INC_client='$(INC_client)' INC_tools='$(INC_tools)' \
		INC_shardbench='$(INC_tools/shardbench)' INC_tests='$(INC_tests)' \
		tests/includes/check_includes.sh $(BUILD)/includes
	@# -Werror comes with WERROR=1 and only then (a compile line as make would run it).
	@$(MAKE) --no-print-directory -n -B WERROR=1 $(BUILD)/kernels/copy.o | grep -q -- '-Werror' || \
		{ echo "test-includes: WERROR=1 does not add -Werror"; exit 1; }
	@! $(MAKE) --no-print-directory -n -B WERROR=0 $(BUILD)/kernels/copy.o | grep -q -- '-Werror' || \
		{ echo "test-includes: -Werror without WERROR=1"; exit 1; }
	@echo "test-includes: -Werror by WERROR=1 only"

test: test-includes
