/* SPDX-License-Identifier: MIT */
/*
 * The memory rooflines every other benchmark is judged against, measured
 * in the same run.
 *
 * One kernel family covers every access pattern: `nin` input streams of
 * `in_size`-byte elements combined (xor) into one output stream of
 * `out_size`-byte elements (0: none, the inputs are only read; a 4-byte
 * input narrows to a 2-byte output by dropping the high half, a 2-byte one
 * widens). That is STREAM's read, write, copy and add, and also the exact
 * traffic of an op: an unshard reads 4-byte shards and writes d-byte
 * elements, a reduce reads S d-byte grads per 4-byte output. A pattern is
 * timed with plain (temporal) stores and with non-temporal ones, with its
 * inputs read as interleaved streams, with software prefetch, or in
 * blocks (the orders kernels/ uses), on one thread and on one per online
 * core (the daemon's pool runs small ops on
 * one thread, large ones on all), and its roofline is the best of them:
 * nothing that moves those bytes in that pattern can be faster on this
 * machine at that time, so an op at more than 100 % means this roofline
 * is wrong. Bytes are counted as the op's floor counts them, each element
 * read or written once (a plain store's write-allocate read is the cost
 * of choosing plain stores, not bytes the pattern must move).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MEM_HAVE_NT 1
#else
#define MEM_HAVE_NT 0
#endif

#include "bench.h"
#include "optim_isa.h"

/*
 * Elements per vector step (32 bytes of 32-bit lanes: native registers in
 * the AVX2 and AVX-512 clones, so no step spills); arrays and thread slices
 * are whole multiples of it.
 */
#define MEM_LANES 8
/* Thread slices start on this many elements: whole 64-byte lines of every stream. */
#define MEM_SLICE_ALIGN 64
/*
 * Software prefetch distance. The hardware prefetcher follows a few streams
 * per core; with many input streams it falls behind, which the daemon's
 * reduce kernel makes up for with prefetches 2 KiB ahead (kernels/reduce.c):
 * the roofline must be at least as good, so it tries the same.
 */
#define MEM_PREFETCH_AHEAD 2048
/*
 * Blocked order: MEM_CHUNK vector steps (512 elements, kernels/'s
 * SHARDD_K_BLOCK) of one input after the other into an L1 buffer, then the
 * output; each input is read in runs of 1 or 2 KiB, which the prefetcher
 * follows better than 8 streams interleaved 32 bytes at a time (the
 * daemon's portable reduce walks its inputs this way).
 */
#define MEM_CHUNK 64
/* A pattern variant runs at least MEM_MIN_RUNS times and until MEM_MIN_NS of runs, at most MEM_MAX_RUNS. */
#define MEM_MIN_RUNS 3
#define MEM_MAX_RUNS 2000
#define MEM_MIN_NS   (20 * 1000 * 1000ull)

typedef uint32_t mem_v32 __attribute__((vector_size(32)));
typedef uint16_t mem_v16 __attribute__((vector_size(16)));

struct mem_args {
	const void *in[BENCH_MEM_MAX_IN];
	void *out;
	uint32_t nin, in_size, out_size;
	int nt;
	int order; /* enum bench_mem_order */
	int wide;  /* mem_pass_512: 64-byte vectors and stores */
};

unsigned bench_worker_threads(void)
{
	long n = sysconf(_SC_NPROCESSORS_ONLN);

	return n > 0 ? (unsigned)n : 1;
}

int bench_mem_have_nt(void)
{
	return MEM_HAVE_NT;
}

const char *bench_store_name(int store)
{
	return store == BENCH_STORE_NT ? "nt" : "plain";
}

const char *bench_order_name(int order)
{
	static const char *const names[BENCH_MEM_NORDERS] = { "streams", "prefetch", "blocked" };

	return order >= 0 && order < BENCH_MEM_NORDERS ? names[order] : "?";
}

/* ---- the kernel ------------------------------------------------------- */

/* Elements per step of the 64-byte kernel: one 64-byte line of a 2-byte output. */
#define MEM_WIDE_STEP 32

