/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend against the host backend (CPU kernels) on the same
 * inputs: every op through the backend table, results copied back from
 * the device and compared bit for bit (the CUDA kernels promise the CPU's
 * numerics; inputs are finite, so no NaN payload can differ). Also the
 * export/import paths a client takes: a buffer exported as an fd
 * (--cuda-export fd) and imported with client/cuda_import.c sees the
 * daemon's bytes and writes; a buffer exported as a legacy CUDA IPC handle
 * (--cuda-export ipc) is imported by a forked child process (the exporting
 * process cannot open its own handle) that sees the same. Skips without a
 * CUDA device.
 */
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "backend_cuda.h"
#include "cudapair.h"
#include "cuda_import.h"
#include "harness.h"
#include "layout.h"
#include "pool.h"
#include "shardd_kernels.h"
#include "xorshift.h"

#define WORLD 3
/* The daemon's default collective timeout: bounds waits on NCCL, which these single-device tests never use. */
#define TIMEOUT_NS (30ull * 1000000000ull)

static struct shd_backend_ctx *cuda_be, *host_be;
static struct shd_pool *pool;

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void)
{
	return xorshift64s(&rng_state);
}

/* Wait for the cuda backend's work on the device of `buf`. */
static int cuda_sync_one(const struct shd_buf *buf)
{
	return cuda_be->ops->sync(cuda_be, &buf, 1, NULL, 0);
}

/* Both backends, the cuda one with --cuda-export `mode`. */
static void setup_mode(uint32_t mode)
{
	cudapair_backends(mode, TIMEOUT_NS, &cuda_be, &host_be, &pool);
}

/* The daemon's default: fd on a device that supports it (every current GPU), else ipc. */
static void setup(void)
{
	setup_mode(SHD_CUDA_EXPORT_AUTO);
}

static void setup_fd(void)
{
	setup_mode(SHD_CUDA_EXPORT_FD);
}

static void setup_ipc(void)
{
	setup_mode(SHD_CUDA_EXPORT_IPC);
}

static void teardown(void)
{
	cudapair_backends_destroy(&cuda_be, &host_be, &pool);
}

/* Device bytes equal to the host backend's, or the first differing byte is named. */
static void pair_expect_same(const struct cudapair *p, const char *what)
{
	uint8_t *got = malloc(p->bytes);

	cr_assert_not_null(got);
	/* The backend only queued the op: wait as the engine does before an unfenced completion. */
	cr_assert_eq(cuda_sync_one(&p->d), 0);
	CUDA_OK(cudaMemcpy(got, shd_backend_cuda_ptr(&p->d), p->bytes, cudaMemcpyDeviceToHost));
	for (uint64_t i = 0; i < p->bytes; i++)
		if (got[i] != p->host[i])
			cr_assert_fail("%s: byte %llu of %llu: cpu 0x%02x, cuda 0x%02x", what,
				       (unsigned long long)i, (unsigned long long)p->bytes,
				       p->host[i], got[i]);
	free(got);
}

/* Random finite values on a grid (exact sums of few terms), as `dtype`, n elements at dst. */
static void fill_values(void *dst, uint32_t dtype, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++) {
		float v = ldexpf((float)((int64_t)(rng() % 20001) - 10000), -6);

		shardd_k_cast((char *)dst + i * shardd_dtype_size(dtype), dtype, &v,
			      SHARDD_DTYPE_FP32, 1);
	}
}

/*
 * A group of three params for a shard group of WORLD: dim-0 sharding with
 * padding rows (fp32 and bf16) and a Shard(1) param (chunk-cat).
 */
static void build_layout(struct shd_layout *l, uint32_t param_dtype)
{
	struct shardd_param_spec specs[3];
	char err[256];

	memset(specs, 0, sizeof(specs));
	strcpy(specs[0].name, "w");
	specs[0].dtype = SHARDD_DTYPE_FP32;
	specs[0].ndim = 2;
	specs[0].shape[0] = 7;
	specs[0].shape[1] = 33;
	strcpy(specs[1].name, "b");
	specs[1].dtype = SHARDD_DTYPE_BF16;
	specs[1].ndim = 1;
	specs[1].shape[0] = 1001;
	strcpy(specs[2].name, "m");
	specs[2].dtype = SHARDD_DTYPE_FP32;
	specs[2].ndim = 3;
	specs[2].shard_dim = 1;
	specs[2].shape[0] = 4;
	specs[2].shape[1] = 6;
	specs[2].shape[2] = 5;
	cr_assert_eq(shd_layout_build(specs, 3, WORLD, param_dtype, l, err, sizeof(err)), 0, "%s",
		     err);
}

