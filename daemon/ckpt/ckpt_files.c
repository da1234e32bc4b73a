/* SPDX-License-Identifier: MIT */
/* A checkpoint on disk (ckpt_files.h): its file writer and reader (O_DIRECT through io_uring) and its directories. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_crc.h"
#include "ckpt_files.h"
#include "clock.h"
#include "log.h"

int ckpt_write_all(int fd, const void *buf, size_t n, uint64_t off)
{
	const uint8_t *p = buf;

	while (n) {
		ssize_t w = pwrite(fd, p, n, (off_t)off);

		if (w < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		p += w;
		n -= (size_t)w;
		off += (uint64_t)w;
	}
	return 0;
}

/* Create `name` in dirfd (O_EXCL). 0 or -errno; buf is the caller's CKPT_DIO_BYTES aligned bytes. */
int ckpt_dio_open(struct dio_file *f, int dirfd, const char *name, uint8_t *buf)
{
	*f = (struct dio_file){ .fd = -1, .dfd = -1, .buf = buf };
	for (uint32_t i = 0; buf && i < CKPT_DIO_BUFS; i++)
		f->bufs[i] = buf + (size_t)i * CKPT_DIO_CHUNK;
	f->fd = openat(dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
	if (f->fd < 0)
		return -errno;
	f->dfd = openat(dirfd, name, O_WRONLY | O_DIRECT | O_CLOEXEC);
	f->ring_ok = f->dfd >= 0 && io_uring_queue_init(CKPT_DIO_BUFS, &f->ring, 0) == 0;
	return 0;
}

int ckpt_dio_reserve(struct dio_file *f, uint64_t bytes)
{
	int ret = bytes && fallocate(f->fd, 0, 0, (off_t)bytes) ? -errno : 0;

	if (ret == -EOPNOTSUPP || ret == -ENOSYS)
		return 0;
	if (ret)
		f->reserve_failed = bytes;
	return ret;
}

/* A failed write at file offset `at`: kept for its message (the first one). Returns ret. */
static int dio_failed(struct dio_file *f, int ret, uint64_t at)
{
	if (ret && !f->failed) {
		f->failed = 1;
		f->failed_at = at;
	}
	return ret;
}

/*
 * A write's completion: one the filesystem refused direct (EINVAL), or cut
 * short, is finished buffered (its buffer is still intact). 0 or -errno.
 */
static int dio_complete(struct dio_file *f, struct io_uring_cqe *cqe)
{
	uint32_t k = (uint32_t)io_uring_cqe_get_data64(cqe), done = 0;
	int res = cqe->res, err = 0;

	io_uring_cqe_seen(&f->ring, cqe);
	if (k >= CKPT_DIO_BUFS || !f->len[k])
		return -EIO;
	if (res == -EINVAL && f->dfd >= 0) {
		close(f->dfd);
		f->dfd = -1;
	} else if (res < 0) {
		err = res;
	} else {
		done = (uint32_t)res;
	}
	if (!err && done < f->len[k])
		err = ckpt_write_all(f->fd, f->bufs[k] + done, f->len[k] - done, f->at[k] + done);
	f->len[k] = 0;
	return err ? dio_failed(f, err, f->at[k] + done) : 0;
}

/*
 * Wait for buffer i's write in flight, if any (taking the others' as they
 * complete first). 0 or -errno; a failed wait leaves len set.
 */
static int dio_wait(struct dio_file *f, uint32_t i)
{
	int ret = 0;

	while (f->len[i]) {
		struct io_uring_cqe *cqe;
		int res = io_uring_wait_cqe(&f->ring, &cqe);

		if (res == -EINTR)
			continue;
		if (res)
			return res;
		res = dio_complete(f, cqe);
		ret = ret ? ret : res;
	}
	return ret;
}

enum {
	PUT_WAIT_NEXT,
	PUT_WAIT_THIS,
	PUT_NO_WAIT
}; /* dio_put: what to wait for after the submission */

/* Write out n bytes of buf at base: direct (through the ring when there is one) when it can, else buffered. */
static int dio_put(struct dio_file *f, size_t n, int wait)
{
	int ret;

	if (f->dfd < 0 || n % CKPT_DIO_ALIGN || f->base % CKPT_DIO_ALIGN)
		return dio_failed(f, ckpt_write_all(f->fd, f->buf, n, f->base), f->base);
	if (!f->ring_ok) {
		ret = ckpt_write_all(f->dfd, f->buf, n, f->base);
		if (ret != -EINVAL)
			return dio_failed(f, ret, f->base);
		close(f->dfd);
		f->dfd = -1;
		return dio_failed(f, ckpt_write_all(f->fd, f->buf, n, f->base), f->base);
	}
	{
		struct io_uring_sqe *sqe = io_uring_get_sqe(&f->ring);

		if (!sqe)
			return -EBUSY; /* a ring as deep as the buffers: never */
		io_uring_prep_write(sqe, f->dfd, f->buf, (unsigned)n, f->base);
		io_uring_sqe_set_data64(sqe, f->cur);
		f->len[f->cur] = (uint32_t)n;
		f->at[f->cur] = f->base;
		ret = io_uring_submit(&f->ring);
		if (ret < 0) {
			f->len[f->cur] = 0;
			return dio_failed(f, ret, f->base);
		}
	}
	if (wait == PUT_WAIT_THIS)
		return dio_wait(f, f->cur);
	/* Fill the next buffer (once its own write is done) while this one is written. */
	f->cur = (f->cur + 1) % CKPT_DIO_BUFS;
	f->buf = f->bufs[f->cur];
	return wait == PUT_NO_WAIT ? 0 : dio_wait(f, f->cur);
}

/* Room at the end of the buffer (after making some: a full buffer goes out). */
int ckpt_dio_room(struct dio_file *f, uint8_t **at, size_t *len)
{
	if (f->fill == CKPT_DIO_CHUNK) {
		int ret = dio_put(f, CKPT_DIO_CHUNK, PUT_WAIT_NEXT);

		f->base += CKPT_DIO_CHUNK;
		f->fill = 0;
		if (ret)
			return ret;
	}
	*at = f->buf + f->fill;
	*len = CKPT_DIO_CHUNK - f->fill;
	return 0;
}

/* Append n bytes from memory. */
int ckpt_dio_append(struct dio_file *f, const uint8_t *p, size_t n)
{
	while (n) {
		uint8_t *at;
		size_t k;
		int ret = ckpt_dio_room(f, &at, &k);

		if (ret)
			return ret;
		k = k < n ? k : n;
		memcpy(at, p, k);
		f->fill += (uint32_t)k;
		p += k;
		n -= k;
	}
	return 0;
}

/* Write out what the buffers hold (the aligned head direct, the tail buffered), then fsync. */
int ckpt_dio_finish(struct dio_file *f)
{
	uint32_t head = f->fill / CKPT_DIO_ALIGN * CKPT_DIO_ALIGN;
	int ret = 0;

	for (uint32_t i = 0; i < CKPT_DIO_BUFS && f->ring_ok; i++) {
		int r = dio_wait(f, i);

		ret = ret ? ret : r;
	}

	if (!ret && head)
		ret = dio_put(f, head, PUT_WAIT_THIS);
	if (!ret && f->fill > head)
		ret = dio_failed(
			f, ckpt_write_all(f->fd, f->buf + head, f->fill - head, f->base + head),
			f->base + head);
	if (!ret && fsync(f->fd))
		ret = dio_failed(f, -errno, f->base + f->fill);
	return ret;
}

uint8_t *ckpt_image_alloc(uint64_t n)
{
	void *p = mmap(NULL, n ? n : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	if (p == MAP_FAILED)
		return NULL;
	/* Best effort: 2 MiB pages map in 512x fewer steps, and a direct write's DMA takes fewer segments. */
	madvise(p, n ? n : 1, MADV_HUGEPAGE);
	return p;
}

void ckpt_image_populate(uint8_t *img, uint64_t off, uint64_t n)
{
#ifdef MADV_POPULATE_WRITE
	uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), from = off / page * page;

	if (n)
		madvise(img + from, (size_t)(off + n - from), MADV_POPULATE_WRITE);
#else
	(void)img;
	(void)off;
	(void)n;
#endif
}

void ckpt_image_free(uint8_t *img, uint64_t n)
{
	if (img)
		munmap(img, n ? n : 1);
}

/* When the pace lets the write that brings the bytes sent to `sent` go out: start_ns plus their time at the rate. */
static uint64_t pace_due(const struct ckpt_pace *p, uint64_t sent)
{
	return p->start_ns + (uint64_t)((long double)sent * 1e9L / (long double)p->bytes_per_s);
}

/* Whether the pace bounds writes now. */
static int pace_on(const struct ckpt_pace *p)
{
	return p && p->bytes_per_s && !__atomic_load_n(&p->unbound, __ATOMIC_RELAXED);
}

/* 1 when `bytes` may go out now (counted as sent), 0 when the pace wants them later. */
static int pace_take(struct ckpt_pace *p, uint64_t bytes)
{
	if (!pace_on(p))
		return 1;
	if (shd_now_ns() < pace_due(p, __atomic_load_n(&p->sent, __ATOMIC_RELAXED) + bytes))
		return 0;
	__atomic_add_fetch(&p->sent, bytes, __ATOMIC_RELAXED);
	return 1;
}

/* A pause of the pace at most: unbound (the job ends) is seen within it. */
#define PACE_SLICE_NS 50000000ull

/* Count `bytes` as sent and sleep until the pace lets them go out (or it is unbound). */
static void pace_wait(struct ckpt_pace *p, uint64_t bytes)
{
	uint64_t due, now;

	if (!pace_on(p))
		return;
	/* Its own place in the order: two writers at once never share a due time. */
	due = pace_due(p, __atomic_add_fetch(&p->sent, bytes, __ATOMIC_RELAXED));
	while (pace_on(p) && (now = shd_now_ns()) < due) {
		uint64_t until = due - now > PACE_SLICE_NS ? now + PACE_SLICE_NS : due;
		struct timespec ts = { .tv_sec = (time_t)(until / 1000000000u),
				       .tv_nsec = (long)(until % 1000000000u) };

		clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
	}
}

int ckpt_dio_push(struct dio_file *f, uint8_t *img, uint64_t ready)
{
	struct io_uring_cqe *cqe;
	int ret = 0;

	if (!f->ring_ok || f->dfd < 0)
		return 0;
	while (!ret && ready - f->base >= CKPT_DIO_CHUNK) {
		/* The next write's slot: its last write reaped if it completed, else later. */
		while (!ret && f->len[f->cur] && !io_uring_peek_cqe(&f->ring, &cqe))
			ret = dio_complete(f, cqe);
		if (ret || f->len[f->cur] || f->dfd < 0 || !pace_take(f->pace, CKPT_DIO_CHUNK))
			break;
		f->buf = f->bufs[f->cur] = img + f->base;
		ret = dio_put(f, CKPT_DIO_CHUNK, PUT_NO_WAIT);
		f->base += CKPT_DIO_CHUNK;
	}
	return ret;
}

int ckpt_dio_write_image(struct dio_file *f, uint8_t *img, uint64_t n, uint64_t *progress)
{
	int ret = 0;

	/* What push sent counts now; each chunk after it as it is submitted (in a free slot). */
	__atomic_add_fetch(progress, f->base, __ATOMIC_RELAXED);
	while (!ret && n - f->base >= CKPT_DIO_CHUNK) {
		ret = f->ring_ok ? dio_wait(f, f->cur) : 0;
		pace_wait(f->pace, CKPT_DIO_CHUNK);
		f->buf = f->bufs[f->cur] = img + f->base;
		ret = ret ? ret : dio_put(f, CKPT_DIO_CHUNK, PUT_NO_WAIT);
		f->base += CKPT_DIO_CHUNK;
		__atomic_add_fetch(progress, CKPT_DIO_CHUNK, __ATOMIC_RELAXED);
	}
	if (ret)
		return ret;
	f->buf = f->bufs[f->cur] = img + f->base;
	f->fill = (uint32_t)(n - f->base);
	__atomic_add_fetch(progress, f->fill, __ATOMIC_RELAXED);
	return ckpt_dio_finish(f);
}

/* Close; a write still in flight (after a failure) is waited for before the buffers are freed. */
void ckpt_dio_close(struct dio_file *f)
{
	if (f->ring_ok) {
		for (uint32_t i = 0; i < CKPT_DIO_BUFS; i++)
			if (f->len[i])
				dio_wait(f, i);
		io_uring_queue_exit(&f->ring);
		f->ring_ok = 0;
	}
	if (f->dfd >= 0)
		close(f->dfd);
	if (f->fd >= 0)
		close(f->fd);
	f->fd = f->dfd = -1;
}

/* From now on buffer reads: the filesystem refused a direct one, or one came back short. */
static void rd_buffered(struct dio_reader *r)
{
	int fl = fcntl(r->fd, F_GETFL);

	if (fl >= 0 && !fcntl(r->fd, F_SETFL, fl & ~O_DIRECT))
		r->direct = 0;
}

/* Bytes to ask for the rest of buffer i: whole blocks when direct (the file ends within the last). */
static uint32_t rd_ask(struct dio_reader *r, uint32_t i)
{
	uint32_t n = r->want[i] - r->got[i];

	if (r->direct && r->got[i] % CKPT_DIO_ALIGN)
		rd_buffered(r);
	return r->direct ? (n + CKPT_DIO_ALIGN - 1) / CKPT_DIO_ALIGN * CKPT_DIO_ALIGN : n;
}

/* The file's next chunk into free buffer i, if it has one left: in flight through the ring, else read when needed. */
static void rd_submit(struct dio_reader *r, uint32_t i)
{
	uint64_t left = r->size - r->next;
	struct io_uring_sqe *sqe;
	int ret;

	r->want[i] = left < CKPT_DIO_CHUNK ? (uint32_t)left : CKPT_DIO_CHUNK;
	r->at[i] = r->next;
	r->got[i] = 0;
	r->err[i] = 0;
	r->next += r->want[i];
	if (!r->want[i] || !r->ring_ok)
		return;
	sqe = io_uring_get_sqe(&r->ring);
	if (!sqe)
		return; /* a ring as deep as the buffers: never; read when needed */
	io_uring_prep_read(sqe, r->fd, r->bufs[i], rd_ask(r, i), r->at[i]);
	io_uring_sqe_set_data64(sqe, i);
	r->busy[i] = 1;
	ret = io_uring_submit(&r->ring);
	if (ret < 0) {
		r->busy[i] = 0;
		r->err[i] = ret;
	}
}

/* Wait for buffer i's read in flight, if any (taking the others' as they complete first). 0 or -errno. */
static int rd_wait(struct dio_reader *r, uint32_t i)
{
	while (r->busy[i]) {
		struct io_uring_cqe *cqe;
		uint32_t k;
		int res = io_uring_wait_cqe(&r->ring, &cqe);

		if (res == -EINTR)
			continue;
		if (res)
			return res;
		k = (uint32_t)io_uring_cqe_get_data64(cqe);
		res = cqe->res;
		io_uring_cqe_seen(&r->ring, cqe);
		if (k >= CKPT_DIO_BUFS || !r->busy[k])
			return -EIO;
		r->busy[k] = 0;
		/* Refused direct: the rest is read buffered when it is needed (rd_finish). */
		if (res == -EINVAL && r->direct)
			rd_buffered(r);
		else if (res < 0)
			r->err[k] = res;
		else
			r->got[k] += (uint32_t)res < r->want[k] - r->got[k]
					     ? (uint32_t)res
					     : r->want[k] - r->got[k];
	}
	return 0;
}

/* Read what buffer i still lacks (no ring, a short read, a refused direct one) synchronously. 0, -ENODATA or -errno. */
static int rd_finish(struct dio_reader *r, uint32_t i)
{
	while (r->got[i] < r->want[i]) {
		ssize_t n = pread(r->fd, r->bufs[i] + r->got[i], rd_ask(r, i),
				  (off_t)(r->at[i] + r->got[i]));

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EINVAL && r->direct) {
			rd_buffered(r);
			continue;
		}
		if (n <= 0)
			return n < 0 ? -errno : -ENODATA;
		r->got[i] +=
			(uint32_t)n < r->want[i] - r->got[i] ? (uint32_t)n : r->want[i] - r->got[i];
	}
	return 0;
}

