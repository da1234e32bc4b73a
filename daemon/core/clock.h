/* SPDX-License-Identifier: MIT */
/*
 * The daemon's clock: CLOCK_MONOTONIC in nanoseconds. Every deadline
 * (rendezvous, NCCL waits, linger), every timestamp an admin view shows
 * and every op latency the metrics count are taken from it, so they
 * compare with each other and never jump with the wall clock.
 */
#ifndef SHD_CLOCK_H
#define SHD_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t shd_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#endif /* SHD_CLOCK_H */
