/* SPDX-License-Identifier: MIT */
/*
 * The op engine driven directly: the test plays every rank of a job
 * (register, map the reply's buffers, write shards and grads, submit ops)
 * and waits for completions on the engine's event fd with a deadline, the
 * way the daemon's loop does. Numbers are checked against tests/lib/
 * reference.c, an independent double-precision model of FSDP2.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "clock.h"
#include "engine.h"
#include "op_table.h"
#include "reference.h"
#include "shardd_kernels.h"
#include "shardd_proto.h"

#define MAXW    16 /* ranks a test job may have */
#define MAXG    32 /* group ids a test may see */
#define WAIT_MS 10000

enum {
	FP32 = SHARDD_DTYPE_FP32,
	BF16 = SHARDD_DTYPE_BF16,
	FP16 = SHARDD_DTYPE_FP16,
	NONE = SHARDD_DTYPE_NONE
};

struct t_map {
	uint8_t *unsharded, *grad, *shard, *sgrad;
	uint64_t usz, gsz, ssz;
};

struct t_group {
	struct shardd_group_reply reply;
	struct shardd_param_layout *layouts[MAXW];
	struct t_map map[MAXW];
	int read_only[MAXW]; /* unsharded fd is O_RDONLY and refuses a writable mapping */
	int sealed[MAXW];    /* every fd carries the three seals */
};

struct t_reply {
	int got, res;
	uint32_t seq, group_id;
	char msg[1024];
};

struct t_cqe {
	uint32_t rank;
	uint64_t token;
	struct shardd_sqe sqe;
	int res;
	char msg[1024];
};

struct t_env {
	struct shd_engine *e;
	struct shd_engine_job *j;
	uint32_t R, S, W;
	struct t_reply rep[MAXW];
	struct t_group grp[MAXG + 1];
	struct t_cqe *cq;
	size_t ncq, capcq;
	uint64_t ud;
};

/* ------------------------------------------------------------------ */
/* Callbacks: what the daemon would send to each rank                  */
/* ------------------------------------------------------------------ */

static void unmap_rank(struct t_group *g, uint32_t r)
{
	struct t_map *m = &g->map[r];

	if (m->unsharded)
		munmap(m->unsharded, m->usz);
	if (m->grad)
		munmap(m->grad, m->gsz);
	if (m->shard)
		munmap(m->shard, m->ssz);
	if (m->sgrad)
		munmap(m->sgrad, m->ssz);
	memset(m, 0, sizeof(*m));
	free(g->layouts[r]);
	g->layouts[r] = NULL;
}

static int has_seals(int fd)
{
	int s = fcntl(fd, F_GET_SEALS);
	int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

	return s >= 0 && (s & want) == want;
}

static void on_reply(void *ctx, uint32_t rank, uint64_t token, uint32_t seq, int res,
		     const char *msg, const struct shardd_group_reply *reply,
		     const struct shardd_param_layout *layouts,
		     const struct shardd_param_spec *specs, const int *fds, int nfds,
		     const struct shardd_cuda_ipc_handle *ipc, int nipc)
{
	struct t_env *env = ctx;
	struct t_reply *rp = &env->rep[rank];
	struct t_group *g;
	struct t_map *m;
	void *w;

	cr_assert_lt(rank, env->W);
	cr_assert_eq(token, 100 + rank, "reply carries the token of the registering attachment");
	rp->got++;
	rp->res = res;
	rp->seq = seq;
	snprintf(rp->msg, sizeof(rp->msg), "%s", msg ? msg : "");
	if (res)
		return;
	/* The host backend sends every buffer as an fd: export kinds all zero, no IPC handle. */
	cr_assert_eq(nfds, 4);
	cr_assert_eq(nipc, 0);
	(void)ipc;
	for (int k = 0; k < SHARDD_GROUP_BUFS; k++)
		cr_assert_eq(reply->export_kind[k], SHARDD_EXPORT_FD, "export_kind[%d]", k);
	cr_assert_not_null(specs, "a GROUP reply carries the registered param specs");
	cr_assert_leq(reply->group_id, MAXG);
	rp->group_id = reply->group_id;
	g = &env->grp[reply->group_id];
	unmap_rank(g, rank);
	g->reply = *reply;
	g->layouts[rank] = malloc(reply->nparams * sizeof(*layouts));
	memcpy(g->layouts[rank], layouts, reply->nparams * sizeof(*layouts));
	m = &g->map[rank];
	m->usz = reply->unsharded_size;
	m->gsz = reply->grad_size;
	m->ssz = reply->shard_size;
	m->unsharded = mmap(NULL, m->usz, PROT_READ, MAP_SHARED, fds[0], 0);
	m->grad = mmap(NULL, m->gsz, PROT_READ | PROT_WRITE, MAP_SHARED, fds[1], 0);
	m->shard = mmap(NULL, m->ssz, PROT_READ | PROT_WRITE, MAP_SHARED, fds[2], 0);
	m->sgrad = mmap(NULL, m->ssz, PROT_READ | PROT_WRITE, MAP_SHARED, fds[3], 0);
	cr_assert(m->unsharded != MAP_FAILED && m->grad != MAP_FAILED && m->shard != MAP_FAILED &&
			  m->sgrad != MAP_FAILED,
		  "map the reply's buffers: %s", strerror(errno));
	w = mmap(NULL, m->usz, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	g->read_only[rank] = (fcntl(fds[0], F_GETFL) & O_ACCMODE) == O_RDONLY && w == MAP_FAILED;
	if (w != MAP_FAILED)
		munmap(w, m->usz);
	g->sealed[rank] =
		has_seals(fds[0]) && has_seals(fds[1]) && has_seals(fds[2]) && has_seals(fds[3]);
}

static void on_complete(void *ctx, uint32_t rank, uint64_t token, const struct shardd_sqe *sqe,
			int res, const char *msg)
{
	struct t_env *env = ctx;
	struct t_cqe *c;

	if (env->ncq == env->capcq) {
		env->capcq = env->capcq ? env->capcq * 2 : 64;
		env->cq = realloc(env->cq, env->capcq * sizeof(*env->cq));
		cr_assert_not_null(env->cq);
	}
	c = &env->cq[env->ncq++];
	c->rank = rank;
	c->token = token;
	c->sqe = *sqe;
	c->res = res;
	snprintf(c->msg, sizeof(c->msg), "%s", msg ? msg : "");
}

/* ------------------------------------------------------------------ */
/* Environment                                                         */
/* ------------------------------------------------------------------ */

static struct t_env *env_new(uint32_t R, uint32_t S, uint32_t timeout_ms)
{
	struct t_env *env = calloc(1, sizeof(*env));
	struct shd_engine_config cfg = {
		.backend = SHARDD_BACKEND_HOST,
		.collective_timeout_ms = timeout_ms,
		.workers = 2,
		.uid = getuid(),
		.complete = on_complete,
		.reply = on_reply,
	};

	cr_assert_not_null(env);
	cr_assert_leq(R * S, MAXW);
	env->R = R;
	env->S = S;
	env->W = R * S;
	cr_assert_eq(shd_engine_create(&cfg, &env->e), 0);
	cr_assert_eq(shd_engine_job_create(env->e, env, "job", R, S, &env->j), 0);
	return env;
}

static void env_free(struct t_env *env)
{
	shd_engine_job_destroy(env->j);
	shd_engine_destroy(env->e);
	for (uint32_t g = 0; g <= MAXG; g++)
		for (uint32_t r = 0; r < MAXW; r++)
			unmap_rank(&env->grp[g], r);
	free(env->cq);
	free(env);
}

/* Wait until `n` completions arrived, as the loop does: eventfd, drain, cron. */
static int wait_cq(struct t_env *env, size_t n, int timeout_ms)
{
	uint64_t deadline = shd_now_ns() + (uint64_t)timeout_ms * 1000000u;
	struct pollfd pfd = { .fd = shd_engine_event_fd(env->e), .events = POLLIN };

	while (env->ncq < n) {
		uint64_t now = shd_now_ns();

		if (now >= deadline)
			return -ETIMEDOUT;
		/* The loop's timer runs cron about every 10 ms here. */
		if (poll(&pfd, 1, 10) > 0)
			shd_engine_drain(env->e);
		shd_engine_cron(env->e, shd_now_ns());
	}
	return 0;
}

static void submit(struct t_env *env, uint32_t rank, uint32_t op, uint32_t group, uint64_t step,
		   uint32_t flags)
{
	struct shardd_sqe sqe = { .op = (uint8_t)op,
				  .group = group,
				  .step = step,
				  .flags = flags,
				  .user_data = ++env->ud };

	shd_engine_submit(env->j, rank, 100 + rank, &sqe);
}

/*
 * As the ring service takes an entry: checked against the op table, failed
 * there with the table's text, else handed to the engine (ops of group
 * scope only: the test submits nothing else).
 */
static void ring_submit(struct t_env *env, uint32_t rank, uint64_t token,
			const struct shardd_sqe *sqe)
{
	char why[SHARDD_RING_MSG_SIZE];

	if (shd_op_check(sqe, why, sizeof(why)) < 0) {
		on_complete(env, rank, token, sqe, -SHARDD_E_INVALID, why);
		return;
	}
	cr_assert_eq(shd_op_info(sqe->op)->scope, SHD_OP_SCOPE_GROUP, "%s is a group op",
		     shd_op_info(sqe->op)->name);
	shd_engine_submit(env->j, rank, token, sqe);
}

/* Submit op on every rank and wait for W successful completions. */
static void all_ranks(struct t_env *env, uint32_t op, uint32_t group, uint64_t step, uint32_t flags)
{
	size_t base = env->ncq;

	for (uint32_t r = 0; r < env->W; r++)
		submit(env, r, op, group, step, flags);
	cr_assert_eq(wait_cq(env, base + env->W, WAIT_MS), 0, "%s on every rank completes",
		     shardd_op_name(op));
	for (size_t i = base; i < base + env->W; i++)
		cr_assert_eq(env->cq[i].res, 0, "%s of rank %u: %d %s", shardd_op_name(op),
			     env->cq[i].rank, env->cq[i].res, env->cq[i].msg);
}

/* ------------------------------------------------------------------ */
/* Registration payloads                                               */
/* ------------------------------------------------------------------ */

struct t_spec {
	uint32_t nparams, param_dtype, reduce_dtype;
	struct shardd_param_spec *specs;
};

static struct shardd_param_spec pspec(const char *name, uint32_t dtype, uint32_t ndim,
				      uint32_t shard_dim, const uint64_t *shape)
{
	struct shardd_param_spec s;

	memset(&s, 0, sizeof(s));
	snprintf(s.name, sizeof(s.name), "%s", name);
	s.dtype = dtype;
	s.ndim = ndim;
	s.shard_dim = shard_dim;
	for (uint32_t d = 0; d < ndim; d++)
		s.shape[d] = shape[d];
	return s;
}

static void *payload(const char *name, const struct t_spec *sp, size_t *len)
{
	struct shardd_register_group hdr;
	uint8_t *p;

	memset(&hdr, 0, sizeof(hdr));
	snprintf(hdr.name, sizeof(hdr.name), "%s", name);
	hdr.nparams = sp->nparams;
	hdr.param_dtype = sp->param_dtype;
	hdr.reduce_dtype = sp->reduce_dtype;
	*len = sizeof(hdr) + sp->nparams * sizeof(struct shardd_param_spec);
	p = malloc(*len);
	cr_assert_not_null(p);
	memcpy(p, &hdr, sizeof(hdr));
	memcpy(p + sizeof(hdr), sp->specs, sp->nparams * sizeof(struct shardd_param_spec));
	return p;
}

static void register_rank(struct t_env *env, uint32_t rank, const char *name,
			  const struct t_spec *sp)
{
	size_t len;
	void *p = payload(name, sp, &len);

	shd_engine_register_group(env->j, rank, 100 + rank, 7 + rank, p, len, getuid(),
				  SHARDD_PROTO_MINOR);
	free(p);
}

/* Every rank registers; returns the group id. */
static uint32_t register_all(struct t_env *env, const char *name, const struct t_spec *sp)
{
	uint32_t id;

	for (uint32_t r = 0; r < env->W; r++) {
		env->rep[r].got = 0;
		register_rank(env, r, name, sp);
	}
	for (uint32_t r = 0; r < env->W; r++) {
		cr_assert_eq(env->rep[r].got, 1, "rank %u got one reply", r);
		cr_assert_eq(env->rep[r].res, 0, "rank %u: %s", r, env->rep[r].msg);
		cr_assert_eq(env->rep[r].seq, 7 + r, "reply echoes the request's seq");
	}
	id = env->rep[0].group_id;
	cr_assert_gt(id, 0);
	for (uint32_t r = 0; r < env->W; r++) {
		cr_assert_eq(env->rep[r].group_id, id);
		cr_assert(env->grp[id].read_only[r], "rank %u's unsharded fd is read-only", r);
		cr_assert(env->grp[id].sealed[r], "rank %u's fds are sealed", r);
	}
	return id;
}

/* ------------------------------------------------------------------ */
/* Data                                                                */
/* ------------------------------------------------------------------ */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return rng_state;
}

