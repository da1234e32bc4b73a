/* SPDX-License-Identifier: MIT */
/*
 * The daemon's event loop, on liburing (Redis "ae" in spirit): file events
 * (IORING_OP_POLL_ADD, multishot where the kernel has it, else re-armed after
 * each event), periodic timers (a timerfd registered as a file event) and a
 * before-sleep hook that decides whether the loop may block at all (the ring
 * service's bounded spin window lives there, in server.c).
 *
 * Single-threaded: every callback runs on the thread that calls
 * shd_loop_run(). A callback may add or delete any event, its own included.
 * The thread that creates the loop is the only one that may call into it
 * (the io_uring is IORING_SETUP_SINGLE_ISSUER where the kernel has it).
 */
#ifndef SHD_LOOP_H
#define SHD_LOOP_H

#include <stdint.h>

struct shd_loop;
struct shd_loop_event;

/* `revents` is the poll(2) mask that fired. */
typedef void (*shd_file_fn)(void *arg, int fd, uint32_t revents);
typedef void (*shd_timer_fn)(void *arg);
/* Return 1 when the loop may block until the next event, 0 to poll again at once. */
typedef int (*shd_before_sleep_fn)(void *arg);
/* Called after the loop blocked and woke up. */
typedef void (*shd_after_sleep_fn)(void *arg);

/* 0, -ENOMEM or -errno of io_uring_queue_init (logged). */
int shd_loop_create(struct shd_loop **out);
/* Cancels every event; fds registered with add_fd are not closed (they are the caller's). */
void shd_loop_destroy(struct shd_loop *l);

/*
 * Call fn(arg, fd, revents) whenever `fd` polls ready for `events` (POLLIN,
 * ...; POLLHUP and POLLERR are always reported). `*out` (may be NULL) is the
 * handle for shd_loop_del(). Returns 0 or -ENOMEM.
 */
int shd_loop_add_fd(struct shd_loop *l, int fd, uint32_t events, shd_file_fn fn, void *arg,
		    struct shd_loop_event **out);
/* Call fn(arg) every `period_ms` milliseconds. Returns 0 or -errno. */
int shd_loop_add_timer(struct shd_loop *l, unsigned period_ms, shd_timer_fn fn, void *arg,
		       struct shd_loop_event **out);
/*
 * Stop delivering the event; the callback is never called again, even for
 * an event already queued. The caller may close the fd right after.
 */
void shd_loop_del(struct shd_loop *l, struct shd_loop_event *ev);

void shd_loop_set_sleep_hooks(struct shd_loop *l, shd_before_sleep_fn before,
			      shd_after_sleep_fn after, void *arg);

/*
 * Run until a callback calls shd_loop_stop(); a later call runs again.
 * Returns 0 or -errno of io_uring_submit_and_wait.
 */
int shd_loop_run(struct shd_loop *l);
void shd_loop_stop(struct shd_loop *l);

#endif /* SHD_LOOP_H */
