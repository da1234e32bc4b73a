/* SPDX-License-Identifier: MIT */
/*
 * daemon/engine/rendezvous.c: "these ranks must all arrive with the same key".
 * Arrivals, completion, key mismatch, duplicates and strangers, deadlines,
 * and the rank lists that end up in error messages people read.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "rendezvous.h"

#define SEC 1000000000ull

static void rdv_of(struct shd_rdv *r, const uint32_t *ranks, uint32_t n)
{
	cr_assert_eq(shd_rdv_init(r, ranks, n), 0);
}

Test(rendezvous, completes_when_every_expected_rank_arrived_with_the_same_key, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 1, 2, 3 };
	struct shd_rdv r;
	char why[128];

	rdv_of(&r, ranks, 4);
	cr_assert_eq(shd_rdv_arrive(&r, 2, 7, 1, 100, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(shd_rdv_arrive(&r, 0, 7, 1, 200, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(shd_rdv_arrive(&r, 3, 7, 1, 300, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(r.narrived, 3);
	cr_assert_eq(shd_rdv_arrive(&r, 1, 7, 1, 400, SEC, why, sizeof(why)), SHD_RDV_COMPLETE);
	cr_assert_eq(r.step, 7);
	cr_assert_eq(r.flags, 1);
	cr_assert_eq(r.first_rank, 2);
	shd_rdv_free(&r);
}

Test(rendezvous, key_and_deadline_come_from_the_first_arrival, .timeout = 5)
{
	const uint32_t ranks[] = { 4, 5 };
	struct shd_rdv r;
	char why[128];

	rdv_of(&r, ranks, 2);
	cr_assert_eq(r.active, 0);
	cr_assert_eq(shd_rdv_arrive(&r, 5, 12, 0, 1000, 30 * SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(r.active, 1);
	cr_assert_eq(r.first_rank, 5);
	cr_assert_eq(r.step, 12);
	cr_assert_eq(r.deadline_ns, 1000 + 30 * SEC);
	shd_rdv_free(&r);
}

Test(rendezvous, expected_ranks_are_sorted_and_duplicates_refused, .timeout = 5)
{
	const uint32_t unsorted[] = { 9, 3, 6 };
	const uint32_t dup[] = { 1, 2, 1 };
	struct shd_rdv r;

	rdv_of(&r, unsorted, 3);
	cr_assert_eq(r.ranks[0], 3);
	cr_assert_eq(r.ranks[1], 6);
	cr_assert_eq(r.ranks[2], 9);
	cr_assert_eq(shd_rdv_expects(&r, 6), 1);
	cr_assert_eq(shd_rdv_expects(&r, 7), 0);
	shd_rdv_free(&r);
	cr_assert_eq(shd_rdv_init(&r, dup, 3), -EINVAL);
	cr_assert_eq(shd_rdv_init(&r, dup, 0), -EINVAL);
}

Test(rendezvous, different_step_is_a_mismatch_naming_both_ranks_and_keys, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 1, 2 };
	struct shd_rdv r;
	char why[256];

	rdv_of(&r, ranks, 3);
	cr_assert_eq(shd_rdv_arrive(&r, 0, 5, 1, 0, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(shd_rdv_arrive(&r, 2, 6, 0, 0, SEC, why, sizeof(why)), SHD_RDV_MISMATCH);
	cr_assert_str_eq(why,
			 "rank 2 submitted step 6 flags 0x0 but rank 0 submitted step 5 flags 0x1");
	/* The mismatching arrival is not recorded: the owner fails and resets. */
	cr_assert_eq(r.narrived, 1);
	cr_assert_eq(shd_rdv_has_arrived(&r, 2), 0);
	shd_rdv_free(&r);
}

