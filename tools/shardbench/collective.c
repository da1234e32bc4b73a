/* SPDX-License-Identifier: MIT */
/*
 * `shardbench unshard` and `shardbench reduce`: the two collectives through
 * the real daemon, with o->ranks forked rank processes that each attach
 * with libshardd, register one group of one 1-D fp32 param per size (a new
 * job per size, so the daemon frees the previous one), write their inputs
 * and run warm-up + timed iterations, each started by a job barrier.
 *
 * Time of one iteration = last rank's completion - first rank's submit
 * (CLOCK_MONOTONIC is one clock for every process); a row shows the mean
 * over the timed iterations. A last, untimed iteration on fresh inputs is
 * checked element by element (-c 1), so a stale or wrong answer shows in
 * #wrong. docs/BENCHMARKS.md derives every column.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "shardd.h"

/* A size with no word from some rank for this long is declared stuck. */
#define COLL_PROGRESS_TIMEOUT_MS (300 * 1000)
#define COLL_MSG_MAX             512
#define COLL_TARGET_MIN_BYTES    (64 * BENCH_MIB)
#define COLL_TARGET_ROOF         85.0
#define COLL_TARGET_MPI          5.0
/* Extra roofline measurements of a size whose op beat it, before the row says so. */
#define COLL_ROOF_RETRIES 3
/*
 * From this size the roofline's best variant runs one pass between every
 * two iterations of the op (while the ranks wait), so that both see the
 * same load of the machine: measured before and after the iterations
 * only, a burst of other work during the roofline's minute and not the
 * op's put rows above 100 %. Smaller ops keep their iterations back to
 * back: a rank woken from the gate would start each one cold.
 */
#define COLL_INTERLEAVE_MIN_BYTES COLL_TARGET_MIN_BYTES

struct coll_sample {
	uint64_t t0; /* before the submit */
	uint64_t t1; /* after the completion */
};

struct coll_rank_state {
	int32_t err;            /* 0, or the code of the call that failed */
	char msg[COLL_MSG_MAX]; /* what failed, with the daemon's text */
};

/* Results the rank processes write; one MAP_SHARED region, laid out once before fork. */
struct coll_shared {
	uint32_t nranks;
	uint32_t nsizes;
	uint32_t total;                /* warm-up + timed iterations */
	struct coll_rank_state *state; /* [rank] */
	uint64_t *wrong;               /* [size][rank] */
	struct coll_sample *samples;   /* [size][rank][iter] */
	uint8_t *interleave;           /* [size]: a gate byte before each iteration but the first */
	void *base;
	size_t len;
};

/* What a rank tells the parent after an iteration or a size; one atomic pipe write. */
struct coll_note {
	uint16_t rank;
	uint16_t size_index;
	int32_t iter; /* iterations done, for an interleaved size's iteration; -1: the size is done */
	int32_t ok;
};

/* One rank's group for one size, as the per-op inputs and checks see it. */
struct coll_io {
	struct shardd_group *g;
	const struct shardd_param_layout *l;
	uint32_t dtype;
	uint64_t count; /* elements of the param */
	uint32_t rank;
	uint32_t nranks;
};

/*
 * One collective of the benchmark: everything that differs between ops
 * (nccl-tests' one table per collective). Adding an op is adding an entry
 * to coll_ops[] below.
 */
struct coll_op {
	const char *name;      /* the op, in job names and messages */
	const char *undo_name; /* the op that resets it for the next iteration */
	const char *mpi_op;    /* the Open MPI comparator's operation (bench_mpi_run) */
	const char *mpi_call;  /* the MPI call it times, for the header */
	int (*run)(struct shardd_group *g, uint64_t step);
	int (*undo)(struct shardd_group *g, uint64_t step);
	/* This rank's inputs from `seed`: 1 for the timed iterations, 2 for the checked one. */
	void (*write_inputs)(const struct coll_io *io, uint32_t seed);
	/* Elements of this rank's output that differ from what inputs of `seed` must give. */
	uint64_t (*check)(const struct coll_io *io, uint32_t seed);
	/*
	 * The op's access pattern over `count` elements of the param: what it
	 * must move through memory, and the roofline kernel it is held against
	 * (docs/BENCHMARKS.md derives both).
	 */
	struct bench_mem_pattern (*pattern)(uint32_t dtype, uint32_t S);
	void (*print_moves)(uint32_t dtype);
};

