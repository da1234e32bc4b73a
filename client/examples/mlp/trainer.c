/* SPDX-License-Identifier: MIT */
/* The trainer of train_mlp: one rank process attached to shardd (trainer.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "model.h"
#include "shardd.h"
#include "trainer.h"

#ifdef SHARDD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define MLP_RECONNECT_MS 10000 /* restarted rank: wait for the daemon to drop its old session */

static uint64_t op_key(uint64_t t, uint32_t attempt, uint32_t phase)
{
	return t * 16 + (uint64_t)attempt * 2 + phase;
}

#define RANK_INFLIGHT 16 /* ops one rank has in flight at most: 3 layers x few ops */

struct inflight {
	int used;
	int done;
	int res;
	uint32_t op;
	uint32_t layer; /* MLP_LAYERS for barrier */
	uint64_t step;
};

struct rank {
	const struct trainer_opts *o;
	uint32_t rank;
	int report_fd;                  /* the launcher's pipe; -1: print */
	const struct rank_hooks *hooks; /* NULL: none */
	struct shardd_client *c;
	struct shardd_group *g[MLP_LAYERS];
	struct inflight ops[RANK_INFLIGHT];
	int wait_ms;     /* per completion: collective timeout + slack */
	int failed;      /* first error of this attempt, 0 if none */
	int trainer_sgd; /* SGD in the trainer (--trainer-sgd), not shardd_step */
	char fail_msg[512];
	struct teacher tc;
	struct mlp_work wk;
	int cuda;                    /* the daemon runs the cuda backend */
	void *unsharded[MLP_LAYERS]; /* cuda: host copies of the unsharded buffers */
	void *grad[MLP_LAYERS];      /* cuda: host copies of the grad buffers */
	uint64_t shardd_ns;          /* this step's time in shardd_submit and shardd_wait */
};

/* CLOCK_MONOTONIC in ns, for the per-step time split. */
static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint32_t rank_id(const struct rank *rk)
{
	return rk->rank;
}

uint32_t rank_reduce_flags(const struct rank *rk)
{
	return rk->o->replicate > 1 ? SHARDD_REDUCE_ALL_REDUCE : 0;
}

/* The hook's point `point` of attempt `attempt` of step t, if there is one. */
static void rank_at(struct rank *rk, uint32_t point, uint64_t t, uint32_t attempt, uint32_t layer)
{
	if (rk->hooks && rk->hooks->at)
		rk->hooks->at(rk, point, t, attempt, layer, rk->hooks->arg);
}

static const char *op_what(const struct inflight *f, char *buf, size_t len)
{
	if (f->layer < MLP_LAYERS)
		snprintf(buf, len, "%s(group '%s', step %" PRIu64 ")", shardd_op_name(f->op),
			 mlp_group_names[f->layer], f->step);
	else
		snprintf(buf, len, "%s(%" PRIu64 ")", shardd_op_name(f->op), f->step);
	return buf;
}

