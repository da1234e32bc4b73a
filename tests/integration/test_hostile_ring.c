/* SPDX-License-Identifier: MIT */
/*
 * Hostile clients against a real shardd, 1: ring entries written straight
 * into a ring (unknown ops, reserved bits, bad group ids, extreme steps,
 * thousands of random entries), corrupt ring indices, a client that never
 * reaps, a collective failing while a member is dropped. Each bad input must get an error naming the
 * field and the value (or an admin {"ok": false}), exactly one completion
 * per ring entry, and afterwards a well-behaved client on the same daemon
 * must still get a barrier, a nop and a correct unshard; the daemon's log
 * must stay free of sanitizer reports (the SANITIZE=1 build). The raw
 * clients are tests/lib/rawproto.h: proto/ only, nothing in libshardd
 * filters what reaches the daemon. The hostile suites:
 * test_hostile_{ring,control,death,replies}.c.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "hostile.h"

TestSuite(hostile, .init = start_daemon, .fini = stop_daemon, .timeout = 30);

/* ------------------------------------------------------------------ */
/* 1. Ring entries                                                     */
/* ------------------------------------------------------------------ */

struct sqe_case {
	struct shardd_sqe sqe;
	int32_t res;
	const char *needle;
};

Test(hostile, bad_ring_entries_each_get_one_error_completion_naming_field_and_value)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct raw r;
	uint32_t gid;

	raw_attach(&r, "entries", 0, 1, 1, 64);
	gid = raw_register_small(&r, "g");

	struct sqe_case cases[] = {
		{ sqe_of(0, 0, 0, 0, 0), -SHARDD_E_INVALID, "op 0" },
		{ sqe_of(SHARDD_OP_COUNT, 0, 0, 0, 0), -SHARDD_E_INVALID, "op 10" },
		{ sqe_of(255, gid, 1, 0, 0), -SHARDD_E_INVALID, "op 255" },
		{ sqe_of(SHARDD_OP_NOP, 0, 0, 0, 0), -SHARDD_E_INVALID, "rsvd0[1] = 0x5" },
		{ sqe_of(SHARDD_OP_NOP, 0, 0, 0, 0), -SHARDD_E_INVALID, "rsvd1 = 0x77" },
		{ sqe_of(SHARDD_OP_BARRIER, 0, 0, 0, 0), -SHARDD_E_INVALID, "arg[3] = 0xdead" },
		{ sqe_of(SHARDD_OP_NOP, 0, 0, 0x10, 0), -SHARDD_E_INVALID, "flags = 0x10" },
		{ sqe_of(SHARDD_OP_BARRIER, 0, 1, 0x1, 0), -SHARDD_E_INVALID, "flags = 0x1" },
		{ sqe_of(SHARDD_OP_NOP, 3, 0, 0, 0), -SHARDD_E_INVALID, "group = 3" },
		{ sqe_of(SHARDD_OP_BARRIER, UINT32_MAX, 1, 0, 0), -SHARDD_E_INVALID,
		  "group = 4294967295" },
		{ sqe_of(SHARDD_OP_UNSHARD, gid, 1, 0x1, 0), -SHARDD_E_INVALID, "flags = 0x1" },
		{ sqe_of(SHARDD_OP_REDUCE, gid, 1, 0x5, 0), -SHARDD_E_INVALID, "unknown bits 0x4" },
		{ sqe_of(SHARDD_OP_RESHARD, gid, 1, 0x80000000u, 0), -SHARDD_E_INVALID,
		  "flags = 0x80000000" },
		{ sqe_of(SHARDD_OP_ZERO_GRAD, gid, 0, 0, 0), -SHARDD_E_INVALID, "arg[0] = 0x1" },
		{ sqe_of(SHARDD_OP_UNSHARD, 0, 1, 0, 0), -SHARDD_E_NOGROUP, "group id 0" },
		{ sqe_of(SHARDD_OP_REDUCE, 999, 1, 0, 0), -SHARDD_E_NOGROUP, "group id 999" },
		{ sqe_of(SHARDD_OP_ZERO_GRAD, UINT32_MAX, 0, 0, 0), -SHARDD_E_NOGROUP,
		  "group id 4294967295" },
		{ sqe_of(SHARDD_OP_RESHARD, gid + 1, 0, 0, 0), -SHARDD_E_NOGROUP, "group id" },
		{ sqe_of(SHARDD_OP_RESHARD, gid, 0, 0, 0), -SHARDD_E_STATE, "no unsharded copy" },
		{ sqe_of(SHARDD_OP_NOP, 0, 0, 0, 0), -SHARDD_E_INVALID, "sqe.fence = 0x3, but" },
		{ sqe_of(SHARDD_OP_UNSHARD, gid, 1, 0, 0), -SHARDD_E_INVALID, "unknown bits 0x80" },
	};
	size_t n = sizeof(cases) / sizeof(cases[0]);
	uint8_t seen[64] = { 0 };

	cases[3].sqe.rsvd0[1] = 0x5;
	cases[4].sqe.rsvd1 = 0x77;
	cases[5].sqe.arg[3] = 0xdead;
	cases[13].sqe.arg[0] = 0x1;
	cases[19].sqe.fence = SHARDD_FENCE_WAIT | SHARDD_FENCE_SIGNAL; /* no STREAM sent */
	cases[20].sqe.fence = 0x81;
	/* All at once: a batch of bad entries, completions matched by user_data. */
	for (size_t i = 0; i < n; i++) {
		cases[i].sqe.user_data = 1000 + i;
		cr_assert_eq(shardd_sq_push(&r.ring, &cases[i].sqe), 0);
	}
	raw_kick(&r);
	for (size_t k = 0; k < n; k++) {
		struct shardd_cqe c;
		size_t i;

		raw_reap_ok(&r, &c, msg, "bad entry");
		i = (size_t)(c.user_data - 1000);
		cr_assert_lt(i, n, "completion with unknown user_data %llu",
			     (unsigned long long)c.user_data);
		cr_assert_eq(seen[i]++, 0, "entry %zu completed twice", i);
		cr_assert_eq(c.op, cases[i].sqe.op, "entry %zu: op not echoed", i);
		cr_assert_eq(c.step, cases[i].sqe.step, "entry %zu: step not echoed", i);
		cr_assert_eq(c.res, cases[i].res, "entry %zu: res %d (%s), want %d; text '%s'", i,
			     c.res, shardd_strerror(c.res), cases[i].res, msg);
		cr_assert_eq(c.has_msg, 1, "entry %zu: error without text", i);
		cr_assert_not_null(strstr(msg, cases[i].needle), "entry %zu: text '%s' lacks '%s'",
				   i, msg, cases[i].needle);
	}
	cr_assert_eq(shardd_cq_ready(&r.ring), 0, "more completions than entries");
	raw_nop_ok(&r, 1);
	raw_close(&r);
	assert_others_served();
}