/* Store `bytes` (16 or 32) of v at p; nt: bypassing the caches (whole lines are written in order). */
static inline __attribute__((always_inline)) void mem_store(void *p, const void *v, size_t bytes,
							    int nt)
{
#if MEM_HAVE_NT
	if (nt) {
		for (size_t o = 0; o < bytes; o += 16)
			_mm_stream_si128((__m128i *)((char *)p + o),
					 _mm_loadu_si128((const __m128i *)((const char *)v + o)));
		return;
	}
#endif
	memcpy(p, v, bytes);
}

/*
 * Blocks [lo, hi) of MEM_LANES elements. Inlined with constant in_size,
 * out_size, nin and nt into mem_pass's cases, so each case is a straight
 * loop of vector loads, xors and stores.
 */
/* Output step b of x: out_size bytes per lane, plain or non-temporal. */
static inline __attribute__((always_inline)) void
mem_put(const struct mem_args *a, size_t b, const mem_v32 *x, uint32_t out_size, int nt)
{
	if (out_size == 4) {
		mem_store((char *)a->out + b * sizeof(*x), x, sizeof(*x), nt);
	} else {
		mem_v16 y = __builtin_convertvector(*x, mem_v16);

		mem_store((char *)a->out + b * sizeof(y), &y, sizeof(y), nt);
	}
}

/*
 * Blocks [lo, hi) of MEM_LANES elements. Inlined with constant in_size,
 * out_size, nin, nt and order into mem_pass's cases, so each case is a
 * straight loop of vector loads, xors and stores.
 */
static inline __attribute__((always_inline)) uint32_t
mem_blocks(const struct mem_args *a, size_t lo, size_t hi, uint32_t in_size, uint32_t out_size,
	   uint32_t nin, int nt, int order)
{
	mem_v32 acc = { 0 };

	if (order == BENCH_MEM_BLOCKED && nin >= 2) {
		mem_v32 buf[MEM_CHUNK];

		for (size_t c = lo; c < hi; c += MEM_CHUNK) {
			size_t len = hi - c < MEM_CHUNK ? hi - c : MEM_CHUNK;

			for (uint32_t k = 0; k < nin; k++) {
				for (size_t j = 0; j < len; j++) {
					mem_v32 x;

					if (in_size == 4)
						x = ((const mem_v32 *)a->in[k])[c + j];
					else
						x = __builtin_convertvector(
							((const mem_v16 *)a->in[k])[c + j],
							mem_v32);
					buf[j] = k ? buf[j] ^ x : x;
				}
			}
			for (size_t j = 0; j < len; j++) {
				if (out_size)
					mem_put(a, c + j, &buf[j], out_size, nt);
				else
					acc ^= buf[j];
			}
		}
	}
	for (size_t b = lo; b < hi && !(order == BENCH_MEM_BLOCKED && nin >= 2); b++) {
		mem_v32 x = { 0 };

		/* A prefetch never faults: one past an input's end is harmless, its address an integer. */
		for (uint32_t k = 0; order == BENCH_MEM_PREFETCH && k < nin; k++)
			__builtin_prefetch((const void *)((uintptr_t)a->in[k] +
							  b * MEM_LANES * in_size +
							  MEM_PREFETCH_AHEAD));
		if (nin == 0)
			x += 0x3f803f80u;
		for (uint32_t k = 0; k < nin; k++) {
			if (in_size == 4)
				x ^= ((const mem_v32 *)a->in[k])[b];
			else
				x ^= __builtin_convertvector(((const mem_v16 *)a->in[k])[b],
							     mem_v32);
		}
		if (out_size == 0)
			acc ^= x;
		else
			mem_put(a, b, &x, out_size, nt);
	}
#if MEM_HAVE_NT
	if (nt)
		_mm_sfence();
#endif
	for (int i = 1; i < MEM_LANES; i++)
		acc[0] ^= acc[i];
	return acc[0];
}

