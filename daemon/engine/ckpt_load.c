/* SPDX-License-Identifier: MIT */
/*
 * Restoring a group from a checkpoint (SHARDD_INIT_RESTORE, docs/CHECKPOINTS.md),
 * at any mesh: the registration's TASK_RESTORE, on the worker pool, once
 * every rank registered and the buffers exist, before any rank gets its
 * reply. Each file is read once, front to back (ckpt_dio_read: direct
 * reads, CKPT_DIO_BUFS of them in flight): its CRC-32 is checked
 * against the manifest's while every tensor it needs is scattered, row
 * range by row range, into the shards of the new mesh (every replica gets
 * a copy), and the optimizer state the same way. The manifest and every
 * safetensors header are parsed by the strict parsers of safetensors.c;
 * an error names the tensor, the file, and what was expected and found.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "ckpt_crc.h"
#include "ckpt_files.h"
#include "safetensors.h"
#include "engine_int.h"
#include "log.h"
#include "shardd_kernels.h"

#define LOAD_BOUNCE (8u << 20) /* bytes of a plain weights file read per call */
#define LOAD_PATH   4200

/* "a/b" into buf; -ENAMETOOLONG when it does not fit. */
static int join(char *buf, size_t len, const char *a, const char *b)
{
	int n = snprintf(buf, len, "%s/%s", a, b);

	return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

/*
 * Where a client of another uid than shardd's may read from (docs/RELIABILITY.md
 * "Who may connect"): its restore path resolved (realpath) lies under `root`,
 * --state-dir or an --import-dir, and every file is opened by open_beneath,
 * relative to `fd`. fd -1: no confinement (shardd's own uid, or the job's
 * own checkpoints in --state-dir).
 */
struct confine {
	int fd;               /* root, O_PATH | O_DIRECTORY; -1: none */
	char root[LOAD_PATH]; /* resolved */
	uid_t uid;            /* the client's, for messages */
};

/* Is `path` `root` or below it? Both resolved (no "..", no "//"). */
static int path_under(const char *root, const char *path)
{
	size_t n = strlen(root);

	if (n == 1 && root[0] == '/')
		return path[0] == '/';
	return !strncmp(root, path, n) && (path[n] == '/' || !path[n]);
}

/*
 * Open `path` (below cf->root) for reading, one component at a time from
 * cf->fd, following no symlink. realpath checked the path when the restore
 * began; a directory or file swapped for a symlink since (by whoever may
 * write below the root) would otherwise redirect the read to a file outside,
 * which the client may not read: here the swapped component fails with
 * ELOOP instead. The fd, or -errno.
 */
static int open_beneath(const struct confine *cf, const char *path)
{
	char rel[LOAD_PATH], *comp, *end;
	int dfd, fd = -1, err;

	if (!path_under(cf->root, path) || strlen(path) >= sizeof(rel))
		return -EACCES;
	snprintf(rel, sizeof(rel), "%s", path + (strcmp(cf->root, "/") ? strlen(cf->root) : 0));
	dfd = fcntl(cf->fd, F_DUPFD_CLOEXEC, 0);
	for (comp = rel; dfd >= 0; comp = end) {
		struct stat st;
		int nfd, last;

		comp += strspn(comp, "/");
		end = comp + strcspn(comp, "/");
		last = !end[strspn(end, "/")];
		if (*end)
			*end++ = '\0';
		if (!*comp || !strcmp(comp, ".") || !strcmp(comp, "..")) {
			errno = !*comp ? EISDIR : EACCES;
			break;
		}
		if (last) {
			fd = openat(dfd, comp,
				    O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY | O_NOFOLLOW);
			break;
		}
		nfd = openat(dfd, comp, O_PATH | O_CLOEXEC | O_NOFOLLOW);
		if (nfd >= 0 && (fstat(nfd, &st) || !S_ISDIR(st.st_mode))) {
			err = fstat(nfd, &st) ? errno : S_ISLNK(st.st_mode) ? ELOOP : ENOTDIR;
			close(nfd);
			nfd = -1;
			errno = err;
		}
		err = errno;
		close(dfd);
		errno = err;
		dfd = nfd;
	}
	err = errno;
	if (dfd >= 0)
		close(dfd);
	return fd >= 0 ? fd : -err;
}

/*
 * Open `path` for reading, if it is a regular file: the path comes from a
 * client (the registration's restore path, files named in it), and an
 * open() of a FIFO would wait for a writer for ever, blocking a worker.
 * O_NONBLOCK makes that open return; a regular file reads as usual. `cf`:
 * a confined client's (open_beneath), or NULL. fd (its size in *st), or
 * -errno with err naming the path.
 */
static int open_regular(const struct confine *cf, const char *path, struct stat *st, char *err,
			size_t errlen)
{
	int fd, ret;

	if (cf && cf->fd >= 0)
		fd = open_beneath(cf, path);
	else if ((fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY)) < 0)
		fd = -errno;
	ret = fd < 0 ? fd : fstat(fd, st) ? -errno : 0;
	if (ret < 0) {
		if (cf && cf->fd >= 0 && (ret == -ELOOP || ret == -ENOTDIR || ret == -EACCES))
			eng_fmt(err, errlen,
				"cannot read %s for client uid %u: %s (below %s shardd follows no "
				"symlink for a client of another uid)",
				path, (unsigned)cf->uid, strerror(-ret), cf->root);
		else
			eng_fmt(err, errlen, "cannot read %s: %s", path, strerror(-ret));
		if (fd >= 0)
			close(fd);
		return cf && cf->fd >= 0 && (ret == -ELOOP || ret == -EACCES) ? -SHARDD_E_PERM
									      : ret;
	}
	if (!S_ISREG(st->st_mode)) {
		close(fd);
		eng_fmt(err, errlen,
			"cannot read %s: not a regular file (mode 0%o); a checkpoint holds files only",
			path, (unsigned)st->st_mode);
		return -SHARDD_E_INVALID;
	}
	return fd;
}

