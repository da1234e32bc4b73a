/* SPDX-License-Identifier: MIT */
/*
 * daemon/world/world_boot.c without a GPU or MPI: the rank arithmetic of the two
 * layouts across nodes, and the bootstrap of communicators spanning nodes
 * run by one thread per simulated node over an in-memory all-gather (a
 * board of posted messages per exchange number, with the deadline the
 * bootstrap gives). The "communicators" are the ids each node's init was
 * handed: every node must end up with node 0's, made by node 0 alone, and
 * a node that fails or never answers must fail every node, named.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "shardd_proto.h"
#include "world_boot.h"

#define NODES_MAX 4
#define SEQS      8
#define MSG_MAX   (8 + 4 * SHD_WORLD_ID_BYTES)

/* ------------------------------------------------------------------ */
/* Rank arithmetic                                                     */
/* ------------------------------------------------------------------ */

Test(world_boot, hsdp_takes_one_communicator_per_local_index_over_the_nodes, .timeout = 5)
{
	struct shd_world_boot s = { .layout = SHD_WORLD_HSDP, .nodes = 3, .node = 2, .local = 2 };
	uint32_t comm, rank, nranks;

	cr_assert_eq(shd_world_boot_comms(&s), 2);
	/* Global rank 2*2+1 = 5 is shard 1 of replica (node) 2: rank 2 of shard 1's 3 replicas. */
	cr_assert_eq(shd_world_boot_member(&s, 1, &comm, &rank, &nranks), 0);
	cr_assert(comm == 1 && rank == 2 && nranks == 3, "comm %u rank %u of %u", comm, rank,
		  nranks);
	cr_assert_eq(shd_world_boot_member(&s, 2, &comm, &rank, &nranks), -SHARDD_E_INVALID);
}

Test(world_boot, fsdp_takes_one_communicator_over_every_rank_in_global_order, .timeout = 5)
{
	struct shd_world_boot s = { .layout = SHD_WORLD_FSDP, .nodes = 3, .node = 1, .local = 4 };
	uint32_t comm, rank, nranks;

	cr_assert_eq(shd_world_boot_comms(&s), 1);
	/* Local rank 3 of node 1 is global rank 1*4+3 = 7 of 12. */
	cr_assert_eq(shd_world_boot_member(&s, 3, &comm, &rank, &nranks), 0);
	cr_assert(comm == 0 && rank == 7 && nranks == 12, "comm %u rank %u of %u", comm, rank,
		  nranks);
	s.node = 3;
	cr_assert_eq(shd_world_boot_member(&s, 0, &comm, &rank, &nranks), -SHARDD_E_INVALID);
}

Test(world_boot, who_names_each_marked_node_with_its_global_ranks, .timeout = 5)
{
	struct shd_world_boot s = { .layout = SHD_WORLD_HSDP, .nodes = 3, .node = 0, .local = 2 };
	const uint8_t marked[3] = { 0, 1, 1 }, none[3] = { 0 };
	char buf[128];

	shd_world_boot_who(&s, marked, buf, sizeof(buf));
	cr_assert_str_eq(buf, "node 1 (ranks 2..3), node 2 (ranks 4..5)");
	shd_world_boot_who(&s, none, buf, sizeof(buf));
	cr_assert_str_eq(buf, "");
}

/* ------------------------------------------------------------------ */
/* An in-memory world                                                  */
/* ------------------------------------------------------------------ */

struct board {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	uint32_t nodes;
	uint8_t posted[SEQS][NODES_MAX];
	uint8_t msg[SEQS][NODES_MAX][MSG_MAX];
	uint32_t made_ids; /* make_ids calls, all nodes */
};

struct node {
	struct board *b;
	struct shd_world_boot s;
	uint32_t gen;  /* in: live generation; out: after the bootstrap */
	int fail_init; /* this node's set-up fails */
	int holds;     /* it holds communicators (init succeeded, not dropped) */
	uint8_t ids[4 * SHD_WORLD_ID_BYTES]; /* what its last init was given */
	uint32_t inits, drops;
	int ret;
	char err[1024];
};