Test(hostile, extreme_step_values_round_trip_and_mismatches_name_both_steps)
{
	char msg[SHARDD_RING_MSG_SIZE], max[32];
	struct raw a, b;
	struct shardd_cqe c;
	uint32_t gid;
	uint64_t steps[] = { 0, UINT64_MAX, 1, UINT64_MAX - 1 };

	raw_attach(&a, "steps", 0, 1, 1, 0);
	gid = raw_register_small(&a, "g");
	for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
		uint8_t ops[] = { SHARDD_OP_BARRIER, SHARDD_OP_UNSHARD, SHARDD_OP_RESHARD,
				  SHARDD_OP_REDUCE, SHARDD_OP_ZERO_GRAD };

		for (size_t k = 0; k < sizeof(ops); k++) {
			uint32_t group = ops[k] == SHARDD_OP_BARRIER ? 0 : gid;

			c = raw_op(&a, sqe_of(ops[k], group, steps[i], 0, i * 10 + k), msg);
			cr_assert_eq(c.res, 0, "%s step %llu: %s", shardd_strerror(c.res),
				     (unsigned long long)steps[i], msg);
			cr_assert_eq(c.step, steps[i], "step not echoed exactly");
		}
	}
	raw_close(&a);

	/* Two ranks that disagree on a step at the extremes: both fail, both steps named. */
	snprintf(max, sizeof(max), "%llu", (unsigned long long)UINT64_MAX);
	raw_attach(&a, "steps2", 0, 1, 2, 0);
	raw_attach(&b, "steps2", 1, 1, 2, 0);
	raw_push(&a, (struct shardd_sqe[]){ sqe_of(SHARDD_OP_BARRIER, 0, 0, 0, 1) });
	raw_nop_ok(&a, 2); /* the barrier was taken before b's arrives */
	c = raw_op(&b, sqe_of(SHARDD_OP_BARRIER, 0, UINT64_MAX, 0, 3), msg);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "barrier mismatch: %d %s", c.res, msg);
	cr_assert(strstr(msg, max) && strstr(msg, "barrier 0"), "text '%s' lacks both steps", msg);
	raw_reap_ok(&a, &c, msg, "barrier of rank 0");
	cr_assert_eq(c.user_data, 1);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "rank 0's barrier: %d %s", c.res, msg);

	raw_send_register(
		&a, (struct shardd_register_group[]){ reg_hdr("g", 1) },
		(struct shardd_param_spec[]){ pspec("w", SHARDD_DTYPE_BF16, 1, (uint64_t[]){ 6 }) },
		1);
	raw_send_register(
		&b, (struct shardd_register_group[]){ reg_hdr("g", 1) },
		(struct shardd_param_spec[]){ pspec("w", SHARDD_DTYPE_BF16, 1, (uint64_t[]){ 6 }) },
		1);
	gid = raw_recv_group(&a);
	cr_assert_eq(raw_recv_group(&b), gid);
	raw_push(&a, (struct shardd_sqe[]){ sqe_of(SHARDD_OP_UNSHARD, gid, UINT64_MAX, 0, 4) });
	raw_nop_ok(&a, 5);
	c = raw_op(&b, sqe_of(SHARDD_OP_UNSHARD, gid, 0, 0, 6), msg);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "unshard mismatch: %d %s", c.res, msg);
	cr_assert(strstr(msg, max) && strstr(msg, "step 0"), "text '%s' lacks both steps", msg);
	raw_reap_ok(&a, &c, msg, "unshard of rank 0");
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH);
	raw_close(&a);
	raw_close(&b);
	assert_others_served();
}

