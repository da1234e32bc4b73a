/* SPDX-License-Identifier: MIT */
/*
 * shardbench checkpoint: saving and restoring a job's state through the
 * daemon (docs/CHECKPOINTS.md) against the disk's own sequential bandwidth
 * measured in the same run, on the same directory, with direct I/O of the
 * same size.
 *
 * Sizes are the state's bytes: an fp32 param and AdamW's exp_avg and
 * exp_avg_sq (three equal tensors) over -r ranks (1 x R). save(GB/s) is
 * those bytes over the time from the ranks' first checkpoint op submitted
 * to the last completion (files fsynced, renamed); disk_w(GB/s) writes the
 * same bytes with O_DIRECT (4 MiB I/Os, 4 in flight, as the daemon's) and
 * one fsync. load(GB/s) is the bytes over the
 * time a registration restoring from it takes minus that of the same
 * registration without a restore (buffers are allocated in both; the best
 * of -n of each);
 * disk_r(GB/s) reads the bytes back the same way; the checkpoint's files
 * leave the page cache (POSIX_FADV_DONTNEED) before the load. #wrong counts restored
 * param elements that differ from what was saved.
 *
 * Then step time during a save: -r rank processes train group 'train'
 * (fp32 [TRAIN_ROWS, 1024], AdamW) of a job whose group 'state' holds the
 * sweep's largest state; each of -w + -n rounds times every step
 * (unshard, reshard, reduce, step) while a checkpoint of the job, which
 * every rank submits without waiting, is written, then as many steps with
 * no save: both windows sample the same minutes of a shared host. idle
 * and save columns: rank 0's step times, p50 and mean, and how much slower
 * the steps during the save were.
 *
 * With --torch PYTHON (or $SHARDBENCH_TORCH), tools/bench_dcp.py run by
 * that python saves and loads the same state with torch.distributed.checkpoint
 * (DTensor dim-0 shards over -r gloo ranks, same directory) first;
 * save/DCP and load/DCP are shardd's GB/s over DCP's. A python without
 * torch >= 2.4 skips the comparison with the script's reason printed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <liburing.h>

#include "bench.h"
#include "shardd.h"

#define CKPT_COLS      1024       /* fp32 elements per row of the param */
#define CKPT_IO_CHUNK  (4u << 20) /* bytes per direct I/O, as the daemon's (ckpt_files.h) */
#define CKPT_IO_DEPTH  4          /* direct I/Os in flight, as the daemon's */
#define CKPT_MAX_RANKS 8
#define CKPT_MAX_SIZES 64
#define DCP_LIMIT_S    1900 /* the script kills its ranks after 1800 s */
#define TRAIN_ROWS     4096 /* the trained group's param: 16 MiB of fp32 rows */
#define TRAIN_LEAD     8 /* steps untimed before the first round: the group's first ops are cold */
#define TRAIN_MAX      4096 /* steps timed while saving (and as many idle), at most */
#define TRAIN_WAIT_MS  600000
#define TRAIN_CKPT_UD  (1ull << 40) /* user_data of a rank's checkpoint op */
#define TRAIN_REAP_MS  (1800 * 1000)
#define TRAIN_ROUNDS   64 /* -w + -n at most */

struct ckpt_job {
	const char *socket;
	char name[64];
	uint32_t ranks;
	struct shardd_param_desc param;
	const char *restore; /* NULL: plain registration */
	struct shardd_client *c[CKPT_MAX_RANKS];
	struct shardd_group *g[CKPT_MAX_RANKS];
	int ret[CKPT_MAX_RANKS];
	char err[CKPT_MAX_RANKS][512];
};

struct reg_arg {
	struct ckpt_job *j;
	uint32_t r;
};

static const struct shardd_optim_config adamw = {
	.kind = SHARDD_OPTIM_ADAMW,
	.beta1 = 0.9,
	.beta2 = 0.999,
	.eps = 1e-8,
};

static void *register_main(void *p)
{
	struct reg_arg *a = p;
	struct ckpt_job *j = a->j;
	struct shardd_group_opts opts = { .optimizer = &adamw, .restore = j->restore };

	j->ret[a->r] =
		shardd_group_register(j->c[a->r], "state", &j->param, 1, NULL, &opts, &j->g[a->r]);
	if (j->ret[a->r])
		snprintf(j->err[a->r], sizeof(j->err[a->r]), "%s", shardd_last_error());
	return NULL;
}

