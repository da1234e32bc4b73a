# shardd — top-level build.
#
#   make                 build the daemon, the client libraries, the tools, the examples
#   make test            install missing packages (make deps), build, run every suite
#   make test-docs       the documents' runnable examples and the man pages' completeness
#   make train           the main job: a real training run through the daemon (README.md)
#   make test-gpu        CUDA kernel and cuda-backend tests (skip cleanly without a GPU)
#   make gpu-check       build/gpu-check/: a bundle to copy to a bare GPU machine and
#                        run there (build/gpu-check/run OUTDIR; docs/CUDA.md)
#   make install PREFIX=/usr/local DESTDIR=    (make uninstall with the same PREFIX)
#   make SANITIZE=1      ASan + UBSan build (out of tree in build-san/)
#   make CUDA=auto|0|1   build the cuda backend when nvcc and nccl.h are found (auto)
#   make WERROR=1        warnings are errors (CI: .ci/run exports WERROR=1; off by
#                        default, so a newer compiler's new warning does not stop a build)
#
# Python: the tests and the Python client run under Debian's /usr/bin/python3
# (python3-numpy, python3-pytest, python3-torch 1.13 from apt, installed by make
# deps), but for the FSDP2 side-by-side tests, whose rank scripts run on PyPI's
# torch in build/venv-torch (TORCH_VENV below).

CC       ?= gcc
CFLAGS   ?= -O2 -g -Wall -Wextra
WERROR   ?= 0
WERROR_FLAGS := $(if $(filter 1,$(WERROR)),-Werror)
override CFLAGS += -std=gnu11 $(WERROR_FLAGS) -fPIC -pthread -MMD -MP
LDFLAGS  ?=
LDLIBS   := -luring -ljansson -lmicrohttpd -lz -lpthread -lm
# Open MPI for `shardd --world mpi` (daemon/world/world.c, the only file that includes mpi.h).
MPI_CFLAGS := $(shell pkg-config --cflags ompi-c 2>/dev/null || echo -I/usr/lib/x86_64-linux-gnu/openmpi/include)
MPI_LIBS   := $(shell pkg-config --libs ompi-c 2>/dev/null || echo -lmpi)
PREFIX   ?= /usr/local
DESTDIR  ?=
PYTHON   ?= /usr/bin/python3
CUDA     ?= auto
CUDA_HOME ?= /usr/local/cuda
NVCC     ?= $(CUDA_HOME)/bin/nvcc
# sm_90 (H100/H200) machine code plus PTX for newer GPUs.
NVCCFLAGS ?= -O3 -lineinfo -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
VERSION  := 0.1.0
override CFLAGS += -DSHARDD_VERSION='"$(VERSION)"'

ifeq ($(SANITIZE),1)
BUILD    ?= build-san
override CFLAGS += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
override LDFLAGS += -fsanitize=address,undefined
else
BUILD    ?= build
endif

# ---------------------------------------------------------------- CUDA ---
ifeq ($(CUDA),auto)
HAVE_CUDA := $(shell test -x $(NVCC) && test -f $(CUDA_HOME)/include/nccl.h && echo 1 || echo 0)
else
HAVE_CUDA := $(CUDA)
endif
ifeq ($(HAVE_CUDA),1)
override CFLAGS += -DSHARDD_HAVE_CUDA=1 -I$(CUDA_HOME)/include
# No -lcuda: libcuda.so.1 exists only where a driver is installed, and shardd
# must start without one. The daemon resolves driver-API calls through
# cudaGetDriverEntryPointByVersion, libshardd through dlopen("libcuda.so.1").
# nccl.h is part of the CUDA=auto test: the cuda backend's collectives across
# GPUs are written against it, but libnccl.so.2 is not linked either: the
# daemon opens it with dlopen at the first such collective, so shardd runs
# where NCCL is absent (daemon/backend/cuda/backend_cuda_nccl.c).
CUDA_LDLIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lstdc++
endif

