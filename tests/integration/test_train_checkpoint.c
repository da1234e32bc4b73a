/* SPDX-License-Identifier: MIT */
/*
 * train_mlp's checkpoints through the daemon (--checkpoint-every N, --resume;
 * client/examples/mlp/trainer.h): a run that checkpoints every 3 steps, a
 * daemon killed with SIGKILL after it, a daemon started again on the same
 * --state-dir, and a second run with --resume that learns the step of the
 * newest checkpoint and trains on to the end. Its final params must be
 * bit-identical to an uninterrupted run of as many steps that took the
 * same checkpoints, and the losses of the steps it trained equal to that
 * run's (the batches are a function of (seed, rank, step), the SGD the same
 * fp32 expression, the reduce the same order on the host backend).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <criterion/criterion.h>

#include "train.h"

#define CK_STEPS_FIRST \
	"8" /* the first run: checkpoints at 3 and 6, steps 6 and 7 lost with the daemon */
#define CK_STEPS     "12" /* the whole run */
#define CK_EVERY     "3"
#define CK_RESUME_AT 6

/* The whole file at `path` into buf (at most len bytes); its size. */
static size_t slurp(const char *path, char *buf, size_t len)
{
	FILE *f = fopen(path, "rb");
	size_t n;

	cr_assert(f, "'%s' missing: %s", path, strerror(errno));
	n = fread(buf, 1, len, f);
	fclose(f);
	return n;
}

/* The text after "step T loss " on its line in a run's output, or NULL. */
static const char *loss_of(const char *out, unsigned t, char *buf, size_t len)
{
	char key[48];
	const char *p;
	size_t n;

	snprintf(key, sizeof(key), "step %u loss ", t);
	for (p = out; (p = strstr(p, key)); p++)
		if (p == out || p[-1] == '\n')
			break;
	if (!p)
		return NULL;
	p += strlen(key);
	n = strcspn(p, " \n");
	snprintf(buf, len, "%.*s", (int)(n < len ? n : len - 1), p);
	return buf;
}

static void start_on(struct harness_daemon *d, const char *state)
{
	const char *extra[] = { "--state-dir", state, NULL };

	cr_assert_eq(harness_daemon_start(d, extra), 0,
		     "shardd --state-dir %s did not start (log above)", state);
}

