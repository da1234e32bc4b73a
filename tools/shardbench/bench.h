/* SPDX-License-Identifier: MIT */
/*
 * shardbench internals: the options every benchmark reads, and the calls
 * each module (one per benchmark, plus the daemon it runs against and the
 * Open MPI comparator) offers to main.c. docs/BENCHMARKS.md explains what
 * each table means and how its bandwidths are derived.
 */
#ifndef SHARDBENCH_H
#define SHARDBENCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include "shardd_proto.h"

#define BENCH_MIB (1024ull * 1024ull)
#define BENCH_GIB (1024ull * BENCH_MIB)

/* Command-line options shared by every benchmark (nccl-tests' letters). */
struct bench_opts {
	uint64_t min_bytes;      /* -b: first size of the sweep */
	uint64_t max_bytes;      /* -e: last size of the sweep */
	uint64_t factor;         /* -f: size multiplication factor, >= 2 */
	int warmup;              /* -w: untimed iterations per size */
	int iters;               /* -n: timed iterations per size (ring: samples) */
	int iters_set;           /* -n was given (the ring picks its own default) */
	int check;               /* -c: check results (1) or not (0) */
	uint32_t dtype;          /* -d: param_dtype of the benchmark group */
	uint32_t ranks;          /* -r: rank processes (world: ranks per node) */
	uint32_t nodes;          /* --nodes: daemons of `shardbench world` */
	uint64_t idle_us;        /* --idle-us: gap before each sleeping ring sample */
	int load;                /* --load: gpu: also time the ops beside a compute load */
	const char *socket_path; /* --socket: a running daemon, or NULL */
	const char *shardd_path; /* --shardd: daemon binary to start */
	const char *mpi_path;    /* --mpi: the shardbench_mpi comparator */
	const char *trace_path;  /* --trace: latency's samples, one line each */
	const char *ckpt_dir;    /* --dir: checkpoint's folder on the disk it measures, or NULL */
	unsigned ckpt_rate;      /* --checkpoint-rate: checkpoint's daemon's, MB/s; 0: none given */
	const char *torch_python; /* --torch: checkpoint's and step's python with torch, or NULL */
	const char *self_dir;     /* directory of this binary */
	/* --exec: the executors unshard, reduce and latency run under, in turn (enum shardd_exec) */
	uint32_t execs[2];
	uint32_t nexecs;
	uint32_t exec; /* the one running now: registered as each group's exec */
};

/* Memory rooflines measured in the same run (roofline.c). */
#define BENCH_MEM_MAX_IN 8

enum bench_store {
	BENCH_STORE_PLAIN =
		0,          /* temporal stores: each output line is read first (write-allocate) */
	BENCH_STORE_NT = 1, /* non-temporal stores: written around the caches */
};

/* The order a multi-input kernel reads its inputs in. */
enum bench_mem_order {
	BENCH_MEM_STREAMS = 0,  /* one vector of each input in turn */
	BENCH_MEM_PREFETCH = 1, /* the same, with software prefetch 2 KiB ahead */
	BENCH_MEM_BLOCKED = 2,  /* 512 elements of one input after the other */
	BENCH_MEM_NORDERS
};

/* An access pattern: nin streams of in_size-byte elements into one of out_size bytes. */
struct bench_mem_pattern {
	uint32_t nin;      /* input streams, 0 .. BENCH_MEM_MAX_IN (0: write only) */
	uint32_t in_size;  /* bytes per input element: 2 or 4 */
	uint32_t out_size; /* bytes per output element: 0 (read only), 2 or 4 */
};

/* The fastest pass of a pattern over some count of elements. */
struct bench_mem_best {
	uint64_t ns;      /* best time of one pass; UINT64_MAX when not measured */
	uint64_t bytes;   /* count * (nin * in_size + out_size): each element once */
	int store;        /* enum bench_store of that pass */
	int order;        /* enum bench_mem_order of that pass */
	int wide;         /* 64-byte vectors and stores (AVX-512), else 32-byte ones */
	unsigned threads; /* and its threads */
	uint64_t wrong;   /* output elements that were wrong after a pass */
};

/* The machine table of `shardbench roofline`. */
enum {
	BENCH_ROOF_READ,
	BENCH_ROOF_WRITE,
	BENCH_ROOF_COPY,
	BENCH_ROOF_ADD,
	BENCH_ROOF_NKERNELS
};

struct bench_roofline {
	struct bench_mem_best kernel[BENCH_ROOF_NKERNELS];
	unsigned threads; /* one per online core, as the daemon's worker pool */
	uint64_t array_bytes;
	uint64_t wrong;
};

/* One row of the Open MPI comparator's output (mpi_compare.c). */
struct bench_mpi_row {
	uint64_t bytes; /* size(B) as shardbench counts it */
	double time_us; /* mean over iterations of (last end - first start) */
	uint64_t wrong;
};