# ------------------------------------------------------- include paths ---
# docs/DESIGN.md's "may include" column, enforced: each folder compiles with
# the include path of the folders it may include, and nothing else (no -I.),
# so a file that includes what its folder may not fails to build. Every file
# includes a project header by its bare name, `#include "log.h"`, found in
# its own folder or on this path. -iquote, not -I: the path serves only
# `#include "..."`, so daemon/limits.h never stands in for <limits.h>.
# tests/includes/ proves the rules hold.
INC_proto    := -iquote proto
INC_kernels  := -iquote kernels -iquote proto
# The daemon's folders, bottom to top: each sees its own and those below it
# (docs/DESIGN.md, "Layout of the daemon"), never one above.
INC_daemon/core      := -iquote daemon/core -iquote proto
INC_daemon/layout    := -iquote daemon/layout $(INC_daemon/core)
INC_daemon/world     := -iquote daemon/world $(INC_daemon/core)
INC_daemon/ckpt      := -iquote daemon/ckpt $(INC_daemon/layout)
INC_daemon/backend   := -iquote daemon/backend -iquote daemon/world -iquote daemon/layout \
			-iquote daemon/core -iquote kernels -iquote proto
INC_daemon/backend/cuda := -iquote daemon/backend/cuda $(INC_daemon/backend)
INC_daemon/engine    := -iquote daemon/engine -iquote daemon/ckpt $(INC_daemon/backend)
INC_daemon/session   := -iquote daemon/session $(INC_daemon/engine)
INC_daemon/admin     := -iquote daemon/admin $(INC_daemon/session)
INC_daemon           := -iquote daemon $(INC_daemon/admin)
DAEMON_DIRS  := core layout world ckpt backend backend/cuda engine session admin
INC_client   := -iquote client -iquote kernels -iquote proto
INC_tools    := -iquote client -iquote proto
# shardbench also measures the kernels (`shardbench gpu`); mpi/ shares bench.h.
INC_tools/shardbench := -iquote tools/shardbench -iquote client -iquote proto -iquote kernels
# Tests reach everything; their header names are therefore unique across these folders.
INC_tests    := -iquote tests/lib -iquote daemon $(foreach d,$(DAEMON_DIRS),-iquote daemon/$(d)) \
		-iquote client -iquote client/examples/mlp -iquote kernels -iquote proto
# Most specific first: the include path of source $(1) is its first match.
INC_FOLDERS  := tools/shardbench proto kernels daemon/backend/cuda \
		$(addprefix daemon/,$(filter-out backend/cuda,$(DAEMON_DIRS))) daemon client tools tests
inc_of = $(INC_$(firstword $(foreach d,$(INC_FOLDERS),$(if $(filter $(d)/%,$(1)),$(d)))))

