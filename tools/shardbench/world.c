/* SPDX-License-Identifier: MIT */
/*
 * `shardbench world`: HSDP reduce across nodes (docs/MULTINODE.md). Starts
 * NODES daemons under `mpirun --mca btl tcp,self` (each on its own socket,
 * on this machine unless mpirun is told otherwise through its environment),
 * attaches NODES x L rank threads with the mesh NODES x L (one replica per
 * node) and, per size, times the reduce without SHARDD_REDUCE_ALL_REDUCE
 * (node-local: the reduce-scatter into the partials) and with it (the same
 * plus the all-reduce of the partials among the nodes). Their difference is
 * the inter-node part, compared with MPI_Allreduce (over tcp,self, the
 * daemons' transport) of the bytes each node
 * contributes among NODES processes; the whole op is compared with
 * MPI_Reduce_scatter_block of the same grads among all NODES x L ranks
 * (plain FSDP over MPI). fp32 grads, sums exact: every result is checked.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "shardd.h"

#define WORLD_READY_MS 60000
#define WORLD_WAIT_MS  120000

struct world_run {
	const struct bench_opts *o;
	uint32_t nodes, L, n;
	char dir[64];
	pthread_barrier_t bar;
	uint64_t bytes;                /* the size being measured */
	uint64_t *t0, *t1;             /* [n][warmup + iters]: each rank's start and end */
	uint64_t wrong;                /* under lock */
	int failed;                    /* under lock */
	pthread_mutex_t lock;
};

struct world_rank {
	struct world_run *w;
	uint32_t rank;
	double us[2];                  /* rank 0: local, whole */
};

static int world_failed(struct world_run *w)
{
	return __atomic_load_n(&w->failed, __ATOMIC_RELAXED);
}

static void world_fail(struct world_run *w, uint32_t rank, const char *what, int err)
{
	pthread_mutex_lock(&w->lock);
	if (!w->failed)
		fprintf(stderr, "shardbench world: rank %u: %s: %s (%s)\n", rank, what, shardd_strerror(err),
			shardd_last_error());
	__atomic_store_n(&w->failed, 1, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&w->lock);
}

/* Mean over the timed iterations of (last end - first start) across ranks, in us. */
static double world_mean_us(const struct world_run *w)
{
	int total = w->o->warmup + w->o->iters;
	double sum = 0;

	for (int it = w->o->warmup; it < total; it++) {
		uint64_t a = UINT64_MAX, b = 0;

		for (uint32_t r = 0; r < w->n; r++) {
			a = w->t0[(size_t)r * total + it] < a ? w->t0[(size_t)r * total + it] : a;
			b = w->t1[(size_t)r * total + it] > b ? w->t1[(size_t)r * total + it] : b;
		}
		sum += (double)(b - a);
	}
	return sum / w->o->iters / 1000.0;
}

