/* SPDX-License-Identifier: MIT */
/*
 * Admin requests (admin.h): the dispatch of a request to its command, and
 * `end`, the one command that changes the daemon. The commands that only
 * look are the views (admin_views.c) and dump (admin_dump.c); the JSON
 * they share is admin_json.c's.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "admin.h"
#include "admin_int.h"
#include "engine.h"
#include "job.h"
#include "shardd_proto.h"
#include "state.h"

/* The pid of the client whose request runs now (shd_admin_handle); 0 when unknown. */
static pid_t admin_peer_pid;

/* ------------------------------------------------------------------ */
/* end: the one command that changes the daemon                        */
/* ------------------------------------------------------------------ */

static json_t *cmd_end(const json_t *req)
{
	const json_t *v = json_object_get(req, "job");
	char name[SHARDD_NAME_MAX], why[160], names[ADMIN_NAMES_MAX];
	struct shd_job *j;
	uint32_t nattached;
	uint64_t bytes;

	if (!json_is_string(v)) {
		admin_job_names(names, sizeof(names));
		return admin_reply_err(-SHARDD_E_INVALID,
				       "end: \"job\" must name the job to end; jobs: %s",
				       shd_state_jobs() ? names : "none");
	}
	j = shd_job_find(json_string_value(v));
	if (!j)
		return admin_no_job(json_string_value(v));
	snprintf(name, sizeof(name), "%s", j->name);
	nattached = j->nattached;
	if (admin_peer_pid > 0)
		snprintf(why, sizeof(why),
			 "was ended by an admin request (shardctl end from pid %d)",
			 (int)admin_peer_pid);
	else
		snprintf(why, sizeof(why), "was ended by an admin request (shardctl end)");
	bytes = shd_job_end(j, why);
	return json_pack("{s:b, s:s, s:i, s:I}", "ok", 1, "job", name, "ranks_attached",
			 (int)nattached, "memory_freed", (json_int_t)bytes);
}

/* ------------------------------------------------------------------ */
/* checkpoint: a checkpoint at the job's next step boundary           */
/* ------------------------------------------------------------------ */

static json_t *cmd_checkpoint(const json_t *req)
{
	const json_t *v = json_object_get(req, "job"), *d = json_object_get(req, "dir");
	char names[ADMIN_NAMES_MAX], msg[512];
	struct shd_job *j;
	uint64_t id;
	int ret;

	if (!json_is_string(v)) {
		admin_job_names(names, sizeof(names));
		return admin_reply_err(-SHARDD_E_INVALID,
				       "checkpoint: \"job\" must name the job; jobs: %s",
				       shd_state_jobs() ? names : "none");
	}
	if (d && !json_is_string(d))
		return admin_reply_err(-SHARDD_E_INVALID,
				       "checkpoint: \"dir\" must be a string (an absolute path)");
	j = shd_job_find(json_string_value(v));
	if (!j)
		return admin_no_job(json_string_value(v));
	ret = shd_job_checkpoint_arm(j, d ? json_string_value(d) : NULL, &id, msg, sizeof(msg));
	if (ret)
		return admin_reply_err(ret, "%s", msg);
	return json_pack("{s:b, s:s, s:I}", "ok", 1, "job", j->name, "id", (json_int_t)id);
}

/*
 * The job's restores: counts, and the last failure and fallback (group,
 * reason, whole message), each null when there was none.
 */
static json_t *restore_json(const struct shd_engine_ckpt_status *st)
{
	json_t *failed =
		st->restore_failed_group[0]
			? json_pack("{s:s, s:s, s:s}", "group", st->restore_failed_group, "reason",
				    shd_engine_restore_reason_name(st->restore_failed_reason),
				    "error", st->restore_failed_msg)
			: json_null();
	json_t *fallback =
		st->restore_fallback_group[0]
			? json_pack("{s:s, s:s, s:s}", "group", st->restore_fallback_group,
				    "reason",
				    shd_engine_restore_reason_name(st->restore_fallback_reason),
				    "error", st->restore_fallback_msg)
			: json_null();

	return json_pack("{s:I, s:I, s:I, s:o, s:o}", "restored", (json_int_t)st->restored,
			 "failed", (json_int_t)st->restore_failed, "fallbacks",
			 (json_int_t)st->restore_fallbacks, "last_failed", failed, "last_fallback",
			 fallback);
}

