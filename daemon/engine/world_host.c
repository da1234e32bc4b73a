/* SPDX-License-Identifier: MIT */
/*
 * The host's exchanges between nodes for a job whose mesh spans the daemon
 * world (world_int.h, docs/MULTINODE.md): the group buffers they use,
 * the buffers MPI still holds after a failure, the exchanges' keys, digests
 * and errors, and the arithmetic of the two layouts.
 *
 * HSDP across nodes (replicate = nodes, shard = the ranks of a node): each
 * node's ranks are one replica, so unshard and the reduce-scatter stay on
 * the node (task.c, as on one node, with the divide factors of the whole
 * mesh). A reduce with SHARDD_REDUCE_ALL_REDUCE then all-reduces each
 * shard over the nodes (eng_world_allreduce): a reduce-scatter of the
 * node's ranks' partials (the reduce-scatter outputs, added to the
 * partials of earlier reduces, in the reduce dtype), in which node k sums
 * slice k of every node's partials in node order with the single-node
 * kernel's arithmetic (in chunks, each summed while the next one travels:
 * HSDP_CHUNK_BYTES), then an all-gather of the rounded sums, to which
 * each node applies the rest of that arithmetic (addend, post-divide,
 * cast, accumulate: backend reduce, SHD_REDUCE_SRC_SHARD): the same
 * inputs, the same order and the same one rounding as one daemon holding
 * every replica, so every node gets the same bits, and the bits of a
 * single-node run of the mesh.
 *
 * The partials are already in the reduce dtype, so sending them as fp32
 * (--internode-dtype fp32, the default) or in the reduce dtype
 * (--internode-dtype reduce: half the bytes for bf16/fp16) moves the same
 * numbers: no partial sum crosses the network, only partials.
 *
 * Memory (docs/MULTINODE.md, "Memory"): each group has one exchange buffer
 * (shd_world_buf, what MPI sends from and receives into) and under FSDP a
 * reduce scratch, sized by eng_world_group_init before the group's memory is
 * committed, so they count against --max-memory like its other buffers,
 * allocated with them and reused by every op (a group runs one task at a
 * time). A buffer MPI still holds after a failed exchange is replaced only
 * within the limit, the old one counted (engine orphans) until MPI lets go.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "engine_int.h"
#include "world_int.h"
#include "layout.h"
#include "memlimit.h"
#include "placement.h"
#include "shardd_kernels.h"
#include "world.h"

/* Loop thread: put b on the engine's orphans, counted in mem_committed until MPI lets go. */
static void span_orphan_add(struct shd_engine *e, struct shd_world_buf *b, uint64_t bytes)
{
	struct eng_world_orphan *o = malloc(sizeof(*o));

	if (!o) {
		/* Without a record it cannot be uncounted: let it go uncounted (freed when MPI lets go). */
		shd_world_buf_put(b);
		return;
	}
	o->b = b;
	o->bytes = bytes;
	o->next = e->span_orphans;
	e->span_orphans = o;
	e->mem_committed += bytes;
}

void eng_world_orphans_sweep(struct shd_engine *e)
{
	for (struct eng_world_orphan **pp = &e->span_orphans; *pp;) {
		struct eng_world_orphan *o = *pp;

		if (shd_world_buf_busy(o->b)) {
			pp = &o->next;
			continue;
		}
		*pp = o->next;
		e->mem_committed -= o->bytes;
		shd_world_buf_put(o->b);
		free(o);
	}
}

void eng_world_orphans_free(struct shd_engine *e)
{
	while (e->span_orphans) {
		struct eng_world_orphan *o = e->span_orphans;

		e->span_orphans = o->next;
		e->mem_committed -= o->bytes;
		shd_world_buf_put(o->b);
		free(o);
	}
}

/*
 * Loop thread, before a task of eg starts (no other task of eg runs): when
 * MPI still holds the group's buffer (an exchange that failed at a node
 * that stopped answering; its sends may still read it), the group gets a
 * fresh one if --max-memory has room for both, the old one counted as an
 * orphan until MPI lets go; else the task fails (eg->span_nobuf).
 */
