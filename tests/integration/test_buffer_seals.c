/* SPDX-License-Identifier: MIT */
/*
 * The unsharded buffer is lent read-only to every rank of a replica, so one
 * rank that could write it would change the params every other rank reads.
 * A real shardd and two real rank processes: rank 0 takes the unsharded fd
 * of a GROUP reply as a hostile trainer would and tries every write path
 * (write(2), a writable shared mapping, mprotect of a read-only one, a hole
 * punch, and all of these again on a descriptor reopened O_RDWR through
 * /proc/self/fd); each must fail. Both ranks then read the gathered values
 * (checked against tests/lib/reference.c), the daemon rewrites the buffer
 * on the next unshard, and the rank's own grad and shard buffers stay
 * writable. A rank-executed group's buffers, lent to a rank's peers, are
 * tried the same way.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "harness.h"
#include "internal.h"
#include "reference.h"
#include "shardd_ctrl.h"
#include "shardd_exec.h"

#define WORLD     2
#define SIGNAL_MS 20000

static struct harness_daemon daemon_;

static void start_daemon(void)
{
	harness_daemon_start_or_fail(&daemon_, NULL);
}

static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(buffer_seals, .init = start_daemon, .fini = stop_daemon, .timeout = 60);

/* Two fp32 params, gathered as bf16: 5x3 (uneven over 2 ranks: one padding row) and 7. */
static const struct shardd_param_desc params[] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 5, 3 } },
	{ .name = "b", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { 7 } },
};
#define NPARAMS 2
static const uint64_t numel[NPARAMS] = { 15, 7 };

/* The unsharded buffer is the daemon's output, lent read-only, in a daemon-executed group. */
static const struct shardd_group_opts daemon_exec = { .exec = SHARDD_EXEC_DAEMON };

/* Value i of param p at step `step`: fp32 values that bf16 must round. */
static float value(uint32_t p, uint64_t i, uint64_t step)
{
	return (float)step * 0.37f + (float)p * 3.1f + (float)i * 0.0123456f - 0.5f;
}

struct rank_arg {
	uint32_t rank;
	int go_rd, go_wr; /* rank 0 writes a byte when its attempts are over; rank 1 reads it */
};

/* Load the step's full values of every param into this rank's shard. */
static int load_step(struct shardd_group *g, uint64_t step)
{
	float full[16];

	for (uint32_t p = 0; p < NPARAMS; p++) {
		for (uint64_t i = 0; i < numel[p]; i++)
			full[i] = value(p, i, step);
		CHILD_CHECK(shardd_group_load_full(g, p, full) == 0, "load param %u: %s", p,
			    shardd_last_error());
	}
	return 0;
}

/* Every unsharded value equals the step's value rounded to bf16 (the reference's rounding). */
static int check_unsharded(struct shardd_group *g, uint32_t rank, uint64_t step)
{
	for (uint32_t p = 0; p < NPARAMS; p++) {
		const uint8_t *u = shardd_group_unsharded(g, p);

		for (uint64_t i = 0; i < numel[p]; i++) {
			double want = ref_round(value(p, i, step), SHARDD_DTYPE_BF16);
			double got = ref_load(u + i * 2, SHARDD_DTYPE_BF16);

			CHILD_CHECK(got == want, "rank %u step %llu: param %s[%llu] = %g, want %g",
				    rank, (unsigned long long)step, params[p].name,
				    (unsigned long long)i, got, want);
		}
	}
	return 0;
}

/*
 * The four fds of a GROUP reply for `name`, as the daemon sends them to this
 * rank (unsharded, grad, shard, sharded grad): what a trainer that reads the
 * protocol itself holds.
 */
