/* SPDX-License-Identifier: MIT */
/*
 * `shardbench gpu`, second table: unshard and reduce through a real
 * `shardd --backend cuda`, o->ranks rank processes sharing device 0.
 *
 * Per op, rank 0 reports the p50 and p99 over o->iters of:
 * - proceed: from the submit until the sync call returns, which is when
 *   the trainer may queue work that uses the results. Without a stream
 *   (mode cpu) the daemon finished the kernels first; with one (mode
 *   stream) the daemon completes as soon as its kernels are queued and
 *   the trainer's stream waits on the daemon's event.
 * - done: from the submit until the results are in device memory, seen
 *   through an event recorded on the trainer's stream after the op.
 * Every rank checks the gathered values (unshard) and the averaged
 * gradient (reduce) of its last iteration.
 *
 * --load: each rank process also runs a trainer's compute, a kernel that
 * keeps every SM busy for ~1.5 ms per launch (gpu_load.cu), launched back
 * to back from a thread of its own on a stream of its own. Every row is
 * then measured twice, idle and busy (the load running), and a busy row
 * adds the load's throughput during its ops as a percentage of the load
 * alone (rank 0's launches per second, measured while every rank's load
 * ran and no op did). Time-sliced, each op of the daemon's context waits
 * for the GPU's slice; under MPS it runs beside the load (docs/CUDA.md).
 */
#include <stdio.h>

#include "bench.h"

#ifdef SHARDD_HAVE_CUDA

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include "gpu_load.h"
#include "shardd.h"

#define RANK_TIMEOUT_MS 600000
#define LOAD_LAUNCH_NS  1500000ull /* one launch of the load, alone: a GEMM's order */
#define LOAD_DEPTH      2 /* launches queued: the next always waits behind the running one */
#define LOAD_ALONE_NS   500000000ull
#define LOAD_SETTLE_US  20000

enum {
	MODE_CPU,
	MODE_STREAM,
	NMODES
};
enum {
	OP_UNSHARD,
	OP_REDUCE,
	NOPS
};

/* The trainer-like load of one rank process (--load). */
struct load {
	pthread_t thread;
	cudaStream_t s;
	cudaEvent_t ev[LOAD_DEPTH];
	float *sink;
	int blocks, threads;
	uint64_t iters; /* per launch: LOAD_LAUNCH_NS on an idle GPU */
	atomic_int stop;
	atomic_uint_fast64_t done; /* launches completed */
	atomic_int err;            /* a cudaError_t of the load's thread */
	double alone_per_s;        /* launches per second with no op running */
};

struct rank_ctx {
	const struct bench_opts *o;
	uint32_t rank;
	struct shardd_client *c;
	cudaStream_t s;
	cudaEvent_t ev;
	uint64_t *proceed, *done; /* [iters] ns */
	float *host;              /* staging for fills and checks */
	struct load *load;        /* --load, else NULL */
};

#define RANK_CUDA(call)                                                                      \
	do {                                                                                 \
		cudaError_t e_ = (call);                                                     \
		if (e_ != cudaSuccess) {                                                     \
			fprintf(stderr, "shardbench gpu: rank %u: %s: %s\n", x->rank, #call, \
				cudaGetErrorString(e_));                                     \
			return -1;                                                           \
		}                                                                            \
	} while (0)

#define RANK_SHARDD(call)                                                                    \
	do {                                                                                 \
		if ((call) < 0) {                                                            \
			fprintf(stderr, "shardbench gpu: rank %u: %s: %s\n", x->rank, #call, \
				shardd_last_error());                                        \
			return -1;                                                           \
		}                                                                            \
	} while (0)

static void *load_main(void *arg)
{
	struct load *l = arg;
	cudaError_t e = cudaSetDevice(0);

	for (uint64_t i = 0; e == cudaSuccess && !atomic_load(&l->stop); i++) {
		int slot = (int)(i % LOAD_DEPTH);

		if (i >= LOAD_DEPTH) {
			e = cudaEventSynchronize(l->ev[slot]);
			atomic_fetch_add(&l->done, 1);
		}
		if (e == cudaSuccess)
			e = bench_load_launch(l->blocks, l->threads, l->iters, l->sink, l->s);
		if (e == cudaSuccess)
			e = cudaEventRecord(l->ev[slot], l->s);
	}
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(l->s);
	atomic_store(&l->err, (int)e);
	return NULL;
}