Test(cuda_backend, exported_buffer_imports_with_the_daemons_bytes, .timeout = 60, .init = setup_fd,
     .fini = teardown)
{
	const uint64_t bytes = 3 * 1000 * 1000 + 17; /* not a multiple of any granularity */
	struct shardd_cuda_mapping m;
	struct shd_buf_export ex;
	struct shd_buf buf;
	uint8_t *want = malloc(bytes), *got = malloc(bytes);

	cr_assert(want && got);
	cr_assert_eq(cuda_be->ops->alloc(cuda_be, bytes, 0, "roundtrip", &buf), 0);
	cr_assert_eq(buf.bytes, bytes);
	cr_assert_geq(buf.fd, 0);
	cr_assert_eq(cuda_be->ops->export_buf(cuda_be, &buf, 1, &ex), 0);
	cr_assert_eq(ex.kind, SHARDD_EXPORT_FD);
	cr_assert_geq(ex.fd, 0);
	cr_assert_eq(shardd_cuda_import(ex.fd, 0, bytes, &m), 0, "import: %s", shardd_last_error());
	close(ex.fd);
	cr_assert_neq(m.ptr, 0);
	cr_assert_geq(m.size, bytes);

	/* New buffers are zero, seen through the client's mapping. */
	CUDA_OK(cudaMemcpy(got, (void *)(uintptr_t)m.ptr, bytes, cudaMemcpyDeviceToHost));
	for (uint64_t i = 0; i < bytes; i++)
		cr_assert_eq(got[i], 0, "byte %llu of a new buffer is 0x%02x",
			     (unsigned long long)i, got[i]);

	/* The daemon writes, the client reads. */
	for (uint64_t i = 0; i < bytes; i++)
		want[i] = (uint8_t)rng();
	CUDA_OK(cudaMemcpy(shd_backend_cuda_ptr(&buf), want, bytes, cudaMemcpyHostToDevice));
	CUDA_OK(cudaMemcpy(got, (void *)(uintptr_t)m.ptr, bytes, cudaMemcpyDeviceToHost));
	cr_assert_eq(memcmp(want, got, bytes), 0,
		     "the client's mapping does not show the daemon's bytes");

	/* The client writes (its grads), the daemon reads. */
	for (uint64_t i = 0; i < bytes; i++)
		want[i] = (uint8_t)rng();
	CUDA_OK(cudaMemcpy((void *)(uintptr_t)m.ptr, want, bytes, cudaMemcpyHostToDevice));
	CUDA_OK(cudaMemcpy(got, shd_backend_cuda_ptr(&buf), bytes, cudaMemcpyDeviceToHost));
	cr_assert_eq(memcmp(want, got, bytes), 0, "the daemon does not see the client's writes");

	/* zero(offset, bytes) clears exactly that range. */
	CUDA_OK(cudaDeviceSynchronize());
	cr_assert_eq(cuda_be->ops->zero(cuda_be, &buf, 4096, 100000), 0);
	cr_assert_eq(cuda_sync_one(&buf), 0);
	memset(want + 4096, 0, 100000);
	CUDA_OK(cudaMemcpy(got, (void *)(uintptr_t)m.ptr, bytes, cudaMemcpyDeviceToHost));
	cr_assert_eq(memcmp(want, got, bytes), 0,
		     "zero(4096, 100000) changed other bytes or missed some");
	cr_assert_eq(cuda_be->ops->zero(cuda_be, &buf, bytes - 10, 11), -EINVAL);

	shardd_cuda_unmap(&m);
	cuda_be->ops->free(cuda_be, &buf);
	free(want);
	free(got);
}