static int read_manifest(const struct confine *cf, const char *dir, struct shd_ckpt_manifest *m,
			 char *err, size_t errlen)
{
	char path[LOAD_PATH], why[400];
	struct stat st;
	char *buf;
	int fd, ret;

	if (join(path, sizeof(path), dir, SHD_CKPT_MANIFEST)) {
		eng_fmt(err, errlen, "checkpoint path '%.200s...' is too long", dir);
		return -SHARDD_E_INVALID;
	}
	fd = open_regular(cf, path, &st, err, errlen);
	if (fd < 0)
		return fd;
	if ((uint64_t)st.st_size > SHD_CKPT_MANIFEST_MAX) {
		close(fd);
		eng_fmt(err, errlen, "%s is %lld bytes; a manifest is at most %u", path,
			(long long)st.st_size, SHD_CKPT_MANIFEST_MAX);
		return -SHARDD_E_MALFORMED;
	}
	buf = malloc((size_t)st.st_size + 1);
	if (!buf) {
		close(fd);
		return -SHARDD_E_NOMEM;
	}
	ret = pread(fd, buf, (size_t)st.st_size, 0) == st.st_size ? 0 : -EIO;
	close(fd);
	if (ret)
		eng_fmt(err, errlen, "cannot read %s: short read", path);
	else
		ret = shd_ckpt_manifest_parse(buf, (size_t)st.st_size, m, why, sizeof(why));
	if (ret && ret != -EIO)
		eng_fmt(err, errlen, "%s: %s", path, why);
	free(buf);
	return ret;
}

/* 1 for a checkpoint's directory name, "step-<digits>". */
static int is_step_name(const char *s)
{
	return !strncmp(s, "step-", 5) && s[5] && strspn(s + 5, "0123456789") == strlen(s + 5);
}

/*
 * Is checkpoint `dir` complete as far as can be told without reading its
 * tensors: manifest.json parses, and every file it lists is there, a
 * regular file of the recorded size with a valid safetensors header. (The
 * CRC-32s are checked as the files are read.) 0, or the error with `err`.
 */
static int check_complete(const struct confine *cf, const char *dir, char *err, size_t errlen)
{
	struct shd_ckpt_manifest m = { 0 };
	int ret = read_manifest(cf, dir, &m, err, errlen);

	for (uint32_t i = 0; !ret && i < m.nfiles; i++) {
		struct shd_safetensors_file f = { 0 };
		char path[LOAD_PATH], why[512];
		struct stat st;
		int fd;

		if (join(path, sizeof(path), dir, m.files[i].name)) {
			eng_fmt(err, errlen, "checkpoint path '%.200s...' is too long", dir);
			ret = -SHARDD_E_INVALID;
			break;
		}
		fd = open_regular(cf, path, &st, err, errlen);
		if (fd < 0) {
			ret = fd;
			break;
		}
		if ((uint64_t)st.st_size != m.files[i].bytes) {
			eng_fmt(err, errlen,
				"%s is %lld bytes, the manifest records %llu: the file changed or is "
				"truncated",
				path, (long long)st.st_size, (unsigned long long)m.files[i].bytes);
			ret = -SHARDD_E_MALFORMED;
		} else if ((ret = shd_safetensors_read(fd, path, &f, why, sizeof(why)))) {
			eng_fmt(err, errlen, "%s", why);
		}
		shd_safetensors_free(&f);
		close(fd);
	}
	shd_ckpt_manifest_free(&m);
	return ret;
}

/*
 * Move damaged checkpoint `dir` aside to "<dir>.damaged" (or ".damaged-K"
 * when that exists), so that the next checkpoint of its step can be
 * written under its name. Another group's restore of the same job may have
 * moved it first. The new name into `to` ("" when it was gone already);
 * 0 or -errno.
 */
static int move_aside(const char *dir, char *to, size_t tolen)
{
	for (unsigned k = 0; k < 100; k++) {
		int n = k ? snprintf(to, tolen, "%s.damaged-%u", dir, k)
			  : snprintf(to, tolen, "%s.damaged", dir);

		if (n < 0 || (size_t)n >= tolen)
			return -ENAMETOOLONG;
		if (!renameat2(AT_FDCWD, dir, AT_FDCWD, to, RENAME_NOREPLACE))
			return 0;
		if (errno == ENOENT) {
			to[0] = '\0';
			return 0;
		}
		if (errno != EEXIST && errno != ENOTEMPTY)
			return -errno;
	}
	return -EEXIST;
}

/* A restore's failure code, or a skipped checkpoint's damage, as its kind. */
static uint32_t restore_reason(int res)
{
	switch (res) {
	case -SHARDD_E_MALFORMED:
		return SHD_RESTORE_DAMAGED;
	case -ENOENT:
		return SHD_RESTORE_MISSING;
	case -SHARDD_E_MISMATCH:
		return SHD_RESTORE_MISMATCH;
	case -SHARDD_E_PERM:
		return SHD_RESTORE_PERMISSION;
	case -SHARDD_E_INVALID:
		return SHD_RESTORE_INVALID;
	case -SHARDD_E_NOMEM:
	case -ENOMEM:
		return SHD_RESTORE_MEMORY;
	case -ENOTSUP:
		return SHD_RESTORE_UNSUPPORTED;
	default:
		return SHD_RESTORE_IO;
	}
}

const char *shd_engine_restore_reason_name(uint32_t reason)
{
	static const char *const names[SHD_RESTORE_REASONS] = {
		[SHD_RESTORE_DAMAGED] = "damaged",
		[SHD_RESTORE_MISSING] = "missing",
		[SHD_RESTORE_MISMATCH] = "mismatch",
		[SHD_RESTORE_PERMISSION] = "permission",
		[SHD_RESTORE_IO] = "io",
		[SHD_RESTORE_INVALID] = "invalid",
		[SHD_RESTORE_MEMORY] = "memory",
		[SHD_RESTORE_UNSUPPORTED] = "unsupported",
	};

	return reason < SHD_RESTORE_REASONS ? names[reason] : NULL;
}

void shd_engine_restore_counts(const struct shd_engine *e, struct shd_engine_restore_counts *c)
{
	*c = e->restores;
}

/*
 * Skipping damaged checkpoint `dir` (its check failed with `bad`, why:
 * `why`): logged, with `aside` moved aside, and kept in the group for
 * eng_restore_record (the pool task owns the group until it is delivered).
 */