#define MEM_ORDERS(IN, OUT, NIN, NT)                                           \
	(a->order == BENCH_MEM_BLOCKED                                         \
		 ? mem_blocks(a, lo, hi, IN, OUT, NIN, NT, BENCH_MEM_BLOCKED)  \
	 : a->order == BENCH_MEM_PREFETCH                                      \
		 ? mem_blocks(a, lo, hi, IN, OUT, NIN, NT, BENCH_MEM_PREFETCH) \
		 : mem_blocks(a, lo, hi, IN, OUT, NIN, NT, BENCH_MEM_STREAMS))
#define MEM_CASE(IN, OUT, NIN)                  \
	case ((IN) << 16 | (OUT) << 8 | (NIN)): \
		return a->nt ? MEM_ORDERS(IN, OUT, NIN, 1) : MEM_ORDERS(IN, OUT, NIN, 0)

/* The kernel's blocks [lo, hi), one clone per ISA; the patterns of mem_supported(). */
__attribute__((target_clones("avx512f", "avx2", "default"))) static uint32_t
mem_pass(const struct mem_args *a, size_t lo, size_t hi)
{
	switch (a->in_size << 16 | a->out_size << 8 | a->nin) {
		MEM_CASE(4, 0, 1); /* read */
		MEM_CASE(4, 4, 0); /* write */
		MEM_CASE(4, 4, 1); /* copy */
		MEM_CASE(4, 4, 2); /* add */
		MEM_CASE(4, 2, 1); /* unshard to a 16-bit dtype */
		MEM_CASE(4, 4, 4);
		MEM_CASE(4, 4, 8);
		MEM_CASE(2, 4, 1); /* reduce of 16-bit grads */
		MEM_CASE(2, 4, 2);
		MEM_CASE(2, 4, 4);
		MEM_CASE(2, 4, 8);
	default:
		return 0;
	}
}

#if MEM_HAVE_NT
/*
 * The same patterns in 64-byte vectors with 64-byte (non-temporal or
 * plain) stores, for CPUs with AVX-512: the daemon's kernels use them, and
 * on the Xeon host (issue 33) a 2-thread fp32 -> bf16 unshard through them
 * beat the 32-byte kernel's best pass (up to 101 %roof), so the roofline
 * must try them too. Streams and prefetch orders; the blocked one is the
 * 32-byte kernel's only.
 */
#define MEM_512        __attribute__((target("avx512f,avx512bw")))
#define MEM_512_INLINE MEM_512 static inline __attribute__((always_inline))

/* 16 elements of input k from element e, as 32-bit lanes (prefetched ahead when pf). */
MEM_512_INLINE __m512i mem_load_512(const void *in, size_t e, uint32_t in_size, int pf)
{
	const char *p = (const char *)in + e * in_size;

	if (pf)
		_mm_prefetch((const char *)((uintptr_t)p + MEM_PREFETCH_AHEAD), _MM_HINT_T0);
	if (in_size == 4)
		return _mm512_loadu_si512((const void *)p);
	return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)p));
}

MEM_512_INLINE __m512i mem_in_512(const struct mem_args *a, size_t e, uint32_t in_size,
				  uint32_t nin, int pf)
{
	__m512i x = nin ? _mm512_setzero_si512() : _mm512_set1_epi32(0x3f803f80);

	for (uint32_t k = 0; k < nin; k++)
		x = _mm512_xor_si512(x, mem_load_512(a->in[k], e, in_size, pf));
	return x;
}

MEM_512_INLINE void mem_store_512(void *p, __m512i v, int nt)
{
	if (nt)
		_mm512_stream_si512(p, v);
	else
		_mm512_storeu_si512(p, v);
}