/* A value of `dtype` in about [-4, 4], sometimes 0. */
static double rnd_val(uint32_t dtype)
{
	double x = ((double)(rnd() % 20001) - 10000.0) / 10000.0;

	if (rnd() % 16 == 0)
		return 0.0;
	return ref_round(ldexp(x, (int)(rnd() % 5) - 2), dtype);
}

static struct ref_param to_ref(const struct shardd_param_spec *s)
{
	struct ref_param p = { .ndim = s->ndim, .shard_dim = s->shard_dim, .dtype = s->dtype };

	memcpy(p.shape, s->shape, sizeof(p.shape));
	return p;
}

/* A random param for a shard group of S: d0 < S, uneven d0, 0-d, Shard(1). */
static struct shardd_param_spec rnd_param(const char *name, uint32_t dtype, uint32_t S)
{
	uint64_t shape[3];
	uint32_t kind = (uint32_t)(rnd() % 5);

	switch (kind) {
	case 0: /* 0-d */
		return pspec(name, dtype, 0, 0, shape);
	case 1: /* d0 < S (or 1) */
		shape[0] = 1 + rnd() % S;
		shape[1] = 1 + rnd() % 5;
		return pspec(name, dtype, 2, 0, shape);
	case 2: /* Shard(1): even along dim 1 */
		shape[0] = 1 + rnd() % 4;
		shape[1] = S * (1 + rnd() % 3);
		shape[2] = 1 + rnd() % 3;
		return pspec(name, dtype, 3, 1, shape);
	default: /* uneven d0 */
		shape[0] = 1 + rnd() % (3 * S + 7);
		if (kind == 3)
			return pspec(name, dtype, 1, 0, shape);
		shape[1] = 1 + rnd() % 6;
		return pspec(name, dtype, 2, 0, shape);
	}
}

static uint64_t numel_of(const struct shardd_param_spec *s)
{
	struct ref_param p = to_ref(s);
	struct ref_dims d;

	ref_dims(&p, 1, &d);
	return d.numel;
}

/* Check each rank's reply layouts against the reference chunking. */
static void check_layouts(struct t_env *env, uint32_t id, const struct t_spec *sp)
{
	struct t_group *g = &env->grp[id];

	cr_assert_eq(g->reply.shard_world, env->S);
	for (uint32_t r = 0; r < env->W; r++) {
		for (uint32_t i = 0; i < sp->nparams; i++) {
			struct ref_param p = to_ref(&sp->specs[i]);
			const struct shardd_param_layout *l = &g->layouts[r][i];
			uint32_t udt = sp->param_dtype ? sp->param_dtype : p.dtype;
			struct ref_dims d;

			ref_dims(&p, env->S, &d);
			cr_assert_eq(l->shard_row_begin, (r % env->S) * d.rows,
				     "param %u rank %u row begin", i, r);
			cr_assert_eq(l->shard_rows_valid, ref_rows_valid(&d, r % env->S),
				     "param %u rank %u rows", i, r);
			cr_assert_eq(l->shard_bytes, d.shard_numel * ref_dtype_size(p.dtype));
			cr_assert_eq(l->unsharded_bytes, d.numel * ref_dtype_size(udt));
			cr_assert_eq(l->grad_bytes, d.numel * ref_dtype_size(udt));
			cr_assert_eq(l->shard_offset % SHARDD_ALIGN, 0);
			cr_assert_eq(l->unsharded_offset % SHARDD_ALIGN, 0);
			cr_assert_eq(l->grad_offset % SHARDD_ALIGN, 0);
			cr_assert_leq(l->shard_offset + l->shard_bytes, g->reply.shard_size);
			cr_assert_leq(l->unsharded_offset + l->unsharded_bytes,
				      g->reply.unsharded_size);
		}
	}
}