Test(hostile, all_reduce_flag_on_a_1xW_mesh_is_accepted_alike_and_mismatches_fail_both)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct raw a, b;
	struct shardd_cqe c;
	uint32_t gid;
	struct shardd_register_group h = reg_hdr("g", 1);
	struct shardd_param_spec s = pspec("w", SHARDD_DTYPE_FP32, 2, (uint64_t[]){ 3, 4 });

	raw_attach(&a, "hsdp-flags", 0, 1, 2, 0);
	raw_attach(&b, "hsdp-flags", 1, 1, 2, 0);
	raw_send_register(&a, &h, &s, 1);
	raw_send_register(&b, &h, &s, 1);
	gid = raw_recv_group(&a);
	cr_assert_eq(raw_recv_group(&b), gid);

	/* No replicate dim: the all-reduce is across one replica; both ranks asking is fine. */
	raw_push(&a, (struct shardd_sqe[]){
			     sqe_of(SHARDD_OP_REDUCE, gid, 1, SHARDD_REDUCE_ALL_REDUCE, 1) });
	c = raw_op(&b, sqe_of(SHARDD_OP_REDUCE, gid, 1, SHARDD_REDUCE_ALL_REDUCE, 2), msg);
	cr_assert_eq(c.res, 0, "rank 1 reduce with ALL_REDUCE: %s", msg);
	raw_reap_ok(&a, &c, msg, "rank 0 reduce");
	cr_assert_eq(c.res, 0, "rank 0 reduce with ALL_REDUCE: %s", msg);

	/* Ranks of the shard group disagreeing on the flag: both fail, both flags named. */
	raw_push(&a, (struct shardd_sqe[]){
			     sqe_of(SHARDD_OP_REDUCE, gid, 2, SHARDD_REDUCE_ALL_REDUCE, 3) });
	raw_nop_ok(&a, 4);
	c = raw_op(&b, sqe_of(SHARDD_OP_REDUCE, gid, 2, 0, 5), msg);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "flag mismatch: %d %s", c.res, msg);
	cr_assert(strstr(msg, "flags 0x1") && strstr(msg, "flags 0x0"), "text '%s'", msg);
	raw_reap_ok(&a, &c, msg, "rank 0 reduce");
	cr_assert_eq(c.user_data, 3);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "rank 0: %d %s", c.res, msg);

	/* A flag bit HSDP does not define. */
	c = raw_op(&a, sqe_of(SHARDD_OP_REDUCE, gid, 3, 0x4, 6), msg);
	cr_assert_eq(c.res, -SHARDD_E_INVALID);
	cr_assert_not_null(strstr(msg, "flags = 0x4"), "text '%s'", msg);
	raw_close(&a);
	raw_close(&b);
	assert_others_served();
}

