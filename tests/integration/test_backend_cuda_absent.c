/* SPDX-License-Identifier: MIT */
/*
 * `shardd --backend cuda` where it cannot run: exit status 1 and one error
 * that names the flag and says why (a build without CUDA, or no usable
 * device), before any socket exists. Valid on every machine without a GPU;
 * a CUDA build skips where nvidia-smi lists one (the backend would start).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/lib/harness.h"

#define RUN_TIMEOUT_MS 10000

#ifdef SHARDD_HAVE_CUDA
/* 1 when `nvidia-smi -L` runs and lists a GPU. */
static int gpu_listed(void)
{
	const char *argv[] = { "/bin/sh", "-c", "nvidia-smi -L 2>/dev/null", NULL };
	char out[4096];
	int status = 0;

	if (harness_run(argv, RUN_TIMEOUT_MS, &status, out, sizeof(out)) != 0)
		return 0;
	return WIFEXITED(status) && WEXITSTATUS(status) == 0 &&
	       (strncmp(out, "GPU ", 4) == 0 || strstr(out, "\nGPU ") != NULL);
}
#endif

Test(backend_cuda, unusable_cuda_backend_exits_1_with_the_reason, .timeout = 30)
{
	const char *bin = getenv("SHARDD_BIN");
	char dir[] = "/tmp/shardd-cuda-absent-XXXXXX", sock[64], out[8192];
	int status = 0;

	cr_assert_not_null(bin, "SHARDD_BIN is not set");
#ifdef SHARDD_HAVE_CUDA
	if (gpu_listed())
		cr_skip_test("nvidia-smi lists a GPU: the cuda backend can start here");
#endif
	cr_assert_not_null(mkdtemp(dir));
	snprintf(sock, sizeof(sock), "%s/shardd.sock", dir);

	const char *argv[] = { bin, "--backend", "cuda", "--socket", sock, "--foreground", NULL };

	cr_assert_eq(harness_run(argv, RUN_TIMEOUT_MS, &status, out, sizeof(out)), 0);
	cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 1, "shardd --backend cuda %s; output: %s",
		  harness_status_str(status), out);
	cr_expect_not_null(strstr(out, "--backend cuda"), "the error does not name the flag: %s", out);
#ifdef SHARDD_HAVE_CUDA
	cr_expect_not_null(strstr(out, "no CUDA device usable"), "the error does not say why: %s", out);
#else
	cr_expect_not_null(strstr(out, "built without CUDA"), "the error does not say why: %s", out);
#endif
	cr_expect_null(strstr(out, "ready on"), "shardd reported ready: %s", out);
	cr_expect_neq(access(sock, F_OK), 0, "shardd created its socket %s", sock);
	unlink(sock);
	cr_assert_eq(rmdir(dir), 0, "rmdir %s", dir);
}
