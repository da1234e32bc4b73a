/* SPDX-License-Identifier: MIT */
/*
 * Jobs spanning nodes on the cuda backend (docs/CUDA.md "Across nodes"):
 * two real `shardd --backend cuda --world mpi` daemons under mpirun on
 * this machine (over TCP: --mca btl tcp,self), node 0 on socket S and node
 * 1 on S.1, and rank processes on the GPU of their node, so that the
 * daemons bootstrap NCCL communicators over the world (node 0's
 * ncclUniqueId handed out through world.c's exchange) and run the
 * inter-node part with NCCL.
 *
 * - HSDP across nodes, 2 x 1 and 2 x 2 (node n's ranks on GPU n): a
 *   reduce without the all-reduce keeps a partial on each node, the next
 *   one with it all-reduces each shard among the nodes; every unsharded
 *   element (node-local) is the registered value.
 * - FSDP across nodes, 1 x 2 (rank n on GPU n): unshard gathers every
 *   rank's shard across the nodes, reduce reduce-scatters over both; a
 *   second reduce accumulates. 1 x 4 on 4 GPUs (2 per node).
 * - Node 1's daemon killed (SIGKILL) after the communicators were made:
 *   node 0's rank gets an error completion of its next reduce, within the
 *   collective timeout, naming node 1 and its ranks; node 0's daemon
 *   keeps serving (mpirun runs with Open MPI 4's recovery flags).
 *
 * Reference: the host's definition of the same op, computed here in
 * double from the grads alone (the average over every rank of the mesh,
 * accumulated). Tolerance (docs/CUDA.md "Numerics"): NCCL sums in the
 * reduce dtype in its own order, rounding at every hop, so an element may
 * be off by N x steps ulps of the reduce dtype at the magnitude of steps x
 * the sum of |grads| (N ranks, steps reduces), plus one fp32 ulp of the
 * result per step; padding rows exactly zero; gathered values exact.
 *
 * Skips with fewer than 2 GPUs (4 for 1 x 4) or without mpirun. The test
 * process itself never touches CUDA (it counts GPUs in a child), so that
 * the rank processes it forks may.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "nccl_checks.h"
#include "shardd.h"

#define CHILD_WAIT_MS 240000
#define READY_MS      120000

/* mpirun's process: the harness starts it as the "daemon", its log holds both daemons' output. */
static struct harness_daemon world_;
static char wrapper_dir[64], wrapper[96], bin_saved[512], node1_socket[128];

/* ------------------------------------------------------------------ */
/* The world: 2 daemons under mpirun                                   */
/* ------------------------------------------------------------------ */

/*
 * A script the harness runs as $SHARDD_BIN: it takes the harness's
 * `--socket S` and the other flags, and starts both daemons under mpirun,
 * node 0 on S and node 1 on S.1, each with every flag.
 */
static void write_wrapper(const char *real)
{
	FILE *f;

	snprintf(wrapper_dir, sizeof(wrapper_dir), "/tmp/shardd-span-XXXXXX");
	cr_assert_not_null(mkdtemp(wrapper_dir), "mkdtemp");
	snprintf(wrapper, sizeof(wrapper), "%s/world.sh", wrapper_dir);
	f = fopen(wrapper, "w");
	cr_assert_not_null(f, "create %s", wrapper);
	fprintf(f,
		"#!/bin/sh\n"
		"sock=$2; shift 2\n"
		"exec mpirun %s --oversubscribe --mca btl tcp,self --mca orte_enable_recovery 1 "
		"--mca orte_abort_on_non_zero_status 0 -np 2 sh -c "
		"'n=$OMPI_COMM_WORLD_RANK; s=$1; shift; if [ \"$n\" != 0 ]; then s=\"$s.$n\"; fi; "
		"exec \"$0\" --world mpi --socket \"$s\" \"$@\"' '%s' \"$sock\" \"$@\"\n",
		geteuid() == 0 ? "--allow-run-as-root" : "", real);
	cr_assert_eq(fclose(f), 0);
	cr_assert_eq(chmod(wrapper, 0755), 0);
}