static void unshard_case(uint32_t param_dtype)
{
	struct shd_layout l;
	struct cudapair shards[WORLD], unsharded;
	struct shd_buf *hs[WORLD], *ds[WORLD];

	build_layout(&l, param_dtype);
	for (int s = 0; s < WORLD; s++) {
		cudapair_alloc(cuda_be, host_be, &shards[s], l.shard_size, "shard");
		for (uint32_t i = 0; i < l.nparams; i++)
			fill_values(shards[s].host + l.params[i].shard_offset, l.params[i].dtype,
				    l.params[i].shard_numel);
		cudapair_to_device(cuda_be, &shards[s]);
		hs[s] = &shards[s].h;
		ds[s] = &shards[s].d;
	}
	cudapair_alloc(cuda_be, host_be, &unsharded, l.unsharded_size, "unsharded");

	/* Every shard rank reads the one unsharded buffer, as ranks on one device do. */
	struct shd_buf *hu[WORLD] = { &unsharded.h, &unsharded.h, &unsharded.h };
	struct shd_buf *du[WORLD] = { &unsharded.d, &unsharded.d, &unsharded.d };
	struct shd_unshard_args ha = {
		.layout = &l, .nshards = WORLD, .shards = hs, .unsharded = hu
	};
	struct shd_unshard_args da = {
		.layout = &l, .nshards = WORLD, .shards = ds, .unsharded = du
	};

	cr_assert_eq(host_be->ops->unshard(host_be, &ha), 0);
	cr_assert_eq(cuda_be->ops->unshard(cuda_be, &da), 0);
	pair_expect_same(&unsharded, "unsharded buffer");

	cudapair_free(cuda_be, host_be, &unsharded);
	for (int s = 0; s < WORLD; s++)
		cudapair_free(cuda_be, host_be, &shards[s]);
	shd_layout_free(&l);
}

Test(cuda_backend, unshard_matches_host_backend, .timeout = 60, .init = setup, .fini = teardown)
{
	unshard_case(SHARDD_DTYPE_NONE);
}

Test(cuda_backend, unshard_with_bf16_param_dtype_matches_host_backend, .timeout = 60, .init = setup,
     .fini = teardown)
{
	unshard_case(SHARDD_DTYPE_BF16);
}

/* Legacy IPC buffers are cudaMalloc'd, not granularity-rounded: the kernels see the same layout. */
Test(cuda_backend, unshard_on_ipc_buffers_matches_host_backend, .timeout = 60, .init = setup_ipc,
     .fini = teardown)
{
	unshard_case(SHARDD_DTYPE_NONE);
}

/*
 * Reduce-scatter of WORLD grad buffers into every shard's sharded grad,
 * twice (assign, then accumulate), with `math`.
 */
static void reduce_scatter_case(uint32_t param_dtype, const struct shardd_reduce_math *math)
{
	struct shd_layout l;
	struct cudapair grads[WORLD], out[WORLD];
	struct shd_buf *hg[WORLD], *dg[WORLD];
	uint64_t offsets[3];

	build_layout(&l, param_dtype);
	for (uint32_t i = 0; i < l.nparams; i++)
		offsets[i] = l.params[i].shard_offset;
	for (int r = 0; r < WORLD; r++) {
		cudapair_alloc(cuda_be, host_be, &out[r], l.shard_size, "sharded grad");
		cudapair_alloc(cuda_be, host_be, &grads[r], l.grad_size, "grad");
		hg[r] = &grads[r].h;
		dg[r] = &grads[r].d;
	}
	for (uint8_t round = 0; round < 2; round++) {
		struct shd_shard_view hv[WORLD], dv[WORLD];
		uint8_t accumulate[WORLD] = { round, round, round };
		struct shd_reduce_args a = {
			.layout = &l,
			.src = SHD_REDUCE_SRC_GRAD,
			.n = WORLD,
			.accumulate = accumulate,
			.math = *math,
		};

		for (int r = 0; r < WORLD; r++) {
			for (uint32_t i = 0; i < l.nparams; i++)
				fill_values(grads[r].host + l.params[i].grad_offset,
					    l.params[i].grad_dtype, l.params[i].numel);
			cudapair_to_device(cuda_be, &grads[r]);
			hv[r] = (struct shd_shard_view){ &out[r].h, offsets, SHARDD_DTYPE_NONE };
			dv[r] = (struct shd_shard_view){ &out[r].d, offsets, SHARDD_DTYPE_NONE };
		}
		a.grads = hg;
		a.outs = hv;
		cr_assert_eq(host_be->ops->reduce(host_be, &a), 0);
		a.grads = dg;
		a.outs = dv;
		cr_assert_eq(cuda_be->ops->reduce(cuda_be, &a), 0);
		for (int s = 0; s < WORLD; s++)
			pair_expect_same(&out[s],
					 round ? "accumulated sharded grad" : "sharded grad");
	}
	for (int r = 0; r < WORLD; r++) {
		cudapair_free(cuda_be, host_be, &grads[r]);
		cudapair_free(cuda_be, host_be, &out[r]);
	}
	shd_layout_free(&l);
}