static int open_group_fds(struct shardd_client *c, const char *name, int fds[SHARDD_GROUP_BUFS])
{
	struct shardd_open_group req = { { 0 } };
	struct shardd_ctrl_rx rx = { 0 };
	int ret;

	snprintf(req.name, sizeof(req.name), "%s", name);
	ret = shardd_client_request(c, SHARDD_MSG_OPEN_GROUP, &req, sizeof(req), 10000,
				    SHARDD_MSG_GROUP, &rx);
	CHILD_CHECK(ret == 0, "open group '%s': %s", name, shardd_last_error());
	CHILD_CHECK(rx.nfds == SHARDD_GROUP_BUFS, "GROUP reply with %d fds", rx.nfds);
	for (int i = 0; i < SHARDD_GROUP_BUFS; i++) {
		fds[i] = rx.fds[i];
		rx.fds[i] = -1;
	}
	rx.nfds = 0;
	shardd_ctrl_rx_reset(&rx);
	return 0;
}

/* Every write path through `fd` fails; `what` names the descriptor in messages. */
static int expect_no_write(int fd, size_t size, const char *what)
{
	uint8_t junk[8];
	void *m;

	memset(junk, 0x7f, sizeof(junk));
	errno = 0;
	CHILD_CHECK(pwrite(fd, junk, sizeof(junk), 0) < 0, "%s: pwrite succeeded", what);
	CHILD_CHECK(write(fd, junk, sizeof(junk)) < 0, "%s: write succeeded", what);
	m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	CHILD_CHECK(m == MAP_FAILED, "%s: mmap(PROT_WRITE, MAP_SHARED) succeeded", what);
	m = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
	CHILD_CHECK(m != MAP_FAILED, "%s: a read-only shared mapping failed: %s", what,
		    strerror(errno));
	CHILD_CHECK(mprotect(m, size, PROT_READ | PROT_WRITE) < 0,
		    "%s: mprotect(PROT_WRITE) of a read-only shared mapping succeeded", what);
	munmap(m, size);
	/* A punched hole would read back as zeros on every rank. */
	CHILD_CHECK(fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)size) < 0,
		    "%s: fallocate(PUNCH_HOLE) succeeded", what);
	CHILD_CHECK(ftruncate(fd, 0) < 0, "%s: ftruncate to 0 succeeded", what);
	return 0;
}

/* Every way to write a read-only buffer through its fd, or one reopened from it. */
static int attack_unsharded(int fd, size_t size)
{
	char path[64];
	int rw;

	if (expect_no_write(fd, size, "the unsharded fd"))
		return 1;
	/* Reopening may succeed (the file is ours to open); no write may go through it. */
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	rw = open(path, O_RDWR | O_CLOEXEC);
	if (rw >= 0) {
		int ret = expect_no_write(rw, size, "the unsharded fd reopened O_RDWR");

		close(rw);
		if (ret)
			return 1;
	}
	return 0;
}

/* The rank's own buffers map writable, and a write through one reaches libshardd's view. */
static int check_writable(struct shardd_group *g, const int fds[SHARDD_GROUP_BUFS])
{
	const struct shardd_group_reply *info = shardd_group_info(g);
	float *grad = shardd_group_grad(g, 0);
	volatile float *shard = shardd_group_shard(g, 1);
	void *m;

	m = mmap(NULL, info->grad_size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[1], 0);
	CHILD_CHECK(m != MAP_FAILED, "grad fd: writable mapping failed: %s", strerror(errno));
	((float *)((uint8_t *)m + shardd_group_layout(g, 0)->grad_offset))[0] = 42.5f;
	CHILD_CHECK(grad[0] == 42.5f, "grad written through its fd reads %g", grad[0]);
	grad[0] = 0;
	munmap(m, info->grad_size);
	m = mmap(NULL, info->shard_size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[2], 0);
	CHILD_CHECK(m != MAP_FAILED, "shard fd: writable mapping failed: %s", strerror(errno));
	munmap(m, info->shard_size);
	shard[0] = shard[0]; /* a store: SIGSEGV if libshardd mapped it read-only */
	return 0;
}

