/* SPDX-License-Identifier: MIT */
/*
 * What a client let in by --allow-gid may restore from (docs/RELIABILITY.md
 * "Who may connect"), against the real binary: shardd reads a restore path
 * as its own uid, so a client of another uid restores only from under
 * --state-dir or an --import-dir, resolved, following no symlink out of
 * them; shardd's own uid restores from anywhere. The weights are a small
 * safetensors file the test writes; the reference is the values it wrote,
 * read back from the restored rank's own mapping of its shard.
 *
 * The tests change uids, so they need root (they skip otherwise), as the
 * rest of the integration suites do.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "opsd.h"
#include "shardd.h"

#define CHILD_MS 20000
#define NOBODY   65534u /* the unprivileged uid the clients switch to */
#define NUMEL    15     /* param "w", fp32 [5, 3] */

struct rst_arg {
	const char *socket;
	const char *job;
	const char *restore;      /* shardd_group_opts.restore; NULL: register without restoring */
	int other_uid;            /* become NOBODY in group ALLOWED_GID first */
	const char *unreadable;   /* a file the client must not be able to open itself, or NULL */
	int want;                 /* 0: the registration succeeds; else the error it must give */
	const char *want_text[4]; /* with want != 0: strings the error must hold */
	const float *expect;      /* want 0: the values the shard must hold */
	int save;                 /* load `expect` into the group and checkpoint it (step 1) */
};

static int restore_client_main(void *p)
{
	const struct rst_arg *a = p;
	struct shardd_attach_opts o = {
		.socket_path = a->socket,
		.job = a->job,
		.rank = 0,
		.replicate = 1,
		.shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_param_desc pd = {
		.name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 5, 3 }
	};
	struct shardd_group_opts opts = { .restore = a->restore };
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	gid_t groups[1] = { ALLOWED_GID };
	int ret;

	if (a->other_uid)
		CHILD_CHECK(setgroups(1, groups) == 0 && setgid(NOBODY) == 0 && setuid(NOBODY) == 0,
			    "become uid %u: %s", NOBODY, strerror(errno));
	if (a->unreadable) {
		int fd = open(a->unreadable, O_RDONLY);

		CHILD_CHECK(fd < 0 && errno == EACCES,
			    "uid %u can open %s itself (fd %d, %s): the test "
			    "proves nothing",
			    (unsigned)getuid(), a->unreadable, fd, strerror(errno));
	}
	CHILD_CHECK_SHARDD(shardd_connect(&o, &c));
	ret = shardd_group_register(c, "layer", &pd, 1, NULL, &opts, &g);
	if (a->want) {
		CHILD_CHECK(ret == a->want, "register gave %d (%s), expected %d: %s", ret,
			    shardd_strerror(ret), a->want, shardd_last_error());
		for (int i = 0; i < 4 && a->want_text[i]; i++)
			CHILD_CHECK(strstr(shardd_last_error(), a->want_text[i]),
				    "'%s' does not say '%s'", shardd_last_error(), a->want_text[i]);
		shardd_close(c);
		return 0;
	}
	CHILD_CHECK(ret == 0, "register restoring from '%s': %s",
		    a->restore ? a->restore : "(none)", shardd_last_error());
	if (a->save) {
		struct shardd_completion cp;

		CHILD_CHECK_SHARDD(shardd_group_load_full(g, 0, a->expect));
		CHILD_CHECK_SHARDD(shardd_client_submit(c, SHARDD_OP_CHECKPOINT, 1, 0, 77));
		CHILD_CHECK_SHARDD(shardd_wait(c, &cp, 30000));
		CHILD_CHECK(cp.op == SHARDD_OP_CHECKPOINT && cp.res == 0,
			    "checkpoint: %s gave %d: %s", shardd_op_name(cp.op), cp.res, cp.msg);
	} else {
		const float *sh = shardd_group_shard(g, 0);

		for (int i = 0; i < NUMEL; i++)
			CHILD_CHECK(sh[i] == a->expect[i], "restored w[%d] = %g, the file holds %g",
				    i, sh[i], a->expect[i]);
	}
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

static void run_client(struct rst_arg *a, struct opd *d)
{
	int status = 0;
	pid_t pid = harness_fork(restore_client_main, a);

	cr_assert_gt(pid, 0);
	cr_assert_eq(harness_wait_or_kill(pid, CHILD_MS, &status), 0);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		  "the %s client of job '%s' %s; shardd's output:\n%s",
		  a->other_uid ? "uid 65534" : "same-uid", a->job, harness_status_str(status),
		  d->log);
}