void eng_world_buf_ready(struct eng_group *eg)
{
	struct shd_engine *e = eg->j->e;
	uint64_t bytes = eg->span_buf_bytes, max = e->cfg.max_memory;
	struct shd_world_buf *nb = NULL;
	char need[32], used[32], lim[32];

	eg->span_nobuf = 0;
	if (!eg->span_buf || !shd_world_buf_busy(eg->span_buf))
		return;
	eng_world_orphans_sweep(e);
	if (!max || (bytes <= max && e->mem_committed <= max - bytes))
		nb = shd_world_buf_new(bytes);
	if (nb) {
		span_orphan_add(e, eg->span_buf, bytes);
		eg->span_buf = nb;
		return;
	}
	eng_fmt(eg->span_nobuf_msg, sizeof(eg->span_nobuf_msg),
		"MPI still holds this group's inter-node buffer (%s), sent to a node that stopped answering, "
		"and another does not fit (%s of --max-memory %s held); retry once that node answers, "
		"or raise --max-memory",
		shd_memlimit_str(bytes, need, sizeof(need)),
		shd_memlimit_str(e->mem_committed, used, sizeof(used)),
		shd_memlimit_str(max, lim, sizeof(lim)));
	eg->span_nobuf = 1;
}

/* The stream of exchanges of one group of one job: FNV-1a of both names, equal on every node. */
uint64_t eng_world_key(const struct eng_group *eg)
{
	uint64_t h = 0xcbf29ce484222325ull;
	const char *parts[2] = { eg->j->name, eg->g->name };

	for (int p = 0; p < 2; p++) {
		for (const char *c = parts[p]; *c; c++)
			h = (h ^ (uint8_t)*c) * 0x100000001b3ull;
		h = (h ^ 0xff) * 0x100000001b3ull;
	}
	return h;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
	return h;
}

/* A digest of what must be equal on every node: the group's params, dtypes and the op. */
uint64_t eng_world_check(const struct eng_task *t)
{
	const struct shd_group *g = t->eg->g;
	uint64_t h = 0xcbf29ce484222325ull;
	uint32_t v[4] = { g->hdr.param_dtype, g->reduce_dtype, g->hdr.nparams, t->ops[0].sqe.op };

	h = fnv(h, v, sizeof(v));
	h = fnv(h, &t->ops[0].sqe.step, sizeof(t->ops[0].sqe.step));
	for (uint32_t i = 0; i < g->hdr.nparams; i++) {
		const struct shardd_param_spec *p = &g->specs[i];
		uint32_t f[3] = { p->dtype, p->ndim, p->shard_dim };

		h = fnv(h, p->name, strnlen(p->name, sizeof(p->name)) + 1);
		h = fnv(h, f, sizeof(f));
		h = fnv(h, p->shape, p->ndim * sizeof(p->shape[0]));
	}
	return h;
}

/* "node 1 (ranks 2..3), node 2 (ranks 4..5)" of the nodes marked in `missing` (global ranks). */
static void span_who(const struct shd_engine_job *j, const uint8_t *missing, char *buf, size_t len)
{
	uint32_t L = j->world;
	size_t off = 0;

	buf[0] = '\0';
	for (uint32_t k = 0; k < j->span_nodes && off < len; k++) {
		if (!missing[k])
			continue;
		off += (size_t)snprintf(buf + off, len - off, "%snode %u (ranks %u..%u)",
					off ? ", " : "", k, k * L, k * L + L - 1);
	}
}

/*
 * The error of task t's failed exchange (`what`: "all-reduce", "exchange")
 * into t->msg, short enough for a completion's 255 characters: which ranks
 * of this node get it, the nodes whose part is missing (died, stalled) or
 * disagreed, with their global ranks, and why (MPI's or the world's words).
 */
void eng_world_fail(struct eng_task *t, const char *what, int ret, const uint8_t *missing,
		    const char *why, const char *lost)
{
	const struct shd_engine_job *j = t->eg->j;
	uint32_t L = j->world, n = j->span_node;
	uint64_t ms = j->e->timeout_ns / 1000000u;
	char who[256], detail[448], within[32];

	span_who(j, missing, who, sizeof(who));
	if (ms % 1000 == 0)
		eng_fmt(within, sizeof(within), "%llu s", (unsigned long long)(ms / 1000));
	else
		eng_fmt(within, sizeof(within), "%.3g s", (double)ms / 1000.0);
	if (ret == -SHARDD_E_TIMEOUT && who[0])
		eng_fmt(detail, sizeof(detail), "%s did not answer within %s", who, within);
	else if (ret == -SHARDD_E_PEER_DIED && who[0])
		eng_fmt(detail, sizeof(detail), "%s is lost: %s", who, why);
	else
		eng_fmt(detail, sizeof(detail), "%s", why); /* the world's words name the node */
	eng_fmt(t->msg, sizeof(t->msg),
		"shardd: %s(group '%s', step %llu): %s among %u nodes failed for ranks %u..%u "
		"(node %u): %s%s%s",
		shardd_op_name(t->ops[0].sqe.op), t->eg->g->name,
		(unsigned long long)t->ops[0].sqe.step, what, j->span_nodes, n * L, n * L + L - 1,
		n, detail, ret == -SHARDD_E_TIMEOUT || ret == -SHARDD_E_PEER_DIED ? lost : "",
		ret == -SHARDD_E_TIMEOUT || ret == -SHARDD_E_PEER_DIED
			? "; check its daemon (dead: relaunch the world)"
			: "");
}