struct coll_rank_ctx {
	const struct bench_opts *o;
	const struct coll_op *op;
	const char *socket_path;
	const uint64_t *sizes;
	struct coll_shared *sh;
	uint32_t rank;
	pid_t parent;
	int go_fd; /* one byte per size, and per interleaved iteration, from the parent */
	int notify_fd;
};

/* ---- inputs and checks (values in values.c) --------------------------- */

/* This rank's rows of the param into its flat shard (fp32), padding zeroed. */
static void write_shard(const struct coll_io *io, uint32_t seed)
{
	const struct shardd_param_layout *l = io->l;
	float *shard = shardd_group_shard(io->g, 0);
	uint64_t j, n = l->shard_bytes / sizeof(float);

	for (j = 0; j < n; j++)
		shard[j] = j < l->shard_rows_valid ? bench_param_value(l->shard_row_begin + j, seed)
						   : 0.0f;
}

static void write_grad(const struct coll_io *io, uint32_t seed)
{
	void *grad = shardd_group_grad(io->g, 0);
	uint64_t i;

	for (i = 0; i < io->count; i++)
		bench_store_exact(grad, io->dtype, i, bench_grad_value(i, io->rank, seed));
}

/* Unsharded elements this rank checks: its 1/S slice of the one shared copy. */
static uint64_t check_unsharded(const struct coll_io *io, uint32_t seed)
{
	const void *u = shardd_group_unsharded(io->g, 0);
	uint64_t i, lo = io->count / io->nranks * io->rank;
	uint64_t hi = io->rank + 1 == io->nranks ? io->count : lo + io->count / io->nranks,
		 wrong = 0;

	for (i = lo; i < hi; i++)
		wrong += bench_load_exact(u, io->dtype, i) != bench_param_value(i, seed);
	return wrong;
}

/* This rank's sharded grad (fp32) against the mean of every rank's grad. */
static uint64_t check_shard_grad(const struct coll_io *io, uint32_t seed)
{
	const struct shardd_param_layout *l = io->l;
	const float *sg = shardd_group_shard_grad(io->g, 0);
	uint64_t j, wrong = 0;
	uint32_t r;

	for (j = 0; j < l->shard_rows_valid; j++) {
		float sum = 0.0f;

		for (r = 0; r < io->nranks; r++)
			sum += bench_grad_value(l->shard_row_begin + j, r, seed);
		wrong += sg[j] != sum / (float)io->nranks;
	}
	return wrong;
}

/* ---- the ops ---------------------------------------------------------- */

static int unshard_run(struct shardd_group *g, uint64_t step)
{
	return shardd_unshard(g, step);
}

/* Reshard releases this rank's hold on the unsharded copy. */
static int unshard_undo(struct shardd_group *g, uint64_t step)
{
	return shardd_reshard(g, step);
}

/* Read the S fp32 shards (count elements in all) in order, write the one unsharded copy. */
static struct bench_mem_pattern unshard_pattern(uint32_t dtype, uint32_t S)
{
	(void)S;
	return (struct bench_mem_pattern){ .nin = 1,
					   .in_size = 4,
					   .out_size = (uint32_t)shardd_dtype_size(dtype) };
}

static void unshard_print_moves(uint32_t dtype)
{
	printf("# moves: S fp32 shards in + the unsharded %s copy out = count*(4+%zu) B; roofline: a kernel"
	       " reading count 4-byte\n#   and writing count %zu-byte elements\n",
	       shardd_dtype_name(dtype), shardd_dtype_size(dtype), shardd_dtype_size(dtype));
}

static int reduce_run(struct shardd_group *g, uint64_t step)
{
	return shardd_reduce(g, step, 0);
}

/* zero_grad makes the next reduce assign, not add. */
static int reduce_undo(struct shardd_group *g, uint64_t step)
{
	(void)step;
	return shardd_zero_grad(g);
}

/* Read S grad buffers, write S fp32 sharded grads: per output element, S inputs. */
static struct bench_mem_pattern reduce_pattern(uint32_t dtype, uint32_t S)
{
	return (struct bench_mem_pattern){ .nin = S,
					   .in_size = (uint32_t)shardd_dtype_size(dtype),
					   .out_size = 4 };
}

static void reduce_print_moves(uint32_t dtype)
{
	printf("# moves: S %s grad buffers in + S fp32 sharded grads out = count*(S*%zu+4) B; roofline: a"
	       " kernel reading\n#   S streams of count %zu-byte elements into count 4-byte ones\n",
	       shardd_dtype_name(dtype), shardd_dtype_size(dtype), shardd_dtype_size(dtype));
}