struct bench_mpi_table {
	struct bench_mpi_row *rows;
	size_t nrows;
	char dtype[8]; /* the MPI datatype it moved: fp32, u16 */
	int available; /* 0: not built or mpirun missing */
	char why[256]; /* when not available or failed */
};

/* The daemon the benchmarks talk to (daemon_proc.c). */
struct bench_daemon {
	pid_t pid;             /* > 0 when shardbench started it */
	char dir[64];          /* its temporary directory */
	char socket_path[128]; /* where clients connect */
	char log_path[128];    /* its stdout and stderr */
};

/* ---- measure.c ------------------------------------------------------- */

/* CLOCK_MONOTONIC in ns: one clock for every process of the machine. */
static inline uint64_t bench_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Nearest-rank percentile (0 < p <= 100) of n sorted values. */
uint64_t bench_percentile(const uint64_t *sorted, size_t n, double p);
void bench_sort_u64(uint64_t *v, size_t n);
/* "256M", "1G", "64K", "4096" -> bytes. Returns 0 or -EINVAL. */
int bench_parse_size(const char *s, uint64_t *out);
/* Human size for table comments: "256 MiB". */
void bench_format_size(uint64_t bytes, char *buf, size_t len);
/* Wait up to timeout_ms for `pid` to exit; returns its wait status or -ETIMEDOUT. */
int bench_wait_pid(pid_t pid, int timeout_ms);
/* bench_wait_pid; on -ETIMEDOUT SIGKILL `pid` and wait as long again. Its wait status or -errno. */
int bench_reap_pid(pid_t pid, int timeout_ms);

/* ---- values.c -------------------------------------------------------- */

/* Element i of a param (seed picks the input set): small integers, exact in every dtype. */
float bench_param_value(uint64_t i, uint32_t seed);
/* Element i of rank `rank`'s gradient: in [-8, 7], so means over <= 8 ranks are exact. */
float bench_grad_value(uint64_t i, uint32_t rank, uint32_t seed);
/* Element codecs for values exact in `dtype` (zero or normal), independent of kernels/. */
void bench_store_exact(void *buf, uint32_t dtype, uint64_t i, float v);
float bench_load_exact(const void *buf, uint32_t dtype, uint64_t i);

/* ---- roofline.c ------------------------------------------------------ */

/*
 * The best pass of pattern p over `count` elements (rounded down to 8):
 * plain and non-temporal stores, every bench_mem_order (2 or more
 * inputs), 1 thread and one per online core, each
 * at least 3 passes and 20 ms of them. 0 or -errno (-EINVAL: a pattern
 * this kernel does not have).
 */
int bench_mem_best(const struct bench_mem_pattern *p, uint64_t count, struct bench_mem_best *out);
/*
 * The same in steps, for measuring between other work: open maps and fills
 * the arrays and starts the threads (0 or -errno); measure keeps the faster
 * pass into *best (ns UINT64_MAX: not yet measured) of every variant, or
 * with all == 0 of best's variant alone; close frees everything (NULL: no-op).
 */
struct bench_mem_ctx;
/* "nt+pf+zmm/2": a best pass's store, order, vector width and threads, for the tables. */
void bench_mem_best_name(const struct bench_mem_best *b, char *buf, size_t len);
int bench_mem_open(const struct bench_mem_pattern *p, uint64_t count, struct bench_mem_ctx **out);
void bench_mem_measure(struct bench_mem_ctx *c, int all, struct bench_mem_best *best);
void bench_mem_close(struct bench_mem_ctx *c);
uint64_t bench_mem_pattern_bytes(const struct bench_mem_pattern *p, uint64_t count);
int bench_mem_have_nt(void);
/* MemAvailable in bytes; 0 when /proc/meminfo does not say. */
uint64_t bench_mem_available(void);
const char *bench_store_name(int store);
const char *bench_order_name(int order);
/*
 * The machine table: read, write, copy and add over arrays of `array_bytes`
 * each, best of the store kinds and thread counts. Prints it when `print`.
 * Returns 0 or -errno.
 */
int bench_roofline_measure(uint64_t array_bytes, int print, struct bench_roofline *out);
unsigned bench_worker_threads(void);

/* ---- daemon_proc.c --------------------------------------------------- */

/*
 * Start `shardd --backend backend` (NULL: host) on a temporary socket and
 * wait until it accepts. 0 or -errno.
 */
int bench_daemon_start(const char *shardd_path, const char *backend, struct bench_daemon *d);
/* The same with a checkpoint folder: shardd --state-dir state_dir [--checkpoint-rate rate]. */
int bench_daemon_start_state(const char *shardd_path, const char *state_dir, unsigned rate,
			     struct bench_daemon *d);