#define RANDOM_ENTRIES 20000u

Test(hostile, thousands_of_random_entries_each_get_exactly_one_completion)
{
	struct shardd_sqe *sent = calloc(RANDOM_ENTRIES, sizeof(*sent));
	uint8_t *seen = calloc(RANDOM_ENTRIES, 1);
	char msg[SHARDD_RING_MSG_SIZE];
	uint32_t submitted = 0, done = 0, failed = 0, gid, gid2;
	int64_t deadline = harness_now_ms() + 20000;
	struct raw r;

	cr_assert(sent && seen);
	raw_attach(&r, "random", 0, 1, 1, 256);
	gid = raw_register_small(&r, "a");
	gid2 = raw_register_small(&r, "b");
	rnd_seed(0x5eed5eed12345678ull);
	while (done < RANDOM_ENTRIES) {
		struct shardd_cqe c;
		int ret;

		while (submitted < RANDOM_ENTRIES) {
			struct shardd_sqe *s = &sent[submitted];
			uint32_t groups[] = { 0, gid, gid2, gid2 + 1, (uint32_t)rnd() };

			if (rnd() % 4 == 0) {
				/* Pure noise. */
				rnd_bytes(s, sizeof(*s));
			} else {
				/* Plausible entries: real ops and groups, odd steps and flags. */
				memset(s, 0, sizeof(*s));
				s->op = (uint8_t)(rnd() % 9);
				s->group = groups[rnd() % 5];
				s->step = rnd() % 3 ? rnd() % 8 : rnd();
				s->flags = rnd() % 4 ? 0 : rnd() % 2 ? 1 : (uint32_t)rnd();
				if (rnd() % 16 == 0)
					s->arg[rnd() % 4] = 1ull << (rnd() % 64);
			}
			s->user_data = submitted;
			if (shardd_sq_push(&r.ring, s) == -EAGAIN)
				break;
			submitted++;
		}
		raw_kick(&r);
		ret = raw_reap(&r, &c, msg, (int)(deadline - harness_now_ms()));
		if (ret < 0)
			harness_daemon_dump_log(&hostile_daemon);
		cr_assert_eq(ret, 0, "after %u of %u completions: %s", done, RANDOM_ENTRIES,
			     strerror(-ret));
		cr_assert_lt(c.user_data, submitted, "completion of an entry never submitted: %llu",
			     (unsigned long long)c.user_data);
		cr_assert_eq(seen[c.user_data]++, 0, "entry %llu completed twice",
			     (unsigned long long)c.user_data);
		cr_assert_eq(c.op, sent[c.user_data].op, "entry %llu: op not echoed",
			     (unsigned long long)c.user_data);
		cr_assert_eq(c.step, sent[c.user_data].step);
		cr_assert_eq(c.group, sent[c.user_data].group);
		if (c.res < 0) {
			failed++;
			cr_assert(c.has_msg && msg[0], "entry %llu failed with %d but no text",
				  (unsigned long long)c.user_data, c.res);
		}
		done++;
	}
	cr_assert_eq(shardd_cq_ready(&r.ring), 0, "more completions than entries");
	/* Most are garbage; the plausible ones include some that succeed. */
	cr_assert(failed > RANDOM_ENTRIES / 4 && failed < RANDOM_ENTRIES,
		  "%u of %u random entries failed", failed, RANDOM_ENTRIES);
	raw_nop_ok(&r, 1);
	raw_close(&r);
	free(sent);
	free(seen);
	assert_others_served();
}

