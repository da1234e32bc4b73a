/* SPDX-License-Identifier: MIT */
/*
 * `shardbench ring`: the round trip of a nop through the shared-memory
 * ring, against a Unix SOCK_SEQPACKET request/response between two
 * processes measured in the same run.
 *
 *   ring-spin    back-to-back nops; the client spins on shardd_poll and
 *                the daemon, busy, spins on the ring;
 *   ring-sleep   an idle gap before each nop, so the daemon has gone to
 *                sleep and needs its doorbell; the client waits in
 *                shardd_wait (a bounded spin, then a futex);
 *   socket       back-to-back 64-byte ping-pongs, blocking recv;
 *   socket-idle  the same after the same idle gap; its samples and
 *                ring-sleep's alternate, so both see the same load.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bench.h"
#include "shardd.h"

#define RING_SPIN_SAMPLES  20000
#define RING_SLEEP_SAMPLES 1000
#define RING_WARMUP        200
#define RING_OP_TIMEOUT_NS (5ull * 1000000000ull)
#define RING_MSG_BYTES     64

enum ring_mode {
	MODE_RING_SPIN,
	MODE_SOCKET,
	MODE_RING_SLEEP,
	MODE_SOCKET_IDLE,
	MODE_COUNT
};

struct ring_result {
	uint64_t *ns; /* samples */
	size_t n;
	uint64_t wrong;
	int err; /* 0, or why the mode did not finish */
};

static void idle_gap(uint64_t us)
{
	struct timespec ts = { (time_t)(us / 1000000u), (long)(us % 1000000u) * 1000 };

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

/*
 * Spinning needs a core on each side: on a shared core the spinning client
 * holds the CPU until the daemon, woken by the doorbell, preempts it, then
 * the daemon spins out its window before the client runs again (~55 us a
 * round trip on 2 cores). When shardbench started the daemon it puts the
 * daemon's loop thread (its main thread: tid = pid) and this client on
 * different cores for the ring modes; sched_setaffinity on a tid moves
 * only that thread, so the worker pool keeps every core.
 */
struct ring_pin {
	int active;
	pid_t daemon_pid;
	cpu_set_t self_saved;
	cpu_set_t daemon_saved;
	unsigned self_cpu, daemon_cpu;
};

static void ring_pin(struct ring_pin *p, pid_t daemon_pid)
{
	cpu_set_t one;

	memset(p, 0, sizeof(*p));
	if (daemon_pid <= 0 || bench_worker_threads() < 2)
		return;
	if (sched_getaffinity(0, sizeof(p->self_saved), &p->self_saved) ||
	    sched_getaffinity(daemon_pid, sizeof(p->daemon_saved), &p->daemon_saved))
		return;
	p->daemon_cpu = 0;
	p->self_cpu = bench_worker_threads() - 1;
	CPU_ZERO(&one);
	CPU_SET(p->daemon_cpu, &one);
	if (sched_setaffinity(daemon_pid, sizeof(one), &one))
		return;
	CPU_ZERO(&one);
	CPU_SET(p->self_cpu, &one);
	if (sched_setaffinity(0, sizeof(one), &one)) {
		sched_setaffinity(daemon_pid, sizeof(p->daemon_saved), &p->daemon_saved);
		return;
	}
	p->daemon_pid = daemon_pid;
	p->active = 1;
}

static void ring_unpin(struct ring_pin *p)
{
	if (!p->active)
		return;
	sched_setaffinity(p->daemon_pid, sizeof(p->daemon_saved), &p->daemon_saved);
	sched_setaffinity(0, sizeof(p->self_saved), &p->self_saved);
	p->active = 0;
}

/* One nop, timed from submit to reaped completion. */
static int ring_nop(struct shardd_client *c, int spin, uint64_t tag, uint64_t *ns, uint64_t *wrong)
{
	struct shardd_completion cqe;
	uint64_t t0, deadline;
	unsigned polls = 0;
	int ret;

	t0 = bench_now_ns();
	ret = shardd_client_submit(c, SHARDD_OP_NOP, 0, 0, tag);
	if (ret)
		return ret;
	if (spin) {
		deadline = t0 + RING_OP_TIMEOUT_NS;
		while ((ret = shardd_poll(c, &cqe)) == -EAGAIN) {
			/* The spin has no liveness check of its own: bound it by time. */
			if ((++polls & 4095u) == 0 && bench_now_ns() > deadline)
				return -ETIMEDOUT;
		}
	} else {
		ret = shardd_wait(c, &cqe, (int)(RING_OP_TIMEOUT_NS / 1000000ull));
	}
	*ns = bench_now_ns() - t0;
	if (ret)
		return ret;
	*wrong += cqe.user_data != tag || cqe.res != 0 || cqe.op != SHARDD_OP_NOP;
	return 0;
}

static int run_ring_spin(struct shardd_client *c, struct ring_result *r, size_t warmup)
{
	uint64_t ns, junk = 0;
	size_t i;
	int ret;

	for (i = 0; i < warmup; i++) {
		ret = ring_nop(c, 1, i, &ns, &junk);
		if (ret)
			return ret;
	}
	for (i = 0; i < r->n; i++) {
		ret = ring_nop(c, 1, warmup + i, &r->ns[i], &r->wrong);
		if (ret)
			return ret;
	}
	return 0;
}

/* The other end of the socket baseline: echo every message until EOF. */
static void socket_echo(int fd)
{
	char buf[RING_MSG_BYTES];
	ssize_t n;

	while ((n = recv(fd, buf, sizeof(buf), 0)) > 0)
		if (send(fd, buf, (size_t)n, 0) != n)
			break;
	_exit(0);
}

/* A socketpair to an echo process. */
struct ring_echo {
	int fd;
	pid_t pid;
};

static int echo_start(struct ring_echo *e)
{
	int sv[2], ret;

	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv))
		return -errno;
	fflush(NULL);
	e->pid = fork();
	if (e->pid < 0) {
		ret = -errno;
		close(sv[0]);
		close(sv[1]);
		return ret;
	}
	if (e->pid == 0) {
		close(sv[0]);
		socket_echo(sv[1]);
	}
	close(sv[1]);
	e->fd = sv[0];
	return 0;
}

