/* SPDX-License-Identifier: MIT */
/*
 * Writing a checkpoint (engine.h, docs/CHECKPOINTS.md) from the daemon's
 * own buffers, without routing bytes through trainers.
 *
 *   start (loop): checks, manifest, a temporary directory beside the target
 *     --> one TASK_SAVE per group, in the group's queue, on a niced thread
 *         of its own (ckpt_thread): each tensor of its params file and
 *         optimizer-state file assembled from replica 0's shards row range
 *         by row range, into a snapshot in memory when --max-memory leaves
 *         room for it (each file's image, the header first, CRC-32 as it
 *         fills; its whole chunks go to the disk as they fill, then a
 *         TASK_SAVE_WRITE per group, off the group's queue and on the same
 *         kind of thread, writes the rest straight from the image while
 *         its ops go on), else into the files in place; fsync
 *     --> all delivered (loop): one TASK_SAVE_FINAL (pool): manifest.json
 *         and the Hugging Face index, fsync of the files and the directory,
 *         rename to the target, fsync of its parent, --keep retention
 *     --> delivered (loop): done()
 *
 * A group's save task sits in its group's queue like any op: ops the ranks
 * submit on the group later wait for it (for the snapshot, or for the
 * whole write without memory for one), so the save reads a state no op
 * writes. A crash at any moment leaves at most a temporary directory
 * (".tmp-*", removed by the next checkpoint into the same folder) and
 * never a half-written checkpoint under the target's name.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_files.h"
#include "ckpt_crc.h"
#include "safetensors.h"
#include "ckpt_int.h"
#include "clock.h"
#include "engine_int.h"
#include "log.h"

/*
 * The nice value of a checkpoint's own threads (a group's snapshot, then
 * its write): below the ops' (0), so that a core an op wants is mostly the
 * op's, while an idle one still takes the save at full speed. Not 19:
 * beside training that kept both cores of the test host busy, a save at
 * nice 19 got about 1/70 of a core and wrote 30 MB/s; at 10 it keeps about
 * a tenth (--checkpoint-rate bounds the disk's share instead).
 */
#define CKPT_THREAD_NICE 10

static int ckpt_spawn(struct eng_task *t);

static const struct eng_task_ops ckpt_hooks = { .exec = eng_ckpt_exec,
						.delivered = eng_ckpt_delivered,
						.spawn = ckpt_spawn };

/* A task of the checkpoint (SAVE, SAVE_FINAL, SAVE_WRITE) that task.c runs through ckpt_hooks, or NULL. */
static struct eng_task *ckpt_task_new(struct eng_group *eg, uint32_t kind)
{
	struct eng_task *t = eng_task_new(eg, kind, 1);

	if (t)
		t->hooks = &ckpt_hooks;
	return t;
}

/* ------------------------------------------------------------------ */
/* Pool thread: files                                                  */
/* ------------------------------------------------------------------ */

/* What an operator does about write error `e` (an errno), or "". */
static const char *write_advice(int e)
{
	if (e == ENOSPC || e == EDQUOT)
		return ": free space there or lower shardd --keep, then checkpoint again; earlier checkpoints are intact";
	if (e == EIO)
		return ": the disk reported an I/O error; check it (dmesg) before the next checkpoint";
	return "";
}

/*
 * The message of a failed write of `file` (group `group`) through `f`
 * with `ret`: the errno text, the file, the byte offset and what to do
 * first, as a rank's error text holds SHARDD_RING_MSG_SIZE bytes; then
 * the checkpoint's directory, for the log and `shardctl checkpoints`.
 */
static void write_error(const struct eng_ckpt *c, const char *file, const char *group,
			const struct dio_file *f, int ret, char *err, size_t errlen)
{
	int e = ret < 0 && ret > -SHARDD_E_BASE ? -ret : 0;
	char at[48] = "";

	if (f->reserve_failed) {
		eng_fmt(err, errlen,
			"%s allocating the %llu bytes of %s of group '%s'%s (checkpoint %s, in %s)",
			strerror(e ? e : EIO), (unsigned long long)f->reserve_failed, file, group,
			write_advice(e), c->dir, c->tmp);
		return;
	}
	if (f->failed)
		snprintf(at, sizeof(at), " at byte %llu", (unsigned long long)f->failed_at);
	eng_fmt(err, errlen, "%s writing %s of group '%s'%s%s (checkpoint %s, in %s)",
		e ? strerror(e) : "the backend's read of the group's buffers failed", file, group,
		at, write_advice(e), c->dir, c->tmp);
}

struct save_out {
	struct dio_file *f;
	uint64_t off;
	uint32_t crc;
	struct shd_backend_ctx *b;
	uint64_t *progress; /* the checkpoint's bytes written */
	uint8_t *stage;     /* snapshot mode: the file's image, written from there (f->bufs none) */
};