static const struct coll_op coll_ops[] = {
	[BENCH_UNSHARD] = {
		.name = "unshard", .undo_name = "reshard",
		.mpi_op = "allgather", .mpi_call = "MPI_Allgather",
		.run = unshard_run, .undo = unshard_undo,
		.write_inputs = write_shard, .check = check_unsharded,
		.pattern = unshard_pattern, .print_moves = unshard_print_moves,
	},
	[BENCH_REDUCE] = {
		.name = "reduce", .undo_name = "zero_grad",
		.mpi_op = "reduce_scatter", .mpi_call = "MPI_Reduce_scatter_block(SUM)",
		.run = reduce_run, .undo = reduce_undo,
		.write_inputs = write_grad, .check = check_shard_grad,
		.pattern = reduce_pattern, .print_moves = reduce_print_moves,
	},
};

/* ---- one rank process ------------------------------------------------- */

static int rank_fail(struct coll_rank_ctx *x, int err, const char *what, uint64_t bytes)
{
	struct coll_rank_state *st = &x->sh->state[x->rank];
	const char *why = shardd_last_error();
	char human[32];

	bench_format_size(bytes, human, sizeof(human));
	st->err = err;
	snprintf(st->msg, sizeof(st->msg), "rank %u: %s at size %s: %s", x->rank, what, human,
		 why && why[0] ? why : shardd_strerror(err));
	return err;
}

/* The op of this benchmark, then what undoes it for the next iteration. */
static int run_op(struct coll_rank_ctx *x, struct shardd_group *g, uint64_t step, uint64_t *t0,
		  uint64_t *t1, uint64_t bytes)
{
	char what[96];
	int ret;

	*t0 = bench_now_ns();
	ret = x->op->run(g, step);
	*t1 = bench_now_ns();
	if (ret) {
		snprintf(what, sizeof(what), "%s(step %llu)", x->op->name,
			 (unsigned long long)step);
		return rank_fail(x, ret, what, bytes);
	}
	return 0;
}

static int undo_op(struct coll_rank_ctx *x, struct shardd_group *g, uint64_t step, uint64_t bytes)
{
	char what[96];
	int ret;

	ret = x->op->undo(g, step);
	if (ret) {
		snprintf(what, sizeof(what), "%s(step %llu)", x->op->undo_name,
			 (unsigned long long)step);
		return rank_fail(x, ret, what, bytes);
	}
	return 0;
}

/* Tell the parent: iteration `iter` of size k done (or, iter -1, the size). 0 or -EPIPE. */
static int rank_note(struct coll_rank_ctx *x, uint32_t k, int32_t iter, int ok)
{
	struct coll_note note = {
		.rank = (uint16_t)x->rank, .size_index = (uint16_t)k, .iter = iter, .ok = ok
	};

	/* A note is smaller than PIPE_BUF: one write, never interleaved with another rank's. */
	if (write(x->notify_fd, &note, sizeof(note)) != (ssize_t)sizeof(note))
		return -EPIPE;
	return 0;
}