static void echo_stop(struct ring_echo *e)
{
	/* EOF ends the echo process. */
	close(e->fd);
	bench_reap_pid(e->pid, 10000);
}

/* One request/response of message number i, timed into *ns when ns is set. */
static int socket_ping(struct ring_echo *e, size_t i, uint64_t *ns, uint64_t *wrong)
{
	char out[RING_MSG_BYTES], in[RING_MSG_BYTES];
	uint64_t t0;

	memset(out, (int)(i & 0xff), sizeof(out));
	memcpy(out, &i, sizeof(i));
	t0 = bench_now_ns();
	if (send(e->fd, out, sizeof(out), 0) != (ssize_t)sizeof(out) ||
	    recv(e->fd, in, sizeof(in), 0) != (ssize_t)sizeof(in))
		return -EPIPE;
	if (ns) {
		*ns = bench_now_ns() - t0;
		*wrong += memcmp(in, out, sizeof(in)) != 0;
	}
	return 0;
}

static int run_socket(struct ring_result *r, size_t warmup)
{
	struct ring_echo e;
	int ret = echo_start(&e);
	size_t i;

	for (i = 0; i < warmup + r->n && !ret; i++)
		ret = socket_ping(&e, i, i >= warmup ? &r->ns[i - warmup] : NULL, &r->wrong);
	echo_stop(&e);
	return ret;
}

/*
 * The idle modes sample by sample in turn (which goes first alternates),
 * so that ring-sleep and its socket-idle baseline see the same load: on a
 * shared machine the load changes within seconds, and two phases run one
 * after the other compared different minutes.
 */
static void run_idle(struct shardd_client *c, uint64_t idle_us, struct ring_result *ring,
		     struct ring_result *sock)
{
	struct ring_echo e;
	size_t i;

	sock->err = echo_start(&e);
	if (sock->err)
		return;
	for (i = 0; i < ring->n && !ring->err && !sock->err; i++)
		for (int k = 0; k < 2; k++) {
			idle_gap(idle_us);
			if ((k == 0) == (i % 2 == 0))
				ring->err = ring_nop(c, 0, i, &ring->ns[i], &ring->wrong);
			else
				sock->err = socket_ping(&e, i, &sock->ns[i], &sock->wrong);
		}
	echo_stop(&e);
}

static void print_ring_row(const char *mode, const char *pacing, struct ring_result *r,
			   const struct ring_result *base)
{
	double p50, p99, mean = 0, bp50, bp99;
	size_t i;

	if (r->err) {
		printf("  %-12s %-14s failed: %s\n", mode, pacing, shardd_strerror(r->err));
		return;
	}
	bench_sort_u64(r->ns, r->n);
	for (i = 0; i < r->n; i++)
		mean += (double)r->ns[i];
	mean /= (double)r->n * 1000.0;
	p50 = (double)bench_percentile(r->ns, r->n, 50) / 1000.0;
	p99 = (double)bench_percentile(r->ns, r->n, 99) / 1000.0;
	printf("  %-12s %-14s %8zu %9.2f %9.2f %9.2f", mode, pacing, r->n, p50, p99, mean);
	if (base && !base->err) {
		bp50 = (double)bench_percentile(base->ns, base->n, 50) / 1000.0;
		bp99 = (double)bench_percentile(base->ns, base->n, 99) / 1000.0;
		printf(" %12.1fx %12.1fx", bp50 / p50, bp99 / p99);
	} else {
		printf(" %13s %13s", "-", "-");
	}
	printf(" %7llu\n", (unsigned long long)r->wrong);
}

