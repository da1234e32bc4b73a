/* SPDX-License-Identifier: MIT */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <liburing.h>

#include "log.h"
#include "loop.h"

#define LOOP_ENTRIES 256 /* io_uring SQ size; the CQ is twice that and never drops */
#define LOOP_BATCH   64  /* completions taken per peek */
/*
 * The low bit of a completion's user_data: the completion of a cancel of
 * the event's poll, not of the poll itself (events come from calloc, so
 * that bit of their address is 0).
 */
#define LOOP_TAG_CANCEL ((uintptr_t)1)

struct shd_loop_event {
	struct shd_loop_event *next, *prev; /* every live or draining event */
	int fd;
	uint32_t events;
	shd_file_fn fn;
	void *arg;
	shd_timer_fn timer_fn; /* timers: fd is our timerfd */
	void *timer_arg;
	int armed;        /* a poll request is in the kernel */
	int multishot;    /* that request is multishot */
	int dead;         /* deleted: free once the request and its cancels are gone */
	unsigned cancels; /* cancels of the poll in the kernel: their completions name us */
	int in_call;      /* its callback is running */
};

struct shd_loop {
	struct io_uring ring;
	struct shd_loop_event *events;
	int stop;
	int no_multishot;     /* the kernel refused IORING_POLL_ADD_MULTI once */
	unsigned setup_flags; /* IORING_SETUP_* the kernel accepted */
	shd_before_sleep_fn before_sleep;
	shd_after_sleep_fn after_sleep;
	void *hook_arg;
	uint64_t watchdog_ns; /* SHARDD_LOOP_WATCHDOG_MS: 0, off (loop_call) */
	int watchdog_abort;   /* SHARDD_LOOP_WATCHDOG_ABORT=1 */
};

/* An SQE, submitting queued ones first when the SQ is full. */
static struct io_uring_sqe *loop_sqe(struct shd_loop *l)
{
	struct io_uring_sqe *sqe = io_uring_get_sqe(&l->ring);

	while (!sqe) {
		int ret = io_uring_submit(&l->ring);

		if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
			/* Nothing sane remains: the loop cannot be driven without its ring. */
			shd_log_error("io_uring_submit: %s", strerror(-ret));
			abort();
		}
		sqe = io_uring_get_sqe(&l->ring);
	}
	return sqe;
}

static void loop_arm(struct shd_loop *l, struct shd_loop_event *ev)
{
	struct io_uring_sqe *sqe = loop_sqe(l);

	if (l->no_multishot) {
		io_uring_prep_poll_add(sqe, ev->fd, ev->events);
		ev->multishot = 0;
	} else {
		io_uring_prep_poll_multishot(sqe, ev->fd, ev->events);
		ev->multishot = 1;
	}
	io_uring_sqe_set_data(sqe, ev);
	ev->armed = 1;
}

/*
 * Cancel the event's poll. IORING_OP_ASYNC_CANCEL, not POLL_REMOVE: a poll
 * whose wake-up is running (a datagram arrived just before) cannot be
 * removed (-EALREADY) and a multishot one would stay armed, pinning the
 * file for ever; a cancel marks it, and the wake-up itself completes it
 * with -ECANCELED. The cancel's own completion says whether that worked
 * (loop_cancel_done).
 */
static void loop_cancel(struct shd_loop *l, struct shd_loop_event *ev)
{
	struct io_uring_sqe *sqe = loop_sqe(l);

	io_uring_prep_cancel64(sqe, (__u64)(uintptr_t)ev, 0);
	io_uring_sqe_set_data(sqe, (void *)((uintptr_t)ev | LOOP_TAG_CANCEL));
	ev->cancels++;
}

static void loop_unlink_free(struct shd_loop *l, struct shd_loop_event *ev)
{
	if (ev->prev)
		ev->prev->next = ev->next;
	else
		l->events = ev->next;
	if (ev->next)
		ev->next->prev = ev->prev;
	if (ev->timer_fn)
		close(ev->fd);
	free(ev);
}