/*
 * A snapshot is filled a piece at a time: mapped (the kernel zeroes its
 * pages), copied from the shards and checksummed while it is still in the
 * cache, so the write reads the image only for the disk's DMA.
 */
#define SNAP_PIECE (1u << 20)

/* Append `bytes` at `offset` of `src` to the file, read into its buffer (or to the snapshot). */
static int save_range(struct save_out *o, const struct shd_buf *src, uint64_t offset,
		      uint64_t bytes)
{
	/* Each whole chunk of the image goes to the disk while the rest is assembled. */
	while (o->stage && bytes) {
		uint64_t k = bytes < SNAP_PIECE ? bytes : SNAP_PIECE;
		uint8_t *at = o->stage + o->off;
		int ret;

		ckpt_image_populate(o->stage, o->off, k);
		ret = o->b->ops->read(o->b, src, offset, k, at);
		if (ret)
			return ret < 0 ? ret : -EIO;
		o->crc = ckpt_crc32(o->crc, at, k);
		o->off += k;
		offset += k;
		bytes -= k;
		ret = ckpt_dio_push(o->f, o->stage, o->off);
		if (ret)
			return ret;
	}
	if (o->stage)
		return 0;
	while (bytes) {
		uint8_t *at;
		size_t k;
		int ret = ckpt_dio_room(o->f, &at, &k);

		if (ret)
			return ret;
		k = bytes < k ? bytes : k;
		ret = o->b->ops->read(o->b, src, offset, k, at);
		if (ret)
			return ret < 0 ? ret : -EIO;
		o->f->fill += (uint32_t)k;
		o->crc = ckpt_crc32(o->crc, at, k);
		__atomic_add_fetch(o->progress, k, __ATOMIC_RELAXED);
		o->off += k;
		offset += k;
		bytes -= k;
	}
	return 0;
}

/*
 * Write group `gi`'s params file (optim 0) or optimizer-state file: the
 * header, then each tensor in file order. A full tensor is, for each
 * index before its shard dim, the valid rows of shard 0, 1, ..., S-1 in
 * turn: each rank's shard is a row range of the tensor.
 */
static int save_file(struct eng_ckpt *c, uint32_t gi, int optim, uint8_t *bounce, char *err,
		     size_t errlen)
{
	uint8_t **stage = c->staged ? &c->stage[2 * gi + optim] : NULL;
	const struct shd_group *g = c->egs[gi]->g;
	struct shd_ckpt_file *fe = &c->m.files[c->file_of[2 * gi + optim]];
	uint32_t ns = optim ? shd_group_optim_states(&g->optim) : 1, n;
	const char *states[SHD_OPTIM_STATES];
	struct shd_safetensors_tensor *t = NULL;
	struct dio_file own = { .fd = -1, .dfd = -1 };
	struct save_out o = { .f = &own, .b = c->j->e->backend, .progress = &c->bytes };
	uint8_t *hdr = NULL;
	size_t hlen;
	uint64_t dsize;
	char why[256];
	int ret;

	for (uint32_t k = 0; optim && k < ns; k++)
		states[k] = shd_group_optim_state_name(&g->optim, k);
	ret = shd_ckpt_group_tensors(&c->m.groups[gi], optim, ns, states, &t, &n);
	if (ret)
		goto out;
	ret = shd_safetensors_build(t, n, &hdr, &hlen, &dsize, why, sizeof(why));
	if (ret) {
		eng_fmt(err, errlen, "checkpoint %s: group '%s': %s", c->dir, g->name, why);
		goto out;
	}
	/*
	 * Snapshot: the file's image into memory now, written as it fills and
	 * finished off the group's queue (write_staged); in place without memory.
	 */
	if (stage && (*stage = ckpt_image_alloc(hlen + dsize))) {
		o.f = &c->sfiles[2 * gi + optim];
		c->stage_len[2 * gi + optim] = hlen + dsize;
		/* Its file now, to write as the image fills; short of descriptors, once it is whole. */
		if (ckpt_dio_open(o.f, c->dirfd, fe->name, NULL))
			ckpt_dio_close(o.f);
		else if ((ret = ckpt_dio_reserve(o.f, hlen + dsize)))
			goto out;
		o.f->pace = &c->pace;
		ckpt_image_populate(*stage, 0, hlen);
		memcpy(*stage, hdr, hlen);
		o.stage = *stage;
		o.crc = ckpt_crc32(o.crc, hdr, hlen);
	} else {
		ret = ckpt_dio_open(o.f, c->dirfd, fe->name, bounce);
		if (!ret)
			ret = ckpt_dio_reserve(o.f, hlen + dsize);
		if (!ret)
			ret = ckpt_dio_append(o.f, hdr, hlen);
		if (ret)
			goto out;
		o.crc = ckpt_crc32(o.crc, hdr, hlen);
		__atomic_add_fetch(&c->bytes, hlen, __ATOMIC_RELAXED);
	}
	o.off = hlen;
	for (uint32_t i = 0, ti = 0; i < g->layout.nparams; i++) {
		const struct shd_layout_param *p = &g->layout.params[i];
		uint64_t esz = optim ? sizeof(float) : shardd_dtype_size(p->dtype);

		for (uint32_t k = 0; k < ns; k++, ti++) {
			for (uint64_t x = 0; p->numel && x < p->outer && !ret; x++)
				for (uint32_t s = 0; s < g->shard && !ret; s++)
					ret = save_range(
						&o, optim ? &g->optim_state[k][s] : &g->shards[s],
						p->shard_offset + x * p->rows * p->inner * esz,
						shd_layout_rows_valid(p, s) * p->inner * esz);
			if (ret)
				goto out;
			if (o.off != hlen + t[ti].end) {
				eng_fmt(err, errlen,
					"checkpoint %s: tensor '%s' took %llu bytes, its header says %llu",
					c->dir, t[ti].name,
					(unsigned long long)(o.off - hlen - t[ti].begin),
					(unsigned long long)(t[ti].end - t[ti].begin));
				ret = -EIO;
				goto out;
			}
		}
	}
	if (!o.stage)
		ret = ckpt_dio_finish(o.f);
	fe->bytes = o.off;
	fe->crc32 = o.crc;
out:
	if (ret && !err[0])
		write_error(c, fe->name, g->name, o.f, ret, err, errlen);
	ckpt_dio_close(&own);
	free(hdr);
	free(t);
	return ret;
}

