/* SPDX-License-Identifier: MIT */
/*
 * The daemon's event loop, on liburing (Redis "ae" in spirit): file events
 * (IORING_OP_POLL_ADD, multishot where the kernel has it, else re-armed after
 * each event), periodic timers (a timerfd registered as a file event) and a
 * before-sleep hook that decides whether the loop may block at all (the ring
 * service's bounded spin window lives there, in server.c).
 *
 * Single-threaded: every callback runs on the thread that calls
 * shardd_loop_run(). A callback may add or delete any event, its own included.
 * The thread that creates the loop is the only one that may call into it
 * (the io_uring is IORING_SETUP_SINGLE_ISSUER where the kernel has it).
 */
#ifndef SHARDD_LOOP_H
#define SHARDD_LOOP_H

#include <stdint.h>

struct shardd_loop;
struct shardd_loop_event;

/* `revents` is the poll(2) mask that fired. */
typedef void (*shardd_file_fn)(void *arg, int fd, uint32_t revents);
typedef void (*shardd_timer_fn)(void *arg);
/* Return 1 when the loop may block until the next event, 0 to poll again at once. */
typedef int (*shardd_before_sleep_fn)(void *arg);
/* Called after the loop blocked and woke up. */
typedef void (*shardd_after_sleep_fn)(void *arg);

/* 0, -ENOMEM or -errno of io_uring_queue_init (logged). */
int shardd_loop_create(struct shardd_loop **out);
/* Cancels every event; fds registered with add_fd are not closed (they are the caller's). */
void shardd_loop_destroy(struct shardd_loop *l);

/*
 * Call fn(arg, fd, revents) whenever `fd` polls ready for `events` (POLLIN,
 * ...; POLLHUP and POLLERR are always reported). `*out` (may be NULL) is the
 * handle for shardd_loop_del(). Returns 0 or -ENOMEM.
 */
int shardd_loop_add_fd(struct shardd_loop *l, int fd, uint32_t events, shardd_file_fn fn,
		       void *arg, struct shardd_loop_event **out);
/* Call fn(arg) every `period_ms` milliseconds. Returns 0 or -errno. */
int shardd_loop_add_timer(struct shardd_loop *l, unsigned period_ms, shardd_timer_fn fn,
			  void *arg, struct shardd_loop_event **out);
/*
 * Stop delivering the event; the callback is never called again, even for
 * an event already queued. The caller may close the fd right after.
 */
void shardd_loop_del(struct shardd_loop *l, struct shardd_loop_event *ev);

void shardd_loop_set_sleep_hooks(struct shardd_loop *l, shardd_before_sleep_fn before,
				 shardd_after_sleep_fn after, void *arg);

/*
 * Run until a callback calls shardd_loop_stop(); a later call runs again.
 * Returns 0 or -errno of io_uring_submit_and_wait.
 */
int shardd_loop_run(struct shardd_loop *l);
void shardd_loop_stop(struct shardd_loop *l);

#endif /* SHARDD_LOOP_H */