/* Write every rank's shard of full[u][i] (replica u's values of param i) into its flat shard. */
static void write_shards(struct t_env *env, uint32_t id, const struct t_spec *sp, double **full)
{
	struct t_group *g = &env->grp[id];

	for (uint32_t r = 0; r < env->W; r++) {
		for (uint32_t i = 0; i < sp->nparams; i++) {
			struct ref_param p = to_ref(&sp->specs[i]);
			struct ref_dims d;
			double *sh;

			ref_dims(&p, env->S, &d);
			sh = calloc(d.shard_numel + 1, sizeof(*sh));
			ref_shard(&d, r % env->S, full[(r / env->S) * sp->nparams + i], sh);
			for (uint64_t e = 0; e < d.shard_numel; e++)
				ref_store(g->map[r].shard + g->layouts[r][i].shard_offset +
						  e * ref_dtype_size(p.dtype),
					  p.dtype, sh[e]);
			free(sh);
		}
	}
}

/* Every replica's unsharded buffer equals its params rounded to the unsharded dtype; fp32 bit for bit. */
static void check_unsharded(struct t_env *env, uint32_t id, const struct t_spec *sp, double **full)
{
	struct t_group *g = &env->grp[id];

	for (uint32_t r = 0; r < env->W; r++) {
		for (uint32_t i = 0; i < sp->nparams; i++) {
			uint32_t udt = sp->param_dtype ? sp->param_dtype : sp->specs[i].dtype;
			const uint8_t *base =
				g->map[r].unsharded + g->layouts[r][i].unsharded_offset;
			const double *f = full[(r / env->S) * sp->nparams + i];
			uint64_t n = numel_of(&sp->specs[i]);

			for (uint64_t e = 0; e < n; e++) {
				double got = ref_load(base + e * ref_dtype_size(udt), udt);
				double want = ref_round(f[e], udt);

				cr_assert(got == want,
					  "rank %u param %u elem %llu: got %.9g want %.9g", r, i,
					  (unsigned long long)e, got, want);
				if (udt == FP32) {
					float w = (float)want;

					cr_assert_eq(memcmp(base + e * 4, &w, 4), 0,
						     "fp32 unshard is bit-exact");
				}
			}
		}
	}
}

static double **alloc_full(const struct t_spec *sp, uint32_t copies)
{
	double **full = calloc((size_t)copies * sp->nparams, sizeof(*full));

	for (uint32_t c = 0; c < copies; c++)
		for (uint32_t i = 0; i < sp->nparams; i++)
			full[c * sp->nparams + i] =
				calloc(numel_of(&sp->specs[i]) + 1, sizeof(double));
	return full;
}

static void free_full(const struct t_spec *sp, uint32_t copies, double **full)
{
	for (uint32_t k = 0; k < copies * sp->nparams; k++)
		free(full[k]);
	free(full);
}

/* ------------------------------------------------------------------ */
/* Unshard                                                             */
/* ------------------------------------------------------------------ */

static void unshard_case(uint32_t R, uint32_t S, uint32_t nparams, uint32_t dtype,
			 uint32_t param_dtype)
{
	struct t_env *env = env_new(R, S, 5000);
	struct shardd_param_spec specs[16];
	struct t_spec sp = { nparams, param_dtype, NONE, specs };
	double **full;
	uint32_t id;
	char name[16];

	for (uint32_t i = 0; i < nparams; i++) {
		snprintf(name, sizeof(name), "p%u", i);
		/* With a param_dtype policy, params may differ in their own dtype. */
		specs[i] = rnd_param(name, param_dtype && (rnd() & 1) ? BF16 : dtype, S);
	}
	id = register_all(env, "g", &sp);
	check_layouts(env, id, &sp);
	full = alloc_full(&sp, R);
	for (uint32_t step = 1; step <= 2; step++) {
		/* Each replica gets its own values: its unsharded buffer is its own. */
		for (uint32_t u = 0; u < R; u++)
			for (uint32_t i = 0; i < nparams; i++)
				for (uint64_t e = 0; e < numel_of(&specs[i]); e++)
					full[u * nparams + i][e] = rnd_val(specs[i].dtype);
		write_shards(env, id, &sp, full);
		all_ranks(env, SHARDD_OP_UNSHARD, id, step, 0);
		check_unsharded(env, id, &sp, full);
	}
	free_full(&sp, R, full);
	env_free(env);
}

Test(engine, unshard_fp32_is_bit_exact_on_random_shapes, .timeout = 60)
{
	for (uint32_t S = 1; S <= 8; S++)
		unshard_case(1, S, 6, FP32, NONE);
}

Test(engine, unshard_casts_to_param_dtype, .timeout = 60)
{
	unshard_case(1, 3, 6, FP32, BF16);
	unshard_case(1, 4, 6, FP32, FP16);
	unshard_case(1, 5, 6, BF16, NONE);
	unshard_case(1, 2, 6, FP16, NONE);
	unshard_case(1, 3, 6, BF16, FP32);
}

Test(engine, unshard_hsdp_keeps_one_unsharded_copy_per_replica, .timeout = 60)
{
	unshard_case(2, 2, 5, FP32, NONE);
	unshard_case(2, 3, 5, FP32, BF16);
	unshard_case(4, 2, 5, BF16, NONE);
}

Test(engine, unsharded_buffer_is_shared_by_the_shard_group, .timeout = 30)
{
	struct t_env *env = env_new(2, 2, 5000);
	uint64_t shape[1] = { 8 };
	struct shardd_param_spec specs[1] = { pspec("w", FP32, 1, 0, shape) };
	struct t_spec sp = { 1, NONE, NONE, specs };
	uint32_t id = register_all(env, "g", &sp);
	struct t_group *g = &env->grp[id];
	float v = 3.5f;

	memcpy(g->map[0].shard, &v, 4);
	all_ranks(env, SHARDD_OP_UNSHARD, id, 1, 0);
	/* Ranks 0 and 1 map the same pages; replica 1 (ranks 2, 3) has its own copy. */
	cr_assert_eq(memcmp(g->map[0].unsharded, &v, 4), 0);
	cr_assert_eq(memcmp(g->map[1].unsharded, &v, 4), 0);
	cr_assert_neq(memcmp(g->map[2].unsharded, &v, 4), 0);
	env_free(env);
}

/* ------------------------------------------------------------------ */
/* Reduce against the FSDP2 reference                                  */
/* ------------------------------------------------------------------ */

struct t_reduce {
	struct t_env *env;
	uint32_t id;
	struct t_spec sp;
	uint32_t grad_dtype, reduce_dtype;
	struct ref_grad_state *st; /* [nparams * W] */
	double **grads;            /* [W * nparams] */
};

static void tr_init(struct t_reduce *t, uint32_t R, uint32_t S, struct t_spec sp)
{
	uint32_t W = R * S;

	memset(t, 0, sizeof(*t));
	t->env = env_new(R, S, 5000);
	t->sp = sp;
	t->id = register_all(t->env, "g", &t->sp);
	t->grad_dtype = sp.param_dtype ? sp.param_dtype : sp.specs[0].dtype;
	t->reduce_dtype = sp.reduce_dtype ? sp.reduce_dtype : t->grad_dtype;
	cr_assert_eq(t->env->grp[t->id].reply.grad_dtype, t->grad_dtype);
	t->st = calloc((size_t)sp.nparams * W, sizeof(*t->st));
	t->grads = alloc_full(&sp, W);
	for (uint32_t i = 0; i < sp.nparams; i++) {
		struct ref_param p = to_ref(&sp.specs[i]);
		struct ref_dims d;

		ref_dims(&p, S, &d);
		for (uint32_t r = 0; r < W; r++) {
			t->st[i * W + r].sgrad = calloc(d.shard_numel + 1, sizeof(struct ref_val));
			t->st[i * W + r].partial =
				calloc(d.shard_numel + 1, sizeof(struct ref_val));
		}
	}
}

static void tr_free(struct t_reduce *t)
{
	uint32_t W = t->env->W;

	for (uint32_t k = 0; k < t->sp.nparams * W; k++) {
		free(t->st[k].sgrad);
		free(t->st[k].partial);
	}
	free(t->st);
	free_full(&t->sp, W, t->grads);
	env_free(t->env);
}

/*
 * Every rank's sharded grads against the reference, within the bound the
 * reference derives for each element (reference.c): exact where fp32
 * arithmetic is exact (one rank, power-of-two divides, short bf16/fp16
 * sums), else the fp32 summation bound (n - 1) * 2^-24 * sum |x_k| plus one
 * ulp of each dtype rounded into afterwards.
 */