/* The whole run: the state dirs and dumps in a new folder of `base`. */
static void resume_matches_uninterrupted(const char *base)
{
	static struct train_run r, whole;
	static char got[1 << 16], ref[1 << 16];
	struct harness_daemon d = { 0 }, d2 = { 0 }, dref = { 0 };
	char dir[64], state[96], state_ref[96], got_path[96], ref_path[96];
	char a[32], b[32];
	size_t ng, nr;

	snprintf(dir, sizeof(dir), "%s/shardd-train-ck-XXXXXX", base);
	cr_assert(mkdtemp(dir), "mkdtemp(%s): %s", dir, strerror(errno));
	snprintf(state, sizeof(state), "%s/state", dir);
	snprintf(state_ref, sizeof(state_ref), "%s/state-ref", dir);
	snprintf(got_path, sizeof(got_path), "%s/resumed.bin", dir);
	snprintf(ref_path, sizeof(ref_path), "%s/whole.bin", dir);

	/* The uninterrupted run, with the same checkpoints. */
	start_on(&dref, state_ref);
	train_run(&whole, (const char *const[]){ "--spawn", "3", "--steps", CK_STEPS, "--socket",
						 dref.socket, "--checkpoint-every", CK_EVERY,
						 "--resume", "--dump", ref_path, NULL });
	if (!train_run_ok(&whole))
		harness_daemon_dump_log(&dref);
	cr_assert(train_run_ok(&whole), "uninterrupted run %s:\n%s",
		  harness_status_str(whole.status), whole.out);
	cr_expect(
		strstr(whole.out, "start at step 0 of " CK_STEPS " (no checkpoint to resume from)"),
		"a first run with --resume says it starts afresh:\n%s", whole.out);
	harness_daemon_stop_expect_clean(&dref);

	/* The interrupted run: its daemon dies with SIGKILL after it, two steps past the last checkpoint. */
	start_on(&d, state);
	train_run(&r, (const char *const[]){ "--spawn", "3", "--steps", CK_STEPS_FIRST, "--socket",
					     d.socket, "--checkpoint-every", CK_EVERY, "--resume",
					     NULL });
	if (!train_run_ok(&r))
		harness_daemon_dump_log(&d);
	cr_assert(train_run_ok(&r), "first run %s:\n%s", harness_status_str(r.status), r.out);
	cr_expect(strstr(r.out, "checkpoint of step 6 written"), "output:\n%s", r.out);
	harness_daemon_stop_sig(&d, SIGKILL, HARNESS_STOP_TIMEOUT_MS);

	start_on(&d2, state);
	train_run(&r, (const char *const[]){ "--spawn", "3", "--steps", CK_STEPS, "--socket",
					     d2.socket, "--checkpoint-every", CK_EVERY, "--resume",
					     "--dump", got_path, NULL });
	if (!train_run_ok(&r))
		harness_daemon_dump_log(&d2);
	cr_assert(train_run_ok(&r), "resumed run %s:\n%s", harness_status_str(r.status), r.out);
	cr_assert(strstr(r.out, "resume at step 6 of " CK_STEPS "\n"),
		  "the resumed run does not say it resumes"
		  " at step 6:\n%s",
		  r.out);
	cr_expect(!loss_of(r.out, CK_RESUME_AT - 1, a, sizeof(a)),
		  "the resumed run trained step %d again:\n%s", CK_RESUME_AT - 1, r.out);
	for (unsigned t = CK_RESUME_AT; t < 12; t++) {
		cr_assert(loss_of(r.out, t, a, sizeof(a)),
			  "no loss of step %u in the resumed run:\n%s", t, r.out);
		cr_assert(loss_of(whole.out, t, b, sizeof(b)),
			  "no loss of step %u in the whole run", t);
		cr_expect_str_eq(a, b, "step %u: resumed loss %s, uninterrupted %s", t, a, b);
	}
	harness_daemon_stop_expect_clean(&d2);

	ng = slurp(got_path, got, sizeof(got));
	nr = slurp(ref_path, ref, sizeof(ref));
	cr_assert_eq(ng, (size_t)TRAIN_NPARAMS * sizeof(float), "%s holds %zu bytes", got_path, ng);
	cr_assert_eq(nr, ng, "%s holds %zu bytes, %s %zu", ref_path, nr, got_path, ng);
	for (size_t i = 0; i < ng; i += sizeof(float))
		cr_assert(!memcmp(got + i, ref + i, sizeof(float)),
			  "param %zu differs after the resume: %.9g,"
			  " uninterrupted %.9g",
			  i / sizeof(float), (double)*(float *)(got + i),
			  (double)*(float *)(ref + i));
	harness_rm_tree(dir);
}

Test(train_checkpoint, resumed_after_daemon_sigkill_matches_uninterrupted_run_bit_for_bit,
     .timeout = 90)
{
	resume_matches_uninterrupted("/tmp");
}

Test(train_checkpoint, checkpoint_every_without_state_dir_fails_naming_the_flag, .timeout = 60)
{
	static struct train_run r;
	struct harness_daemon d = { 0 };

	cr_assert_eq(harness_daemon_start(&d, NULL), 0, "shardd did not start (log above)");
	train_run(&r, (const char *const[]){ "--spawn", "2", "--steps", "4", "--socket", d.socket,
					     "--checkpoint-every", "2", NULL });
	cr_expect(!train_run_ok(&r),
		  "train_mlp --checkpoint-every succeeded on a daemon without --state-dir:\n%s",
		  r.out);
	cr_expect(strstr(r.out, "checkpoint(2) failed") && strstr(r.out, "--state-dir"),
		  "the failure does not name the op and the flag:\n%s", r.out);
	harness_daemon_stop_expect_clean(&d);
}

Test(train_checkpoint, checkpoint_every_with_trainer_sgd_is_refused, .timeout = 30)
{
	static struct train_run r;

	train_run(&r, (const char *const[]){ "--spawn", "2", "--trainer-sgd", "--checkpoint-every",
					     "2", NULL });
	cr_expect(!train_run_ok(&r), "train_mlp --trainer-sgd --checkpoint-every succeeded:\n%s",
		  r.out);
	cr_expect(strstr(r.out, "drop --trainer-sgd"), "the refusal does not name the fix:\n%s",
		  r.out);
}