# ------------------------------------------------------------- sources ---
KERNEL_SRC  := $(wildcard kernels/*.c)
KERNEL_CU   := $(if $(filter 1,$(HAVE_CUDA)),$(wildcard kernels/*.cu))
# Every daemon source but main.c; the cuda backend's folder only with CUDA.
DAEMON_ALL_SRC := $(filter-out daemon/main.c,$(wildcard daemon/*.c $(addsuffix /*.c,$(addprefix daemon/,$(DAEMON_DIRS)))))
DAEMON_SRC  := $(filter-out $(if $(filter 1,$(HAVE_CUDA)),,daemon/backend/cuda/%.c),$(DAEMON_ALL_SRC))
CLIENT_SRC  := $(wildcard client/*.c)
SHARDCTL_SRC := $(wildcard tools/shardctl/*.c)
BENCH_SRC   := $(wildcard tools/shardbench/*.c)
EXAMPLE_SRC := $(wildcard client/examples/*.c)
UNIT_SRC    := $(wildcard tests/unit/test_*.c)
INTEG_SRC   := $(wildcard tests/integration/test_*.c)
GPU_SRC     := $(if $(filter 1,$(HAVE_CUDA)),$(wildcard tests/gpu/test_*.c))
TESTLIB_SRC := $(wildcard tests/lib/*.c)

obj = $(patsubst %.c,$(BUILD)/%.o,$(1))

KERNEL_OBJ  := $(call obj,$(KERNEL_SRC)) $(patsubst %.cu,$(BUILD)/%.cu.o,$(KERNEL_CU))
DAEMON_OBJ  := $(call obj,$(DAEMON_SRC))
CLIENT_OBJ  := $(call obj,$(CLIENT_SRC))
TESTLIB_OBJ := $(call obj,$(TESTLIB_SRC))

LIBKERNELS  := $(BUILD)/libshardd_kernels.a
LIBDAEMON   := $(BUILD)/libshardd_daemon.a
LIBCLIENT_A := $(BUILD)/libshardd.a
LIBCLIENT_SO := $(BUILD)/libshardd.so
SHARDD      := $(BUILD)/shardd
SHARDCTL    := $(if $(SHARDCTL_SRC),$(BUILD)/shardctl)
SHARDBENCH  := $(if $(BENCH_SRC),$(BUILD)/shardbench)
EXAMPLES    := $(patsubst client/examples/%.c,$(BUILD)/examples/%,$(EXAMPLE_SRC))
UNIT_BIN    := $(patsubst tests/%.c,$(BUILD)/tests/%,$(UNIT_SRC))
INTEG_BIN   := $(patsubst tests/%.c,$(BUILD)/tests/%,$(INTEG_SRC))
GPU_BIN     := $(patsubst tests/%.c,$(BUILD)/tests/%,$(GPU_SRC))

.PHONY: all test test-c test-python test-docs test-gpu gpu-check test-gpu-check train deps \
	deps-check deps-check-packages install clean
# Keep objects that pattern chains would delete as intermediates (and rebuild every time).
.SECONDARY:
all: $(SHARDD) $(LIBCLIENT_A) $(LIBCLIENT_SO) $(SHARDCTL) $(SHARDBENCH) $(EXAMPLES)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(call inc_of,$<) -c $< -o $@

$(BUILD)/daemon/world/world.o: override CFLAGS += $(MPI_CFLAGS)

$(BUILD)/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -Xcompiler -fPIC $(subst -iquote ,-I,$(call inc_of,$<)) -c $< -o $@

$(LIBKERNELS): $(KERNEL_OBJ)
	rm -f $@ && $(AR) rcs $@ $^

$(LIBDAEMON): $(DAEMON_OBJ)
	rm -f $@ && $(AR) rcs $@ $^

# The CPU kernels go with the client: a rank-executed group's ops run in the rank
# (client/exec.c) with the daemon's own arithmetic.
$(LIBCLIENT_A): $(CLIENT_OBJ) $(call obj,$(KERNEL_SRC))
	rm -f $@ && $(AR) rcs $@ $^

# client/libshardd.map: only shardd_* is exported, versioned SHARDD_0.1; the
# kernels' shardd_k_* stay inside (--exclude-libs).
$(LIBCLIENT_SO): $(CLIENT_OBJ) $(LIBKERNELS) client/libshardd.map
	$(CC) $(LDFLAGS) -shared -Wl,-soname,libshardd.so.0 -Wl,--version-script,client/libshardd.map \
		-Wl,--exclude-libs,libshardd_kernels.a -o $@ $(CLIENT_OBJ) $(LIBKERNELS) -lpthread -lm

$(SHARDD): $(BUILD)/daemon/main.o $(LIBDAEMON) $(LIBKERNELS)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS) $(MPI_LIBS) $(CUDA_LDLIBS)

$(BUILD)/shardctl: $(call obj,$(SHARDCTL_SRC)) $(LIBCLIENT_A)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/shardbench: $(call obj,$(BENCH_SRC)) $(LIBCLIENT_A) $(LIBKERNELS)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS) $(CUDA_LDLIBS)

$(BUILD)/examples/%: $(BUILD)/client/examples/%.o $(LIBCLIENT_A)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -lpthread -lm $(CUDA_LDLIBS)

$(BUILD)/tests/%: $(BUILD)/tests/%.o $(TESTLIB_OBJ) $(LIBDAEMON) $(LIBCLIENT_A) $(LIBKERNELS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $^ -lcriterion $(LDLIBS) $(MPI_LIBS) $(CUDA_LDLIBS)


# ---------------------------------------------------------------- deps ---
deps:
	tools/setup/deps.sh install

deps-check:
	@tools/setup/deps.sh check || tools/setup/deps.sh install

# make train needs the Debian packages only, never PyPI: it runs offline once
# they are installed (the PyPI venv of deps-check is for tests that use it).
deps-check-packages:
	@tools/setup/deps.sh check packages || tools/setup/deps.sh install packages

# ---------------------------------------------------------------- test ---
# Each Criterion binary runs on its own; every test in it carries a timeout.
# The GPU suites are built here too, so a change that breaks them fails without a GPU.
test: deps-check
	$(MAKE) all $(UNIT_BIN) $(INTEG_BIN) $(GPU_BIN)
	$(MAKE) test-c test-python $(if $(filter 1,$(SANITIZE)),,test-gpu-check)

# The numerics and recovery suites, run a second time with their small
# groups rank-executed (shardd --rank-exec-max 4M; the default, 0, leaves
# every group to the daemon), so both executors pass the same tests.
EXEC_BOTH_BIN := $(addprefix $(BUILD)/tests/integration/,test_shapes test_train \
	test_step_job test_optim_daemon test_grad_norm test_checkpoint \
	test_checkpoint_restore test_checkpoint_restart test_train_checkpoint \
	test_step_kill test_step_pause test_departures)

test-c: all $(UNIT_BIN) $(INTEG_BIN)
	@set -e; for t in $(UNIT_BIN) $(INTEG_BIN); do \
		echo "== $$t"; SHARDD_BIN=$(abspath $(SHARDD)) SHARDD_BUILD=$(abspath $(BUILD)) $$t --jobs 1; \
	done; \
	for t in $(EXEC_BOTH_BIN); do \
		echo "== $$t (small groups rank-executed)"; SHARDD_TEST_RANK_EXEC_MAX=4M \
		SHARDD_BIN=$(abspath $(SHARDD)) SHARDD_BUILD=$(abspath $(BUILD)) $$t --jobs 1; \
	done

# pytest and every suite run on $(PYTHON) (Debian's torch 1.13); the FSDP2
# side-by-side tests (tests/python/test_torch_dropin.py) start their ranks with
# $(TORCH_VENV)'s python, which has torch's FSDP2 (>= 2.6) and sees Debian's
# packages (numpy). Installed once (one pip install of the pinned torch, about
# 5 GB with its CUDA wheels) and reused; when the install fails, the venv is
# removed and its reason left in $(TORCH_VENV).failed, make goes on and those
# tests skip naming it (the next make tries again).
TORCH_PIN  ?= torch==2.15.0
TORCH_VENV ?= build/venv-torch
# Named for the pin, so that a new pin installs afresh.
TORCH_STAMP := $(TORCH_VENV)/.$(subst ==,-,$(TORCH_PIN))

$(TORCH_STAMP):
	@rm -rf $(TORCH_VENV) $(TORCH_VENV).failed && mkdir -p $(dir $(TORCH_VENV))
	@echo "installing $(TORCH_PIN) into $(TORCH_VENV) for the FSDP2 tests (once; log: $(TORCH_VENV).log)"
	@if $(PYTHON) -m venv --system-site-packages $(TORCH_VENV) > $(TORCH_VENV).log 2>&1 && \
	    $(TORCH_VENV)/bin/pip install --no-cache-dir -q $(TORCH_PIN) >> $(TORCH_VENV).log 2>&1; then \
		touch $@; \
	else \
		{ echo "installing $(TORCH_PIN) into $(TORCH_VENV) failed:"; tail -n 3 $(TORCH_VENV).log; } \
			> $(TORCH_VENV).failed; \
		cat $(TORCH_VENV).failed >&2; \
		rm -rf $(TORCH_VENV); \
	fi

# The Python numerics suites, run a second time with their small groups
# rank-executed (tests/python/conftest.py passes SHARDD_TEST_RANK_EXEC_MAX
# to shardd --rank-exec-max), as EXEC_BOTH_BIN for the C suites.
PY_EXEC_BOTH := $(addprefix tests/python/,test_client.py test_shapes.py test_step.py \
	test_step_job.py test_grad_norm.py test_checkpoint.py test_torch.py test_torch_fsdp.py \
	test_torch_optim.py test_torch_clip.py test_torch_state_dict.py test_torch_names.py \
	test_torch_checkpoint.py test_torch_train_checkpoint.py test_torch_reattach.py)

test-python: all $(TORCH_STAMP)
	@if [ -d tests/python ]; then \
		SHARDD_BIN=$(abspath $(SHARDD)) SHARDD_BUILD=$(abspath $(BUILD)) SHARDD_VENV=$(abspath build/venv) \
		SHARDD_TORCH_VENV=$(abspath $(TORCH_VENV)) \
		PYTHONPATH=$(abspath client/python) $(PYTHON) -m pytest -q tests/python && \
		echo "== $(PY_EXEC_BOTH) (small groups rank-executed)" && SHARDD_TEST_RANK_EXEC_MAX=4M \
		SHARDD_BIN=$(abspath $(SHARDD)) SHARDD_BUILD=$(abspath $(BUILD)) SHARDD_VENV=$(abspath build/venv) \
		PYTHONPATH=$(abspath client/python) $(PYTHON) -m pytest -q $(PY_EXEC_BOTH); \
	fi

# The documents' runnable examples and the man pages' completeness
# (docs/README.md); part of test-python, here on their own.
test-docs: all
	SHARDD_BIN=$(abspath $(SHARDD)) SHARDD_BUILD=$(abspath $(BUILD)) \
		PYTHONPATH=$(abspath client/python) $(PYTHON) -m pytest -q \
		tests/python/test_docs.py tests/python/test_man_pages.py

# Plain programs the Python suites run (tests/python/*.c), on the kernels alone.
PYDRV_BIN := $(patsubst tests/python/%.c,$(BUILD)/tests/python/%,$(wildcard tests/python/*.c))

$(BUILD)/tests/python/%: $(BUILD)/tests/python/%.o $(LIBKERNELS)
	$(CC) $(LDFLAGS) -o $@ $^ -lm $(CUDA_LDLIBS)

test-python: $(PYDRV_BIN)

test-gpu: all $(GPU_BIN)
	SHARDD_BIN=$(abspath $(SHARDD)) tools/setup/test_gpu.sh $(abspath $(BUILD)) $(HAVE_CUDA) $(GPU_BIN)

# The GPU check bundle (tools/setup/gpu_check.sh), and its script run as CI
# runs it: without a GPU it must skip every step and succeed, fast. Not in
# a SANITIZE=1 test: the bundle is what a GPU session carries (60 MiB at
# most), and sanitized binaries are neither that small nor what it ships.
GPU_CHECK := $(BUILD)/gpu-check
gpu-check: all $(GPU_BIN)
	PYTHON=$(PYTHON) tools/setup/gpu_check.sh $(BUILD) $(HAVE_CUDA) $(GPU_CHECK) $(GPU_BIN)

test-gpu-check: gpu-check
	@d=$$(mktemp -d) && { $(GPU_CHECK)/run $$d; rc=$$?; rm -rf $$d; exit $$rc; }

train: deps-check-packages
	$(MAKE) all
	tools/train.sh $(BUILD)

# ------------------------------------------------------------- install ---
# Every path below is filled in at install time, so `make install PREFIX=/x`
# after a plain `make` installs a shardd.pc and units that name /x.
BINDIR     ?= $(PREFIX)/bin
LIBDIR     ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
MANDIR     ?= $(PREFIX)/share/man
UNITDIR    ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
SONAME     := libshardd.so.0
INSTALL_BINS = $(notdir $(SHARDD) $(SHARDCTL) $(SHARDBENCH) $(wildcard $(BUILD)/shardbench_mpi))
UNITS      := shardd.service shardd.socket
# Man pages: scdoc sources in man/, pages built into $(BUILD)/man.
MAN_SRC    := $(wildcard man/*.scd)
MAN_PAGES  := $(patsubst man/%.scd,$(BUILD)/man/%,$(MAN_SRC))
# Fill a .in template: @PREFIX@ @BINDIR@ @LIBDIR@ @INCLUDEDIR@ @VERSION@.
subst_paths = sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@BINDIR@|$(BINDIR)|g' \
	-e 's|@LIBDIR@|$(LIBDIR)|g' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' -e 's|@VERSION@|$(VERSION)|g'
.PHONY: uninstall man
all: $(MAN_PAGES)
man: $(MAN_PAGES)

$(BUILD)/man/%: man/%.scd
	@mkdir -p $(dir $@)
	scdoc < $< > $@.tmp || { rm -f $@.tmp; exit 1; }
	mv $@.tmp $@

install: all
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(INCLUDEDIR) \
		$(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man3 $(DESTDIR)$(MANDIR)/man8 \
		$(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSUSERSDIR)
	install -m 755 $(addprefix $(BUILD)/,$(INSTALL_BINS)) $(DESTDIR)$(BINDIR)/
	install -m 644 $(LIBCLIENT_A) $(DESTDIR)$(LIBDIR)/
	install -m 755 $(LIBCLIENT_SO) $(DESTDIR)$(LIBDIR)/libshardd.so.$(VERSION)
	ln -sf libshardd.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(LIBDIR)/libshardd.so
	install -m 644 client/shardd.h proto/shardd_proto.h $(DESTDIR)$(INCLUDEDIR)/
	$(subst_paths) shardd.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/shardd.pc
	chmod 644 $(DESTDIR)$(LIBDIR)/pkgconfig/shardd.pc
	for m in $(notdir $(MAN_PAGES)); do \
		install -m 644 $(BUILD)/man/$$m $(DESTDIR)$(MANDIR)/man$${m##*.}/$$m || exit 1; done
	for u in $(UNITS); do \
		$(subst_paths) tools/systemd/$$u.in > $(DESTDIR)$(UNITDIR)/$$u && \
		chmod 644 $(DESTDIR)$(UNITDIR)/$$u || exit 1; done
	install -m 644 tools/systemd/shardd.sysusers $(DESTDIR)$(SYSUSERSDIR)/shardd.conf
	@# ldconfig for a real install as root into a directory ld.so searches, else a note.
	@tools/setup/ldconfig.sh install '$(LIBDIR)' '$(DESTDIR)'

uninstall:
	rm -f $(addprefix $(DESTDIR)$(BINDIR)/,shardd shardctl shardbench shardbench_mpi)
	rm -f $(addprefix $(DESTDIR)$(LIBDIR)/,libshardd.a libshardd.so $(SONAME) libshardd.so.$(VERSION))
	rm -f $(DESTDIR)$(LIBDIR)/pkgconfig/shardd.pc
	rm -f $(addprefix $(DESTDIR)$(INCLUDEDIR)/,shardd.h shardd_proto.h)
	for m in $(notdir $(MAN_PAGES)); do rm -f $(DESTDIR)$(MANDIR)/man$${m##*.}/$$m; done
	rm -f $(addprefix $(DESTDIR)$(UNITDIR)/,$(UNITS)) $(DESTDIR)$(SYSUSERSDIR)/shardd.conf
	@tools/setup/ldconfig.sh uninstall '$(LIBDIR)' '$(DESTDIR)'

clean:
	rm -rf build build-san

# Build fragments owned by a tool's folder (e.g. the MPI comparator of shardbench).
include $(wildcard tools/*/*.mk)
include $(wildcard client/examples/*.mk)
include $(wildcard tests/*/*.mk)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