static void tr_check(struct t_reduce *t, const char *when)
{
	struct t_env *env = t->env;
	struct t_group *g = &env->grp[t->id];

	for (uint32_t r = 0; r < env->W; r++) {
		for (uint32_t i = 0; i < t->sp.nparams; i++) {
			struct ref_param p = to_ref(&t->sp.specs[i]);
			const struct ref_grad_state *st = &t->st[i * env->W + r];
			const uint8_t *base = g->map[r].sgrad + g->layouts[r][i].shard_offset;
			struct ref_dims d;

			ref_dims(&p, env->S, &d);
			for (uint64_t e = 0; e < d.shard_numel; e++) {
				double got = ref_load(base + e * ref_dtype_size(p.dtype), p.dtype);
				struct ref_val want =
					st->present ? st->sgrad[e] : (struct ref_val){ 0, 0 };

				cr_assert(
					fabs(got - want.v) <= want.err,
					"%s: mesh %ux%u rank %u param %u (%s) elem %llu: got %.9g want %.9g +- %.3g (grad %s, reduce %s)",
					when, env->R, env->S, r, i, t->sp.specs[i].name,
					(unsigned long long)e, got, want.v, want.err,
					shardd_dtype_name(t->grad_dtype),
					shardd_dtype_name(t->reduce_dtype));
			}
		}
	}
}

/* One microbatch: fresh grads on every rank, reduce, reference. */
static void tr_reduce(struct t_reduce *t, uint64_t step, int all_reduce)
{
	struct t_env *env = t->env;
	struct t_group *g = &env->grp[t->id];
	uint32_t W = env->W;
	struct ref_reduce_cfg c = { env->R, env->S, t->grad_dtype, t->reduce_dtype, all_reduce };

	for (uint32_t r = 0; r < W; r++) {
		for (uint32_t i = 0; i < t->sp.nparams; i++) {
			double *gr = t->grads[r * t->sp.nparams + i];
			uint64_t n = numel_of(&t->sp.specs[i]);

			for (uint64_t e = 0; e < n; e++) {
				gr[e] = rnd_val(t->grad_dtype);
				ref_store(g->map[r].grad + g->layouts[r][i].grad_offset +
						  e * ref_dtype_size(t->grad_dtype),
					  t->grad_dtype, gr[e]);
			}
		}
	}
	all_ranks(env, SHARDD_OP_REDUCE, t->id, step, all_reduce ? SHARDD_REDUCE_ALL_REDUCE : 0);
	for (uint32_t i = 0; i < t->sp.nparams; i++) {
		const double *gp[MAXW];
		struct ref_param p = to_ref(&t->sp.specs[i]);

		for (uint32_t r = 0; r < W; r++)
			gp[r] = t->grads[r * t->sp.nparams + i];
		ref_reduce(&p, &c, gp, &t->st[i * W]);
	}
}

static void tr_zero_grad(struct t_reduce *t)
{
	all_ranks(t->env, SHARDD_OP_ZERO_GRAD, t->id, 0, 0);
	for (uint32_t k = 0; k < t->sp.nparams * t->env->W; k++)
		t->st[k].present = 0;
}

/*
 * A training loop's worth of reduces: `steps` optimizer steps of 1..4
 * microbatches each; HSDP all-reduces on the last microbatch only, or on
 * every one; the second step accumulates into present grads, the third
 * starts after zero_grad.
 */
static void reduce_case(uint32_t R, uint32_t S, uint32_t dtype, uint32_t param_dtype,
			uint32_t reduce_dtype, int all_reduce_every_microbatch)
{
	struct shardd_param_spec specs[6];
	struct t_spec sp = { 6, param_dtype, reduce_dtype, specs };
	struct t_reduce t;
	uint64_t step = 0;
	char name[16], when[64];

	for (uint32_t i = 0; i < sp.nparams; i++) {
		snprintf(name, sizeof(name), "p%u", i);
		specs[i] = rnd_param(name, param_dtype && (rnd() & 1) ? BF16 : dtype, S);
	}
	tr_init(&t, R, S, sp);
	for (int opt_step = 0; opt_step < 3; opt_step++) {
		uint32_t nmb = 1 + (uint32_t)(rnd() % 4);

		if (opt_step == 2)
			tr_zero_grad(&t);
		for (uint32_t mb = 0; mb < nmb; mb++) {
			int last = mb + 1 == nmb;

			tr_reduce(&t, ++step, last || all_reduce_every_microbatch);
			snprintf(when, sizeof(when), "optimizer step %d microbatch %u of %u",
				 opt_step, mb + 1, nmb);
			tr_check(&t, when);
		}
	}
	tr_free(&t);
}

static const uint32_t policies[][3] = {
	/* param's dtype, param_dtype, reduce_dtype */
	{ FP32, NONE, NONE }, { FP32, BF16, FP32 }, { FP32, BF16, NONE }, { BF16, NONE, NONE },
	{ FP16, NONE, NONE }, { FP32, FP16, NONE }, { FP32, NONE, FP16 }, { BF16, NONE, FP32 },
};

Test(engine, reduce_matches_fsdp2_reference_on_1xW, .timeout = 120)
{
	for (uint32_t S = 1; S <= 8; S++)
		for (size_t k = 0; k < sizeof(policies) / sizeof(policies[0]); k++)
			reduce_case(1, S, policies[k][0], policies[k][1], policies[k][2], 0);
}

Test(engine, reduce_matches_fsdp2_reference_on_hsdp_meshes, .timeout = 120)
{
	static const uint32_t meshes[][2] = { { 2, 2 }, { 2, 3 }, { 4, 2 }, { 2, 1 } };

	for (size_t m = 0; m < sizeof(meshes) / sizeof(meshes[0]); m++)
		for (size_t k = 0; k < sizeof(policies) / sizeof(policies[0]); k++)
			for (int every = 0; every < 2; every++)
				reduce_case(meshes[m][0], meshes[m][1], policies[k][0],
					    policies[k][1], policies[k][2], every);
}

Test(engine, reduce_fp16_uses_runtime_divide_factors, .timeout = 60)
{
	/* Worked from the seed's loop by hand: factor doubles while N % f == 0 and N / f > f. */
	static const double known[][3] = {
		{ 1, 1, 1 },  { 2, 2, 1 },  { 3, 2, 1.5 }, { 4, 2, 2 },  { 6, 4, 1.5 }, { 8, 4, 2 },
		{ 12, 4, 3 }, { 16, 4, 4 }, { 32, 8, 4 },  { 64, 8, 8 }, { 48, 8, 6 },
	};
	double pre, post, rpre, rpost;

	for (size_t k = 0; k < sizeof(known) / sizeof(known[0]); k++) {
		ref_divide_factors((uint32_t)known[k][0], FP16, &rpre, &rpost);
		cr_assert(rpre == known[k][1] && rpost == known[k][2], "reference N=%g",
			  known[k][0]);
	}
	for (uint32_t n = 1; n <= 64; n++) {
		shardd_divide_factors(n, FP16, &pre, &post);
		ref_divide_factors(n, FP16, &rpre, &rpost);
		cr_assert(pre == rpre && post == rpost, "N=%u: kernels %g/%g, seed %g/%g", n, pre,
			  post, rpre, rpost);
		shardd_divide_factors(n, BF16, &pre, &post);
		cr_assert(pre == 0 && post == 0, "bf16 averages");
		shardd_divide_factors(n, FP32, &pre, &post);
		cr_assert(pre == 0 && post == 0, "fp32 averages");
	}
	/*
	 * HSDP non-final microbatches pre-divide by the factor of N = S * R
	 * (both groups passed), not of S: 2x4 fp16 with partial accumulation.
	 */
	reduce_case(2, 4, FP16, NONE, NONE, 0);
	reduce_case(4, 2, FP32, FP16, NONE, 0);
	reduce_case(1, 6, FP16, NONE, NONE, 0);
}

Test(engine, reduce_rejects_mixed_grad_dtypes, .timeout = 30)
{
	struct t_env *env = env_new(1, 2, 5000);
	uint64_t shape[1] = { 4 };
	struct shardd_param_spec specs[2] = { pspec("a", FP32, 1, 0, shape),
					      pspec("b", BF16, 1, 0, shape) };
	struct t_spec sp = { 2, NONE, NONE, specs };
	uint32_t id = register_all(env, "mixed", &sp);

	cr_assert_eq(env->grp[id].reply.grad_dtype, NONE, "reply says grads differ");
	submit(env, 0, SHARDD_OP_REDUCE, id, 1, 0);
	cr_assert_eq(wait_cq(env, 1, WAIT_MS), 0);
	cr_assert_eq(env->cq[0].res, -SHARDD_E_INVALID);
	cr_assert(strstr(env->cq[0].msg,
			 "FSDP reduce-scatter expects uniform gradient dtype but got {fp32, bf16}"),
		  "%s", env->cq[0].msg);
	/* With a param_dtype policy the grads are uniform and reduce runs. */
	sp.param_dtype = BF16;
	id = register_all(env, "mixed.policy", &sp);
	all_ranks(env, SHARDD_OP_REDUCE, id, 1, 0);
	env_free(env);
}

