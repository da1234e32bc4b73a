/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "pool.h"

/* Helpers one parallel-for may enlist; more would only wait for ranges. */
#define POOL_FOR_MAX_HELPERS 64

struct shd_pool {
	pthread_mutex_t lock;
	pthread_cond_t work;        /* a task was queued, or stop */
	pthread_cond_t helper_done; /* a parallel-for helper finished */
	struct shd_pool_task *head, *tail;
	int stop;
	unsigned nthreads;
	pthread_t *threads;
};

struct pool_for;

struct pool_helper {
	struct shd_pool_task task;
	struct pool_for *pf;
};

struct pool_for {
	struct shd_pool *pool;
	void (*fn)(void *arg, size_t begin, size_t end);
	void *arg;
	size_t n, grain, nranges;
	atomic_size_t next;   /* next range to claim */
	unsigned outstanding; /* helpers queued or running; under pool->lock */
	struct pool_helper helpers[POOL_FOR_MAX_HELPERS];
};

static void queue_unlink(struct shd_pool *p, struct shd_pool_task *t)
{
	if (t->prev)
		t->prev->next = t->next;
	else
		p->head = t->next;
	if (t->next)
		t->next->prev = t->prev;
	else
		p->tail = t->prev;
	t->next = t->prev = NULL;
	t->queued = 0;
}

static void queue_push(struct shd_pool *p, struct shd_pool_task *t, int front)
{
	t->queued = 1;
	if (front) {
		t->prev = NULL;
		t->next = p->head;
		if (p->head)
			p->head->prev = t;
		else
			p->tail = t;
		p->head = t;
	} else {
		t->next = NULL;
		t->prev = p->tail;
		if (p->tail)
			p->tail->next = t;
		else
			p->head = t;
		p->tail = t;
	}
}

static void *pool_worker(void *arg)
{
	struct shd_pool *p = arg;

	pthread_mutex_lock(&p->lock);
	for (;;) {
		struct shd_pool_task *t;

		while (!p->head && !p->stop)
			pthread_cond_wait(&p->work, &p->lock);
		if (!p->head)
			break;
		t = p->head;
		queue_unlink(p, t);
		pthread_mutex_unlock(&p->lock);
		t->fn(t);
		pthread_mutex_lock(&p->lock);
	}
	pthread_mutex_unlock(&p->lock);
	return NULL;
}

int shd_pool_create(unsigned threads, struct shd_pool **out)
{
	struct shd_pool *p;
	int ret;

	if (threads == 0) {
		long n = sysconf(_SC_NPROCESSORS_ONLN);

		threads = n > 0 ? (unsigned)n : 1;
	}
	p = calloc(1, sizeof(*p));
	if (!p)
		return -ENOMEM;
	p->threads = calloc(threads, sizeof(*p->threads));
	if (!p->threads) {
		ret = -ENOMEM;
		goto err_free;
	}
	pthread_mutex_init(&p->lock, NULL);
	pthread_cond_init(&p->work, NULL);
	pthread_cond_init(&p->helper_done, NULL);
	for (; p->nthreads < threads; p->nthreads++) {
		ret = pthread_create(&p->threads[p->nthreads], NULL, pool_worker, p);
		if (ret) {
			ret = -ret;
			goto err_stop;
		}
	}
	*out = p;
	return 0;

err_stop:
	shd_pool_destroy(p);
	return ret;
err_free:
	free(p);
	return ret;
}

void shd_pool_destroy(struct shd_pool *p)
{
	if (!p)
		return;
	pthread_mutex_lock(&p->lock);
	p->stop = 1;
	pthread_cond_broadcast(&p->work);
	pthread_mutex_unlock(&p->lock);
	for (unsigned i = 0; i < p->nthreads; i++)
		pthread_join(p->threads[i], NULL);
	pthread_cond_destroy(&p->helper_done);
	pthread_cond_destroy(&p->work);
	pthread_mutex_destroy(&p->lock);
	free(p->threads);
	free(p);
}

void shd_pool_submit(struct shd_pool *p, struct shd_pool_task *t)
{
	pthread_mutex_lock(&p->lock);
	queue_push(p, t, 0);
	pthread_cond_signal(&p->work);
	pthread_mutex_unlock(&p->lock);
}

/* Claim and run ranges until none is left. */
static void pool_for_run(struct pool_for *pf)
{
	for (;;) {
		/*
		 * Relaxed: the counter only hands out distinct ranges. What fn
		 * wrote reaches the caller through pool->lock, which each helper
		 * takes after its last range.
		 */
		size_t r = atomic_fetch_add_explicit(&pf->next, 1, memory_order_relaxed);
		size_t begin, end;

		if (r >= pf->nranges)
			return;
		begin = r * pf->grain;
		end = begin + pf->grain < pf->n ? begin + pf->grain : pf->n;
		pf->fn(pf->arg, begin, end);
	}
}

static void pool_helper_fn(struct shd_pool_task *t)
{
	struct pool_helper *h = (struct pool_helper *)t;
	struct pool_for *pf = h->pf;
	struct shd_pool *p = pf->pool;

	pool_for_run(pf);
	/* The last touch of pf: once outstanding drops, the caller may return and its stack frame go. */
	pthread_mutex_lock(&p->lock);
	pf->outstanding--;
	pthread_cond_broadcast(&p->helper_done);
	pthread_mutex_unlock(&p->lock);
}

void shd_pool_for(struct shd_pool *p, size_t n, size_t grain,
		  void (*fn)(void *arg, size_t begin, size_t end), void *arg)
{
	/* On the stack: this call returns only once no helper touches it. */
	struct pool_for pf;
	size_t nranges, nhelpers;

	if (n == 0)
		return;
	if (grain == 0)
		grain = 1;
	nranges = n / grain + (n % grain != 0);
	nhelpers = nranges - 1;
	if (nhelpers > p->nthreads)
		nhelpers = p->nthreads;
	if (nhelpers > POOL_FOR_MAX_HELPERS)
		nhelpers = POOL_FOR_MAX_HELPERS;
	if (!nhelpers) {
		/* One range: the caller does it all. */
		fn(arg, 0, n);
		return;
	}
	pf.pool = p;
	pf.fn = fn;
	pf.arg = arg;
	pf.n = n;
	pf.grain = grain;
	pf.nranges = nranges;
	atomic_init(&pf.next, 0);
	pf.outstanding = (unsigned)nhelpers;

	pthread_mutex_lock(&p->lock);
	for (size_t i = 0; i < nhelpers; i++) {
		pf.helpers[i].pf = &pf;
		pf.helpers[i].task.fn = pool_helper_fn;
		/* Helpers go first: they finish work already started, ahead of new ops. */
		queue_push(p, &pf.helpers[i].task, 1);
	}
	pthread_cond_broadcast(&p->work);
	pthread_mutex_unlock(&p->lock);

	pool_for_run(&pf);

	/* Helpers no worker took are withdrawn; those running finish their range. */
	pthread_mutex_lock(&p->lock);
	for (size_t i = 0; i < nhelpers; i++) {
		if (pf.helpers[i].task.queued) {
			queue_unlink(p, &pf.helpers[i].task);
			pf.outstanding--;
		}
	}
	while (pf.outstanding)
		pthread_cond_wait(&p->helper_done, &p->lock);
	pthread_mutex_unlock(&p->lock);
}