/* Attach and register every rank (one thread each); its time in ns, or 0 on failure (printed). */
static uint64_t job_register(struct ckpt_job *j)
{
	pthread_t th[CKPT_MAX_RANKS];
	struct reg_arg a[CKPT_MAX_RANKS];
	uint64_t t0;
	int failed = 0;

	for (uint32_t r = 0; r < j->ranks; r++) {
		struct shardd_attach_opts ao = { .socket_path = j->socket,
						 .job = j->name,
						 .rank = r,
						 .replicate = 1,
						 .shard = j->ranks,
						 .device = SHARDD_HELLO_DEVICE_HOST };

		if (shardd_connect(&ao, &j->c[r]) < 0) {
			fprintf(stderr, "shardbench: checkpoint: attach rank %u: %s\n", r,
				shardd_last_error());
			return 0;
		}
	}
	t0 = bench_now_ns();
	for (uint32_t r = 0; r < j->ranks; r++) {
		a[r] = (struct reg_arg){ .j = j, .r = r };
		pthread_create(&th[r], NULL, register_main, &a[r]);
	}
	for (uint32_t r = 0; r < j->ranks; r++)
		pthread_join(th[r], NULL);
	t0 = bench_now_ns() - t0;
	for (uint32_t r = 0; r < j->ranks; r++)
		if (j->ret[r]) {
			fprintf(stderr, "shardbench: checkpoint: register rank %u: %s\n", r,
				j->err[r]);
			failed = 1;
		}
	return failed ? 0 : t0;
}

static void job_close(struct ckpt_job *j)
{
	for (uint32_t r = 0; r < j->ranks; r++) {
		if (j->g[r] && !j->ret[r])
			shardd_group_close(j->g[r]);
		shardd_close(j->c[r]);
	}
}

/* Every rank's checkpoint(step); ns from the first submission to the last completion, 0 on failure. */
static uint64_t job_checkpoint(struct ckpt_job *j, uint64_t step)
{
	struct shardd_completion cp;
	uint64_t t0 = bench_now_ns();

	for (uint32_t r = 0; r < j->ranks; r++)
		if (shardd_client_submit(j->c[r], SHARDD_OP_CHECKPOINT, step, 0, step) < 0) {
			fprintf(stderr, "shardbench: checkpoint: submit: %s\n",
				shardd_last_error());
			return 0;
		}
	for (uint32_t r = 0; r < j->ranks; r++) {
		if (shardd_wait(j->c[r], &cp, 600000) < 0 || cp.res < 0) {
			fprintf(stderr, "shardbench: checkpoint(step %llu) rank %u: %s\n",
				(unsigned long long)step, r,
				cp.res < 0 ? cp.msg : shardd_last_error());
			return 0;
		}
	}
	return bench_now_ns() - t0;
}

/*
 * Sequential direct I/O of `bytes` to (write 1) or from `path`, with
 * CKPT_IO_DEPTH chunks in flight through io_uring (each in its slot of
 * buf): the disk as the daemon's writes and reads see it, not one request
 * at a time. ns, or 0 with the error printed.
 */