Test(engine, zero_grad_runs_after_earlier_ops_of_the_group, .timeout = 30)
{
	struct shardd_param_spec specs[2];
	uint64_t shape[2] = { 5, 3 };
	struct t_spec sp = { 2, NONE, NONE, specs };
	struct t_reduce t;
	size_t base;

	specs[0] = pspec("a", FP32, 2, 0, shape);
	specs[1] = pspec("b", FP32, 1, 0, shape);
	tr_init(&t, 1, 2, sp);
	tr_reduce(&t, 1, 0);
	/* reduce(2) then zero_grad back to back: the group runs them in order. */
	base = t.env->ncq;
	for (uint32_t r = 0; r < 2; r++) {
		for (uint32_t i = 0; i < 2; i++)
			for (uint64_t e = 0; e < numel_of(&specs[i]); e++)
				ref_store(t.env->grp[t.id].map[r].grad +
						  t.env->grp[t.id].layouts[r][i].grad_offset +
						  e * 4,
					  FP32, 1.0);
	}
	for (uint32_t r = 0; r < 2; r++) {
		submit(t.env, r, SHARDD_OP_REDUCE, t.id, 2, 0);
		submit(t.env, r, SHARDD_OP_ZERO_GRAD, t.id, 0, 0);
	}
	cr_assert_eq(wait_cq(t.env, base + 4, WAIT_MS), 0);
	for (size_t k = base; k < base + 4; k++)
		cr_assert_eq(t.env->cq[k].res, 0, "%s", t.env->cq[k].msg);
	for (uint32_t r = 0; r < 2; r++)
		for (uint64_t b = 0; b < t.env->grp[t.id].reply.shard_size; b++)
			cr_assert_eq(t.env->grp[t.id].map[r].sgrad[b], 0, "zero_grad ran last");
	for (uint32_t k = 0; k < 4; k++)
		t.st[k].present = 0;
	/* Absent grads are assigned, not accumulated. */
	tr_reduce(&t, 3, 0);
	tr_check(&t, "after zero_grad");
	tr_free(&t);
}

Test(engine, ops_on_different_groups_interleave, .timeout = 30)
{
	struct t_env *env = env_new(1, 2, 5000);
	/* Above the host's 16 MiB loop cut (24 MB and 18 MB moved): both groups' tasks run on the pool. */
	uint64_t shape[1] = { 3000000 };
	struct shardd_param_spec a[1] = { pspec("w", FP32, 1, 0, shape) };
	struct shardd_param_spec b[1] = { pspec("w", BF16, 1, 0, shape) };
	struct t_spec sa = { 1, NONE, NONE, a }, sb = { 1, NONE, NONE, b };
	uint32_t ga = register_all(env, "layer.0", &sa), gb = register_all(env, "layer.1", &sb);
	double **fa = alloc_full(&sa, 1), **fb = alloc_full(&sb, 1);

	for (uint64_t e = 0; e < shape[0]; e++) {
		fa[0][e] = rnd_val(FP32);
		fb[0][e] = rnd_val(BF16);
	}
	write_shards(env, ga, &sa, fa);
	write_shards(env, gb, &sb, fb);
	/* A prefetching trainer: unshard of the next group submitted before the current one is done. */
	for (uint32_t r = 0; r < 2; r++) {
		submit(env, r, SHARDD_OP_UNSHARD, ga, 1, 0);
		submit(env, r, SHARDD_OP_UNSHARD, gb, 1, 0);
	}
	cr_assert_eq(wait_cq(env, 4, WAIT_MS), 0);
	for (size_t k = 0; k < 4; k++)
		cr_assert_eq(env->cq[k].res, 0, "%s", env->cq[k].msg);
	check_unsharded(env, ga, &sa, fa);
	check_unsharded(env, gb, &sb, fb);
	free_full(&sa, 1, fa);
	free_full(&sb, 1, fb);
	env_free(env);
}

/* ------------------------------------------------------------------ */
/* Registration                                                        */
/* ------------------------------------------------------------------ */

static struct t_spec three_params(struct shardd_param_spec *specs)
{
	uint64_t s1[2] = { 4, 4 }, s2[1] = { 7 }, s3[3] = { 2, 4, 3 };

	specs[0] = pspec("a", FP32, 2, 0, s1);
	specs[1] = pspec("b", FP32, 1, 0, s2);
	specs[2] = pspec("c", FP32, 3, 1, s3);
	return (struct t_spec){ 3, NONE, NONE, specs };
}

static void expect_mismatch(void (*mutate)(struct shardd_param_spec *specs, struct t_spec *sp),
			    const char *w1, const char *w2, const char *w3)
{
	struct t_env *env = env_new(1, 4, 5000);
	struct shardd_param_spec good[3], bad[3];
	struct t_spec sg = three_params(good), sb = three_params(bad);

	mutate(bad, &sb);
	register_rank(env, 0, "g", &sg);
	register_rank(env, 2, "g", &sg);
	cr_assert_eq(env->rep[0].got, 0, "rank 0 waits for the others");
	register_rank(env, 1, "g", &sb);
	for (uint32_t r = 0; r < 3; r++) {
		cr_assert_eq(env->rep[r].got, 1);
		cr_assert_eq(env->rep[r].res, -SHARDD_E_MISMATCH, "rank %u: %s", r,
			     env->rep[r].msg);
		cr_assert(strstr(env->rep[r].msg, w1) && strstr(env->rep[r].msg, w2) &&
				  strstr(env->rep[r].msg, w3),
			  "'%s' names '%s', '%s', '%s'", env->rep[r].msg, w1, w2, w3);
		cr_assert(strstr(env->rep[r].msg, "rank 1") && strstr(env->rep[r].msg, "rank 0"),
			  "names the ranks: %s", env->rep[r].msg);
		cr_assert(strstr(env->rep[r].msg, "0,2,1"), "lists the failed ranks: %s",
			  env->rep[r].msg);
	}
	/* The failed registration is forgotten: a consistent one succeeds. */
	register_all(env, "g", &sg);
	env_free(env);
}

static void bad_dtype(struct shardd_param_spec *s, struct t_spec *sp)
{
	(void)sp;
	s[1].dtype = BF16;
}
static void bad_shape(struct shardd_param_spec *s, struct t_spec *sp)
{
	(void)sp;
	s[2].shape[2] = 5;
}
static void bad_dim(struct shardd_param_spec *s, struct t_spec *sp)
{
	(void)sp;
	s[0].shard_dim = 1;
}
static void bad_name(struct shardd_param_spec *s, struct t_spec *sp)
{
	(void)sp;
	snprintf(s[1].name, 8, "bb");
}
static void bad_count(struct shardd_param_spec *s, struct t_spec *sp)
{
	(void)s;
	sp->nparams = 2;
}
static void bad_policy(struct shardd_param_spec *s, struct t_spec *sp)
{
	(void)s;
	sp->reduce_dtype = BF16;
}

Test(engine, register_spec_mismatch_names_param_field_values_and_ranks, .timeout = 30)
{
	expect_mismatch(bad_dtype, "param #1 'b'", "dtype",
			"bf16 from rank 1 but fp32 from rank 0");
	expect_mismatch(bad_shape, "param #2 'c'", "shape", "[2, 4, 5] from rank 1 but [2, 4, 3]");
	expect_mismatch(bad_dim, "param #0 'a'", "shard_dim", "1 from rank 1 but 0");
	expect_mismatch(bad_name, "param #1", "name", "'bb' from rank 1 but 'b'");
	expect_mismatch(bad_count, "nparams", "2 from rank 1", "3 from rank 0");
	expect_mismatch(bad_policy, "reduce_dtype", "bf16 from rank 1", "none from rank 0");
}

static void expect_reg_error(struct t_env *env, const void *p, size_t len, int code,
			     const char *want)
{
	env->rep[0].got = 0;
	shd_engine_register_group(env->j, 0, 100, 1, p, len, getuid(), SHARDD_PROTO_MINOR);
	cr_assert_eq(env->rep[0].got, 1, "an invalid registration is answered at once");
	cr_assert_eq(env->rep[0].res, code, "%s: %d %s", want, env->rep[0].res, env->rep[0].msg);
	cr_assert(strstr(env->rep[0].msg, want), "'%s' names '%s'", env->rep[0].msg, want);
}

