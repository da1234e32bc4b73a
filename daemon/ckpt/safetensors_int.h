/* SPDX-License-Identifier: MIT */
/*
 * What the checkpoint format's files share (safetensors.c): its writer
 * (safetensors_write.c) and its parser (safetensors_parse.c). Not for
 * other files: they include safetensors.h. It includes nothing of the
 * project, so safetensors.c, below both, can include it.
 */
#ifndef SHD_SAFETENSORS_INT_H
#define SHD_SAFETENSORS_INT_H

#include <stddef.h>
#include <stdint.h>

struct shd_safetensors_tensor;

/* Format `fmt` into err (when err and errlen) and return rc. */
int ckpt_fmt_error(int rc, char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

/* Bytes of a tensor, or UINT64_MAX on overflow. */
uint64_t ckpt_st_bytes(const struct shd_safetensors_tensor *t);

/* qsort comparison of two `const char *`. */
int ckpt_cmp_str(const void *a, const void *b);

#endif /* SHD_SAFETENSORS_INT_H */
