/* SPDX-License-Identifier: MIT */
/*
 * `shardbench world`: collectives across nodes (docs/MULTINODE.md). Starts
 * NODES daemons under `mpirun --mca btl tcp,self` (each on its own socket,
 * on this machine unless mpirun is told otherwise through its environment)
 * and NODES plain daemons, and per size runs three jobs of NODES x L rank
 * threads, one after another:
 *
 * - HSDP, mesh NODES x L on the world: the reduce without
 *   SHARDD_REDUCE_ALL_REDUCE (node-local: the reduce-scatter into the
 *   partials) and with it (the same plus the all-reduce of the partials
 *   among the nodes); their difference is the inter-node part, compared
 *   with MPI_Allreduce of the bytes each node contributes among NODES
 *   processes over tcp,self (the daemons' transport);
 * - FSDP's node-local part: mesh 1 x L on each plain daemon, unshard and
 *   reduce of the same param: what each node does without the exchange;
 * - FSDP, mesh 1 x NODES*L on the world: unshard and reduce; minus the
 *   node-local part, compared with MPI_Allgather and
 *   MPI_Reduce_scatter_block of the same bytes among NODES processes.
 *
 * Each whole op is compared with plain MPI among all NODES x L ranks
 * (MPI_Reduce_scatter_block, MPI_Allgather). fp32 grads and small-integer
 * values, sums exact: every result is checked against values computed here.
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

/* The jobs one size runs, each on its own rank threads, in this order. */
enum world_kind {
	WORLD_HSDP = 0,  /* mesh NODES x L on the world: reduce without, then with the all-reduce */
	WORLD_LOCAL = 1, /* mesh 1 x L on each of NODES plain daemons: unshard, then reduce */
	WORLD_FSDP = 2,  /* mesh 1 x NODES*L on the world: unshard, then reduce */
	WORLD_KINDS
};

struct world_run {
	const struct bench_opts *o;
	uint32_t nodes, L, n;
	char dir[64];
	struct bench_daemon *plain; /* [nodes]: WORLD_LOCAL's daemons */
	pthread_barrier_t bar;
	enum world_kind kind; /* the job being measured */
	uint64_t bytes;       /* the size being measured */
	uint64_t *t0, *t1;    /* [n][warmup + iters]: each rank's start and end */
	uint64_t wrong[2];    /* under lock: wrong elements of op 0 and op 1 */
	int failed;           /* under lock */
	pthread_mutex_t lock;
};

struct world_rank {
	struct world_run *w;
	uint32_t rank; /* global: node rank / L */
	double us[2];  /* rank 0, per the kind's two ops (see enum world_kind) */
};

static int world_failed(struct world_run *w)
{
	return __atomic_load_n(&w->failed, __ATOMIC_RELAXED);
}

