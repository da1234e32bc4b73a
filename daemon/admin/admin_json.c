/* SPDX-License-Identifier: MIT */
/*
 * The JSON of admin requests (admin_int.h): building replies, and reading a
 * request's arguments with errors that list what exists. Numbers that JSON
 * cannot hold (NaN, Inf) travel as the strings "nan", "inf", "-inf".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "admin_int.h"
#include "engine.h"
#include "group.h"
#include "job.h"
#include "shardd_kernels.h"
#include "state.h"

/* ------------------------------------------------------------------ */
/* Replies                                                             */
/* ------------------------------------------------------------------ */

json_t *admin_reply_ok(void)
{
	return json_pack("{s:b}", "ok", 1);
}

/*
 * Replace, in place, each byte that does not begin a well-formed UTF-8
 * sequence with '?'. jansson refuses strings that are not UTF-8, and ours
 * may not be: group and param names are whatever bytes a client registered,
 * and a long text cut at its buffer's end may end inside a character.
 */
static void utf8_scrub(char *s)
{
	unsigned char *p = (unsigned char *)s;

	while (*p) {
		unsigned c = *p, n = 0, lo = 0x80, hi = 0xbf, k;
		int ok;

		if (c < 0x80) {
			p++;
			continue;
		}
		if (c >= 0xc2 && c <= 0xdf) {
			n = 1;
		} else if (c >= 0xe0 && c <= 0xef) {
			n = 2;
			lo = c == 0xe0 ? 0xa0 : 0x80; /* no overlong forms */
			hi = c == 0xed ? 0x9f : 0xbf; /* no surrogates */
		} else if (c >= 0xf0 && c <= 0xf4) {
			n = 3;
			lo = c == 0xf0 ? 0x90 : 0x80;
			hi = c == 0xf4 ? 0x8f : 0xbf; /* nothing above U+10FFFF */
		}
		/* A NUL fails the first check, so nothing past the string is read. */
		ok = n > 0;
		for (k = 1; ok && k <= n; k++)
			ok = k == 1 ? p[k] >= lo && p[k] <= hi : p[k] >= 0x80 && p[k] <= 0xbf;
		if (!ok) {
			*p++ = '?';
			continue;
		}
		p += n + 1;
	}
}

/* A name a client chose (group, param), as a JSON string whatever its bytes. */
json_t *admin_json_name(const char *name)
{
	char buf[SHARDD_PARAM_NAME_MAX];

	snprintf(buf, sizeof(buf), "%s", name);
	utf8_scrub(buf);
	return json_string(buf);
}

json_t *admin_reply_err(int code, const char *fmt, ...)
{
	char text[1024];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	utf8_scrub(text);
	return json_pack("{s:b, s:s, s:i}", "ok", 0, "error", text, "code", code);
}

/* obj[key] = v, taking v's reference. -ENOMEM when either is NULL or the set fails. */
int admin_put(json_t *obj, const char *key, json_t *v)
{
	if (!obj || !v) {
		json_decref(v);
		return -ENOMEM;
	}
	return json_object_set_new(obj, key, v) ? -ENOMEM : 0;
}

int admin_append(json_t *arr, json_t *v)
{
	if (!arr || !v) {
		json_decref(v);
		return -ENOMEM;
	}
	return json_array_append_new(arr, v) ? -ENOMEM : 0;
}

json_t *admin_json_u64(uint64_t v)
{
	return json_integer((json_int_t)(v > INT64_MAX ? INT64_MAX : v));
}

json_t *admin_json_dtype(uint32_t d)
{
	const char *n = shardd_dtype_name(d);

	return n ? json_string(n) : json_integer(d);
}

/* ------------------------------------------------------------------ */
/* Arguments, with errors that list what exists                       */
/* ------------------------------------------------------------------ */

void admin_job_names(char *buf, size_t len)
{
	size_t n = 0;

	buf[0] = 0;
	for (struct shd_job *j = shd_state_jobs(); j && n < len; j = j->next)
		n += (size_t)snprintf(buf + n, len - n, "%s'%s'", n ? ", " : "", j->name);
}

json_t *admin_no_job(const char *name)
{
	char names[ADMIN_NAMES_MAX];

	if (!shd_state_jobs())
		return admin_reply_err(-SHARDD_E_NOJOB,
				       "no job '%s': shardd has no jobs (no rank attached yet)",
				       name);
	admin_job_names(names, sizeof(names));
	return admin_reply_err(-SHARDD_E_NOJOB, "no job '%s'; jobs: %s", name, names);
}