/* One rank of one size: its own job, so the group's memory goes when the ranks leave. */
static void *world_rank_main(void *arg)
{
	struct world_rank *wr = arg;
	struct world_run *w = wr->w;
	uint32_t r = wr->rank, total = (uint32_t)(w->o->warmup + w->o->iters);
	uint64_t count = w->bytes / sizeof(float);
	char job[64], sock[128];
	struct shardd_attach_opts ao = {
		.job = job, .socket_path = sock, .rank = r, .replicate = w->nodes, .shard = w->L,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_param_desc p = { .name = "g", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { count } };
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	int err = 0;

	snprintf(job, sizeof(job), "bench-world-%llu", (unsigned long long)w->bytes);
	snprintf(sock, sizeof(sock), "%s/node.%u", w->dir, r / w->L);
	err = shardd_connect(&ao, &c);
	if (!err)
		err = shardd_group_register(c, "g", &p, 1, NULL, &g);
	if (err)
		world_fail(w, r, "attach and register", err);
	if (g) {
		float *grad = shardd_group_grad(g, 0);

		for (uint64_t i = 0; i < count; i++)
			grad[i] = bench_grad_value(i, r, 3);
	}
	for (int mode = 0; mode < 2; mode++) {
		for (uint32_t it = 0; it < total; it++) {
			pthread_barrier_wait(&w->bar);
			w->t0[(size_t)r * total + it] = bench_now_ns();
			if (g && !world_failed(w)) {
				err = shardd_reduce(g, 1 + it, mode ? SHARDD_REDUCE_ALL_REDUCE : 0);
				if (err)
					world_fail(w, r, mode ? "reduce with the all-reduce" : "reduce", err);
			}
			w->t1[(size_t)r * total + it] = bench_now_ns();
		}
		pthread_barrier_wait(&w->bar);
		if (r == 0)
			wr->us[mode] = world_mean_us(w);
		pthread_barrier_wait(&w->bar);
	}
	/* The check: a fresh sharded grad from one all-reduce (the last one cleared the partials). */
	if (g && !world_failed(w) && w->o->check) {
		uint64_t bad = 0;

		err = shardd_zero_grad(g);
		pthread_barrier_wait(&w->bar);
		if (!err)
			err = shardd_reduce(g, 100000, SHARDD_REDUCE_ALL_REDUCE);
		if (err) {
			world_fail(w, r, "checked reduce", err);
		} else {
			const struct shardd_param_layout *l = shardd_group_layout(g, 0);
			const float *sg = shardd_group_shard_grad(g, 0);

			for (uint64_t k = 0; k < l->shard_rows_valid; k++) {
				uint64_t i = l->shard_row_begin + k;
				float acc = 0;

				/* HSDP's numbers: each node's average (its partial), then the nodes' average. */
				for (uint32_t node = 0; node < w->nodes; node++) {
					float sum = 0;

					for (uint32_t q = 0; q < w->L; q++)
						sum += bench_grad_value(i, node * w->L + q, 3);
					acc += sum / (float)w->L;
				}
				bad += sg[k] != acc / (float)w->nodes;
			}
		}
		pthread_mutex_lock(&w->lock);
		w->wrong += bad;
		pthread_mutex_unlock(&w->lock);
	} else {
		pthread_barrier_wait(&w->bar);
	}
	if (g)
		shardd_group_close(g);
	if (c)
		shardd_close(c);
	return NULL;
}

/* Start the world: mpirun of NODES daemons in a session of their own. Returns mpirun's pid or -errno. */
static pid_t world_start(const struct bench_opts *o, struct world_run *w)
{
	char np[16], log[128];
	pid_t pid;

	snprintf(np, sizeof(np), "%u", w->nodes);
	snprintf(log, sizeof(log), "%s/daemons.log", w->dir);
	fflush(NULL);
	pid = fork();
	if (pid < 0)
		return -errno;
	if (pid == 0) {
		int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);

		setsid();
		if (fd >= 0) {
			dup2(fd, STDOUT_FILENO);
			dup2(fd, STDERR_FILENO);
		}
		execlp("mpirun", "mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "tcp,self",
		       "-np", np, "sh", "-c",
		       "d=\"$1\"; shift; exec \"$0\" --world mpi --socket \"$d/node.$OMPI_COMM_WORLD_RANK\" "
		       "--log-level warn --collective-timeout 60",
		       o->shardd_path, w->dir, (char *)NULL);
		fprintf(stderr, "exec mpirun: %s\n", strerror(errno));
		_exit(127);
	}
	return pid;
}

/* 0 once every node's socket exists, -ETIMEDOUT, or -ECHILD when mpirun ended. */
static int world_wait_ready(struct world_run *w, pid_t pid)
{
	uint64_t deadline = bench_now_ns() + WORLD_READY_MS * 1000000ull;

	for (;;) {
		uint32_t ready = 0;
		char sock[128];
		struct timespec ts = { 0, 10 * 1000000 };

		for (uint32_t k = 0; k < w->nodes; k++) {
			snprintf(sock, sizeof(sock), "%s/node.%u", w->dir, k);
			ready += access(sock, F_OK) == 0;
		}
		if (ready == w->nodes)
			return 0;
		if (waitpid(pid, NULL, WNOHANG) == pid)
			return -ECHILD;
		if (bench_now_ns() >= deadline)
			return -ETIMEDOUT;
		nanosleep(&ts, NULL);
	}
}

static void world_stop(pid_t pid)
{
	kill(-pid, SIGTERM);
	if (bench_wait_pid(pid, 15000) == -ETIMEDOUT) {
		kill(-pid, SIGKILL);
		bench_reap_pid(pid, 10000);
	}
}