/* A client whose ring indices went bad is dropped, with a logged error. */
static void expect_dropped_for_corrupt_ring(struct raw *r, const char *which)
{
	char needle[64];

	expect_eof(r->fd, which);
	cr_assert(ring_load(&r->ring.hdr->flags) & SHARDD_RING_DEAD, "%s: ring not marked DEAD",
		  which);
	snprintf(needle, sizeof(needle), "ring %s index is corrupt", which);
	wait_log(&hostile_daemon, needle);
}

Test(hostile, corrupt_ring_indices_drop_only_that_client)
{
	struct raw bad, bystander;
	uint32_t head;

	raw_attach(&bystander, "innocent", 0, 1, 1, 0);

	/* A tail more than one ring ahead of the head. */
	raw_attach(&bad, "corrupt", 0, 1, 1, 16);
	head = ring_load(&bad.ring.hdr->sq_head);
	shardd_store_release(&bad.ring.hdr->sq_tail, head + 16 + 5);
	cr_assert_eq(write(bad.doorbell, &(uint64_t){ 1 }, 8), 8);
	expect_dropped_for_corrupt_ring(&bad, "SQ tail");
	raw_close(&bad);
	raw_nop_ok(&bystander, 1);

	/* The same, with the capacity in the shared header rewritten to hide it. */
	raw_attach(&bad, "corrupt", 0, 1, 1, 16);
	head = ring_load(&bad.ring.hdr->sq_head);
	bad.ring.hdr->sq_entries = UINT32_MAX;
	bad.ring.hdr->cq_entries = UINT32_MAX;
	shardd_store_release(&bad.ring.hdr->sq_tail, head + 100000);
	cr_assert_eq(write(bad.doorbell, &(uint64_t){ 1 }, 8), 8);
	expect_dropped_for_corrupt_ring(&bad, "SQ tail");
	raw_close(&bad);
	raw_nop_ok(&bystander, 2);

	/* A CQ head run past the CQ tail, then a submission. */
	raw_attach(&bad, "corrupt", 0, 1, 1, 16);
	raw_nop_ok(&bad, 1);
	shardd_store_release(&bad.ring.hdr->cq_head, ring_load(&bad.ring.hdr->cq_tail) + 7);
	raw_push(&bad, (struct shardd_sqe[]){ sqe_of(SHARDD_OP_NOP, 0, 0, 0, 2) });
	cr_assert_eq(write(bad.doorbell, &(uint64_t){ 1 }, 8), 8);
	expect_dropped_for_corrupt_ring(&bad, "CQ head");
	raw_close(&bad);

	/* The rank is free again, and everyone else was never disturbed. */
	raw_attach(&bad, "corrupt", 0, 1, 1, 16);
	raw_nop_ok(&bad, 3);
	raw_close(&bad);
	raw_nop_ok(&bystander, 3);
	raw_close(&bystander);
	assert_others_served();
}