Test(engine, register_validates_the_payload, .timeout = 30)
{
	struct t_env *env = env_new(1, 2, 5000);
	struct shardd_param_spec specs[3];
	struct t_spec sp = three_params(specs);
	struct shardd_register_group *h;
	size_t len;
	uint8_t *p = payload("g", &sp, &len);

	h = (struct shardd_register_group *)(void *)p;
	expect_reg_error(env, p, 10, -SHARDD_E_MALFORMED, "shorter than its 88-byte header");
	expect_reg_error(env, p, len - 1, -SHARDD_E_MALFORMED, "nparams = 3 needs");
	h->nparams = 0;
	expect_reg_error(env, p, len, -SHARDD_E_INVALID, "nparams = 0");
	h->nparams = SHARDD_MAX_PARAMS + 1;
	expect_reg_error(env, p, len, -SHARDD_E_INVALID, "nparams = 65537");
	h->nparams = 3;
	h->param_dtype = 9;
	expect_reg_error(env, p, len, -SHARDD_E_INVALID, "param_dtype = 9");
	h->param_dtype = NONE;
	h->reduce_dtype = 4;
	expect_reg_error(env, p, len, -SHARDD_E_INVALID, "reduce_dtype = 4");
	h->reduce_dtype = NONE;
	memset(h->name, 'x', sizeof(h->name));
	expect_reg_error(env, p, len, -SHARDD_E_INVALID, "not NUL-terminated");
	snprintf(h->name, sizeof(h->name), "g");
	h->flags = 2;
	expect_reg_error(env, p, len, -SHARDD_E_INVALID, "flags = 0x2");
	h->flags = 0;
	/* Param fields are the layout's to check; its message is forwarded. */
	((struct shardd_param_spec *)(void *)(p + sizeof(*h)))[1].dtype = 0;
	expect_reg_error(env, p, len, -SHARDD_E_INVALID, "param 'b': dtype = 0");
	((struct shardd_param_spec *)(void *)(p + sizeof(*h)))[1].dtype = FP32;
	((struct shardd_param_spec *)(void *)(p + sizeof(*h)))[2].shape[1] = 5;
	expect_reg_error(env, p, len, -SHARDD_E_INVALID, "not divisible by the shard group size 2");
	expect_reg_error(env, NULL, 0, -SHARDD_E_MALFORMED, "payload is 0 bytes");
	/* Nothing was left pending: rank 1 alone registering waits (no reply). */
	free(p);
	env_free(env);
}

Test(engine, register_again_is_an_error_and_open_reattaches, .timeout = 30)
{
	struct t_env *env = env_new(1, 2, 5000);
	struct shardd_param_spec specs[3];
	struct t_spec sp = three_params(specs);
	struct shardd_open_group og;
	uint32_t id = register_all(env, "blocks.0", &sp);
	float v = 1.25f;

	memcpy(env->grp[id].map[1].shard, &v, 4);
	register_rank(env, 0, "blocks.0", &sp);
	cr_assert_eq(env->rep[0].res, -EEXIST);
	cr_assert(strstr(env->rep[0].msg, "group 'blocks.0' is already registered") &&
			  strstr(env->rep[0].msg, "OPEN_GROUP"),
		  "%s", env->rep[0].msg);

	memset(&og, 0, sizeof(og));
	snprintf(og.name, sizeof(og.name), "blocks.0");
	env->rep[1].got = 0;
	unmap_rank(&env->grp[id], 1);
	shd_engine_open_group(env->j, 1, 101, 3, &og, sizeof(og), SHARDD_PROTO_MINOR);
	cr_assert_eq(env->rep[1].got, 1);
	cr_assert_eq(env->rep[1].res, 0, "%s", env->rep[1].msg);
	cr_assert_eq(env->rep[1].group_id, id);
	cr_assert_eq(memcmp(env->grp[id].map[1].shard, &v, 4), 0,
		     "re-attached to the same flat shard");
	cr_assert_eq(env->grp[id].layouts[1][2].shard_row_begin, 2, "c: Shard(1), 4 / 2 rows each");

	snprintf(og.name, sizeof(og.name), "blocks.9");
	shd_engine_open_group(env->j, 1, 101, 4, &og, sizeof(og), SHARDD_PROTO_MINOR);
	cr_assert_eq(env->rep[1].res, -SHARDD_E_NOGROUP);
	cr_assert(strstr(env->rep[1].msg, "no group 'blocks.9'") &&
			  strstr(env->rep[1].msg, "'blocks.0'"),
		  "lists the groups: %s", env->rep[1].msg);
	shd_engine_open_group(env->j, 1, 101, 5, &og, 3, SHARDD_PROTO_MINOR);
	cr_assert_eq(env->rep[1].res, -SHARDD_E_MALFORMED);
	env_free(env);
}

Test(engine, register_10000_params, .timeout = 60)
{
	enum {
		N = 10000
	};
	struct t_env *env = env_new(1, 2, 5000);
	struct shardd_param_spec *specs = calloc(N, sizeof(*specs));
	struct t_spec sp = { N, NONE, NONE, specs };
	uint64_t t0, t1;
	double **full;
	uint32_t id;
	char name[32];

	for (uint32_t i = 0; i < N; i++) {
		uint64_t shape[2] = { 1 + i % 5, 3 };

		snprintf(name, sizeof(name), "layers.%u.weight", i);
		specs[i] = pspec(name, FP32, 2, 0, shape);
	}
	t0 = shd_now_ns();
	id = register_all(env, "big", &sp);
	t1 = shd_now_ns();
	cr_log_info("10000-param registration on 2 ranks: %.1f ms", (double)(t1 - t0) / 1e6);
	full = alloc_full(&sp, 1);
	for (uint32_t i = 0; i < N; i++)
		for (uint64_t e = 0; e < numel_of(&specs[i]); e++)
			full[i][e] = rnd_val(FP32);
	write_shards(env, id, &sp, full);
	all_ranks(env, SHARDD_OP_UNSHARD, id, 1, 0);
	check_unsharded(env, id, &sp, full);
	free_full(&sp, 1, full);
	free(specs);
	env_free(env);
}

/* ------------------------------------------------------------------ */
/* Failures                                                            */
/* ------------------------------------------------------------------ */

static uint32_t small_group(struct t_env *env, const char *name)
{
	static struct shardd_param_spec specs[3];
	struct t_spec sp = three_params(specs);

	specs[2].shape[1] = env->S * 2; /* Shard(1) even for any S */
	return register_all(env, name, &sp);
}

Test(engine, step_mismatch_fails_every_rank_naming_them, .timeout = 30)
{
	struct t_env *env = env_new(1, 3, 5000);
	uint32_t id = small_group(env, "g");

	submit(env, 0, SHARDD_OP_UNSHARD, id, 5, 0);
	submit(env, 1, SHARDD_OP_UNSHARD, id, 5, 0);
	submit(env, 2, SHARDD_OP_UNSHARD, id, 6, 0);
	cr_assert_eq(wait_cq(env, 3, WAIT_MS), 0);
	for (size_t k = 0; k < 3; k++) {
		cr_assert_eq(env->cq[k].res, -SHARDD_E_MISMATCH);
		cr_assert(strstr(env->cq[k].msg, "rank 2 submitted step 6") &&
				  strstr(env->cq[k].msg, "rank 0 submitted step 5") &&
				  strstr(env->cq[k].msg, "ranks 0,1,2"),
			  "%s", env->cq[k].msg);
	}
	/* The rendezvous is clean again: the next step runs. */
	all_ranks(env, SHARDD_OP_UNSHARD, id, 7, 0);
	env_free(env);
}

Test(engine, hsdp_flag_mismatch_within_a_shard_group_fails, .timeout = 30)
{
	struct t_env *env = env_new(2, 2, 5000);
	uint32_t id = small_group(env, "g");

	submit(env, 0, SHARDD_OP_REDUCE, id, 3, SHARDD_REDUCE_ALL_REDUCE);
	submit(env, 1, SHARDD_OP_REDUCE, id, 3, 0);
	cr_assert_eq(wait_cq(env, 2, WAIT_MS), 0);
	for (size_t k = 0; k < 2; k++) {
		cr_assert_eq(env->cq[k].res, -SHARDD_E_MISMATCH, "%s", env->cq[k].msg);
		cr_assert(
			strstr(env->cq[k].msg,
			       "rank 1 submitted step 3 flags 0x0 but rank 0 submitted step 3 flags 0x1"),
			"%s", env->cq[k].msg);
	}
	env_free(env);
}

