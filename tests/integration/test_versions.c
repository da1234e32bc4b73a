/* SPDX-License-Identifier: MIT */
/*
 * --version on every binary prints the build's version.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "shardd.h"

#define CTL_MS          10000

TestSuite(operations, .timeout = 60);

/* ------------------------------------------------------------------ */
/* --version                                                           */
/* ------------------------------------------------------------------ */

Test(operations, every_binary_prints_its_version)
{
	static const char *const bins[] = {
		"shardd", "shardctl", "shardbench", "examples/train_mlp", "examples/interop_rank",
	};
	const char *build = getenv("SHARDD_BUILD");

	cr_assert(build, "SHARDD_BUILD is not set: run through make test");
	for (size_t i = 0; i < sizeof(bins) / sizeof(bins[0]); i++) {
		char path[4096], out[1024];
		const char *argv[] = { path, "--version", NULL };
		int status = 0;

		snprintf(path, sizeof(path), "%s/%s", build, bins[i]);
		cr_assert_eq(harness_run(argv, CTL_MS, &status, out, sizeof(out)), 0, "%s", path);
		cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s --version %s: %s",
			  bins[i], harness_status_str(status), out);
		cr_assert_not_null(strstr(out, SHARDD_VERSION), "%s --version: %s", bins[i], out);
	}
}