/* The error of an op that found no inter-node buffer (eng_world_buf_ready) into t->msg. */
int eng_world_nobuf(struct eng_task *t)
{
	eng_fmt(t->msg, sizeof(t->msg), "shardd: %s(group '%s', step %llu): %s",
		shardd_op_name(t->ops[0].sqe.op), t->eg->g->name,
		(unsigned long long)t->ops[0].sqe.step,
		t->eg->span_nobuf
			? t->eg->span_nobuf_msg
			: "the group has no inter-node buffer (registered without a reduce dtype)");
	return -SHARDD_E_NOMEM;
}

/* The dtype partials and node sums travel in between nodes: fp32, or the reduce dtype rdt (--internode-dtype). */
static uint32_t span_wire(uint32_t rdt)
{
	return shd_world_internode_dtype() == SHD_INTERNODE_FP32 ? SHARDD_DTYPE_FP32 : rdt;
}

/* HSDP: elements of one node's slice of the partials (C), and the bytes of the all-reduce's buffer. */
static uint64_t span_hsdp_bytes(const struct eng_group *eg, uint32_t wire, size_t *C)
{
	const struct shd_group *g = eg->g;
	uint32_t N = eg->j->span_nodes;
	size_t rsz = shardd_dtype_size(g->reduce_dtype), wsz = shardd_dtype_size(wire);
	size_t T = (size_t)g->shard * (g->reduce_shard_size / rsz);

	*C = (T + N - 1) / N;
	/* The reduce-scatter's send and receive halves (wire dtype), then the all-gather's (reduce dtype). */
	return (uint64_t)2 * N * *C * wsz + (uint64_t)N * *C * rsz;
}

/*
 * HSDP's reduce-scatter among the nodes goes in chunks of about this many
 * bytes of each node's slice, at most HSDP_CHUNKS of them: chunk j is
 * summed while chunk j + 1 travels, so the sum (about an eighth of the
 * all-reduce's time at 64 MiB on the CI VM, docs/BENCHMARKS.md) hides
 * behind the transfer instead of following it. Every chunk is one more
 * hand-off to the communication thread and one more message header per
 * node, so a slice smaller than two chunks goes whole, as before. The sum
 * is per element, in node order, whatever the chunks: the same bits.
 */
#define HSDP_CHUNK_BYTES ((size_t)1 << 20)
#define HSDP_CHUNKS      64u

/* Elements per chunk of a slice of C elements of wsz bytes, and the number of chunks (>= 1). */
static size_t span_hsdp_chunks(size_t C, size_t wsz, uint32_t *K)
{
	size_t per = HSDP_CHUNK_BYTES / wsz;

	if (C < 2 * per)
		per = C ? C : 1;
	else if ((C + per - 1) / per > HSDP_CHUNKS)
		per = (C + HSDP_CHUNKS - 1) / HSDP_CHUNKS;
	*K = (uint32_t)((C + per - 1) / per);
	*K = *K ? *K : 1;
	return per;
}