static void rank_fail(struct rank *rk, int res, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Record the attempt's first error and print it: the run's log names every failure. */
static void rank_fail(struct rank *rk, int res, const char *fmt, ...)
{
	char text[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	fprintf(stderr, "train_mlp: rank %u: %s\n", rk->rank, text);
	if (!rk->failed) {
		rk->failed = res;
		snprintf(rk->fail_msg, sizeof(rk->fail_msg), "%s", text);
	}
}

/* ------------------------------------------------------------------ */
/* Group buffers seen from this process                                */
/* ------------------------------------------------------------------ */

/*
 * Copy n bytes between this process's memory and a cuda-backend group
 * buffer (device memory), finished before returning: without a stream set
 * (shardd_stream_set), the daemon's work does not wait for this process's
 * copies. 0, or the error recorded with rank_fail.
 */
static int rank_copy(struct rank *rk, void *dst, const void *src, size_t n, int to_device)
{
#ifdef SHARDD_HAVE_CUDA
	cudaError_t e = cudaMemcpy(dst, src, n,
				   to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);

	/* A copy to the device from pageable memory may return before its DMA lands; one from it may not. */
	if (e == cudaSuccess && to_device)
		e = cudaDeviceSynchronize();
	if (e == cudaSuccess)
		return 0;
	rank_fail(rk, -EIO, "copying %zu bytes %s the device failed: %s", n,
		  to_device ? "to" : "from", cudaGetErrorString(e));
#else
	(void)dst;
	(void)src;
	(void)to_device;
	rank_fail(rk, -ENOTSUP,
		  "copying %zu bytes of device memory: this train_mlp was built "
		  "without CUDA",
		  n);
#endif
	return rk->failed;
}

/* Param i of layer l's unsharded params, where the CPU reads them. */
static const float *rank_unsharded(const struct rank *rk, uint32_t l, uint32_t i)
{
	if (!rk->cuda)
		return shardd_group_unsharded(rk->g[l], i);
	return (const float *)((const char *)rk->unsharded[l] +
			       shardd_group_layout(rk->g[l], i)->unsharded_offset);
}

/* Param i of layer l's grads, where the CPU writes them. */
static float *rank_grad(const struct rank *rk, uint32_t l, uint32_t i)
{
	if (!rk->cuda)
		return shardd_group_grad(rk->g[l], i);
	return (float *)((char *)rk->grad[l] + shardd_group_layout(rk->g[l], i)->grad_offset);
}

/* After layer l's unshard completed: cuda, copy the gathered params where rank_unsharded reads. */
static int rank_fetch_unsharded(struct rank *rk, uint32_t l)
{
	const char *dev = shardd_group_unsharded(rk->g[l], 0);

	if (!rk->cuda)
		return 0;
	return rank_copy(rk, rk->unsharded[l],
			 dev - shardd_group_layout(rk->g[l], 0)->unsharded_offset,
			 (size_t)shardd_group_info(rk->g[l])->unsharded_size, 0);
}

/* Before layer l's reduce: cuda, copy the grads backward wrote where the daemon reads them. */
static int rank_put_grad(struct rank *rk, uint32_t l)
{
	char *dev = shardd_group_grad(rk->g[l], 0);

	if (!rk->cuda)
		return 0;
	return rank_copy(rk, dev - shardd_group_layout(rk->g[l], 0)->grad_offset, rk->grad[l],
			 (size_t)shardd_group_info(rk->g[l])->grad_size, 1);
}

/* Reap one completion into its in-flight slot. 0 or the wait's error. */
static int rank_reap(struct rank *rk)
{
	struct shardd_completion cqe;
	struct inflight *f;
	char what[160];
	uint64_t t0;
	int ret;

	t0 = now_ns();
	ret = shardd_wait(rk->c, &cqe, rk->wait_ms);
	rk->shardd_ns += now_ns() - t0;
	if (ret < 0) {
		size_t n = 0;
		char pending[256] = "";

		for (unsigned i = 0; i < RANK_INFLIGHT && n < sizeof(pending) - 64; i++)
			if (rk->ops[i].used && !rk->ops[i].done)
				n += snprintf(pending + n, sizeof(pending) - n, "%s%s",
					      n ? ", " : "",
					      op_what(&rk->ops[i], what, sizeof(what)));
		rank_fail(rk, ret, "waiting up to %d ms for %s: %s", rk->wait_ms, pending,
			  shardd_last_error()[0] ? shardd_last_error() : shardd_strerror(ret));
		return ret;
	}
	if (cqe.user_data == 0 || cqe.user_data > RANK_INFLIGHT ||
	    !rk->ops[cqe.user_data - 1].used || rk->ops[cqe.user_data - 1].done) {
		rank_fail(rk, -EPROTO,
			  "completion with unexpected user_data %" PRIu64 " (op %u, step %" PRIu64
			  ")",
			  cqe.user_data, cqe.op, cqe.step);
		return -EPROTO;
	}
	f = &rk->ops[cqe.user_data - 1];
	f->done = 1;
	f->res = cqe.res;
	if (cqe.res < 0)
		rank_fail(rk, cqe.res, "%s failed: %s", op_what(f, what, sizeof(what)),
			  cqe.msg[0] ? cqe.msg : shardd_strerror(cqe.res));
	else if (f->op == SHARDD_OP_STEP && cqe.res == SHARDD_STEP_SKIPPED)
		rank_fail(rk, -EIO, "%s was skipped: its grad is not finite",
			  op_what(f, what, sizeof(what)));
	return 0;
}

/* A full SQ is not an error: reap a completion and retry. SHARDD_OP_STEP: the daemon's SGD, lr MLP_LR. */
int rank_submit(struct rank *rk, uint32_t op, uint32_t layer, uint64_t step, uint32_t flags)
{
	struct inflight *f = NULL;
	char what[160];
	int slot, ret;

	for (slot = 0; slot < RANK_INFLIGHT; slot++) {
		if (!rk->ops[slot].used) {
			f = &rk->ops[slot];
			break;
		}
	}
	if (!f) {
		rank_fail(rk, -ENOSPC, "more than %d ops in flight", RANK_INFLIGHT);
		return -ENOSPC;
	}
	*f = (struct inflight){ .used = 1, .op = op, .layer = layer, .step = step };
	for (;;) {
		uint64_t t0 = now_ns();

		if (op == SHARDD_OP_STEP)
			ret = shardd_step_submit(rk->g[layer], step, (double)MLP_LR, flags, 0, 0,
						 (uint64_t)slot + 1);
		else if (layer < MLP_LAYERS)
			ret = shardd_group_submit(rk->g[layer], op, step, flags,
						  (uint64_t)slot + 1);
		else
			ret = shardd_client_submit(rk->c, op, step, flags, (uint64_t)slot + 1);
		rk->shardd_ns += now_ns() - t0;
		if (ret != -EAGAIN)
			break;
		ret = rank_reap(rk); /* reports its own failure */
		if (ret < 0)
			goto err;
	}
	if (ret < 0) {
		rank_fail(rk, ret, "submit %s: %s", op_what(f, what, sizeof(what)),
			  shardd_last_error());
		goto err;
	}
	return slot;
err:
	f->used = 0;
	return ret;
}

/* Wait for the op in `slot`, free the slot; its result. */
static int rank_wait(struct rank *rk, int slot)
{
	struct inflight *f = &rk->ops[slot];
	int ret;

	while (!f->done) {
		ret = rank_reap(rk);
		if (ret < 0)
			return ret;
	}
	f->used = 0;
	return f->res;
}

/* Wait for every op in flight. The attempt's first error, or 0. */
static int rank_drain(struct rank *rk)
{
	for (int i = 0; i < RANK_INFLIGHT; i++) {
		if (rk->ops[i].used && rank_wait(rk, i) < 0 && !rk->ops[i].done) {
			/* The wait itself failed: nothing more will complete. */
			for (int j = 0; j < RANK_INFLIGHT; j++)
				rk->ops[j].used = 0;
			break;
		}
	}
	return rk->failed;
}

int rank_sync_op(struct rank *rk, uint32_t op, uint32_t layer, uint64_t step)
{
	int slot = rank_submit(rk, op, layer, step, 0);

	return slot < 0 ? slot : rank_wait(rk, slot);
}

/* p -= lr * grad over n floats: the whole shard, padding included (its grad is zero). */
static void sgd(float *p, const float *gr, uint64_t n)
{
	for (uint64_t k = 0; k < n; k++)
		p[k] -= MLP_LR * gr[k];
}

/* SGD on this rank's flat shards; cuda: through host copies of the shard and its grad. */
static int rank_sgd(struct rank *rk)
{
	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		for (uint32_t i = 0; i < 2; i++) {
			float *p = shardd_group_shard(rk->g[l], i);
			float *gr = shardd_group_shard_grad(rk->g[l], i);
			size_t bytes = (size_t)shardd_group_layout(rk->g[l], i)->shard_bytes;
			float *hp, *hg;

			if (!rk->cuda) {
				sgd(p, gr, bytes / sizeof(float));
				continue;
			}
			hp = malloc(bytes);
			hg = malloc(bytes);
			if (!hp || !hg)
				rank_fail(rk, -ENOMEM, "out of memory for a %zu-byte shard", bytes);
			else if (!rank_copy(rk, hp, p, bytes, 0) &&
				 !rank_copy(rk, hg, gr, bytes, 0)) {
				sgd(hp, hg, bytes / sizeof(float));
				rank_copy(rk, p, hp, bytes, 1);
			}
			free(hp);
			free(hg);
			if (rk->failed)
				return rk->failed;
		}
	}
	return 0;
}

/*
 * The daemon's SGD (p -= lr * grad on the valid rows, the same fp32
 * expression as sgd() above) on every layer's shard for step number `n`
 * (attempt `attempt` of training step n - 1); it clears the sharded grads.
 * The three steps are in flight together. A step the daemon already applied
 * (a replacement rank catching up) changes nothing.
 */
static int rank_daemon_sgd(struct rank *rk, uint64_t n, uint32_t attempt)
{
	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		if (rank_submit(rk, SHARDD_OP_STEP, l, n, 0) < 0)
			break;
		rank_at(rk, RANK_AT_STEP, n - 1, attempt, l);
	}
	if (rank_drain(rk))
		return rk->failed;
	rank_at(rk, RANK_AT_STEP_DONE, n - 1, attempt, MLP_LAYERS);
	return 0;
}

