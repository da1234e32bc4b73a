/* SPDX-License-Identifier: MIT */
/*
 * Worker pool: a fixed set of threads (one per core by default) that run
 * queued tasks. The engine queues one task per running op too large for
 * its loop thread (small ones it runs itself, task.c); a task splits
 * its kernel work with shardd_pool_for, in which the calling thread takes
 * part, so a task never waits on a pool thread that may be busy with
 * another task: a pool whose threads all run ops still makes progress.
 */
#ifndef SHARDD_POOL_H
#define SHARDD_POOL_H

#include <stddef.h>

struct shardd_pool;

/* A unit of work, embedded in its owner's struct (no allocation to queue it). */
struct shardd_pool_task {
	struct shardd_pool_task *next, *prev; /* queue links, owned by the pool */
	int queued;                           /* on the queue, not yet taken */
	void (*fn)(struct shardd_pool_task *t);
};

/* Start `threads` workers (0: one per online core). 0, -ENOMEM or -errno. */
int shardd_pool_create(unsigned threads, struct shardd_pool **out);
/* Stop and join the workers. No task may be queued or running. */
void shardd_pool_destroy(struct shardd_pool *p);

/* Queue `t` (fn set by the caller); a worker runs t->fn(t) once. */
void shardd_pool_submit(struct shardd_pool *p, struct shardd_pool_task *t);

/*
 * Run fn(arg, begin, end) over [0, n) split into ranges of about `grain`
 * items, on the calling thread and on idle workers; returns when every
 * range is done. Ranges never overlap and cover [0, n) exactly.
 */
void shardd_pool_for(struct shardd_pool *p, size_t n, size_t grain,
		     void (*fn)(void *arg, size_t begin, size_t end), void *arg);

#endif /* SHARDD_POOL_H */