static int load_begin(struct rank_ctx *x)
{
	struct load *l = x->load;

	atomic_store(&l->stop, 0);
	atomic_store(&l->done, 0);
	if (pthread_create(&l->thread, NULL, load_main, l)) {
		fprintf(stderr, "shardbench gpu: rank %u: pthread_create for the load failed\n",
			x->rank);
		return -1;
	}
	/* Past the first launch: the load runs back to back before the ops start. */
	usleep(LOAD_SETTLE_US);
	return 0;
}

static int load_end(struct rank_ctx *x)
{
	struct load *l = x->load;

	atomic_store(&l->stop, 1);
	pthread_join(l->thread, NULL);
	RANK_CUDA((cudaError_t)atomic_load(&l->err));
	return 0;
}

/* Launches per second between (t0, n0) and now. */
static double load_rate(const struct load *l, uint64_t t0, uint64_t n0)
{
	uint64_t dt = bench_now_ns() - t0;

	return dt ? (double)(atomic_load(&l->done) - n0) * 1e9 / (double)dt : 0;
}

/* The load's shape, its iterations per launch (timed alone), its stream and events. */
static int load_setup(struct rank_ctx *x, struct load *l)
{
	cudaEvent_t a, b;
	float ms = 0;
	const uint64_t probe = 4096;

	x->load = l;
	RANK_CUDA(bench_load_shape(&l->blocks, &l->threads));
	RANK_CUDA(cudaMalloc((void **)&l->sink, (size_t)l->threads * sizeof(float)));
	RANK_CUDA(cudaStreamCreateWithFlags(&l->s, cudaStreamNonBlocking));
	for (int i = 0; i < LOAD_DEPTH; i++)
		RANK_CUDA(cudaEventCreateWithFlags(&l->ev[i],
						   cudaEventDisableTiming | cudaEventBlockingSync));
	RANK_CUDA(cudaEventCreate(&a));
	RANK_CUDA(cudaEventCreate(&b));
	RANK_CUDA(bench_load_launch(l->blocks, l->threads, probe, l->sink, l->s));
	RANK_CUDA(cudaEventRecord(a, l->s));
	RANK_CUDA(bench_load_launch(l->blocks, l->threads, probe, l->sink, l->s));
	RANK_CUDA(cudaEventRecord(b, l->s));
	RANK_CUDA(cudaEventSynchronize(b));
	RANK_CUDA(cudaEventElapsedTime(&ms, a, b));
	cudaEventDestroy(a);
	cudaEventDestroy(b);
	l->iters = ms > 0 ? (uint64_t)((double)probe * (double)LOAD_LAUNCH_NS / (ms * 1e6)) : probe;
	if (l->iters < 1)
		l->iters = 1;
	return 0;
}

/* The load alone: every rank's load running, no op. */
static int load_measure_alone(struct rank_ctx *x)
{
	struct load *l = x->load;
	uint64_t t0, n0;

	if (load_begin(x))
		return -1;
	t0 = bench_now_ns();
	n0 = atomic_load(&l->done);
	usleep(LOAD_ALONE_NS / 1000);
	l->alone_per_s = load_rate(l, t0, n0);
	if (load_end(x))
		return -1;
	if (x->rank == 0) {
		printf("# load: %d blocks x %d threads, %llu FMA rounds per launch (%.2f ms alone), "
		       "%.1f launches/s alone (rank 0, every rank's load running)\n",
		       l->blocks, l->threads, (unsigned long long)l->iters,
		       l->alone_per_s > 0 ? 1e3 / l->alone_per_s : 0.0, l->alone_per_s);
		fflush(stdout);
	}
	return 0;
}

