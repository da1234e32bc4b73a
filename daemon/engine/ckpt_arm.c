/* SPDX-License-Identifier: MIT */
/*
 * When a checkpoint is taken besides the ranks' op (engine.h,
 * docs/CHECKPOINTS.md): armed by an admin request for the job's next step
 * boundary, or periodically (--checkpoint-every) at a boundary whose step
 * is a multiple of it; tried after each task's completions (the engine's
 * at_boundary). Also what `shardctl checkpoints` shows: the armed, the one
 * being written, the last. The writing itself is ckpt_save.c's.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_int.h"
#include "clock.h"
#include "log.h"

/* An armed checkpoint's end: its outcome is in ckpt_last, read by `shardctl checkpoints`. */
static void armed_done(void *ctx, int res, const char *msg, const char *dir, uint64_t bytes,
		       double seconds)
{
	(void)ctx;
	(void)res;
	(void)msg;
	(void)dir;
	(void)bytes;
	(void)seconds;
}

/*
 * The step boundary of an armed checkpoint: every group registered and
 * idle, every optimizer group's last step the same on every rank and in
 * every group. *step gets that step (0 without an optimizer group).
 */
static int at_boundary(const struct shd_engine_job *j, uint64_t *step)
{
	int seen = 0;

	*step = 0;
	for (uint32_t i = 0; i < j->ngroups; i++) {
		const struct eng_group *eg = j->groups[i];

		if (!eg)
			continue;
		if (!eg->complete || eg->running || eg->qhead)
			return 0;
		if (eg->g->optim.kind == SHARDD_OPTIM_NONE)
			continue;
		for (uint32_t r = 0; r < eg->g->world; r++) {
			uint64_t s = __atomic_load_n(&eg->g->last_step[r], __ATOMIC_RELAXED);

			if (seen && s != *step)
				return 0;
			*step = s;
			seen = 1;
		}
	}
	return 1;
}

/* --checkpoint-every: at a step boundary that is a multiple of it, once per step. */
static void try_periodic(struct shd_engine_job *j)
{
	const struct shd_engine_config *cfg = &j->e->cfg;
	struct shd_engine_ckpt_target t = { .keep = cfg->keep };
	char msg[ENGINE_MSG_MAX], *root = NULL, *dir = NULL;
	int ret;

	if (!cfg->checkpoint_every || !cfg->state_dir || j->ckpt || j->ending ||
	    !at_boundary(j, &t.step) || !t.step || t.step % cfg->checkpoint_every ||
	    t.step <= j->ckpt_every_last)
		return;
	j->ckpt_every_last = t.step;
	if (asprintf(&root, "%s/%s", cfg->state_dir, j->name) < 0)
		root = NULL;
	if (root && asprintf(&dir, "%s/step-%012llu", root, (unsigned long long)t.step) < 0)
		dir = NULL;
	t.dir = dir;
	t.keep_root = root;
	ret = dir ? eng_ckpt_start(j, &t, j->ckpt_seq + 1, armed_done, NULL, msg, sizeof(msg))
		  : -SHARDD_E_NOMEM;
	if (!dir)
		eng_fmt(msg, sizeof(msg), "out of memory");
	j->ckpt_seq++;
	if (ret)
		eng_ckpt_record_failure(j, j->ckpt_seq, ret, msg, dir, t.step);
	free(dir);
	free(root);
}

void eng_ckpt_try_armed(struct shd_engine_job *j)
{
	struct eng_ckpt_req *r = j->ckpt_armed;
	struct shd_engine_ckpt_target t = { .keep_root = r ? r->keep_root : NULL,
					    .keep = r ? r->keep : 0 };
	char msg[ENGINE_MSG_MAX], *dir = NULL;
	int ret;

	if (!r) {
		try_periodic(j);
		return;
	}
	if (j->ckpt || j->ending || !at_boundary(j, &t.step))
		return;
	j->ckpt_armed = NULL;
	if (!r->dir &&
	    asprintf(&dir, "%s/step-%012llu", r->keep_root, (unsigned long long)t.step) < 0)
		dir = NULL;
	t.dir = r->dir ? r->dir : dir;
	ret = t.dir ? eng_ckpt_start(j, &t, r->id, armed_done, NULL, msg, sizeof(msg))
		    : -SHARDD_E_NOMEM;
	if (ret) {
		if (!t.dir)
			eng_fmt(msg, sizeof(msg), "out of memory");
		eng_ckpt_record_failure(j, r->id, ret, msg, t.dir, t.step);
	}
	free(dir);
	eng_ckpt_req_free(r);
}

int shd_engine_job_checkpoint_arm(struct shd_engine_job *j, const char *dir, const char *keep_root,
				  uint32_t keep, uint64_t *id, char *err, size_t errlen)
{
	struct eng_ckpt_req *r;

	if (j->ckpt_armed || j->ckpt) {
		eng_fmt(err, errlen,
			"checkpoint %llu of job '%s' is %s; wait for it (shardctl checkpoints %s)",
			(unsigned long long)(j->ckpt_armed ? j->ckpt_armed->id : j->ckpt->id),
			j->name,
			j->ckpt_armed ? "armed for the next step boundary" : "being written",
			j->name);
		return -SHARDD_E_STATE;
	}
	r = calloc(1, sizeof(*r));
	if (!r || (dir && !(r->dir = strdup(dir))) ||
	    (keep_root && !(r->keep_root = strdup(keep_root)))) {
		eng_ckpt_req_free(r);
		eng_fmt(err, errlen, "out of memory");
		return -SHARDD_E_NOMEM;
	}
	r->keep = keep;
	r->id = ++j->ckpt_seq;
	*id = r->id;
	j->ckpt_armed = r;
	shd_log_info("job '%s': checkpoint %llu armed for the next step boundary (%s)", j->name,
		     (unsigned long long)r->id, dir ? dir : keep_root);
	eng_ckpt_try_armed(j);
	return 0;
}

void shd_engine_job_checkpoint_status(const struct shd_engine_job *j,
				      struct shd_engine_ckpt_status *st)
{
	*st = j->ckpt_last;
	st->armed_id = j->ckpt_armed ? j->ckpt_armed->id : 0;
	snprintf(st->armed_dir, sizeof(st->armed_dir), "%s",
		 j->ckpt_armed && j->ckpt_armed->dir ? j->ckpt_armed->dir : "");
	st->writing_id = j->ckpt ? j->ckpt->id : 0;
	st->writing_step = j->ckpt ? j->ckpt->m.step : 0;
	snprintf(st->writing_dir, sizeof(st->writing_dir), "%s", j->ckpt ? j->ckpt->dir : "");
	st->writing_bytes = j->ckpt ? __atomic_load_n(&j->ckpt->bytes, __ATOMIC_RELAXED) : 0;
	st->writing_total = j->ckpt ? j->ckpt->total : 0;
	st->writing_s = j->ckpt ? (double)(shd_now_ns() - j->ckpt->start_ns) / 1e9 : 0;
}