/* checkpoints: the job's armed, in-progress and last checkpoint, and its restores. */
static json_t *cmd_checkpoints(const json_t *req)
{
	const json_t *v = json_object_get(req, "job");
	struct shd_engine_ckpt_status st;
	char names[ADMIN_NAMES_MAX];
	struct shd_job *j;

	if (!json_is_string(v)) {
		admin_job_names(names, sizeof(names));
		return admin_reply_err(-SHARDD_E_INVALID,
				       "checkpoints: \"job\" must name the job; jobs: %s",
				       shd_state_jobs() ? names : "none");
	}
	j = shd_job_find(json_string_value(v));
	if (!j)
		return admin_no_job(json_string_value(v));
	shd_engine_job_checkpoint_status(j->ejob, &st);
	return json_pack(
		"{s:b, s:s, s:{s:I, s:s}, s:{s:I, s:I, s:s, s:I, s:I, s:f}, s:{s:I, s:i, s:s, s:s, s:I, s:I, s:f, s:b}, s:o}",
		"ok", 1, "job", j->name, "armed", "id", (json_int_t)st.armed_id, "dir",
		st.armed_dir, "writing", "id", (json_int_t)st.writing_id, "step",
		(json_int_t)st.writing_step, "dir", st.writing_dir, "bytes",
		(json_int_t)st.writing_bytes, "total", (json_int_t)st.writing_total, "seconds",
		st.writing_s, "last", "id", (json_int_t)st.last_id, "code", st.last_res, "error",
		st.last_msg, "dir", st.last_dir, "step", (json_int_t)st.last_step, "bytes",
		(json_int_t)st.last_bytes, "seconds", st.last_s, "staged", st.last_staged,
		"restore", restore_json(&st));
}

/* ------------------------------------------------------------------ */
/* Dispatch                                                            */
/* ------------------------------------------------------------------ */

static const struct {
	const char *name;
	json_t *(*fn)(const json_t *req);
} commands[] = {
	{ "status", admin_cmd_status },
	{ "jobs", admin_cmd_jobs },
	{ "ranks", admin_cmd_ranks },
	{ "groups", admin_cmd_groups },
	{ "show", admin_cmd_show },
	{ "dump", admin_cmd_dump },
	{ "stats", admin_cmd_stats },
	{ "metrics", admin_cmd_metrics },
	{ "end", cmd_end },
	{ "checkpoint", cmd_checkpoint },
	{ "checkpoints", cmd_checkpoints },
};

/* The reply object to one request (the caller decrefs), or NULL when out of memory. */
static json_t *admin_exec(const void *payload, size_t len, uid_t peer_uid)
{
	uid_t uid = shd_state_uid();
	json_error_t jerr;
	const char *cmd;
	json_t *req, *r = NULL;

	if (peer_uid != uid)
		return admin_reply_err(-SHARDD_E_PERM,
				       "admin requests need shardd's uid %u; this "
				       "client runs as uid %u (--allow-gid lets ranks attach, not "
				       "inspect): run shardctl as uid %u",
				       (unsigned)uid, (unsigned)peer_uid, (unsigned)uid);
	req = json_loadb(payload, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!req)
		return admin_reply_err(-SHARDD_E_MALFORMED,
				       "admin request is not JSON: %s at byte %d", jerr.text,
				       jerr.position);
	if (!json_is_object(req) || !json_is_string(json_object_get(req, "cmd"))) {
		r = admin_reply_err(-SHARDD_E_MALFORMED, "admin request must be an object with a "
							 "\"cmd\" string");
		goto out;
	}
	cmd = json_string_value(json_object_get(req, "cmd"));
	for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++) {
		if (strcmp(cmd, commands[i].name) == 0) {
			r = commands[i].fn(req);
			goto out;
		}
	}
	r = admin_reply_err(
		-SHARDD_E_INVALID,
		"unknown admin command '%s'; commands: status, jobs, "
		"ranks, groups, show, dump, stats, metrics, end, checkpoint, checkpoints",
		cmd);
out:
	json_decref(req);
	return r;
}

void shd_admin_handle(const void *payload, size_t len, uid_t peer_uid, pid_t peer_pid,
		      struct shd_admin_reply *out)
{
	char *text;
	size_t n;
	json_t *r;

	admin_peer_pid = peer_pid;
	r = admin_exec(payload, len, peer_uid);
	admin_peer_pid = 0;
	text = r ? json_dumps(r, JSON_COMPACT) : NULL;
	n = text ? strlen(text) : 0;
	json_decref(r);
	out->owned = text;
	out->text = text;
	out->len = n;
	if (!text || n > SHARDD_CTRL_MAX) {
		/* Built without jansson: no memory was left for the reply, or it is too big to send. */
		out->len =
			(size_t)snprintf(out->fallback, sizeof(out->fallback),
					 "{\"ok\":false,\"error\":\"%s\",\"code\":%d}",
					 text ? "reply exceeds the 64 MiB message limit: ask for "
						"fewer values"
					      : "shardd is out of memory for the reply",
					 text ? -SHARDD_E_INVALID : -SHARDD_E_NOMEM);
		out->text = out->fallback;
	}
}

void shd_admin_reply_free(struct shd_admin_reply *r)
{
	free(r->owned);
	r->owned = NULL;
	r->text = NULL;
	r->len = 0;
}
