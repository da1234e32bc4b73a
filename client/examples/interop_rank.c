/* SPDX-License-Identifier: MIT */
/*
 * interop_rank: one rank of the C/Python interop job (tests/python/
 * test_interop.py). It runs exactly the sequence tests/python/interop_py_rank.py
 * runs with the Python client, so a job can mix both:
 *
 *   group "interop": w fp32 [5,3], b fp32 [7]; initial values are a
 *   function of the element index; per step s:
 *     unshard(s), dump the unsharded w and b,
 *     write grads g = ((rank + 1) * (i % 7 - 3) + s) / 8, reduce(s),
 *     dump this rank's sharded grads (valid rows),
 *     shard -= 0.5 * sharded grad, reshard(s), zero_grad.
 *
 * Dumps go to OUTDIR/r<rank>_s<step>.bin as raw little-endian fp32; the test
 * checks them against its own numpy reference.
 *
 * usage: interop_rank SOCKET JOB RANK WORLD STEPS OUTDIR
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardd.h"

#define NPARAMS 2

static const struct shardd_param_desc params[NPARAMS] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 5, 3 } },
	{ .name = "b", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 7 } },
};

static uint64_t numel(const struct shardd_param_desc *p)
{
	uint64_t n = 1;

	for (uint32_t d = 0; d < p->ndim; d++)
		n *= p->shape[d];
	return n;
}

/* Initial value of element i of param k: small multiples of 1/4, exact in fp32. */
static float init_value(uint32_t k, uint64_t i)
{
	if (k == 0)
		return (float)((int)(i % 13) - 6) * 0.5f;
	return (float)((i * 3) % 11) * 0.25f - 1.0f;
}

/* Gradient of element i on `rank` at `step`: multiples of 1/8, exact in fp32. */
static float grad_value(uint32_t rank, uint64_t step, uint64_t i)
{
	return (float)((int)(rank + 1) * ((int)(i % 7) - 3) + (int)step) * 0.125f;
}

static int write_all(FILE *f, const void *p, size_t n)
{
	return fwrite(p, 1, n, f) == n ? 0 : -EIO;
}

static int run_step(struct shardd_group *g, uint32_t rank, uint64_t step, const char *outdir)
{
	char path[4096];
	FILE *f;
	int ret;

	snprintf(path, sizeof(path), "%s/r%u_s%llu.bin", outdir, rank, (unsigned long long)step);
	f = fopen(path, "wb");
	if (!f) {
		fprintf(stderr, "interop_rank %u: open %s: %s\n", rank, path, strerror(errno));
		return -errno;
	}
	ret = shardd_unshard(g, step);
	if (ret < 0)
		goto err;
	for (uint32_t k = 0; k < NPARAMS; k++) {
		ret = write_all(f, shardd_group_unsharded(g, k), numel(&params[k]) * sizeof(float));
		if (ret < 0)
			goto err;
		float *grad = shardd_group_grad(g, k);

		for (uint64_t i = 0; i < numel(&params[k]); i++)
			grad[i] = grad_value(rank, step, i);
	}
	ret = shardd_reduce(g, step, 0);
	if (ret < 0)
		goto err;
	for (uint32_t k = 0; k < NPARAMS; k++) {
		const struct shardd_param_layout *l = shardd_group_layout(g, k);
		uint64_t inner = numel(&params[k]) / params[k].shape[0];
		uint64_t n = l->shard_bytes / sizeof(float);
		float *shard = shardd_group_shard(g, k);
		const float *sgrad = shardd_group_shard_grad(g, k);

		ret = write_all(f, sgrad, l->shard_rows_valid * inner * sizeof(float));
		if (ret < 0)
			goto err;
		for (uint64_t j = 0; j < n; j++)
			shard[j] -= 0.5f * sgrad[j];
	}
	ret = shardd_reshard(g, step);
	if (ret < 0)
		goto err;
	ret = shardd_zero_grad(g);
	if (ret < 0)
		goto err;
	if (fclose(f) != 0)
		return -EIO;
	return 0;
err:
	fclose(f);
	return ret;
}

int main(int argc, char **argv)
{
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	struct shardd_attach_opts o = { 0 };
	struct shardd_precision precision = { .param_dtype = SHARDD_DTYPE_NONE,
					      .reduce_dtype = SHARDD_DTYPE_NONE };
	uint64_t steps;
	int ret;

	if (argc == 2 && strcmp(argv[1], "--help") == 0) {
		printf("usage: %s SOCKET JOB RANK WORLD STEPS OUTDIR\n"
		       "One C rank of the C/Python interop job of tests/python/test_interop.py.\n",
		       argv[0]);
		return 0;
	}
	if (argc == 2 && strcmp(argv[1], "--version") == 0) {
		printf("interop_rank (shardd %s, protocol %d.%d)\n", SHARDD_VERSION,
		       SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR);
		return 0;
	}
	if (argc != 7) {
		fprintf(stderr, "usage: %s SOCKET JOB RANK WORLD STEPS OUTDIR\n", argv[0]);
		return 2;
	}
	o.socket_path = argv[1];
	o.job = argv[2];
	o.rank = (uint32_t)strtoul(argv[3], NULL, 10);
	o.replicate = 1;
	o.shard = (uint32_t)strtoul(argv[4], NULL, 10);
	o.device = SHARDD_HELLO_DEVICE_HOST;
	steps = strtoull(argv[5], NULL, 10);

	ret = shardd_connect(&o, &c);
	if (ret < 0)
		goto err;
	ret = shardd_group_register(c, "interop", params, NPARAMS, &precision, NULL, &g);
	if (ret < 0)
		goto err;
	for (uint32_t k = 0; k < NPARAMS; k++) {
		uint64_t n = numel(&params[k]);
		float *full = malloc(n * sizeof(float));

		if (!full) {
			ret = -ENOMEM;
			goto err;
		}
		for (uint64_t i = 0; i < n; i++)
			full[i] = init_value(k, i);
		ret = shardd_group_load_full(g, k, full);
		free(full);
		if (ret < 0)
			goto err;
	}
	for (uint64_t s = 0; s < steps; s++) {
		ret = run_step(g, o.rank, s, argv[6]);
		if (ret < 0)
			goto err;
	}
	shardd_group_close(g);
	shardd_close(c);
	return 0;
err:
	fprintf(stderr, "interop_rank %u: %s: %s\n", o.rank, shardd_strerror(ret),
		shardd_last_error());
	shardd_group_close(g);
	shardd_close(c);
	return 1;
}
