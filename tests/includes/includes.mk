# The include rules of docs/DESIGN.md's layout table, checked against the
# Makefile's per-folder include paths (INC_*), and the WERROR switch;
# included by the top Makefile, run by make test.
.PHONY: test-includes

test-includes:
	@CC='$(CC)' INC_proto='$(INC_proto)' INC_kernels='$(INC_kernels)' \
		INC_daemon='$(INC_daemon)' INC_client='$(INC_client)' INC_tools='$(INC_tools)' \
		INC_shardbench='$(INC_tools/shardbench)' INC_tests='$(INC_tests)' \
		tests/includes/check_includes.sh $(BUILD)/includes
	@# -Werror comes with WERROR=1 and only then (a compile line as make would run it).
	@$(MAKE) --no-print-directory -n -B WERROR=1 $(BUILD)/kernels/copy.o | grep -q -- '-Werror' || \
		{ echo "test-includes: WERROR=1 does not add -Werror"; exit 1; }
	@! $(MAKE) --no-print-directory -n -B WERROR=0 $(BUILD)/kernels/copy.o | grep -q -- '-Werror' || \
		{ echo "test-includes: -Werror without WERROR=1"; exit 1; }
	@echo "test-includes: -Werror by WERROR=1 only"

test: test-includes