int ckpt_dio_read_open(struct dio_reader *r, int fd, uint64_t size, uint8_t *buf)
{
	int fl = fcntl(fd, F_GETFL);

	*r = (struct dio_reader){ .fd = fd, .size = size };
	for (uint32_t i = 0; i < CKPT_DIO_BUFS; i++)
		r->bufs[i] = buf + (size_t)i * CKPT_DIO_CHUNK;
	if (fl < 0)
		return -errno;
	/* O_NONBLOCK guarded the open against a FIFO; a regular file's reads may block. */
	fl &= ~O_NONBLOCK;
	r->direct = !fcntl(fd, F_SETFL, fl | O_DIRECT);
	if (!r->direct && fcntl(fd, F_SETFL, fl))
		return -errno;
	r->ring_ok = io_uring_queue_init(CKPT_DIO_BUFS, &r->ring, 0) == 0;
	for (uint32_t i = 0; i < CKPT_DIO_BUFS; i++)
		rd_submit(r, i);
	return 0;
}

int ckpt_dio_read(struct dio_reader *r, size_t max, const uint8_t **at, size_t *len)
{
	uint32_t i = r->head;
	size_t n;
	int ret;

	/* The buffer handed out last time is consumed: it goes back for the chunk CKPT_DIO_BUFS on. */
	if (r->want[i] && r->pos == r->want[i]) {
		r->pos = 0;
		rd_submit(r, i);
		i = r->head = (i + 1) % CKPT_DIO_BUFS;
	}
	if (!r->want[i])
		return -ENODATA;
	ret = r->ring_ok ? rd_wait(r, i) : 0;
	if (!ret)
		ret = r->err[i];
	if (!ret)
		ret = rd_finish(r, i);
	if (ret) {
		r->failed_at = r->at[i] + r->got[i];
		return ret;
	}
	n = r->want[i] - r->pos;
	n = n < max ? n : max;
	*at = r->bufs[i] + r->pos;
	*len = n;
	r->pos += (uint32_t)n;
	return 0;
}