static void skip_damaged(struct eng_group *eg, const char *dir, int bad, const char *why, int aside)
{
	char to[LOAD_PATH], *m = eg->restore_skip_msg;
	size_t mlen = sizeof(eg->restore_skip_msg);
	int ret = aside ? move_aside(dir, to, sizeof(to)) : 0;

	if (!aside)
		eng_fmt(m, mlen,
			"skipped damaged checkpoint %s: %s; it stays in place (a restore path names "
			"no folder shardd may change): remove it or move it aside",
			dir, why);
	else if (ret)
		eng_fmt(m, mlen,
			"skipped damaged checkpoint %s: %s; moving it aside failed (%s): remove it, "
			"or the next checkpoint of its step cannot be written",
			dir, why, strerror(-ret));
	else if (to[0])
		eng_fmt(m, mlen,
			"skipped damaged checkpoint %s: %s; moved it aside to %s (inspect or delete it)",
			dir, why, to);
	else
		eng_fmt(m, mlen,
			"skipped damaged checkpoint %s: %s; another group's restore moved it aside",
			dir, why);
	eg->restore_skipped++;
	eg->restore_skip_reason = restore_reason(bad);
	shd_log_warn("job '%s': group '%s': %s", eg->j->name, eg->g->name, m);
}

static int step_cmp_desc(const void *a, const void *b)
{
	unsigned long long x = strtoull(*(char *const *)a + 5, NULL, 10);
	unsigned long long y = strtoull(*(char *const *)b + 5, NULL, 10);

	return x < y ? 1 : x > y ? -1 : 0;
}

/*
 * The newest complete step-<N> directory of `root` (check_complete) into
 * `out`, skipping newer damaged ones (skip_damaged; with `aside` they are
 * moved aside). 0; -ENOENT with *nsteps 0 when root holds no step-N, or
 * with *nsteps > 0 and `err` (the newest one's damage) when none of them
 * is complete; or, when a checkpoint could not be read (not damage: it is
 * neither skipped nor moved), that error with `err`.
 */
static int newest_checkpoint(struct eng_group *eg, const struct confine *cf, const char *root,
			     int aside, char *out, size_t len, uint32_t *nsteps, char *err,
			     size_t errlen)
{
	DIR *d = opendir(root);
	char **names = NULL, first[ENGINE_MSG_MAX] = "";
	size_t n = 0, cap = 0;
	struct dirent *e;
	int ret = -ENOENT;

	*nsteps = 0;
	if (!d)
		return -errno;
	while (ret == -ENOENT && (e = readdir(d))) {
		if (!is_step_name(e->d_name))
			continue;
		if (n == cap) {
			char **bigger = realloc(names, (cap = cap ? 2 * cap : 16) * sizeof(*names));

			if (!bigger) {
				ret = -ENOMEM;
				break;
			}
			names = bigger;
		}
		if (!(names[n] = strdup(e->d_name)))
			ret = -ENOMEM;
		else
			n++;
	}
	closedir(d);
	if (ret == -ENOMEM) {
		eng_fmt(err, errlen, "out of memory to list %s", root);
		goto out;
	}
	/* qsort's base must not be NULL, even for no element (UBSan holds it to that). */
	if (n)
		qsort(names, n, sizeof(*names), step_cmp_desc);
	*nsteps = (uint32_t)n;
	for (size_t i = 0; i < n && ret == -ENOENT; i++) {
		char dir[LOAD_PATH], why[ENGINE_MSG_MAX] = "";
		int bad;

		if (join(dir, sizeof(dir), root, names[i]) || strlen(dir) >= len)
			continue;
		bad = check_complete(cf, dir, why, sizeof(why));
		/* Only damage skips a checkpoint: after a failure to read (EMFILE, EACCES, EIO) it may be sound. */
		if (bad && bad != -SHARDD_E_MALFORMED && bad != -ENOENT &&
		    bad != -SHARDD_E_INVALID) {
			eng_fmt(err, errlen, "%s", why);
			ret = bad;
			break;
		}
		if (bad) {
			if (!first[0])
				snprintf(first, sizeof(first), "%s", why);
			skip_damaged(eg, dir, bad, why, aside);
			continue;
		}
		memcpy(out, dir, strlen(dir) + 1);
		ret = 0;
	}
	if (ret == -ENOENT && n)
		eng_fmt(err, errlen, "%s", first);
out:
	for (size_t i = 0; i < n; i++)
		free(names[i]);
	free(names);
	return ret;
}

/*
 * Is directory `src` (no manifest.json in it) a checkpoint all the same:
 * named step-N, under --state-dir, or holding an optimizer-state file?
 * Then it is a damaged one, never plain weights to import.
 */
static int looks_like_checkpoint(const struct shd_engine_config *cfg, const char *src)
{
	char *real = realpath(src, NULL),
	     *state = cfg->state_dir ? realpath(cfg->state_dir, NULL) : NULL;
	const char *base = strrchr(src, '/');
	int yes = is_step_name(base ? base + 1 : src) || (real && state && path_under(state, real));
	DIR *d = yes ? NULL : opendir(src);
	struct dirent *e;

	while (d && !yes && (e = readdir(d))) {
		size_t n = strlen(e->d_name);

		yes = !strcmp(e->d_name, "optim.safetensors") ||
		      (!strncmp(e->d_name, "optim-", 6) && n > 12 &&
		       !strcmp(e->d_name + n - 12, ".safetensors"));
	}
	if (d)
		closedir(d);
	free(real);
	free(state);
	return yes;
}

/* A file read front to back (ckpt_files.h), its CRC-32 kept as it goes. */
struct loader {
	struct shd_group *g;
	struct shd_backend_ctx *b;
	struct dio_reader rd;
	uint32_t crc;
	const char *path;
	char *err; /* the restore's error text */
	size_t errlen;
};

/* The next bytes of the file, at most n, at *at (*len of them), counted in the CRC. */
static int ld_next(struct loader *l, uint64_t n, const uint8_t **at, size_t *len)
{
	int ret = ckpt_dio_read(&l->rd, n < SIZE_MAX ? (size_t)n : SIZE_MAX, at, len);

	if (ret) {
		eng_fmt(l->err, l->errlen, "%s: read at byte %llu: %s", l->path,
			(unsigned long long)l->rd.failed_at,
			ret == -ENODATA ? "the file ends early" : strerror(-ret));
		return ret == -ENODATA ? -SHARDD_E_MALFORMED : ret;
	}
	l->crc = ckpt_crc32(l->crc, *at, *len);
	return 0;
}