static void start_world(int need_gpus)
{
	const char *extra[] = { "--backend", "cuda", "--log-level", "info", "--collective-timeout",
				"10",        NULL };
	const char *real = getenv("SHARDD_BIN");
	int n = harness_cuda_devices();
	char line[192];

	if (n < need_gpus)
		cr_skip_test(
			"needs %d GPUs (one node's daemon per GPU, 2 nodes), %d visible: " NCCL_ONE_RANK_PER_GPU,
			need_gpus, n);
	if (system("command -v mpirun >/dev/null 2>&1") != 0)
		cr_skip_test("mpirun (openmpi-bin) is not installed: make deps");
	cr_assert(real && real[0] == '/',
		  "SHARDD_BIN must be the daemon's absolute path; run through make test-gpu");
	signal(SIGPIPE, SIG_IGN);
	snprintf(bin_saved, sizeof(bin_saved), "%s", real);
	write_wrapper(bin_saved);
	setenv("SHARDD_BIN", wrapper, 1);
	cr_assert_eq(harness_daemon_start(&world_, extra), 0,
		     "mpirun of 2 shardd --backend cuda did not start");
	setenv("SHARDD_BIN", bin_saved, 1);
	snprintf(node1_socket, sizeof(node1_socket), "%s.1", world_.socket);
	/* The harness saw a ready line holding S, which node 1's S.1 holds too: wait for each exactly. */
	snprintf(line, sizeof(line), "shardd: ready on %s\n", world_.socket);
	harness_wait_log(&world_, line, READY_MS);
	snprintf(line, sizeof(line), "shardd: ready on %s\n", node1_socket);
	harness_wait_log(&world_, line, READY_MS);
}

static void start_2(void)
{
	start_world(2);
}

static void start_4(void)
{
	start_world(4);
}

static void stop_world(void)
{
	/* mpirun passes SIGTERM on to both daemons. */
	harness_daemon_stop(&world_);
	if (wrapper[0]) {
		unlink(wrapper);
		rmdir(wrapper_dir);
	}
}

/* ------------------------------------------------------------------ */
/* Values                                                              */
/* ------------------------------------------------------------------ */

/* w: 1001 rows leave padding rows over 2 and 4 shards; t: Shard(1), a chunk-cat. */
static const struct shardd_param_desc params[] = {
	{ .name = "w", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 1001, 3 } },
	{ .name = "t", .dtype = SHARDD_DTYPE_FP32, .ndim = 2, .shape = { 4, 8 }, .shard_dim = 1 },
};
#define NPARAMS 2

/* ------------------------------------------------------------------ */
/* Rank processes                                                      */
/* ------------------------------------------------------------------ */

struct rank_args {
	const char *job;
	uint32_t rank, replicate, shard, local;
	int32_t device;
	int hsdp;
};

static int check_unsharded(const struct rank_args *a, struct shardd_group *g)
{
	char who[32];

	snprintf(who, sizeof(who), "rank %u", a->rank);
	for (uint32_t pi = 0; pi < NPARAMS; pi++)
		if (check_unsharded_param(who, pi, &params[pi], SHARDD_DTYPE_FP32,
					  shardd_group_layout(g, pi),
					  shardd_group_unsharded(g, pi)))
			return 1;
	return 0;
}

static int write_grads(const struct rank_args *a, struct shardd_group *g)
{
	for (uint32_t pi = 0; pi < NPARAMS; pi++)
		if (write_grad_param(a->rank, pi, &params[pi], SHARDD_DTYPE_FP32,
				     shardd_group_grad(g, pi)))
			return 1;
	return 0;
}

/* steps x the average over every rank of the mesh, within the tolerance of the file comment. */
static int check_sharded_grads(const struct rank_args *a, struct shardd_group *g, uint32_t steps)
{
	char who[32];

	snprintf(who, sizeof(who), "rank %u", a->rank);
	for (uint32_t pi = 0; pi < NPARAMS; pi++)
		if (check_shard_grad_param(
			    who, pi, &params[pi], SHARDD_DTYPE_FP32, SHARDD_DTYPE_FP32, a->shard,
			    a->rank % a->shard, a->replicate * a->shard, steps,
			    shardd_group_layout(g, pi), shardd_group_shard_grad(g, pi)))
			return 1;
	return 0;
}