/* Elements [lo, hi), whole MEM_WIDE_STEPs from a 64-element boundary (lines of every stream). */
MEM_512_INLINE uint32_t mem_wide(const struct mem_args *a, size_t lo, size_t hi, uint32_t in_size,
				 uint32_t out_size, uint32_t nin, int nt, int pf)
{
	__m512i acc = _mm512_setzero_si512();
	uint32_t lanes[16];

	for (size_t e = lo; e < hi; e += MEM_WIDE_STEP) {
		__m512i x = mem_in_512(a, e, in_size, nin, pf);
		__m512i y = mem_in_512(a, e + 16, in_size, nin, pf);
		char *o = (char *)a->out + e * out_size;

		if (out_size == 0) {
			acc = _mm512_xor_si512(acc, _mm512_xor_si512(x, y));
		} else if (out_size == 4) {
			mem_store_512(o, x, nt);
			mem_store_512(o + 64, y, nt);
		} else {
			mem_store_512(
				o,
				_mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(x)),
						   _mm512_cvtepi32_epi16(y), 1),
				nt);
		}
	}
	if (nt)
		_mm_sfence();
	_mm512_storeu_si512(lanes, acc);
	for (int i = 1; i < 16; i++)
		lanes[0] ^= lanes[i];
	return lanes[0];
}

#define MEM_WIDE(IN, OUT, NIN, NT)                                                 \
	(a->order == BENCH_MEM_PREFETCH ? mem_wide(a, lo, hi, IN, OUT, NIN, NT, 1) \
					: mem_wide(a, lo, hi, IN, OUT, NIN, NT, 0))
#define MEM_WIDE_CASE(IN, OUT, NIN)             \
	case ((IN) << 16 | (OUT) << 8 | (NIN)): \
		return a->nt ? MEM_WIDE(IN, OUT, NIN, 1) : MEM_WIDE(IN, OUT, NIN, 0)

/* mem_pass's patterns over elements [lo, hi) (as mem_wide) in 64-byte vectors. */
MEM_512 static uint32_t mem_pass_512(const struct mem_args *a, size_t lo, size_t hi)
{
	switch (a->in_size << 16 | a->out_size << 8 | a->nin) {
		MEM_WIDE_CASE(4, 0, 1);
		MEM_WIDE_CASE(4, 4, 0);
		MEM_WIDE_CASE(4, 4, 1);
		MEM_WIDE_CASE(4, 4, 2);
		MEM_WIDE_CASE(4, 2, 1);
		MEM_WIDE_CASE(4, 4, 4);
		MEM_WIDE_CASE(4, 4, 8);
		MEM_WIDE_CASE(2, 4, 1);
		MEM_WIDE_CASE(2, 4, 2);
		MEM_WIDE_CASE(2, 4, 4);
		MEM_WIDE_CASE(2, 4, 8);
	default:
		return 0;
	}
}

/* 64-byte variants run where the CPU has AVX-512 and the kernels' limit allows it (optim_isa.h). */
static int mem_have_wide(void)
{
	return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
	       shardd_k_isa_allows(SHARDD_K_ISA_AVX512);
}
#else
static int mem_have_wide(void)
{
	return 0;
}
#endif

static int mem_supported(const struct bench_mem_pattern *p)
{
	struct mem_args a = { .nin = p->nin, .in_size = p->in_size, .out_size = p->out_size };

	switch (a.in_size << 16 | a.out_size << 8 | a.nin) {
	case 4 << 16 | 0 << 8 | 1:
	case 4 << 16 | 4 << 8 | 0:
	case 4 << 16 | 4 << 8 | 1:
	case 4 << 16 | 4 << 8 | 2:
	case 4 << 16 | 2 << 8 | 1:
	case 4 << 16 | 4 << 8 | 4:
	case 4 << 16 | 4 << 8 | 8:
	case 2 << 16 | 4 << 8 | 1:
	case 2 << 16 | 4 << 8 | 2:
	case 2 << 16 | 4 << 8 | 4:
	case 2 << 16 | 4 << 8 | 8:
		return 1;
	default:
		return 0;
	}
}

uint64_t bench_mem_available(void)
{
	char line[256];
	unsigned long long kib = 0;
	FILE *f = fopen("/proc/meminfo", "r");

	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1)
			break;
	if (f)
		fclose(f);
	return (uint64_t)kib * 1024;
}

uint64_t bench_mem_pattern_bytes(const struct bench_mem_pattern *p, uint64_t count)
{
	return count * ((uint64_t)p->nin * p->in_size + p->out_size);
}

/* ---- threads ---------------------------------------------------------- */