Test(hostile, client_that_never_reaps_stalls_only_itself_and_its_cq_never_overflows)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct raw r;
	uint32_t cq_cap, sq_cap, pushed = 0, reaped = 0;
	uint8_t seen[64] = { 0 };
	int64_t deadline;

	raw_attach(&r, "no-reap", 0, 1, 1, 8);
	sq_cap = r.ring.sq_mask + 1;
	cq_cap = r.ring.cq_mask + 1;
	cr_assert_eq(sq_cap, 8);
	cr_assert_eq(cq_cap, 16);

	/* Keep the SQ full until the daemon stops taking: every CQ slot is used. */
	deadline = harness_now_ms() + REPLY_MS;
	while (pushed < cq_cap + sq_cap && harness_now_ms() < deadline) {
		struct shardd_sqe s = sqe_of(SHARDD_OP_NOP, 0, 0, 0, pushed);

		if (shardd_sq_push(&r.ring, &s) == 0)
			pushed++;
		raw_kick(&r);
	}
	cr_assert_eq(pushed, cq_cap + sq_cap, "the daemon took only %u entries", pushed - sq_cap);
	deadline = harness_now_ms() + REPLY_MS;
	while (shardd_cq_ready(&r.ring) < cq_cap && harness_now_ms() < deadline)
		sched_yield();
	cr_assert_eq(shardd_cq_ready(&r.ring), cq_cap);

	/* The daemon serves others meanwhile; that proves its loop turned many times. */
	assert_others_served();
	cr_assert_eq(shardd_cq_ready(&r.ring), cq_cap, "the CQ overflowed its %u slots", cq_cap);
	cr_assert_eq(ring_load(&r.ring.hdr->sq_tail) - ring_load(&r.ring.hdr->sq_head), sq_cap,
		     "the daemon took entries it had no CQ room for");

	/* Reaping lets the stalled entries through, each completed once. */
	while (reaped < pushed) {
		struct shardd_cqe c;

		raw_reap_ok(&r, &c, msg, "stalled nops");
		cr_assert_lt(c.user_data, pushed);
		cr_assert_eq(seen[c.user_data]++, 0, "nop %llu completed twice",
			     (unsigned long long)c.user_data);
		cr_assert_eq(c.res, 0);
		reaped++;
	}
	raw_nop_ok(&r, 100);
	raw_close(&r);
}

/*
 * Three ranks; rank 1 corrupts its CQ while it waits in an unshard, and
 * rank 2's mismatching step fails that unshard. Completing rank 1's op
 * drops rank 1, whose departure fails the same collective again: rank 0
 * must still get each of its completions exactly once.
 */