/* HSDP's all-reduce among the nodes over the world, in host memory. */
int eng_world_mpi_allreduce(struct eng_task *t, const struct shardd_reduce_math *ar)
{
	struct eng_group *eg = t->eg;
	struct shd_engine_job *j = eg->j;
	struct shd_group *g = eg->g;
	struct shd_backend_ctx *b = j->e->backend;
	uint32_t N = j->span_nodes, L = g->shard, rdt = g->reduce_dtype, me = j->span_node;
	uint32_t wire = span_wire(rdt);
	size_t P = g->reduce_shard_size, rsz = shardd_dtype_size(rdt),
	       wsz = shardd_dtype_size(wire);
	size_t E = P / rsz, T = (size_t)L * E, C;
	const struct shardd_reduce_math sum = {
		.reduce_dtype = rdt, .pre = ar->pre, .avg = ar->avg, .post = 1
	};
	uint64_t seq = eg->span_seq, check = eng_world_check(t);
	uint8_t *d1, *d2, *recv, missing[SHARDD_MAX_WORLD];
	const void *in[SHARDD_MAX_WORLD];
	struct shd_world_xchg *x;
	size_t per;
	uint32_t K;
	char why[384];
	int ret = 0;

	span_hsdp_bytes(eg, wire, &C);
	per = span_hsdp_chunks(C, wsz, &K);
	/*
	 * Every chunk's number and the all-gather's are taken whatever happens
	 * (HSDP_CHUNKS + 1, however many chunks), so the nodes' streams stay
	 * paired even when a mismatched group cuts its slices differently.
	 */
	eg->span_seq += HSDP_CHUNKS + 1;
	if (eg->span_nobuf || !eg->span_buf)
		return eng_world_nobuf(t);
	d1 = shd_world_buf_data(eg->span_buf);
	d2 = d1 + (size_t)2 * N * C * wsz;
	/*
	 * Reduce-scatter: this node's partials of every shard, one after
	 * another in the wire dtype (a cast from the reduce dtype is exact),
	 * cut into N slices of C elements; node k gets slice k of every node.
	 */
	for (uint32_t s = 0; s < L; s++) {
		const void *src = g->partials[s].priv;

		if (wire == rdt)
			memcpy(d1 + s * E * wsz, src, P);
		else
			shardd_k_cast(d1 + s * E * wsz, wire, src, rdt, E);
	}
	memset(d1 + T * wsz, 0, ((size_t)N * C - T) * wsz);
	/*
	 * Chunk c: elements [c * per, c * per + n) of every slice; node k's
	 * land at recv + (c * per * N + k * n) * wsz, in the receive half.
	 * One chunk in flight while the one before it is summed.
	 */
	recv = d1 + (size_t)N * C * wsz;
	ret = shd_world_xchg_start(eng_world_key(eg), seq, check, eg->span_buf, 0, C * wsz,
				   (size_t)(recv - d1), (per < C ? per : C) * wsz,
				   shd_now_ns() + j->e->timeout_ns, missing, why, sizeof(why), &x);
	for (uint32_t c = 0; c < K && !ret; c++) {
		size_t at = (size_t)c * per, n = C - at < per ? C - at : per;

		/* A failed chunk leaves nothing in flight: the next one starts only after it. */
		ret = shd_world_xchg_wait(x);
		if (!ret && c + 1 < K) {
			size_t next = at + per, nn = C - next < per ? C - next : per;

			ret = shd_world_xchg_start(
				eng_world_key(eg), seq + 1 + c, check, eg->span_buf, next * wsz,
				C * wsz, (size_t)(recv - d1) + next * N * wsz, nn * wsz,
				shd_now_ns() + j->e->timeout_ns, missing, why, sizeof(why), &x);
		}
		if (ret)
			break;
		/*
		 * Slice `me` summed over the nodes in node order: s =
		 * round_rd(sum / avg), as one daemon. This node's own slice is
		 * read where it was sent from (the exchange leaves its receive
		 * slot empty); the all-gather below sends the sums from their
		 * place among the reduce-dtype results.
		 */
		for (uint32_t k = 0; k < N; k++)
			in[k] = k == me ? d1 + ((size_t)me * C + at) * wsz
					: recv + (at * N + (size_t)k * n) * wsz;
		shardd_k_reduce(d2 + ((size_t)me * C + at) * rsz, rdt, 0, in, N, wire, n, &sum);
	}
	if (ret) {
		eng_world_fail(t, "all-reduce", ret, missing, why, "; sharded grads not reduced");
		return ret;
	}
	/* All-gather of the summed slices, in the reduce dtype: every node gets every shard's s. */
	ret = shd_world_xchg(eng_world_key(eg), seq + HSDP_CHUNKS, check, eg->span_buf,
			     (size_t)(d2 - d1) + (size_t)me * C * rsz, 0, (size_t)(d2 - d1),
			     C * rsz, shd_now_ns() + j->e->timeout_ns, missing, why, sizeof(why));
	if (ret) {
		eng_world_fail(t, "all-reduce", ret, missing, why, "; sharded grads not reduced");
		return ret;
	}
	/*
	 * Each shard's s into its sharded grad: rounding s again is exact, so
	 * the addend, the post-divide, the cast and the accumulate give the
	 * bits of the single-node all-reduce.
	 */
	for (uint32_t s = 0; s < L && !ret; s++) {
		struct shd_buf buf = { .bytes = P, .fd = -1, .priv = d2 + s * E * rsz };
		struct shd_shard_view view = { &buf, g->reduce_offsets, rdt },
				      out = { &g->sharded_grads[s], g->shard_offsets,
					      SHARDD_DTYPE_NONE };
		uint8_t accumulate = g->grad_present[s];
		struct shd_reduce_args a = {
			.job = j->bj,
			.layout = &g->layout,
			.src = SHD_REDUCE_SRC_SHARD,
			.n = 1,
			.views = &view,
			.shard_rank = s,
			.in_dtype = rdt,
			.outs = &out,
			.accumulate = &accumulate,
			.reduce_offsets = g->reduce_offsets,
			.reduce_shard_size = g->reduce_shard_size,
			.math = { .reduce_dtype = rdt,
				  .pre = 1,
				  .avg = 1,
				  .add = ar->add,
				  .post = ar->post },
			.err = t->why,
			.errlen = sizeof(t->why),
		};

		ret = b->ops->reduce(b, &a);
		if (!ret)
			g->grad_present[s] = 1;
	}
	return ret;
}

