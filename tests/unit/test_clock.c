/* SPDX-License-Identifier: MIT */
/* daemon/core/clock.h: the daemon's monotonic clock, in nanoseconds. */
#include <criterion/criterion.h>
#include <time.h>

#include "clock.h"

Test(clock, now_is_monotonic_and_counts_nanoseconds, .timeout = 5)
{
	struct timespec pause = { .tv_sec = 0, .tv_nsec = 2000000 };
	uint64_t a = shd_now_ns(), b = shd_now_ns(), c;

	cr_assert_gt(a, 0);
	cr_assert_geq(b, a);
	nanosleep(&pause, NULL);
	c = shd_now_ns();
	/* 2 ms of sleep is at least 2e6 ns on CLOCK_MONOTONIC (a µs or ms unit would fall short). */
	cr_assert_geq(c - b, 2000000u, "%llu ns", (unsigned long long)(c - b));
}
