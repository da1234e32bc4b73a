/* SPDX-License-Identifier: MIT */
/*
 * Waking a sleeping daemon through the doorbell (proto/PROTOCOL.md 5.5):
 * each submission waits until the daemon has announced sleep on the ring
 * (NEED_WAKEUP set, so its spin window is over and it is blocked in the
 * kernel or about to be), then pushes an entry and rings. Every entry must
 * get exactly one completion, with its own user_data, within the timeout:
 * a lost wake-up shows as -ETIMEDOUT naming the entry. With two clients,
 * an entry left on one ring without a doorbell while the other ring rings
 * still completes, once, as does the one that rang. The
 * clients are tests/lib/rawproto.h (the ring mapped directly), so the test
 * sees the flag the daemon sets and nothing in libshardd hides a miss.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <sched.h>
#include <stdlib.h>

#include "hostile.h"

TestSuite(ring_wake, .init = start_daemon, .fini = stop_daemon, .timeout = 60);

#define ROUNDS    300
#define ASLEEP_MS 5000 /* the spin window is ~50 us; the periodic turn 100 ms */
#define REAP_MS   5000
/*
 * Without its wake-up the daemon would still serve a ring at its next cron
 * turn (SHD_CRON_PERIOD_MS, 100 ms): a lost doorbell costs 50 ms on average
 * and never fails a reap. So the rounds' median must stay far below that
 * (25 ms); a woken daemon answers in tens of us, ms on a loaded machine.
 */
#define CRON_MS       100
#define MEDIAN_MAX_MS (CRON_MS / 4)

/* Wait until the daemon has set NEED_WAKEUP on r's ring: it will sleep until a doorbell. */
static void wait_asleep(struct raw *r, const char *who, unsigned round)
{
	int64_t deadline = harness_now_ms() + ASLEEP_MS;

	while (!(ring_load(&r->ring.hdr->flags) & SHARDD_RING_NEED_WAKEUP)) {
		cr_assert(!raw_gone(r), "%s round %u: the daemon dropped the client", who, round);
		cr_assert(harness_now_ms() < deadline,
			  "%s round %u: the daemon did not set NEED_WAKEUP within %d ms of an idle "
			  "ring",
			  who, round, ASLEEP_MS);
		sched_yield();
	}
}

/* Reap r's next completion and check it is the nop `user_data`, and the only one. */
static void reap_nop(struct raw *r, uint64_t user_data, const char *who)
{
	char msg[SHARDD_RING_MSG_SIZE];
	struct shardd_cqe c;
	int ret = raw_reap(r, &c, msg, REAP_MS);

	cr_assert_eq(ret, 0,
		     "%s: no completion of nop user_data %llu within %d ms after the "
		     "doorbell (%d): a lost wake-up",
		     who, (unsigned long long)user_data, REAP_MS, ret);
	cr_assert_eq(c.user_data, user_data, "%s: completion for user_data %llu, want %llu", who,
		     (unsigned long long)c.user_data, (unsigned long long)user_data);
	cr_assert_eq(c.res, 0, "%s: nop %llu failed: %d %s", who, (unsigned long long)user_data,
		     c.res, msg);
	cr_assert_eq(c.op, SHARDD_OP_NOP, "%s: completion op %u, want nop", who, c.op);
	cr_assert_eq(shardd_cq_ready(&r->ring), 0, "%s: more than one completion for nop %llu", who,
		     (unsigned long long)user_data);
}

static int cmp_i64(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;

	return (x > y) - (x < y);
}

/* The rounds were woken by the doorbell, not by the daemon's cron turn. */
static void assert_woken(int64_t *ms, unsigned n, const char *what)
{
	qsort(ms, n, sizeof(*ms), cmp_i64);
	cr_assert_lt(ms[n / 2], MEDIAN_MAX_MS,
		     "%s: median round trip %lld ms over %u rounds (max %lld): completions wait "
		     "for the daemon's %d ms cron turn, so the doorbell did not wake it",
		     what, (long long)ms[n / 2], n, (long long)ms[n - 1], CRON_MS);
}

Test(ring_wake, nop_to_a_sleeping_daemon_completes_once_every_time)
{
	static int64_t ms[ROUNDS];
	struct raw r;

	raw_attach(&r, "wake1", 0, 1, 1, 64);
	for (unsigned i = 0; i < ROUNDS; i++) {
		wait_asleep(&r, "client", i);
		ms[i] = harness_now_ms();
		raw_push(&r, &(struct shardd_sqe){ .op = SHARDD_OP_NOP, .user_data = 1000 + i });
		reap_nop(&r, 1000 + i, "client");
		ms[i] = harness_now_ms() - ms[i];
	}
	assert_woken(ms, ROUNDS, "nop after sleep");
	raw_close(&r);
	assert_daemon_alive();
}

Test(ring_wake, entry_without_doorbell_beside_one_that_rang_both_complete_once)
{
	static int64_t ms[ROUNDS];
	struct raw a, b;

	raw_attach(&a, "wake2a", 0, 1, 1, 64);
	raw_attach(&b, "wake2b", 0, 1, 1, 64);
	for (unsigned i = 0; i < ROUNDS; i++) {
		struct raw *ring = i % 2 ? &a : &b, *quiet = i % 2 ? &b : &a;

		wait_asleep(&a, "client a", i);
		wait_asleep(&b, "client b", i);
		/* An entry on the quiet ring without a doorbell, then one on the other ring with it. */
		ms[i] = harness_now_ms();
		cr_assert_eq(
			shardd_sq_push(&quiet->ring, &(struct shardd_sqe){ .op = SHARDD_OP_NOP,
									   .user_data = 2 * i }),
			0);
		raw_push(ring, &(struct shardd_sqe){ .op = SHARDD_OP_NOP, .user_data = 2 * i + 1 });
		reap_nop(ring, 2 * i + 1, i % 2 ? "client a" : "client b");
		reap_nop(quiet, 2 * i, i % 2 ? "client b (no doorbell)" : "client a (no doorbell)");
		ms[i] = harness_now_ms() - ms[i];
	}
	assert_woken(ms, ROUNDS, "two rings, one doorbell");
	raw_close(&a);
	raw_close(&b);
	assert_daemon_alive();
}