Test(cuda_backend, reduce_scatter_fp32_average_matches_host_backend, .timeout = 60, .init = setup,
     .fini = teardown)
{
	struct shardd_reduce_math m = {
		.reduce_dtype = SHARDD_DTYPE_FP32, .pre = 1, .avg = WORLD, .post = 1
	};

	reduce_scatter_case(SHARDD_DTYPE_NONE, &m);
}

Test(cuda_backend, reduce_scatter_fp16_divide_factors_match_host_backend, .timeout = 60,
     .init = setup, .fini = teardown)
{
	double pre, post;
	struct shardd_reduce_math m = { .reduce_dtype = SHARDD_DTYPE_FP16, .avg = 1 };

	shardd_divide_factors(WORLD, SHARDD_DTYPE_FP16, &pre, &post);
	m.pre = (float)pre;
	m.post = (float)post;
	reduce_scatter_case(SHARDD_DTYPE_BF16, &m);
}

/*
 * The HSDP all-reduce: shard views in the reduce dtype (fp32, at offsets
 * of their own) into the sharded grad, with an addend view.
 */
Test(cuda_backend, all_reduce_of_shard_views_with_addend_matches_host_backend, .timeout = 60,
     .init = setup, .fini = teardown)
{
	enum {
		NIN = 2
	};
	struct shd_layout l;
	struct cudapair views[NIN], add, out[NIN];
	uint64_t offsets[3], out_offsets[3], vbytes = 0;
	struct shd_shard_view hv[NIN], dv[NIN], hadd[NIN], dadd[NIN], hout[NIN], dout[NIN];
	uint8_t accumulate[NIN] = { 0, 0 };
	struct shardd_reduce_math m = {
		.reduce_dtype = SHARDD_DTYPE_FP32, .pre = 1, .avg = 2, .post = 1
	};

	build_layout(&l, SHARDD_DTYPE_NONE);
	for (uint32_t i = 0; i < l.nparams; i++) {
		offsets[i] = vbytes;
		vbytes += (l.params[i].shard_numel * 4 + 63) / 64 * 64;
		out_offsets[i] = l.params[i].shard_offset;
	}
	for (uint32_t k = 0; k < NIN + 1; k++) {
		struct cudapair *p = k < NIN ? &views[k] : &add;

		cudapair_alloc(cuda_be, host_be, p, vbytes, "partial");
		for (uint32_t i = 0; i < l.nparams; i++)
			fill_values(p->host + offsets[i], SHARDD_DTYPE_FP32,
				    l.params[i].shard_numel);
		cudapair_to_device(cuda_be, p);
		if (k < NIN) {
			hv[k] = (struct shd_shard_view){ &p->h, offsets, SHARDD_DTYPE_FP32 };
			dv[k] = (struct shd_shard_view){ &p->d, offsets, SHARDD_DTYPE_FP32 };
		}
	}
	/* Each member's output gets the sum plus the one addend. */
	for (uint32_t k = 0; k < NIN; k++) {
		cudapair_alloc(cuda_be, host_be, &out[k], l.shard_size, "sharded grad");
		hadd[k] = (struct shd_shard_view){ &add.h, offsets, SHARDD_DTYPE_FP32 };
		dadd[k] = (struct shd_shard_view){ &add.d, offsets, SHARDD_DTYPE_FP32 };
		hout[k] = (struct shd_shard_view){ &out[k].h, out_offsets, SHARDD_DTYPE_NONE };
		dout[k] = (struct shd_shard_view){ &out[k].d, out_offsets, SHARDD_DTYPE_NONE };
	}

	struct shd_reduce_args a = {
		.layout = &l,
		.src = SHD_REDUCE_SRC_SHARD,
		.n = NIN,
		.shard_rank = WORLD - 1,
		.in_dtype = SHARDD_DTYPE_FP32,
		.accumulate = accumulate,
		.reduce_offsets = offsets,
		.reduce_shard_size = vbytes,
		.math = m,
	};

	a.views = hv;
	a.adds = hadd;
	a.outs = hout;
	cr_assert_eq(host_be->ops->reduce(host_be, &a), 0);
	a.views = dv;
	a.adds = dadd;
	a.outs = dout;
	cr_assert_eq(cuda_be->ops->reduce(cuda_be, &a), 0);
	for (uint32_t k = 0; k < NIN; k++)
		pair_expect_same(&out[k], "all-reduced sharded grad");

	for (uint32_t k = 0; k < NIN; k++) {
		cudapair_free(cuda_be, host_be, &views[k]);
		cudapair_free(cuda_be, host_be, &out[k]);
	}
	cudapair_free(cuda_be, host_be, &add);
	shd_layout_free(&l);
}