static int fake_exchange(void *ctx, uint64_t seq, const void *mine, void *all, size_t bytes,
			 uint64_t deadline_ns, uint8_t *missing, char *err, size_t len)
{
	struct node *n = ctx;
	struct board *b = n->b;
	struct timespec until = { (time_t)(deadline_ns / 1000000000ull),
				  (long)(deadline_ns % 1000000000ull) };
	uint32_t have = 0;

	cr_assert(seq < SEQS && bytes <= MSG_MAX, "exchange %llu of %zu bytes",
		  (unsigned long long)seq, bytes);
	pthread_mutex_lock(&b->lock);
	memcpy(b->msg[seq][n->s.node], mine, bytes);
	b->posted[seq][n->s.node] = 1;
	pthread_cond_broadcast(&b->cond);
	for (;;) {
		have = 0;
		for (uint32_t k = 0; k < b->nodes; k++)
			have += b->posted[seq][k];
		if (have == b->nodes || pthread_cond_timedwait(&b->cond, &b->lock, &until))
			break;
	}
	for (uint32_t k = 0; k < b->nodes; k++) {
		missing[k] = !b->posted[seq][k];
		if (!missing[k])
			memcpy((uint8_t *)all + k * bytes, b->msg[seq][k], bytes);
	}
	pthread_mutex_unlock(&b->lock);
	if (have == b->nodes)
		return 0;
	snprintf(err, len, "no answer within the collective timeout");
	return -SHARDD_E_TIMEOUT;
}

static int fake_make_ids(void *ctx, uint8_t *ids, uint32_t n, char *err, size_t len)
{
	struct node *me = ctx;

	(void)err;
	(void)len;
	pthread_mutex_lock(&me->b->lock);
	me->b->made_ids++;
	pthread_mutex_unlock(&me->b->lock);
	/* Distinct per communicator, and never all zero (what the other nodes send). */
	for (uint32_t i = 0; i < n * SHD_WORLD_ID_BYTES; i++)
		ids[i] = (uint8_t)(0xa0 + i % 7 + i / SHD_WORLD_ID_BYTES);
	return 0;
}

static int fake_init(void *ctx, const uint8_t *ids, uint64_t deadline_ns, char *err, size_t len)
{
	struct node *n = ctx;

	(void)deadline_ns;
	n->inits++;
	memcpy(n->ids, ids, shd_world_boot_comms(&n->s) * SHD_WORLD_ID_BYTES);
	if (n->fail_init) {
		snprintf(err, len, "ncclCommInitRankConfig: unhandled system error");
		return -SHARDD_E_BACKEND;
	}
	n->holds = 1;
	return 0;
}

static void fake_drop(void *ctx)
{
	struct node *n = ctx;

	n->drops++;
	n->holds = 0;
}

static void *node_main(void *arg)
{
	struct node *n = arg;
	const struct shd_world_boot_ops ops = { n, fake_exchange, fake_make_ids, fake_init,
						fake_drop };

	n->ret = shd_world_bootstrap(&n->s, &ops, &n->gen, n->err, sizeof(n->err));
	return NULL;
}

/*
 * Run the bootstrap on nodes 0..nodes-1 of a world of `world` nodes (the
 * rest never answer), node k starting at generation gens[k].
 */
static void run(struct board *b, struct node *nodes, uint32_t world, uint32_t running,
		uint32_t layout, const uint32_t *gens, uint64_t timeout_ns)
{
	pthread_t th[NODES_MAX];

	memset(b, 0, sizeof(*b));
	pthread_mutex_init(&b->lock, NULL);
	{
		pthread_condattr_t ca;

		pthread_condattr_init(&ca);
		pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
		pthread_cond_init(&b->cond, &ca);
		pthread_condattr_destroy(&ca);
	}
	b->nodes = world;
	for (uint32_t k = 0; k < running; k++) {
		int fail = nodes[k].fail_init;

		memset(&nodes[k], 0, sizeof(nodes[k]));
		nodes[k] = (struct node){
			.b = b,
			.gen = gens[k],
			.holds = gens[k] != 0,
			.fail_init = fail,
			.s = { .layout = layout,
			       .nodes = world,
			       .node = k,
			       .local = 2,
			       .key = 7,
			       .seq = 0,
			       .check = 9,
			       .timeout_ns = timeout_ns },
		};
	}
	for (uint32_t k = 0; k < running; k++)
		cr_assert_eq(pthread_create(&th[k], NULL, node_main, &nodes[k]), 0);
	for (uint32_t k = 0; k < running; k++)
		pthread_join(th[k], NULL);
	pthread_cond_destroy(&b->cond);
	pthread_mutex_destroy(&b->lock);
}

#define SECOND 1000000000ull