/* One timed op; on return the results are in device memory and the stream is idle. */
static int rank_op(struct rank_ctx *x, struct shardd_group *g, int op, uint64_t step, int i)
{
	uint64_t t0 = bench_now_ns();

	if (op == OP_UNSHARD)
		RANK_SHARDD(shardd_unshard(g, step));
	else
		RANK_SHARDD(shardd_reduce(g, step, 0));
	x->proceed[i] = bench_now_ns() - t0;
	RANK_CUDA(cudaEventRecord(x->ev, x->s));
	RANK_CUDA(cudaEventSynchronize(x->ev));
	x->done[i] = bench_now_ns() - t0;
	if (op == OP_UNSHARD)
		RANK_SHARDD(shardd_reshard(g, step));
	else
		RANK_SHARDD(shardd_zero_grad(g));
	return 0;
}

/* The last iteration's results: every shard gathered, the gradients averaged. */
static int rank_check(struct rank_ctx *x, struct shardd_group *g, int op, uint64_t numel)
{
	uint32_t world = x->o->ranks;
	uint64_t per = numel / world;
	float want;

	if (op == OP_UNSHARD) {
		RANK_CUDA(cudaMemcpy(x->host, shardd_group_unsharded(g, 0), numel * sizeof(float),
				     cudaMemcpyDeviceToHost));
		for (uint64_t i = 0; i < numel; i++) {
			want = (float)(i / per + 1);
			if (x->host[i] != want) {
				fprintf(stderr,
					"shardbench gpu: rank %u: unsharded[%llu] = %g, want %g\n",
					x->rank, (unsigned long long)i, x->host[i], want);
				return -1;
			}
		}
		return 0;
	}
	RANK_CUDA(cudaMemcpy(x->host, shardd_group_shard_grad(g, 0), per * sizeof(float),
			     cudaMemcpyDeviceToHost));
	/* Rank r's gradient is r + 1 everywhere: the mean of 1..world. */
	want = (float)(world + 1) / 2.0f;
	for (uint64_t i = 0; i < per; i++) {
		if (x->host[i] != want) {
			fprintf(stderr,
				"shardbench gpu: rank %u: sharded grad[%llu] = %g, want %g\n",
				x->rank, (unsigned long long)i, x->host[i], want);
			return -1;
		}
	}
	return 0;
}

/* load_pct: the load's throughput during the row, % of alone; < 0 for an idle row. */
static void print_row(const struct rank_ctx *x, uint64_t bytes, int op, int mode, double load_pct)
{
	int n = x->o->iters;

	bench_sort_u64(x->proceed, (size_t)n);
	bench_sort_u64(x->done, (size_t)n);
	printf("%12llu %8s %7s %12.1f %12.1f %12.1f %12.1f", (unsigned long long)bytes,
	       op == OP_UNSHARD ? "unshard" : "reduce", mode == MODE_CPU ? "cpu" : "stream",
	       bench_percentile(x->proceed, (size_t)n, 50) / 1e3,
	       bench_percentile(x->proceed, (size_t)n, 99) / 1e3,
	       bench_percentile(x->done, (size_t)n, 50) / 1e3,
	       bench_percentile(x->done, (size_t)n, 99) / 1e3);
	if (x->load && load_pct < 0)
		printf(" %5s %8s", "idle", "-");
	else if (x->load)
		printf(" %5s %8.1f", "busy", load_pct);
	printf("\n");
	fflush(stdout);
}

/* Warm-up and o->iters timed ops, then one more that leaves the result for the check. */
static int rank_row(struct rank_ctx *x, struct shardd_group *g, int op, uint64_t *step)
{
	int ret = 0;

	for (int i = 0; i < x->o->warmup && !ret; i++)
		ret = rank_op(x, g, op, ++*step, 0);
	for (int i = 0; i < x->o->iters && !ret; i++)
		ret = rank_op(x, g, op, ++*step, i);
	if (ret)
		return ret;
	/* Measured reduces each followed a zero_grad, unshards a reshard: one more leaves the last result. */
	if (op == OP_REDUCE)
		RANK_SHARDD(shardd_reduce(g, ++*step, 0));
	else
		RANK_SHARDD(shardd_unshard(g, ++*step));
	RANK_CUDA(cudaStreamSynchronize(x->s));
	return 0;
}