/*
 * Task-work modes, best first. A poll completion (a doorbell, a socket) is
 * posted by task work on the loop thread. With DEFER_TASKRUN (6.1+, needs
 * SINGLE_ISSUER: only the loop thread touches the ring) that work waits for
 * our next io_uring_enter and the sleeping loop is woken directly, with no
 * signal-style notification interrupting it while it spins on the rings.
 * COOP_TASKRUN (5.19+) drops the interrupting IPI only. TASKRUN_FLAG makes
 * the kernel raise IORING_SQ_TASKRUN when work is pending, so a spinning turn
 * enters the kernel only then.
 */
static const unsigned loop_setup_flags[] = {
	IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
	IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
	0,
};

/*
 * The watchdog, for tests and debugging (docs/RELIABILITY.md): with
 * SHARDD_LOOP_WATCHDOG_MS=N in the environment, a callback (or the
 * before-sleep hook) that runs over N ms is logged, naming it as
 * shardd+OFFSET (addr2line -f -e shardd OFFSET gives the function: most
 * callbacks are static, which dladdr cannot name). One during which the
 * loop thread blocked (a voluntary context switch: a wait on a lock, a
 * condition variable, a read) is an error, since nothing on the loop
 * thread may wait, and aborts with SHARDD_LOOP_WATCHDOG_ABORT=1; one that
 * only ran long (preempted on a loaded machine, or computing) a warning.
 */
static void loop_watchdog_setup(struct shd_loop *l)
{
	const char *ms = getenv("SHARDD_LOOP_WATCHDOG_MS"),
		   *ab = getenv("SHARDD_LOOP_WATCHDOG_ABORT");

	l->watchdog_ns = ms ? strtoull(ms, NULL, 10) * 1000000ull : 0;
	l->watchdog_abort = ab && strcmp(ab, "1") == 0;
	if (l->watchdog_ns)
		shd_log_info("loop watchdog: callbacks over %llu ms are logged%s",
			     (unsigned long long)(l->watchdog_ns / 1000000),
			     l->watchdog_abort ? ", waits abort" : "");
}

static uint64_t loop_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The watchdog's start of a call: its time and the thread's voluntary switches so far. */
static uint64_t loop_watch_start(const struct shd_loop *l, long *nvcsw)
{
	struct rusage ru;

	if (!l->watchdog_ns)
		return 0;
	getrusage(RUSAGE_THREAD, &ru);
	*nvcsw = ru.ru_nvcsw;
	return loop_now_ns();
}

/* The watchdog's end of a call of `fn` (`what`: its kind and fd) that started at t0. */
static void loop_watch_end(const struct shd_loop *l, uint64_t t0, long nvcsw, void *fn,
			   const char *what)
{
	uint64_t ns;
	struct rusage ru;
	Dl_info info = { 0 };
	int waited;

	if (!l->watchdog_ns || (ns = loop_now_ns() - t0) < l->watchdog_ns)
		return;
	getrusage(RUSAGE_THREAD, &ru);
	waited = ru.ru_nvcsw > nvcsw;
	dladdr(fn, &info);
	shd_log(waited ? SHD_LOG_ERROR : SHD_LOG_WARN,
		"loop watchdog: %s callback %s+0x%lx%s%s ran %.0f ms (limit %llu ms) %s", what,
		info.dli_fname ? strrchr(info.dli_fname, '/') ? strrchr(info.dli_fname, '/') + 1
							      : info.dli_fname
			       : "?",
		(unsigned long)((uintptr_t)fn - (uintptr_t)info.dli_fbase),
		info.dli_sname ? " near " : "", info.dli_sname ? info.dli_sname : "",
		(double)ns / 1e6, (unsigned long long)(l->watchdog_ns / 1000000),
		waited ? "and blocked in a wait: nothing on the loop thread may wait"
		       : "without waiting (preempted or computing)");
	if (waited && l->watchdog_abort)
		abort();
}

int shd_loop_create(struct shd_loop **out)
{
	struct shd_loop *l = calloc(1, sizeof(*l));
	int ret = -EINVAL;

	if (!l)
		return -ENOMEM;
	for (size_t i = 0; i < sizeof(loop_setup_flags) / sizeof(loop_setup_flags[0]); i++) {
		struct io_uring_params p = { .flags = loop_setup_flags[i] };

		/* Older kernels refuse flags they do not know with EINVAL: try the next mode. */
		ret = io_uring_queue_init_params(LOOP_ENTRIES, &l->ring, &p);
		if (ret != -EINVAL) {
			l->setup_flags = loop_setup_flags[i];
			break;
		}
	}
	if (ret < 0) {
		shd_log_error("io_uring_queue_init: %s (is io_uring disabled? see "
			      "/proc/sys/kernel/io_uring_disabled)",
			      strerror(-ret));
		free(l);
		return ret;
	}
	shd_log_debug("io_uring: setup flags 0x%x", l->setup_flags);
	loop_watchdog_setup(l);
	*out = l;
	return 0;
}