int bench_world_run(const struct bench_opts *o)
{
	struct world_run w = { .o = o, .nodes = o->nodes, .L = o->ranks };
	struct bench_opts mo = *o;
	struct bench_mpi_table ar = { 0 }, rs = { 0 };
	struct world_rank *wr = NULL;
	pthread_t *th = NULL;
	pid_t pid;
	int total = o->warmup + o->iters, ret = 0;

	w.n = w.nodes * w.L;
	snprintf(w.dir, sizeof(w.dir), "/tmp/shardbench-world-XXXXXX");
	if (!mkdtemp(w.dir)) {
		fprintf(stderr, "shardbench world: mkdtemp: %s\n", strerror(errno));
		return 1;
	}
	pthread_mutex_init(&w.lock, NULL);
	pthread_barrier_init(&w.bar, NULL, w.n);
	w.t0 = calloc((size_t)w.n * total, sizeof(*w.t0));
	w.t1 = calloc((size_t)w.n * total, sizeof(*w.t1));
	wr = calloc(w.n, sizeof(*wr));
	th = calloc(w.n, sizeof(*th));
	if (!w.t0 || !w.t1 || !wr || !th) {
		fprintf(stderr, "shardbench world: out of memory\n");
		ret = 1;
		goto out;
	}

	/* The comparators first, before the daemons take memory and cores. */
	mo.dtype = SHARDD_DTYPE_FP32;
	mo.ranks = w.nodes;
	{
		/* Over the daemons' own transport, unless the caller picked one for Open MPI. */
		const char *btl = getenv("OMPI_MCA_btl");

		if (!btl)
			setenv("OMPI_MCA_btl", "tcp,self", 1);
		bench_mpi_run(&mo, "allreduce", &ar);
		if (!btl)
			unsetenv("OMPI_MCA_btl");
	}
	mo.ranks = w.n;
	bench_mpi_run(&mo, "reduce_scatter", &rs);

	pid = world_start(o, &w);
	if (pid < 0 || (ret = world_wait_ready(&w, pid)) != 0) {
		char log[160];

		snprintf(log, sizeof(log), "%s/daemons.log", w.dir);
		fprintf(stderr, "shardbench world: %u daemons under mpirun were not ready (%s); their output "
			"is in %s\n", w.nodes, strerror(pid < 0 ? (int)-pid : -ret), log);
		if (pid > 0)
			world_stop(pid);
		ret = 1;
		goto out;
	}

	printf("\n# world: HSDP reduce across %u nodes x %u ranks (mesh %ux%u), fp32 grads, %u daemons "
	       "under mpirun --mca btl tcp,self on this machine\n", w.nodes, w.L, w.nodes, w.L, w.nodes);
	printf("# local: reduce without SHARDD_REDUCE_ALL_REDUCE (node-local reduce-scatter into the partials)\n"
	       "# whole: reduce with it (the same, then the all-reduce of the partials among the nodes)\n"
	       "# inter = whole - local; vsAllreduce = MPI_Allreduce time of size(B) among %u processes over the\n"
	       "#   daemons' transport (--mca btl tcp,self unless OMPI_MCA_btl is set) / inter\n"
	       "# vsRS = MPI_Reduce_scatter_block time of size(B) among all %u ranks (Open MPI's default\n"
	       "#   transports: shared memory on one machine) / whole (> 1: shardd faster)\n",
	       w.nodes, w.n);
	printf("%12s %10s %10s %10s %13s %11s %10s %8s %7s\n", "size(B)", "local(us)", "whole(us)", "inter(us)",
	       "Allreduce(us)", "vsAllreduce", "RS(us)", "vsRS", "#wrong");
	for (w.bytes = o->min_bytes; w.bytes <= o->max_bytes && !world_failed(&w); w.bytes *= o->factor) {
		const struct bench_mpi_row *a = bench_mpi_find(&ar, w.bytes), *b = bench_mpi_find(&rs, w.bytes);
		double inter;

		w.wrong = 0;
		for (uint32_t r = 0; r < w.n; r++) {
			wr[r] = (struct world_rank){ .w = &w, .rank = r };
			if (pthread_create(&th[r], NULL, world_rank_main, &wr[r])) {
				fprintf(stderr, "shardbench world: cannot start rank thread %u\n", r);
				world_stop(pid);
				ret = 1;
				goto out;
			}
		}
		for (uint32_t r = 0; r < w.n; r++)
			pthread_join(th[r], NULL);
		if (world_failed(&w))
			break;
		inter = wr[0].us[1] - wr[0].us[0];
		printf("%12llu %10.1f %10.1f %10.1f ", (unsigned long long)w.bytes, wr[0].us[0], wr[0].us[1], inter);
		if (a)
			printf("%13.1f %11.2f ", a->time_us, inter > 0 ? a->time_us / inter : 0.0);
		else
			printf("%13s %11s ", "-", "-");
		if (b)
			printf("%10.1f %8.2f ", b->time_us, b->time_us / wr[0].us[1]);
		else
			printf("%10s %8s ", "-", "-");
		printf("%7llu\n", (unsigned long long)w.wrong);
		fflush(stdout);
		if (w.wrong)
			ret = 1;
	}
	if (!ar.available)
		printf("# MPI_Allreduce comparator: %s\n", ar.why);
	if (!rs.available)
		printf("# MPI_Reduce_scatter_block comparator: %s\n", rs.why);
	if (world_failed(&w))
		ret = 1;
	world_stop(pid);
out:
	{
		char path[160];

		for (uint32_t k = 0; k < w.nodes; k++) {
			snprintf(path, sizeof(path), "%s/node.%u", w.dir, k);
			unlink(path);
		}
		if (!ret) {
			snprintf(path, sizeof(path), "%s/daemons.log", w.dir);
			unlink(path);
			rmdir(w.dir);
		}
	}
	bench_mpi_free(&ar);
	bench_mpi_free(&rs);
	pthread_barrier_destroy(&w.bar);
	pthread_mutex_destroy(&w.lock);
	free(w.t0);
	free(w.t1);
	free(wr);
	free(th);
	return ret;
}