static int rank_size(struct coll_rank_ctx *x, uint32_t k)
{
	const struct bench_opts *o = x->o;
	struct coll_shared *sh = x->sh;
	uint64_t bytes = x->sizes[k], count = bytes / shardd_dtype_size(o->dtype);
	struct coll_sample *samples = sh->samples + ((size_t)k * sh->nranks + x->rank) * sh->total;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	struct coll_io io;
	char job[SHARDD_NAME_MAX], what[128];
	uint64_t barrier = 1, step = 1, t0, t1;
	uint32_t it;
	int ret;
	struct shardd_attach_opts ao = {
		.socket_path = x->socket_path,
		.job = job,
		.rank = x->rank,
		.replicate = 1,
		.shard = o->ranks,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_param_desc param = {
		.name = "w",
		.dtype = SHARDD_DTYPE_FP32,
		.ndim = 1,
		.shape = { count },
	};
	struct shardd_precision precision = {
		.param_dtype = o->dtype == SHARDD_DTYPE_FP32 ? SHARDD_DTYPE_NONE : o->dtype,
		.reduce_dtype = SHARDD_DTYPE_NONE,
	};
	struct shardd_group_opts gopts = { .exec = o->exec };

	snprintf(job, sizeof(job), "shardbench.%d.%s.%u", (int)x->parent, x->op->name, k);
	ret = shardd_connect(&ao, &c);
	if (ret) {
		snprintf(what, sizeof(what), "attach to %s as rank %u of job '%s'", x->socket_path,
			 x->rank, job);
		return rank_fail(x, ret, what, bytes);
	}
	ret = shardd_group_register(c, "bench", &param, 1, &precision, &gopts, &g);
	if (ret) {
		rank_fail(x, ret, "register group 'bench'", bytes);
		goto out;
	}
	io = (struct coll_io){
		.g = g,
		.l = shardd_group_layout(g, 0),
		.dtype = o->dtype,
		.count = count,
		.rank = x->rank,
		.nranks = o->ranks,
	};
	x->op->write_inputs(&io, 1);

	for (it = 0; it < sh->total; it++, step++) {
		char go;

		/* The parent's roofline pass runs between interleaved iterations (EOF: it is gone). */
		if (it > 0 && sh->interleave[k] && read(x->go_fd, &go, 1) != 1) {
			ret = rank_fail(x, -EPIPE, "waiting for the parent between iterations",
					bytes);
			goto out;
		}
		/* Every rank starts the iteration together: the first submit starts the clock. */
		ret = shardd_barrier(c, barrier++);
		if (ret) {
			rank_fail(x, ret, "barrier", bytes);
			goto out;
		}
		ret = run_op(x, g, step, &samples[it].t0, &samples[it].t1, bytes);
		if (!ret)
			ret = undo_op(x, g, step, bytes);
		if (!ret && sh->interleave[k] && it + 1 < sh->total)
			ret = rank_note(x, k, (int32_t)it + 1, 1);
		if (ret)
			goto out;
	}
	if (o->check) {
		/* Fresh inputs, so an op that did nothing leaves the previous answer and fails. */
		x->op->write_inputs(&io, 2);
		ret = shardd_barrier(c, barrier++);
		if (ret) {
			rank_fail(x, ret, "barrier", bytes);
			goto out;
		}
		ret = run_op(x, g, step, &t0, &t1, bytes);
		if (ret)
			goto out;
		sh->wrong[(size_t)k * sh->nranks + x->rank] = x->op->check(&io, 2);
		ret = undo_op(x, g, step, bytes);
	}
out:
	shardd_group_close(g);
	shardd_close(c);
	return ret;
}

static int rank_main(struct coll_rank_ctx *x)
{
	uint32_t k;
	int ret = 0;

	for (k = 0; k < x->sh->nsizes && !ret; k++) {
		char go;

		/* The parent measures the roofline while no rank works; EOF: it is gone. */
		if (read(x->go_fd, &go, 1) != 1)
			return 1;
		ret = rank_size(x, k);
		if (rank_note(x, k, -1, ret == 0))
			return 1;
	}
	return ret ? 1 : 0;
}

/* ---- the parent: sweep, collect, print -------------------------------- */

static int shared_map(struct coll_shared *sh, uint32_t nranks, uint32_t nsizes, uint32_t total)
{
	size_t st = sizeof(struct coll_rank_state) * nranks;
	size_t wr = sizeof(uint64_t) * nranks * nsizes;
	size_t sa = sizeof(struct coll_sample) * (size_t)nranks * nsizes * total;
	char *p;

	sh->len = st + wr + sa + nsizes;
	/* Shared, not private: the rank processes write here after fork. */
	p = mmap(NULL, sh->len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return -errno;
	sh->base = p;
	sh->nranks = nranks;
	sh->nsizes = nsizes;
	sh->total = total;
	sh->state = (struct coll_rank_state *)p;
	sh->wrong = (uint64_t *)(p + st);
	sh->samples = (struct coll_sample *)(p + st + wr);
	sh->interleave = (uint8_t *)(p + st + wr + sa);
	return 0;
}

/*
 * Over the timed iterations of (last completion - first submit), in ns:
 * the mean, and in *best (when not NULL) the fastest.
 */
static double size_times_ns(const struct coll_shared *sh, const struct bench_opts *o, uint32_t k,
			    double *best)
{
	double sum = 0, fastest = 0;
	uint32_t it, r;

	for (it = (uint32_t)o->warmup; it < sh->total; it++) {
		uint64_t first = UINT64_MAX, last = 0;

		for (r = 0; r < sh->nranks; r++) {
			const struct coll_sample *s =
				&sh->samples[((size_t)k * sh->nranks + r) * sh->total + it];

			first = s->t0 < first ? s->t0 : first;
			last = s->t1 > last ? s->t1 : last;
		}
		sum += (double)(last - first);
		if (it == (uint32_t)o->warmup || (double)(last - first) < fastest)
			fastest = (double)(last - first);
	}
	if (best)
		*best = fastest;
	return sum / o->iters;
}

struct coll_summary {
	double busbw_sum;
	uint32_t rows;
	double worst_roof; /* over sizes >= COLL_TARGET_MIN_BYTES */
	double worst_mpi;
	double highest_roof; /* over every row: above 100 is a roofline bug */
	uint32_t roof_rows;
	uint32_t roof_retried; /* sizes whose roofline was measured again */
	uint32_t target_rows;
	uint32_t mpi_rows;
	uint64_t wrong;
	uint64_t mpi_wrong;
};

/*
 * The roofline of size `bytes`: the best pass of the op's pattern, kept
 * over every measurement of the size (ns UINT64_MAX: not measured, as when
 * its arrays would take more than half of MemAvailable). *ctx: the
 * pattern's arrays, opened here and left open when `keep` and there is
 * room for them beside the op's buffers (about as large), else NULL.
 */
static void size_roofline(const struct bench_opts *o, const struct coll_op *op, uint64_t bytes,
			  int keep, struct bench_mem_ctx **ctx, struct bench_mem_best *best)
{
	struct bench_mem_pattern p = op->pattern(o->dtype, o->ranks);
	uint64_t count = bytes / shardd_dtype_size(o->dtype), avail = bench_mem_available();
	uint64_t need = bench_mem_pattern_bytes(&p, count);

	if (!*ctx) {
		if ((avail && 2 * need > avail) || bench_mem_open(&p, count, ctx))
			return;
	}
	bench_mem_measure(*ctx, 1, best);
	if (!keep || (avail && 3 * need > avail)) {
		bench_mem_close(*ctx);
		*ctx = NULL;
	}
}

static void print_row(const struct bench_opts *o, const struct coll_shared *sh, uint32_t k,
		      uint64_t bytes, const struct bench_mem_best *roof,
		      const struct bench_mpi_table *mpi, struct coll_summary *sum)
{
	uint64_t count = bytes / shardd_dtype_size(o->dtype), wrong = 0;
	double best_ns, ns = size_times_ns(sh, o, k, &best_ns), us = ns / 1000.0;
	double algbw = (double)bytes / ns;
	double busbw = algbw * (double)(o->ranks - 1) / (double)o->ranks;
	const struct bench_mpi_row *m = bench_mpi_find(mpi, bytes);
	char mpi_us[24] = "-", vs[24] = "-", wr[24] = "-", roof_gbs[24] = "-", pct_s[24] = "-",
	     best_s[24] = "-", by[24] = "-";
	double pct = 0;
	uint32_t r;

	for (r = 0; r < sh->nranks; r++)
		wrong += sh->wrong[(size_t)k * sh->nranks + r];
	if (roof->ns != UINT64_MAX) {
		/* Same bytes on both sides: the ratio of the times. */
		pct = (double)roof->ns / ns * 100.0;
		snprintf(roof_gbs, sizeof(roof_gbs), "%.2f",
			 (double)roof->bytes / (double)roof->ns);
		snprintf(pct_s, sizeof(pct_s), "%.1f", pct);
		snprintf(best_s, sizeof(best_s), "%.1f", (double)roof->ns / best_ns * 100.0);
		bench_mem_best_name(roof, by, sizeof(by));
		sum->highest_roof =
			sum->roof_rows && sum->highest_roof > pct ? sum->highest_roof : pct;
		sum->roof_rows++;
	}
	if (m) {
		sum->mpi_wrong += m->wrong;
		snprintf(mpi_us, sizeof(mpi_us), "%.1f", m->time_us);
		snprintf(vs, sizeof(vs), "%.2f", m->time_us / us);
	}
	if (o->check)
		snprintf(wr, sizeof(wr), "%llu", (unsigned long long)(wrong + roof->wrong));
	printf("%12llu %12llu %6s %12.1f %12.2f %12.2f %10s %11s %7s %7s %12s %7s %7s\n",
	       (unsigned long long)bytes, (unsigned long long)count, shardd_dtype_name(o->dtype),
	       us, algbw, busbw, roof_gbs, by, pct_s, best_s, mpi_us, vs, wr);
	fflush(stdout);
	sum->busbw_sum += busbw;
	sum->rows++;
	sum->wrong += wrong + roof->wrong;
	if (bytes >= COLL_TARGET_MIN_BYTES && roof->ns != UINT64_MAX) {
		sum->worst_roof = sum->target_rows && sum->worst_roof < pct ? sum->worst_roof : pct;
		sum->target_rows++;
		if (m) {
			double v = m->time_us / us;

			sum->worst_mpi = sum->mpi_rows && sum->worst_mpi < v ? sum->worst_mpi : v;
			sum->mpi_rows++;
		}
	}
}

static void print_header(const struct bench_opts *o, const struct coll_op *op,
			 const struct bench_mpi_table *mpi)
{
	const char *d = shardd_dtype_name(o->dtype);

	printf("#\n# shardbench %s: %u rank processes, one 1-D param per size (fp32 shards,"
	       " param_dtype %s), warm-up %d, iterations %d, check %d\n",
	       op->name, o->ranks, d, o->warmup, o->iters, o->check);
	op->print_moves(o->dtype);
	printf("#   at the same size, right before and after the op's iterations and, from 64 MiB, one pass"
	       " of its best variant\n#   between every two of them (no rank works then); roof(GB/s): its best"
	       " pass of\n#   %splain stores, inputs streamed, prefetched (+pf) or"
	       " blocked (+blk), in 32-byte vectors or (AVX-512)\n#   64-byte ones (+zmm), on 1 and %u"
	       " threads; by: which (store[+order][+zmm]/threads); %%roof: its"
	       " time / the op's mean time;\n#   %%best: its time / the op's fastest timed iteration"
	       " (best against best: what the op reaches\n#   when other load leaves it the cores, as the"
	       " roofline's best pass had them)\n",
	       bench_mem_have_nt() ? "non-temporal and " : "", bench_worker_threads());
	if (mpi->available)
		printf("# vsMPI: Open MPI %s among %u processes, same sizes, MPI datatype %s\n",
		       op->mpi_call, o->ranks, mpi->dtype);
	else
		printf("# Open MPI comparator not built (%s)\n", mpi->why);
	printf("# target: >= %.0f %%roof and >= %.0fx vsMPI for sizes >= 64 MiB\n",
	       COLL_TARGET_ROOF, COLL_TARGET_MPI);
	printf("#\n# %10s %12s %6s %12s %12s %12s %10s %11s %7s %7s %12s %7s %7s\n", "size(B)",
	       "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "roof(GB/s)", "by",
	       "%roof", "%best", "mpi(us)", "vsMPI", "#wrong");
	fflush(stdout);
}

static void print_summary(const struct coll_summary *s)
{
	if (s->rows)
		printf("# Avg bus bandwidth    : %.3f GB/s\n", s->busbw_sum / s->rows);
	if (s->roof_rows)
		printf("# highest %%roof: %.1f%s\n", s->highest_roof,
		       s->highest_roof > 100.0
			       ? " (above 100: the roofline is wrong, a benchmark bug)"
			       : "");
	if (s->roof_retried)
		printf("# roofline measured again for %u size(s) whose op's fastest iteration beat it"
		       " (other load disturbed\n#   the first two)\n",
		       s->roof_retried);
	if (s->target_rows) {
		int roof_ok = s->worst_roof >= COLL_TARGET_ROOF;
		int mpi_ok = s->mpi_rows && s->worst_mpi >= COLL_TARGET_MPI;

		printf("# target (sizes >= 64 MiB): worst %%roof %.1f (%s), ", s->worst_roof,
		       roof_ok ? "met" : "MISSED");
		if (s->mpi_rows)
			printf("worst vsMPI %.2fx (%s)\n", s->worst_mpi, mpi_ok ? "met" : "MISSED");
		else
			printf("vsMPI not measured\n");
	} else {
		printf("# target (sizes >= 64 MiB): no such size in this sweep; use -e 64M or more\n");
	}
	if (s->wrong)
		printf("# WRONG RESULTS: %llu elements\n", (unsigned long long)s->wrong);
	if (s->mpi_wrong)
		printf("# the Open MPI comparator got %llu elements wrong: its times are suspect\n",
		       (unsigned long long)s->mpi_wrong);
	fflush(stdout);
}

static int build_sizes(const struct bench_opts *o, uint64_t **out, uint32_t *n)
{
	size_t esize = shardd_dtype_size(o->dtype);
	uint64_t b, *v = NULL;
	uint32_t cnt = 0;

	for (b = o->min_bytes; b <= o->max_bytes;
	     b = b > UINT64_MAX / o->factor ? UINT64_MAX : b * o->factor) {
		uint64_t *nv;

		if (b % (esize * o->ranks)) {
			printf("# %llu bytes: not a multiple of %u %s elements, skipped\n",
			       (unsigned long long)b, o->ranks, shardd_dtype_name(o->dtype));
			continue;
		}
		nv = realloc(v, (cnt + 1) * sizeof(*v));
		if (!nv) {
			free(v);
			return -ENOMEM;
		}
		v = nv;
		v[cnt++] = b;
		if (b == UINT64_MAX)
			break;
	}
	*out = v;
	*n = cnt;
	return 0;
}

/* Where the ranks are: sizes reported, and iterations of the current size. */
struct coll_progress {
	uint32_t *sizes; /* [rank]: sizes done */
	uint32_t *iters; /* [rank]: iterations of the current interleaved size done */
};

/*
 * Wait until every rank reported size k (iter < 0) or its iteration `iter`
 * of size k: 1; or a rank failed or went silent for COLL_PROGRESS_TIMEOUT_MS
 * (a negative code, printed with who).
 */
static int wait_ranks(const struct bench_opts *o, const struct coll_op *op,
		      const struct coll_shared *sh, int fd, uint32_t k, int32_t iter,
		      uint64_t bytes, struct coll_progress *pg)
{
	for (;;) {
		struct pollfd pfd = { .fd = fd, .events = POLLIN };
		struct coll_note note;
		uint32_t r;
		ssize_t n;
		int rc;

		for (r = 0;
		     r < o->ranks && (iter < 0 ? pg->sizes[r] > k : pg->iters[r] >= (uint32_t)iter);
		     r++)
			;
		if (r == o->ranks)
			return 1;
		rc = poll(&pfd, 1, COLL_PROGRESS_TIMEOUT_MS);
		if (rc < 0 && errno == EINTR)
			continue;
		if (rc == 0) {
			printf("# %s stuck: no rank finished size %llu", op->name,
			       (unsigned long long)bytes);
			if (iter >= 0)
				printf(" iteration %d", iter);
			printf(" within %d s; missing ranks:", COLL_PROGRESS_TIMEOUT_MS / 1000);
			for (r = 0; r < o->ranks; r++)
				if (iter < 0 ? pg->sizes[r] <= k : pg->iters[r] < (uint32_t)iter)
					printf(" %u", r);
			printf("\n");
			return -ETIMEDOUT;
		}
		n = read(fd, &note, sizeof(note));
		if (n != (ssize_t)sizeof(note) || note.rank >= o->ranks) {
			printf("# %s: rank processes exited before size %llu\n", op->name,
			       (unsigned long long)bytes);
			return -ECHILD;
		}
		if (!note.ok) {
			printf("# %s FAILED: %s\n", op->name, sh->state[note.rank].msg);
			return sh->state[note.rank].err ? sh->state[note.rank].err : -EIO;
		}
		if (note.iter < 0)
			pg->sizes[note.rank] = note.size_index + 1u;
		else
			pg->iters[note.rank] = (uint32_t)note.iter;
	}
}

/* The gate: one byte per rank. 0 or -EPIPE. */
static int open_gate(const struct bench_opts *o, int fd)
{
	static const char gos[8] = { 0 };

	return write(fd, gos, o->ranks) == (ssize_t)o->ranks ? 0 : -EPIPE;
}

/*
 * Size k: its roofline, the ranks' iterations (with a roofline pass between
 * two when interleaved), its roofline again, its row. 0 or a negative code.
 */
static int run_size(const struct bench_opts *o, const struct coll_op *op, struct coll_shared *sh,
		    int go_fd, int notify_fd, uint32_t k, uint64_t bytes, struct coll_progress *pg,
		    const struct bench_mpi_table *mpi, struct coll_summary *sum)
{
	struct bench_mem_best roof = { .ns = UINT64_MAX };
	struct bench_mem_ctx *ctx = NULL;
	int ret;
	uint32_t r;

	size_roofline(o, op, bytes, bytes >= COLL_INTERLEAVE_MIN_BYTES, &ctx, &roof);
	sh->interleave[k] = ctx != NULL;
	memset(pg->iters, 0, o->ranks * sizeof(*pg->iters));
	ret = open_gate(o, go_fd);
	for (uint32_t it = 1; !ret && ctx && it < sh->total; it++) {
		ret = wait_ranks(o, op, sh, notify_fd, k, (int32_t)it, bytes, pg);
		if (ret < 0)
			break;
		bench_mem_measure(ctx, 0, &roof);
		ret = open_gate(o, go_fd);
	}
	if (!ret)
		ret = wait_ranks(o, op, sh, notify_fd, k, -1, bytes, pg);
	if (ret < 0) {
		bench_mem_close(ctx);
		return ret;
	}
	size_roofline(o, op, bytes, 1, &ctx, &roof);
	/*
	 * The roofline is the best pass its kernels achieve: one slower
	 * than the op's fastest iteration was disturbed (other load during
	 * every pass; under a load of 8 on 2 cores a 4-rank reduce's best
	 * iteration came out at 116.6 % of it). Measure again; the row
	 * shows what remains.
	 */
	for (r = 0; r < COLL_ROOF_RETRIES && roof.ns != UINT64_MAX; r++) {
		double best;

		size_times_ns(sh, o, k, &best);
		if ((double)roof.ns <= best)
			break;
		size_roofline(o, op, bytes, 1, &ctx, &roof);
	}
	bench_mem_close(ctx);
	sum->roof_retried += r > 0;
	print_row(o, sh, k, bytes, &roof, mpi, sum);
	return 0;
}

int bench_collective_run(const struct bench_opts *o, enum bench_collective which,
			 const char *socket_path)
{
	const struct coll_op *op = &coll_ops[which];
	struct bench_mpi_table mpi = { 0 };
	struct coll_shared sh = { 0 };
	struct coll_summary sum = { 0 };
	uint64_t *sizes = NULL;
	struct coll_progress pg = { 0 };
	uint32_t nsizes = 0, r, k;
	pid_t *pids = NULL;
	int fds[2] = { -1, -1 }, go[2] = { -1, -1 }, ret;

	ret = build_sizes(o, &sizes, &nsizes);
	if (ret || nsizes == 0) {
		fprintf(stderr, "shardbench: %s: no size to run in -b %llu -e %llu\n", op->name,
			(unsigned long long)o->min_bytes, (unsigned long long)o->max_bytes);
		ret = ret ? ret : -EINVAL;
		goto out;
	}
	/* MPI first, while the daemon idles: each side gets the machine to itself. */
	bench_mpi_run(o, op->mpi_op, &mpi);

	ret = shared_map(&sh, o->ranks, nsizes, (uint32_t)(o->warmup + o->iters));
	if (ret)
		goto out;
	pids = calloc(o->ranks, sizeof(*pids));
	pg.sizes = calloc(o->ranks, sizeof(*pg.sizes));
	pg.iters = calloc(o->ranks, sizeof(*pg.iters));
	if (!pids || !pg.sizes || !pg.iters || pipe2(fds, O_CLOEXEC) || pipe2(go, O_CLOEXEC)) {
		ret = -ENOMEM;
		goto out;
	}
	print_header(o, op, &mpi);
	for (r = 0; r < o->ranks; r++) {
		struct coll_rank_ctx x = {
			.o = o,
			.op = op,
			.socket_path = socket_path,
			.sizes = sizes,
			.sh = &sh,
			.rank = r,
			.parent = getpid(),
			.go_fd = go[0],
		};

		/* Unflushed stdio would be printed again by every child. */
		fflush(NULL);
		pids[r] = fork();
		if (pids[r] < 0) {
			ret = -errno;
			fprintf(stderr, "shardbench: fork of rank %u: %s\n", r, strerror(errno));
			break;
		}
		if (pids[r] == 0) {
			close(fds[0]);
			close(go[1]);
			x.notify_fd = fds[1];
			_exit(rank_main(&x));
		}
	}
	close(fds[1]);
	fds[1] = -1;
	close(go[0]);
	go[0] = -1;

	for (k = 0; !ret && k < nsizes; k++)
		ret = run_size(o, op, &sh, go[1], fds[0], k, sizes[k], &pg, &mpi, &sum);
	if (sum.rows)
		print_summary(&sum);
	if (!ret && sum.wrong)
		ret = -EIO;
	/* EOF on the gate: ranks that wait for a next size leave. */
	close(go[1]);
	go[1] = -1;
	for (r = 0; r < o->ranks; r++) {
		if (pids[r] <= 0)
			continue;
		/* Survivors of a failed sweep would wait on a collective that never comes. */
		if (ret)
			kill(pids[r], SIGKILL);
		bench_reap_pid(pids[r], 30000);
	}
out:
	for (k = 0; k < 2; k++) {
		if (fds[k] >= 0)
			close(fds[k]);
		if (go[k] >= 0)
			close(go[k]);
	}
	if (sh.base)
		munmap(sh.base, sh.len);
	free(pg.sizes);
	free(pg.iters);
	free(pids);
	free(sizes);
	bench_mpi_free(&mpi);
	return ret;
}