struct mem_run {
	struct mem_args args;
	size_t nblocks;
	unsigned threads; /* taking part in the current pass */
	unsigned pool;    /* threads of the pool, the caller included */
	unsigned started; /* worker threads created (besides the caller) */
	pthread_t *tid;
	uint32_t *sink; /* [thread]: read-only passes' xor, so their loads stay */
	pthread_barrier_t go, done;
	pthread_mutex_t gate_lock;
	pthread_cond_t gate_cond;
	int gate; /* 0: wait, 1: run, -1: a thread failed to start, leave */
	int quit;
};

struct mem_thread {
	struct mem_run *run;
	unsigned id;
};

/* Thread id's blocks of nblocks, starting on MEM_SLICE_ALIGN elements. */
static void mem_slice(size_t nblocks, unsigned threads, unsigned id, size_t *lo, size_t *hi)
{
	size_t per = MEM_SLICE_ALIGN / MEM_LANES;
	size_t units = (nblocks + per - 1) / per;
	size_t b0 = units * id / threads * per, b1 = units * (id + 1) / threads * per;

	*lo = b0 < nblocks ? b0 : nblocks;
	*hi = b1 < nblocks ? b1 : nblocks;
}

static void mem_slice_run(struct mem_run *r, unsigned id)
{
	size_t lo, hi;
	uint32_t x = 0;

	mem_slice(r->nblocks, r->threads, id, &lo, &hi);
#if MEM_HAVE_NT
	if (r->args.wide) {
		/* Whole steps in 64-byte vectors, the last slice's tail (a few blocks) in 32-byte ones. */
		size_t whole = (hi - lo) * MEM_LANES / MEM_WIDE_STEP * MEM_WIDE_STEP;

		x = mem_pass_512(&r->args, lo * MEM_LANES, lo * MEM_LANES + whole);
		lo += whole / MEM_LANES;
	}
#endif
	((volatile uint32_t *)r->sink)[id] = x ^ mem_pass(&r->args, lo, hi);
}

static void *mem_worker(void *arg)
{
	struct mem_thread *t = arg;
	struct mem_run *r = t->run;
	unsigned id = t->id;

	free(t);
	/* Every thread must exist before anyone enters the barriers sized for all. */
	pthread_mutex_lock(&r->gate_lock);
	while (r->gate == 0)
		pthread_cond_wait(&r->gate_cond, &r->gate_lock);
	pthread_mutex_unlock(&r->gate_lock);
	if (r->gate < 0)
		return NULL;
	for (;;) {
		pthread_barrier_wait(&r->go);
		if (r->quit)
			break;
		if (id < r->threads)
			mem_slice_run(r, id);
		pthread_barrier_wait(&r->done);
	}
	return NULL;
}

/* One pass on `threads` threads (the caller is thread 0); its time in ns. */
static uint64_t mem_time_pass(struct mem_run *r, unsigned threads)
{
	uint64_t t0;

	if (threads == 1 || r->pool == 1) {
		r->threads = 1;
		t0 = bench_now_ns();
		mem_slice_run(r, 0);
		return bench_now_ns() - t0;
	}
	r->threads = threads;
	pthread_barrier_wait(&r->go);
	t0 = bench_now_ns();
	mem_slice_run(r, 0);
	pthread_barrier_wait(&r->done);
	return bench_now_ns() - t0;
}

/* A pool of `threads` (the caller included). 0 or -errno (nothing left running). */
static int mem_start(struct mem_run *r, unsigned threads)
{
	int ret = 0;

	r->pool = threads;
	r->tid = calloc(threads, sizeof(*r->tid));
	r->sink = calloc(threads, sizeof(*r->sink));
	if (!r->tid || !r->sink)
		return -ENOMEM;
	if (threads < 2)
		return 0;
	pthread_mutex_init(&r->gate_lock, NULL);
	pthread_cond_init(&r->gate_cond, NULL);
	pthread_barrier_init(&r->go, NULL, threads);
	pthread_barrier_init(&r->done, NULL, threads);
	for (unsigned i = 1; i < threads && !ret; i++) {
		struct mem_thread *t = malloc(sizeof(*t));

		if (!t) {
			ret = -ENOMEM;
			break;
		}
		*t = (struct mem_thread){ .run = r, .id = i };
		ret = -pthread_create(&r->tid[i], NULL, mem_worker, t);
		if (ret) {
			free(t);
			fprintf(stderr, "shardbench: roofline: starting thread %u of %u: %s\n",
				i + 1, threads, strerror(-ret));
		} else {
			r->started++;
		}
	}
	pthread_mutex_lock(&r->gate_lock);
	r->gate = ret ? -1 : 1;
	pthread_cond_broadcast(&r->gate_cond);
	pthread_mutex_unlock(&r->gate_lock);
	return ret;
}

