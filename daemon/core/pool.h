/* SPDX-License-Identifier: MIT */
/*
 * Worker pool: a fixed set of threads (one per core by default) that run
 * queued tasks. The engine queues one task per running op too large for
 * its loop thread (small ones it runs itself, task.c); a task splits
 * its kernel work with shd_pool_for, in which the calling thread takes
 * part, so a task never waits on a pool thread that may be busy with
 * another task: a pool whose threads all run ops still makes progress.
 */
#ifndef SHD_POOL_H
#define SHD_POOL_H

#include <stddef.h>

struct shd_pool;

/* A unit of work, embedded in its owner's struct (no allocation to queue it). */
struct shd_pool_task {
	struct shd_pool_task *next, *prev; /* queue links, owned by the pool */
	int queued;                        /* on the queue, not yet taken */
	void (*fn)(struct shd_pool_task *t);
};

/* Start `threads` workers (0: one per online core). 0, -ENOMEM or -errno. */
int shd_pool_create(unsigned threads, struct shd_pool **out);
/* Stop and join the workers. No task may be queued or running. */
void shd_pool_destroy(struct shd_pool *p);

/* Queue `t` (fn set by the caller); a worker runs t->fn(t) once. */
void shd_pool_submit(struct shd_pool *p, struct shd_pool_task *t);

/*
 * Run fn(arg, begin, end) over [0, n) split into ranges of about `grain`
 * items, on the calling thread and on idle workers; returns when every
 * range is done. Ranges never overlap and cover [0, n) exactly.
 */
void shd_pool_for(struct shd_pool *p, size_t n, size_t grain,
		  void (*fn)(void *arg, size_t begin, size_t end), void *arg);

#endif /* SHD_POOL_H */