/* One row idle and, with --load, one busy: timed ops then the check of the last. */
static int rank_rows(struct rank_ctx *x, struct shardd_group *g, uint64_t bytes, int op, int mode,
		     uint64_t numel, uint64_t *step)
{
	for (int busy = 0; busy <= (x->load != NULL); busy++) {
		uint64_t t0 = 0, n0 = 0;
		double pct = -1;
		int ret;

		if (busy) {
			if (load_begin(x))
				return -1;
			t0 = bench_now_ns();
			n0 = atomic_load(&x->load->done);
		}
		ret = rank_row(x, g, op, step);
		if (busy) {
			pct = x->load->alone_per_s > 0
				      ? 100.0 * load_rate(x->load, t0, n0) / x->load->alone_per_s
				      : 0;
			ret |= load_end(x);
		}
		if (!ret && x->o->check)
			ret = rank_check(x, g, op, numel);
		if (!ret && op == OP_UNSHARD)
			RANK_SHARDD(shardd_reshard(g, *step));
		if (!ret && op == OP_REDUCE)
			RANK_SHARDD(shardd_zero_grad(g));
		if (ret)
			return ret;
		if (x->rank == 0)
			print_row(x, bytes, op, mode, pct);
	}
	return 0;
}

/* One size: a group of one fp32 param, both ops, both modes. */
static int rank_size(struct rank_ctx *x, uint64_t bytes, uint64_t *step)
{
	const struct bench_opts *o = x->o;
	uint64_t numel = bytes / sizeof(float), per = numel / o->ranks;
	struct shardd_param_desc p = {
		.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { numel }
	};
	struct shardd_group *g = NULL;
	char name[32];
	int ret = 0;

	snprintf(name, sizeof(name), "size%llu", (unsigned long long)bytes);
	RANK_SHARDD(shardd_group_register(x->c, name, &p, 1, NULL, NULL, &g));
	for (uint64_t i = 0; i < numel; i++)
		x->host[i] = (float)(x->rank + 1);
	/* The shard and the whole gradient hold rank + 1: the gathered tensor is 1..world by shard. */
	RANK_CUDA(cudaMemcpy(shardd_group_shard(g, 0), x->host, per * sizeof(float),
			     cudaMemcpyHostToDevice));
	RANK_CUDA(cudaMemcpy(shardd_group_grad(g, 0), x->host, numel * sizeof(float),
			     cudaMemcpyHostToDevice));
	/* A pageable copy may still be in flight when cudaMemcpy returns. */
	RANK_CUDA(cudaDeviceSynchronize());
	/* Once, after the first registration: the ranks reach it about together, so their loads overlap. */
	if (x->load && x->load->alone_per_s == 0 && load_measure_alone(x))
		ret = -1;
	for (int mode = 0; mode < NMODES && !ret; mode++) {
		if (mode == MODE_STREAM)
			RANK_SHARDD(shardd_stream_set(x->c, x->s));
		else
			shardd_stream_clear(x->c);
		for (int op = 0; op < NOPS && !ret; op++)
			ret = rank_rows(x, g, bytes, op, mode, numel, step);
	}
	shardd_stream_clear(x->c);
	shardd_group_close(g);
	return ret;
}

static int rank_main(const struct bench_opts *o, const char *socket_path, uint32_t rank)
{
	struct shardd_attach_opts ao = {
		.socket_path = socket_path,
		.job = "shardbench-gpu",
		.rank = rank,
		.replicate = 1,
		.shard = o->ranks,
		.device = 0,
	};
	struct rank_ctx ctx = { .o = o, .rank = rank }, *x = &ctx;
	struct load load = { 0 };
	uint64_t step = 0;
	int ret = 0;

	x->proceed = calloc((size_t)o->iters, sizeof(uint64_t));
	x->done = calloc((size_t)o->iters, sizeof(uint64_t));
	if (!x->proceed || !x->done)
		return -1;
	RANK_CUDA(cudaSetDevice(0));
	RANK_CUDA(cudaStreamCreateWithFlags(&x->s, cudaStreamNonBlocking));
	RANK_CUDA(cudaEventCreateWithFlags(&x->ev, cudaEventDisableTiming));
	RANK_CUDA(cudaMallocHost((void **)&x->host, o->max_bytes));
	if (o->load && load_setup(x, &load))
		return -1;
	RANK_SHARDD(shardd_connect(&ao, &x->c));
	for (uint64_t bytes = o->min_bytes; bytes <= o->max_bytes && !ret; bytes *= o->factor) {
		if (bytes % (o->ranks * sizeof(float)) == 0)
			ret = rank_size(x, bytes, &step);
		if (bytes > UINT64_MAX / o->factor)
			break;
	}
	shardd_close(x->c);
	return ret;
}

