/* SPDX-License-Identifier: MIT */
/*
 * A checkpoint on disk (ckpt_save.c, ckpt_load.c): its file writer and
 * reader (direct I/O through io_uring where the filesystem allows it,
 * buffered otherwise) and its directories (creation, durable small files,
 * removal, --keep retention). No engine state.
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
 * A bound on the rate a checkpoint's snapshot files are written at, shared
 * by its writers (a group's snapshot thread and write thread each): a
 * direct write waits (or, pushed as the image fills, waits for a later
 * push) until the bytes submitted before it and it are no more than
 * bytes_per_s allows since start_ns.
 */
struct ckpt_pace {
	uint64_t bytes_per_s; /* 0: no bound */
	uint64_t start_ns;    /* CLOCK_MONOTONIC */
	uint64_t sent;        /* bytes submitted (atomic: every writer adds) */
	int unbound; /* atomic: set, the rest goes out at the disk's speed (the job ends) */
};

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
	/* the file offset of the first one (fsync: the file's end), for its message */
	uint64_t failed_at;
	uint64_t reserve_failed; /* ckpt_dio_reserve failed: the bytes it asked for (0: none) */
	struct ckpt_pace *pace;  /* an image's writes: the checkpoint's bound, or NULL */
};

/*
 * A file read front to back through CKPT_DIO_BUFS aligned buffers of
 * CKPT_DIO_CHUNK bytes, every one of them in flight at once: a buffer goes
 * back to the disk for the chunk CKPT_DIO_BUFS further on as soon as it is
 * consumed, so the disk always has reads queued while the caller checks and
 * copies (a single buffered read at a time left it idle between calls).
 * The reads are O_DIRECT (no page cache: a restore does not evict the
 * node's cache for bytes read once) where the filesystem takes it; tmpfs,
 * or a direct read refused (EINVAL), reads buffered; without an io_uring
 * each chunk is read synchronously when it is needed.
 */
struct dio_reader {
	int fd;
	int direct; /* fd is O_DIRECT */
	int ring_ok;
	struct io_uring ring;
	uint8_t *bufs[CKPT_DIO_BUFS]; /* chunk c lies in bufs[c % CKPT_DIO_BUFS] */
	uint64_t size;                /* the file's bytes */
	uint64_t next;                /* the file offset of the next chunk to read */
	uint64_t at[CKPT_DIO_BUFS];   /* a buffer's chunk: its file offset */
	uint32_t want[CKPT_DIO_BUFS]; /* and its bytes (0: the buffer is free) */
	uint32_t got[CKPT_DIO_BUFS];  /* bytes read into it so far */
	int err[CKPT_DIO_BUFS];       /* its read failed: -errno */
	uint8_t busy[CKPT_DIO_BUFS];  /* its read is in flight */
	uint32_t head;                /* the buffer being consumed */
	uint32_t pos;                 /* bytes of it consumed */
	uint64_t failed_at;           /* a failed read: its file offset */
};

/* pwrite all n bytes at off, retrying short writes and EINTR. 0 or -errno. */
int ckpt_write_all(int fd, const void *buf, size_t n, uint64_t off);
/* Create `name` in dirfd (O_EXCL). 0 or -errno; buf is the caller's CKPT_DIO_BYTES aligned bytes (NULL: an image's). */
int ckpt_dio_open(struct dio_file *f, int dirfd, const char *name, uint8_t *buf);
/*
 * Allocate the file's `bytes` on the disk before it is written: a full
 * disk fails here, before any byte of a checkpoint of many GiB is written,
 * and nothing else can fill it half way through. (Not for speed: on the
 * test host's ext4 direct writes into the allocated file and ones that
 * extend it ran at the same speed.) 0 (also where the filesystem has no
 * fallocate: the writes extend the file as before) or -errno.
 */
int ckpt_dio_reserve(struct dio_file *f, uint64_t bytes);
/* Room at the end of the buffer (after making some: a full buffer goes out). 0 or -errno. */
int ckpt_dio_room(struct dio_file *f, uint8_t **at, size_t *len);
/* Append n bytes from memory. 0 or -errno. */
int ckpt_dio_append(struct dio_file *f, const uint8_t *p, size_t n);
/* Write out what the buffers hold (the aligned head direct, the tail buffered), then fsync. 0 or -errno. */
int ckpt_dio_finish(struct dio_file *f);
/*
 * A file written from its whole image in memory (a snapshot), with no
 * buffers of its own: ckpt_dio_open with buf NULL, then ckpt_dio_push as
 * the image fills, then ckpt_dio_write_image. The image is
 * CKPT_DIO_ALIGN-aligned and stays until ckpt_dio_close.
 */
/* Anonymous memory of n bytes for an image, or NULL. */
uint8_t *ckpt_image_alloc(uint64_t n);
/*
 * Map bytes [off, off + n) of an image in one call before they are filled:
 * a fault per 4 KiB page ran at 1-2 GB/s on a VM; all of it at once, up
 * front, would keep the disk waiting. Best effort (Linux >= 5.14).
 */
void ckpt_image_populate(uint8_t *img, uint64_t off, uint64_t n);
/* Release ckpt_image_alloc's n bytes; safe on NULL. */
void ckpt_image_free(uint8_t *img, uint64_t n);
/*
 * Its first `ready` bytes are final: submit the direct writes of the whole
 * chunks among them that free slots allow, without waiting (the rest go
 * out in ckpt_dio_write_image). 0 or -errno.
 */
int ckpt_dio_push(struct dio_file *f, uint8_t *img, uint64_t ready);
/* Write all n bytes of img (what push left), adding them to *progress, then fsync. 0 or -errno. */
int ckpt_dio_write_image(struct dio_file *f, uint8_t *img, uint64_t n, uint64_t *progress);
/* Close; a write still in flight (after a failure) is waited for before the buffers are freed. */
void ckpt_dio_close(struct dio_file *f);
/*
 * Read `fd` (a regular file of `size` bytes, opened by the caller, which
 * keeps it) front to back; its flags become O_DIRECT where allowed, and
 * blocking. buf: the caller's CKPT_DIO_BYTES aligned bytes. 0 or -errno.
 */
int ckpt_dio_read_open(struct dio_reader *r, int fd, uint64_t size, uint8_t *buf);
/*
 * The next bytes of the file, at most `max`, at *at (*len of them, >= 1),
 * valid until the next call; they count as consumed. 0, -ENODATA when the
 * file ends before `size` bytes, or -errno (r->failed_at: where).
 */
int ckpt_dio_read(struct dio_reader *r, size_t max, const uint8_t **at, size_t *len);
/* Stop: reads still in flight are waited for before the caller frees the buffers. */
void ckpt_dio_read_close(struct dio_reader *r);
/* Create `name` in dirfd, write `text`, fsync. 0 or -errno. */
int ckpt_write_text(int dirfd, const char *name, const char *text);
/* Remove the files of directory `path` under parentfd (no subdirectories in a checkpoint), then it. 0 or -errno. */
int ckpt_remove_dir(int parentfd, const char *path);
/* In keep_root: remove stale temporary directories, and the oldest step-* beyond `keep` (0: keep all). */
void ckpt_retention(const char *keep_root, uint32_t keep);
/* mkdir -p `path` (mode 0755). 0 or -errno. */
int ckpt_mkdir_p(const char *path);

#endif