int bench_ring_run(const struct bench_opts *o, const char *socket_path, pid_t daemon_pid)
{
	struct ring_pin pin = { 0 };
	struct ring_result res[MODE_COUNT] = { 0 };
	struct shardd_client *c = NULL;
	char job[SHARDD_NAME_MAX], pacing[32];
	size_t nspin = o->iters_set ? (size_t)o->iters : RING_SPIN_SAMPLES;
	size_t nsleep = o->iters_set ? (size_t)o->iters : RING_SLEEP_SAMPLES;
	size_t warmup = o->warmup > RING_WARMUP ? (size_t)o->warmup : RING_WARMUP;
	int m, ret = 0;
	struct shardd_attach_opts ao = {
		.socket_path = socket_path,
		.job = job,
		.rank = 0,
		.replicate = 1,
		.shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};

	for (m = 0; m < MODE_COUNT; m++) {
		res[m].n = m == MODE_RING_SPIN || m == MODE_SOCKET ? nspin : nsleep;
		res[m].ns = calloc(res[m].n, sizeof(uint64_t));
		if (!res[m].ns) {
			ret = -ENOMEM;
			goto out;
		}
	}
	snprintf(job, sizeof(job), "shardbench.%d.ring", (int)getpid());
	ret = shardd_connect(&ao, &c);
	if (ret) {
		fprintf(stderr, "shardbench: ring: attach to %s: %s\n", socket_path,
			shardd_last_error()[0] ? shardd_last_error() : shardd_strerror(ret));
		goto out;
	}
	/* The baselines run unpinned, where the scheduler serves a blocking ping-pong best. */
	res[MODE_SOCKET].err = run_socket(&res[MODE_SOCKET], warmup);
	ring_pin(&pin, daemon_pid);
	res[MODE_RING_SPIN].err = run_ring_spin(c, &res[MODE_RING_SPIN], warmup);
	ring_unpin(&pin);
	/*
	 * ring-sleep runs unpinned, as its socket-idle baseline: a wake-up the
	 * scheduler may place on the waker's core is the fair comparison, and a
	 * daemon pinned to a core other processes use waits for it (ms tails).
	 */
	run_idle(c, o->idle_us, &res[MODE_RING_SLEEP], &res[MODE_SOCKET_IDLE]);
	if (res[MODE_RING_SPIN].err || res[MODE_RING_SLEEP].err)
		fprintf(stderr, "shardbench: ring: %s\n", shardd_last_error());

	snprintf(pacing, sizeof(pacing), "idle %lluus", (unsigned long long)o->idle_us);
	printf("#\n# shardbench ring: nop round trip, submit to reaped completion; samples:"
	       " %zu back-to-back, %zu after an idle gap of %llu us\n",
	       nspin, nsleep, (unsigned long long)o->idle_us);
	printf("# ring-spin: client spins on shardd_poll; ring-sleep: daemon asleep after the"
	       " gap (doorbell), client in shardd_wait (spin, then futex)\n");
	printf("# socket: Unix SOCK_SEQPACKET %d-byte request/response between two processes;"
	       " socket-idle and ring-sleep samples alternate\n",
	       RING_MSG_BYTES);
	if (pin.daemon_pid)
		printf("# ring-spin: client on cpu %u, daemon loop thread on cpu %u (a spinner"
		       " per core; docs/BENCHMARKS.md); ring-sleep unpinned, as the socket"
		       " baselines\n",
		       pin.self_cpu, pin.daemon_cpu);
	else
		printf("# ring modes: not pinned (daemon not started by shardbench, or one core);"
		       " client and daemon on one core make ring-spin ~the daemon's spin window\n");
	printf("# %-12s %-14s %8s %9s %9s %9s %13s %13s %7s\n", "mode", "pacing", "samples",
	       "p50(us)", "p99(us)", "mean(us)", "socket/ring50", "socket/ring99", "#wrong");
	/* Each socket row first, so ratios read against a sorted baseline. */
	print_ring_row("socket", "back-to-back", &res[MODE_SOCKET], NULL);
	print_ring_row("ring-spin", "back-to-back", &res[MODE_RING_SPIN], &res[MODE_SOCKET]);
	print_ring_row("socket-idle", pacing, &res[MODE_SOCKET_IDLE], NULL);
	print_ring_row("ring-sleep", pacing, &res[MODE_RING_SLEEP], &res[MODE_SOCKET_IDLE]);
	fflush(stdout);
	for (m = 0; m < MODE_COUNT; m++) {
		if (res[m].err && !ret)
			ret = res[m].err;
		if (res[m].wrong && !ret)
			ret = -EIO;
	}
out:
	shardd_close(c);
	for (m = 0; m < MODE_COUNT; m++)
		free(res[m].ns);
	return ret;
}