/* A rank's end: its group's fds, the group and the client closed; 0 (the child's status). */
static int close_rank(int *fds, struct shardd_group *g, struct shardd_client *c)
{
	for (int i = 0; i < SHARDD_GROUP_BUFS; i++)
		close(fds[i]);
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

static int rank_main(void *p)
{
	const struct rank_arg *a = p;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	struct shardd_precision prec = { .param_dtype = SHARDD_DTYPE_BF16 };
	int fds[SHARDD_GROUP_BUFS];
	char byte;

	CHILD_CHECK(harness_attach(&daemon_, "seals", a->rank, 1, WORLD, &c) == 0, "attach");
	CHILD_CHECK(shardd_group_register(c, "g", params, NPARAMS, &prec, &daemon_exec, &g) == 0,
		    "register: %s", shardd_last_error());
	if (load_step(g, 1))
		return 1;
	CHILD_CHECK(shardd_unshard(g, 1) == 0, "unshard 1: %s", shardd_last_error());
	if (open_group_fds(c, "g", fds))
		return 1;
	if (a->rank == 0) {
		if (attack_unsharded(fds[0], shardd_group_info(g)->unsharded_size))
			return 1;
		CHILD_CHECK(harness_signal(a->go_wr, 'g') == 0, "signal rank 1");
	} else {
		CHILD_CHECK(harness_read_full(a->go_rd, &byte, 1, SIGNAL_MS) == 0,
			    "rank 0 never finished its attempts");
	}
	/* The other rank's attempts changed nothing this rank reads. */
	if (check_unsharded(g, a->rank, 1) || check_writable(g, fds))
		return 1;
	/* The daemon still writes the sealed buffer: new shards, next step, new values. */
	if (load_step(g, 2))
		return 1;
	CHILD_CHECK(shardd_reshard(g, 1) == 0, "reshard 1: %s", shardd_last_error());
	CHILD_CHECK(shardd_unshard(g, 2) == 0, "unshard 2: %s", shardd_last_error());
	if (check_unsharded(g, a->rank, 2))
		return 1;
	return close_rank(fds, g, c);
}

Test(buffer_seals, unsharded_fd_refuses_every_write_path_and_keeps_gathered_values)
{
	struct rank_arg args[WORLD];
	int go[2];

	cr_assert_eq(pipe2(go, O_CLOEXEC), 0);
	for (uint32_t r = 0; r < WORLD; r++)
		args[r] = (struct rank_arg){ .rank = r, .go_rd = go[0], .go_wr = go[1] };
	harness_run_children(rank_main, args, sizeof(args[0]), WORLD, 40000, &daemon_);
	close(go[0]);
	close(go[1]);
}

/* A rank's second export of the same buffers (a re-attaching rank's OPEN_GROUP) is sealed alike. */
static int reopen_rank(void *p)
{
	const struct rank_arg *a = p;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	int fds[SHARDD_GROUP_BUFS];
	int seals;

	CHILD_CHECK(harness_attach(&daemon_, "seals-fresh", a->rank, 1, 1, &c) == 0, "attach");
	CHILD_CHECK(shardd_group_register(c, "g", params, NPARAMS, NULL, &daemon_exec, &g) == 0,
		    "register: %s", shardd_last_error());
	if (open_group_fds(c, "g", fds))
		return 1;
	seals = fcntl(fds[0], F_GET_SEALS);
	CHILD_CHECK(seals >= 0 && (seals & F_SEAL_FUTURE_WRITE) && (seals & F_SEAL_SEAL),
		    "unsharded seals 0x%x", seals);
	seals = fcntl(fds[1], F_GET_SEALS);
	CHILD_CHECK(seals >= 0 && !(seals & F_SEAL_FUTURE_WRITE) && (seals & F_SEAL_SEAL),
		    "grad seals 0x%x: sealed, and writable", seals);
	if (attack_unsharded(fds[0], shardd_group_info(g)->unsharded_size))
		return 1;
	return close_rank(fds, g, c);
}

Test(buffer_seals, every_export_of_an_unsharded_buffer_is_sealed_and_others_stay_writable)
{
	struct rank_arg a = { .rank = 0, .go_rd = -1, .go_wr = -1 };

	harness_run_children(reopen_rank, &a, sizeof(a), 1, 30000, &daemon_);
}

/*
 * A rank-executed group lends each rank's flat shard and grad buffer to its
 * peers (EXEC_MAP): through those descriptors, and any reopened from them,
 * no write path may reach the owner's buffers, which the owner still writes
 * through the mappings it made before the seal.
 */
static int exec_peer_fds(struct shardd_client *c, uint32_t group, uint32_t peer, int fds[2],
			 uint64_t sizes[2])
{
	struct shardd_exec_map req = { .group_id = group, .peer = peer };
	struct shardd_exec_map_reply rep;
	struct shardd_ctrl_rx rx = { 0 };
	int ret;

	ret = shardd_client_request(c, SHARDD_MSG_EXEC_MAP, &req, sizeof(req), 10000,
				    SHARDD_MSG_EXEC_MAP_REPLY, &rx);
	CHILD_CHECK(ret == 0, "EXEC_MAP of rank %u: %s", peer, shardd_last_error());
	CHILD_CHECK(rx.nfds == 2 && rx.hdr.length == sizeof(rep), "EXEC_MAP reply: %d fds",
		    rx.nfds);
	memcpy(&rep, rx.payload, sizeof(rep));
	sizes[0] = rep.shard_map_size;
	sizes[1] = rep.grad_map_size;
	for (int i = 0; i < 2; i++) {
		fds[i] = rx.fds[i];
		rx.fds[i] = -1;
	}
	rx.nfds = 0;
	shardd_ctrl_rx_reset(&rx);
	return 0;
}

static int exec_rank(void *p)
{
	const struct rank_arg *a = p;
	const struct shardd_group_opts ranks = { .exec = SHARDD_EXEC_RANKS };
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	uint32_t peer = 1 - a->rank;
	uint64_t sizes[2];
	int fds[2];
	const float *seen;

	CHILD_CHECK(harness_attach(&daemon_, "seals-exec", a->rank, 1, WORLD, &c) == 0, "attach");
	CHILD_CHECK(shardd_group_register(c, "g", params, NPARAMS, NULL, &ranks, &g) == 0,
		    "register: %s", shardd_last_error());
	/* Each rank's own shard is writable to it after its seal, and its peer reads the value. */
	((volatile float *)shardd_group_shard(g, 0))[0] = 7.25f + (float)a->rank;
	CHILD_CHECK(shardd_barrier(c, 1) == 0, "barrier: %s", shardd_last_error());
	if (exec_peer_fds(c, shardd_group_id(g), peer, fds, sizes))
		return 1;
	if (attack_unsharded(fds[0], sizes[0]) || attack_unsharded(fds[1], sizes[1]))
		return 1;
	seen = mmap(NULL, sizes[0], PROT_READ, MAP_SHARED, fds[0], 0);
	CHILD_CHECK(seen != MAP_FAILED, "map the peer's shard: %s", strerror(errno));
	CHILD_CHECK(seen[shardd_group_layout(g, 0)->shard_offset / sizeof(float)] ==
			    7.25f + (float)peer,
		    "rank %u's shard reads %g here", peer,
		    seen[shardd_group_layout(g, 0)->shard_offset / sizeof(float)]);
	munmap((void *)seen, sizes[0]);
	CHILD_CHECK(shardd_barrier(c, 2) == 0, "barrier: %s", shardd_last_error());
	close(fds[0]);
	close(fds[1]);
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

Test(buffer_seals, a_peers_rank_executed_buffers_refuse_every_write_path)
{
	struct rank_arg args[WORLD];

	for (uint32_t r = 0; r < WORLD; r++)
		args[r] = (struct rank_arg){ .rank = r, .go_rd = -1, .go_wr = -1 };
	harness_run_children(exec_rank, args, sizeof(args[0]), WORLD, 30000, &daemon_);
}
