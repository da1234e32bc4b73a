/* SPDX-License-Identifier: MIT */
/*
 * Inside the admin requests (admin.h): the JSON helpers and argument
 * readers every command uses (admin_json.c), and the commands the dispatch
 * (admin.c) calls: the views (admin_views.c) and dump (admin_dump.c). Each
 * command takes the request object and returns its reply, or NULL when out
 * of memory.
 */
#ifndef SHD_ADMIN_INT_H
#define SHD_ADMIN_INT_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

struct shd_group;
struct shd_job;

#define ADMIN_NAMES_MAX 1024 /* bytes of a "jobs: a, b, c" list in an error */

/* ---- admin_json.c: replies ---- */

/* {"ok": true} */
json_t *admin_reply_ok(void);
/* {"ok": false, "error": the text, "code": code} */
json_t *__attribute__((format(printf, 2, 3))) admin_reply_err(int code, const char *fmt, ...);
/* A name a client chose (group, param), as a JSON string whatever its bytes. */
json_t *admin_json_name(const char *name);
/* obj[key] = v, taking v's reference. -ENOMEM when either is NULL or the set fails. */
int admin_put(json_t *obj, const char *key, json_t *v);
/* arr += v, taking v's reference; -ENOMEM likewise. */
int admin_append(json_t *arr, json_t *v);
/* A count, clamped to JSON's (jansson's) largest integer. */
json_t *admin_json_u64(uint64_t v);
/* A dtype's name, or its number when it has none. */
json_t *admin_json_dtype(uint32_t d);

/* ---- admin_json.c: arguments ---- */

/* "'a', 'b'": the names of every job, into buf. */
void admin_job_names(char *buf, size_t len);
/* The error for a job `name` that does not exist, listing those that do. */
json_t *admin_no_job(const char *name);
/* The job named by req's optional "job"; NULL when absent, or with *err when none fits. */
struct shd_job *admin_arg_job(const json_t *req, json_t **err);
/*
 * The group of req's "group" (and optional "job"): its job, with *g and
 * *id; NULL with *err when none fits.
 */
struct shd_job *admin_arg_group(const json_t *req, const struct shd_group **g, uint32_t *id,
				json_t **err);
/*
 * req's optional non-negative integer `key` into *out (def when absent). 0, or
 * -SHARDD_E_INVALID with *err.
 */
int admin_arg_u64(const json_t *req, const char *key, uint64_t def, uint64_t *out, json_t **err);
/*
 * The unshards, reduces and reshards the ranks of `j`'s rank-executed
 * groups ran (their slots' counts, summed), into counts[0..2]: what the
 * ring's op counters do not see.
 */
void admin_exec_counts(const struct shd_job *j, uint64_t counts[3]);

/* ---- admin_views.c ---- */

json_t *admin_cmd_status(const json_t *req);
json_t *admin_cmd_jobs(const json_t *req);
json_t *admin_cmd_ranks(const json_t *req);
json_t *admin_cmd_groups(const json_t *req);
json_t *admin_cmd_show(const json_t *req);
json_t *admin_cmd_stats(const json_t *req);
json_t *admin_cmd_metrics(const json_t *req);

/* ---- admin_dump.c ---- */

json_t *admin_cmd_dump(const json_t *req);

#endif /* SHD_ADMIN_INT_H */