static uint64_t disk_pass(const char *path, uint64_t bytes, int write_it, uint8_t *buf)
{
	int fd = open(path,
		      (write_it ? O_WRONLY | O_CREAT | O_TRUNC : O_RDONLY) | O_DIRECT | O_CLOEXEC,
		      0600);
	uint32_t len[CKPT_IO_DEPTH] = { 0 };
	uint64_t t0, next = 0, done = 0;
	const char *what = write_it ? "write" : "read";
	struct io_uring ring;
	int ret;

	if (fd < 0) {
		fprintf(stderr, "shardbench: checkpoint: %s with O_DIRECT: %s\n", path,
			strerror(errno));
		return 0;
	}
	ret = io_uring_queue_init(CKPT_IO_DEPTH, &ring, 0);
	if (ret) {
		fprintf(stderr, "shardbench: checkpoint: io_uring: %s\n", strerror(-ret));
		close(fd);
		return 0;
	}
	t0 = bench_now_ns();
	/*
	 * Allocated first, as the daemon's files are (and fio's by default):
	 * ext4 runs direct writes past the end of a file one at a time.
	 */
	if (write_it && fallocate(fd, 0, 0, (off_t)bytes) && errno != EOPNOTSUPP)
		ret = -errno;
	while (!ret && done < bytes) {
		struct io_uring_cqe *cqe;
		uint32_t i;

		for (i = 0; i < CKPT_IO_DEPTH && next < bytes; i++) {
			struct io_uring_sqe *sqe;

			if (len[i])
				continue;
			/* Direct I/O moves whole blocks. */
			len[i] = (uint32_t)((bytes - next < CKPT_IO_CHUNK ? bytes - next
									  : CKPT_IO_CHUNK) +
					    4095) &
				 ~4095u;
			sqe = io_uring_get_sqe(&ring);
			if (write_it)
				io_uring_prep_write(sqe, fd, buf + (size_t)i * CKPT_IO_CHUNK,
						    len[i], next);
			else
				io_uring_prep_read(sqe, fd, buf + (size_t)i * CKPT_IO_CHUNK, len[i],
						   next);
			io_uring_sqe_set_data64(sqe, i);
			next += len[i];
		}
		ret = io_uring_submit(&ring);
		ret = ret < 0 ? ret : io_uring_wait_cqe(&ring, &cqe);
		if (ret == -EINTR) {
			ret = 0;
			continue;
		}
		if (ret)
			break;
		i = (uint32_t)io_uring_cqe_get_data64(cqe);
		ret = cqe->res < 0 ? cqe->res : cqe->res != (int)len[i] ? -ENODATA : 0;
		done += len[i];
		len[i] = 0;
		io_uring_cqe_seen(&ring, cqe);
	}
	/* A failure may leave I/Os in flight on buf, which the caller frees: they end first. */
	for (uint32_t i = 0; i < CKPT_IO_DEPTH; i++) {
		struct io_uring_cqe *cqe;

		while (len[i] && io_uring_wait_cqe(&ring, &cqe) == 0) {
			len[io_uring_cqe_get_data64(cqe) % CKPT_IO_DEPTH] = 0;
			io_uring_cqe_seen(&ring, cqe);
		}
	}
	io_uring_queue_exit(&ring);
	if (!ret && write_it && fsync(fd))
		ret = -errno;
	close(fd);
	if (ret) {
		fprintf(stderr, "shardbench: checkpoint: %s %s: %s\n", what, path,
			ret == -ENODATA ? "short" : strerror(-ret));
		return 0;
	}
	return bench_now_ns() - t0;
}

/* Drop the page cache of a checkpoint's files (clean after their fsync): the load reads the disk. */
static int drop_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	int fd;

	(void)st;
	(void)ftw;
	if (flag != FTW_F)
		return 0;
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
		close(fd);
	}
	return 0;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	return remove(path);
}

/* torch.distributed.checkpoint's best save and load per size; 0 ns when not measured. */
struct dcp_results {
	int available;
	char why[256];
	uint64_t asked[CKPT_MAX_SIZES], save_ns[CKPT_MAX_SIZES], load_ns[CKPT_MAX_SIZES],
		wrong[CKPT_MAX_SIZES];
	size_t n;
};

/* Run tools/bench_dcp.py with `python` over `sizes` in `dir`; fills *d (d->why when it did not run). */
static void dcp_run(const struct bench_opts *o, const char *python, const char *dir, uint32_t ranks,
		    const uint64_t *sizes, size_t nsizes, struct dcp_results *d)
{
	char script[PATH_MAX + 32], nums[4 + CKPT_MAX_SIZES][32], line[512];
	char *argv[16 + CKPT_MAX_SIZES];
	int pipefd[2], status, argc = 0;
	pid_t pid;
	FILE *f;

	memset(d, 0, sizeof(*d));
	snprintf(script, sizeof(script), "%s/../tools/bench_dcp.py", o->self_dir);
	if (access(script, R_OK)) {
		snprintf(d->why, sizeof(d->why), "%.200s: %s (it runs from a build tree)", script,
			 strerror(errno));
		return;
	}
	argv[argc++] = (char *)python;
	argv[argc++] = script;
	argv[argc++] = "--dir";
	argv[argc++] = (char *)dir;
	snprintf(nums[0], sizeof(nums[0]), "--ranks=%u", ranks);
	snprintf(nums[1], sizeof(nums[1]), "--warmup=%d", o->warmup);
	snprintf(nums[2], sizeof(nums[2]), "--iters=%d", o->iters);
	for (int i = 0; i < 3; i++)
		argv[argc++] = nums[i];
	for (size_t i = 0; i < nsizes; i++) {
		snprintf(nums[4 + i], sizeof(nums[0]), "%llu", (unsigned long long)sizes[i]);
		argv[argc++] = nums[4 + i];
	}
	argv[argc] = NULL;
	if (pipe(pipefd)) {
		snprintf(d->why, sizeof(d->why), "pipe: %s", strerror(errno));
		return;
	}
	fflush(stdout);
	pid = fork();
	if (pid < 0) {
		snprintf(d->why, sizeof(d->why), "fork: %s", strerror(errno));
		close(pipefd[0]);
		close(pipefd[1]);
		return;
	}
	if (pid == 0) {
		dup2(pipefd[1], STDOUT_FILENO);
		close(pipefd[0]);
		close(pipefd[1]);
		execvp(argv[0], argv);
		printf("unavailable exec %s: %s (--torch names a python)\n", argv[0],
		       strerror(errno));
		_exit(127);
	}
	close(pipefd[1]);
	f = fdopen(pipefd[0], "r");
	if (!f) {
		snprintf(d->why, sizeof(d->why), "fdopen: %s", strerror(errno));
		close(pipefd[0]);
		kill(pid, SIGKILL);
		bench_reap_pid(pid, 10000);
		return;
	}
	snprintf(d->why, sizeof(d->why), "%.200s printed nothing", script);
	while (fgets(line, sizeof(line), f)) {
		unsigned long long asked, bytes, save, load, wrong;

		line[strcspn(line, "\n")] = '\0';
		if (!strncmp(line, "unavailable ", 12)) {
			snprintf(d->why, sizeof(d->why), "%.240s", line + 12);
			d->available = 0;
		} else if (!strncmp(line, "torch ", 6)) {
			printf("# DCP: torch %.64s (%s), FileSystemWriter/Reader, %u gloo ranks\n",
			       line + 6, python, ranks);
			d->available = 1;
		} else if (sscanf(line, "dcp %llu %llu %llu %llu %llu", &asked, &bytes, &save,
				  &load, &wrong) == 5 &&
			   d->n < CKPT_MAX_SIZES) {
			d->asked[d->n] = asked;
			d->save_ns[d->n] = save;
			d->load_ns[d->n] = load;
			d->wrong[d->n++] = wrong;
		}
	}
	fclose(f);
	status = bench_reap_pid(pid, DCP_LIMIT_S * 1000);
	if (!(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0) && d->available) {
		printf("# DCP: the script ended with status 0x%x (%s): rows without DCP columns were not measured\n",
		       status, d->why);
	}
}

