/* SPDX-License-Identifier: MIT */
/*
 * The checkpoint format (safetensors.h): what its writer
 * (safetensors_write.c) and its parser (safetensors_parse.c) share: error
 * text, dtype names and tensor sizes.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"
#include "safetensors_int.h"

int ckpt_fmt_error(int rc, char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (err && errlen) {
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return rc;
}

const char *shd_safetensors_dtype_name(uint32_t dtype)
{
	switch (dtype) {
	case SHARDD_DTYPE_FP32:
		return "F32";
	case SHARDD_DTYPE_BF16:
		return "BF16";
	case SHARDD_DTYPE_FP16:
		return "F16";
	default:
		return NULL;
	}
}

uint64_t shd_safetensors_numel(const struct shd_safetensors_tensor *t)
{
	uint64_t n = 1;

	for (uint32_t d = 0; d < t->ndim; d++)
		if (__builtin_mul_overflow(n, t->shape[d], &n))
			return UINT64_MAX;
	return n;
}

/* Bytes of a tensor, or UINT64_MAX on overflow. */
uint64_t ckpt_st_bytes(const struct shd_safetensors_tensor *t)
{
	uint64_t n = shd_safetensors_numel(t), b;

	if (n == UINT64_MAX || __builtin_mul_overflow(n, shardd_dtype_size(t->dtype), &b))
		return UINT64_MAX;
	return b;
}

int ckpt_cmp_str(const void *a, const void *b)
{
	return strcmp(*(const char *const *)a, *(const char *const *)b);
}
