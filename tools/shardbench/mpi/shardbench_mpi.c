/* SPDX-License-Identifier: MIT */
/*
 * shardbench_mpi: the Open MPI comparator of `shardbench unshard` and
 * `shardbench reduce`. Run under mpirun with the same process count and
 * sweep as the shardbench run; prints one line per size,
 *   <size(B)> <time(us)> <#wrong>
 * where size(B) is the full param's bytes in the benchmark dtype (the key
 * shardbench matches rows by) and time is the mean over iterations of
 * (last rank's end - first rank's start) after a barrier, the same
 * definition shardbench uses for the daemon.
 *
 *   allgather:      MPI_Allgather of count/np elements per process
 *                   (fp32 as MPI_FLOAT, bf16/fp16 as MPI_UINT16_T: FSDP2
 *                   casts the shard before its all-gather);
 *   reduce_scatter: MPI_Reduce_scatter_block(MPI_SUM) of count elements
 *                   per process, in MPI_FLOAT for every dtype: Open MPI has
 *                   no 16-bit float sum;
 *   allreduce:      MPI_Allreduce(MPI_SUM) of count elements per process,
 *                   MPI_FLOAT (`shardbench world`'s inter-node part).
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <mpi.h>

#include "bench.h"

struct mpi_opts {
	const char *op;
	uint64_t min_bytes, max_bytes, factor;
	int warmup, iters, check;
	size_t dsize; /* bytes per element of the benchmark dtype */
};

static int parse_args(int argc, char **argv, struct mpi_opts *o)
{
	int i;

	if (argc < 2)
		return -EINVAL;
	o->op = argv[1];
	if (strcmp(o->op, "allgather") && strcmp(o->op, "reduce_scatter") &&
	    strcmp(o->op, "allreduce"))
		return -EINVAL;
	for (i = 2; i + 1 < argc; i += 2) {
		const char *f = argv[i], *v = argv[i + 1];
		int bad = 0;

		if (!strcmp(f, "-b"))
			bad = bench_parse_size(v, &o->min_bytes);
		else if (!strcmp(f, "-e"))
			bad = bench_parse_size(v, &o->max_bytes);
		else if (!strcmp(f, "-f"))
			bad = bench_parse_size(v, &o->factor);
		else if (!strcmp(f, "-w"))
			o->warmup = atoi(v);
		else if (!strcmp(f, "-n"))
			o->iters = atoi(v);
		else if (!strcmp(f, "-c"))
			o->check = atoi(v);
		else if (!strcmp(f, "-d"))
			o->dsize = !strcmp(v, "fp32")                           ? 4
				   : (!strcmp(v, "bf16") || !strcmp(v, "fp16")) ? 2
										: 0;
		else
			bad = -EINVAL;
		if (bad)
			return bad;
	}
	if (i != argc || o->dsize == 0 || o->factor < 2 || o->iters < 1 || o->warmup < 0 ||
	    o->min_bytes > o->max_bytes)
		return -EINVAL;
	return 0;
}

/* Exactly representable small integers, so sums and compares are exact. */
static float pattern(uint64_t i, int seed)
{
	return (float)((int)((i * 7 + (uint64_t)seed * 13) & 15) - 8);
}