/* ------------------------------------------------------------------ */
/* FSDP across nodes: one shard group over every rank                  */
/* ------------------------------------------------------------------ */

/*
 * Node n holds shard ranks n*L .. n*L+L-1 of the S = N*L of the mesh. The
 * layout is the whole shard group's; the engine's ranks 0..L-1 are these
 * shard ranks (shd_group_shard_rank).
 *
 * Unshard: every node sends its L flat shards (a node chunk) to every other
 * node; each node runs the backend's unshard over all S shards, this
 * node's and the received ones, exactly as one daemon holding every rank:
 * its own shards' part while the exchange runs, the others' after it.
 *
 * Reduce: each node sums its L ranks' grads (inputs rounded to the reduce
 * dtype and pre-divided as FSDP2 does, the sum kept in fp32) for every one
 * of the S shards' rows; node k receives every node's sums of its L shards;
 * it adds them in node order in fp32, divides, and rounds to the reduce
 * dtype once (--internode-dtype reduce: the node sums travel rounded to the
 * reduce dtype, one more rounding per node sum). Against one daemon holding
 * every rank only the order of the fp32 additions differs (the ranks of a
 * node first, then the nodes), so a result is the same value or one
 * reduce-dtype rounding step away when the fp32 sums straddle a rounding
 * boundary.
 */

#define WORLD_ALIGN(x) (((x) + 63) & ~(uint64_t)63)

/*
 * FSDP's buffer and scratch (eng_group): the buffer holds the unshard's
 * node chunks (S shards, this node's sent from its own slot) or the
 * reduce's node sums in the wire dtype (S shards sent, then N node chunks
 * received); the scratch the fp32 node sums when they travel in another
 * dtype, the fp32 total of one shard, and one param's grads of the node's
 * ranks rounded to the reduce dtype. *msg: the largest message.
 */
static int span_fsdp_size(struct eng_group *eg, uint32_t wire, uint64_t *buf, uint64_t *scratch,
			  uint64_t *msg)
{
	struct shd_group *g = eg->g;
	uint32_t L = g->shard, S = eg->j->span_shard, rdt = g->reduce_dtype;
	uint64_t Z = g->layout.shard_size, W, F, numel = 0, rsz;

	*buf = (uint64_t)S * Z;
	*scratch = 0;
	*msg = (uint64_t)L * Z;
	if (rdt == SHARDD_DTYPE_NONE)
		return 0;
	eg->span_off32 = calloc(g->layout.nparams + 1, sizeof(*eg->span_off32));
	if (!eg->span_off32)
		return -ENOMEM;
	F = shd_placement_reduce_shard(&g->layout, SHARDD_DTYPE_FP32, eg->span_off32);
	eg->span_F = F;
	W = F / sizeof(float) * shardd_dtype_size(wire);
	if ((uint64_t)2 * S * W > *buf)
		*buf = (uint64_t)2 * S * W;
	if ((uint64_t)L * W > *msg)
		*msg = (uint64_t)L * W;
	for (uint32_t i = 0; i < g->layout.nparams; i++)
		if (g->layout.params[i].numel > numel)
			numel = g->layout.params[i].numel;
	rsz = shardd_dtype_size(rdt);
	eg->span_sums_at = wire == SHARDD_DTYPE_FP32 ? UINT64_MAX : 0;
	eg->span_tot_at = wire == SHARDD_DTYPE_FP32 ? 0 : WORLD_ALIGN((uint64_t)S * F);
	eg->span_tmp_at = eg->span_tot_at + WORLD_ALIGN(F);
	*scratch = eg->span_tmp_at + (uint64_t)L * numel * rsz;
	return 0;
}

