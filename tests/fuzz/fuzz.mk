# libFuzzer targets of the daemon (tests/fuzz/, docs/RELIABILITY.md), included
# by the top Makefile. Built with clang out of tree in build-fuzz/ (the gcc
# builds in build/ and build-san/ are untouched): the daemon's and kernels'
# sources with -fsanitize=fuzzer-no-link,address,undefined, linked with
# -fsanitize=fuzzer.
#
#   make fuzz FUZZ_SECONDS=N   run each target N seconds (default 60) on its
#                              committed corpus; new inputs go to
#                              build-fuzz/corpus/<target>, crashes to build-fuzz/
#   make fuzz-ci               each target FUZZ_CI_SECONDS (default 25) on a
#                              temporary copy of its corpus (make test runs it)

FUZZ_CC          ?= clang
FUZZ_SECONDS     ?= 60
FUZZ_CI_SECONDS  ?= 25
FUZZ_BUILD       := build-fuzz
# Ring and socket work per input is bounded by the input: 4 KiB programs are plenty.
FUZZ_FLAGS       ?= -max_len=4096 -timeout=30 -rss_limit_mb=4096 -malloc_limit_mb=1024 \
		    -print_final_stats=1
FUZZ_SAN         := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
# Include paths: each source's folder's, as in the gcc builds (inc_of, Makefile).
FUZZ_CFLAGS      := -O1 -g -std=gnu11 -Wall -Wextra $(WERROR_FLAGS) -pthread -MMD -MP \
		    -DSHARDD_VERSION='"$(VERSION)"' $(FUZZ_SAN)

# Every target links the daemon, the kernels and the harness (fuzz_daemon.c
# and harness_*.c); each tests/fuzz/fuzz_*.c but fuzz_daemon.c is a target.
FUZZ_LIB_SRC := $(filter-out daemon/backend/cuda/%.c,$(DAEMON_ALL_SRC)) \
		$(wildcard kernels/*.c) tests/fuzz/fuzz_daemon.c $(wildcard tests/fuzz/harness_*.c)
FUZZ_TARGETS := $(patsubst tests/fuzz/%.c,%,$(filter-out tests/fuzz/fuzz_daemon.c,$(wildcard tests/fuzz/fuzz_*.c)))
FUZZ_BIN     := $(addprefix $(FUZZ_BUILD)/,$(FUZZ_TARGETS))
FUZZ_OBJ     := $(patsubst %.c,$(FUZZ_BUILD)/%.o,$(FUZZ_LIB_SRC))

.PHONY: fuzz fuzz-build fuzz-ci clean-fuzz

fuzz-build: $(FUZZ_BIN)

$(FUZZ_BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(call inc_of,$<) $(FUZZ_EXTRA) -fsanitize=fuzzer-no-link -c $< -o $@

# The kernels are written for gcc: clang 14 lacks __builtin_cpu_supports("f16c")
# (clang_compat.h).
$(FUZZ_BUILD)/kernels/%.o: FUZZ_EXTRA := -include tests/fuzz/clang_compat.h
# optim.c's `#pragma GCC optimize("fp-contract=off")` is gcc's; clang keeps
# its own contraction, which changes rounding only, not what the fuzzer finds.
$(FUZZ_BUILD)/kernels/optim.o: FUZZ_EXTRA += -Wno-unknown-pragmas
# The daemon world includes mpi.h (Makefile, MPI_CFLAGS).
$(FUZZ_BUILD)/daemon/world/world.o: FUZZ_EXTRA := $(MPI_CFLAGS)

$(FUZZ_BUILD)/fuzz_%: $(FUZZ_BUILD)/tests/fuzz/fuzz_%.o $(FUZZ_OBJ)
	$(FUZZ_CC) $(FUZZ_SAN) -fsanitize=fuzzer -pthread -o $@ $^ $(LDLIBS) $(MPI_LIBS)

# fuzz_ckpt drives the checkpoint parsers directly, without the daemon harness.
$(FUZZ_BUILD)/fuzz_ckpt: $(FUZZ_BUILD)/tests/fuzz/fuzz_ckpt.o $(FUZZ_BUILD)/daemon/ckpt/safetensors.o \
		$(FUZZ_BUILD)/daemon/ckpt/safetensors_parse.o $(FUZZ_BUILD)/daemon/ckpt/safetensors_write.o \
		$(FUZZ_BUILD)/daemon/layout/layout.o
	$(FUZZ_CC) $(FUZZ_SAN) -fsanitize=fuzzer -pthread -o $@ $^ $(LDLIBS)

fuzz: $(FUZZ_BIN)
	@set -e; for t in $(FUZZ_TARGETS); do \
		mkdir -p $(FUZZ_BUILD)/corpus/$$t; \
		echo "== $$t: $(FUZZ_SECONDS) s"; \
		$(FUZZ_BUILD)/$$t $(FUZZ_FLAGS) -max_total_time=$(FUZZ_SECONDS) \
			-artifact_prefix=$(FUZZ_BUILD)/$$t- $(FUZZ_BUILD)/corpus/$$t tests/fuzz/corpus/$$t; \
	done

# The committed corpus is read only: libFuzzer adds new inputs to the first
# directory it is given, here a temporary one.
fuzz-ci: $(FUZZ_BIN)
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	for t in $(FUZZ_TARGETS); do \
		mkdir -p "$$tmp/$$t"; \
		echo "== $$t: $(FUZZ_CI_SECONDS) s on tests/fuzz/corpus/$$t"; \
		if ! $(FUZZ_BUILD)/$$t $(FUZZ_FLAGS) -max_total_time=$(FUZZ_CI_SECONDS) \
			-artifact_prefix=$(FUZZ_BUILD)/$$t- "$$tmp/$$t" tests/fuzz/corpus/$$t \
			> "$$tmp/$$t.log" 2>&1; then \
			tail -n 60 "$$tmp/$$t.log"; exit 1; \
		fi; \
		grep -E '(INITED|DONE) +cov|^stat::(number_of_executed_units|new_units_added|peak_rss_mb)' "$$tmp/$$t.log" || true; \
	done

test: fuzz-ci

clean: clean-fuzz
clean-fuzz:
	rm -rf build-fuzz

-include $(shell find $(FUZZ_BUILD) -name '*.d' 2>/dev/null)