Test(rendezvous, same_step_with_different_flags_is_a_mismatch, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 1 };
	struct shd_rdv r;
	char why[256];

	rdv_of(&r, ranks, 2);
	cr_assert_eq(shd_rdv_arrive(&r, 1, 3, 0, 0, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(shd_rdv_arrive(&r, 0, 3, 1, 0, SEC, why, sizeof(why)), SHD_RDV_MISMATCH);
	cr_assert_str_eq(why,
			 "rank 0 submitted step 3 flags 0x1 but rank 1 submitted step 3 flags 0x0");
	shd_rdv_free(&r);
}

Test(rendezvous, arriving_twice_is_refused_and_says_which_step_waits, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 1 };
	struct shd_rdv r;
	char why[256];

	rdv_of(&r, ranks, 2);
	cr_assert_eq(shd_rdv_arrive(&r, 1, 8, 0, 0, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(shd_rdv_arrive(&r, 1, 9, 0, 0, SEC, why, sizeof(why)), -EINVAL);
	cr_assert_str_eq(why, "rank 1 submitted step 9 while its step 8 is still waiting");
	cr_assert_eq(r.narrived, 1);
	shd_rdv_free(&r);
}

Test(rendezvous, a_rank_outside_the_expected_set_is_refused, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 2 };
	struct shd_rdv r;
	char why[256];

	rdv_of(&r, ranks, 2);
	cr_assert_eq(shd_rdv_arrive(&r, 1, 0, 0, 0, SEC, why, sizeof(why)), -EINVAL);
	cr_assert_str_eq(why, "rank 1 is not part of this rendezvous");
	cr_assert_eq(r.active, 0);
	shd_rdv_free(&r);
}

Test(rendezvous, expires_only_when_active_and_at_its_deadline, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 1 };
	struct shd_rdv r;
	char why[128];

	rdv_of(&r, ranks, 2);
	cr_assert_eq(shd_rdv_expired(&r, UINT64_MAX), 0);
	shd_rdv_arrive(&r, 0, 1, 0, 10 * SEC, 5 * SEC, why, sizeof(why));
	cr_assert_eq(shd_rdv_expired(&r, 15 * SEC - 1), 0);
	cr_assert_eq(shd_rdv_expired(&r, 15 * SEC), 1);
	shd_rdv_reset(&r);
	cr_assert_eq(shd_rdv_expired(&r, 100 * SEC), 0);
	shd_rdv_free(&r);
}

Test(rendezvous, huge_timeout_saturates_instead_of_wrapping, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 1 };
	struct shd_rdv r;
	char why[128];

	rdv_of(&r, ranks, 2);
	shd_rdv_arrive(&r, 0, 1, 0, 10 * SEC, UINT64_MAX, why, sizeof(why));
	cr_assert_eq(r.deadline_ns, UINT64_MAX);
	cr_assert_eq(shd_rdv_expired(&r, 20 * SEC), 0);
	shd_rdv_free(&r);
}

Test(rendezvous, missing_and_present_list_ranks_ascending, .timeout = 5)
{
	const uint32_t ranks[] = { 5, 0, 3, 1 };
	struct shd_rdv r;
	char why[128], missing[64], present[64];

	rdv_of(&r, ranks, 4);
	shd_rdv_missing(&r, missing, sizeof(missing));
	shd_rdv_present(&r, present, sizeof(present));
	cr_assert_str_eq(missing, "0,1,3,5");
	cr_assert_str_eq(present, "");
	shd_rdv_arrive(&r, 3, 1, 0, 0, SEC, why, sizeof(why));
	shd_rdv_arrive(&r, 0, 1, 0, 0, SEC, why, sizeof(why));
	shd_rdv_missing(&r, missing, sizeof(missing));
	shd_rdv_present(&r, present, sizeof(present));
	cr_assert_str_eq(missing, "1,5");
	cr_assert_str_eq(present, "0,3");
	shd_rdv_free(&r);
}

Test(rendezvous, a_list_too_long_for_the_buffer_ends_with_dots, .timeout = 5)
{
	uint32_t ranks[100];
	struct shd_rdv r;
	char missing[16];

	for (uint32_t i = 0; i < 100; i++)
		ranks[i] = 100 + i;
	rdv_of(&r, ranks, 100);
	shd_rdv_missing(&r, missing, sizeof(missing));
	/* "100,101,102,10" cut, then "..." in the last bytes. */
	cr_assert_eq(strlen(missing), sizeof(missing) - 1);
	cr_assert_str_eq(missing, "100,101,102,...");
	shd_rdv_free(&r);
}

Test(rendezvous, leave_forgets_an_arrival_of_a_gone_rank, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 1, 2 };
	struct shd_rdv r;
	char why[128], present[64];

	rdv_of(&r, ranks, 3);
	shd_rdv_arrive(&r, 0, 4, 0, 0, SEC, why, sizeof(why));
	shd_rdv_arrive(&r, 2, 4, 0, 0, SEC, why, sizeof(why));
	cr_assert_eq(shd_rdv_leave(&r, 2), 1);
	cr_assert_eq(shd_rdv_leave(&r, 1), 0);
	cr_assert_eq(r.narrived, 1);
	shd_rdv_present(&r, present, sizeof(present));
	cr_assert_str_eq(present, "0");
	shd_rdv_free(&r);
}