/* A safetensors file holding tensor "w", F32 [5, 3] = v, with `mode`. */
static void write_weights(const char *path, const float *v, mode_t mode)
{
	char hdr[96];
	uint8_t len8[8];
	int n = snprintf(hdr, sizeof(hdr),
			 "{\"w\":{\"dtype\":\"F32\",\"shape\":[5,3],\"data_offsets\":[0,%d]}}",
			 NUMEL * 4);
	FILE *f = fopen(path, "wb");

	while (n % 8)
		hdr[n++] = ' ';
	for (int i = 0; i < 8; i++)
		len8[i] = (uint8_t)((uint64_t)n >> (8 * i));
	cr_assert_not_null(f, "create %s: %s", path, strerror(errno));
	cr_assert_eq(fwrite(len8, 1, 8, f), 8);
	cr_assert_eq(fwrite(hdr, 1, (size_t)n, f), (size_t)n);
	cr_assert_eq(fwrite(v, sizeof(float), NUMEL, f), NUMEL);
	cr_assert_eq(fclose(f), 0);
	cr_assert_eq(chmod(path, mode), 0);
}

/*
 * base/outside (0700: uid 65534 cannot look in) holds w.safetensors; so does
 * base/imports/model (0700 too: shardd reads it for the client, as the
 * operator allowed); base/state is the state dir. A daemon on base/run
 * with --allow-gid, --state-dir and, with `import`, --import-dir base/imports.
 */
struct fixture {
	char base[64], sock[128], state[96], imports[96], outside[96];
	char out_file[160], in_file[192], in_dir[128];
	float v[NUMEL];
	struct opd d;
};

static void fixture_start(struct fixture *f, int import)
{
	char gid[16];

	require_root();
	make_base(f->base, sizeof(f->base));
	snprintf(f->sock, sizeof(f->sock), "%s/run/shardd.sock", f->base);
	snprintf(f->state, sizeof(f->state), "%s/state", f->base);
	snprintf(f->imports, sizeof(f->imports), "%s/imports", f->base);
	snprintf(f->outside, sizeof(f->outside), "%s/outside", f->base);
	snprintf(f->out_file, sizeof(f->out_file), "%s/w.safetensors", f->outside);
	snprintf(f->in_dir, sizeof(f->in_dir), "%s/model", f->imports);
	snprintf(f->in_file, sizeof(f->in_file), "%s/w.safetensors", f->in_dir);
	cr_assert_eq(mkdir(f->state, 0700), 0);
	cr_assert_eq(mkdir(f->imports, 0755), 0);
	cr_assert_eq(mkdir(f->outside, 0700), 0);
	cr_assert_eq(mkdir(f->in_dir, 0700), 0);
	for (int i = 0; i < NUMEL; i++)
		f->v[i] = (float)i * 0.25f - 1.5f;
	write_weights(f->out_file, f->v, 0600);
	write_weights(f->in_file, f->v, 0600);
	snprintf(gid, sizeof(gid), "%u", ALLOWED_GID);
	if (import)
		opd_start_or_fail(&f->d,
				  (const char *const[]){ "--socket", f->sock, "--allow-gid", gid,
							 "--state-dir", f->state, "--import-dir",
							 f->imports, NULL },
				  f->sock);
	else
		opd_start_or_fail(&f->d,
				  (const char *const[]){ "--socket", f->sock, "--allow-gid", gid,
							 "--state-dir", f->state, NULL },
				  f->sock);
}

static void fixture_stop(struct fixture *f)
{
	opd_stop_clean(&f->d);
	remove_tree(f->base);
}

TestSuite(restore_access, .timeout = 60);

Test(restore_access, other_uid_restore_from_outside_the_allowed_dirs_is_refused_naming_the_fix)
{
	struct fixture f;

	fixture_start(&f, 1);
	{
		struct rst_arg a = {
			.socket = f.sock,
			.job = "out",
			.restore = f.out_file,
			.other_uid = 1,
			.unreadable = f.out_file,
			.want = -SHARDD_E_PERM,
			.want_text = { "policy.restore", f.out_file, "uid 65534",
				       "let it in with --import-dir DIR, or restore as shardd's uid" }
		};

		run_client(&a, &f.d);
	}
	fixture_stop(&f);
}

Test(restore_access, without_import_dir_other_uid_cannot_restore_plain_weights_anywhere)
{
	struct fixture f;

	fixture_start(&f, 0);
	{
		struct rst_arg a = { .socket = f.sock,
				     .job = "noimp",
				     .restore = f.in_file,
				     .other_uid = 1,
				     .want = -SHARDD_E_PERM,
				     .want_text = { "policy.restore", f.in_file,
						    "--import-dir (0 given)" } };

		run_client(&a, &f.d);
	}
	fixture_stop(&f);
}