/* Pass over `n` bytes the group does not need, for the CRC. */
static int ld_skip(struct loader *l, uint64_t n)
{
	while (n) {
		const uint8_t *at;
		size_t k;
		int ret = ld_next(l, n, &at, &k);

		if (ret)
			return ret;
		n -= k;
	}
	return 0;
}

/* The next `n` bytes into offset `dst` of shard rank `s`'s buffer `bufs[u * S + s]` of every replica u. */
static int ld_scatter(struct loader *l, struct shd_buf *bufs, uint32_t s, uint64_t dst, uint64_t n)
{
	const struct shd_group *g = l->g;

	while (n) {
		const uint8_t *at;
		size_t k;
		int ret = ld_next(l, n, &at, &k);

		for (uint32_t u = 0; !ret && u < g->replicate; u++)
			ret = l->b->ops->write(l->b, &bufs[u * g->shard + s], dst, k, at);
		if (ret) {
			if (!l->err[0])
				eng_fmt(l->err, l->errlen,
					"%s: writing into group '%s''s buffers failed in the %s backend (%d)",
					l->path, g->name, l->b->ops->name, ret);
			return ret;
		}
		dst += k;
		n -= k;
	}
	return 0;
}

static void shape_text(uint32_t dtype, uint32_t ndim, const uint64_t *shape, char *buf, size_t len)
{
	size_t o = (size_t)snprintf(buf, len, "%s [",
				    shardd_dtype_name(dtype) ? shardd_dtype_name(dtype) : "?");

	for (uint32_t d = 0; d < ndim && o < len; d++)
		o += (size_t)snprintf(buf + o, len - o, "%s%llu", d ? ", " : "",
				      (unsigned long long)shape[d]);
	if (o < len)
		snprintf(buf + o, len - o, "]");
}

/*
 * Read file `name` of checkpoint `dir` (manifest entry `fe`) into the group:
 * its params (optim 0) or its optimizer state (optim 1).
 */
static int load_file(struct eng_group *eg, const struct confine *cf, const char *dir,
		     const struct shd_ckpt_file *fe, int optim, char *err, size_t errlen)
{
	struct shd_group *g = eg->g;
	uint32_t ns = optim ? shd_group_optim_states(&g->optim) : 1;
	char path[LOAD_PATH], why[512], want[160], found[160];
	struct loader l = {
		.g = g, .b = eg->j->e->backend, .path = path, .err = err, .errlen = errlen
	};
	struct shd_safetensors_file f = { 0 };
	int32_t *need = NULL;
	uint8_t *buf = NULL;
	struct stat st;
	int fd, reading = 0, ret;

	if (join(path, sizeof(path), dir, fe->name)) {
		eng_fmt(err, errlen, "checkpoint path '%.200s...' is too long", dir);
		return -SHARDD_E_INVALID;
	}
	fd = open_regular(cf, path, &st, err, errlen);
	if (fd < 0)
		return fd;
	if ((uint64_t)st.st_size != fe->bytes) {
		eng_fmt(err, errlen,
			"%s is %lld bytes, the manifest records %llu: the file changed or is truncated",
			path, (long long)st.st_size, (unsigned long long)fe->bytes);
		ret = -SHARDD_E_MALFORMED;
		goto out;
	}
	ret = shd_safetensors_read(fd, path, &f, why, sizeof(why));
	if (ret) {
		eng_fmt(err, errlen, "%s", why);
		goto out;
	}
	need = malloc((f.ntensors ? f.ntensors : 1) * sizeof(*need));
	if (posix_memalign((void **)&buf, CKPT_DIO_ALIGN, CKPT_DIO_BYTES))
		buf = NULL;
	if (!need || !buf) {
		eng_fmt(err, errlen, "out of memory to read %s", path);
		ret = -SHARDD_E_NOMEM;
		goto out;
	}
	for (uint32_t i = 0; i < f.ntensors; i++)
		need[i] = -1;
	/* Every tensor the group needs, as its spec says. */
	for (uint32_t i = 0; i < g->hdr.nparams; i++) {
		const struct shardd_param_spec *s = &g->specs[i];

		for (uint32_t k = 0; k < ns; k++) {
			const struct shd_safetensors_tensor *t;
			char name[SHD_CKPT_NAME_MAX];
			uint32_t dtype = optim ? SHARDD_DTYPE_FP32 : s->dtype;

			if (optim)
				snprintf(name, sizeof(name), "%s.%s", s->name,
					 shd_group_optim_state_name(&g->optim, k));
			else
				snprintf(name, sizeof(name), "%s", s->name);
			t = shd_safetensors_find(&f, name);
			shape_text(dtype, s->ndim, s->shape, want, sizeof(want));
			if (!t) {
				eng_fmt(err, errlen, "tensor '%s' (%s) of group '%s' is not in %s",
					name, want, g->name, path);
				ret = -SHARDD_E_MISMATCH;
				goto out;
			}
			if (t->dtype != dtype || t->ndim != s->ndim ||
			    memcmp(t->shape, s->shape, s->ndim * sizeof(s->shape[0]))) {
				shape_text(t->dtype, t->ndim, t->shape, found, sizeof(found));
				eng_fmt(err, errlen,
					"tensor '%s' in %s: the group registers %s, the file holds %s",
					name, path, want, found);
				ret = -SHARDD_E_MISMATCH;
				goto out;
			}
			need[t - f.tensors] = (int32_t)(i * ns + k);
		}
	}
	/* The header for the CRC, then each tensor in file order. */
	ret = ckpt_dio_read_open(&l.rd, fd, fe->bytes, buf);
	if (ret) {
		eng_fmt(err, errlen, "cannot read %s: %s", path, strerror(-ret));
		goto out;
	}
	reading = 1;
	ret = ld_skip(&l, f.data_start);
	for (uint32_t ti = 0; !ret && ti < f.ntensors; ti++) {
		const struct shd_safetensors_tensor *t = &f.tensors[ti];
		const struct shd_layout_param *p;
		uint64_t esz;
		uint32_t k;

		if (need[ti] < 0) {
			ret = ld_skip(&l, t->end - t->begin);
			continue;
		}
		p = &g->layout.params[(uint32_t)need[ti] / ns];
		k = (uint32_t)need[ti] % ns;
		esz = optim ? sizeof(float) : shardd_dtype_size(p->dtype);
		for (uint64_t x = 0; p->numel && x < p->outer && !ret; x++)
			for (uint32_t s = 0; s < g->shard && !ret; s++)
				ret = ld_scatter(&l, optim ? g->optim_state[k] : g->shards, s,
						 p->shard_offset + x * p->rows * p->inner * esz,
						 shd_layout_rows_valid(p, s) * p->inner * esz);
	}
	if (!ret && l.crc != fe->crc32) {
		eng_fmt(err, errlen,
			"%s: CRC-32 %08x, the manifest records %08x: the file changed or is damaged",
			path, l.crc, fe->crc32);
		ret = -SHARDD_E_MALFORMED;
	}
out:
	if (reading)
		ckpt_dio_read_close(&l.rd);
	close(fd);
	free(buf);
	free(need);
	shd_safetensors_free(&f);
	return ret;
}

