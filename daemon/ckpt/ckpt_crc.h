/* SPDX-License-Identifier: MIT */
/*
 * A checkpoint file's CRC-32 (the manifest's "crc32"): zlib's crc32(), the
 * same values, at the speed of memory rather than of zlib's tables, so that
 * computing it while a file is written or read does not hold the disk back.
 */
#ifndef SHD_CKPT_CRC_H
#define SHD_CKPT_CRC_H

#include <stddef.h>
#include <stdint.h>

/* zlib's crc32(crc, p, n): the CRC-32 of the bytes so far (`crc`, 0 to begin) followed by p[0..n). */
uint32_t ckpt_crc32(uint32_t crc, const uint8_t *p, size_t n);

#endif