/*
 * One attempt of training step t. On success the rank's shards hold the
 * step's update. On failure nothing was applied: SGD runs only after every
 * reduce of the step succeeded, so a retried step starts from the same
 * shards.
 */
static int rank_step(struct rank *rk, uint64_t t, uint32_t attempt, double *loss)
{
	const uint64_t kf = op_key(t, attempt, 0), kb = op_key(t, attempt, 1);
	struct mlp_work *wk = &rk->wk;
	int slot;

	rk->failed = 0;
	batch_make(wk, &rk->tc, MLP_SEED, rk->rank, t);

	/* Forward: unshard layer l+1 while layer l computes, reshard after use. */
	slot = rank_submit(rk, SHARDD_OP_UNSHARD, 0, kf, 0);
	if (slot >= 0)
		rank_at(rk, RANK_AT_UNSHARD, t, attempt, 0);
	for (uint32_t l = 0; l < MLP_LAYERS && slot >= 0; l++) {
		if (rank_wait(rk, slot) < 0 || rank_fetch_unsharded(rk, l))
			break;
		slot = l + 1 < MLP_LAYERS ? rank_submit(rk, SHARDD_OP_UNSHARD, l + 1, kf, 0) : 0;
		if (slot >= 0 && l + 1 < MLP_LAYERS)
			rank_at(rk, RANK_AT_UNSHARD, t, attempt, l + 1);
		layer_forward(wk, l, rank_unsharded(rk, l, 0), rank_unsharded(rk, l, 1));
		if (rank_submit(rk, SHARDD_OP_RESHARD, l, kf, 0) < 0)
			break;
	}
	if (rk->failed)
		return rank_drain(rk);
	*loss = loss_and_seed(wk);

	/* Backward: unshard again (new key), prefetch l-1, reduce each layer's grads. */
	slot = rank_submit(rk, SHARDD_OP_UNSHARD, MLP_LAYERS - 1, kb, 0);
	if (slot >= 0)
		rank_at(rk, RANK_AT_UNSHARD, t, attempt, MLP_LAYERS - 1);
	for (uint32_t l = MLP_LAYERS; l-- > 0 && slot >= 0;) {
		if (rank_wait(rk, slot) < 0 || rank_fetch_unsharded(rk, l))
			break;
		slot = l > 0 ? rank_submit(rk, SHARDD_OP_UNSHARD, l - 1, kb, 0) : 0;
		if (slot >= 0 && l > 0)
			rank_at(rk, RANK_AT_UNSHARD, t, attempt, l - 1);
		layer_backward(wk, l, rank_unsharded(rk, l, 0), rank_grad(rk, l, 0),
			       rank_grad(rk, l, 1));
		if (rank_put_grad(rk, l) || rank_submit(rk, SHARDD_OP_RESHARD, l, kb, 0) < 0 ||
		    rk->failed)
			break;
		if (rk->hooks && rk->hooks->before_reduce) {
			int took = rk->hooks->before_reduce(rk, t, attempt, l, kb, rk->hooks->arg);

			if (took < 0)
				break;
			if (took > 0)
				continue;
		}
		if (rank_submit(rk, SHARDD_OP_REDUCE, l, kb, rank_reduce_flags(rk)) < 0)
			break;
		rank_at(rk, RANK_AT_REDUCE, t, attempt, l);
	}
	if (rank_drain(rk))
		return rk->failed;

	rank_at(rk, RANK_AT_BEFORE_STEP, t, attempt, MLP_LAYERS);
	if (!rk->trainer_sgd)
		return rank_daemon_sgd(rk, t + 1, attempt);
	if (rank_sgd(rk))
		return rk->failed;
	for (uint32_t l = 0; l < MLP_LAYERS; l++)
		if (rank_sync_op(rk, SHARDD_OP_ZERO_GRAD, l, 0) < 0)
			return rk->failed;
	return 0;
}