Test(rendezvous, reset_keeps_the_expected_set_for_the_next_round, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 1 };
	struct shd_rdv r;
	char why[128];

	rdv_of(&r, ranks, 2);
	shd_rdv_arrive(&r, 0, 1, 0, 0, SEC, why, sizeof(why));
	cr_assert_eq(shd_rdv_arrive(&r, 1, 1, 0, 0, SEC, why, sizeof(why)), SHD_RDV_COMPLETE);
	shd_rdv_reset(&r);
	cr_assert_eq(r.narrived, 0);
	cr_assert_eq(r.active, 0);
	cr_assert_eq(shd_rdv_arrive(&r, 1, 2, 0, 0, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(r.first_rank, 1);
	cr_assert_eq(shd_rdv_arrive(&r, 0, 2, 0, 0, SEC, why, sizeof(why)), SHD_RDV_COMPLETE);
	shd_rdv_free(&r);
}

Test(rendezvous, missing_msg_names_late_and_waiting_ranks_in_number, .timeout = 5)
{
	const uint32_t four[] = { 3, 1, 0, 2 }, two[] = { 0, 1 };
	struct shd_rdv r;
	char why[128], msg[256];

	rdv_of(&r, four, 4);
	shd_rdv_arrive(&r, 1, 5, 0, 0, SEC, why, sizeof(why));
	shd_rdv_arrive(&r, 0, 5, 0, 0, SEC, why, sizeof(why));
	shd_rdv_missing_msg(&r, "did not arrive", "30 s", msg, sizeof(msg));
	cr_assert_str_eq(msg, "ranks 2,3 did not arrive within 30 s; ranks 0,1 are waiting");
	shd_rdv_free(&r);

	rdv_of(&r, two, 2);
	shd_rdv_arrive(&r, 0, 5, 0, 0, SEC, why, sizeof(why));
	shd_rdv_missing_msg(&r, "never submitted reduce(group 'g', step 5)", "0.05 s", msg,
			    sizeof(msg));
	cr_assert_str_eq(
		msg,
		"rank 1 never submitted reduce(group 'g', step 5) within 0.05 s; rank 0 is waiting");
	shd_rdv_who_missing(&r, msg, sizeof(msg));
	cr_assert_str_eq(msg, "rank 1");
	shd_rdv_who_present(&r, msg, sizeof(msg));
	cr_assert_str_eq(msg, "rank 0");
	shd_rdv_free(&r);
}

Test(rendezvous, present_but_leaves_out_the_rank_that_left, .timeout = 5)
{
	static const uint32_t three[] = { 4, 5, 6 };
	struct shd_rdv r;
	char msg[128], why[256];

	rdv_of(&r, three, 3);
	shd_rdv_arrive(&r, 4, 5, 0, 0, SEC, why, sizeof(why));
	shd_rdv_arrive(&r, 6, 5, 0, 0, SEC, why, sizeof(why));
	shd_rdv_who_present_but(&r, 6, msg, sizeof(msg));
	cr_assert_str_eq(msg, "rank 4");
	shd_rdv_who_present_but(&r, 5, msg, sizeof(msg));
	cr_assert_str_eq(msg, "ranks 4,6");
	shd_rdv_free(&r);

	rdv_of(&r, three, 3);
	shd_rdv_arrive(&r, 5, 5, 0, 0, SEC, why, sizeof(why));
	shd_rdv_who_present_but(&r, 5, msg, sizeof(msg));
	cr_assert_str_eq(msg, "no rank");
	shd_rdv_free(&r);
}

Test(rendezvous, missing_msg_cuts_long_rank_lists_but_keeps_its_end, .timeout = 5)
{
	static uint32_t ranks[1024];
	const char *end = "; rank 0 is waiting";
	struct shd_rdv r;
	char why[128], msg[256];
	size_t n;

	for (uint32_t i = 0; i < 1024; i++)
		ranks[i] = i;
	rdv_of(&r, ranks, 1024);
	shd_rdv_arrive(&r, 0, 1, 0, 0, SEC, why, sizeof(why));
	shd_rdv_missing_msg(&r, "did not arrive", "30 s", msg, sizeof(msg));
	n = strlen(msg);
	cr_assert(strncmp(msg, "ranks 1,2,3,", 12) == 0, "%s", msg);
	cr_assert(strstr(msg, "... did not arrive within 30 s"), "%s", msg);
	cr_assert(n > strlen(end) && strcmp(msg + n - strlen(end), end) == 0, "%s", msg);
	shd_rdv_free(&r);
}

Test(rendezvous, failing_lists_arrived_ranks_and_the_newcomer_ascending, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 1, 2, 3, 4 };
	struct shd_rdv r;
	char why[128], list[64];

	rdv_of(&r, ranks, 5);
	cr_assert_eq(shd_rdv_arrive(&r, 4, 7, 0, 100, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(shd_rdv_arrive(&r, 0, 7, 0, 100, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(shd_rdv_arrive(&r, 2, 8, 0, 100, SEC, why, sizeof(why)), SHD_RDV_MISMATCH);
	shd_rdv_failing(&r, 2, list, sizeof(list));
	cr_assert_str_eq(list, "0,2,4");
	shd_rdv_failing(&r, 2, list, 4);
	cr_assert_str_eq(list, "0,2");
	shd_rdv_free(&r);
}

Test(rendezvous, rank_missing_at_an_expiry_is_told_at_once_when_it_comes_late, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 1, 2 };
	struct shd_rdv r;
	char why[128], msg[256];

	rdv_of(&r, ranks, 3);
	cr_assert_eq(shd_rdv_arrive(&r, 0, 9, 0, 0, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(shd_rdv_arrive(&r, 1, 9, 0, 0, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(shd_rdv_expired(&r, SEC), 1);
	shd_rdv_expire(&r, SEC);
	shd_rdv_reset(&r);
	/* Rank 2 was paused: with the key given up on it fails at once, naming who waited and when. */
	cr_assert_eq(shd_rdv_arrive(&r, 2, 9, 0, 3 * SEC / 2, SEC, why, sizeof(why)), SHD_RDV_LATE);
	cr_assert_eq(r.active, 0, "a late arrival starts no wait");
	shd_rdv_late_msg(&r, 2, "submitted x(step 9)", "1 s", 3 * SEC / 2, msg, sizeof(msg));
	cr_assert_str_eq(
		msg,
		"rank 2 submitted x(step 9) 0.50 s after ranks 0,1 gave up waiting for it (the "
		"collective timeout, 1 s); failed at once: retry with the others");
	/* Told once: its next arrival, whatever the key, is an ordinary one. */
	cr_assert_eq(shd_rdv_arrive(&r, 2, 9, 0, 2 * SEC, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	shd_rdv_free(&r);
}

Test(rendezvous, late_rank_joins_when_the_others_came_back_with_the_key, .timeout = 5)
{
	const uint32_t ranks[] = { 0, 1 };
	struct shd_rdv r;
	char why[128];

	rdv_of(&r, ranks, 2);
	shd_rdv_arrive(&r, 0, 4, 0, 0, SEC, why, sizeof(why));
	shd_rdv_expire(&r, SEC);
	shd_rdv_reset(&r);
	/* Rank 0 retries the same key: the late rank completes it rather than failing it. */
	cr_assert_eq(shd_rdv_arrive(&r, 0, 4, 0, 2 * SEC, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	cr_assert_eq(shd_rdv_arrive(&r, 1, 4, 0, 2 * SEC, SEC, why, sizeof(why)), SHD_RDV_COMPLETE);
	shd_rdv_reset(&r);
	/* A rank that moved on to another key is not failed either, and its mark is gone. */
	shd_rdv_arrive(&r, 0, 5, 0, 3 * SEC, SEC, why, sizeof(why));
	shd_rdv_expire(&r, 4 * SEC);
	shd_rdv_reset(&r);
	cr_assert_eq(shd_rdv_arrive(&r, 1, 6, 0, 5 * SEC, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	shd_rdv_reset(&r);
	cr_assert_eq(shd_rdv_arrive(&r, 1, 5, 0, 6 * SEC, SEC, why, sizeof(why)), SHD_RDV_WAIT);
	shd_rdv_free(&r);
}
