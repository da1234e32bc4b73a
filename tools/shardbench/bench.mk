# shardbench's Open MPI comparator (tools/shardbench/mpi/), included by the
# top Makefile. Built only where mpicc exists; shardbench prints
# "# Open MPI comparator not built" and leaves vsMPI empty otherwise.

MPICC ?= mpicc
HAVE_MPICC := $(shell command -v $(MPICC) >/dev/null 2>&1 && echo 1 || echo 0)

ifeq ($(HAVE_MPICC),1)
BENCH_MPI_SRC := $(wildcard tools/shardbench/mpi/*.c)
BENCH_MPI_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(BENCH_MPI_SRC))

all: $(BUILD)/shardbench_mpi

# shardbench runs the comparator from its own directory: build both together.
$(BUILD)/shardbench: | $(BUILD)/shardbench_mpi

$(BUILD)/tools/shardbench/mpi/%.o: tools/shardbench/mpi/%.c
	@mkdir -p $(dir $@)
	$(MPICC) $(CFLAGS) $(call inc_of,$<) -c $< -o $@

# measure.o: the size parsing shardbench itself uses, so both read -b/-e alike.
$(BUILD)/shardbench_mpi: $(BENCH_MPI_OBJ) $(BUILD)/tools/shardbench/measure.o
	$(MPICC) $(LDFLAGS) -o $@ $^ -lm
endif

# `shardbench gpu --load`'s compute load (gpu_load.cu), a kernel of
# shardbench's own: linked into shardbench only, never into the daemon.
ifeq ($(HAVE_CUDA),1)
$(BUILD)/shardbench: $(BUILD)/tools/shardbench/gpu_load.cu.o
endif