static int save_group(struct eng_ckpt *c, uint32_t gi, char *err, size_t errlen)
{
	const struct shd_group *g = c->egs[gi]->g;
	struct shd_backend_ctx *b = c->j->e->backend;
	uint8_t *bounce;
	int ret = 0;

	/* Device work queued on the buffers (a step's) finishes before they are read. */
	if (b->ops->sync) {
		const struct shd_buf *on[(1 + SHD_OPTIM_STATES) * SHARDD_MAX_WORLD];
		uint32_t n = 0;
		char why[256] = "";

		for (uint32_t s = 0; s < g->shard; s++) {
			on[n++] = &g->shards[s];
			for (uint32_t k = 0; k < shd_group_optim_states(&g->optim); k++)
				on[n++] = &g->optim_state[k][s];
		}
		ret = b->ops->sync(b, on, n, why, sizeof(why));
		if (ret) {
			eng_fmt(err, errlen, "checkpoint %s: group '%s': the %s backend failed: %s",
				c->dir, g->name, b->ops->name, why);
			return ret;
		}
	}
	if (posix_memalign((void **)&bounce, CKPT_DIO_ALIGN, CKPT_DIO_BYTES))
		bounce = NULL;
	if (!bounce) {
		eng_fmt(err, errlen, "checkpoint %s: out of memory for the %u-byte write buffers",
			c->dir, CKPT_DIO_BYTES);
		return -SHARDD_E_NOMEM;
	}
	ret = save_file(c, gi, 0, bounce, err, errlen);
	if (!ret && c->file_of[2 * gi + 1] >= 0)
		ret = save_file(c, gi, 1, bounce, err, errlen);
	free(bounce);
	return ret;
}

/*
 * Write the rest of group `gi`'s snapshot files (SAVE_WRITE, off its
 * group's queue) from their images: CRC-32 as written, fsync; the images
 * are freed. Reads nothing of the group.
 */
static int write_staged(struct eng_ckpt *c, uint32_t gi, char *err, size_t errlen)
{
	const struct shd_ckpt_group *cg = &c->m.groups[gi];
	int ret = 0;

	for (int optim = 0; optim < 2; optim++) {
		uint32_t i = 2 * gi + (uint32_t)optim;
		struct shd_ckpt_file *fe;

		if (!c->stage[i])
			continue;
		fe = &c->m.files[c->file_of[i]];
		if (!ret) {
			if (c->sfiles[i].fd < 0) {
				ret = ckpt_dio_open(&c->sfiles[i], c->dirfd, fe->name, NULL);
				if (!ret)
					ret = ckpt_dio_reserve(&c->sfiles[i], c->stage_len[i]);
				c->sfiles[i].pace = &c->pace;
			}
			if (!ret)
				ret = ckpt_dio_write_image(&c->sfiles[i], c->stage[i],
							   c->stage_len[i], &c->bytes);
			if (ret)
				write_error(c, fe->name, cg->hdr.name, &c->sfiles[i], ret, err,
					    errlen);
		}
		ckpt_dio_close(&c->sfiles[i]);
		ckpt_image_free(c->stage[i], c->stage_len[i]);
		c->stage[i] = NULL;
	}
	return ret;
}

