/* SPDX-License-Identifier: MIT */
/*
 * A checkpoint file's CRC-32 (daemon/ckpt/ckpt_crc.c) against zlib's
 * crc32(), the manifest's reference: every length and alignment around the
 * folding's 16- and 64-byte blocks, chained calls, and CRC-32's published
 * check value.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "ckpt_crc.h"

Test(ckpt_crc, check_value_of_123456789_is_cbf43926, .timeout = 10)
{
	cr_assert_eq(ckpt_crc32(0, (const uint8_t *)"123456789", 9), 0xcbf43926u);
	cr_assert_eq(ckpt_crc32(0, NULL, 0), 0u);
}

Test(ckpt_crc, equals_zlib_at_every_length_and_alignment_to_300_bytes, .timeout = 30)
{
	uint8_t buf[300 + 64];

	srand(7);
	for (size_t i = 0; i < sizeof(buf); i++)
		buf[i] = (uint8_t)rand();
	for (size_t off = 0; off < 64; off++)
		for (size_t n = 0; n <= 300; n++) {
			uint32_t seed = (uint32_t)rand();

			cr_assert_eq(ckpt_crc32(seed, buf + off, n),
				     (uint32_t)crc32(seed, buf + off, (uInt)n),
				     "offset %zu, %zu bytes, crc before %08x", off, n, seed);
		}
}

Test(ckpt_crc, equals_zlib_over_megabytes_in_chained_pieces, .timeout = 30)
{
	size_t n = (9u << 20) + 77;
	uint8_t *buf = malloc(n);
	uint32_t mine = 0;
	uLong ref = crc32(0L, Z_NULL, 0);

	cr_assert(buf);
	srand(11);
	for (size_t i = 0; i < n; i++)
		buf[i] = (uint8_t)rand();
	for (size_t at = 0, k; at < n; at += k) {
		k = (size_t)rand() % (3u << 20);
		k = k < n - at ? k : n - at;
		mine = ckpt_crc32(mine, buf + at, k);
		ref = crc32(ref, buf + at, (uInt)k);
		cr_assert_eq(mine, (uint32_t)ref, "after %zu bytes", at + k);
	}
	free(buf);
}
