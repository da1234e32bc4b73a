/* SPDX-License-Identifier: MIT */
/*
 * The memory-bandwidth roofline every other benchmark is judged against,
 * measured in the same run: STREAM's copy (a = b) and an add (a = b + c,
 * triad without the scalar) over arrays far larger than the last-level
 * cache, on as many threads as the daemon's worker pool has (one per
 * online core). Bytes counted as STREAM counts them: each array element
 * read or written once (write-allocate traffic is not counted).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench.h"

/* 16 floats: gcc lowers this to whatever vector width the target has. */
typedef float bench_vec __attribute__((vector_size(64)));

enum { ROOF_COPY = 0, ROOF_ADD = 1, ROOF_NKERNELS };

struct roof_run {
	bench_vec         *a, *b, *c;
	size_t             nvec;     /* vectors per array */
	unsigned           threads;
	int                iters;
	pthread_barrier_t  barrier;
	pthread_mutex_t    gate_lock;
	pthread_cond_t     gate_cond;
	int                gate;     /* 0: wait, 1: run, -1: a thread failed to start */
	uint64_t          *ns;       /* [kernel][iter], written by thread 0 */
	uint64_t          *wrong;    /* [thread][kernel] */
};

struct roof_thread {
	struct roof_run *run;
	unsigned         id;
	pthread_t        tid;
};

unsigned bench_worker_threads(void)
{
	long n = sysconf(_SC_NPROCESSORS_ONLN);

	return n > 0 ? (unsigned)n : 1;
}

static uint64_t count_wrong(const bench_vec *a, size_t lo, size_t hi, float want)
{
	uint64_t wrong = 0;
	size_t i;
	int k;

	for (i = lo; i < hi; i++)
		for (k = 0; k < 16; k++)
			wrong += a[i][k] != want;
	return wrong;
}

static void *roof_worker(void *arg)
{
	struct roof_thread *t = arg;
	struct roof_run *r = t->run;
	size_t per = r->nvec / r->threads;
	size_t lo = per * t->id;
	size_t hi = t->id + 1 == r->threads ? r->nvec : lo + per;
	const bench_vec zero = { 0 };
	bench_vec ones = zero + 1.0f, twos = zero + 2.0f;
	uint64_t t0 = 0;
	size_t i;
	int k, it;

	/* Every thread must exist before anyone enters the barrier sized for all. */
	pthread_mutex_lock(&r->gate_lock);
	while (r->gate == 0)
		pthread_cond_wait(&r->gate_cond, &r->gate_lock);
	pthread_mutex_unlock(&r->gate_lock);
	if (r->gate < 0)
		return NULL;
	/* First touch by the thread that will stream the slice. */
	for (i = lo; i < hi; i++) {
		r->a[i] = zero;
		r->b[i] = ones;
		r->c[i] = twos;
	}
	for (k = 0; k < ROOF_NKERNELS; k++) {
		for (it = 0; it < r->iters; it++) {
			pthread_barrier_wait(&r->barrier);
			if (t->id == 0)
				t0 = bench_now_ns();
			if (k == ROOF_COPY)
				for (i = lo; i < hi; i++)
					r->a[i] = r->b[i];
			else
				for (i = lo; i < hi; i++)
					r->a[i] = r->b[i] + r->c[i];
			pthread_barrier_wait(&r->barrier);
			if (t->id == 0)
				r->ns[k * r->iters + it] = bench_now_ns() - t0;
		}
		r->wrong[t->id * ROOF_NKERNELS + k] = count_wrong(r->a, lo, hi, k == ROOF_COPY ? 1.0f : 3.0f);
	}
	return NULL;
}

static void *map_array(uint64_t bytes)
{
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	return p == MAP_FAILED ? NULL : p;
}

int bench_roofline_measure(uint64_t array_bytes, int iters, int print,
			   struct bench_roofline *out)
{
	static const char *const names[ROOF_NKERNELS] = { "copy", "add" };
	static const int streams[ROOF_NKERNELS] = { 2, 3 };
	struct roof_run r = { 0 };
	struct roof_thread *th = NULL;
	double best[ROOF_NKERNELS], avg[ROOF_NKERNELS];
	uint64_t wrong[ROOF_NKERNELS] = { 0 };
	unsigned i, started = 0;
	int k, it, ret = 0;
	char human[32];