/* Time one size: returns mean us over iterations; *wrong from the check. */
static double run_size(const struct mpi_opts *o, int rank, int np, uint64_t bytes, void *send,
		       void *recv, uint64_t *t0, uint64_t *t1, uint64_t *wrong)
{
	int ag = !strcmp(o->op, "allgather"), ar = !strcmp(o->op, "allreduce");
	uint64_t count = bytes / o->dsize, chunk = count / (uint64_t)np, i, sum = 0;
	size_t esize = ag ? o->dsize : sizeof(float);
	MPI_Datatype type = ag ? (o->dsize == 4 ? MPI_FLOAT : MPI_UINT16_T) : MPI_FLOAT;
	int total = o->warmup + o->iters, it, r;

	/* Inputs: the allgather's chunk of rank `rank`, or all of the rank's reduce input. */
	if (ag) {
		for (i = 0; i < chunk; i++) {
			uint64_t g = (uint64_t)rank * chunk + i;

			if (esize == 4)
				((float *)send)[i] = pattern(g, 1);
			else
				((uint16_t *)send)[i] = (uint16_t)(g * 2654435761u);
		}
	} else {
		for (i = 0; i < count; i++)
			((float *)send)[i] = pattern(i + (uint64_t)rank, 1);
	}
	memset(recv, 0, ag || ar ? count * esize : chunk * esize);

	for (it = 0; it < total; it++) {
		MPI_Barrier(MPI_COMM_WORLD);
		t0[it] = bench_now_ns();
		if (ag)
			MPI_Allgather(send, (int)chunk, type, recv, (int)chunk, type,
				      MPI_COMM_WORLD);
		else if (ar)
			MPI_Allreduce(send, recv, (int)count, type, MPI_SUM, MPI_COMM_WORLD);
		else
			MPI_Reduce_scatter_block(send, recv, (int)chunk, type, MPI_SUM,
						 MPI_COMM_WORLD);
		t1[it] = bench_now_ns();
	}
	/* First start and last end of every iteration, over all ranks. */
	MPI_Allreduce(MPI_IN_PLACE, t0, total, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
	MPI_Allreduce(MPI_IN_PLACE, t1, total, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
	for (it = o->warmup; it < total; it++)
		sum += t1[it] - t0[it];

	*wrong = 0;
	if (o->check) {
		if (ag) {
			for (i = 0; i < count; i++) {
				if (esize == 4)
					*wrong += ((float *)recv)[i] != pattern(i, 1);
				else
					*wrong += ((uint16_t *)recv)[i] !=
						  (uint16_t)(i * 2654435761u);
			}
		} else if (ar) {
			for (i = 0; i < count; i++) {
				float want = 0;

				for (r = 0; r < np; r++)
					want += pattern(i + (uint64_t)r, 1);
				*wrong += ((float *)recv)[i] != want;
			}
		} else {
			for (i = 0; i < chunk; i++) {
				uint64_t g = (uint64_t)rank * chunk + i;
				float want = 0;

				for (r = 0; r < np; r++)
					want += pattern(g + (uint64_t)r, 1);
				*wrong += ((float *)recv)[i] != want;
			}
		}
		MPI_Allreduce(MPI_IN_PLACE, wrong, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
	}
	return (double)sum / o->iters / 1000.0;
}

int main(int argc, char **argv)
{
	struct mpi_opts o = { .factor = 2, .warmup = 1, .iters = 5, .check = 1, .dsize = 4 };
	uint64_t *t0 = NULL, *t1 = NULL, bytes, wrong, max_count;
	void *send = NULL, *recv = NULL;
	int rank, np, ret = 0;

	if (argc == 2 && strcmp(argv[1], "--help") == 0) {
		printf("usage: mpirun -np N shardbench_mpi allgather|reduce_scatter|allreduce -b MIN -e MAX "
		       "-f FACTOR -w WARMUP -n ITERS -c 0|1 -d fp32|bf16|fp16\n"
		       "Open MPI's MPI_Allgather / MPI_Reduce_scatter_block on the sizes of a "
		       "shardbench sweep; shardbench runs it and compares.\n");
		return 0;
	}
	if (argc == 2 && strcmp(argv[1], "--version") == 0) {
		printf("shardbench_mpi %s\n", SHARDD_VERSION);
		return 0;
	}
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &np);
	if (parse_args(argc, argv, &o)) {
		if (rank == 0)
			fprintf(stderr,
				"usage: mpirun -np N shardbench_mpi allgather|reduce_scatter|allreduce "
				"-b MIN -e MAX -f FACTOR -w WARMUP -n ITERS -c 0|1 -d fp32|bf16|fp16\n");
		ret = 2;
		goto out;
	}
	max_count = o.max_bytes / o.dsize;
	if (max_count / (uint64_t)np > INT_MAX) {
		if (rank == 0)
			fprintf(stderr,
				"shardbench_mpi: -e %llu is %llu elements per process; MPI "
				"counts are int, at most %d\n",
				(unsigned long long)o.max_bytes,
				(unsigned long long)(max_count / (uint64_t)np), INT_MAX);
		ret = 2;
		goto out;
	}
	/* Largest buffers once: reduce inputs are fp32 whatever the dtype. */
	send = malloc(max_count * sizeof(float));
	recv = malloc(max_count * sizeof(float));
	t0 = calloc((size_t)(o.warmup + o.iters), sizeof(*t0));
	t1 = calloc((size_t)(o.warmup + o.iters), sizeof(*t1));
	if (!send || !recv || !t0 || !t1) {
		fprintf(stderr, "shardbench_mpi: rank %d: cannot allocate 2 x %llu bytes\n", rank,
			(unsigned long long)(max_count * sizeof(float)));
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	if (rank == 0) {
		printf("# shardbench_mpi %s: %d processes, MPI datatype %s\n", o.op, np,
		       strcmp(o.op, "allgather") ? "fp32" : (o.dsize == 4 ? "fp32" : "u16"));
		fflush(stdout);
	}
	for (bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.factor) {
		double us;

		if ((bytes / o.dsize) % (uint64_t)np) {
			if (rank == 0)
				printf("# %llu bytes: not a multiple of %d elements, skipped\n",
				       (unsigned long long)bytes, np);
		} else {
			us = run_size(&o, rank, np, bytes, send, recv, t0, t1, &wrong);
			if (rank == 0)
				printf("%llu %.3f %llu\n", (unsigned long long)bytes, us,
				       (unsigned long long)wrong);
		}
		fflush(stdout);
		if (bytes > UINT64_MAX / o.factor)
			break;
	}
out:
	free(t1);
	free(t0);
	free(recv);
	free(send);
	MPI_Finalize();
	return ret;
}
