/* SPDX-License-Identifier: MIT */
/*
 * How a real `shardd --backend cuda` shares the GPU with the trainers
 * (docs/CUDA.md, "MPS"): `shardctl status` names it, "MPS: ..." when the
 * daemon's CUDA contexts are MPS clients (an MPS control daemon reachable
 * at start: the system's, or CUDA_MPS_PIPE_DIRECTORY's), else
 * "time-sliced: ops wait for the trainers' compute, docs/CUDA.md"; with
 * --mps-sm-percent the MPS line carries the daemon's share. Which of the
 * two applies is the machine's; build/gpu-check/run runs this suite
 * time-sliced, and its MPS step checks the MPS line. Skips without a GPU.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <string.h>

#include "harness.h"

#define CTL_TIMEOUT_MS 30000

static struct harness_daemon daemon_;

static void need_gpu(void)
{
	if (harness_cuda_devices() == 0)
		cr_skip_test("no CUDA device visible");
	signal(SIGPIPE, SIG_IGN);
}

static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

/* The daemon's gpu_sharing, checked to be one of the two kinds; *mps says which. */
static void status_sharing(char *out, size_t len, int *mps)
{
	const char *args[] = { "status", NULL };
	char ctl[8192];
	json_t *r = harness_shardctl_json(daemon_.socket, args, CTL_TIMEOUT_MS, ctl, sizeof(ctl));
	const char *s = json_string_value(json_object_get(r, "gpu_sharing"));

	cr_assert_not_null(s, "shardctl status of a cuda daemon has no gpu_sharing: %s", ctl);
	snprintf(out, len, "%s", s);
	json_decref(r);
	*mps = strncmp(out, "MPS: ", 5) == 0;
	cr_assert(*mps || strcmp(out,
				 "time-sliced: ops wait for the trainers' compute, docs/CUDA.md") ==
				  0,
		  "gpu_sharing is neither MPS nor time-sliced: '%s'", out);
}

TestSuite(cuda_sharing, .init = need_gpu, .fini = stop_daemon, .timeout = 60);

Test(cuda_sharing, status_says_mps_or_time_sliced)
{
	const char *extra[] = { "--backend", "cuda", NULL };
	const char *args[] = { "status", NULL };
	char s[256], ctl[8192];
	int mps;

	harness_daemon_start_or_fail(&daemon_, extra);
	status_sharing(s, sizeof(s), &mps);
	cr_assert_eq(harness_shardctl(daemon_.socket, args, CTL_TIMEOUT_MS, ctl, sizeof(ctl)), 0,
		     "%s", ctl);
	cr_expect_not_null(strstr(ctl, "\ngpu      "), "shardctl status prints no gpu line: %s",
			   ctl);
	cr_expect_not_null(strstr(ctl, s), "shardctl status does not print '%s': %s", s, ctl);
	if (mps)
		cr_expect_not_null(strstr(s, "SM share uncapped") || strstr(s, "% of the SMs"),
				   "the MPS line does not give the daemon's SM share: %s", s);
}

Test(cuda_sharing, mps_sm_percent_is_the_daemons_share_under_mps)
{
	const char *extra[] = { "--backend", "cuda", "--mps-sm-percent", "50", NULL };
	char s[256];
	int mps;

	harness_daemon_start_or_fail(&daemon_, extra);
	status_sharing(s, sizeof(s), &mps);
	if (mps)
		cr_expect_not_null(strstr(s, "up to 50% of the SMs"),
				   "--mps-sm-percent 50, but: %s", s);
}