Test(restore_access, other_uid_restores_weights_under_an_import_dir_and_reads_the_values)
{
	struct fixture f;

	fixture_start(&f, 1);
	{
		/* The file, and a model directory holding model.safetensors. */
		char model[224];
		struct rst_arg a = { .socket = f.sock,
				     .job = "imp",
				     .restore = f.in_file,
				     .other_uid = 1,
				     .unreadable = f.in_file,
				     .expect = f.v };
		struct rst_arg b = { .socket = f.sock,
				     .job = "impdir",
				     .restore = f.in_dir,
				     .other_uid = 1,
				     .expect = f.v };

		snprintf(model, sizeof(model), "%s/model.safetensors", f.in_dir);
		write_weights(model, f.v, 0600);
		run_client(&a, &f.d);
		run_client(&b, &f.d);
	}
	fixture_stop(&f);
}

Test(restore_access, symlinks_and_dotdot_inside_an_import_dir_do_not_lead_outside)
{
	struct fixture f;

	fixture_start(&f, 1);
	{
		char link[128], linkdir[128], via_dir[192], dotdot[192], model[128],
			model_file[192];
		struct rst_arg a = { .socket = f.sock,
				     .job = "lnk",
				     .restore = link,
				     .other_uid = 1,
				     .want = -SHARDD_E_PERM,
				     .want_text = { "policy.restore", link, "resolves outside",
						    "uid 65534" } };
		struct rst_arg b = { .socket = f.sock,
				     .job = "lnkdir",
				     .restore = via_dir,
				     .other_uid = 1,
				     .want = -SHARDD_E_PERM,
				     .want_text = { "policy.restore", via_dir } };
		struct rst_arg c = { .socket = f.sock,
				     .job = "dotdot",
				     .restore = dotdot,
				     .other_uid = 1,
				     .want = -SHARDD_E_PERM,
				     .want_text = { "policy.restore", dotdot } };
		/* A real directory inside whose model.safetensors is a symlink out: the file is refused. */
		struct rst_arg d = { .socket = f.sock,
				     .job = "inner",
				     .restore = model,
				     .other_uid = 1,
				     .want = -SHARDD_E_PERM,
				     .want_text = { model_file, "follows no symlink" } };

		snprintf(link, sizeof(link), "%s/link.safetensors", f.imports);
		snprintf(linkdir, sizeof(linkdir), "%s/out", f.imports);
		snprintf(via_dir, sizeof(via_dir), "%s/w.safetensors", linkdir);
		snprintf(dotdot, sizeof(dotdot), "%s/../outside/w.safetensors", f.imports);
		snprintf(model, sizeof(model), "%s/hf", f.imports);
		snprintf(model_file, sizeof(model_file), "%s/model.safetensors", model);
		cr_assert_eq(symlink(f.out_file, link), 0);
		cr_assert_eq(symlink(f.outside, linkdir), 0);
		cr_assert_eq(mkdir(model, 0755), 0);
		cr_assert_eq(symlink(f.out_file, model_file), 0);
		run_client(&a, &f.d);
		run_client(&b, &f.d);
		run_client(&c, &f.d);
		run_client(&d, &f.d);
	}
	fixture_stop(&f);
}

Test(restore_access, same_uid_client_restores_from_anywhere_as_before)
{
	struct fixture f;

	fixture_start(&f, 0);
	{
		char link[128];
		struct rst_arg a = {
			.socket = f.sock, .job = "self", .restore = f.out_file, .expect = f.v
		};
		struct rst_arg b = {
			.socket = f.sock, .job = "selflink", .restore = link, .expect = f.v
		};

		snprintf(link, sizeof(link), "%s/link.safetensors", f.base);
		cr_assert_eq(symlink(f.out_file, link), 0);
		run_client(&a, &f.d);
		run_client(&b, &f.d);
	}
	fixture_stop(&f);
}

Test(restore_access, other_uid_restores_its_jobs_own_checkpoint_with_an_empty_path)
{
	struct fixture f;

	fixture_start(&f, 0);
	{
		struct rst_arg save = {
			.socket = f.sock, .job = "own", .other_uid = 1, .expect = f.v, .save = 1
		};
		struct rst_arg a = {
			.socket = f.sock, .job = "own", .restore = "", .other_uid = 1, .expect = f.v
		};
		char gid[16];

		run_client(&save, &f.d);
		/* A new daemon on the same state dir: the job's newest checkpoint is all there is. */
		opd_stop_clean(&f.d);
		snprintf(gid, sizeof(gid), "%u", ALLOWED_GID);
		opd_start_or_fail(&f.d,
				  (const char *const[]){ "--socket", f.sock, "--allow-gid", gid,
							 "--state-dir", f.state, NULL },
				  f.sock);
		run_client(&a, &f.d);
	}
	fixture_stop(&f);
}

Test(restore_access, import_dir_that_is_not_a_directory_is_a_usage_error)
{
	expect_usage_error("--import-dir", "/nonexistent/shardd-imports",
			   "--import-dir: '/nonexistent/shardd-imports'");
	expect_usage_error("--import-dir", "/dev/null", "is not a directory");
}