/*
 * Before a retry of step t: clear the sharded grads that the failed attempt's
 * successful reduces assigned (a reduce accumulates into present grads),
 * then meet every rank, the restarted one included, at a barrier whose
 * number is unique to (t, attempt).
 */
static int rank_resync(struct rank *rk, uint64_t t, uint32_t attempt)
{
	rk->failed = 0;
	for (uint32_t l = 0; l < MLP_LAYERS; l++)
		if (rank_sync_op(rk, SHARDD_OP_ZERO_GRAD, l, 0) < 0)
			return rk->failed;
	if (rank_sync_op(rk, SHARDD_OP_BARRIER, MLP_LAYERS, op_key(t, attempt, 0)) < 0)
		return rk->failed;
	return 0;
}

/* A loss report (attempt 0) or a retry report (attempt > 0: see struct loss_report). */
static int rank_report(struct rank *rk, uint64_t t, uint32_t attempt, double loss, uint64_t step_ns)
{
	struct loss_report rep = {
		.rank = rk->rank,
		.attempt = attempt,
		.step = t,
		.loss = loss,
		.step_ns = step_ns,
		.shardd_ns = rk->shardd_ns,
	};

	if (rk->report_fd < 0 && attempt > 0)
		return 0; /* rank_main printed the retry */
	if (rk->report_fd < 0) {
		printf("rank %u step %" PRIu64
		       " loss %.6f time_us %.1f compute_us %.1f shardd_us %.1f\n",
		       rk->rank, t, loss, step_ns / 1e3, (step_ns - rk->shardd_ns) / 1e3,
		       rk->shardd_ns / 1e3);
		fflush(stdout);
		return 0;
	}
	/* One write under PIPE_BUF is atomic: reports of ranks never interleave. */
	if (write(rk->report_fd, &rep, sizeof(rep)) != (ssize_t)sizeof(rep)) {
		fprintf(stderr, "train_mlp: rank %u: loss report to the supervisor failed: %s\n",
			rk->rank, strerror(errno));
		return -EPIPE;
	}
	return 0;
}