/*
 * A group's params file and its optimizer-state file, read at once: each
 * one's CRC-32 and copy into the shards take about as long as the disk
 * takes to read it, so one thread reading both in turn is held back by
 * its own CPU, two keep the disk busy (shd_pool_for: on the restore's
 * thread and an idle worker, else both in turn on the restore's).
 */
struct load_files {
	struct eng_group *eg;
	const struct confine *cf;
	const char *dir;
	const struct shd_ckpt_file *fe[2]; /* params, optimizer state (NULL: none) */
	int ret[2];
	char err[2][ENGINE_MSG_MAX];
};

static void load_files_run(void *arg, size_t begin, size_t end)
{
	struct load_files *lf = arg;

	for (size_t i = begin; i < end; i++)
		lf->ret[i] = load_file(lf->eg, lf->cf, lf->dir, lf->fe[i], (int)i, lf->err[i],
				       sizeof(lf->err[i]));
}

/* ------------------------------------------------------------------ */
/* Importing plain safetensors weights (no manifest)                   */
/* ------------------------------------------------------------------ */

/*
 * Param `i` of the group from tensor `t` of the safetensors file open at
 * `fd` (header `f`), converted from the file's dtype to the param's, into
 * every replica's shards.
 */
static int import_tensor(struct eng_group *eg, uint32_t i, int fd,
			 const struct shd_safetensors_file *f,
			 const struct shd_safetensors_tensor *t, const char *path, uint8_t *in,
			 uint8_t *out, char *err, size_t errlen)
{
	struct shd_group *g = eg->g;
	struct shd_backend_ctx *b = eg->j->e->backend;
	const struct shd_layout_param *p = &g->layout.params[i];
	uint64_t ies = shardd_dtype_size(t->dtype), oes = shardd_dtype_size(p->dtype);
	uint64_t chunk = LOAD_BOUNCE / 4,
		 src = f->data_start + t->begin; /* elements; 4: the largest dtype */

	for (uint64_t x = 0; p->numel && x < p->outer; x++)
		for (uint32_t s = 0; s < g->shard; s++) {
			uint64_t n = shd_layout_rows_valid(p, s) * p->inner;
			uint64_t dst = p->shard_offset + x * p->rows * p->inner * oes;

			for (uint64_t done = 0; done < n;) {
				uint64_t k = n - done < chunk ? n - done : chunk;
				ssize_t r = pread(fd, in, k * ies, (off_t)src);

				if (r != (ssize_t)(k * ies)) {
					eng_fmt(err, errlen,
						"%s: tensor '%s': read at byte %llu: %s", path,
						t->name, (unsigned long long)src,
						r < 0 ? strerror(errno) : "the file ends early");
					return r < 0 ? -errno : -SHARDD_E_MALFORMED;
				}
				shardd_k_cast(out, p->dtype, in, t->dtype, k);
				for (uint32_t u = 0; u < g->replicate; u++) {
					int ret = b->ops->write(b, &g->shards[u * g->shard + s],
								dst + done * oes, k * oes, out);

					if (ret) {
						eng_fmt(err, errlen,
							"%s: writing tensor '%s' into group '%s' failed in the %s "
							"backend (%d)",
							path, t->name, g->name, b->ops->name, ret);
						return ret;
					}
				}
				src += k * ies;
				done += k;
			}
		}
	return 0;
}

/* The file of param `name` from a Hugging Face index's weight_map, checked as a plain file name. */
static int index_file(json_t *map, const char *name, const char *ipath, char *out, size_t olen,
		      char *err, size_t errlen)
{
	json_t *v = json_object_get(map, name);
	const char *s = json_string_value(v);

	if (!s) {
		eng_fmt(err, errlen, "param '%s' is not in the weight_map of %s", name, ipath);
		return -SHARDD_E_MISMATCH;
	}
	if (!s[0] || strchr(s, '/') || s[0] == '.' || strlen(s) >= olen) {
		eng_fmt(err, errlen, "%s: weight_map['%s'] = \"%.64s\" is not a plain file name",
			ipath, name, s);
		return -SHARDD_E_MALFORMED;
	}
	memcpy(out, s, strlen(s) + 1);
	return 0;
}

/*
 * Plain safetensors weights into the group's params by name (a Hugging Face
 * model's): `src` a .safetensors file, or a directory with
 * model.safetensors.index.json or model.safetensors. Each tensor's shape
 * must be the param's; its dtype (F32, BF16, F16) is converted to the
 * param's. No optimizer state: it starts at zero, at step 0.
 */