/* ------------------------------------------------------------------ */
/* Legacy IPC export, imported by another process                      */
/* ------------------------------------------------------------------ */

#define IPC_BYTES   ((uint64_t)3 * 1000 * 1000 + 17) /* an odd size: no rounding hides a bug */
#define IPC_ZERO_AT 4096
#define IPC_ZERO_N  100000
#define IPC_WAIT_MS 30000

/* Byte i of pattern `salt`, written by one process and checked by the other. */
static uint8_t pattern(uint64_t i, unsigned salt)
{
	uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull + salt;

	x ^= x >> 29;
	return (uint8_t)(x ^ (x >> 17));
}

/* Expected byte i: 0 for salt 0 and inside [zero_at, zero_at + zero_n), else pattern(i, salt). */
static uint8_t expected(uint64_t i, unsigned salt, uint64_t zero_at, uint64_t zero_n)
{
	return salt == 0 || (i >= zero_at && i < zero_at + zero_n) ? 0 : pattern(i, salt);
}

/* What the parent sends the child first: the handle a GROUP reply would carry, and the size. */
struct ipc_offer {
	struct shardd_cuda_ipc_handle handle;
	uint64_t bytes;
};

struct ipc_pipes {
	int in;  /* child reads the offer and the parent's go bytes */
	int out; /* child writes one byte per step done */
	/* the parent's ends: closed in the child, so each side sees the other's EOF */
	int parents[2];
};

/* In the child: the device bytes at `ptr` are what `expected` says; 0, else the first bad index + 1. */
static uint64_t child_mismatch(uint64_t ptr, uint64_t n, unsigned salt, uint64_t zero_at,
			       uint64_t zero_n)
{
	uint8_t *got = malloc(n);
	uint64_t bad = 0;

	if (!got ||
	    cudaMemcpy(got, (void *)(uintptr_t)ptr, n, cudaMemcpyDeviceToHost) != cudaSuccess) {
		free(got);
		return n + 1;
	}
	for (uint64_t i = 0; i < n && !bad; i++)
		if (got[i] != expected(i, salt, zero_at, zero_n))
			bad = i + 1;
	free(got);
	return bad;
}

/* In the child: wait for the parent's go byte `want`. */
static int child_await(int fd, char want)
{
	char c = 0;

	return harness_read_full(fd, &c, 1, IPC_WAIT_MS) == 0 && c == want ? 0 : -1;
}

/*
 * The importing process, a trainer's stand-in: open the handle through
 * libshardd, read the daemon's bytes, write its own, open the handle a
 * second time (a group opened again in one process) and close both. It
 * touches CUDA only after the fork, as a process forked from one that
 * initialised CUDA could not use it.
 */
