/* SPDX-License-Identifier: MIT */
/*
 * A checkpoint file read back through ckpt_dio_read (daemon/ckpt/ckpt_files.c):
 * every byte in order whatever the caller asks for at a time, a file that is
 * not a whole number of blocks or chunks, a file that ends before the size
 * it was opened with, on a disk's filesystem (O_DIRECT) and on tmpfs.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt_crc.h"
#include "ckpt_files.h"

/* A file of n pseudo-random bytes in folder `dir`, opened for reading; its bytes in *bytes. */
static int make_file(const char *dir, size_t n, uint8_t **bytes)
{
	char path[256];
	uint8_t *b = malloc(n ? n : 1);
	int fd;

	cr_assert(b);
	for (size_t i = 0; i < n; i++)
		b[i] = (uint8_t)(i * 2654435761u >> 13);
	snprintf(path, sizeof(path), "%s/ckpt-files-XXXXXX", dir);
	fd = mkstemp(path);
	cr_assert(fd >= 0, "%s: %s", path, strerror(errno));
	unlink(path);
	cr_assert_eq(ckpt_write_all(fd, b, n, 0), 0);
	*bytes = b;
	return fd;
}

/* Read all n bytes of fd through the reader, at most `step` (0: random) at a time, and compare. */
static void reads_back(const char *dir, size_t n, size_t step)
{
	uint8_t *want, *buf = NULL;
	struct dio_reader r;
	int fd = make_file(dir, n, &want);
	size_t at = 0;

	cr_assert_eq(posix_memalign((void **)&buf, CKPT_DIO_ALIGN, CKPT_DIO_BYTES), 0);
	cr_assert_eq(ckpt_dio_read_open(&r, fd, n, buf), 0);
	srand(3);
	while (at < n) {
		const uint8_t *p;
		size_t len, max = step ? step : 1 + (size_t)rand() % (3u << 20);

		cr_assert_eq(ckpt_dio_read(&r, max, &p, &len), 0, "at byte %zu", at);
		cr_assert(len >= 1 && len <= max && len <= n - at);
		cr_assert_eq(memcmp(p, want + at, len), 0, "%zu bytes at byte %zu differ", len, at);
		at += len;
	}
	cr_assert_eq(ckpt_dio_read(&r, 1, &(const uint8_t *){ NULL }, &(size_t){ 0 }), -ENODATA);
	ckpt_dio_read_close(&r);
	close(fd);
	free(buf);
	free(want);
}

Test(ckpt_files, reader_returns_every_byte_in_order_on_a_disk, .timeout = 60)
{
	reads_back("/var/tmp", 3 * CKPT_DIO_CHUNK + 12345, 0);
	reads_back("/var/tmp", 9 * CKPT_DIO_CHUNK, CKPT_DIO_CHUNK);
	reads_back("/var/tmp", 4097, 1000);
}

Test(ckpt_files, reader_returns_every_byte_in_order_on_tmpfs, .timeout = 60)
{
	reads_back("/dev/shm", 5 * CKPT_DIO_CHUNK + 1, 0);
}

Test(ckpt_files, reader_says_a_file_shorter_than_its_size_ends_early, .timeout = 60)
{
	size_t n = CKPT_DIO_CHUNK + 100;
	uint8_t *want, *buf = NULL;
	struct dio_reader r;
	int fd = make_file("/var/tmp", n, &want), ret = 0;
	size_t at = 0;

	cr_assert_eq(posix_memalign((void **)&buf, CKPT_DIO_ALIGN, CKPT_DIO_BYTES), 0);
	cr_assert_eq(ckpt_dio_read_open(&r, fd, n + 5000, buf), 0);
	while (!ret) {
		const uint8_t *p;
		size_t len;

		ret = ckpt_dio_read(&r, SIZE_MAX, &p, &len);
		at += ret ? 0 : len;
	}
	/* The chunk that ends early is not handed out; the error names where the file ends. */
	cr_assert_eq(ret, -ENODATA);
	cr_assert_eq(at, CKPT_DIO_CHUNK);
	cr_assert_eq(r.failed_at, n);
	ckpt_dio_read_close(&r);
	close(fd);
	free(buf);
	free(want);
}

/* An image of n bytes written as a snapshot is: pushed as it fills, then the rest; the file must match, every byte counted. */
static void image_writes(const char *dir, uint64_t n)
{
	char path[256], name[64];
	uint8_t *img = ckpt_image_alloc(n), *back = malloc(n ? n : 1);
	struct dio_file f;
	uint64_t progress = 0;
	int dirfd = open(dir, O_RDONLY | O_DIRECTORY), fd;

	cr_assert(img && back && dirfd >= 0);
	for (uint64_t i = 0; i < n; i++)
		img[i] = (uint8_t)(i * 2246822519u >> 11);
	snprintf(name, sizeof(name), "ckpt-image-%d-%llu", getpid(), (unsigned long long)n);
	unlinkat(dirfd, name, 0);
	cr_assert_eq(ckpt_dio_open(&f, dirfd, name, NULL), 0);
	for (uint64_t ready = 0; ready < n; ready += CKPT_DIO_CHUNK / 3)
		cr_assert_eq(ckpt_dio_push(&f, img, ready), 0, "pushing %llu bytes",
			     (unsigned long long)ready);
	{
		int r = ckpt_dio_write_image(&f, img, n, &progress);

		cr_assert_eq(r, 0, "%s: %llu bytes: %s (failed at %llu)", dir,
			     (unsigned long long)n, strerror(-r), (unsigned long long)f.failed_at);
	}
	ckpt_dio_close(&f);
	cr_assert_eq(progress, n);
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	fd = open(path, O_RDONLY);
	cr_assert(fd >= 0);
	cr_assert_eq(pread(fd, back, n, 0), (ssize_t)n);
	cr_assert_eq(memcmp(back, img, n), 0);
	close(fd);
	unlinkat(dirfd, name, 0);
	close(dirfd);
	ckpt_image_free(img, n);
	free(back);
}

Test(ckpt_files, image_is_written_whole_as_it_fills_on_a_disk_and_on_tmpfs, .timeout = 60)
{
	image_writes("/var/tmp", 7 * (uint64_t)CKPT_DIO_CHUNK + 777);
	image_writes("/var/tmp", 2 * (uint64_t)CKPT_DIO_CHUNK);
	image_writes("/var/tmp", 100);
	image_writes("/dev/shm", 3 * (uint64_t)CKPT_DIO_CHUNK + 5);
}