static void group_names(const struct shd_job *j, char *buf, size_t len)
{
	size_t n = 0;

	buf[0] = 0;
	for (uint32_t i = 1; i <= shd_engine_job_ngroups(j->ejob) && n < len; i++) {
		const struct shd_group *g = shd_engine_job_group(j->ejob, i);

		if (g)
			n += (size_t)snprintf(buf + n, len - n, "%s'%s'", n ? ", " : "", g->name);
	}
}

/* The job named by req's optional "job"; NULL when absent, or with *err when none fits. */
struct shd_job *admin_arg_job(const json_t *req, json_t **err)
{
	const json_t *v = json_object_get(req, "job");
	struct shd_job *j;

	*err = NULL;
	if (v && !json_is_null(v)) {
		if (!json_is_string(v)) {
			*err = admin_reply_err(-SHARDD_E_INVALID, "\"job\" must be a string");
			return NULL;
		}
		j = shd_job_find(json_string_value(v));
		if (!j)
			*err = admin_no_job(json_string_value(v));
		return j;
	}
	return NULL;
}

/*
 * The group named `name` in job `j`, or in the only job that has one by that
 * name when `j` is NULL. NULL with *err otherwise.
 */
static struct shd_job *find_group(struct shd_job *j, const char *name, const struct shd_group **g,
				  uint32_t *id, json_t **err)
{
	char names[ADMIN_NAMES_MAX];
	struct shd_job *found = NULL;
	size_t n = 0;

	*err = NULL;
	if (j) {
		*g = shd_engine_job_group_named(j->ejob, name);
		if (*g) {
			*id = (*g)->id;
			return j;
		}
		group_names(j, names, sizeof(names));
		*err = admin_reply_err(-SHARDD_E_NOGROUP, "job '%s' has no group '%s'; groups: %s",
				       j->name, name, *names ? names : "none registered yet");
		return NULL;
	}
	names[0] = 0;
	for (struct shd_job *k = shd_state_jobs(); k; k = k->next) {
		const struct shd_group *kg = shd_engine_job_group_named(k->ejob, name);

		if (!kg)
			continue;
		if (found) {
			*err = admin_reply_err(
				-SHARDD_E_INVALID,
				"group '%s' exists in jobs '%s' and '%s': pass --job NAME", name,
				found->name, k->name);
			return NULL;
		}
		found = k;
		*g = kg;
		*id = kg->id;
	}
	if (found)
		return found;
	for (struct shd_job *k = shd_state_jobs(); k && n < sizeof(names); k = k->next) {
		for (uint32_t i = 1; i <= shd_engine_job_ngroups(k->ejob) && n < sizeof(names);
		     i++) {
			const struct shd_group *kg = shd_engine_job_group(k->ejob, i);

			if (kg)
				n += (size_t)snprintf(names + n, sizeof(names) - n,
						      "%s'%s' (job '%s')", n ? ", " : "", kg->name,
						      k->name);
		}
	}
	*err = admin_reply_err(-SHARDD_E_NOGROUP, "no group '%s'; groups: %s", name,
			       *names ? names : "none registered yet");
	return NULL;
}

/* The group of req's "group" (and optional "job"). */
struct shd_job *admin_arg_group(const json_t *req, const struct shd_group **g, uint32_t *id,
				json_t **err)
{
	const json_t *v = json_object_get(req, "group");
	struct shd_job *j = admin_arg_job(req, err);

	if (*err)
		return NULL;
	if (!json_is_string(v)) {
		*err = admin_reply_err(-SHARDD_E_INVALID,
				       "\"group\" (a group name string) is required");
		return NULL;
	}
	return find_group(j, json_string_value(v), g, id, err);
}

int admin_arg_u64(const json_t *req, const char *key, uint64_t def, uint64_t *out, json_t **err)
{
	const json_t *v = json_object_get(req, key);

	*out = def;
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_integer(v) || json_integer_value(v) < 0) {
		*err = admin_reply_err(-SHARDD_E_INVALID, "\"%s\" must be a non-negative integer",
				       key);
		return -SHARDD_E_INVALID;
	}
	*out = (uint64_t)json_integer_value(v);
	return 0;
}

void admin_exec_counts(const struct shd_job *j, uint64_t counts[3])
{
	struct shd_engine_exec_rank er;

	counts[0] = counts[1] = counts[2] = 0;
	for (uint32_t id = 1; id <= shd_engine_job_ngroups(j->ejob); id++)
		for (uint32_t r = 0; shd_engine_exec_rank(j->ejob, id, r, &er) == 0; r++) {
			counts[0] += er.unshards;
			counts[1] += er.reduces;
			counts[2] += er.reshards;
		}
}