/*
 * Attempt *attempt of step t failed (rk->fail_msg says why): retry it as
 * the next attempt, reported to the launcher (which restarts a dead rank
 * into it), once every rank met at its barrier (rank_resync). A rank paused
 * past the collective timeout may come back after that barrier timed out
 * too: then every rank that met the timeout (or, late, the daemon's
 * "gave up waiting for it") moves on to the next attempt's barrier alike,
 * where they all meet. 0, or the error that ended the retries.
 */
static int rank_retry(struct rank *rk, uint64_t t, uint32_t *attempt)
{
	int ret;

	do {
		if (*attempt + 1 >= MLP_MAX_ATTEMPTS)
			return rk->failed;
		++*attempt;
		fprintf(stderr,
			"train_mlp: rank %u: step %" PRIu64 " failed (%s); nothing applied,"
			" retrying it as attempt %u once every rank is back (--resume-step %" PRIu64
			" --attempt %u)\n",
			rk->rank, t, rk->fail_msg, *attempt, t, *attempt);
		ret = rank_report(rk, t, *attempt, 0.0, 0);
		if (ret < 0)
			return ret;
		ret = rank_resync(rk, t, *attempt);
	} while (ret == -SHARDD_E_TIMEOUT);
	return ret;
}

/* Attach; a restarted rank retries while the daemon still holds its old session. */
static int rank_connect(struct rank *rk)
{
	struct shardd_attach_opts ao = {
		.socket_path = rk->o->socket,
		.job = rk->o->job,
		.rank = rk->rank,
		.replicate = rk->o->replicate,
		.shard = rk->o->world / rk->o->replicate,
		.device = rk->o->device,
	};
	struct timespec pause = { .tv_nsec = 10 * 1000 * 1000 };
	int ret;

	for (int waited = 0;; waited += 10) {
		ret = shardd_connect(&ao, &rk->c);
		if (ret != -SHARDD_E_RANK_TAKEN || rk->o->resume_step == -1 ||
		    waited >= MLP_RECONNECT_MS)
			break;
		nanosleep(&pause, NULL);
	}
	if (ret < 0) {
		fprintf(stderr, "train_mlp: rank %u: attach to job '%s' failed: %s\n", rk->rank,
			rk->o->job, shardd_last_error());
		return ret;
	}
	rk->cuda = shardd_client_backend(rk->c) == SHARDD_BACKEND_CUDA;
	rk->trainer_sgd = rk->o->trainer_sgd;
	if (rk->cuda && rk->o->device < 0) {
		fprintf(stderr,
			"train_mlp: rank %u: the daemon runs --backend cuda: give --device N\n",
			rk->rank);
		return -EINVAL;
	}
#ifdef SHARDD_HAVE_CUDA
	if (rk->cuda && cudaSetDevice(rk->o->device) != cudaSuccess) {
		fprintf(stderr, "train_mlp: rank %u: cudaSetDevice(%d) failed\n", rk->rank,
			rk->o->device);
		return -ENODEV;
	}
#endif
	return 0;
}

/* cuda: host copies of every layer's unsharded and grad buffers. */
static int rank_host_copies(struct rank *rk)
{
	for (uint32_t l = 0; l < MLP_LAYERS && rk->cuda; l++) {
		rk->unsharded[l] = malloc((size_t)shardd_group_info(rk->g[l])->unsharded_size);
		rk->grad[l] = malloc((size_t)shardd_group_info(rk->g[l])->grad_size);
		if (!rk->unsharded[l] || !rk->grad[l]) {
			fprintf(stderr, "train_mlp: rank %u: out of memory for host copies\n",
				rk->rank);
			return -ENOMEM;
		}
	}
	return 0;
}