Test(engine, collective_timeout_names_missing_ranks, .timeout = 30)
{
	struct t_env *env = env_new(1, 4, 50);
	uint32_t id = small_group(env, "blocks.7");

	submit(env, 0, SHARDD_OP_REDUCE, id, 12, 0);
	submit(env, 1, SHARDD_OP_REDUCE, id, 12, 0);
	cr_assert_eq(wait_cq(env, 2, WAIT_MS), 0, "the timeout fires");
	for (size_t k = 0; k < 2; k++) {
		cr_assert_eq(env->cq[k].res, -SHARDD_E_TIMEOUT);
		cr_assert(
			strstr(env->cq[k].msg,
			       "ranks 2,3 never submitted reduce(group 'blocks.7', step 12) within 0.05 s; ranks 0,1 are waiting"),
			"%s", env->cq[k].msg);
	}
	/* Registration waits time out too, naming who never came. */
	register_rank(
		env, 3, "late",
		&(struct t_spec){ 1, NONE, NONE,
				  (struct shardd_param_spec[]){ pspec("w", FP32, 0, 0, NULL) } });
	cr_assert_eq(env->rep[3].got, 1, "rank 3's earlier reply only");
	env->rep[3].got = 0;
	{
		uint64_t deadline = shd_now_ns() + 5000000000ull;
		struct pollfd pfd = { .fd = shd_engine_event_fd(env->e), .events = POLLIN };

		while (!env->rep[3].got && shd_now_ns() < deadline) {
			poll(&pfd, 1, 10);
			shd_engine_cron(env->e, shd_now_ns());
		}
	}
	cr_assert_eq(env->rep[3].res, -SHARDD_E_TIMEOUT);
	cr_assert(strstr(env->rep[3].msg, "ranks 0,1,2 never registered group 'late'"), "%s",
		  env->rep[3].msg);
	env_free(env);
}

Test(engine, rank_gone_fails_others_naming_it_and_keeps_shards, .timeout = 30)
{
	struct t_env *env = env_new(1, 3, 5000);
	uint32_t id = small_group(env, "g");
	struct shardd_open_group og;
	float v = 2.5f;

	memcpy(env->grp[id].map[2].shard, &v, 4);
	all_ranks(env, SHARDD_OP_UNSHARD, id, 1, 0);
	submit(env, 0, SHARDD_OP_UNSHARD, id, 2, 0);
	submit(env, 1, SHARDD_OP_UNSHARD, id, 2, 0);
	shd_engine_rank_gone(env->j, 2, 102);
	cr_assert_eq(wait_cq(env, 3 + 2, WAIT_MS), 0);
	for (size_t k = 3; k < 5; k++) {
		cr_assert_eq(env->cq[k].res, -SHARDD_E_PEER_DIED);
		cr_assert(strstr(env->cq[k].msg, "rank 2 left") &&
				  strstr(env->cq[k].msg, "unshard(group 'g', step 2)"),
			  "%s", env->cq[k].msg);
	}
	/* Its hold is gone with it; its shard stays for the restarted rank. */
	submit(env, 2, SHARDD_OP_RESHARD, id, 1, 0);
	cr_assert_eq(wait_cq(env, 6, WAIT_MS), 0);
	cr_assert_eq(env->cq[5].res, -SHARDD_E_STATE);
	memset(&og, 0, sizeof(og));
	snprintf(og.name, sizeof(og.name), "g");
	unmap_rank(&env->grp[id], 2);
	shd_engine_rank_attached(env->j, 2, SHARDD_HELLO_DEVICE_HOST);
	shd_engine_open_group(env->j, 2, 102, 1, &og, sizeof(og), SHARDD_PROTO_MINOR);
	cr_assert_eq(memcmp(env->grp[id].map[2].shard, &v, 4), 0);
	all_ranks(env, SHARDD_OP_UNSHARD, id, 2, 0);
	env_free(env);
}

Test(engine, collective_after_a_rank_left_fails_at_once_until_it_attaches_again, .timeout = 30)
{
	struct t_env *env = env_new(1, 3, 60000);
	uint32_t id = small_group(env, "g");

	shd_engine_rank_gone(env->j, 1, 101);
	/* Rank 1 cannot arrive: rank 0 must not wait out the 60 s collective timeout. */
	submit(env, 0, SHARDD_OP_REDUCE, id, 7, 0);
	cr_assert_eq(wait_cq(env, 1, WAIT_MS), 0);
	cr_assert_eq(env->cq[0].res, -SHARDD_E_PEER_DIED);
	cr_assert(strstr(env->cq[0].msg, "rank 1 left") &&
			  strstr(env->cq[0].msg, "reduce(group 'g', step 7)") &&
			  strstr(env->cq[0].msg, "failed for rank 0"),
		  "%s", env->cq[0].msg);
	/* Once it attached again the collective waits for it and completes. */
	shd_engine_rank_attached(env->j, 1, SHARDD_HELLO_DEVICE_HOST);
	all_ranks(env, SHARDD_OP_REDUCE, id, 7, 0);
	env_free(env);
}

Test(engine, rank_gone_fails_a_pending_registration_and_the_all_reduce, .timeout = 30)
{
	struct t_env *env = env_new(2, 2, 5000);
	struct shardd_param_spec specs[3];
	struct t_spec sp = three_params(specs);
	uint32_t id;

	register_rank(env, 0, "g", &sp);
	register_rank(env, 1, "g", &sp);
	shd_engine_rank_gone(env->j, 3, 103);
	for (uint32_t r = 0; r < 2; r++) {
		cr_assert_eq(env->rep[r].res, -SHARDD_E_PEER_DIED);
		cr_assert(strstr(env->rep[r].msg, "rank 3 left") &&
				  strstr(env->rep[r].msg, "ranks 0,1"),
			  "%s", env->rep[r].msg);
	}
	shd_engine_rank_attached(env->j, 3, SHARDD_HELLO_DEVICE_HOST);
	id = register_all(env, "g", &sp);
	/* The HSDP all-reduce spans both replicas: a death in replica 1 fails replica 0's ranks. */
	submit(env, 0, SHARDD_OP_REDUCE, id, 1, SHARDD_REDUCE_ALL_REDUCE);
	submit(env, 1, SHARDD_OP_REDUCE, id, 1, SHARDD_REDUCE_ALL_REDUCE);
	shd_engine_rank_gone(env->j, 2, 102);
	cr_assert_eq(wait_cq(env, 2, WAIT_MS), 0);
	for (size_t k = 0; k < 2; k++) {
		cr_assert_eq(env->cq[k].res, -SHARDD_E_PEER_DIED);
		cr_assert(strstr(env->cq[k].msg, "rank 2 left") &&
				  strstr(env->cq[k].msg, "reduce(group 'g', step 1)"),
			  "%s", env->cq[k].msg);
	}
	env_free(env);
}

Test(engine, reshard_submitted_during_its_unshard_waits_for_it, .timeout = 30)
{
	struct t_env *env = env_new(1, 2, 5000);
	uint32_t id = small_group(env, "g");

	submit(env, 0, SHARDD_OP_UNSHARD, id, 1, 0);
	submit(env, 0, SHARDD_OP_RESHARD, id, 1, 0);
	cr_assert_eq(env->ncq, 0, "rank 0's reshard waits behind its unshard");
	submit(env, 1, SHARDD_OP_UNSHARD, id, 1, 0);
	cr_assert_eq(wait_cq(env, 3, WAIT_MS), 0);
	for (size_t k = 0; k < 3; k++)
		cr_assert_eq(env->cq[k].res, 0, "%s %s", shardd_op_name(env->cq[k].sqe.op),
			     env->cq[k].msg);
	/* Rank 0 let go of the copy, rank 1 still holds it. */
	submit(env, 0, SHARDD_OP_RESHARD, id, 1, 0);
	submit(env, 1, SHARDD_OP_RESHARD, id, 1, 0);
	cr_assert_eq(wait_cq(env, 5, WAIT_MS), 0);
	cr_assert_eq(env->cq[3].res, -SHARDD_E_STATE);
	cr_assert_eq(env->cq[4].res, 0);
	env_free(env);
}

Test(engine, reduce_of_large_params_splits_across_workers, .timeout = 60)
{
	static const uint32_t meshes[][2] = { { 1, 2 }, { 2, 2 } };

	for (size_t m = 0; m < 2; m++) {
		uint64_t big[1] = { 200003 }, wide[3] = { 300, 8, 41 }, tall[2] = { 5000, 7 };
		struct shardd_param_spec specs[3] = {
			pspec("big", BF16, 1, 0, big),
			pspec("wide", BF16, 3, 1, wide),
			pspec("tall", BF16, 2, 0, tall),
		};
		struct t_reduce t;

		tr_init(&t, meshes[m][0], meshes[m][1], (struct t_spec){ 3, NONE, FP32, specs });
		tr_reduce(&t, 1, 0);
		tr_reduce(&t, 2, 1);
		tr_check(&t, "large params");
		tr_free(&t);
	}
}