/* The index of `size`'s DCP row, or -1. */
static int dcp_find(const struct dcp_results *d, uint64_t size)
{
	for (size_t i = 0; i < d->n; i++)
		if (d->asked[i] == size && d->save_ns[i] && d->load_ns[i])
			return (int)i;
	return -1;
}

/*
 * Step time during a save: rank processes train group 'train' of a job
 * that also holds group 'state', each round the steps while a checkpoint
 * of the job (the ranks' op, submitted without waiting, as a trainer does)
 * is written, until it completes, then as many steps with no save. Rank 0
 * times each step; results in shared memory.
 */
struct train_shared {
	uint32_t ranks;
	uint64_t state_rows;
	uint64_t nidle, nsaving;
	uint64_t idle_ns[TRAIN_MAX];
	uint64_t saving_ns[TRAIN_MAX];
	uint64_t save_ns[TRAIN_ROUNDS]; /* per timed round: the save's time */
	uint64_t stop_after
		[TRAIN_ROUNDS]; /* per round: the last step while saving, once rank 0 knows it */
	int32_t err[CKPT_MAX_RANKS];
	char msg[CKPT_MAX_RANKS][512];
};

static int train_fail(struct train_shared *sh, uint32_t rank, int err, const char *what)
{
	const char *why = shardd_last_error();

	sh->err[rank] = err ? err : -EIO;
	snprintf(sh->msg[rank], sizeof(sh->msg[rank]), "rank %u: %s: %s", rank, what,
		 why && why[0] ? why : shardd_strerror(err));
	return sh->err[rank];
}

/* One training step of the group: unshard, reshard, reduce, step; its ns, or 0 (failed). */
static uint64_t train_step(struct train_shared *sh, uint32_t rank, struct shardd_group *g,
			   uint64_t step)
{
	uint64_t t0 = bench_now_ns();
	int ret;

	if ((ret = shardd_unshard(g, step)) || (ret = shardd_reshard(g, step)) ||
	    (ret = shardd_reduce(g, step, 0)) || (ret = shardd_step(g, step, 1e-3, 0, 0, 0))) {
		train_fail(sh, rank, ret, "train step");
		return 0;
	}
	return bench_now_ns() - t0;
}

/* A rank's checkpoint completion: 0, or its failure kept for the report. */
static int train_ckpt_done(struct train_shared *sh, uint32_t rank,
			   const struct shardd_completion *cp, uint64_t step)
{
	if (cp->user_data == TRAIN_CKPT_UD + step && !cp->res)
		return 0;
	snprintf(sh->msg[rank], sizeof(sh->msg[rank]), "rank %u: checkpoint(step %llu): %.400s",
		 rank, (unsigned long long)step, cp->res ? cp->msg : "another completion");
	sh->err[rank] = cp->res ? cp->res : -EPROTO;
	return sh->err[rank];
}