static int rank_main(void *arg)
{
	const struct rank_args *a = arg;
	struct shardd_attach_opts o = {
		.socket_path = a->rank / a->local ? node1_socket : world_.socket,
		.job = a->job,
		.rank = a->rank,
		.replicate = a->replicate,
		.shard = a->shard,
		.device = a->device,
	};
	struct shardd_group *g = NULL;
	struct shardd_client *c = NULL;

	CHILD_CHECK_CUDA(cudaSetDevice(a->device));
	CHILD_CHECK_SHARDD(shardd_connect(&o, &c));
	if (register_loaded(c, "blocks", params, NPARAMS, NULL, &g))
		return 1;
	/* Under FSDP across nodes the first unshard also sets the communicator up. */
	CHILD_CHECK_SHARDD(shardd_unshard(g, 1));
	if (check_unsharded(a, g))
		return 1;
	CHILD_CHECK_SHARDD(shardd_reshard(g, 1));
	if (write_grads(a, g))
		return 1;
	if (a->hsdp) {
		/* Microbatch 1 stays a partial on each node; microbatch 2 adds to it, then all-reduces among the nodes. */
		CHILD_CHECK_SHARDD(shardd_reduce(g, 1, 0));
		CHILD_CHECK_SHARDD(shardd_reduce(g, 2, SHARDD_REDUCE_ALL_REDUCE));
		if (check_sharded_grads(a, g, 2))
			return 1;
	} else {
		CHILD_CHECK_SHARDD(shardd_reduce(g, 1, 0));
		if (check_sharded_grads(a, g, 1))
			return 1;
		/* The sharded grad exists now: the next reduce accumulates into it. */
		CHILD_CHECK_SHARDD(shardd_reduce(g, 2, 0));
		if (check_sharded_grads(a, g, 2))
			return 1;
	}
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

/* Mesh replicate x shard over the 2 nodes, rank r on devices[r]. */
static void run_mesh(const char *job, uint32_t replicate, uint32_t shard, const int32_t *devices)
{
	struct rank_args args[4];
	uint32_t n = replicate * shard;

	for (uint32_t r = 0; r < n; r++)
		args[r] = (struct rank_args){ .job = job,
					      .rank = r,
					      .replicate = replicate,
					      .shard = shard,
					      .local = n / 2,
					      .device = devices[r],
					      .hsdp = replicate > 1 };
	harness_run_children(rank_main, args, sizeof(args[0]), n, CHILD_WAIT_MS, &world_);
	/* Both nodes made their communicators from node 0's unique id. */
	harness_wait_log(&world_, "across nodes ready", 10000);
}

Test(nccl_span, hsdp_2x1_across_two_nodes_all_reduces_each_shard_through_nccl, .init = start_2,
     .fini = stop_world, .timeout = 300)
{
	const int32_t devices[2] = { 0, 1 };

	run_mesh("hsdp2x1", 2, 1, devices);
}

Test(nccl_span, hsdp_2x2_across_two_nodes_keeps_partials_then_all_reduces_per_local_index,
     .init = start_2, .fini = stop_world, .timeout = 300)
{
	/* Node 0's ranks on GPU 0, node 1's on GPU 1: the reduce-scatter on one GPU, the all-reduce across. */
	const int32_t devices[4] = { 0, 0, 1, 1 };

	run_mesh("hsdp2x2", 2, 2, devices);
}

Test(nccl_span, fsdp_1x2_across_two_nodes_gathers_and_reduce_scatters_through_nccl, .init = start_2,
     .fini = stop_world, .timeout = 300)
{
	const int32_t devices[2] = { 0, 1 };

	run_mesh("fsdp1x2", 1, 2, devices);
}

Test(nccl_span, fsdp_1x4_across_two_nodes_of_two_gpus_runs_one_communicator_over_every_rank,
     .init = start_4, .fini = stop_world, .timeout = 300)
{
	const int32_t devices[4] = { 0, 1, 2, 3 };

	run_mesh("fsdp1x4", 1, 4, devices);
}

/* ------------------------------------------------------------------ */
/* A node that dies                                                    */
/* ------------------------------------------------------------------ */

struct dying_args {
	uint32_t rank;
	int ready_fd; /* write end: one byte once the first unshard (and the set-up) is done */
	int go_fd;    /* read end: one byte (rank 0: reduce now) or EOF (rank 1: exit) */
	int go_write; /* the test's end of go_fd's pipe, closed in the child so that EOF can come */
};

static int dying_main(void *arg)
{
	const struct dying_args *a = arg;
	struct shardd_attach_opts o = {
		.socket_path = a->rank ? node1_socket : world_.socket,
		.job = "dying",
		.rank = a->rank,
		.replicate = 1,
		.shard = 2,
		.device = (int32_t)a->rank,
	};
	struct shardd_group *g = NULL;
	struct shardd_client *c = NULL;
	const char *why;
	char byte = 'r';
	int ret;

	close(a->go_write);
	CHILD_CHECK_CUDA(cudaSetDevice((int)a->rank));
	CHILD_CHECK_SHARDD(shardd_connect(&o, &c));
	if (register_loaded(c, "blocks", params, NPARAMS, NULL, &g))
		return 1;
	CHILD_CHECK_SHARDD(shardd_unshard(g, 1));
	CHILD_CHECK_SHARDD(shardd_reshard(g, 1));
	CHILD_CHECK(write(a->ready_fd, &byte, 1) == 1, "tell the test the set-up is done");
	CHILD_CHECK(read(a->go_fd, &byte, 1) >= 0, "wait for the test");
	if (a->rank)
		return 0;
	ret = shardd_reduce(g, 1, 0);
	why = shardd_last_error();
	CHILD_CHECK(ret < 0, "the reduce with node 1 dead completed");
	CHILD_CHECK(strstr(why, "node 1 (ranks 1..1)"),
		    "the error must name node 1 and its ranks: %s", why);
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

/* Node 1's daemon pid, from its "world: node 1 of 2 nodes" line. */
static pid_t node1_pid(void)
{
	const char *at;
	pid_t pid = -1;

	pthread_mutex_lock(&world_.lock);
	at = world_.log ? strstr(world_.log, "info: world: node 1 of 2 nodes") : NULL;
	if (at) {
		while (at > world_.log && at[-1] != '[')
			at--;
		pid = (pid_t)atoi(at);
	}
	pthread_mutex_unlock(&world_.lock);
	return pid;
}

/* Until `pid` (not our child) has exited, or timeout_ms: a zombie of mpirun's counts. */
static int wait_gone(pid_t pid, int timeout_ms)
{
	char path[64], stat[256];

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	for (int waited = 0; waited < timeout_ms; waited += 10) {
		FILE *f = fopen(path, "r");
		const char *paren;

		if (!f)
			return 0;
		paren = fgets(stat, sizeof(stat), f) ? strrchr(stat, ')') : NULL;
		fclose(f);
		if (paren && (paren[2] == 'Z' || paren[2] == 'X'))
			return 0;
		/* Polling /proc: the kernel tells only a parent when a process ends. */
		usleep(10000);
	}
	return -1;
}

Test(nccl_span, a_dead_node_fails_the_next_reduce_on_the_other_node_naming_it, .init = start_2,
     .fini = stop_world, .timeout = 300)
{
	struct dying_args args[2];
	int ready[2][2], go[2][2];
	pid_t pids[2], pid;
	char byte;

	harness_wait_log(&world_, "info: world: node 1 of 2 nodes", 10000);
	pid = node1_pid();
	cr_assert_gt(pid, 0, "node 1's daemon pid not found in the log");
	for (uint32_t r = 0; r < 2; r++) {
		cr_assert_eq(pipe(ready[r]), 0);
		cr_assert_eq(pipe(go[r]), 0);
		args[r] = (struct dying_args){
			.rank = r, .ready_fd = ready[r][1], .go_fd = go[r][0], .go_write = go[r][1]
		};
		pids[r] = harness_fork(dying_main, &args[r]);
		cr_assert_gt(pids[r], 0);
		close(ready[r][1]);
		close(go[r][0]);
	}
	for (uint32_t r = 0; r < 2; r++) {
		struct pollfd pfd = { ready[r][0], POLLIN, 0 };

		cr_assert_eq(poll(&pfd, 1, CHILD_WAIT_MS), 1,
			     "rank %u did not finish its first unshard", r);
		if (read(ready[r][0], &byte, 1) != 1) {
			harness_daemon_dump_log(&world_);
			cr_assert_fail("rank %u failed before the kill (its log is above)", r);
		}
	}
	cr_assert_eq(kill(pid, SIGKILL), 0);
	cr_assert_eq(wait_gone(pid, 10000), 0, "node 1's daemon (pid %d) did not exit", (int)pid);
	close(go[1][1]);
	cr_assert_eq(write(go[0][1], "g", 1), 1);
	close(go[0][1]);
	for (uint32_t r = 0; r < 2; r++) {
		int status = 0;

		cr_assert_eq(harness_wait_or_kill(pids[r], CHILD_WAIT_MS, &status), 0,
			     "rank %u did not finish", r);
		if (!WIFEXITED(status) || WEXITSTATUS(status))
			harness_daemon_dump_log(&world_);
		cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank %u %s", r,
			  harness_status_str(status));
		close(ready[r][0]);
	}
	/* Node 0's daemon is still there: its socket takes a new rank. */
	{
		struct shardd_client *c = NULL;

		cr_assert_eq(harness_attach(&world_, "after", 0, 1, 2, &c), 0,
			     "node 0's daemon stopped serving: %s", shardd_last_error());
		shardd_close(c);
	}
}
