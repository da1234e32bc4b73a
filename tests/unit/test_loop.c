/* SPDX-License-Identifier: MIT */
/*
 * daemon/core/loop.c: the io_uring event loop. File events on pipes, deletion
 * from inside callbacks (the daemon closes sessions from their own and from
 * other sessions' callbacks), periodic timers, and the before-sleep hook
 * that lets the ring service poll without blocking.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "loop.h"

struct pipe_ev {
	struct shd_loop *l;
	struct shd_loop_event *ev;
	struct shd_loop_event *victim; /* deleted by this event's callback */
	int fds[2];
	int calls;
	int bytes;
	int stop_after; /* stop the loop after this many calls */
	int del_self;
};

static void pipe_new(struct pipe_ev *p, struct shd_loop *l)
{
	memset(p, 0, sizeof(*p));
	p->l = l;
	cr_assert_eq(pipe2(p->fds, O_NONBLOCK | O_CLOEXEC), 0);
}

static void pipe_free(struct pipe_ev *p)
{
	close(p->fds[0]);
	close(p->fds[1]);
}

static void pipe_readable(void *arg, int fd, uint32_t revents)
{
	struct pipe_ev *p = arg;
	char buf[64];
	ssize_t n;

	p->calls++;
	if (revents & POLLIN) {
		while ((n = read(fd, buf, sizeof(buf))) > 0)
			p->bytes += (int)n;
	}
	if (p->victim) {
		shd_loop_del(p->l, p->victim);
		p->victim = NULL;
	}
	if (p->del_self) {
		shd_loop_del(p->l, p->ev);
		p->ev = NULL;
	}
	if (p->calls >= p->stop_after)
		shd_loop_stop(p->l);
}

struct counter {
	struct shd_loop *l;
	int calls;
	int stop_after;
};

static void count_and_stop(void *arg)
{
	struct counter *c = arg;

	if (++c->calls >= c->stop_after)
		shd_loop_stop(c->l);
}

Test(loop, readable_fd_calls_its_callback_with_pollin, .timeout = 10)
{
	struct shd_loop *l;
	struct pipe_ev p;

	cr_assert_eq(shd_loop_create(&l), 0);
	pipe_new(&p, l);
	p.stop_after = 1;
	cr_assert_eq(shd_loop_add_fd(l, p.fds[0], POLLIN, pipe_readable, &p, &p.ev), 0);
	cr_assert_eq(write(p.fds[1], "abc", 3), 3);
	cr_assert_eq(shd_loop_run(l), 0);
	cr_assert_eq(p.calls, 1);
	cr_assert_eq(p.bytes, 3);
	shd_loop_destroy(l);
	pipe_free(&p);
}

Test(loop, event_fires_again_for_new_data_after_the_first, .timeout = 10)
{
	struct shd_loop *l;
	struct pipe_ev p;

	cr_assert_eq(shd_loop_create(&l), 0);
	pipe_new(&p, l);
	p.stop_after = 1;
	cr_assert_eq(shd_loop_add_fd(l, p.fds[0], POLLIN, pipe_readable, &p, &p.ev), 0);
	cr_assert_eq(write(p.fds[1], "a", 1), 1);
	cr_assert_eq(shd_loop_run(l), 0);
	/* The loop stopped; a second write must re-arm delivery on the next run. */
	p.stop_after = 2;
	cr_assert_eq(write(p.fds[1], "bc", 2), 2);
	cr_assert_eq(shd_loop_run(l), 0);
	cr_assert_eq(p.calls, 2);
	cr_assert_eq(p.bytes, 3);
	shd_loop_destroy(l);
	pipe_free(&p);
}

Test(loop, hang_up_is_reported_without_asking_for_it, .timeout = 10)
{
	struct shd_loop *l;
	struct pipe_ev p;

	cr_assert_eq(shd_loop_create(&l), 0);
	pipe_new(&p, l);
	p.stop_after = 1;
	p.del_self = 1;
	cr_assert_eq(shd_loop_add_fd(l, p.fds[0], 0, pipe_readable, &p, &p.ev), 0);
	close(p.fds[1]);
	p.fds[1] = -1;
	cr_assert_eq(shd_loop_run(l), 0);
	cr_assert_eq(p.calls, 1);
	cr_assert_eq(p.bytes, 0);
	shd_loop_destroy(l);
	close(p.fds[0]);
}

Test(loop, event_deleted_by_another_callback_is_never_called_again, .timeout = 10)
{
	struct shd_loop *l;
	struct pipe_ev a, b;
	struct counter stop = { .stop_after = 3 };

	cr_assert_eq(shd_loop_create(&l), 0);
	stop.l = l;
	pipe_new(&a, l);
	pipe_new(&b, l);
	a.stop_after = 100;
	b.stop_after = 100;
	cr_assert_eq(shd_loop_add_fd(l, a.fds[0], POLLIN, pipe_readable, &a, &a.ev), 0);
	cr_assert_eq(shd_loop_add_fd(l, b.fds[0], POLLIN, pipe_readable, &b, &b.ev), 0);
	/* Whichever runs first deletes the other, even if both completions are queued. */
	a.victim = b.ev;
	b.victim = a.ev;
	cr_assert_eq(write(a.fds[1], "x", 1), 1);
	cr_assert_eq(write(b.fds[1], "y", 1), 1);
	cr_assert_eq(shd_loop_add_timer(l, 5, count_and_stop, &stop, NULL), 0);
	cr_assert_eq(shd_loop_run(l), 0);
	cr_assert_eq(a.calls + b.calls, 1, "a %d b %d", a.calls, b.calls);
	shd_loop_destroy(l);
	pipe_free(&a);
	pipe_free(&b);
}

