/* SPDX-License-Identifier: MIT */
/*
 * `shardd --backend cuda` where it cannot run: exit status 1 and one error
 * that names the flag and says why (a build without CUDA, or no usable
 * device), before any socket exists. Valid on every machine without a GPU;
 * a CUDA build skips where nvidia-smi lists one (the backend would start).
 *
 * Also the usage errors of --cuda-export (exit status 2, in every build
 * and on every machine): an unknown mode, or the flag without --backend
 * cuda.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

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

/* Run `argv` (socket in a fresh temporary dir); expect exit `code`, no socket, no "ready on". */
static void expect_exit(const char *const *argv_tail, int code, char *out, size_t len)
{
	const char *bin = getenv("SHARDD_BIN");
	char dir[] = "/tmp/shardd-cuda-absent-XXXXXX", sock[64];
	const char *argv[16];
	int status = 0, n = 0;

	cr_assert_not_null(bin, "SHARDD_BIN is not set");
	cr_assert_not_null(mkdtemp(dir));
	snprintf(sock, sizeof(sock), "%s/shardd.sock", dir);
	argv[n++] = bin;
	argv[n++] = "--socket";
	argv[n++] = sock;
	for (int i = 0; argv_tail[i]; i++) {
		cr_assert_lt(n, 15);
		argv[n++] = argv_tail[i];
	}
	argv[n] = NULL;
	cr_assert_eq(harness_run(argv, RUN_TIMEOUT_MS, &status, out, len), 0);
	cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == code,
		  "shardd %s %s (want exit %d); output: %s", argv_tail[0],
		  harness_status_str(status), code, out);
	cr_expect_null(strstr(out, "ready on"), "shardd reported ready: %s", out);
	cr_expect_neq(access(sock, F_OK), 0, "shardd created its socket %s", sock);
	unlink(sock);
	cr_assert_eq(rmdir(dir), 0, "rmdir %s", dir);
}

Test(backend_cuda, unusable_cuda_backend_exits_1_with_the_reason, .timeout = 30)
{
	/* --cuda-export before --backend: the flag is checked once all are read. */
	const char *plain[] = { "--backend", "cuda", "--foreground", NULL };
	const char *ipc[] = { "--cuda-export", "ipc", "--backend", "cuda", NULL };
	const char *const *runs[] = { plain, ipc };
	char out[8192];

	cr_assert_not_null(getenv("SHARDD_BIN"), "SHARDD_BIN is not set");
#ifdef SHARDD_HAVE_CUDA
	if (gpu_listed())
		cr_skip_test("nvidia-smi lists a GPU: the cuda backend can start here");
#endif
	for (size_t r = 0; r < sizeof(runs) / sizeof(runs[0]); r++) {
		expect_exit(runs[r], 1, out, sizeof(out));
		cr_expect_not_null(strstr(out, "--backend cuda"),
				   "the error does not name the flag: %s", out);
#ifdef SHARDD_HAVE_CUDA
		cr_expect_not_null(strstr(out, "no CUDA device usable"),
				   "the error does not say why: %s", out);
#else
		cr_expect_not_null(strstr(out, "built without CUDA"),
				   "the error does not say why: %s", out);
#endif
	}
}

Test(backend_cuda, cuda_export_with_an_unknown_mode_is_a_usage_error, .timeout = 30)
{
	const char *argv[] = { "--backend", "cuda", "--cuda-export", "dmabuf", NULL };
	char out[8192];

	expect_exit(argv, 2, out, sizeof(out));
	cr_expect_not_null(strstr(out, "--cuda-export: 'dmabuf' is not one of auto, fd, ipc"),
			   "the error does not name the flag, the value and the choices: %s", out);
}

Test(backend_cuda, cuda_export_without_the_cuda_backend_is_a_usage_error, .timeout = 30)
{
	const char *host[] = { "--backend", "host", "--cuda-export=fd", NULL };
	const char *by_default[] = { "--cuda-export", "ipc", NULL };
	const char *const *runs[] = { host, by_default };
	char out[8192];

	for (size_t r = 0; r < sizeof(runs) / sizeof(runs[0]); r++) {
		expect_exit(runs[r], 2, out, sizeof(out));
		cr_expect_not_null(
			strstr(out,
			       "--cuda-export applies to --backend cuda only; the backend is host"),
			"the error does not name the flag and the backend: %s", out);
	}
}

Test(backend_cuda, mps_sm_percent_out_of_range_or_without_the_cuda_backend_is_a_usage_error,
     .timeout = 30)
{
	const char *zero[] = { "--backend", "cuda", "--mps-sm-percent", "0", NULL };
	const char *over[] = { "--backend", "cuda", "--mps-sm-percent", "101", NULL };
	const char *host[] = { "--mps-sm-percent", "50", NULL };
	char out[8192];

	expect_exit(zero, 2, out, sizeof(out));
	cr_expect_not_null(strstr(out, "--mps-sm-percent: '0' is not a percentage in [1, 100]"),
			   "the error does not name the flag, the value and the range: %s", out);
	expect_exit(over, 2, out, sizeof(out));
	cr_expect_not_null(strstr(out, "--mps-sm-percent: '101' is not a percentage in [1, 100]"),
			   "the error does not name the flag, the value and the range: %s", out);
	expect_exit(host, 2, out, sizeof(out));
	cr_expect_not_null(
		strstr(out, "--mps-sm-percent applies to --backend cuda only; the backend is host"),
		"the error does not name the flag and the backend: %s", out);
}

Test(backend_cuda, help_lists_cuda_export, .timeout = 30)
{
	const char *bin = getenv("SHARDD_BIN");
	const char *argv[] = { bin, "--help", NULL };
	char out[8192];
	int status = 0;

	cr_assert_not_null(bin, "SHARDD_BIN is not set");
	cr_assert_eq(harness_run(argv, RUN_TIMEOUT_MS, &status, out, sizeof(out)), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "--help %s",
		  harness_status_str(status));
	cr_expect_not_null(strstr(out, "--cuda-export auto|fd|ipc"), "--help does not list it: %s",
			   out);
}
