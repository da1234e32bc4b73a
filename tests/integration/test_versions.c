/* SPDX-License-Identifier: MIT */
/*
 * --version on every binary prints the build's version, and libshardd's
 * version macros and shardd_version() name the same.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "shardd.h"

#define CTL_MS 10000

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

/* ------------------------------------------------------------------ */
/* libshardd                                                           */
/* ------------------------------------------------------------------ */

Test(operations, libshardd_reports_the_version_of_its_header)
{
	char numbers[64];

	snprintf(numbers, sizeof(numbers), "%d.%d.%d", SHARDD_VERSION_MAJOR, SHARDD_VERSION_MINOR,
		 SHARDD_VERSION_PATCH);
	cr_assert_str_eq(SHARDD_VERSION_STRING, numbers);
	cr_assert_str_eq(
		shardd_version(), SHARDD_VERSION_STRING,
		"the library says %s, shardd.h %s: the Makefile's VERSION and shardd.h differ",
		shardd_version(), SHARDD_VERSION_STRING);
}