static int train_rank(const struct bench_opts *o, struct train_shared *sh, const char *socket_path,
		      const char *job, const char *state_dir, uint32_t rank)
{
	struct shardd_client *c = NULL;
	struct shardd_group *state = NULL, *train = NULL;
	struct shardd_group_opts opts = { .optimizer = &adamw };
	struct shardd_attach_opts ao = { .socket_path = socket_path,
					 .job = job,
					 .rank = rank,
					 .replicate = 1,
					 .shard = sh->ranks,
					 .device = SHARDD_HELLO_DEVICE_HOST };
	struct shardd_param_desc sp = { .name = "state.w",
					.dtype = SHARDD_DTYPE_FP32,
					.ndim = 2,
					.shape = { sh->state_rows, CKPT_COLS } };
	struct shardd_param_desc tp = { .name = "train.w",
					.dtype = SHARDD_DTYPE_FP32,
					.ndim = 2,
					.shape = { TRAIN_ROWS, CKPT_COLS } };
	uint64_t step = 0, barrier = 0;
	int ret;

	ret = shardd_connect(&ao, &c);
	if (ret)
		return train_fail(sh, rank, ret, "attach");
	if ((ret = shardd_group_register(c, "state", &sp, 1, NULL, &opts, &state)) ||
	    (ret = shardd_group_register(c, "train", &tp, 1, NULL, &opts, &train))) {
		train_fail(sh, rank, ret, "register");
		goto out;
	}
	{
		float *gr = shardd_group_grad(train, 0);

		for (uint64_t e = 0; e < TRAIN_ROWS * CKPT_COLS; e++)
			gr[e] = bench_grad_value(e, rank, 2);
	}
	for (int k = 0; k < TRAIN_LEAD && !ret; k++)
		ret = train_step(sh, rank, train, ++step) ? 0 : -EIO;
	for (int round = 0; !ret && round < o->warmup + o->iters; round++) {
		struct shardd_completion cp;
		uint64_t t0, n = 0, t;
		int timed = round >= o->warmup, done = 0;
		char dir[700];

		if ((ret = shardd_barrier(c, ++barrier))) {
			train_fail(sh, rank, ret, "barrier");
			break;
		}
		t0 = bench_now_ns();
		ret = shardd_client_submit(c, SHARDD_OP_CHECKPOINT, step, 0, TRAIN_CKPT_UD + step);
		if (ret) {
			train_fail(sh, rank, ret, "submit checkpoint");
			break;
		}
		/*
		 * Steps go on until rank 0's checkpoint completes (the save is
		 * durable): it then names the next step as the last, which no
		 * rank can have finished yet (a step is a collective), and every
		 * rank stops after it.
		 */
		while (!ret && step != __atomic_load_n(&sh->stop_after[round], __ATOMIC_ACQUIRE)) {
			t = train_step(sh, rank, train, ++step);
			ret = t ? 0 : -EIO;
			if (!ret && timed && rank == 0 && sh->nsaving < TRAIN_MAX)
				sh->saving_ns[sh->nsaving++] = t;
			n++;
			if (!ret && !done && !shardd_poll(c, &cp)) {
				ret = train_ckpt_done(sh, rank, &cp, step - n);
				done = 1;
				if (rank == 0)
					__atomic_store_n(&sh->stop_after[round], step + 1,
							 __ATOMIC_RELEASE);
			}
		}
		if (!ret && !done) {
			ret = shardd_wait(c, &cp, TRAIN_WAIT_MS);
			ret = ret ? train_fail(sh, rank, ret, "checkpoint")
				  : train_ckpt_done(sh, rank, &cp, step - n);
		}
		if (!ret && timed && rank == 0)
			sh->save_ns[round - o->warmup] = bench_now_ns() - t0;
		if (!ret && (ret = shardd_barrier(c, ++barrier)))
			train_fail(sh, rank, ret, "barrier");
		/* As many steps with no save: every rank stopped at the same step, so n is every rank's. */
		for (uint64_t k = 0; k < n && !ret; k++) {
			t = train_step(sh, rank, train, ++step);
			ret = t ? 0 : -EIO;
			if (!ret && timed && rank == 0 && sh->nidle < TRAIN_MAX)
				sh->idle_ns[sh->nidle++] = t;
		}
		/* Rank 0 removes the checkpoint: the disk holds one at a time. */
		if (!ret && rank == 0) {
			snprintf(dir, sizeof(dir), "%s/%s/step-%012llu", state_dir, job,
				 (unsigned long long)(step - 2 * n));
			nftw(dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
		}
	}
out:
	shardd_group_close(train);
	shardd_group_close(state);
	shardd_close(c);
	return ret;
}

static uint64_t mean_ns(const uint64_t *v, uint64_t n)
{
	long double sum = 0;

	for (uint64_t i = 0; i < n; i++)
		sum += v[i];
	return n ? (uint64_t)(sum / n) : 0;
}

/* The step-during-save table at state size `size` (bytes of param + AdamW state). */
static int train_run(const struct bench_opts *o, const char *socket_path, const char *state_dir,
		     uint32_t ranks, uint64_t size)
{
	struct train_shared *sh =
		mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	pid_t pids[CKPT_MAX_RANKS];
	char job[64], dir[600];
	uint64_t save_ns = 0;
	int failed = 0;

	if (sh == MAP_FAILED)
		return -ENOMEM;
	if (o->warmup + o->iters > TRAIN_ROUNDS) {
		fprintf(stderr,
			"shardbench: checkpoint: step during a save: -w + -n is %d, at most %d\n",
			o->warmup + o->iters, TRAIN_ROUNDS);
		munmap(sh, sizeof(*sh));
		return -EINVAL;
	}
	memset(sh, 0, sizeof(*sh));
	sh->ranks = ranks;
	sh->state_rows = size / 3 / (CKPT_COLS * sizeof(float));
	if (!sh->state_rows)
		sh->state_rows = 1;
	snprintf(job, sizeof(job), "ckpt-step-%llu", (unsigned long long)size);
	fflush(stdout);
	for (uint32_t r = 0; r < ranks; r++) {
		pids[r] = fork();
		if (pids[r] == 0)
			_exit(train_rank(o, sh, socket_path, job, state_dir, r) ? 1 : 0);
		if (pids[r] < 0) {
			fprintf(stderr, "shardbench: checkpoint: fork: %s\n", strerror(errno));
			failed = 1;
			ranks = r;
			break;
		}
	}
	for (uint32_t r = 0; r < ranks; r++) {
		int st = bench_reap_pid(pids[r], TRAIN_REAP_MS);

		if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) {
			fprintf(stderr, "shardbench: checkpoint: step during a save: %s\n",
				sh->msg[r][0] ? sh->msg[r] : "a rank process failed");
			failed = 1;
		}
	}
	snprintf(dir, sizeof(dir), "%s/%s", state_dir, job);
	nftw(dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
	if (!failed && sh->nidle && sh->nsaving) {
		uint64_t ip50, sp50, im = mean_ns(sh->idle_ns, sh->nidle),
				     sm = mean_ns(sh->saving_ns, sh->nsaving);

		for (int i = 0; i < o->iters; i++)
			save_ns += sh->save_ns[i];
		bench_sort_u64(sh->idle_ns, sh->nidle);
		bench_sort_u64(sh->saving_ns, sh->nsaving);
		ip50 = bench_percentile(sh->idle_ns, sh->nidle, 50);
		sp50 = bench_percentile(sh->saving_ns, sh->nsaving, 50);
		printf(" %13llu %10llu %10.2f %10.2f %+8.1f%% %10.2f %10.2f %+8.1f%% %7llu %7llu %10.2f\n",
		       (unsigned long long)(3 * sh->state_rows * CKPT_COLS * sizeof(float)),
		       (unsigned long long)(3ull * TRAIN_ROWS * CKPT_COLS * sizeof(float)),
		       ip50 / 1e6, sp50 / 1e6, 100.0 * ((double)sp50 / (double)ip50 - 1), im / 1e6,
		       sm / 1e6, 100.0 * ((double)sm / (double)im - 1),
		       (unsigned long long)sh->nidle, (unsigned long long)sh->nsaving,
		       (double)(3 * (sh->state_rows + TRAIN_ROWS) * CKPT_COLS * sizeof(float)) *
			       o->iters / (double)save_ns);
		fflush(stdout);
	}
	munmap(sh, sizeof(*sh));
	return failed ? -EIO : 0;
}

int bench_checkpoint_run(const struct bench_opts *o, const char *socket_path, const char *state_dir)
{
	void *buf = NULL;
	char probe[256], dir[512];
	uint32_t ranks = o->ranks;
	int failed = 0;
	uint64_t seq = 0, sizes[CKPT_MAX_SIZES];
	size_t nsizes = 0;
	const char *python = o->torch_python ? o->torch_python : getenv("SHARDBENCH_TORCH");
	struct dcp_results *dcp = calloc(1, sizeof(*dcp));

	if (ranks > CKPT_MAX_RANKS)
		ranks = CKPT_MAX_RANKS;
	if (!dcp || posix_memalign(&buf, 4096, (size_t)CKPT_IO_DEPTH * CKPT_IO_CHUNK)) {
		free(dcp);
		return -ENOMEM;
	}
	memset(buf, 0x5a, (size_t)CKPT_IO_DEPTH * CKPT_IO_CHUNK);
	snprintf(probe, sizeof(probe), "%s/disk-probe", state_dir);
	printf("# checkpoint: AdamW state (fp32 param, exp_avg, exp_avg_sq) over %u ranks, in %s\n",
	       ranks, state_dir);
	printf("# disk_w/disk_r: O_DIRECT sequential write (+ fsync) and read of the same bytes there,\n"
	       "# %u MiB I/Os, %u in flight (as the daemon's)\n",
	       CKPT_IO_CHUNK >> 20, CKPT_IO_DEPTH);
	printf("# load: a registration restoring from the checkpoint minus the same registration without a restore\n");
	for (uint64_t size = o->min_bytes; size <= o->max_bytes && nsizes < CKPT_MAX_SIZES;
	     size *= o->factor)
		sizes[nsizes++] = size;
	if (python && *python) {
		dcp_run(o, python, state_dir, ranks, sizes, nsizes, dcp);
		if (dcp->available)
			printf("# dcp_w/dcp_r: its save (files fsynced by DCP, + the directory) and load GB/s,\n"
			       "# dcpw/disk, dcpr/disk: over disk_w and disk_r; save/DCP, load/DCP: shardd's over DCP's\n");
		else
			printf("# torch.distributed.checkpoint: skipped: %s\n", dcp->why);
	} else {
		printf("# torch.distributed.checkpoint: not compared (--torch PYTHON with torch >= 2.4 compares it)\n");
	}
	printf("#%13s %12s %12s %9s %12s %12s %9s", "size(B)", "disk_w(GB/s)", "save(GB/s)",
	       "save/disk", "disk_r(GB/s)", "load(GB/s)", "load/disk");
	if (dcp->available)
		printf(" %11s %9s %9s %11s %9s %9s", "dcp_w(GB/s)", "dcpw/disk", "save/DCP",
		       "dcp_r(GB/s)", "dcpr/disk", "load/DCP");
	printf(" %7s\n", "#wrong");
	for (size_t si = 0; si < nsizes; si++) {
		uint64_t size = sizes[si];
		struct ckpt_job src = { .socket = socket_path, .ranks = ranks }, plain, back;
		uint64_t rows = size / 3 / (CKPT_COLS * sizeof(float)), bytes, t_save = UINT64_MAX,
			 t_w = UINT64_MAX;
		uint64_t t_r = UINT64_MAX, t_plain, t_back, wrong = 0;

		if (!rows)
			rows = 1;
		bytes = 3 * rows * CKPT_COLS * sizeof(float);
		src.param = (struct shardd_param_desc){ .name = "w",
							.dtype = SHARDD_DTYPE_FP32,
							.ndim = 2,
							.shape = { rows, CKPT_COLS } };
		snprintf(src.name, sizeof(src.name), "ckpt-src-%llu", (unsigned long long)size);
		if (!job_register(&src)) {
			failed = 1;
			job_close(&src);
			break;
		}
		for (uint32_t r = 0; r < ranks; r++) {
			const struct shardd_param_layout *l = shardd_group_layout(src.g[r], 0);
			float *sh = shardd_group_shard(src.g[r], 0);
			uint64_t first = l->shard_row_begin * CKPT_COLS;

			for (uint64_t e = 0; e < l->shard_rows_valid * CKPT_COLS; e++)
				sh[e] = bench_param_value(first + e, 1);
		}
		/* Each iteration writes a new step-N; all but the last are removed before the next. */
		for (int it = 0; it < o->warmup + o->iters && !failed; it++) {
			uint64_t t;

			if (seq) {
				snprintf(dir, sizeof(dir), "%s/%s/step-%012llu", state_dir,
					 src.name, (unsigned long long)seq);
				nftw(dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
			}
			t = job_checkpoint(&src, ++seq);
			failed |= !t;
			if (it >= o->warmup && t && t < t_save)
				t_save = t;
			t = disk_pass(probe, bytes, 1, buf);
			failed |= !t;
			if (it >= o->warmup && t && t < t_w)
				t_w = t;
			t = disk_pass(probe, bytes, 0, buf);
			failed |= !t;
			if (it >= o->warmup && t && t < t_r)
				t_r = t;
		}
		unlink(probe);
		snprintf(dir, sizeof(dir), "%s/%s/step-%012llu", state_dir, src.name,
			 (unsigned long long)seq);
		/* Best of -n after -w, like the save: one registration pair is at the mercy of the host. */
		t_plain = t_back = UINT64_MAX;
		for (int it = 0; !failed && it < o->warmup + o->iters; it++) {
			uint64_t tp, tb;

			plain = (struct ckpt_job){ .socket = socket_path,
						   .ranks = ranks,
						   .param = src.param };
			back = plain;
			snprintf(plain.name, sizeof(plain.name), "ckpt-plain-%llu-%d",
				 (unsigned long long)size, it);
			snprintf(back.name, sizeof(back.name), "ckpt-back-%llu-%d",
				 (unsigned long long)size, it);
			back.restore = dir;
			nftw(dir, drop_entry, 8, FTW_PHYS);
			tp = job_register(&plain);
			tb = tp ? job_register(&back) : 0;
			failed |= !tp || !tb;
			if (it >= o->warmup && tp && tp < t_plain)
				t_plain = tp;
			if (it >= o->warmup && tb && tb < t_back)
				t_back = tb;
			for (uint32_t r = 0; !failed && o->check && r < ranks; r++) {
				const struct shardd_param_layout *l =
					shardd_group_layout(back.g[r], 0);
				const float *sh = shardd_group_shard(back.g[r], 0);
				uint64_t first = l->shard_row_begin * CKPT_COLS;

				for (uint64_t e = 0; e < l->shard_rows_valid * CKPT_COLS; e++)
					wrong += sh[e] != bench_param_value(first + e, 1);
			}
			job_close(&plain);
			job_close(&back);
		}
		job_close(&src);
		/* The job's folder too (the daemon made it for the checkpoints): nothing of the run stays. */
		snprintf(dir, sizeof(dir), "%s/%s", state_dir, src.name);
		nftw(dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
		if (failed)
			break;
		{
			double save = (double)bytes / (double)t_save,
			       w = (double)bytes / (double)t_w;
			double rd = (double)bytes / (double)t_r;
			double load =
				t_back > t_plain ? (double)bytes / (double)(t_back - t_plain) : 0;
			int k = dcp_find(dcp, size);

			printf(" %13llu %12.2f %12.2f %8.0f%% %12.2f", (unsigned long long)bytes, w,
			       save, 100 * save / w, rd);
			/* A restore within the noise of the registration itself is not a measurement. */
			if (load > 0)
				printf(" %12.2f %8.0f%%", load, 100 * load / rd);
			else
				printf(" %12s %9s", "-", "-");
			if (dcp->available && k >= 0) {
				double dw = (double)bytes / (double)dcp->save_ns[k];
				double dr = (double)bytes / (double)dcp->load_ns[k];

				printf(" %11.2f %8.0f%% %8.2fx %11.2f %8.0f%%", dw, 100 * dw / w,
				       save / dw, dr, 100 * dr / rd);
				if (load > 0)
					printf(" %8.2fx", load / dr);
				else
					printf(" %9s", "-");
			} else if (dcp->available) {
				printf(" %11s %9s %9s %11s %9s %9s", "-", "-", "-", "-", "-", "-");
			}
			printf(" %7llu\n",
			       (unsigned long long)(wrong + (k >= 0 ? dcp->wrong[k] : 0)));
			fflush(stdout);
		}
		failed |= wrong != 0;
	}
	if (!failed) {
		printf("# step during a save: %u rank processes step group 'train' (fp32 [%u, %u], AdamW:\n"
		       "# unshard, reshard, reduce, step) of a job whose group 'state' holds the sweep's\n"
		       "# largest state; each of -w + -n rounds times the steps while a checkpoint of the\n"
		       "# job, submitted by every rank without waiting, is written (save), then as many\n"
		       "# steps with no save (idle); rank 0's step times; save(GB/s): both groups' bytes\n"
		       "# over the time from the checkpoint's submission to its completion\n",
		       ranks, TRAIN_ROWS, CKPT_COLS);
		printf("#%13s %10s %10s %10s %9s %10s %10s %9s %7s %7s %10s\n", "state(B)",
		       "train(B)", "idle_p50", "save_p50", "slower", "idle_mean", "save_mean",
		       "slower", "n_idle", "n_save", "save(GB/s)");
		printf("#%13s %10s %10s %10s %9s %10s %10s %9s %7s %7s %10s\n", "", "", "(ms)",
		       "(ms)", "", "(ms)", "(ms)", "", "", "", "");
		failed = train_run(o, socket_path, state_dir, ranks, sizes[nsizes - 1]) != 0;
	}
	free(buf);
	free(dcp);
	return failed ? -EIO : 0;
}