int eng_world_group_init(struct eng_group *eg, char *err, size_t errlen)
{
	struct shd_engine_job *j = eg->j;
	struct shd_group *g = eg->g;
	uint32_t rdt = g->reduce_dtype;
	uint32_t wire = span_wire(rdt);
	uint64_t buf = 0, scratch = 0, msg = 0;
	char a[32], b[32];
	struct shd_layout l;
	size_t C;
	int ret;

	if (eng_world_fsdp(j)) {
		ret = shd_layout_build(g->specs, g->hdr.nparams, j->span_shard, g->hdr.param_dtype,
				       &l, err, errlen);
		if (ret)
			return ret;
		shd_layout_free(&g->layout);
		g->layout = l;
		g->shard_base = j->span_node * j->world;
		for (uint32_t i = 0; i < g->hdr.nparams; i++)
			g->shard_offsets[i] = l.params[i].shard_offset;
		if (g->reduce_dtype != SHARDD_DTYPE_NONE)
			g->reduce_shard_size = shd_placement_reduce_shard(
				&g->layout, g->reduce_dtype, g->reduce_offsets);
	}
	/* A backend that crosses nodes itself (cuda: NCCL) needs no host exchange buffers. */
	if (j->e->backend->ops->span_reduce) {
		eg->span_buf_bytes = 0;
		g->internode_size = 0;
		return 0;
	}
	if (eng_world_fsdp(j)) {
		if (span_fsdp_size(eg, wire, &buf, &scratch, &msg)) {
			eng_fmt(err, errlen, "register group '%s': out of memory", g->name);
			return -ENOMEM;
		}
	} else if (rdt != SHARDD_DTYPE_NONE && g->reduce_shard_size) {
		buf = span_hsdp_bytes(eg, wire, &C);
		msg = C * shardd_dtype_size(wire);
	}
	if (msg > (uint64_t)INT32_MAX) {
		eng_fmt(err, errlen,
			"register group '%s' of job '%s': across its %u nodes one inter-node message of this "
			"group would be %s (%llu bytes), past MPI's count limit of %s (%d bytes); register "
			"smaller groups (split the params over more groups)",
			g->name, j->name, j->span_nodes, shd_memlimit_str(msg, a, sizeof(a)),
			(unsigned long long)msg, shd_memlimit_str(INT32_MAX, b, sizeof(b)),
			INT32_MAX);
		return -EINVAL;
	}
	eg->span_buf_bytes = buf;
	g->internode_size = buf + scratch;
	return 0;
}

int eng_world_group_alloc(struct eng_group *eg, char *err, size_t errlen)
{
	struct shd_group *g = eg->g;
	uint64_t scratch = g->internode_size - eg->span_buf_bytes;
	char need[32];

	if (eg->span_buf_bytes) {
		eg->span_buf = shd_world_buf_new(eg->span_buf_bytes);
		if (!eg->span_buf)
			goto nomem;
		/* The pages now, as the host backend's buffers: an op never finds memory missing. */
		memset(shd_world_buf_data(eg->span_buf), 0, eg->span_buf_bytes);
	}
	if (scratch) {
		if (posix_memalign((void **)&eg->span_scratch, 64, scratch))
			goto nomem;
		memset(eg->span_scratch, 0, scratch);
	}
	g->internode_held = g->internode_size;
	return 0;
nomem:
	eng_fmt(err, errlen, "register group '%s': out of memory for its %s of inter-node buffers",
		g->name, shd_memlimit_str(g->internode_size, need, sizeof(need)));
	return -ENOMEM;
}

void eng_world_group_free(struct eng_group *eg)
{
	if (eg->span_buf && shd_world_buf_busy(eg->span_buf))
		span_orphan_add(eg->j->e, eg->span_buf, eg->span_buf_bytes);
	else
		shd_world_buf_put(eg->span_buf);
	eg->span_buf = NULL;
	free(eg->span_scratch);
	eg->span_scratch = NULL;
	free(eg->span_off32);
	eg->span_off32 = NULL;
	if (eg->g)
		eg->g->internode_held = 0;
}

