/* SPDX-License-Identifier: MIT */
/* The tests' random numbers: xorshift64*, deterministic, so a failure reproduces. */
#ifndef SHARDD_TEST_XORSHIFT_H
#define SHARDD_TEST_XORSHIFT_H

#include <stdint.h>

/* The next number of the stream whose (nonzero) state is *state. */
static inline uint64_t xorshift64s(uint64_t *state)
{
	*state ^= *state >> 12;
	*state ^= *state << 25;
	*state ^= *state >> 27;
	return *state * 0x2545f4914f6cdd1dull;
}

#endif /* SHARDD_TEST_XORSHIFT_H */