/* The manifest, the index, then the directory made durable and renamed into place. */
static int save_final(struct eng_ckpt *c, char *err, size_t errlen)
{
	char *json = NULL, why[256] = "";
	const char *what = SHD_CKPT_MANIFEST;
	int ret, pfd;

	if (c->res) {
		/* A group's save failed: nothing of this checkpoint stays, and its message is the checkpoint's. */
		ckpt_remove_dir(AT_FDCWD, c->tmp);
		eng_fmt(err, errlen, "%s", c->msg);
		return c->res;
	}
	ret = shd_ckpt_manifest_dump(&c->m, &json, why, sizeof(why));
	if (!ret)
		ret = ckpt_write_text(c->dirfd, SHD_CKPT_MANIFEST, json);
	free(json);
	json = NULL;
	if (!ret && c->m.ngroups > 1) {
		uint64_t total = 0;

		what = SHD_CKPT_INDEX;
		for (uint32_t i = 0; i < c->m.ngroups; i++) {
			const struct shd_ckpt_group *g = &c->m.groups[i];

			for (uint32_t p = 0; p < g->hdr.nparams; p++) {
				uint64_t n = 1;

				for (uint32_t d = 0; d < g->specs[p].ndim; d++)
					n *= g->specs[p].shape[d];
				total += n * shardd_dtype_size(g->specs[p].dtype);
			}
		}
		ret = shd_ckpt_index_dump(&c->m, total, &json, why, sizeof(why));
		if (!ret)
			ret = ckpt_write_text(c->dirfd, SHD_CKPT_INDEX, json);
		free(json);
	}
	if (!ret) {
		what = "the directory";
		if (fsync(c->dirfd))
			ret = -errno;
	}
	if (!ret) {
		what = "the rename into place";
		if (rename(c->tmp, c->dir))
			ret = -errno;
	}
	if (!ret) {
		what = "the parent directory";
		pfd = open(c->parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		if (pfd < 0 || fsync(pfd))
			ret = -errno;
		if (pfd >= 0)
			close(pfd);
	}
	if (ret) {
		int e = ret < 0 && ret > -SHARDD_E_BASE ? -ret : EIO;

		eng_fmt(err, errlen, "checkpoint %s: writing %s: %s%s", c->dir, what,
			why[0] ? why : strerror(e), why[0] ? "" : write_advice(e));
		ckpt_remove_dir(AT_FDCWD, c->tmp);
		return ret;
	}
	if (c->keep_root)
		ckpt_retention(c->keep_root, c->keep);
	return 0;
}

void eng_ckpt_exec(struct eng_task *t)
{
	t->msg[0] = '\0';
	if (t->kind == TASK_SAVE)
		t->res = save_group(t->ckpt, t->gindex, t->msg, sizeof(t->msg));
	else if (t->kind == TASK_SAVE_WRITE)
		t->res = write_staged(t->ckpt, t->gindex, t->msg, sizeof(t->msg));
	else
		t->res = save_final(t->ckpt, t->msg, sizeof(t->msg));
}

/* ------------------------------------------------------------------ */
/* Loop thread                                                         */
/* ------------------------------------------------------------------ */

static void ckpt_free(struct eng_ckpt *c)
{
	/* The snapshot's memory leaves the limits (--max-memory, --max-job-memory). */
	c->j->mem_committed -= c->staged;
	c->j->e->mem_committed -= c->staged;
	/* A snapshot not written (the job ended, a group failed): its writes in flight end first. */
	for (uint32_t i = 0; c->stage && i < 2 * c->m.ngroups; i++)
		if (c->stage[i]) {
			ckpt_dio_close(&c->sfiles[i]);
			ckpt_image_free(c->stage[i], c->stage_len[i]);
		}
	free(c->stage);
	free(c->stage_len);
	free(c->sfiles);
	free(c->wtasks);
	free(c->threads);
	free(c->thread_on);
	if (c->dirfd >= 0)
		close(c->dirfd);
	shd_ckpt_manifest_free(&c->m);
	free(c->egs);
	free(c->file_of);
	free(c->dir);
	free(c->tmp);
	free(c->parent);
	free(c->keep_root);
	free(c);
}

static void ckpt_finish(struct eng_ckpt *c, int res, const char *msg)
{
	double secs = (double)(shd_now_ns() - c->start_ns) / 1e9;
	uint64_t bytes = __atomic_load_n(&c->bytes, __ATOMIC_RELAXED);

	struct shd_engine_ckpt_status *l = &c->j->ckpt_last;

	c->j->ckpt = NULL;
	l->last_id = c->id;
	l->last_res = res;
	snprintf(l->last_msg, sizeof(l->last_msg), "%s", res ? msg : "");
	snprintf(l->last_dir, sizeof(l->last_dir), "%s", c->dir);
	l->last_step = c->m.step;
	l->last_bytes = bytes;
	l->last_s = secs;
	l->last_staged = c->staged != 0;
	if (!res)
		shd_log_info(
			"job '%s': checkpoint of step %llu written to %s: %llu bytes in %.3f s (%.2f GB/s; %s)",
			c->j->name, (unsigned long long)c->m.step, c->dir,
			(unsigned long long)bytes, secs,
			secs > 0 ? (double)bytes / secs / 1e9 : 0.0,
			c->staged
				? "snapshot in memory, the groups' ops went on while it was written"
				: "written in place, the groups' ops waited");
	else
		shd_log_warn("job '%s': %s", c->j->name, msg);
	c->done(c->ctx, res, res ? msg : NULL, c->dir, bytes, secs);
	ckpt_free(c);
}

/*
 * A SAVE's or SAVE_WRITE's thread. On a pool thread, a save took the
 * groups' ops a worker for its whole snapshot or write (on a 2-core host,
 * half of every op's kernels), and a snapshot split across the pool put
 * its pieces ahead of their queued ops: the ops of the other groups, which
 * training goes on with, slowed while a save ran (docs/BENCHMARKS.md).
 * Here, niced (CKPT_THREAD_NICE), a core that an op wants is mostly the
 * op's; a core that none wants (training waits for this group, or computes
 * elsewhere) runs the save at full speed.
 */
static void *ckpt_thread(void *arg)
{
	struct eng_task *t = arg;

	/* Best effort: at the same priority it still saves, only the ops may wait for it. */
	if (setpriority(PRIO_PROCESS, (id_t)gettid(), CKPT_THREAD_NICE))
		shd_log_debug("checkpoint thread: setpriority: %s", strerror(errno));
	/* task_run: saves, then hands the task to the loop, which joins this thread. */
	t->pt.fn(&t->pt);
	return NULL;
}

/* Start SAVE or SAVE_WRITE `t` on a thread of its own (ckpt_thread). 0, or -1: none started. */
static int thread_spawn(struct eng_ckpt *c, struct eng_task *t)
{
	if (pthread_create(&c->threads[t->gindex], NULL, ckpt_thread, t))
		return -1;
	c->thread_on[t->gindex] = 1;
	return 0;
}

/* Loop thread (task.c's group_kick): a SAVE on a thread of its own; else the pool runs the task. */
static int ckpt_spawn(struct eng_task *t)
{
	return t->kind == TASK_SAVE ? thread_spawn(t->ckpt, t) : -1;
}

void eng_ckpt_delivered(struct eng_task *t)
{
	struct eng_ckpt *c = t->ckpt;
	struct eng_task *f;

	if (t->kind == TASK_SAVE_FINAL) {
		ckpt_finish(c, t->res, t->msg);
		return;
	}
	if (t->kind == TASK_SAVE_WRITE)
		c->wtasks[t->gindex] = NULL;
	/* Its thread handed the task over as its last act: the join waits for no disk. */
	if (t->kind != TASK_SAVE_FINAL && c->thread_on[t->gindex]) {
		pthread_join(c->threads[t->gindex], NULL);
		c->thread_on[t->gindex] = 0;
	}
	if (t->res && !c->res) {
		c->res = t->res;
		snprintf(c->msg, sizeof(c->msg), "%s", t->msg);
	}
	/* A group's snapshot is taken: its files are written off its queue, its ops go on. */
	if (t->kind == TASK_SAVE && !t->res && !c->res && !c->j->ending &&
	    (c->stage[2 * t->gindex] || c->stage[2 * t->gindex + 1])) {
		struct eng_task *w = ckpt_task_new(c->egs[t->gindex], TASK_SAVE_WRITE);

		if (w) {
			w->ckpt = c;
			w->gindex = t->gindex;
			w->ops[0].sqe.op = SHARDD_OP_CHECKPOINT;
			w->ops[0].sqe.step = c->m.step;
			c->wtasks[t->gindex] = w;
			c->pending++;
			if (thread_spawn(c, w))
				shd_pool_submit(c->j->e->pool, &w->pt);
		} else {
			c->res = -SHARDD_E_NOMEM;
			snprintf(c->msg, sizeof(c->msg),
				 "checkpoint %s: out of memory for a write task", c->dir);
		}
	}
	if (--c->pending)
		return;
	if (c->j->ending) {
		ckpt_finish(c, c->res ? c->res : -SHARDD_E_SHUTDOWN,
			    c->res ? c->msg : "the job ended while its checkpoint was written");
		return;
	}
	f = ckpt_task_new(c->egs[0], TASK_SAVE_FINAL);
	if (!f) {
		ckpt_finish(c, -SHARDD_E_NOMEM, "out of memory for the checkpoint's last task");
		return;
	}
	f->ckpt = c;
	f->ops[0].sqe.op = SHARDD_OP_CHECKPOINT;
	f->ops[0].sqe.step = c->m.step;
	eng_group_enqueue(c->egs[0], f);
}

void eng_ckpt_req_free(struct eng_ckpt_req *r)
{
	if (!r)
		return;
	free(r->dir);
	free(r->keep_root);
	free(r);
}

void eng_ckpt_job_wait(struct shd_engine_job *j)
{
	/* The job ends: what is left of its snapshot goes out at the disk's speed, not at --checkpoint-rate. */
	if (j->ckpt)
		__atomic_store_n(&j->ckpt->pace.unbound, 1, __ATOMIC_RELAXED);
	for (;;) {
		struct eng_ckpt *c = j->ckpt;
		struct eng_task *t = NULL;

		for (uint32_t i = 0; c && i < c->m.ngroups && !t; i++)
			t = c->wtasks[i];
		if (!t)
			return;
		/* Its files are being written off the groups' queues. */
		eng_task_wait_finished(j->e, t);
		eng_ckpt_delivered(t);
		free(t);
	}
}

void eng_ckpt_job_end(struct shd_engine_job *j, const char *why)
{
	char msg[ENGINE_MSG_MAX];

	eng_ckpt_req_free(j->ckpt_armed);
	j->ckpt_armed = NULL;
	if (!j->ckpt)
		return;
	eng_fmt(msg, sizeof(msg), "job '%s' %s while its checkpoint was written", j->name,
		why ? why : "ended");
	ckpt_finish(j->ckpt, -SHARDD_E_SHUTDOWN, msg);
}

int shd_engine_job_checkpointing(const struct shd_engine_job *j)
{
	return j->ckpt != NULL;
}

/*
 * 1 when every rank of optimizer group `g` applied or skipped the same last
 * step; else 0 with `err` naming a rank behind and the step to wait for.
 * Update counts may differ: a rank whose grad was non-finite skipped a step
 * alone (SHARDD_STEP_SKIP_NONFINITE), and the manifest keeps each rank
 * shard's count (shard_steps).
 */
static int at_one_step(const struct shd_group *g, char *err, size_t errlen)
{
	uint32_t hi = 0, lo = 0;

	for (uint32_t r = 1; r < g->world; r++) {
		if (g->last_step[r] > g->last_step[hi])
			hi = r;
		if (g->last_step[r] < g->last_step[lo])
			lo = r;
	}
	if (g->last_step[hi] == g->last_step[lo])
		return 1;
	eng_fmt(err, errlen,
		"group '%s' is not at a step boundary: rank %u applied step %llu, rank %u only step "
		"%llu; submit checkpoint after the completions of every rank's step %llu (a restarted rank "
		"catches up with SHARDD_STEP_REPLAY)",
		g->name, hi, (unsigned long long)g->last_step[hi], lo,
		(unsigned long long)g->last_step[lo], (unsigned long long)g->last_step[hi]);
	return 0;
}

/*
 * The manifest's update counts of group `g`: optim_steps the highest of
 * replica 0's rank shards (whose state is written), and each rank shard's
 * in shard_optim_steps when they differ. 0 or -ENOMEM.
 */
static int shard_steps(const struct shd_group *g, struct shd_ckpt_group *cg)
{
	int differ = 0;

	cg->optim_steps = 0;
	for (uint32_t s = 0; s < g->shard; s++) {
		differ |= g->optim_steps[s] != g->optim_steps[0];
		cg->optim_steps =
			g->optim_steps[s] > cg->optim_steps ? g->optim_steps[s] : cg->optim_steps;
	}
	if (!differ)
		return 0;
	cg->shard_optim_steps = malloc(g->shard * sizeof(*cg->shard_optim_steps));
	if (!cg->shard_optim_steps)
		return -ENOMEM;
	memcpy(cg->shard_optim_steps, g->optim_steps, g->shard * sizeof(*cg->shard_optim_steps));
	return 0;
}

/* Check the job can be saved now and fill c->m, c->egs, c->file_of. */
static int ckpt_plan(struct shd_engine_job *j, struct eng_ckpt *c, uint64_t step, char *err,
		     size_t errlen)
{
	uint32_t n = 0, nf = 0;

	for (uint32_t i = 0; i < j->ngroups; i++) {
		struct eng_group *eg = j->groups[i];

		if (!eg)
			continue;
		if (!eg->complete) {
			eng_fmt(err, errlen,
				"group '%s' is still registering; checkpoint once every rank registered it",
				eg->g->name);
			return -SHARDD_E_STATE;
		}
		if (eg->running || eg->qhead) {
			eng_fmt(err, errlen,
				"group '%s' still has a %s in flight; submit checkpoint after the "
				"completions of the step's ops",
				eg->g->name,
				shd_op_info((eg->running ? eg->running : eg->qhead)->ops[0].sqe.op)
					->name);
			return -SHARDD_E_STATE;
		}
		if (eg->g->optim.kind != SHARDD_OPTIM_NONE && !at_one_step(eg->g, err, errlen))
			return -SHARDD_E_STATE;
		n++;
	}
	if (!n) {
		eng_fmt(err, errlen,
			"job '%s' has no registered group to checkpoint; register its groups first",
			j->name);
		return -SHARDD_E_STATE;
	}
	c->m.version = SHD_CKPT_VERSION;
	snprintf(c->m.job, sizeof(c->m.job), "%s", j->name);
	c->m.step = step;
	c->m.replicate = j->replicate;
	c->m.shard = j->shard;
	c->m.groups = calloc(n, sizeof(*c->m.groups));
	c->m.files = calloc(2 * (size_t)n, sizeof(*c->m.files));
	c->egs = calloc(n, sizeof(*c->egs));
	c->file_of = calloc(2 * (size_t)n, sizeof(*c->file_of));
	if (!c->m.groups || !c->m.files || !c->egs || !c->file_of)
		return -ENOMEM;
	for (uint32_t i = 0; i < j->ngroups; i++) {
		struct eng_group *eg = j->groups[i];
		struct shd_ckpt_group *cg;
		const struct shd_group *g;

		if (!eg)
			continue;
		g = eg->g;
		cg = &c->m.groups[c->m.ngroups];
		c->egs[c->m.ngroups] = eg;
		cg->hdr = g->hdr;
		cg->hdr.init = 0;
		cg->specs = malloc(g->hdr.nparams * sizeof(*cg->specs));
		if (!cg->specs)
			return -ENOMEM;
		memcpy(cg->specs, g->specs, g->hdr.nparams * sizeof(*cg->specs));
		cg->optim = g->optim;
		cg->last_step = g->optim.kind != SHARDD_OPTIM_NONE ? g->last_step[0] : 0;
		if (g->optim.kind != SHARDD_OPTIM_NONE && shard_steps(g, cg))
			return -ENOMEM;
		shd_ckpt_file_names(c->m.ngroups, n, cg->file, cg->optim_file);
		c->file_of[2 * c->m.ngroups] = (int32_t)nf;
		snprintf(c->m.files[nf++].name, SHD_CKPT_FILE_NAME_MAX, "%s", cg->file);
		if (shd_group_optim_states(&g->optim)) {
			c->file_of[2 * c->m.ngroups + 1] = (int32_t)nf;
			snprintf(c->m.files[nf++].name, SHD_CKPT_FILE_NAME_MAX, "%s",
				 cg->optim_file);
		} else {
			c->file_of[2 * c->m.ngroups + 1] = -1;
			cg->optim_file[0] = '\0';
		}
		for (uint32_t i = 0; i < g->layout.nparams; i++) {
			const struct shd_layout_param *p = &g->layout.params[i];

			c->total += p->numel *
				    (shardd_dtype_size(p->dtype) +
				     sizeof(float) * (uint64_t)shd_group_optim_states(&g->optim));
		}
		c->m.ngroups++;
	}
	c->m.nfiles = nf;
	c->stage = calloc(2 * (size_t)n, sizeof(*c->stage));
	c->stage_len = calloc(2 * (size_t)n, sizeof(*c->stage_len));
	c->sfiles = calloc(2 * (size_t)n, sizeof(*c->sfiles));
	c->wtasks = calloc(n, sizeof(*c->wtasks));
	c->threads = calloc(n, sizeof(*c->threads));
	c->thread_on = calloc(n, sizeof(*c->thread_on));
	if (!c->stage || !c->stage_len || !c->sfiles || !c->wtasks || !c->threads || !c->thread_on)
		return -ENOMEM;
	/* A snapshot in memory when the limits leave room for it; else the files are written in place. */
	{
		const struct shd_engine_config *cfg = &j->e->cfg;

		if ((!cfg->max_memory || j->e->mem_committed + c->total <= cfg->max_memory) &&
		    (!cfg->max_job_memory || j->mem_committed + c->total <= cfg->max_job_memory)) {
			c->staged = c->total;
			j->mem_committed += c->staged;
			j->e->mem_committed += c->staged;
		}
	}
	return 0;
}

int eng_ckpt_start(struct shd_engine_job *j, const struct shd_engine_ckpt_target *tg, uint64_t id,
		   shd_engine_ckpt_fn done, void *ctx, char *err, size_t errlen)
{
	struct eng_ckpt *c;
	struct eng_task **tasks = NULL;
	char *json = NULL, why[256] = "", *base, *parent, *tmpl = NULL;
	struct stat st;
	int ret;

	if (j->ckpt) {
		eng_fmt(err, errlen,
			"the checkpoint of step %llu into %s is still being written; wait for its "
			"completion",
			(unsigned long long)j->ckpt->m.step, j->ckpt->dir);
		return -SHARDD_E_STATE;
	}
	c = calloc(1, sizeof(*c));
	if (!c)
		goto nomem;
	c->j = j;
	c->id = id;
	c->dirfd = -1;
	c->keep = tg->keep;
	c->done = done;
	c->ctx = ctx;
	c->start_ns = shd_now_ns();
	c->pace.bytes_per_s = (uint64_t)j->e->cfg.checkpoint_rate * 1000000u;
	c->pace.start_ns = c->start_ns;
	ret = ckpt_plan(j, c, tg->step, err, errlen);
	if (ret == -ENOMEM)
		goto nomem;
	if (ret)
		goto fail;
	/* Every name must be UTF-8 and every param name unique in the job before a byte is written. */
	ret = shd_ckpt_manifest_dump(&c->m, &json, why, sizeof(why));
	free(json);
	json = NULL;
	if (!ret && c->m.ngroups > 1) {
		ret = shd_ckpt_index_dump(&c->m, 0, &json, why, sizeof(why));
		free(json);
	}
	if (ret == -ENOMEM)
		goto nomem;
	if (ret) {
		eng_fmt(err, errlen, "%s", why);
		goto fail;
	}
	c->dir = strdup(tg->dir);
	c->keep_root = tg->keep_root ? strdup(tg->keep_root) : NULL;
	base = strdup(tg->dir);
	parent = strdup(tg->dir);
	if (!c->dir || !base || !parent || (tg->keep_root && !c->keep_root)) {
		free(base);
		free(parent);
		goto nomem;
	}
	/* dirname and basename may return a pointer into their argument: copy out of it. */
	c->parent = strdup(dirname(parent));
	ret = c->parent ? asprintf(&tmpl, "%s/.tmp-%s-XXXXXX", c->parent, basename(base)) : -1;
	free(base);
	free(parent);
	if (ret < 0)
		goto nomem;
	c->tmp = tmpl;
	if (!stat(tg->dir, &st)) {
		eng_fmt(err, errlen,
			"checkpoint directory %s exists; name a new one (a checkpoint is never "
			"written over another)",
			tg->dir);
		ret = -SHARDD_E_INVALID;
		goto fail;
	}
	ret = ckpt_mkdir_p(c->parent);
	if (ret || !mkdtemp(c->tmp) ||
	    (c->dirfd = open(c->tmp, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
		eng_fmt(err, errlen, "checkpoint %s: cannot create %s: %s", tg->dir,
			ret ? c->parent : c->tmp, strerror(ret ? -ret : errno));
		ret = -SHARDD_E_INVALID;
		goto fail;
	}
	tasks = calloc(c->m.ngroups, sizeof(*tasks));
	if (!tasks)
		goto nomem_tmp;
	for (uint32_t i = 0; i < c->m.ngroups; i++) {
		tasks[i] = ckpt_task_new(c->egs[i], TASK_SAVE);
		if (!tasks[i]) {
			for (uint32_t k = 0; k < i; k++)
				free(tasks[k]);
			free(tasks);
			goto nomem_tmp;
		}
		tasks[i]->ckpt = c;
		tasks[i]->gindex = i;
		/* Read by messages that name what a group runs; never completed (eng_ckpt_delivered). */
		tasks[i]->ops[0].sqe.op = SHARDD_OP_CHECKPOINT;
		tasks[i]->ops[0].sqe.step = tg->step;
	}
	c->pending = c->m.ngroups;
	j->ckpt = c;
	shd_log_info("job '%s': checkpoint of step %llu into %s started (%u groups)", j->name,
		     (unsigned long long)tg->step, tg->dir, c->m.ngroups);
	for (uint32_t i = 0; i < c->m.ngroups; i++)
		eng_group_enqueue(c->egs[i], tasks[i]);
	free(tasks);
	return 0;
nomem_tmp:
	ckpt_remove_dir(AT_FDCWD, c->tmp);
nomem:
	eng_fmt(err, errlen, "out of memory to plan the checkpoint");
	ret = -SHARDD_E_NOMEM;
fail:
	if (c)
		ckpt_free(c);
	return ret;
}

void eng_ckpt_record_failure(struct shd_engine_job *j, uint64_t id, int res, const char *msg,
			     const char *dir, uint64_t step)
{
	struct shd_engine_ckpt_status *l = &j->ckpt_last;

	shd_log_warn("job '%s': checkpoint %llu of step %llu: %s", j->name, (unsigned long long)id,
		     (unsigned long long)step, msg);
	l->last_id = id;
	l->last_res = res;
	snprintf(l->last_msg, sizeof(l->last_msg), "%s", msg);
	snprintf(l->last_dir, sizeof(l->last_dir), "%s", dir ? dir : "");
	l->last_step = step;
	l->last_bytes = 0;
	l->last_s = 0;
	l->last_staged = 0;
}

int shd_engine_job_checkpoint(struct shd_engine_job *j, const struct shd_engine_ckpt_target *tg,
			      shd_engine_ckpt_fn done, void *ctx, char *err, size_t errlen)
{
	if (j->ckpt_armed) {
		eng_fmt(err, errlen,
			"a checkpoint armed by an admin request (id %llu) waits for the next step "
			"boundary; wait for it (shardctl checkpoints %s)",
			(unsigned long long)j->ckpt_armed->id, j->name);
		return -SHARDD_E_STATE;
	}
	int ret = eng_ckpt_start(j, tg, j->ckpt_seq + 1, done, ctx, err, errlen);

	j->ckpt_seq++;
	if (ret)
		eng_ckpt_record_failure(j, j->ckpt_seq, ret, err, tg->dir, tg->step);
	return ret;
}