void shd_loop_destroy(struct shd_loop *l)
{
	if (!l)
		return;
	/* Tearing down the ring cancels every request; no CQE is read after this. */
	io_uring_queue_exit(&l->ring);
	while (l->events)
		loop_unlink_free(l, l->events);
	free(l);
}

int shd_loop_add_fd(struct shd_loop *l, int fd, uint32_t events, shd_file_fn fn, void *arg,
		    struct shd_loop_event **out)
{
	struct shd_loop_event *ev = calloc(1, sizeof(*ev));

	if (!ev)
		return -ENOMEM;
	ev->fd = fd;
	ev->events = events | POLLHUP | POLLERR;
	ev->fn = fn;
	ev->arg = arg;
	ev->next = l->events;
	if (l->events)
		l->events->prev = ev;
	l->events = ev;
	loop_arm(l, ev);
	if (out)
		*out = ev;
	return 0;
}

static void loop_timer_fired(void *arg, int fd, uint32_t revents)
{
	struct shd_loop_event *ev = arg;
	uint64_t expirations;

	(void)revents;
	/* Drain the count so the poll goes quiet until the next period. */
	if (read(fd, &expirations, sizeof(expirations)) != sizeof(expirations))
		return;
	ev->timer_fn(ev->timer_arg);
}

int shd_loop_add_timer(struct shd_loop *l, unsigned period_ms, shd_timer_fn fn, void *arg,
		       struct shd_loop_event **out)
{
	struct itimerspec its = {
		.it_interval = { period_ms / 1000, (long)(period_ms % 1000) * 1000000L },
		.it_value = { period_ms / 1000, (long)(period_ms % 1000) * 1000000L },
	};
	struct shd_loop_event *ev;
	int fd, ret;

	fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
	if (fd < 0)
		return -errno;
	if (timerfd_settime(fd, 0, &its, NULL) < 0) {
		ret = -errno;
		goto err_close;
	}
	ret = shd_loop_add_fd(l, fd, POLLIN, loop_timer_fired, NULL, &ev);
	if (ret < 0)
		goto err_close;
	/* The file callback gets the event itself; the timer's own argument rides on it. */
	ev->arg = ev;
	ev->timer_fn = fn;
	ev->timer_arg = arg;
	if (out)
		*out = ev;
	return 0;

err_close:
	close(fd);
	return ret;
}

void shd_loop_del(struct shd_loop *l, struct shd_loop_event *ev)
{
	if (!ev || ev->dead)
		return;
	ev->dead = 1;
	if (ev->armed)
		/* The request pins the file; cancel it and free the event on its last CQE. */
		loop_cancel(l, ev);
	else if (!ev->in_call && !ev->cancels)
		loop_unlink_free(l, ev);
}

void shd_loop_set_sleep_hooks(struct shd_loop *l, shd_before_sleep_fn before,
			      shd_after_sleep_fn after, void *arg)
{
	l->before_sleep = before;
	l->after_sleep = after;
	l->hook_arg = arg;
}

void shd_loop_stop(struct shd_loop *l)
{
	l->stop = 1;
}