Test(world_boot, a_fresh_world_makes_every_node_take_node_0s_ids, .timeout = 10)
{
	static struct board b;
	static struct node n[3];
	const uint32_t gens[3] = { 0, 0, 0 };
	uint8_t want[2 * SHD_WORLD_ID_BYTES];

	run(&b, n, 3, 3, SHD_WORLD_HSDP, gens, 5 * SECOND);
	fake_make_ids(&n[0], want, 2, NULL, 0);
	cr_assert_eq(b.made_ids, 2, "node 0 alone makes the ids (once here, once for `want`)");
	for (uint32_t k = 0; k < 3; k++) {
		cr_assert_eq(n[k].ret, 0, "node %u: %s", k, n[k].err);
		cr_assert_eq(n[k].gen, 1, "node %u: generation %u", k, n[k].gen);
		cr_assert(n[k].holds && n[k].inits == 1, "node %u: %u inits", k, n[k].inits);
		/* Both communicators of the HSDP layout, each from its own id of node 0's. */
		cr_assert_eq(memcmp(n[k].ids, want, sizeof(want)), 0,
			     "node %u was not given node 0's ids", k);
	}
}

Test(world_boot, live_communicators_on_every_node_are_kept, .timeout = 10)
{
	static struct board b;
	static struct node n[2];
	const uint32_t gens[2] = { 4, 4 };

	run(&b, n, 2, 2, SHD_WORLD_FSDP, gens, 5 * SECOND);
	cr_assert_eq(b.made_ids, 0);
	for (uint32_t k = 0; k < 2; k++) {
		cr_assert_eq(n[k].ret, 0, "node %u: %s", k, n[k].err);
		cr_assert(n[k].gen == 4 && n[k].inits == 0 && n[k].drops == 0 && n[k].holds,
			  "node %u: generation %u, %u inits, %u drops", k, n[k].gen, n[k].inits,
			  n[k].drops);
	}
}

Test(world_boot, one_node_without_communicators_makes_every_node_remake_them, .timeout = 10)
{
	static struct board b;
	static struct node n[3];
	const uint32_t gens[3] = { 2, 0, 2 };

	run(&b, n, 3, 3, SHD_WORLD_FSDP, gens, 5 * SECOND);
	for (uint32_t k = 0; k < 3; k++) {
		cr_assert_eq(n[k].ret, 0, "node %u: %s", k, n[k].err);
		/* Dropped first (node 1 aborted its own), then made from node 0's one id; one past the largest seen. */
		cr_assert(n[k].gen == 3 && n[k].drops >= 1 && n[k].inits == 1 && n[k].holds,
			  "node %u: generation %u, %u drops, %u inits", k, n[k].gen, n[k].drops,
			  n[k].inits);
		cr_assert_eq(memcmp(n[k].ids, n[0].ids, SHD_WORLD_ID_BYTES), 0);
	}
}

Test(world_boot, a_node_whose_set_up_fails_fails_every_node_naming_it, .timeout = 10)
{
	static struct board b;
	static struct node n[3];
	const uint32_t gens[3] = { 0, 0, 0 };

	memset(n, 0, sizeof(n));
	n[2].fail_init = 1;
	run(&b, n, 3, 3, SHD_WORLD_HSDP, gens, 5 * SECOND);
	for (uint32_t k = 0; k < 3; k++) {
		cr_assert_eq(n[k].ret, -SHARDD_E_BACKEND, "node %u: %d", k, n[k].ret);
		cr_assert(n[k].gen == 0 && !n[k].holds,
			  "node %u kept communicators the others gave up", k);
		cr_assert(strstr(n[k].err, "node 2 (ranks 4..5) did not join"), "node %u: %s", k,
			  n[k].err);
	}
	cr_assert(strstr(n[2].err, "on this node: ncclCommInitRankConfig"), "node 2 says why: %s",
		  n[2].err);
}

Test(world_boot, a_node_that_never_answers_is_named_within_the_timeout, .timeout = 10)
{
	static struct board b;
	static struct node n[3];
	const uint32_t gens[3] = { 1, 1, 1 };
	uint64_t t0 = shd_now_ns();

	/* Node 2 of 3 never runs: the others' first exchange times out. */
	run(&b, n, 3, 2, SHD_WORLD_FSDP, gens, SECOND / 5);
	cr_assert_lt(shd_now_ns() - t0, 3 * SECOND, "the bootstrap must end within the timeout");
	for (uint32_t k = 0; k < 2; k++) {
		cr_assert_eq(n[k].ret, -SHARDD_E_TIMEOUT, "node %u: %d %s", k, n[k].ret, n[k].err);
		cr_assert(n[k].gen == 0 && !n[k].holds, "node %u kept its communicators", k);
		cr_assert(strstr(n[k].err, "missing node 2 (ranks 4..5)"), "node %u: %s", k,
			  n[k].err);
	}
}