/*
 * Register (or, re-attached, open) the layers' groups. With --resume they
 * register from the job's newest checkpoint: *start is then its step (the
 * same for every layer), and the init is loaded only when there was none
 * (*start 0). Else *start is 0.
 */
static int rank_groups(struct rank *rk, uint64_t *start)
{
	struct mlp_params *init = NULL;
	int ret = 0;

	*start = 0;
	if (rk->o->resume_step == -1) {
		init = malloc(sizeof(*init));
		if (!init)
			return -ENOMEM;
		/* Every rank builds the same full init from the seed and loads its rows. */
		mlp_init(init, MLP_SEED);
	}
	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		char wname[SHARDD_PARAM_NAME_MAX], bname[SHARDD_PARAM_NAME_MAX];
		struct shardd_param_desc pd[2] = {
			{ .name = wname,
			  .dtype = SHARDD_DTYPE_FP32,
			  .ndim = 2,
			  .shape = { layer_out(l), layer_in(l) } },
			{ .name = bname,
			  .dtype = SHARDD_DTYPE_FP32,
			  .ndim = 1,
			  .shape = { layer_out(l) } },
		};
		static const struct shardd_optim_config sgd_cfg = { .kind = SHARDD_OPTIM_SGD };
		struct shardd_group_opts opts = { .optimizer = rk->trainer_sgd ? NULL : &sgd_cfg,
						  .restore = rk->o->resume ? "" : NULL };

		/* Unique across the job (a checkpoint's files need it), named like torch's state_dict keys. */
		snprintf(wname, sizeof(wname), "%s.weight", mlp_group_names[l]);
		snprintf(bname, sizeof(bname), "%s.bias", mlp_group_names[l]);
		if (!init) {
			/* Re-attached: the daemon kept this rank's shards. */
			ret = shardd_group_open(rk->c, mlp_group_names[l], &rk->g[l]);
		} else {
			ret = shardd_group_register(rk->c, mlp_group_names[l], pd, 2, NULL, &opts,
						    &rk->g[l]);
			if (ret == 0 && l > 0 && shardd_group_last_step(rk->g[l]) != *start) {
				fprintf(stderr,
					"train_mlp: rank %u: the job's checkpoint has group '%s' at step %" PRIu64
					" and group '%s' at step %" PRIu64 "; it was not written by"
					" train_mlp --checkpoint-every: use another --job name\n",
					rk->rank, mlp_group_names[0], *start, mlp_group_names[l],
					shardd_group_last_step(rk->g[l]));
				ret = -SHARDD_E_MISMATCH;
				break;
			}
			if (ret == 0 && l == 0)
				*start = shardd_group_last_step(rk->g[l]);
			/* No checkpoint restored (a first run, or no --resume): the seeded init. */
			if (ret == 0 && *start == 0)
				ret = shardd_group_load_full(rk->g[l], 0, init->w[l]);
			if (ret == 0 && *start == 0)
				ret = shardd_group_load_full(rk->g[l], 1, init->b[l]);
		}
		if (ret < 0) {
			fprintf(stderr, "train_mlp: rank %u: group '%s': %s\n", rk->rank,
				mlp_group_names[l], shardd_last_error());
			break;
		}
		if (shardd_group_nparams(rk->g[l]) != 2 ||
		    shardd_group_layout(rk->g[l], 0)->unsharded_bytes !=
			    sizeof(float) * layer_out(l) * layer_in(l) ||
		    shardd_group_layout(rk->g[l], 1)->unsharded_bytes !=
			    sizeof(float) * layer_out(l)) {
			fprintf(stderr,
				"train_mlp: rank %u: group '%s' in the daemon does not have this"
				" model's shape (%ux%u weight, %u bias); use a fresh --job name\n",
				rk->rank, mlp_group_names[l], layer_out(l), layer_in(l),
				layer_out(l));
			ret = -SHARDD_E_MISMATCH;
			break;
		}
	}
	free(init);
	return ret;
}

/*
 * HSDP's final: a job-wide reduce of layer l's last grads, cleared again,
 * that every rank must reach. 0, or the error recorded.
 */
static int rank_final_all_reduce(struct rank *rk, uint32_t l, uint32_t attempt)
{
	int slot = rank_submit(rk, SHARDD_OP_REDUCE, l, op_key(rk->o->steps, attempt, 1),
			       rank_reduce_flags(rk));

	if (slot < 0 || rank_wait(rk, slot) < 0 || rank_sync_op(rk, SHARDD_OP_ZERO_GRAD, l, 0) < 0)
		return rk->failed;
	return 0;
}