static void world_fail(struct world_run *w, uint32_t rank, const char *what, int err)
{
	pthread_mutex_lock(&w->lock);
	if (!w->failed)
		fprintf(stderr, "shardbench world: rank %u: %s: %s (%s)\n", rank, what,
			shardd_strerror(err), shardd_last_error());
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

/* Op `mode` (0 or 1) of the rank's kind at `step`. */
static int world_op(const struct world_run *w, struct shardd_group *g, int mode, uint64_t step)
{
	if (w->kind == WORLD_HSDP)
		return shardd_reduce(g, step, mode ? SHARDD_REDUCE_ALL_REDUCE : 0);
	return mode ? shardd_reduce(g, step, 0) : shardd_unshard(g, step);
}

/* What resets an FSDP op for the next iteration (untimed): reshard, zero_grad. */
static int world_undo(const struct world_run *w, struct shardd_group *g, int mode, uint64_t step)
{
	if (w->kind == WORLD_HSDP)
		return 0;
	return mode ? shardd_zero_grad(g) : shardd_reshard(g, step);
}

/*
 * The rank's sharded grad after one reduce from zero against the mean the
 * mesh defines, computed here: HSDP, each node's mean (its partial) and
 * then the nodes' mean; FSDP, the mean over the shard group (the node's L
 * ranks on a plain daemon, every rank on the world).
 */
static uint64_t world_check_grad(const struct world_run *w, uint32_t r, struct shardd_group *g)
{
	const struct shardd_param_layout *l = shardd_group_layout(g, 0);
	const float *sg = shardd_group_shard_grad(g, 0);
	uint32_t first = w->kind == WORLD_LOCAL ? r / w->L * w->L : 0;
	uint32_t members = w->kind == WORLD_LOCAL ? w->L : w->n;
	uint64_t bad = 0;

	for (uint64_t k = 0; k < l->shard_rows_valid; k++) {
		uint64_t i = l->shard_row_begin + k;
		float want = 0;

		if (w->kind == WORLD_HSDP) {
			for (uint32_t node = 0; node < w->nodes; node++) {
				float sum = 0;

				for (uint32_t q = 0; q < w->L; q++)
					sum += bench_grad_value(i, node * w->L + q, 3);
				want += sum / (float)w->L;
			}
			want /= (float)w->nodes;
		} else {
			for (uint32_t q = first; q < first + members; q++)
				want += bench_grad_value(i, q, 3);
			want /= (float)members;
		}
		bad += sg[k] != want;
	}
	return bad;
}

/* The node's one unsharded copy: each of its L ranks checks 1/L of it. */
static uint64_t world_check_unsharded(const struct world_run *w, uint32_t r, struct shardd_group *g,
				      uint64_t count)
{
	const float *u = shardd_group_unsharded(g, 0);
	uint64_t lo = count / w->L * (r % w->L),
		 hi = r % w->L + 1 == w->L ? count : lo + count / w->L, bad = 0;

	for (uint64_t i = lo; i < hi; i++)
		bad += u[i] != bench_param_value(i, 3);
	return bad;
}

/* One rank of one size and kind: its own job, so the group's memory goes when the ranks leave. */
static void *world_rank_main(void *arg)
{
	struct world_rank *wr = arg;
	struct world_run *w = wr->w;
	uint32_t r = wr->rank, total = (uint32_t)(w->o->warmup + w->o->iters), node = r / w->L;
	uint64_t count = w->bytes / sizeof(float);
	static const char *const kind_name[WORLD_KINDS] = { "hsdp", "local", "fsdp" };
	char job[64], sock[128];
	struct shardd_attach_opts ao = {
		.job = job,
		.socket_path = sock,
		.rank = r,
		.replicate = w->nodes,
		.shard = w->L,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_param_desc p = {
		.name = "g", .dtype = SHARDD_DTYPE_FP32, .ndim = 1, .shape = { count }
	};
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;
	int err = 0;

	snprintf(job, sizeof(job), "bench-world-%s-%llu", kind_name[w->kind],
		 (unsigned long long)w->bytes);
	if (w->kind == WORLD_LOCAL) {
		snprintf(sock, sizeof(sock), "%s", w->plain[node].socket_path);
		ao.rank = r % w->L;
		ao.replicate = 1;
	} else {
		snprintf(sock, sizeof(sock), "%s/node.%u", w->dir, node);
		if (w->kind == WORLD_FSDP) {
			ao.replicate = 1;
			ao.shard = w->n;
		}
	}
	err = shardd_connect(&ao, &c);
	if (!err)
		err = shardd_group_register(c, "g", &p, 1, NULL, NULL, &g);
	if (err)
		world_fail(w, r, "attach and register", err);
	if (g) {
		const struct shardd_param_layout *l = shardd_group_layout(g, 0);
		float *grad = shardd_group_grad(g, 0), *shard = shardd_group_shard(g, 0);

		for (uint64_t i = 0; i < count; i++)
			grad[i] = bench_grad_value(i, r, 3);
		for (uint64_t k = 0; k < l->shard_bytes / sizeof(float); k++)
			shard[k] = k < l->shard_rows_valid
					   ? bench_param_value(l->shard_row_begin + k, 3)
					   : 0.0f;
	}
	for (int mode = 0; mode < 2; mode++) {
		for (uint32_t it = 0; it < total; it++) {
			pthread_barrier_wait(&w->bar);
			w->t0[(size_t)r * total + it] = bench_now_ns();
			if (g && !world_failed(w)) {
				err = world_op(w, g, mode, 1 + it);
				if (err)
					world_fail(w, r,
						   w->kind == WORLD_HSDP
							   ? (mode ? "reduce with the all-reduce"
								   : "reduce")
							   : (mode ? "reduce" : "unshard"),
						   err);
			}
			w->t1[(size_t)r * total + it] = bench_now_ns();
			if (g && !world_failed(w) && it + 1 < total &&
			    (err = world_undo(w, g, mode, 1 + it)))
				world_fail(w, r, mode ? "zero_grad" : "reshard", err);
		}
		pthread_barrier_wait(&w->bar);
		if (r == 0)
			wr->us[mode] = world_mean_us(w);
		pthread_barrier_wait(&w->bar);
	}
	/*
	 * The check: the unsharded copy the last unshard left (FSDP; every
	 * rank wrote its rows of the param), and a fresh sharded grad from one
	 * more reduce (HSDP: the last all-reduce cleared the partials).
	 */
	if (g && !world_failed(w) && w->o->check) {
		uint64_t bad = 0;

		uint64_t bad_unsharded =
			w->kind != WORLD_HSDP ? world_check_unsharded(w, r, g, count) : 0;

		err = shardd_zero_grad(g);
		pthread_barrier_wait(&w->bar);
		if (!err)
			err = world_op(w, g, 1, 100000);
		if (err)
			world_fail(w, r, "checked reduce", err);
		else
			bad = world_check_grad(w, r, g);
		pthread_mutex_lock(&w->lock);
		w->wrong[0] += bad_unsharded;
		w->wrong[1] += bad;
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
		execlp("mpirun", "mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl",
		       "tcp,self", "-np", np, "sh", "-c",
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

/* The Open MPI comparators, in the order of enum world_mpi. */
enum world_mpi {
	MPI_AR_NODES, /* MPI_Allreduce among NODES processes over tcp,self */
	MPI_AG_NODES, /* MPI_Allgather among NODES over tcp,self */
	MPI_RS_NODES, /* MPI_Reduce_scatter_block among NODES over tcp,self */
	MPI_AG_ALL,   /* MPI_Allgather among all NODES*L ranks, default transports */
	MPI_RS_ALL,   /* MPI_Reduce_scatter_block among all NODES*L ranks, default transports */
	MPI_TABLES
};

/* What one size measured: per kind its two ops' times, and the #wrong of each op. */
struct world_row {
	uint64_t bytes;
	double us[WORLD_KINDS][2];
	uint64_t wrong[WORLD_KINDS][2];
};

/* Run every rank thread of one kind at w->bytes. 0, or 1 when a rank failed. */
static int world_measure(struct world_run *w, enum world_kind kind, struct world_rank *wr,
			 pthread_t *th, struct world_row *row)
{
	uint32_t started = 0;

	w->kind = kind;
	w->wrong[0] = w->wrong[1] = 0;
	for (uint32_t r = 0; r < w->n; r++) {
		wr[r] = (struct world_rank){ .w = w, .rank = r };
		if (pthread_create(&th[r], NULL, world_rank_main, &wr[r])) {
			fprintf(stderr, "shardbench world: cannot start rank thread %u\n", r);
			/* The started ones wait at the barrier for the missing: fail and release them. */
			__atomic_store_n(&w->failed, 1, __ATOMIC_RELAXED);
			break;
		}
		started++;
	}
	if (started < w->n) {
		/* A barrier that never completes cannot be released: exit, the daemons end with us. */
		fprintf(stderr, "shardbench world: giving up\n");
		exit(1);
	}
	for (uint32_t r = 0; r < w->n; r++)
		pthread_join(th[r], NULL);
	row->us[kind][0] = wr[0].us[0];
	row->us[kind][1] = wr[0].us[1];
	row->wrong[kind][0] = w->wrong[0];
	row->wrong[kind][1] = w->wrong[1];
	return world_failed(w);
}

/* "  %13.1f %11.2f" of a comparator's time and its ratio to `us`, or dashes. */
static void world_print_vs(const struct bench_mpi_table *t, uint64_t bytes, double us)
{
	const struct bench_mpi_row *m = bench_mpi_find(t, bytes);

	if (m)
		printf(" %13.1f %9.2f", m->time_us, us > 0 ? m->time_us / us : 0.0);
	else
		printf(" %13s %9s", "-", "-");
}

static void world_print(const struct world_run *w, const struct world_row *rows, size_t nrows,
			const struct bench_mpi_table *mpi)
{
	printf("\n# world: %u nodes x %u ranks, fp32 grads, %u daemons under mpirun --mca btl tcp,self on this "
	       "machine; times in us, mean over -n\n",
	       w->nodes, w->L, w->nodes);
	printf("# MPI(n): Open MPI among %u processes over the daemons' transport (--mca btl tcp,self unless\n"
	       "#   OMPI_MCA_btl is set), the bytes of the inter-node part; MPI(all): among all %u ranks with\n"
	       "#   Open MPI's default transports (shared memory on one machine), the whole op's bytes;\n"
	       "#   each the faster of two runs, before the daemons start and after they stop\n"
	       "# vs = MPI time / shardd time: above 1, shardd is faster\n",
	       w->nodes, w->n);

	printf("\n# HSDP reduce (mesh %ux%u): local = reduce without SHARDD_REDUCE_ALL_REDUCE (the node's\n"
	       "#   reduce-scatter into the partials), whole = with it, inter = whole - local;\n"
	       "#   MPI(n) = MPI_Allreduce, MPI(all) = MPI_Reduce_scatter_block\n",
	       w->nodes, w->L);
	printf("%12s %10s %10s %10s %13s %9s %13s %9s %7s\n", "size(B)", "local", "whole", "inter",
	       "Allreduce(n)", "vsInter", "RS(all)", "vsWhole", "#wrong");
	for (size_t i = 0; i < nrows; i++) {
		const struct world_row *x = &rows[i];
		double inter = x->us[WORLD_HSDP][1] - x->us[WORLD_HSDP][0];

		printf("%12llu %10.1f %10.1f %10.1f", (unsigned long long)x->bytes,
		       x->us[WORLD_HSDP][0], x->us[WORLD_HSDP][1], inter);
		world_print_vs(&mpi[MPI_AR_NODES], x->bytes, inter);
		world_print_vs(&mpi[MPI_RS_ALL], x->bytes, x->us[WORLD_HSDP][1]);
		printf(" %7llu\n", (unsigned long long)x->wrong[WORLD_HSDP][1]);
	}

	for (int op = 0; op < 2; op++) {
		printf("\n# FSDP %s (mesh 1x%u): local = the same op on %u plain daemons, mesh 1x%u each (the node's\n"
		       "#   part alone), whole = on the world, inter = whole - local;\n"
		       "#   MPI(n) = %s of size(B) among %u processes (each node's %s),\n"
		       "#   MPI(all) = %s among all %u ranks\n",
		       op ? "reduce" : "unshard", w->n, w->nodes, w->L,
		       op ? "MPI_Reduce_scatter_block" : "MPI_Allgather", w->nodes,
		       op ? "fp32 sums of every shard in, its ranks' shards out"
			  : "ranks' shards in, every shard out",
		       op ? "MPI_Reduce_scatter_block" : "MPI_Allgather", w->n);
		printf("%12s %10s %10s %10s %13s %9s %13s %9s %7s\n", "size(B)", "local", "whole",
		       "inter", op ? "RS(n)" : "Allgather(n)", "vsInter",
		       op ? "RS(all)" : "Allgather(all)", "vsWhole", "#wrong");
		for (size_t i = 0; i < nrows; i++) {
			const struct world_row *x = &rows[i];
			double inter = x->us[WORLD_FSDP][op] - x->us[WORLD_LOCAL][op];

			printf("%12llu %10.1f %10.1f %10.1f", (unsigned long long)x->bytes,
			       x->us[WORLD_LOCAL][op], x->us[WORLD_FSDP][op], inter);
			world_print_vs(&mpi[op ? MPI_RS_NODES : MPI_AG_NODES], x->bytes, inter);
			world_print_vs(&mpi[op ? MPI_RS_ALL : MPI_AG_ALL], x->bytes,
				       x->us[WORLD_FSDP][op]);
			printf(" %7llu\n", (unsigned long long)(x->wrong[WORLD_FSDP][op] +
								x->wrong[WORLD_LOCAL][op]));
		}
	}
	{
		static const char *const name[MPI_TABLES] = {
			"MPI_Allreduce(n)",
			"MPI_Allgather(n)",
			"MPI_Reduce_scatter_block(n)",
			"MPI_Allgather(all)",
			"MPI_Reduce_scatter_block(all)",
		};

		for (int m = 0; m < MPI_TABLES; m++) {
			uint64_t wrong = 0;

			if (!mpi[m].available)
				printf("# %s comparator: %s\n", name[m], mpi[m].why);
			for (size_t i = 0; i < mpi[m].nrows; i++)
				wrong += mpi[m].rows[i].wrong;
			if (wrong)
				printf("# %s comparator got %llu elements wrong: its times are suspect\n",
				       name[m], (unsigned long long)wrong);
		}
	}
}

/* Every comparator once, into mpi[MPI_TABLES]. */
static void world_mpi_runs(const struct bench_opts *o, const struct world_run *w,
			   struct bench_mpi_table *mpi)
{
	struct bench_opts mo = *o;
	/* Among the daemons' count, over their own transport, unless the caller picked one for Open MPI. */
	const char *btl = getenv("OMPI_MCA_btl");

	mo.dtype = SHARDD_DTYPE_FP32;
	mo.ranks = w->nodes;
	if (!btl)
		setenv("OMPI_MCA_btl", "tcp,self", 1);
	bench_mpi_run(&mo, "allreduce", &mpi[MPI_AR_NODES]);
	bench_mpi_run(&mo, "allgather", &mpi[MPI_AG_NODES]);
	bench_mpi_run(&mo, "reduce_scatter", &mpi[MPI_RS_NODES]);
	if (!btl)
		unsetenv("OMPI_MCA_btl");
	mo.ranks = w->n;
	bench_mpi_run(&mo, "allgather", &mpi[MPI_AG_ALL]);
	bench_mpi_run(&mo, "reduce_scatter", &mpi[MPI_RS_ALL]);
}

/*
 * The faster of two comparator runs per row into `into` (and its #wrong
 * added): load that slows one run must not make shardd look faster.
 */
static void world_mpi_merge(struct bench_mpi_table *into, struct bench_mpi_table *other)
{
	if (!into->available) {
		bench_mpi_free(into);
		*into = *other;
		memset(other, 0, sizeof(*other));
		return;
	}
	for (size_t i = 0; i < into->nrows; i++) {
		const struct bench_mpi_row *m = bench_mpi_find(other, into->rows[i].bytes);

		if (!m)
			continue;
		if (m->time_us < into->rows[i].time_us)
			into->rows[i].time_us = m->time_us;
		into->rows[i].wrong += m->wrong;
	}
}

int bench_world_run(const struct bench_opts *o)
{
	struct world_run w = { .o = o, .nodes = o->nodes, .L = o->ranks };
	struct bench_mpi_table mpi[MPI_TABLES] = { 0 }, again[MPI_TABLES] = { 0 };
	struct world_rank *wr = NULL;
	struct world_row *rows = NULL;
	size_t nrows = 0, maxrows = 0;
	pthread_t *th = NULL;
	pid_t pid;
	int total = o->warmup + o->iters, ret = 0;

	w.n = w.nodes * w.L;
	snprintf(w.dir, sizeof(w.dir), "/tmp/shardbench-world-XXXXXX");
	if (!mkdtemp(w.dir)) {
		fprintf(stderr, "shardbench world: mkdtemp: %s\n", strerror(errno));
		return 1;
	}
	for (uint64_t b = o->min_bytes; b <= o->max_bytes; b *= o->factor)
		maxrows++;
	pthread_mutex_init(&w.lock, NULL);
	pthread_barrier_init(&w.bar, NULL, w.n);
	w.t0 = calloc((size_t)w.n * total, sizeof(*w.t0));
	w.t1 = calloc((size_t)w.n * total, sizeof(*w.t1));
	w.plain = calloc(w.nodes, sizeof(*w.plain));
	wr = calloc(w.n, sizeof(*wr));
	th = calloc(w.n, sizeof(*th));
	rows = calloc(maxrows + 1, sizeof(*rows));
	if (!w.t0 || !w.t1 || !w.plain || !wr || !th || !rows) {
		fprintf(stderr, "shardbench world: out of memory\n");
		ret = 1;
		goto out;
	}

	/* The comparators before the daemons start, and again once they are gone (world_mpi_merge). */
	world_mpi_runs(o, &w, mpi);

	for (uint32_t k = 0; k < w.nodes; k++) {
		if (bench_daemon_start(o->shardd_path, "host", &w.plain[k])) {
			fprintf(stderr,
				"shardbench world: plain daemon %u (the node-local FSDP reference) did not "
				"start\n",
				k);
			ret = 1;
			goto out;
		}
	}
	pid = world_start(o, &w);
	if (pid < 0 || (ret = world_wait_ready(&w, pid)) != 0) {
		char log[160];

		snprintf(log, sizeof(log), "%s/daemons.log", w.dir);
		fprintf(stderr,
			"shardbench world: %u daemons under mpirun were not ready (%s); their output "
			"is in %s\n",
			w.nodes, strerror(pid < 0 ? (int)-pid : -ret), log);
		if (pid > 0)
			world_stop(pid);
		ret = 1;
		goto out;
	}

	/* Per size the three jobs one after another: they see the same machine. */
	for (w.bytes = o->min_bytes; w.bytes <= o->max_bytes && !world_failed(&w);
	     w.bytes *= o->factor) {
		struct world_row *x = &rows[nrows];

		x->bytes = w.bytes;
		if (world_measure(&w, WORLD_HSDP, wr, th, x) ||
		    world_measure(&w, WORLD_LOCAL, wr, th, x) ||
		    world_measure(&w, WORLD_FSDP, wr, th, x))
			break;
		nrows++;
		fprintf(stderr, "shardbench world: %llu bytes measured\n",
			(unsigned long long)w.bytes);
	}
	world_stop(pid);
	for (uint32_t k = 0; k < w.nodes; k++)
		bench_daemon_stop(&w.plain[k]);
	world_mpi_runs(o, &w, again);
	for (int m = 0; m < MPI_TABLES; m++)
		world_mpi_merge(&mpi[m], &again[m]);
	world_print(&w, rows, nrows, mpi);
	for (size_t i = 0; i < nrows; i++)
		for (int k = 0; k < WORLD_KINDS; k++)
			if (rows[i].wrong[k][0] || rows[i].wrong[k][1])
				ret = 1;
	if (world_failed(&w))
		ret = 1;
out:
	for (uint32_t k = 0; w.plain && k < w.nodes; k++)
		bench_daemon_stop(&w.plain[k]);
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
	for (int m = 0; m < MPI_TABLES; m++) {
		bench_mpi_free(&mpi[m]);
		bench_mpi_free(&again[m]);
	}
	pthread_barrier_destroy(&w.bar);
	pthread_mutex_destroy(&w.lock);
	free(w.t0);
	free(w.t1);
	free(w.plain);
	free(wr);
	free(th);
	free(rows);
	return ret;
}
