/* SPDX-License-Identifier: MIT */
/*
 * A checkpoint on disk (ckpt_save.c): its file writer (direct I/O through
 * io_uring where alignment allows, buffered otherwise) and its directories
 * (creation, durable small files, removal, --keep retention). No engine state.
 */
#ifndef SHD_CKPT_FILES_H
#define SHD_CKPT_FILES_H

#include <stddef.h>
#include <stdint.h>
#include <liburing.h>

#define CKPT_DIO_ALIGN \
	4096u /* O_DIRECT offsets, lengths and buffers: any logical block size up to it */
#define CKPT_DIO_CHUNK (4u << 20) /* bytes per direct write */
#define CKPT_DIO_BUFS  4u         /* direct writes in flight at most, one buffer each */
#define CKPT_DIO_BYTES (CKPT_DIO_BUFS * CKPT_DIO_CHUNK) /* a writer's buffers */

/*
 * A file written front to back through CKPT_DIO_BUFS aligned buffers of
 * CKPT_DIO_CHUNK bytes: a full buffer starts at a multiple of
 * CKPT_DIO_CHUNK, so it goes out with O_DIRECT (no page cache: the
 * checkpoint neither evicts the node's cache nor leaves writeback for
 * fsync), submitted through io_uring while the next buffers fill (up to
 * CKPT_DIO_BUFS writes in flight, as a buffered writeback would have); at the end the aligned part of the rest
 * goes out direct too and the unaligned tail through the buffered
 * descriptor. A filesystem without O_DIRECT (tmpfs), or one that refuses a
 * direct write (EINVAL), gets buffered writes from there on; without an
 * io_uring the direct writes are synchronous.
 */
struct dio_file {
	int fd;      /* buffered */
	int dfd;     /* O_DIRECT on the same file, or -1 */
	int ring_ok; /* ring is set up */
	struct io_uring ring;
	uint8_t *bufs[CKPT_DIO_BUFS]; /* CKPT_DIO_CHUNK bytes each, CKPT_DIO_ALIGN-aligned */
	uint32_t cur;                 /* the buffer being filled */
	uint8_t *buf;                 /* bufs[cur] */
	uint32_t fill;                /* bytes in buf, from file offset base */
	uint64_t base;
	uint32_t len[CKPT_DIO_BUFS]; /* a buffer's write in flight: its bytes (0: none) */
	uint64_t at[CKPT_DIO_BUFS];  /* and its file offset */
	int failed;                  /* a write failed: */
	uint64_t
		failed_at; /* the file offset of the first one (fsync: the file's end), for its message */
};

/* pwrite all n bytes at off, retrying short writes and EINTR. 0 or -errno. */
int ckpt_write_all(int fd, const void *buf, size_t n, uint64_t off);
/* Create `name` in dirfd (O_EXCL). 0 or -errno; buf is the caller's CKPT_DIO_BYTES aligned bytes. */
int ckpt_dio_open(struct dio_file *f, int dirfd, const char *name, uint8_t *buf);
/* Room at the end of the buffer (after making some: a full buffer goes out). 0 or -errno. */
int ckpt_dio_room(struct dio_file *f, uint8_t **at, size_t *len);
/* Append n bytes from memory. 0 or -errno. */
int ckpt_dio_append(struct dio_file *f, const uint8_t *p, size_t n);
/* Write out what the buffers hold (the aligned head direct, the tail buffered), then fsync. 0 or -errno. */
int ckpt_dio_finish(struct dio_file *f);
/* Close; a write still in flight (after a failure) is waited for before the buffers are freed. */
void ckpt_dio_close(struct dio_file *f);
/* Create `name` in dirfd, write `text`, fsync. 0 or -errno. */
int ckpt_write_text(int dirfd, const char *name, const char *text);
/* Remove the files of directory `path` under parentfd (no subdirectories in a checkpoint), then it. 0 or -errno. */
int ckpt_remove_dir(int parentfd, const char *path);
/* In keep_root: remove stale temporary directories, and the oldest step-* beyond `keep` (0: keep all). */
void ckpt_retention(const char *keep_root, uint32_t keep);
/* mkdir -p `path` (mode 0755). 0 or -errno. */
int ckpt_mkdir_p(const char *path);

#endif