/*
 * The final params, from one more unshard (attempt `attempt` of it); rank 0
 * writes them when --dump was given.
 */
static int rank_final(struct rank *rk, uint32_t attempt)
{
	const float *w[MLP_LAYERS], *b[MLP_LAYERS];
	const uint64_t key = op_key(rk->o->steps, attempt, 0);
	int ret = 0;

	rk->failed = 0;
	/*
	 * HSDP: an unshard gathers one replica only, so a rank that died after
	 * the last step's reduces would fail the final unshard of its replica
	 * while the other replicas finished and left, and its replacement would
	 * find nobody at the retry's barrier. A job-wide reduce first (fc2's
	 * last grads, cleared again) fails on every rank at once instead, and
	 * they all retry the final together.
	 */
	if (rk->o->replicate > 1 && rank_final_all_reduce(rk, MLP_LAYERS - 1, attempt))
		return rk->failed;
	for (uint32_t l = 0; l < MLP_LAYERS; l++)
		if (rank_submit(rk, SHARDD_OP_UNSHARD, l, key, 0) < 0)
			break;
	if (rank_drain(rk))
		return rk->failed;
	/*
	 * HSDP again: a rank paused (not dead) after that reduce misses only
	 * its replica's unshard, and the other replicas would leave as above.
	 * A second job-wide reduce (fc0's, another group) holds them until
	 * every replica has its params: it times out on them too, and they
	 * all retry the final.
	 */
	if (rk->o->replicate > 1 && rank_final_all_reduce(rk, 0, attempt))
		return rk->failed;
	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		if (rank_fetch_unsharded(rk, l))
			return rk->failed;
		w[l] = rank_unsharded(rk, l, 0);
		b[l] = rank_unsharded(rk, l, 1);
	}
	if (rk->rank == 0 && rk->o->dump)
		ret = mlp_dump_write(rk->o->dump, w, b);
	for (uint32_t l = 0; l < MLP_LAYERS; l++)
		if (rank_submit(rk, SHARDD_OP_RESHARD, l, key, 0) < 0)
			break;
	if (rank_drain(rk))
		return rk->failed;
	return ret;
}

/*
 * A restarted rank: where to resume (*t, *attempt), the update its
 * predecessor owed, then the barrier where the others wait.
 *
 * o->resume_step is the step the other ranks failed in and retry (their
 * retry reports, through the launcher), so every reduce of step
 * resume_step - 1 completed: where the daemon applied an earlier step last
 * on this rank's shard of a layer, the predecessor died between that
 * reduce and its step, and the reduced grad is still in the daemon; the
 * step is applied now (exactly once: a layer that has it completes
 * SHARDD_STEP_ALREADY). With MLP_RESUME_OWN (no other rank), the rank
 * resumes after the latest step applied on any of its layers: the reduces
 * of that step completed, and a step the predecessor died in before any
 * update is simply redone.
 */
static int rank_rejoin(struct rank *rk, uint64_t *t, uint32_t *attempt)
{
	uint64_t last = 0;
	int ret;

	*t = (uint64_t)rk->o->resume_step;
	*attempt = rk->o->attempt;
	if (rk->o->resume_step == MLP_RESUME_OWN) {
		for (uint32_t l = 0; l < MLP_LAYERS; l++)
			if (shardd_group_last_step(rk->g[l]) > last)
				last = shardd_group_last_step(rk->g[l]);
		*t = last > rk->o->steps ? rk->o->steps : last;
	}
	for (uint32_t l = 0; l < MLP_LAYERS && !rk->trainer_sgd && *t > 0; l++) {
		if (shardd_group_last_step(rk->g[l]) >= *t)
			continue;
		fprintf(stderr,
			"train_mlp: rank %u: layer %u: the daemon applied step %" PRIu64
			" last; applying step %" PRIu64 "\n",
			rk->rank, l, shardd_group_last_step(rk->g[l]), *t);
		ret = rank_daemon_sgd(rk, *t, *attempt);
		if (ret < 0)
			return ret;
		break;
	}
	ret = rank_resync(rk, *t, *attempt);
	if (ret < 0)
		return ret;
	fprintf(stderr, "train_mlp: rank %u: re-attached; joining attempt %u of step %" PRIu64 "\n",
		rk->rank, *attempt, *t);
	return 0;
}

/*
 * Tell the launcher (or print) the step this rank trains from: `start`, 0
 * or the step of the checkpoint its groups were restored from.
 */
