/* SPDX-License-Identifier: MIT */
/*
 * The restore block of a REGISTER_GROUP payload (SHARDD_INIT_RESTORE,
 * PROTOCOL.md 3.6) as shd_group_parse reads it: the path after the specs
 * and the optimizer config, and each malformed form rejected naming the
 * field and value. Payloads are built here byte by byte from the
 * documented layout.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "group.h"

/* header + one fp32 [4] spec (+ optimizer) + restore block with `path` of `path_len` bytes. */
static size_t payload(uint8_t *buf, int optim, const char *path, uint32_t path_len, uint32_t rsvd,
		      size_t cut)
{
	struct shardd_register_group h;
	struct shardd_param_spec s;
	struct shardd_restore r = { .path_len = path_len, .rsvd = rsvd };
	size_t n = 0;

	memset(&h, 0, sizeof(h));
	memset(&s, 0, sizeof(s));
	strcpy(h.name, "g");
	h.nparams = 1;
	h.init = SHARDD_INIT_RESTORE;
	h.flags = optim ? SHARDD_REGISTER_OPTIMIZER : 0;
	strcpy(s.name, "w");
	s.dtype = SHARDD_DTYPE_FP32;
	s.ndim = 1;
	s.shape[0] = 4;
	memcpy(buf + n, &h, sizeof(h));
	n += sizeof(h);
	memcpy(buf + n, &s, sizeof(s));
	n += sizeof(s);
	if (optim) {
		struct shardd_optim_config o = { .kind = SHARDD_OPTIM_SGD, .momentum = 0.5 };

		memcpy(buf + n, &o, sizeof(o));
		n += sizeof(o);
	}
	memcpy(buf + n, &r, sizeof(r));
	n += sizeof(r);
	memcpy(buf + n, path, strlen(path));
	n += strlen(path);
	return n - cut;
}

static int parse(const uint8_t *buf, size_t len, char restore[SHARDD_RESTORE_PATH_MAX], char *err,
		 size_t errlen)
{
	struct shardd_register_group h;
	struct shardd_param_spec *specs = NULL;
	struct shardd_optim_config o;
	int ret = shd_group_parse(buf, len, &h, &specs, &o, restore, err, errlen);

	free(specs);
	return ret;
}

Test(group_restore, path_after_the_optimizer_is_read, .timeout = 5)
{
	static uint8_t buf[8192];
	char restore[SHARDD_RESTORE_PATH_MAX], err[512] = "";
	size_t n = payload(buf, 1, "/ck/step-000000000002", 21, 0, 0);

	cr_assert_eq(parse(buf, n, restore, err, sizeof(err)), 0, "%s", err);
	cr_assert_str_eq(restore, "/ck/step-000000000002");
	n = payload(buf, 0, "", 0, 0, 0);
	cr_assert_eq(parse(buf, n, restore, err, sizeof(err)), 0, "%s", err);
	cr_assert_str_eq(restore, "");
}

Test(group_restore, each_malformed_block_is_rejected_naming_it, .timeout = 5)
{
	static uint8_t buf[8192];
	char restore[SHARDD_RESTORE_PATH_MAX], err[512] = "";
	char longpath[SHARDD_RESTORE_PATH_MAX + 1];
	size_t n;

	n = payload(buf, 0, "/a", 2, 0, 10); /* ends inside the 8-byte block */
	cr_assert_eq(parse(buf, n, restore, err, sizeof(err)), -SHARDD_E_MALFORMED);
	cr_assert(strstr(err, "ends before its 8-byte struct shardd_restore"), "%s", err);
	n = payload(buf, 0, "/a", 2, 7, 0);
	cr_assert_eq(parse(buf, n, restore, err, sizeof(err)), -SHARDD_E_INVALID);
	cr_assert(strstr(err, "rsvd = 7 (must be 0)"), "%s", err);
	memset(longpath, 'x', SHARDD_RESTORE_PATH_MAX);
	longpath[SHARDD_RESTORE_PATH_MAX] = '\0';
	n = payload(buf, 0, longpath, SHARDD_RESTORE_PATH_MAX, 0, 0);
	cr_assert_eq(parse(buf, n, restore, err, sizeof(err)), -SHARDD_E_INVALID);
	cr_assert(strstr(err, "restore path_len = 4096 (at most 4095)"), "%s", err);
	n = payload(buf, 0, "/abc", 4, 0, 1); /* path shorter than path_len */
	cr_assert_eq(parse(buf, n, restore, err, sizeof(err)), -SHARDD_E_MALFORMED);
	cr_assert(strstr(err, "payload is"), "%s", err);
	n = payload(buf, 0, "/ab", 2, 0, 0); /* a byte past path_len */
	cr_assert_eq(parse(buf, n, restore, err, sizeof(err)), -SHARDD_E_MALFORMED);
	n = payload(buf, 0, "/axb", 4, 0, 0);
	buf[n - 2] = '\0';
	cr_assert_eq(parse(buf, n, restore, err, sizeof(err)), -SHARDD_E_INVALID);
	cr_assert(strstr(err, "the restore path holds a NUL byte"), "%s", err);
}