static void loop_dispatch(struct shd_loop *l, struct shd_loop_event *ev, int32_t res,
			  uint32_t cqe_flags)
{
	/* Without F_MORE this was the request's last completion. */
	if (!(cqe_flags & IORING_CQE_F_MORE))
		ev->armed = 0;
	if (res == -EINVAL && ev->multishot) {
		/*
		 * Kernel without multishot poll: use one-shot polls, re-armed after
		 * each event. Every event armed before we knew fails the same way.
		 */
		if (!l->no_multishot)
			shd_log_debug("io_uring: no multishot poll, re-arming one-shot polls");
		l->no_multishot = 1;
	} else if (res < 0 && res != -ECANCELED && !ev->dead) {
		/* A poll that fails for another reason reports an error event to the owner. */
		res = POLLERR;
	}
	if (res >= 0 && !ev->dead) {
		long nvcsw = 0;
		uint64_t t0 = loop_watch_start(l, &nvcsw);
		char what[32];

		ev->in_call = 1;
		ev->fn(ev->arg, ev->fd, (uint32_t)res);
		ev->in_call = 0;
		if (t0) {
			/* ev lives on until loop_dispatch's end, even when the callback deleted it. */
			snprintf(what, sizeof(what), "%s of fd %d", ev->timer_fn ? "timer" : "file",
				 ev->fd);
			loop_watch_end(l, t0, nvcsw,
				       ev->timer_fn ? (void *)ev->timer_fn : (void *)ev->fn, what);
		}
	}
	if (ev->dead) {
		if (ev->armed && !ev->cancels)
			/* A poll that is still armed after its cancel completed: cancel it again. */
			loop_cancel(l, ev);
		else if (!ev->armed && !ev->cancels)
			loop_unlink_free(l, ev);
	} else if (!ev->armed) {
		loop_arm(l, ev);
	}
}

/*
 * The cancel of a deleted event's poll completed: 0, the poll completes
 * (or completed) with -ECANCELED; -ENOENT, it had already ended; -EALREADY,
 * the kernel could not stop it now: while the poll is armed, cancel again.
 * The event is freed once neither its poll nor a cancel can name it.
 */
static void loop_cancel_done(struct shd_loop *l, struct shd_loop_event *ev, int32_t res)
{
	ev->cancels--;
	if (res < 0 && res != -ENOENT && res != -EALREADY)
		shd_log_warn("io_uring: cancelling the poll of fd %d: %s", ev->fd, strerror(-res));
	if (ev->armed && !ev->cancels && res != 0)
		loop_cancel(l, ev);
	else if (!ev->armed && !ev->cancels)
		loop_unlink_free(l, ev);
}

/* Take every completion now in the CQ and dispatch it. */
static void loop_process(struct shd_loop *l)
{
	for (;;) {
		struct io_uring_cqe *cqes[LOOP_BATCH];
		struct {
			void *data;
			int32_t res;
			uint32_t flags;
		} done[LOOP_BATCH];
		unsigned n = io_uring_peek_batch_cqe(&l->ring, cqes, LOOP_BATCH);

		if (!n)
			break;
		/* Copy out and release the slots first: callbacks may queue new requests. */
		for (unsigned i = 0; i < n; i++) {
			done[i].data = io_uring_cqe_get_data(cqes[i]);
			done[i].res = cqes[i]->res;
			done[i].flags = cqes[i]->flags;
		}
		io_uring_cq_advance(&l->ring, n);
		for (unsigned i = 0; i < n; i++) {
			uintptr_t data = (uintptr_t)done[i].data;

			if (data & LOOP_TAG_CANCEL)
				loop_cancel_done(l,
						 (struct shd_loop_event *)(data & ~LOOP_TAG_CANCEL),
						 done[i].res);
			else if (data)
				loop_dispatch(l, (struct shd_loop_event *)data, done[i].res,
					      done[i].flags);
		}
	}
}

int shd_loop_run(struct shd_loop *l)
{
	l->stop = 0;
	while (!l->stop) {
		long nvcsw = 0;
		uint64_t t0 = loop_watch_start(l, &nvcsw);
		int may_sleep = l->before_sleep ? l->before_sleep(l->hook_arg) : 1;
		int ret;

		if (t0 && l->before_sleep)
			loop_watch_end(l, t0, nvcsw, (void *)l->before_sleep, "before-sleep");

		if (l->stop)
			break;
		if (may_sleep)
			ret = io_uring_submit_and_wait(&l->ring, 1);
		else if (IO_URING_READ_ONCE(*l->ring.sq.kflags) & IORING_SQ_TASKRUN)
			/* Deferred task work posts its completions only inside io_uring_enter. */
			ret = io_uring_submit_and_get_events(&l->ring);
		else
			ret = io_uring_submit(&l->ring);
		if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY && ret != -ETIME) {
			shd_log_error("io_uring_submit_and_wait: %s", strerror(-ret));
			return ret;
		}
		if (may_sleep && l->after_sleep)
			l->after_sleep(l->hook_arg);
		loop_process(l);
	}
	return 0;
}
