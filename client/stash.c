/* SPDX-License-Identifier: MIT */
/*
 * The stash (internal.h): completions a client holds for its caller's
 * poll and wait, whoever produced them (the ring, reaped while a sync call
 * waited for its own; a rank-executed op that ran here).
 */
#include <errno.h>
#include <stdlib.h>

#include "internal.h"

int shardd_stash_push(struct shardd_stash *s, const struct shardd_completion *cp)
{
	if (s->count == s->cap) {
		uint32_t cap = s->cap ? s->cap * 2 : 16;
		struct shardd_completion *v = malloc(sizeof(*v) * cap);

		if (!v || cap < s->cap) {
			free(v);
			return shardd_err_set(-ENOMEM,
					      "keep %u unreaped completions: out of memory",
					      s->count + 1);
		}
		for (uint32_t i = 0; i < s->count; i++)
			v[i] = s->v[(s->head + i) & (s->cap - 1)];
		free(s->v);
		s->v = v;
		s->head = 0;
		s->cap = cap;
	}
	s->v[(s->head + s->count) & (s->cap - 1)] = *cp;
	s->count++;
	return 0;
}

int shardd_stash_pop(struct shardd_stash *s, struct shardd_completion *out)
{
	if (!s->count)
		return 0;
	*out = s->v[s->head];
	s->head = (s->head + 1) & (s->cap - 1);
	s->count--;
	return 1;
}
