/* SPDX-License-Identifier: MIT */
/*
 * Error names and the thread-local error context. Each layer that fails
 * sets or prefixes the calling thread's message, so the caller can print
 * the whole chain: "register group 'layer3': daemon: param 'w' dtype 9:
 * unknown dtype".
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define SHARDD_ERR_LEN 1024

static __thread char last_error[SHARDD_ERR_LEN];
static __thread char unknown_text[48];

static const char *const shardd_error_text[SHARDD_E_MAX - SHARDD_E_BASE] = {
	[SHARDD_E_MAGIC - SHARDD_E_BASE] = "wrong magic number in a message or ring",
	[SHARDD_E_VERSION - SHARDD_E_BASE] = "protocol major version differs",
	[SHARDD_E_MALFORMED - SHARDD_E_BASE] = "truncated or malformed message",
	[SHARDD_E_PERM - SHARDD_E_BASE] = "peer credentials not allowed",
	[SHARDD_E_RANK_TAKEN - SHARDD_E_BASE] = "another live client holds this rank",
	[SHARDD_E_MESH - SHARDD_E_BASE] = "mesh differs from the job's",
	[SHARDD_E_INVALID - SHARDD_E_BASE] = "a field has an invalid value",
	[SHARDD_E_TIMEOUT - SHARDD_E_BASE] = "collective timeout: ranks missing",
	[SHARDD_E_PEER_DIED - SHARDD_E_BASE] = "a rank of the rendezvous died",
	[SHARDD_E_MISMATCH - SHARDD_E_BASE] = "ranks disagree on step, flags or spec",
	[SHARDD_E_SHUTDOWN - SHARDD_E_BASE] = "the daemon is shutting down",
	[SHARDD_E_NOGROUP - SHARDD_E_BASE] = "unknown group",
	[SHARDD_E_STATE - SHARDD_E_BASE] = "op not allowed in this state",
	[SHARDD_E_NOMEM - SHARDD_E_BASE] = "daemon could not allocate memory",
	[SHARDD_E_BACKEND - SHARDD_E_BASE] = "backend failure",
	[SHARDD_E_NOJOB - SHARDD_E_BASE] = "unknown job",
};

const char *shardd_strerror(int err)
{
	const char *s = NULL;
	long e = err < 0 ? -(long)err : err;

	if (e == 0)
		return "success";
	if (e > SHARDD_E_BASE && e < SHARDD_E_MAX)
		s = shardd_error_text[e - SHARDD_E_BASE];
	else if (e < SHARDD_E_BASE)
		s = strerrordesc_np((int)e);
	if (s)
		return s;
	snprintf(unknown_text, sizeof(unknown_text), "unknown error %d", err);
	return unknown_text;
}

const char *shardd_last_error(void)
{
	return last_error;
}

void shardd_err_clear(void)
{
	last_error[0] = '\0';
}

int shardd_err_set(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
	return err;
}

int shardd_err_wrap(int err, const char *fmt, ...)
{
	char prefix[SHARDD_ERR_LEN];
	char chain[2 * SHARDD_ERR_LEN + 2];
	size_t n;
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(prefix, sizeof(prefix), fmt, ap);
	va_end(ap);
	/* An inner layer that set no text still leaves the code's name. */
	snprintf(chain, sizeof(chain), "%s: %s", prefix,
		 last_error[0] ? last_error : shardd_strerror(err));
	/* Too long a chain loses its innermost end; the outer context stays readable. */
	n = strnlen(chain, sizeof(last_error) - 1);
	memcpy(last_error, chain, n);
	last_error[n] = '\0';
	return err;
}