static int ipc_child(void *arg)
{
	const struct ipc_pipes *p = arg;
	struct shardd_cuda_mapping m, again;
	struct ipc_offer offer;
	uint64_t bad, n;
	uint8_t *mine;
	int ret;

	close(p->parents[0]);
	close(p->parents[1]);
	CHILD_CHECK(harness_read_full(p->in, &offer, sizeof(offer), IPC_WAIT_MS) == 0, "no offer");
	n = offer.bytes;
	ret = shardd_cuda_import_ipc(&offer.handle, 0, n, &m);
	CHILD_CHECK(ret == 0, "import: %d %s", ret, shardd_last_error());
	CHILD_CHECK(m.ptr != 0 && m.size == n && m.kind == SHARDD_EXPORT_CUDA_IPC && m.device == 0,
		    "mapping ptr 0x%llx size %llu kind %u device %d", (unsigned long long)m.ptr,
		    (unsigned long long)m.size, m.kind, m.device);
	bad = child_mismatch(m.ptr, n, 0, 0, 0);
	CHILD_CHECK(bad == 0, "byte %llu of a new buffer is not 0", (unsigned long long)bad - 1);
	CHILD_CHECK(harness_signal(p->out, 'z') == 0, "signal z");

	/* The daemon writes, the client reads. */
	CHILD_CHECK(child_await(p->in, 'w') == 0, "no go after the daemon's write");
	bad = child_mismatch(m.ptr, n, 1, 0, 0);
	CHILD_CHECK(bad == 0, "byte %llu differs from the daemon's write",
		    (unsigned long long)bad - 1);

	/* The client writes (its grads), the daemon reads. */
	mine = malloc(n);
	CHILD_CHECK(mine != NULL, "malloc");
	for (uint64_t i = 0; i < n; i++)
		mine[i] = pattern(i, 2);
	CHILD_CHECK(cudaMemcpy((void *)(uintptr_t)m.ptr, mine, n, cudaMemcpyHostToDevice) ==
			    cudaSuccess,
		    "write through the mapping");
	/* A copy from pageable memory may return before its DMA lands: wait before telling the daemon. */
	CHILD_CHECK(cudaDeviceSynchronize() == cudaSuccess, "synchronize after the write");
	free(mine);
	CHILD_CHECK(harness_signal(p->out, 'c') == 0, "signal c");

	/* The daemon's zero of a sub-range shows, the rest keeps the client's bytes. */
	CHILD_CHECK(child_await(p->in, 'Z') == 0, "no go after the daemon's zero");
	bad = child_mismatch(m.ptr, n, 2, IPC_ZERO_AT, IPC_ZERO_N);
	CHILD_CHECK(bad == 0, "byte %llu wrong after zero(%d, %d)", (unsigned long long)bad - 1,
		    IPC_ZERO_AT, IPC_ZERO_N);

	/*
	 * A second import of the same handle shares the mapping (the driver
	 * counts opens in one context), and closing one leaves the other.
	 */
	ret = shardd_cuda_import_ipc(&offer.handle, 0, n, &again);
	CHILD_CHECK(ret == 0, "second import: %d %s", ret, shardd_last_error());
	CHILD_CHECK(again.ptr == m.ptr, "second import at 0x%llx, first at 0x%llx",
		    (unsigned long long)again.ptr, (unsigned long long)m.ptr);
	shardd_cuda_unmap(&m);
	CHILD_CHECK(m.ptr == 0, "unmap leaves ptr 0x%llx", (unsigned long long)m.ptr);
	bad = child_mismatch(again.ptr, n, 2, IPC_ZERO_AT, IPC_ZERO_N);
	CHILD_CHECK(bad == 0, "after closing the first import, byte %llu of the second is wrong",
		    (unsigned long long)bad - 1);
	shardd_cuda_unmap(&again);
	CHILD_CHECK(harness_signal(p->out, 'd') == 0, "signal d");
	return 0;
}

/* In the parent: the child's step byte `want`, or fail naming how the child ended. */
static void expect_step(int fd, pid_t child, char want, const char *step)
{
	int status = 0;
	char c = 0;

	if (harness_read_full(fd, &c, 1, IPC_WAIT_MS) == 0 && c == want)
		return;
	cr_assert_eq(harness_wait_or_kill(child, IPC_WAIT_MS, &status), 0);
	cr_assert_fail("the importing child did not finish '%s': it %s (its check is on stderr)",
		       step, harness_status_str(status));
}