Test(hostile, collective_failing_while_a_member_is_dropped_completes_each_op_once)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct raw r[3];
	struct shardd_cqe c;
	uint32_t g1, g2;
	int got101 = 0, got104 = 0;

	for (uint32_t k = 0; k < 3; k++)
		raw_attach(&r[k], "trio", k, 1, 3, 0);
	for (uint32_t k = 0; k < 3; k++)
		raw_send_register(&r[k], (struct shardd_register_group[]){ reg_hdr("g1", 1) },
				  (struct shardd_param_spec[]){
					  pspec("w", SHARDD_DTYPE_FP32, 1, (uint64_t[]){ 6 }) },
				  1);
	g1 = raw_recv_group(&r[0]);
	cr_assert_eq(raw_recv_group(&r[1]), g1);
	cr_assert_eq(raw_recv_group(&r[2]), g1);
	for (uint32_t k = 0; k < 3; k++)
		raw_send_register(&r[k], (struct shardd_register_group[]){ reg_hdr("g2", 1) },
				  (struct shardd_param_spec[]){
					  pspec("w", SHARDD_DTYPE_FP32, 1, (uint64_t[]){ 6 }) },
				  1);
	g2 = raw_recv_group(&r[0]);
	cr_assert_eq(raw_recv_group(&r[1]), g2);
	cr_assert_eq(raw_recv_group(&r[2]), g2);

	/* Rank 0 waits in two collectives; rank 1 in one. Nops prove they were taken. */
	raw_push(&r[0], (struct shardd_sqe[]){ sqe_of(SHARDD_OP_UNSHARD, g1, 1, 0, 101) });
	raw_push(&r[0], (struct shardd_sqe[]){ sqe_of(SHARDD_OP_UNSHARD, g2, 1, 0, 104) });
	raw_nop_ok(&r[0], 102);
	raw_push(&r[1], (struct shardd_sqe[]){ sqe_of(SHARDD_OP_UNSHARD, g1, 1, 0, 201) });
	raw_nop_ok(&r[1], 202);
	shardd_store_release(&r[1].ring.hdr->cq_head, ring_load(&r[1].ring.hdr->cq_tail) + 7);

	c = raw_op(&r[2], sqe_of(SHARDD_OP_UNSHARD, g1, 2, 0, 301), msg);
	cr_assert_eq(c.res, -SHARDD_E_MISMATCH, "rank 2: %d %s", c.res, msg);
	expect_eof(r[1].fd, "rank 1 with a corrupt CQ");

	/* Rank 0: its g1 unshard failed once, its g2 unshard failed once (rank 1 left). */
	for (int k = 0; k < 2; k++) {
		raw_reap_ok(&r[0], &c, msg, "rank 0");
		cr_assert(c.user_data == 101 || c.user_data == 104,
			  "unexpected completion %llu (%s)", (unsigned long long)c.user_data, msg);
		cr_assert_lt(c.res, 0, "completion %llu succeeded",
			     (unsigned long long)c.user_data);
		/* Dropped after the push that found it broken, rank 1 is still named as gone. */
		if (c.user_data == 104) {
			cr_assert_eq(c.res, -SHARDD_E_PEER_DIED, "unshard(g2): %d %s", c.res, msg);
			cr_assert(strstr(msg, "rank 1 left"),
				  "unshard(g2) does not name rank 1: %s", msg);
		}
		got101 += c.user_data == 101;
		got104 += c.user_data == 104;
	}
	cr_assert_eq(got101, 1, "unshard(g1) completed %d times", got101);
	cr_assert_eq(got104, 1, "unshard(g2) completed %d times", got104);
	raw_nop_ok(&r[0], 103);
	cr_assert_eq(shardd_cq_ready(&r[0].ring), 0, "rank 0 got an extra completion");
	cr_assert(!log_contains("without a reserved CQ slot"),
		  "the daemon completed an op twice (see its log)");
	for (int k = 0; k < 3; k++)
		raw_close(&r[k]);
	assert_others_served();
}

/*
 * A rank that arrived at a collective and then left is the one the error
 * names as gone, not one of the ranks the collective failed for.
 */
Test(hostile, rank_leaving_after_arriving_is_not_listed_among_the_failed)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct raw r[3];
	struct shardd_cqe c;
	uint32_t g;

	for (uint32_t k = 0; k < 3; k++)
		raw_attach(&r[k], "gone", k, 1, 3, 0);
	for (uint32_t k = 0; k < 3; k++)
		raw_send_register(&r[k], (struct shardd_register_group[]){ reg_hdr("g", 1) },
				  (struct shardd_param_spec[]){
					  pspec("w", SHARDD_DTYPE_FP32, 1, (uint64_t[]){ 6 }) },
				  1);
	g = raw_recv_group(&r[0]);
	cr_assert_eq(raw_recv_group(&r[1]), g);
	cr_assert_eq(raw_recv_group(&r[2]), g);

	raw_push(&r[0], (struct shardd_sqe[]){ sqe_of(SHARDD_OP_UNSHARD, g, 1, 0, 11) });
	raw_nop_ok(&r[0], 12);
	raw_push(&r[1], (struct shardd_sqe[]){ sqe_of(SHARDD_OP_UNSHARD, g, 1, 0, 21) });
	raw_nop_ok(&r[1], 22);
	raw_close(&r[1]);

	raw_reap_ok(&r[0], &c, msg, "rank 0");
	cr_assert_eq(c.user_data, 11, "unexpected completion %llu (%s)",
		     (unsigned long long)c.user_data, msg);
	cr_assert_eq(c.res, -SHARDD_E_PEER_DIED, "unshard: %d %s", c.res, msg);
	cr_assert(strstr(msg, "rank 1 left") && strstr(msg, "; failed for rank 0") &&
			  !strstr(msg, "0,1"),
		  "want rank 1 named as gone and the op failed for rank 0 only: %s", msg);
	raw_close(&r[0]);
	raw_close(&r[2]);
	assert_others_served();
}