Test(loop, event_deleting_itself_is_not_called_again_and_fd_can_close, .timeout = 10)
{
	struct shd_loop *l;
	struct pipe_ev p;
	struct counter stop = { .stop_after = 3 };

	cr_assert_eq(shd_loop_create(&l), 0);
	stop.l = l;
	pipe_new(&p, l);
	p.stop_after = 100;
	p.del_self = 1;
	cr_assert_eq(shd_loop_add_fd(l, p.fds[0], POLLIN, pipe_readable, &p, &p.ev), 0);
	cr_assert_eq(write(p.fds[1], "x", 1), 1);
	cr_assert_eq(shd_loop_add_timer(l, 5, count_and_stop, &stop, NULL), 0);
	cr_assert_eq(shd_loop_run(l), 0);
	cr_assert_eq(p.calls, 1);
	cr_assert_eq(p.bytes, 1);
	shd_loop_destroy(l);
	pipe_free(&p);
}

Test(loop, timer_fires_again_every_period, .timeout = 10)
{
	struct shd_loop *l;
	struct counter c = { .stop_after = 5 };

	cr_assert_eq(shd_loop_create(&l), 0);
	c.l = l;
	cr_assert_eq(shd_loop_add_timer(l, 2, count_and_stop, &c, NULL), 0);
	cr_assert_eq(shd_loop_run(l), 0);
	cr_assert_eq(c.calls, 5);
	shd_loop_destroy(l);
}

struct hooks {
	struct shd_loop *l;
	int before;
	int after;
};

static int never_sleep(void *arg)
{
	struct hooks *h = arg;

	if (++h->before == 1000)
		shd_loop_stop(h->l);
	return 0;
}

static void woke(void *arg)
{
	((struct hooks *)arg)->after++;
}

Test(loop, before_sleep_returning_zero_polls_without_blocking, .timeout = 10)
{
	struct shd_loop *l;
	struct hooks h = { 0 };

	/* No event ever fires: the loop can only stop if it never blocks. */
	cr_assert_eq(shd_loop_create(&l), 0);
	h.l = l;
	shd_loop_set_sleep_hooks(l, never_sleep, woke, &h);
	cr_assert_eq(shd_loop_run(l), 0);
	cr_assert_eq(h.before, 1000);
	cr_assert_eq(h.after, 0);
	shd_loop_destroy(l);
}

static int may_sleep(void *arg)
{
	((struct hooks *)arg)->before++;
	return 1;
}

Test(loop, after_sleep_runs_once_per_wake_up, .timeout = 10)
{
	struct shd_loop *l;
	struct hooks h = { 0 };
	struct pipe_ev p;

	cr_assert_eq(shd_loop_create(&l), 0);
	h.l = l;
	pipe_new(&p, l);
	p.stop_after = 1;
	shd_loop_set_sleep_hooks(l, may_sleep, woke, &h);
	cr_assert_eq(shd_loop_add_fd(l, p.fds[0], POLLIN, pipe_readable, &p, &p.ev), 0);
	cr_assert_eq(write(p.fds[1], "x", 1), 1);
	cr_assert_eq(shd_loop_run(l), 0);
	cr_assert_eq(p.calls, 1);
	cr_assert_geq(h.after, 1);
	cr_assert_eq(h.after, h.before);
	shd_loop_destroy(l);
	pipe_free(&p);
}

struct turns {
	struct shd_loop *l;
	int n;
	int stop_at;
};

static int stop_after_turns(void *arg)
{
	struct turns *t = arg;

	if (++t->n >= t->stop_at)
		shd_loop_stop(t->l);
	return 0;
}

/* Turn the loop `n` times without blocking. */
static void run_turns(struct turns *t, int n)
{
	t->n = 0;
	t->stop_at = n;
	cr_assert_eq(shd_loop_run(t->l), 0);
}

static void count_calls(void *arg, int fd, uint32_t revents)
{
	(void)fd;
	(void)revents;
	(*(int *)arg)++;
}

/*
 * The daemon's session close: a client's datagram arrives just before the
 * session is deleted, so the poll's wake-up owns the multishot poll when the
 * loop cancels it (IORING_OP_POLL_REMOVE answers -EALREADY there). The
 * cancel must still end the poll, or the socket is never released and the
 * client never sees the connection close (#11, fuzz finding F2).
 */
Test(loop, deleting_an_event_whose_poll_just_fired_releases_its_file, .timeout = 10)
{
	struct shd_loop *l;
	struct shd_loop_event *ev;
	struct turns t = { 0 };
	struct pollfd pfd;
	int sv[2], calls = 0;

	cr_assert_eq(shd_loop_create(&l), 0);
	t.l = l;
	shd_loop_set_sleep_hooks(l, stop_after_turns, NULL, &t);
	cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
	cr_assert_eq(shd_loop_add_fd(l, sv[0], POLLIN, count_calls, &calls, &ev), 0);
	run_turns(&t, 3); /* the poll is in the kernel */
	/* The wake-up takes the poll; its task work waits for the loop's next io_uring_enter. */
	cr_assert_eq(write(sv[1], "x", 1), 1);
	shd_loop_del(l, ev);
	close(sv[0]);
	run_turns(&t, 10);
	cr_assert_eq(calls, 0, "the deleted event's callback ran %d times", calls);
	/* Our end of the pair is gone once no poll holds its file: the peer sees the hang-up. */
	pfd = (struct pollfd){ .fd = sv[1], .events = POLLIN };
	cr_assert_eq(poll(&pfd, 1, 2000), 1, "the peer never saw the deleted event's socket close");
	cr_assert(pfd.revents & POLLHUP, "revents 0x%x", pfd.revents);
	shd_loop_destroy(l);
	close(sv[1]);
}