/* FSDP's unshard across nodes over the world, in host memory. */
int eng_world_mpi_unshard(struct eng_task *t)
{
	struct eng_group *eg = t->eg;
	struct shd_engine_job *j = eg->j;
	struct shd_group *g = eg->g;
	struct shd_backend_ctx *b = j->e->backend;
	uint32_t L = g->shard, S = j->span_shard;
	size_t Z = g->layout.shard_size, bytes = (size_t)L * Z;
	struct shd_buf bufs[SHARDD_MAX_WORLD], *shards[SHARDD_MAX_WORLD],
		*unsharded[SHARDD_MAX_WORLD];
	uint8_t missing[SHARDD_MAX_WORLD], *chunks, *mine;
	struct shd_unshard_args a = {
		.job = j->bj,
		.layout = &g->layout,
		.nshards = S,
		.shards = shards,
		.unsharded = unsharded,
		.err = t->why,
		.errlen = sizeof(t->why),
	};
	uint64_t seq = eg->span_seq++;
	uint32_t me = j->span_node;
	struct shd_world_xchg *x;
	char why[384];
	int ret, local;

	if (eg->span_nobuf || !eg->span_buf)
		return eng_world_nobuf(t);
	/* Node k's chunk (shards k*L .. k*L+L-1) at k * bytes; this node's sent from its own place. */
	chunks = shd_world_buf_data(eg->span_buf);
	mine = chunks + (size_t)me * bytes;
	for (uint32_t s = 0; s < L; s++)
		memcpy(mine + s * Z, g->shards[s].priv, Z);
	ret = shd_world_xchg_start(eng_world_key(eg), seq, eng_world_check(t), eg->span_buf,
				   (size_t)(mine - chunks), 0, 0, bytes,
				   shd_now_ns() + j->e->timeout_ns, missing, why, sizeof(why), &x);
	if (ret) {
		eng_world_fail(t, "exchange", ret, missing, why, "");
		return ret;
	}
	for (uint32_t r = 0; r < S; r++) {
		bufs[r] = (struct shd_buf){ .bytes = Z, .fd = -1, .priv = chunks + (size_t)r * Z };
		shards[r] = &bufs[r];
		unsharded[r] = shd_group_unsharded(g, 0);
	}
	/*
	 * This node's shards need no other node: gathered while the others'
	 * travel (the sends read `mine` meanwhile, as this does). A failed
	 * exchange leaves the unsharded copy part new: the op fails, and no
	 * rank reads a copy its unshard did not complete.
	 */
	a.part_first = me * L;
	a.part_count = L;
	local = b->ops->unshard(b, &a);
	ret = shd_world_xchg_wait(x);
	if (ret) {
		eng_world_fail(t, "exchange", ret, missing, why, "");
		return ret;
	}
	if (local)
		return local;
	/* The other nodes' shards: those before this node's, then those after it. */
	a.part_first = 0;
	a.part_count = me * L;
	if (a.part_count)
		ret = b->ops->unshard(b, &a);
	a.part_first = (me + 1) * L;
	a.part_count = S - (me + 1) * L;
	if (!ret && a.part_count)
		ret = b->ops->unshard(b, &a);
	return ret;
}

/*
 * The fp32 sums over this node's ranks of every shard's rows: shard r's at
 * sums + r * F, each param at off32[i]; inputs rounded to the reduce dtype
 * and pre-divided (math.pre) first, as one daemon would, in `tmp` (room
 * for the node's ranks' grads of the largest param in the reduce dtype).
 */
static void span_node_sums(struct eng_task *t, const struct shardd_reduce_math *rs,
			   const uint64_t *off32, size_t F, uint8_t *sums, uint8_t *tmp)
{
	struct shd_group *g = t->eg->g;
	uint32_t L = g->shard, S = t->eg->j->span_shard, rdt = g->reduce_dtype;
	const struct shardd_reduce_math sum = {
		.reduce_dtype = SHARDD_DTYPE_FP32, .pre = 1, .avg = 1, .post = 1
	};
	const struct shardd_reduce_math prep = {
		.reduce_dtype = rdt, .pre = rs->pre, .avg = 1, .post = 1
	};

	/* Padding rows and the gaps between params are zero, as in a fresh buffer. */
	memset(sums, 0, (size_t)S * F);
	for (uint32_t i = 0; i < g->layout.nparams; i++) {
		const struct shd_layout_param *p = &g->layout.params[i];
		size_t gs = shardd_dtype_size(p->grad_dtype), rsz = shardd_dtype_size(rdt);
		const void *in[SHARDD_MAX_WORLD];
		uint32_t idt = p->grad_dtype;

		if (!p->numel)
			continue;
		for (uint32_t k = 0; k < L; k++)
			in[k] = (const uint8_t *)g->grads[k].priv + p->grad_offset;
		if (p->grad_dtype != rdt || rs->pre > 1) {
			/* x_k = round_rd(round_rd(grad) / pre): the single-node kernel's first step. */
			for (uint32_t k = 0; k < L; k++) {
				const void *src = in[k];

				shardd_k_reduce(tmp + k * p->numel * rsz, rdt, 0, &src, 1,
						p->grad_dtype, p->numel, &prep);
				in[k] = tmp + k * p->numel * rsz;
			}
			idt = rdt;
			gs = rsz;
		}
		for (uint32_t r = 0; r < S; r++) {
			uint64_t valid = shd_layout_rows_valid(p, r);

			for (uint64_t o = 0; o < p->outer && valid; o++) {
				uint64_t e =
					o * p->dim * p->inner + (uint64_t)r * p->rows * p->inner;
				uint64_t at = o * p->rows * p->inner;
				const void *src[SHARDD_MAX_WORLD];

				for (uint32_t k = 0; k < L; k++)
					src[k] = (const uint8_t *)in[k] + e * gs;
				shardd_k_reduce(sums + r * F + off32[i] + at * sizeof(float),
						SHARDD_DTYPE_FP32, 0, src, L, idt, valid * p->inner,
						&sum);
			}
		}
	}
}