static void mem_stop(struct mem_run *r)
{
	if (r->pool >= 2 && r->tid && r->sink) {
		if (r->gate > 0) {
			r->quit = 1;
			pthread_barrier_wait(&r->go);
		}
		for (unsigned i = 1; i <= r->started; i++)
			pthread_join(r->tid[i], NULL);
		pthread_barrier_destroy(&r->done);
		pthread_barrier_destroy(&r->go);
		pthread_cond_destroy(&r->gate_cond);
		pthread_mutex_destroy(&r->gate_lock);
	}
	free(r->sink);
	free(r->tid);
}

/* ---- arrays ----------------------------------------------------------- */

/*
 * Stream j starts j * MEM_STAGGER bytes past a page boundary: streams that
 * all start on the same offset modulo the page (separate mappings do) meet
 * in the same cache sets and alias at 4 KiB, which measured 6x slower for
 * 8 inputs on the 2-core CI VM. A whole number of lines, for the stores.
 */
#define MEM_STAGGER (4096 + 64)

struct mem_arrays {
	void *in[BENCH_MEM_MAX_IN];
	void *out;
	size_t in_bytes, out_bytes;
	void *base; /* one mapping holds every stream */
	size_t len;
};

static size_t mem_page_up(size_t n)
{
	return (n + 4095) & ~(size_t)4095;
}