static int rank_start(struct rank *rk, uint64_t start)
{
	struct loss_report rep = { .rank = rk->rank, .attempt = MLP_REPORT_START, .step = start };

	if (start > rk->o->steps) {
		fprintf(stderr,
			"train_mlp: rank %u: the job's checkpoint is of step %" PRIu64
			", past --steps %" PRIu64
			": give more --steps, or another --job name to start afresh\n",
			rk->rank, start, rk->o->steps);
		return -EINVAL;
	}
	if (rk->o->resume && start)
		fprintf(stderr,
			"train_mlp: rank %u: restored the job's checkpoint of step %" PRIu64
			" from the daemon's --state-dir\n",
			rk->rank, start);
	if (rk->o->resume && !start)
		fprintf(stderr,
			"train_mlp: rank %u: no checkpoint of job '%s' in the daemon's --state-dir:"
			" starting afresh\n",
			rk->rank, rk->o->job);
	if (rk->report_fd < 0) {
		if (rk->o->resume)
			printf("rank %u resume at step %" PRIu64 "\n", rk->rank, start);
		fflush(stdout);
		return 0;
	}
	if (write(rk->report_fd, &rep, sizeof(rep)) != (ssize_t)sizeof(rep)) {
		fprintf(stderr, "train_mlp: rank %u: start report to the supervisor failed: %s\n",
			rk->rank, strerror(errno));
		return -EPIPE;
	}
	return 0;
}

/*
 * Every rank: the job-wide checkpoint of the daemon's step n, waited for
 * until the daemon wrote it. 0 or the error (printed).
 */
static int rank_checkpoint(struct rank *rk, uint64_t n)
{
	int ret;

	rk->failed = 0;
	ret = rank_sync_op(rk, SHARDD_OP_CHECKPOINT, MLP_LAYERS, n);
	if (ret < 0)
		return ret;
	if (rk->rank == 0)
		fprintf(stderr,
			"train_mlp: checkpoint of step %" PRIu64 " written to the daemon's"
			" --state-dir (job '%s')\n",
			n, rk->o->job);
	return 0;
}

int rank_main(const struct trainer_opts *o, uint32_t rank, int report_fd,
	      const struct rank_hooks *hooks)
{
	struct rank *rk = calloc(1, sizeof(*rk));
	uint64_t t = 0, step_t0 = now_ns();
	uint32_t attempt = 0;
	int ret;

	if (!rk) {
		fprintf(stderr, "train_mlp: rank %u: out of memory\n", rank);
		return -ENOMEM;
	}
	rk->o = o;
	rk->rank = rank;
	rk->report_fd = report_fd;
	rk->hooks = hooks;
	teacher_init(&rk->tc, MLP_SEED);
	ret = rank_connect(rk);
	if (ret < 0)
		goto out;
	rk->wait_ms = (int)shardd_client_collective_timeout_ms(rk->c) + 10000;
	ret = rank_groups(rk, &t);
	if (ret == 0)
		ret = rank_host_copies(rk);
	if (ret < 0)
		goto out;

	if (o->resume_step != -1) {
		ret = rank_rejoin(rk, &t, &attempt);
		if (ret < 0)
			goto out;
	} else {
		ret = rank_start(rk, t);
		if (ret < 0)
			goto out;
	}
	for (;;) {
		double loss = 0.0;
		uint64_t t0;

		/* A step's time and its shardd share cover its retries too. */
		if (attempt == 0) {
			step_t0 = now_ns();
			rk->shardd_ns = 0;
		}
		t0 = step_t0;
		/* Every rank takes part: the final unshard is a collective even where only rank 0 dumps. */
		ret = t < o->steps ? rank_step(rk, t, attempt, &loss) : rank_final(rk, attempt);
		if (ret == 0 && t == o->steps)
			break;
		if (ret == 0) {
			ret = rank_report(rk, t, 0, loss, now_ns() - t0);
			if (ret == 0 && o->checkpoint_every && (t + 1) % o->checkpoint_every == 0)
				ret = rank_checkpoint(rk, t + 1);
			if (ret < 0)
				goto out;
			t++;
			attempt = 0;
			continue;
		}
		/* A rank died or was paused mid-step: it will come back, and the step is redone. */
		if (ret != -SHARDD_E_PEER_DIED && ret != -SHARDD_E_TIMEOUT)
			goto out;
		ret = rank_retry(rk, t, &attempt);
		if (ret < 0)
			goto out;
	}
out:
	for (uint32_t l = 0; l < MLP_LAYERS; l++) {
		shardd_group_close(rk->g[l]);
		free(rk->unsharded[l]);
		free(rk->grad[l]);
	}
	shardd_close(rk->c);
	free(rk);
	return ret;
}