static int import_weights(struct eng_group *eg, const struct confine *cf, const char *src,
			  int is_file, char *err, size_t errlen)
{
	struct shd_group *g = eg->g;
	char ipath[LOAD_PATH], path[LOAD_PATH],
		file[SHD_CKPT_FILE_NAME_MAX * 4] = "", open_file[sizeof(file)] = "";
	char want[160], found[160], why[512];
	struct shd_safetensors_file f = { 0 };
	json_t *index = NULL, *map = NULL;
	uint8_t *in = malloc(LOAD_BOUNCE), *out = malloc(LOAD_BOUNCE);
	struct stat st;
	int fd = -1, ret = 0;

	if (!in || !out) {
		eng_fmt(err, errlen, "out of memory to import %s", src);
		ret = -SHARDD_E_NOMEM;
		goto out;
	}
	if (!is_file && !join(ipath, sizeof(ipath), src, SHD_CKPT_INDEX) && !stat(ipath, &st)) {
		json_error_t jerr = { .text = "" };
		int ifd = open_regular(cf, ipath, &st, err, errlen);

		if (ifd < 0) {
			ret = ifd;
			goto out;
		}
		if ((uint64_t)st.st_size <= SHD_CKPT_MANIFEST_MAX)
			index = json_loadfd(ifd, JSON_REJECT_DUPLICATES, &jerr);
		close(ifd);
		if (!index || !json_is_object(map = json_object_get(index, "weight_map"))) {
			eng_fmt(err, errlen,
				"%s: not a Hugging Face index (a JSON object with a \"weight_map\" "
				"object of at most %u bytes)%s%s",
				ipath, SHD_CKPT_MANIFEST_MAX, index ? "" : ": ",
				index ? "" : jerr.text);
			ret = -SHARDD_E_MALFORMED;
			goto out;
		}
	}
	for (uint32_t i = 0; !ret && i < g->hdr.nparams; i++) {
		const struct shardd_param_spec *s = &g->specs[i];
		const struct shd_safetensors_tensor *t;

		if (is_file)
			ret = snprintf(path, sizeof(path), "%s", src) >= (int)sizeof(path)
				      ? -ENAMETOOLONG
				      : 0;
		else if (map)
			ret = index_file(map, s->name, ipath, file, sizeof(file), err, errlen)
				      ?: join(path, sizeof(path), src, file);
		else
			ret = join(path, sizeof(path), src, "model.safetensors");
		if (ret) {
			if (!err[0])
				eng_fmt(err, errlen, "import from '%.200s': path too long", src);
			break;
		}
		if (strcmp(path, open_file)) {
			shd_safetensors_free(&f);
			if (fd >= 0)
				close(fd);
			fd = open_regular(cf, path, &st, err, errlen);
			if (fd < 0) {
				ret = fd;
				break;
			}
			ret = shd_safetensors_read(fd, path, &f, why, sizeof(why));
			if (ret) {
				eng_fmt(err, errlen, "%s", why);
				break;
			}
			snprintf(open_file, sizeof(open_file), "%.*s", (int)sizeof(open_file) - 1,
				 path);
		}
		t = shd_safetensors_find(&f, s->name);
		shape_text(s->dtype, s->ndim, s->shape, want, sizeof(want));
		if (!t) {
			eng_fmt(err, errlen, "param '%s' (%s) of group '%s' is not in %s", s->name,
				want, g->name, path);
			ret = -SHARDD_E_MISMATCH;
			break;
		}
		if (t->ndim != s->ndim ||
		    memcmp(t->shape, s->shape, s->ndim * sizeof(s->shape[0]))) {
			shape_text(t->dtype, t->ndim, t->shape, found, sizeof(found));
			eng_fmt(err, errlen,
				"tensor '%s' in %s: the group registers %s, the file holds %s",
				s->name, path, want, found);
			ret = -SHARDD_E_MISMATCH;
			break;
		}
		ret = import_tensor(eg, i, fd, &f, t, path, in, out, err, errlen);
	}
	if (!ret)
		shd_log_info(
			"job '%s': group '%s' imported from %s (weights only: optimizer state from zero)",
			eg->j->name, g->name, src);
out:
	if (fd >= 0)
		close(fd);
	shd_safetensors_free(&f);
	json_decref(index);
	free(in);
	free(out);
	return ret;
}

/*
 * Where to restore from, into `dir`: 0 a checkpoint, 1 nothing (start from
 * zero), 2 a directory of plain weights, 3 a plain .safetensors file; or an
 * error with err. `src`: the restore path, or "" for the job's newest
 * checkpoint. A newer damaged checkpoint is skipped for the newest complete
 * one (in --state-dir also moved aside); a directory that is a checkpoint
 * but has no manifest is damaged, never plain weights.
 */
static int restore_dir(struct eng_group *eg, const struct confine *cf, const char *src, char *dir,
		       size_t dlen, char *err, size_t errlen)
{
	const struct shd_engine_config *cfg = &eg->j->e->cfg;
	char probe[LOAD_PATH], root[LOAD_PATH];
	uint32_t nsteps;
	struct stat st;
	int ret;

	if (!src[0]) {
		if (!cfg->state_dir) {
			eng_fmt(err, errlen,
				"the job's newest checkpoint needs shardd --state-dir; start shardd "
				"with it, or name a checkpoint directory");
			return -SHARDD_E_INVALID;
		}
		ret = join(root, sizeof(root), cfg->state_dir, eg->j->name);
		if (!ret)
			ret = newest_checkpoint(eg, cf, root, 1, dir, dlen, &nsteps, err, errlen);
		if (ret == -ENOENT && !nsteps) {
			shd_log_info(
				"job '%s': group '%s': no checkpoint in %s; it starts from zero",
				eg->j->name, eg->g->name, root);
			return 1;
		}
		if (ret == -ENOENT) {
			char why[ENGINE_MSG_MAX];

			eng_fmt(why, sizeof(why), "%s", err);
			eng_fmt(err, errlen,
				"every checkpoint in %s is damaged (%u, each moved aside to "
				"step-N.damaged; the newest: %s); register again to start from zero, or restore a "
				"copy by its path",
				root, nsteps, why);
			return -SHARDD_E_MALFORMED;
		}
		if (ret && !err[0])
			eng_fmt(err, errlen, "cannot list %s: %s", root, strerror(-ret));
		return ret;
	}
	if (!join(probe, sizeof(probe), src, SHD_CKPT_MANIFEST) && !stat(probe, &st) &&
	    strlen(src) < dlen) {
		memcpy(dir, src, strlen(src) + 1);
		return 0;
	}
	ret = newest_checkpoint(eg, cf, src, 0, dir, dlen, &nsteps, err, errlen);
	if (!ret)
		return 0;
	if (ret == -ENOENT && nsteps) {
		char why[ENGINE_MSG_MAX];

		eng_fmt(why, sizeof(why), "%s", err);
		eng_fmt(err, errlen,
			"'%s' holds %u step-N checkpoints and every one is damaged (the newest: %s); "
			"restore another copy by its path",
			src, nsteps, why);
		return -SHARDD_E_MALFORMED;
	}
	if (ret == -ENOMEM)
		return -SHARDD_E_NOMEM;
	err[0] = '\0';
	if (!stat(src, &st) && S_ISDIR(st.st_mode) && looks_like_checkpoint(cfg, src)) {
		eng_fmt(err, errlen,
			"'%s' is a damaged checkpoint: it has no %s (a copy cut short, or the manifest "
			"deleted), so its optimizer state and step cannot be trusted; restore an older checkpoint "
			"(restore its parent folder for the newest complete one), or copy its model*.safetensors "
			"into a folder of their own to import the weights alone",
			src, SHD_CKPT_MANIFEST);
		return -SHARDD_E_MALFORMED;
	}
	/* No checkpoint: plain weights to import, a .safetensors file or a model's directory. */
	if (strlen(src) < dlen && !stat(src, &st) &&
	    (S_ISREG(st.st_mode) ||
	     (!join(probe, sizeof(probe), src, SHD_CKPT_INDEX) && !stat(probe, &st)) ||
	     (!join(probe, sizeof(probe), src, "model.safetensors") && !stat(probe, &st)))) {
		struct stat self;

		memcpy(dir, src, strlen(src) + 1);
		return !stat(src, &self) && S_ISREG(self.st_mode) ? 3 : 2;
	}
	eng_fmt(err, errlen,
		"'%s' holds no %s, no step-N checkpoint, no %s and no model.safetensors (%s)", src,
		SHD_CKPT_MANIFEST, SHD_CKPT_INDEX, strerror(-ret));
	return ret;
}