void ckpt_dio_read_close(struct dio_reader *r)
{
	if (!r->ring_ok)
		return;
	for (uint32_t i = 0; i < CKPT_DIO_BUFS; i++)
		if (r->busy[i])
			rd_wait(r, i);
	io_uring_queue_exit(&r->ring);
	r->ring_ok = 0;
}

/* Remove the files of directory `path` (no subdirectories in a checkpoint), then it. */
int ckpt_remove_dir(int parentfd, const char *path)
{
	int fd = openat(parentfd, path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	DIR *d;
	struct dirent *e;

	if (fd < 0)
		return -errno;
	d = fdopendir(fd);
	if (!d) {
		close(fd);
		return -errno;
	}
	while ((e = readdir(d)))
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
			unlinkat(fd, e->d_name, 0);
	closedir(d);
	return unlinkat(parentfd, path, AT_REMOVEDIR) ? -errno : 0;
}

static int step_cmp(const void *a, const void *b)
{
	unsigned long long x = strtoull(*(char *const *)a + 5, NULL, 10);
	unsigned long long y = strtoull(*(char *const *)b + 5, NULL, 10);

	return x < y ? -1 : x > y;
}

/* 1 for "step-<digits>". */
static int is_step_dir(const char *s)
{
	return !strncmp(s, "step-", 5) && s[5] && strspn(s + 5, "0123456789") == strlen(s + 5);
}

/* In keep_root: remove stale temporary directories, and the oldest step-* beyond `keep`. */
void ckpt_retention(const char *keep_root, uint32_t keep)
{
	int fd = open(keep_root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	char **steps = NULL;
	size_t n = 0, cap = 0;
	struct dirent *e;
	DIR *d;

	if (fd < 0)
		return;
	d = fdopendir(fd);
	if (!d) {
		close(fd);
		return;
	}
	while ((e = readdir(d))) {
		if (!strncmp(e->d_name, ".tmp-", 5)) {
			ckpt_remove_dir(fd, e->d_name);
			continue;
		}
		if (!keep || !is_step_dir(e->d_name))
			continue;
		if (n == cap) {
			char **bigger = realloc(steps, (cap = cap ? 2 * cap : 16) * sizeof(*steps));

			if (!bigger)
				break;
			steps = bigger;
		}
		if (!(steps[n] = strdup(e->d_name)))
			break;
		n++;
	}
	if (n)
		qsort(steps, n, sizeof(*steps), step_cmp);
	for (size_t i = 0; i + keep < n; i++) {
		int ret = ckpt_remove_dir(fd, steps[i]);

		if (ret)
			shd_log_warn("checkpoint retention (--keep %u): cannot remove %s/%s: %s",
				     keep, keep_root, steps[i], strerror(-ret));
		else
			shd_log_info("checkpoint retention (--keep %u): removed %s/%s", keep,
				     keep_root, steps[i]);
	}
	for (size_t i = 0; i < n; i++)
		free(steps[i]);
	free(steps);
	closedir(d);
}

int ckpt_write_text(int dirfd, const char *name, const char *text)
{
	int fd = openat(dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644), ret;

	if (fd < 0)
		return -errno;
	ret = ckpt_write_all(fd, text, strlen(text), 0);
	if (!ret && fsync(fd))
		ret = -errno;
	close(fd);
	return ret;
}

/* mkdir -p `path` (mode 0755). 0 or -errno. */
int ckpt_mkdir_p(const char *path)
{
	char buf[4096];
	size_t n = strlen(path);

	if (n >= sizeof(buf))
		return -ENAMETOOLONG;
	memcpy(buf, path, n + 1);
	for (char *p = buf + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(buf, 0755) && errno != EEXIST)
			return -errno;
		*p = '/';
	}
	if (mkdir(buf, 0755) && errno != EEXIST)
		return -errno;
	return 0;
}