/*
 * GPUs visible, counted in a child: the rank processes are forked from this
 * one, and a process that initialised CUDA cannot hand it to its children.
 */
static int visible_gpus(void)
{
	pid_t pid;
	int n = 0, status;

	fflush(NULL);
	pid = fork();
	if (pid < 0)
		return 0;
	if (pid == 0)
		_exit(cudaGetDeviceCount(&n) == cudaSuccess && n > 0 ? (n > 64 ? 64 : n) : 0);
	status = bench_reap_pid(pid, RANK_TIMEOUT_MS);
	return status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : 0;
}

int bench_gpu_ops_run(const struct bench_opts *o)
{
	struct bench_daemon d = { 0 };
	const char *socket_path = o->socket_path;
	pid_t pids[64];
	uint32_t started = 0;
	int failed = 0;

	if (visible_gpus() == 0) {
		printf("#\n# shardbench gpu ops: no CUDA device: skipped\n");
		return 0;
	}
	if (o->ranks < 1 || o->ranks > sizeof(pids) / sizeof(pids[0])) {
		fprintf(stderr, "shardbench gpu ops: -r %u: 1 to %zu ranks\n", o->ranks,
			sizeof(pids) / sizeof(pids[0]));
		return -1;
	}
	if (!socket_path) {
		if (bench_daemon_start(o->shardd_path, "cuda", &d))
			return -1;
		socket_path = d.socket_path;
	}
	printf("#\n# shardbench gpu ops: shardd --backend cuda%s%s, %u ranks on device 0, fp32, "
	       "warm-up %d, iterations %d\n",
	       o->socket_path ? " at " : "", o->socket_path ? o->socket_path : "", o->ranks,
	       o->warmup, o->iters);
	printf("# proceed: submit -> the sync call returns (the trainer may queue dependent work); "
	       "done: submit -> results in device memory\n");
	printf("# mode cpu: no stream (the daemon syncs before completing); stream: "
	       "shardd_stream_set (fences)\n");
	if (o->load)
		printf("# --load: each row idle, then busy with every rank's compute load running; "
		       "load%%: its throughput during the row, %% of the load alone\n");
	printf("# %10s %8s %7s %12s %12s %12s %12s%s\n", "size(B)", "op", "mode", "proceed_p50",
	       "proceed_p99", "done_p50", "done_p99", o->load ? "  load    load%" : "");
	printf("# %10s %8s %7s %12s %12s %12s %12s\n", "", "", "", "(us)", "(us)", "(us)", "(us)");
	fflush(stdout);
	for (; started < o->ranks; started++) {
		pid_t parent = getpid();

		pids[started] = fork();
		if (pids[started] < 0) {
			failed = 1;
			break;
		}
		if (pids[started] == 0) {
			/* A shardbench killed mid-run takes its ranks along. */
			prctl(PR_SET_PDEATHSIG, SIGKILL);
			_exit(getppid() == parent && rank_main(o, socket_path, started) == 0 ? 0
											     : 1);
		}
	}
	for (uint32_t r = 0; r < started; r++) {
		int status = bench_reap_pid(pids[r], RANK_TIMEOUT_MS);

		if (status < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
			fprintf(stderr, "shardbench gpu ops: rank %u failed (status %d)\n", r,
				status);
			failed = 1;
		}
	}
	if (!o->socket_path)
		bench_daemon_stop(&d);
	return failed ? -1 : 0;
}

#else /* !SHARDD_HAVE_CUDA */

int bench_gpu_ops_run(const struct bench_opts *o)
{
	(void)o;
	printf("#\n# shardbench gpu ops: built without CUDA: skipped\n");
	return 0;
}

#endif