/*
 * A client of another uid than shardd's (let in by --allow-gid) restores
 * only what it could be given anyway: its path, resolved, must lie under
 * --state-dir or an --import-dir, or shardd would read, as its own uid,
 * files the client cannot read and hand them over in the group's buffers.
 * The resolved path into `out` and the root into `cf` (its fd open); or
 * -SHARDD_E_PERM with err. A path that does not resolve is refused the same
 * way, without saying why: that would tell the client which files exist
 * where it may not look. The probes that then tell a checkpoint from plain
 * weights (stat, the step-N listing) may follow a symlink swapped in after
 * this check; they read no file's content, and every file read is opened by
 * open_beneath.
 */
static int confine_path(struct eng_group *eg, struct confine *cf, char *out, size_t olen, char *err,
			size_t errlen)
{
	const struct shd_engine_config *c = &eg->j->e->cfg;
	char *real = realpath(eg->restore, NULL),
	     *state = c->state_dir ? realpath(c->state_dir, NULL) : NULL;
	const char *root = NULL;
	int ret = 0;

	cf->uid = eg->restore_uid;
	if (real && state && path_under(state, real))
		root = state;
	for (unsigned i = 0; real && !root && i < c->nimport_dirs; i++)
		if (path_under(c->import_dirs[i], real))
			root = c->import_dirs[i];
	if (!root) {
		eng_fmt(err, errlen,
			"policy.restore '%s' of client uid %u %s: a client of another uid than "
			"shardd's (%u) restores only from under --state-dir%s%s or an --import-dir (%u given); "
			"let it in with --import-dir DIR, or restore as shardd's uid",
			eg->restore, (unsigned)cf->uid,
			real ? "resolves outside them" : "does not resolve to a path",
			(unsigned)c->uid, state ? " " : " (not set)", state ? state : "",
			c->nimport_dirs);
		ret = -SHARDD_E_PERM;
	} else if (strlen(real) >= olen || strlen(root) >= sizeof(cf->root)) {
		eng_fmt(err, errlen, "policy.restore '%.200s...' is too long", eg->restore);
		ret = -SHARDD_E_INVALID;
	} else if ((cf->fd = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC)) < 0) {
		ret = -errno;
		eng_fmt(err, errlen, "cannot open %s: %s", root, strerror(-ret));
	} else {
		memcpy(out, real, strlen(real) + 1);
		memcpy(cf->root, root, strlen(root) + 1);
	}
	free(real);
	free(state);
	return ret;
}

/*
 * Whether each rank shard takes its own saved update count
 * (cg->shard_optim_steps, where a rank skipped a step alone): at the saved
 * shard count with every param sharded on the saved dim, each rank shard
 * holds the rows it saved. At another layout a rank shard's rows come from
 * several saved ones with different counts, and one count per rank shard
 * cannot say that: each takes the highest (optim_steps), which changes
 * only AdamW's bias correction of the rows that skipped, and the log says so.
 */
static int restore_counts(const struct eng_group *eg, const struct shd_ckpt_manifest *m,
			  const struct shd_ckpt_group *cg, const char *dir)
{
	const struct shd_group *g = eg->g;
	int same = m->shard == g->shard;

	if (!cg->shard_optim_steps)
		return 0;
	for (uint32_t i = 0; same && i < g->hdr.nparams; i++)
		for (uint32_t k = 0; k < cg->hdr.nparams; k++)
			if (!strcmp(g->specs[i].name, cg->specs[k].name))
				same = g->specs[i].shard_dim == cg->specs[k].shard_dim;
	if (!same)
		shd_log_warn(
			"job '%s': group '%s': in %s its %u rank shards applied different numbers of updates "
			"(a rank skipped a step alone); at shard %u each rank shard resumes at %llu updates, "
			"the most; restore at shard %u with the saved shard dims to keep each one's count",
			eg->j->name, g->name, dir, m->shard, g->shard,
			(unsigned long long)cg->optim_steps, m->shard);
	return same;
}

/*
 * What to do about a checkpoint that failed as it was read (restore_dir's
 * own refusals say it themselves): appended to the message.
 */
static const char *restore_advice(int res)
{
	switch (restore_reason(res)) {
	case SHD_RESTORE_DAMAGED:
	case SHD_RESTORE_INVALID:
		return "; move it aside, or restore an older checkpoint by its path, and register again";
	case SHD_RESTORE_MISSING:
		return "; a file went missing after the checkpoint was checked: restore another one";
	case SHD_RESTORE_MISMATCH:
		return "; register the group as it was saved (its names, dtypes and shapes), or "
		       "restore a checkpoint of this group";
	case SHD_RESTORE_MEMORY:
		return "; free memory on the node, then register again";
	default:
		return "; check the file and its disk (permissions, the kernel log), then register "
		       "again";
	}
}