/* FSDP's reduce-scatter across nodes over the world, in host memory. */
int eng_world_mpi_reduce_scatter(struct eng_task *t, const struct shardd_reduce_math *rs)
{
	struct eng_group *eg = t->eg;
	struct shd_engine_job *j = eg->j;
	struct shd_group *g = eg->g;
	struct shd_backend_ctx *b = j->e->backend;
	uint32_t N = j->span_nodes, L = g->shard, S = j->span_shard, rdt = g->reduce_dtype;
	uint32_t wire = span_wire(rdt);
	const uint64_t *off32 = eg->span_off32;
	size_t F = eg->span_F, E = F / sizeof(float), wsz = E * shardd_dtype_size(wire),
	       bytes = (size_t)L * wsz;
	uint8_t *send, *recv, *sums, *tot, missing[SHARDD_MAX_WORLD];
	uint64_t seq = eg->span_seq++;
	struct shd_buf tot_buf;
	char why[384];
	int ret = 0;

	if (eg->span_nobuf || !eg->span_buf || !off32)
		return eng_world_nobuf(t);
	/* The buffer: this node's sums of all S shards (sent), then node k's chunk at recv + k * bytes. */
	send = shd_world_buf_data(eg->span_buf);
	recv = send + (size_t)S * wsz;
	sums = eg->span_sums_at == UINT64_MAX ? send : eg->span_scratch + eg->span_sums_at;
	tot = eg->span_scratch + eg->span_tot_at;
	span_node_sums(t, rs, off32, F, sums, eg->span_scratch + eg->span_tmp_at);
	if (send != sums)
		shardd_k_cast(send, wire, sums, SHARDD_DTYPE_FP32, (size_t)S * E);
	/* Node k gets this node's sums of its shards k*L .. k*L+L-1. */
	ret = shd_world_xchg(eng_world_key(eg), seq, eng_world_check(t), eg->span_buf, 0, bytes,
			     (size_t)(recv - send), bytes, shd_now_ns() + j->e->timeout_ns, missing,
			     why, sizeof(why));
	if (ret) {
		eng_world_fail(t, "exchange", ret, missing, why, "");
		return ret;
	}
	tot_buf = (struct shd_buf){ .bytes = F, .fd = -1, .priv = tot };
	for (uint32_t s = 0; s < L && !ret; s++) {
		/* The nodes' sums of shard s in node order, in fp32, divided: what one daemon's fp32 sum is. */
		const struct shardd_reduce_math add = {
			.reduce_dtype = SHARDD_DTYPE_FP32, .pre = 1, .avg = rs->avg, .post = 1
		};
		struct shd_shard_view view = { &tot_buf, off32, SHARDD_DTYPE_FP32 }, out;
		uint8_t accumulate = g->grad_present[s];
		const void *in[SHARDD_MAX_WORLD];
		struct shd_reduce_args a = {
			.job = j->bj,
			.layout = &g->layout,
			.src = SHD_REDUCE_SRC_SHARD,
			.n = 1,
			.views = &view,
			.shard_rank = g->shard_base + s,
			.in_dtype = SHARDD_DTYPE_FP32,
			.outs = &out,
			.accumulate = &accumulate,
			.reduce_offsets = off32,
			.reduce_shard_size = F,
			.math = { .reduce_dtype = rdt, .pre = 1, .avg = 1, .post = rs->post },
			.err = t->why,
			.errlen = sizeof(t->why),
		};

		/* This node's own sums are read where they were sent from (the exchange leaves that slot empty). */
		for (uint32_t k = 0; k < N; k++)
			in[k] = (k == j->span_node ? send : recv) + (size_t)k * bytes +
				(size_t)s * wsz;
		shardd_k_reduce(tot, SHARDD_DTYPE_FP32, 0, in, N, wire, E, &add);
		out = (struct shd_shard_view){ &g->sharded_grads[s], g->shard_offsets,
					       SHARDD_DTYPE_NONE };
		/* One rounding to the reduce dtype, the post-divide, the cast to the param's dtype, the accumulate. */
		ret = b->ops->reduce(b, &a);
	}
	return ret;
}