Test(engine, reshard_drops_the_hold_once, .timeout = 30)
{
	struct t_env *env = env_new(1, 2, 5000);
	uint32_t id = small_group(env, "g");

	all_ranks(env, SHARDD_OP_UNSHARD, id, 1, 0);
	all_ranks(env, SHARDD_OP_RESHARD, id, 1, 0);
	submit(env, 1, SHARDD_OP_RESHARD, id, 1, 0);
	cr_assert_eq(wait_cq(env, 5, WAIT_MS), 0);
	cr_assert_eq(env->cq[4].res, -SHARDD_E_STATE);
	cr_assert(strstr(env->cq[4].msg, "rank 1 has no unsharded copy of group 'g' to reshard"),
		  "%s", env->cq[4].msg);
	env_free(env);
}

Test(engine, op_table_has_every_shardd_op_under_its_protocol_name, .timeout = 10)
{
	cr_assert_null(shd_op_info(0));
	cr_assert_null(shd_op_info(SHARDD_OP_COUNT));
	cr_assert_null(shd_op_info(255));
	for (uint32_t op = 1; op < SHARDD_OP_COUNT; op++) {
		const struct shd_op_info *o = shd_op_info(op);

		cr_assert_not_null(o, "op %u has an entry", op);
		cr_assert_str_eq(o->name, shardd_op_name(op), "op %u", op);
		cr_assert(o->scope >= SHD_OP_SCOPE_RING && o->scope <= SHD_OP_SCOPE_GROUP, "op %u",
			  op);
		cr_assert_eq(o->executor, SHD_OP_EXEC_DAEMON, "op %u", op);
		/* An op outside a group takes no flags: the ring says so (shd_op_check). */
		if (o->scope != SHD_OP_SCOPE_GROUP)
			cr_assert_eq(o->flags, 0, "op %u", op);
	}
}

Test(engine, bad_ops_are_rejected_naming_the_field, .timeout = 30)
{
	struct t_env *env = env_new(1, 2, 5000);
	uint32_t id = small_group(env, "g");
	struct shardd_sqe sqe = { .op = SHARDD_OP_UNSHARD, .group = id, .step = 1 };
	size_t base;
	static const struct {
		uint32_t op, group, flags, rank;
		int res;
		const char *want;
	} cases[] = {
		{ SHARDD_OP_UNSHARD, 9, 0, 0, -SHARDD_E_NOGROUP,
		  "group id 9 is not a registered group of job 'job'" },
		{ SHARDD_OP_UNSHARD, 0, 0, 0, -SHARDD_E_NOGROUP, "group id 0" },
		{ 77, 1, 0, 0, -SHARDD_E_INVALID, "op 77 is not a shardd op" },
		{ SHARDD_OP_NOP, 1, 0, 0, -SHARDD_E_INVALID, "sqe.group = 1: must be 0 for nop" },
		{ SHARDD_OP_REDUCE, 1, 0x5, 0, -SHARDD_E_INVALID,
		  "flags = 0x5 has unknown bits 0x4" },
		{ SHARDD_OP_UNSHARD, 1, 0x1, 0, -SHARDD_E_INVALID,
		  "flags = 0x1 has unknown bits 0x1" },
		{ SHARDD_OP_UNSHARD, 1, 0, 5, -SHARDD_E_INVALID,
		  "rank 5 is outside job 'job' of 2 ranks" },
	};

	for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
		struct shardd_sqe s = { .op = (uint8_t)cases[k].op,
					.group = cases[k].group,
					.flags = cases[k].flags };

		ring_submit(env, cases[k].rank, 1, &s);
		cr_assert_eq(env->ncq, k + 1, "rejected at once");
		cr_assert_eq(env->cq[k].res, cases[k].res, "%s", env->cq[k].msg);
		cr_assert(strstr(env->cq[k].msg, cases[k].want), "'%s' names '%s'", env->cq[k].msg,
			  cases[k].want);
	}
	sqe.rsvd1 = 3;
	ring_submit(env, 0, 100, &sqe);
	cr_assert_eq(env->cq[env->ncq - 1].res, -SHARDD_E_INVALID);
	/* A rank submitting its next step while its previous one waits: that op alone fails. */
	submit(env, 0, SHARDD_OP_UNSHARD, id, 1, 0);
	submit(env, 0, SHARDD_OP_UNSHARD, id, 2, 0);
	cr_assert_eq(env->cq[env->ncq - 1].res, -SHARDD_E_INVALID);
	cr_assert(strstr(env->cq[env->ncq - 1].msg, "still waiting"), "%s",
		  env->cq[env->ncq - 1].msg);
	base = env->ncq;
	submit(env, 1, SHARDD_OP_UNSHARD, id, 1, 0);
	cr_assert_eq(wait_cq(env, base + 2, WAIT_MS), 0);
	cr_assert_eq(env->cq[env->ncq - 1].res, 0);
	env_free(env);
}

/* Readable event fd: a pool task finished. */
static int engine_signalled(struct t_env *env)
{
	struct pollfd pfd = { .fd = shd_engine_event_fd(env->e), .events = POLLIN };

	return poll(&pfd, 1, 0) > 0;
}

Test(engine, small_ops_complete_within_submit_and_large_ones_on_the_pool, .timeout = 30)
{
	struct t_env *env = env_new(1, 2, 5000);
	uint64_t shape[1] = { 3000000 };
	struct shardd_param_spec big[1] = { pspec("w", FP32, 1, 0, shape) };
	struct t_spec sb = { 1, NONE, NONE, big };
	uint32_t small = small_group(env, "small"), large = register_all(env, "large", &sb);
	double **full = alloc_full(&sb, 1);

	/* A few hundred bytes: delivered before the last rank's submit returns, no worker involved. */
	submit(env, 0, SHARDD_OP_UNSHARD, small, 1, 0);
	cr_assert_eq(env->ncq, 0, "rank 0 waits for rank 1");
	submit(env, 1, SHARDD_OP_UNSHARD, small, 1, 0);
	cr_assert_eq(env->ncq, 2, "both completions delivered by the submit itself");
	cr_assert_eq(env->cq[0].res, 0, "%s", env->cq[0].msg);
	cr_assert_eq(env->cq[1].res, 0, "%s", env->cq[1].msg);
	submit(env, 0, SHARDD_OP_ZERO_GRAD, small, 0, 0);
	cr_assert_eq(env->ncq, 3, "a small zero_grad completes at once");
	cr_assert_not(engine_signalled(env), "no pool task finished");

	/* 24 MB moved, above the host's 16 MiB loop cut: the loop hands it to the pool and delivers it from drain only. */
	for (uint64_t e = 0; e < shape[0]; e++)
		full[0][e] = rnd_val(FP32);
	write_shards(env, large, &sb, full);
	submit(env, 0, SHARDD_OP_UNSHARD, large, 1, 0);
	submit(env, 1, SHARDD_OP_UNSHARD, large, 1, 0);
	cr_assert_eq(env->ncq, 3, "a large unshard is not run by the submit");
	cr_assert_eq(wait_cq(env, 5, WAIT_MS), 0);
	cr_assert_eq(env->cq[3].res, 0, "%s", env->cq[3].msg);
	cr_assert_eq(env->cq[4].res, 0, "%s", env->cq[4].msg);
	check_unsharded(env, large, &sb, full);
	free_full(&sb, 1, full);
	env_free(env);
}

Test(engine, job_destroy_fails_pending_ops_with_shutdown, .timeout = 30)
{
	struct t_env *env = env_new(1, 2, 5000);
	uint32_t id = small_group(env, "g");
	struct shardd_param_spec specs[3];
	struct t_spec sp = three_params(specs);

	submit(env, 0, SHARDD_OP_UNSHARD, id, 1, 0);
	register_rank(env, 1, "pending", &sp);
	shd_engine_job_destroy(env->j);
	env->j = NULL;
	cr_assert_eq(env->ncq, 1);
	cr_assert_eq(env->cq[0].res, -SHARDD_E_SHUTDOWN);
	cr_assert_eq(env->rep[1].res, -SHARDD_E_SHUTDOWN);
	cr_assert(strstr(env->cq[0].msg, "job 'job' ended"), "%s", env->cq[0].msg);
	env_free(env);
}

Test(engine, cuda_backend_is_reported_unavailable, .timeout = 10)
{
	struct shd_engine *e = NULL;
	struct shd_engine_config cfg = { .backend = SHARDD_BACKEND_CUDA,
					 .complete = on_complete,
					 .reply = on_reply };

	cr_assert_eq(shd_engine_create(&cfg, &e), -SHARDD_E_BACKEND);
	cr_assert_null(e);
	cfg.backend = 7;
	cr_assert_eq(shd_engine_create(&cfg, &e), -SHARDD_E_BACKEND);
}