/* Map the streams of p over n elements. 0 or -ENOMEM. */
static int mem_map(const struct bench_mem_pattern *p, size_t n, struct mem_arrays *m)
{
	size_t in_stride = mem_page_up(n * p->in_size) + 2 * 4096 * (p->nin + 1);
	char *b;

	m->in_bytes = n * p->in_size;
	m->out_bytes = n * p->out_size;
	m->len = p->nin * in_stride + mem_page_up(m->out_bytes) + MEM_STAGGER * (p->nin + 1) + 4096;
	b = mmap(NULL, m->len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (b == MAP_FAILED)
		return -ENOMEM;
	m->base = b;
	for (uint32_t k = 0; k < p->nin; k++)
		m->in[k] = b + k * in_stride + k * MEM_STAGGER;
	if (p->out_size)
		m->out = b + p->nin * in_stride + p->nin * MEM_STAGGER;
	return 0;
}

static void mem_unmap(struct mem_arrays *m)
{
	if (m->base)
		munmap(m->base, m->len);
}

/* Input k holds k + 1 in every element. */
static void mem_fill(const struct bench_mem_pattern *p, struct mem_arrays *m, size_t n)
{
	for (uint32_t k = 0; k < p->nin; k++) {
		if (p->in_size == 4)
			for (size_t i = 0; i < n; i++)
				((uint32_t *)m->in[k])[i] = k + 1;
		else
			for (size_t i = 0; i < n; i++)
				((uint16_t *)m->in[k])[i] = (uint16_t)(k + 1);
	}
	if (m->out)
		memset(m->out, 0xff, m->out_bytes);
}

/* Output elements that differ from the xor of the inputs (or the write kernel's constant). */
static uint64_t mem_wrong(const struct bench_mem_pattern *p, const struct mem_arrays *m, size_t n)
{
	uint32_t want = p->nin ? 0 : 0x3f803f80u;
	uint64_t wrong = 0;

	for (uint32_t k = 0; k < p->nin; k++)
		want ^= k + 1;
	if (p->out_size == 4)
		for (size_t i = 0; i < n; i++)
			wrong += ((const uint32_t *)m->out)[i] != want;
	else if (p->out_size == 2)
		for (size_t i = 0; i < n; i++)
			wrong += ((const uint16_t *)m->out)[i] != (uint16_t)want;
	return wrong;
}

/* ---- measuring -------------------------------------------------------- */

/* Best pass of one variant: at least MEM_MIN_RUNS runs and MEM_MIN_NS of them. */
static uint64_t mem_best_variant(struct mem_run *r, unsigned threads, int min_runs)
{
	uint64_t best = UINT64_MAX, total = 0;

	mem_time_pass(r, threads); /* warm-up: caches, TLB */
	for (int i = 0; i < MEM_MAX_RUNS && (i < min_runs || total < MEM_MIN_NS); i++) {
		uint64_t ns = mem_time_pass(r, threads);

		total += ns;
		best = ns < best ? ns : best;
	}
	return best;
}

/* A pattern's arrays, filled, and its threads, kept between measurements. */
struct bench_mem_ctx {
	struct bench_mem_pattern p;
	struct mem_arrays m;
	struct mem_run r;
	size_t n;
	unsigned tcounts[2]; /* 1 and one per online core */
};

void bench_mem_close(struct bench_mem_ctx *c)
{
	if (!c)
		return;
	mem_stop(&c->r);
	mem_unmap(&c->m);
	free(c);
}

int bench_mem_open(const struct bench_mem_pattern *p, uint64_t count, struct bench_mem_ctx **out)
{
	struct bench_mem_ctx *c;
	int ret;

	*out = NULL;
	if (!mem_supported(p) || count < MEM_LANES || p->nin > BENCH_MEM_MAX_IN)
		return -EINVAL;
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->p = *p;
	c->n = (size_t)(count - count % MEM_LANES);
	c->tcounts[0] = 1;
	c->tcounts[1] = bench_worker_threads();
	ret = mem_map(p, c->n, &c->m);
	if (ret) {
		fprintf(stderr, "shardbench: roofline: cannot map %u x %zu + %zu bytes\n", p->nin,
			c->n * p->in_size, c->n * p->out_size);
		free(c);
		return ret;
	}
	for (uint32_t k = 0; k < p->nin; k++)
		c->r.args.in[k] = c->m.in[k];
	mem_fill(p, &c->m, c->n);
	c->r.args.out = c->m.out;
	c->r.args.nin = p->nin;
	c->r.args.in_size = p->in_size;
	c->r.args.out_size = p->out_size;
	c->r.nblocks = c->n / MEM_LANES;
	ret = mem_start(&c->r, c->tcounts[1]);
	if (ret) {
		bench_mem_close(c);
		return ret;
	}
	*out = c;
	return 0;
}

/* One variant's best pass into *best when faster; its wrong elements counted. */
static void mem_measure_variant(struct bench_mem_ctx *c, int nt, int ord, int wide,
				unsigned threads, struct bench_mem_best *best)
{
	uint64_t ns;

	c->r.args.nt = nt;
	c->r.args.order = ord;
	c->r.args.wide = wide;
	if (c->m.out)
		memset(c->m.out, 0xff, c->m.out_bytes);
	ns = mem_best_variant(&c->r, threads, MEM_MIN_RUNS);
	best->wrong += mem_wrong(&c->p, &c->m, c->n);
	if (ns < best->ns) {
		best->ns = ns;
		best->store = nt ? BENCH_STORE_NT : BENCH_STORE_PLAIN;
		best->order = ord;
		best->wide = wide;
		best->threads = threads;
	}
}

void bench_mem_best_name(const struct bench_mem_best *b, char *buf, size_t len)
{
	snprintf(buf, len, "%s%s%s/%u", bench_store_name(b->store),
		 b->order == BENCH_MEM_PREFETCH  ? "+pf"
		 : b->order == BENCH_MEM_BLOCKED ? "+blk"
						 : "",
		 b->wide ? "+zmm" : "", b->threads);
}

void bench_mem_measure(struct bench_mem_ctx *c, int all, struct bench_mem_best *best)
{
	best->bytes = bench_mem_pattern_bytes(&c->p, c->n);
	if (!all && best->ns != UINT64_MAX) {
		mem_measure_variant(c, best->store == BENCH_STORE_NT, best->order, best->wide,
				    best->threads, best);
		return;
	}
	/*
	 * Every combination: store kind, input order (blocked for 2 or more
	 * inputs, in 32-byte vectors only), vector width, threads.
	 */
	for (int nt = 0; nt <= (c->p.out_size && MEM_HAVE_NT); nt++)
		for (int wide = 0; wide <= mem_have_wide(); wide++)
			for (int ord = 0; ord < BENCH_MEM_NORDERS; ord++) {
				if (ord == BENCH_MEM_BLOCKED && (c->p.nin < 2 || wide))
					continue;
				if (ord == BENCH_MEM_PREFETCH && c->p.nin == 0)
					continue;
				for (int ti = 0; ti < (c->tcounts[1] > 1 ? 2 : 1); ti++)
					mem_measure_variant(c, nt, ord, wide, c->tcounts[ti], best);
			}
}

int bench_mem_best(const struct bench_mem_pattern *p, uint64_t count, struct bench_mem_best *out)
{
	struct bench_mem_ctx *c;
	int ret;

	memset(out, 0, sizeof(*out));
	out->ns = UINT64_MAX;
	out->bytes = bench_mem_pattern_bytes(p, count - count % MEM_LANES);
	ret = bench_mem_open(p, count, &c);
	if (ret)
		return ret;
	bench_mem_measure(c, 1, out);
	bench_mem_close(c);
	return 0;
}

/* ---- the machine table ------------------------------------------------ */

static const struct {
	const char *name;
	struct bench_mem_pattern p;
	const char *what;
} mem_kernels[BENCH_ROOF_NKERNELS] = {
	{ "read", { 1, 4, 0 }, "s ^= b[i]" },
	{ "write", { 0, 4, 4 }, "a[i] = k" },
	{ "copy", { 1, 4, 4 }, "a[i] = b[i]" },
	{ "add", { 2, 4, 4 }, "a[i] = b[i] ^ c[i] (STREAM add/triad traffic)" },
};

int bench_roofline_measure(uint64_t array_bytes, int print, struct bench_roofline *out)
{
	uint64_t count = array_bytes / sizeof(float);
	char human[32];
	int ret = 0;

	memset(out, 0, sizeof(*out));
	out->threads = bench_worker_threads();
	out->array_bytes = count * sizeof(float);
	if (print) {
		bench_format_size(out->array_bytes, human, sizeof(human));
		printf("# roofline: memory kernels over arrays of %s of 32-bit elements, best pass of plain and"
		       " non-temporal stores,\n#   inputs streamed, prefetched or blocked (2+ inputs), in 32- or"
		       " (AVX-512) 64-byte vectors, on 1 and %u"
		       " threads (one per online core, as the daemon's\n#   pool); bytes: each element read or"
		       " written once\n",
		       human, out->threads);
		printf("# %8s %16s %12s %7s %9s %6s %5s %8s  %s\n", "kernel", "bytes/pass(B)",
		       "best(GB/s)", "store", "order", "vector", "thr", "#wrong", "pass");
	}
	for (int k = 0; k < BENCH_ROOF_NKERNELS && !ret; k++) {
		struct bench_mem_best *b = &out->kernel[k];

		ret = bench_mem_best(&mem_kernels[k].p, count, b);
		if (ret)
			break;
		out->wrong += b->wrong;
		if (print)
			printf("  %8s %16llu %12.2f %7s %9s %6s %5u %8llu  %s\n",
			       mem_kernels[k].name, (unsigned long long)b->bytes,
			       (double)b->bytes / (double)b->ns, bench_store_name(b->store),
			       bench_order_name(b->order), b->wide ? "64B" : "32B", b->threads,
			       (unsigned long long)b->wrong, mem_kernels[k].what);
	}
	if (print)
		fflush(stdout);
	return ret;
}