Test(cuda_backend, ipc_exported_buffer_imports_in_another_process_with_the_daemons_bytes,
     .timeout = 120, .fini = teardown)
{
	int to_child[2], from_child[2], status = 0, n = 0;
	struct ipc_pipes pipes;
	struct shd_buf_export ex;
	struct ipc_offer offer;
	struct shd_buf buf;
	uint8_t *host = malloc(IPC_BYTES);
	pid_t child;

	cr_assert_not_null(host);
	cr_assert_eq(pipe(to_child), 0);
	cr_assert_eq(pipe(from_child), 0);
	pipes = (struct ipc_pipes){ to_child[0], from_child[1], { to_child[1], from_child[0] } };
	/* Fork before this process touches CUDA: the child could not use it after. */
	child = harness_fork(ipc_child, &pipes);
	cr_assert_gt(child, 0);
	close(to_child[0]);
	close(from_child[1]);
	if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
		close(to_child[1]);
		harness_wait_or_kill(child, IPC_WAIT_MS, &status);
		cr_skip_test("no CUDA device visible");
	}
	setup_ipc();

	/* Allocated, exactly sized, no fd: it travels as a handle. */
	cr_assert_eq(cuda_be->ops->alloc(cuda_be, IPC_BYTES, 0, "ipc roundtrip", &buf), 0);
	cr_assert(shd_buf_allocated(&buf));
	cr_assert_eq(buf.fd, -1);
	cr_assert_eq(buf.bytes, IPC_BYTES);
	cr_assert_eq(cuda_be->ops->export_buf(cuda_be, &buf, 1, &ex), 0);
	cr_assert_eq(ex.kind, SHARDD_EXPORT_CUDA_IPC);
	cr_assert_eq(ex.fd, -1);

	offer.handle = ex.ipc;
	offer.bytes = IPC_BYTES;
	cr_assert_eq(write(to_child[1], &offer, sizeof(offer)), (ssize_t)sizeof(offer));
	expect_step(from_child[0], child, 'z', "a new buffer reads zero");

	for (uint64_t i = 0; i < IPC_BYTES; i++)
		host[i] = pattern(i, 1);
	CUDA_OK(cudaMemcpy(shd_backend_cuda_ptr(&buf), host, IPC_BYTES, cudaMemcpyHostToDevice));
	/* A copy from pageable memory may return before its DMA lands: wait before telling the child. */
	CUDA_OK(cudaDeviceSynchronize());
	cr_assert_eq(harness_signal(to_child[1], 'w'), 0);
	expect_step(from_child[0], child, 'c', "read the daemon's bytes, write its own");

	CUDA_OK(cudaMemcpy(host, shd_backend_cuda_ptr(&buf), IPC_BYTES, cudaMemcpyDeviceToHost));
	for (uint64_t i = 0; i < IPC_BYTES; i++)
		if (host[i] != pattern(i, 2))
			cr_assert_fail("byte %llu: the daemon does not see the client's write",
				       (unsigned long long)i);
	cr_assert_eq(cuda_be->ops->zero(cuda_be, &buf, IPC_ZERO_AT, IPC_ZERO_N), 0);
	/* The backend only queued the zero: wait for it before the child looks. */
	cr_assert_eq(cuda_sync_one(&buf), 0);
	cr_assert_eq(harness_signal(to_child[1], 'Z'), 0);
	expect_step(from_child[0], child, 'd', "see the zero, open the handle twice, close both");

	cr_assert_eq(harness_wait_or_kill(child, IPC_WAIT_MS, &status), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the importing child %s",
		  harness_status_str(status));
	/* Freed only now: legacy IPC memory goes with the daemon's free, open or not. */
	cuda_be->ops->free(cuda_be, &buf);
	cr_assert(!shd_buf_allocated(&buf));
	cr_assert_eq(buf.fd, -1);
	close(to_child[1]);
	close(from_child[0]);
	free(host);
}