/* Stop a daemon bench_daemon_start() started; a no-op for --socket. */
void bench_daemon_stop(struct bench_daemon *d);

/* ---- mpi_compare.c --------------------------------------------------- */

/*
 * Run `mpirun -np ranks shardbench_mpi <op> ...` over the sweep of `o` and
 * collect its rows. op is "allgather" or "reduce_scatter". Never fails the
 * caller: t->available says whether rows exist, t->why why not.
 */
void bench_mpi_run(const struct bench_opts *o, const char *op, struct bench_mpi_table *t);
const struct bench_mpi_row *bench_mpi_find(const struct bench_mpi_table *t, uint64_t bytes);
void bench_mpi_free(struct bench_mpi_table *t);

/* ---- collective.c ---------------------------------------------------- */

enum bench_collective {
	BENCH_UNSHARD = 0,
	BENCH_REDUCE = 1,
};

/*
 * The unshard or reduce sweep through the daemon at `socket_path` with
 * o->ranks forked rank processes, each size against the roofline of the
 * op's own access pattern measured right before and after it (the best
 * of the two); prints its table. Returns 0, or a
 * negative code when a rank failed (its message is printed).
 */
int bench_collective_run(const struct bench_opts *o, enum bench_collective which,
			 const char *socket_path);

/* ---- ring.c ---------------------------------------------------------- */

/*
 * Nop round trips, spinning and sleeping, against a socket ping-pong.
 * daemon_pid > 0 (a daemon shardbench started): pin its loop thread and
 * this client to different cores for the ring modes.
 */
int bench_ring_run(const struct bench_opts *o, const char *socket_path, pid_t daemon_pid);

/* ---- latency.c ------------------------------------------------------- */

/*
 * One small unshard and reduce (-b bytes, o->ranks ranks) -n times, timed
 * per stage from the clients; prints p50/p90/p99. trace_path: also write
 * every sample there (tools/shardbench/trace_latency.py reads it).
 * Returns 0 or a negative code (the failing rank's message printed).
 */
int bench_latency_run(const struct bench_opts *o, const char *socket_path, const char *trace_path);

/* ---- reduce_step.c ------------------------------------------------- */

/*
 * A REDUCE with SHARDD_REDUCE_STEP (the fused pass) against REDUCE then
 * STEP through the daemon at `socket_path`, o->ranks rank processes, AdamW
 * on fp32 params of each size of the sweep; prints its table. 0, 1 when
 * the two left different params (#wrong), or a negative code (printed).
 */
int bench_reduce_step_run(const struct bench_opts *o, const char *socket_path);

/* ---- gpu.c ----------------------------------------------------------- */

/* CUDA kernels against cudaMemcpy device-to-device; 0 and "# no GPU" without one. */
int bench_gpu_run(const struct bench_opts *o);

/* ---- gpu_ops.c ------------------------------------------------------- */

/*
 * Unshard and reduce latency through `shardd --backend cuda` (started
 * here, or the one at o->socket_path) with o->ranks rank processes on
 * device 0: submit to "the trainer's stream may proceed", with and without
 * a stream set; with o->load, also beside a compute load in the rank
 * processes (gpu_load.cu). 0 and a "skipped" line without CUDA or a GPU. It forks rank processes that use CUDA, so
 * it must run before this process touches CUDA (bench_gpu_run).
 */
int bench_gpu_ops_run(const struct bench_opts *o);

/* ---- checkpoint.c --------------------------------------------------- */

/*
 * Checkpoint save and restore of an AdamW state through the daemon at
 * `socket_path` (started with --state-dir `state_dir`) over the size sweep,
 * against O_DIRECT sequential write and read of the same bytes in
 * `state_dir`; prints its table. 0, or a negative code (printed).
 */
int bench_checkpoint_run(const struct bench_opts *o, const char *socket_path,
			 const char *state_dir);

/* ---- step.c --------------------------------------------------------- */

/*
 * The optimizer kernels (AdamW, SGD) over the size sweep on 1 thread and
 * on one per core, against a same-run roofline with their traffic and
 * against torch.optim.AdamW (fused, foreach, single-tensor) when the
 * --torch interpreter (o->torch_python, else $SHARDBENCH_TORCH, else
 * python3) has torch, implausible torch times flagged; prints its table.
 * Returns 0, 1 when a result was wrong, or -errno.
 */
int bench_step_run(const struct bench_opts *o);

/* ---- world.c -------------------------------------------------------- */

/*
 * HSDP reduce, FSDP unshard and reduce across --nodes daemons under mpirun,
 * against Open MPI. 0, or 1 on failure or #wrong.
 */
int bench_world_run(const struct bench_opts *o);

#endif /* SHARDBENCH_H */