static void restore_run(struct eng_task *t)
{
	struct eng_group *eg = t->eg;
	struct shd_group *g = eg->g;
	struct shd_ckpt_manifest m = { 0 };
	const struct shd_ckpt_group *cg = NULL;
	char dir[LOAD_PATH], src[LOAD_PATH], *msg = t->msg;
	size_t len = sizeof(t->msg);
	struct confine cf = { .fd = -1 };
	uint32_t ns = shd_group_optim_states(&g->optim);
	int found, ret;

	msg[0] = '\0';
	if (!eg->j->e->backend->ops->write) {
		eng_fmt(msg, len,
			"shardd: register group '%s': the %s backend cannot restore a checkpoint",
			g->name, eg->j->e->backend->ops->name);
		t->res = -ENOTSUP;
		return;
	}
	if (eg->restore_confined && eg->restore[0]) {
		ret = confine_path(eg, &cf, src, sizeof(src), msg, len);
		if (ret) {
			char full[ENGINE_MSG_MAX];

			eng_fmt(full, sizeof(full), "shardd: register group '%s': %s", g->name,
				msg);
			eng_fmt(msg, len, "%s", full);
			t->res = ret;
			return;
		}
	} else {
		snprintf(src, sizeof(src), "%s", eg->restore);
	}
	ret = restore_dir(eg, &cf, src, dir, sizeof(dir), msg, len);
	found = !ret;
	if (ret == 1) {
		t->res = 0;
		goto out;
	}
	if (ret == 2 || ret == 3) {
		ret = import_weights(eg, &cf, dir, ret == 3, msg, len);
		if (ret) {
			char full[ENGINE_MSG_MAX];

			eng_fmt(full, sizeof(full), "shardd: register group '%s': import: %s",
				g->name, msg);
			eng_fmt(msg, len, "%s", full);
		}
		t->res = ret < 0 ? ret : 0;
		goto out;
	}
	if (!ret)
		ret = read_manifest(&cf, dir, &m, msg, len);
	for (uint32_t i = 0; !ret && i < m.ngroups; i++)
		if (!strcmp(m.groups[i].hdr.name, g->name))
			cg = &m.groups[i];
	if (!ret && !cg) {
		size_t o = (size_t)snprintf(
			msg, len, "checkpoint %s has no group '%s'; its groups:", dir, g->name);

		for (uint32_t i = 0; i < m.ngroups && o < len; i++)
			o += (size_t)snprintf(msg + o, len - o, "%s '%s'", i ? "," : "",
					      m.groups[i].hdr.name);
		ret = -SHARDD_E_MISMATCH;
	}
	if (!ret && ns && !cg->optim_file[0]) {
		eng_fmt(msg, len,
			"checkpoint %s holds no optimizer state for group '%s', which registers %s",
			dir, g->name,
			g->optim.kind == SHARDD_OPTIM_SGD ? "SGD with momentum" : "AdamW");
		ret = -SHARDD_E_MISMATCH;
	}
	if (!ret) {
		struct load_files lf = { .eg = eg, .cf = &cf, .dir = dir };

		lf.fe[0] = shd_ckpt_manifest_file(&m, cg->file);
		lf.fe[1] = ns ? shd_ckpt_manifest_file(&m, cg->optim_file) : NULL;
		shd_pool_for(eg->j->e->pool, ns ? 2 : 1, 1, load_files_run, &lf);
		ret = lf.ret[0] ? lf.ret[0] : lf.ret[1];
		if (ret)
			eng_fmt(msg, len, "%s", lf.err[lf.ret[0] ? 0 : 1]);
	}
	if (!ret) {
		int own = restore_counts(eg, &m, cg, dir);

		for (uint32_t r = 0; r < g->world; r++) {
			g->optim_steps[r] =
				own ? cg->shard_optim_steps[r % g->shard] : cg->optim_steps;
			__atomic_store_n(&g->last_step[r], cg->last_step, __ATOMIC_RELAXED);
		}
		shd_log_info(
			"job '%s': group '%s' restored from %s (saved at mesh %ux%u, step %llu; now %ux%u)",
			eg->j->name, g->name, dir, m.replicate, m.shard,
			(unsigned long long)cg->last_step, g->replicate, g->shard);
	} else {
		char full[ENGINE_MSG_MAX], to[LOAD_PATH] = "", todo[LOAD_PATH + 160] = "";

		/* Damage only reading the tensors shows (a CRC-32): the job's own checkpoint goes aside too. */
		if (!src[0] && ret == -SHARDD_E_MALFORMED && !move_aside(dir, to, sizeof(to)) &&
		    to[0]) {
			shd_log_warn(
				"job '%s': group '%s': checkpoint %s is damaged: %s; moved it aside to %s",
				eg->j->name, g->name, dir, msg, to);
			snprintf(
				todo, sizeof(todo),
				"; moved it aside to %s: register again (restore \"\") to resume from "
				"the newest complete one before it",
				to);
		} else if (found) {
			snprintf(todo, sizeof(todo), "%s", restore_advice(ret));
		}
		eng_fmt(full, sizeof(full), "shardd: register group '%s': restore: %s%s", g->name,
			msg, todo);
		eng_fmt(msg, len, "%s", full);
	}
	shd_ckpt_manifest_free(&m);
	t->res = ret < 0 ? ret : 0;
out:
	if (cf.fd >= 0)
		close(cf.fd);
}

void eng_restore_record(const struct eng_task *t)
{
	const struct eng_group *eg = t->eg;
	struct shd_engine_ckpt_status *l = &eg->j->ckpt_last;
	struct shd_engine_restore_counts *c = &eg->j->e->restores;

	if (eg->restore_skipped) {
		c->fallbacks[eg->restore_skip_reason] += eg->restore_skipped;
		l->restore_fallbacks += eg->restore_skipped;
		snprintf(l->restore_fallback_group, sizeof(l->restore_fallback_group), "%s",
			 eg->g->name);
		l->restore_fallback_reason = eg->restore_skip_reason;
		snprintf(l->restore_fallback_msg, sizeof(l->restore_fallback_msg), "%s",
			 eg->restore_skip_msg);
	}
	if (!t->res) {
		c->restored++;
		l->restored++;
		return;
	}
	c->failed[restore_reason(t->res)]++;
	l->restore_failed++;
	snprintf(l->restore_failed_group, sizeof(l->restore_failed_group), "%s", eg->g->name);
	l->restore_failed_reason = restore_reason(t->res);
	snprintf(l->restore_failed_msg, sizeof(l->restore_failed_msg), "%s", t->msg);
}

void eng_restore_exec(struct eng_task *t)
{
	restore_run(t);
	/* The ranks get it in their registration's reply; the operator reads it here. */
	if (t->res)
		shd_log_warn("job '%s': %s", t->eg->j->name, t->msg);
}