	memset(out, 0, sizeof(*out));
	array_bytes -= array_bytes % sizeof(bench_vec);
	r.nvec = array_bytes / sizeof(bench_vec);
	r.threads = bench_worker_threads();
	r.iters = iters > 0 ? iters : 1;
	r.a = map_array(array_bytes);
	r.b = map_array(array_bytes);
	r.c = map_array(array_bytes);
	r.ns = calloc((size_t)ROOF_NKERNELS * (size_t)r.iters, sizeof(*r.ns));
	r.wrong = calloc((size_t)r.threads * ROOF_NKERNELS, sizeof(*r.wrong));
	th = calloc(r.threads, sizeof(*th));
	if (!r.a || !r.b || !r.c || !r.ns || !r.wrong || !th) {
		ret = -ENOMEM;
		fprintf(stderr, "shardbench: roofline: cannot allocate 3 arrays of %llu bytes\n",
			(unsigned long long)array_bytes);
		goto err;
	}
	ret = -pthread_barrier_init(&r.barrier, NULL, r.threads);
	if (ret)
		goto err;
	pthread_mutex_init(&r.gate_lock, NULL);
	pthread_cond_init(&r.gate_cond, NULL);
	for (i = 0; i < r.threads; i++) {
		th[i].run = &r;
		th[i].id = i;
	}
	for (i = 1; i < r.threads && !ret; i++) {
		ret = -pthread_create(&th[i].tid, NULL, roof_worker, &th[i]);
		if (ret)
			fprintf(stderr, "shardbench: roofline: starting thread %u of %u: %s\n",
				i + 1, r.threads, strerror(-ret));
		else
			started++;
	}
	pthread_mutex_lock(&r.gate_lock);
	r.gate = ret ? -1 : 1;
	pthread_cond_broadcast(&r.gate_cond);
	pthread_mutex_unlock(&r.gate_lock);
	if (!ret)
		roof_worker(&th[0]);
	for (i = 1; i <= started; i++)
		pthread_join(th[i].tid, NULL);
	pthread_cond_destroy(&r.gate_cond);
	pthread_mutex_destroy(&r.gate_lock);
	pthread_barrier_destroy(&r.barrier);
	if (ret)
		goto err;

	for (k = 0; k < ROOF_NKERNELS; k++) {
		uint64_t min = UINT64_MAX, sum = 0;
		double bytes = (double)streams[k] * (double)array_bytes;

		for (it = 0; it < r.iters; it++) {
			uint64_t ns = r.ns[k * r.iters + it];

			min = ns < min ? ns : min;
			sum += ns;
		}
		best[k] = bytes / (double)min;
		avg[k] = bytes / ((double)sum / r.iters);
	}
	out->copy_gbs = best[ROOF_COPY];
	out->add_gbs = best[ROOF_ADD];
	out->threads = r.threads;
	out->array_bytes = array_bytes;
	for (i = 0; i < r.threads; i++)
		for (k = 0; k < ROOF_NKERNELS; k++)
			wrong[k] += r.wrong[i * ROOF_NKERNELS + k];
	out->wrong = wrong[ROOF_COPY] + wrong[ROOF_ADD];
	if (print) {
		bench_format_size(array_bytes, human, sizeof(human));
		printf("# roofline: STREAM-style kernels on %u threads (one per online core, as the"
		       " daemon's worker pool), 3 arrays of %s fp32, best of %d\n",
		       r.threads, human, r.iters);
		printf("# %8s %16s %12s %12s %8s\n", "kernel", "bytes/iter(B)", "best(GB/s)",
		       "avg(GB/s)", "#wrong");
		for (k = 0; k < ROOF_NKERNELS; k++)
			printf("  %8s %16llu %12.2f %12.2f %8llu\n", names[k],
			       (unsigned long long)(streams[k] * array_bytes), best[k], avg[k],
			       (unsigned long long)wrong[k]);
		fflush(stdout);
	}
err:
	free(th);
	free(r.wrong);
	free(r.ns);
	if (r.c)
		munmap(r.c, array_bytes);
	if (r.b)
		munmap(r.b, array_bytes);
	if (r.a)
		munmap(r.a, array_bytes);
	return ret;
}
