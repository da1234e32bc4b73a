/* SPDX-License-Identifier: MIT */
/*
 * shardbench: how fast shardd moves parameters, in nccl-tests' format.
 *
 *   shardbench [options] roofline|unshard|reduce|ring|latency|reduce-step|gpu|step|all
 *
 * Without --socket it starts its own `shardd` (next to this binary, or
 * --shardd PATH) on a temporary socket and stops it at the end. Every
 * benchmark checks its results (#wrong). docs/BENCHMARKS.md explains the
 * tables.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"

/* Roofline arrays: 8x the 32 MiB L3 of the machines this runs on, and over any L3 we know. */
#define ROOF_ARRAY_BYTES (256 * BENCH_MIB)

enum bench_cmd {
	CMD_ALL,
	CMD_ROOFLINE,
	CMD_UNSHARD,
	CMD_REDUCE,
	CMD_RING,
	CMD_GPU,
	CMD_STEP,
	CMD_LATENCY,
	CMD_REDUCE_STEP,
	CMD_CHECKPOINT,
	CMD_WORLD
};

static void usage(FILE *f)
{
	fprintf(f,
		"usage: shardbench [options] roofline|unshard|reduce|ring|latency|reduce-step|gpu|step|checkpoint|world|all\n"
		"       (default: all)\n"
		"\n"
		"  roofline   memory kernels (read, write, copy, add), plain and non-temporal stores\n"
		"  unshard    all-gather + cast through the daemon, against its pattern's roofline and\n"
		"             MPI_Allgather\n"
		"  reduce     reduce-scatter of grads, against its pattern's roofline and\n"
		"             MPI_Reduce_scatter_block\n"
		"  ring       nop round trip through the ring (spinning, sleeping) against a socket\n"
		"  latency    one small unshard and reduce (-b bytes), per stage, from the clients\n"
		"  gpu        CUDA kernels against cudaMemcpy device-to-device, and unshard/reduce\n"
		"             latency through shardd --backend cuda (also: --gpu)\n"
		"  reduce-step  a reduce with SHARDD_REDUCE_STEP (the fused reduce-and-step) against\n"
		"             reduce then step, AdamW on fp32 params, through the daemon\n"
		"  step       AdamW and SGD updates against a same-run roofline and torch's CPU AdamW\n"
		"             (fused, foreach and single-tensor, those the --torch PYTHON has)\n"
		"  checkpoint save and restore of an AdamW state through the daemon (docs/CHECKPOINTS.md)\n"
		"             against O_DIRECT write and read of the same bytes (-b 256M -e 8G: the\n"
		"             issue's sweep; --dir DIR: where, default /var/tmp; --torch PYTHON:\n"
		"             also torch.distributed.checkpoint through tools/bench_dcp.py)\n"
		"  world      HSDP reduce, FSDP unshard and reduce across --nodes daemons under\n"
		"             mpirun (-r ranks each): the inter-node part against MPI_Allreduce,\n"
		"             MPI_Allgather, MPI_Reduce_scatter_block among the daemons, the whole\n"
		"             op against MPI among all ranks (docs/MULTINODE.md)\n"
		"  all        roofline, unshard, reduce, ring (and gpu when built with CUDA)\n"
		"\n"
		"  -b SIZE        first size (default 1M); K, M, G suffixes\n"
		"  -e SIZE        last size (default 256M; the full sweep is -e 1G)\n"
		"  -f FACTOR      size multiplication factor (default 2)\n"
		"  -w N           warm-up iterations per size (default 1)\n"
		"  -n N           timed iterations per size (default 5; ring: samples; latency:\n"
		"                 samples per op, default 1000, so that p99 is the 10th largest\n"
		"                 sample and not the maximum; reduce-step: default 20, a median)\n"
		"  -c 0|1         check every result (default 1)\n"
		"  -d DTYPE       param_dtype: fp32, bf16 or fp16 (default bf16; shards are fp32)\n"
		"  -r N           rank processes: 1, 2, 4 or 8 (default 2)\n"
		"  --socket PATH  use the daemon listening there instead of starting one\n"
		"  --shardd PATH  daemon binary to start (default: shardd next to shardbench)\n"
		"  --mpi PATH     Open MPI comparator (default: shardbench_mpi next to shardbench)\n"
		"  --idle-us N    ring: idle gap before each sleeping sample (default 2000)\n"
		"  --exec MODE    unshard, reduce, latency: who moves the bytes (docs/DESIGN.md,\n"
		"                 \"Who moves the bytes\"): daemon, ranks, auto (the daemon's\n"
		"                 --rank-exec-max picks), or both: daemon, then ranks, in one\n"
		"                 run (default both)\n"
		"  --nodes N      world: daemons under mpirun, 2 to 8 (default 2)\n"
		"  --trace FILE   latency: also write every sample to FILE (trace_latency.py)\n"
		"  --dir DIR      checkpoint: the folder whose disk is measured (default /var/tmp)\n"
		"  --checkpoint-rate MBPS  checkpoint: start the daemon with --checkpoint-rate MBPS\n"
		"                 (a snapshot's write at most MBPS MB/s; default: the disk's speed)\n"
		"  --torch PYTHON checkpoint: compare with torch.distributed.checkpoint run by\n"
		"                 PYTHON (needs torch >= 2.4; default: $SHARDBENCH_TORCH, else none);\n"
		"                 step: the interpreter whose torch.optim.AdamW is timed (default:\n"
		"                 $SHARDBENCH_TORCH, else /usr/bin/python3, else python3 on PATH)\n"
		"  --gpu          same as the gpu subcommand\n"
		"  --load         gpu: also time unshard and reduce beside a trainer-like compute\n"
		"                 load in the rank processes (every SM busy ~1.5 ms per launch),\n"
		"                 and report the load's throughput during them\n"
		"  --version      print the version and exit\n"
		"  -h, --help     this text\n");
}

static int parse_int(const char *s, int lo, int hi, int *out)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < lo || v > hi)
		return -EINVAL;
	*out = (int)v;
	return 0;
}

static int parse_dtype(const char *s, uint32_t *out)
{
	uint32_t d;

	for (d = SHARDD_DTYPE_FP32; d < SHARDD_DTYPE_COUNT; d++) {
		if (!strcmp(s, shardd_dtype_name(d))) {
			*out = d;
			return 0;
		}
	}
	return -EINVAL;
}

static int bad_option(const char *opt, const char *value, const char *want)
{
	fprintf(stderr, "shardbench: %s %s: expected %s (see --help)\n", opt, value, want);
	return 2;
}

static int parse_cmd(const char *s, enum bench_cmd *cmd)
{
	static const struct {
		const char *name;
		enum bench_cmd cmd;
	} cmds[] = {
		{ "all", CMD_ALL },
		{ "roofline", CMD_ROOFLINE },
		{ "unshard", CMD_UNSHARD },
		{ "reduce", CMD_REDUCE },
		{ "ring", CMD_RING },
		{ "gpu", CMD_GPU },
		{ "step", CMD_STEP },
		{ "latency", CMD_LATENCY },
		{ "reduce-step", CMD_REDUCE_STEP },
		{ "checkpoint", CMD_CHECKPOINT },
		{ "world", CMD_WORLD },
	};
	size_t i;

	for (i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
		if (!strcmp(s, cmds[i].name)) {
			*cmd = cmds[i].cmd;
			return 0;
		}
	}
	return -EINVAL;
}

/* Parse argv into *o and *cmd. Returns 0, 1 (--help or --version printed) or 2 (usage error). */
static int parse_args(int argc, char **argv, struct bench_opts *o, enum bench_cmd *cmd)
{
	enum {
		OPT_SOCKET = 256,
		OPT_SHARDD,
		OPT_MPI,
		OPT_IDLE,
		OPT_GPU,
		OPT_VERSION,
		OPT_TRACE,
		OPT_DIR,
		OPT_NODES,
		OPT_TORCH,
		OPT_CKPT_RATE,
		OPT_LOAD,
		OPT_EXEC
	};
	static const struct option longopts[] = {
		{ "socket", required_argument, NULL, OPT_SOCKET },
		{ "shardd", required_argument, NULL, OPT_SHARDD },
		{ "mpi", required_argument, NULL, OPT_MPI },
		{ "idle-us", required_argument, NULL, OPT_IDLE },
		{ "gpu", no_argument, NULL, OPT_GPU },
		{ "trace", required_argument, NULL, OPT_TRACE },
		{ "dir", required_argument, NULL, OPT_DIR },
		{ "nodes", required_argument, NULL, OPT_NODES },
		{ "torch", required_argument, NULL, OPT_TORCH },
		{ "checkpoint-rate", required_argument, NULL, OPT_CKPT_RATE },
		{ "load", no_argument, NULL, OPT_LOAD },
		{ "exec", required_argument, NULL, OPT_EXEC },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, OPT_VERSION },
		{ NULL, 0, NULL, 0 },
	};
	int c, v, gpu = 0;

	while ((c = getopt_long(argc, argv, "b:e:f:w:n:c:d:r:h", longopts, NULL)) != -1) {
		switch (c) {
		case 'b':
			if (bench_parse_size(optarg, &o->min_bytes))
				return bad_option("-b", optarg, "a size such as 1M");
			break;
		case 'e':
			if (bench_parse_size(optarg, &o->max_bytes))
				return bad_option("-e", optarg, "a size such as 1G");
			break;
		case 'f':
			if (parse_int(optarg, 2, 1 << 20, &v))
				return bad_option("-f", optarg, "an integer factor >= 2");
			o->factor = (uint64_t)v;
			break;
		case 'w':
			if (parse_int(optarg, 0, 1000000, &o->warmup))
				return bad_option("-w", optarg, "a count >= 0");
			break;
		case 'n':
			if (parse_int(optarg, 1, 10000000, &o->iters))
				return bad_option("-n", optarg, "a count >= 1");
			o->iters_set = 1;
			break;
		case 'c':
			if (parse_int(optarg, 0, 1, &o->check))
				return bad_option("-c", optarg, "0 or 1");
			break;
		case 'd':
			if (parse_dtype(optarg, &o->dtype))
				return bad_option("-d", optarg, "fp32, bf16 or fp16");
			break;
		case 'r':
			if (parse_int(optarg, 1, 8, &v) || (v & (v - 1)))
				return bad_option("-r", optarg, "1, 2, 4 or 8");
			o->ranks = (uint32_t)v;
			break;
		case OPT_NODES:
			if (parse_int(optarg, 2, 8, &v))
				return bad_option("--nodes", optarg, "2 to 8");
			o->nodes = (uint32_t)v;
			break;
		case OPT_SOCKET:
			o->socket_path = optarg;
			break;
		case OPT_SHARDD:
			o->shardd_path = optarg;
			break;
		case OPT_MPI:
			o->mpi_path = optarg;
			break;
		case OPT_IDLE:
			if (parse_int(optarg, 0, 10000000, &v))
				return bad_option("--idle-us", optarg, "microseconds >= 0");
			o->idle_us = (uint64_t)v;
			break;
		case OPT_GPU:
			gpu = 1;
			break;
		case OPT_EXEC:
			if (!strcmp(optarg, "both")) {
				o->execs[0] = SHARDD_EXEC_DAEMON;
				o->execs[1] = SHARDD_EXEC_RANKS;
				o->nexecs = 2;
				break;
			}
			o->nexecs = 1;
			for (o->execs[0] = 0; o->execs[0] < SHARDD_EXEC_COUNT; o->execs[0]++)
				if (!strcmp(optarg, shardd_exec_name(o->execs[0])))
					break;
			if (o->execs[0] == SHARDD_EXEC_COUNT)
				return bad_option("--exec", optarg, "daemon, ranks, auto or both");
			break;
		case OPT_LOAD:
			o->load = 1;
			break;
		case OPT_DIR:
			o->ckpt_dir = optarg;
			break;
		case OPT_TORCH:
			o->torch_python = optarg;
			break;
		case OPT_CKPT_RATE:
			if (parse_int(optarg, 1, 1000000, &v))
				return bad_option("--checkpoint-rate", optarg,
						  "MB/s in [1, 1000000]");
			o->ckpt_rate = (unsigned)v;
			break;
		case OPT_TRACE:
			o->trace_path = optarg;
			break;
		case 'h':
			usage(stdout);
			return 1;
		case OPT_VERSION:
			printf("shardbench %s (protocol %d.%d)\n", SHARDD_VERSION,
			       SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR);
			return 1;
		default:
			usage(stderr);
			return 2;
		}
	}
	*cmd = gpu ? CMD_GPU : CMD_ALL;
	if (optind < argc && parse_cmd(argv[optind++], cmd))
		return bad_option(
			"subcommand", argv[optind - 1],
			"roofline, unshard, reduce, ring, latency, reduce-step, gpu, step, checkpoint, world or all");
	if (optind < argc)
		return bad_option("argument", argv[optind], "one subcommand");
	if (o->min_bytes > o->max_bytes) {
		fprintf(stderr, "shardbench: -b %llu is larger than -e %llu\n",
			(unsigned long long)o->min_bytes, (unsigned long long)o->max_bytes);
		return 2;
	}
	return 0;
}

/* Directory of this binary: where make puts shardd and shardbench_mpi beside it. */
static void find_self_dir(char *buf, size_t len)
{
	char exe[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);

	if (n <= 0) {
		snprintf(buf, len, ".");
		return;
	}
	exe[n] = '\0';
	snprintf(buf, len, "%s", dirname(exe));
}

static void print_machine(const struct bench_opts *o)
{
	char model[256] = "unknown CPU", line[512];
	long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
	FILE *f = fopen("/proc/cpuinfo", "r");

	while (f && fgets(line, sizeof(line), f)) {
		char *colon = strchr(line, ':');

		if (!strncmp(line, "model name", 10) && colon) {
			snprintf(model, sizeof(model), "%s", colon + 2);
			model[strcspn(model, "\n")] = '\0';
			break;
		}
	}
	if (f)
		fclose(f);
	printf("# shardbench: %s, %u online cores, %.1f GiB memory; ranks %u, dtype %s\n", model,
	       bench_worker_threads(), (double)pages * (double)psize / (double)BENCH_GIB, o->ranks,
	       shardd_dtype_name(o->dtype));
}

int main(int argc, char **argv)
{
	struct bench_opts o = {
		.min_bytes = BENCH_MIB,
		.max_bytes = 256 * BENCH_MIB,
		.factor = 2,
		.warmup = 1,
		.iters = 5,
		.check = 1,
		.dtype = SHARDD_DTYPE_BF16,
		.ranks = 2,
		.idle_us = 2000,
		.nodes = 2,
		.execs = { SHARDD_EXEC_DAEMON, SHARDD_EXEC_RANKS },
		.nexecs = 2,
	};
	struct bench_daemon d = { 0 };
	struct bench_roofline roof = { 0 };
	char self_dir[PATH_MAX], shardd_default[PATH_MAX + 16];
	const char *socket_path;
	enum bench_cmd cmd;
	int ret, rc, failed = 0;

	ret = parse_args(argc, argv, &o, &cmd);
	if (ret)
		return ret == 1 ? 0 : ret;
	find_self_dir(self_dir, sizeof(self_dir));
	o.self_dir = self_dir;
	snprintf(shardd_default, sizeof(shardd_default), "%s/shardd", self_dir);
	if (!o.shardd_path)
		o.shardd_path = shardd_default;

	print_machine(&o);
	if (cmd == CMD_GPU) {
		/* The ops table forks CUDA ranks: it runs before this process touches CUDA. */
		failed = bench_gpu_ops_run(&o) != 0;
		failed |= bench_gpu_run(&o) != 0;
		return failed;
	}

	/* The world starts its own daemons under mpirun. */
	if (cmd == CMD_WORLD)
		return bench_world_run(&o) != 0;

	/* The optimizer step needs no daemon and measures its own roofline. */
	if (cmd == CMD_STEP)
		return bench_step_run(&o) != 0;
	/* Checkpoints need a daemon of their own, with a state dir on the disk measured. */
	if (cmd == CMD_CHECKPOINT) {
		char state[PATH_MAX];

		snprintf(state, sizeof(state), "%s/shardbench-ckpt.XXXXXX",
			 o.ckpt_dir ? o.ckpt_dir : "/var/tmp");
		if (!mkdtemp(state)) {
			fprintf(stderr, "shardbench: checkpoint: mkdtemp %s: %s\n", state,
				strerror(errno));
			return 1;
		}
		ret = bench_daemon_start_state(o.shardd_path, state, o.ckpt_rate, &d);
		if (!ret) {
			if (o.ckpt_rate)
				printf("# daemon: %s --state-dir %s --checkpoint-rate %u (started by "
				       "shardbench)\n",
				       o.shardd_path, state, o.ckpt_rate);
			else
				printf("# daemon: %s --state-dir %s (started by shardbench)\n",
				       o.shardd_path, state);
			failed = bench_checkpoint_run(&o, d.socket_path, state) != 0;
			bench_daemon_stop(&d);
		}
		rmdir(state);
		return ret ? 1 : failed;
	}

	/*
	 * The machine table runs before the daemon starts, so nothing else
	 * competes for memory; unshard and reduce measure their own pattern's
	 * roofline at each size.
	 */
	if (cmd == CMD_ALL || cmd == CMD_ROOFLINE) {
		ret = bench_roofline_measure(ROOF_ARRAY_BYTES, 1, &roof);
		if (ret)
			return 1;
		if (roof.wrong)
			failed = 1;
		if (cmd == CMD_ROOFLINE)
			return failed;
	}

	socket_path = o.socket_path;
	if (!socket_path) {
		ret = bench_daemon_start(o.shardd_path, NULL, &d);
		if (ret)
			return 1;
		socket_path = d.socket_path;
		printf("# daemon: %s --socket %s (started by shardbench)\n", o.shardd_path,
		       socket_path);
	} else {
		printf("# daemon: the one on %s\n", socket_path);
	}
	fflush(stdout);

	for (uint32_t i = 0; i < o.nexecs && (cmd == CMD_ALL || cmd == CMD_UNSHARD); i++) {
		o.exec = o.execs[i];
		printf("#\n# exec: %s\n", shardd_exec_name(o.exec));
		rc = bench_collective_run(&o, BENCH_UNSHARD, socket_path);
		failed |= rc != 0;
	}
	for (uint32_t i = 0; i < o.nexecs && (cmd == CMD_ALL || cmd == CMD_REDUCE); i++) {
		o.exec = o.execs[i];
		printf("#\n# exec: %s\n", shardd_exec_name(o.exec));
		rc = bench_collective_run(&o, BENCH_REDUCE, socket_path);
		failed |= rc != 0;
	}
	for (uint32_t i = 0; i < o.nexecs && cmd == CMD_LATENCY; i++) {
		o.exec = o.execs[i];
		printf("#\n# exec: %s\n", shardd_exec_name(o.exec));
		rc = bench_latency_run(&o, socket_path, o.trace_path);
		failed |= rc != 0;
	}
	if (cmd == CMD_REDUCE_STEP) {
		rc = bench_reduce_step_run(&o, socket_path);
		failed |= rc != 0;
	}
	if (cmd == CMD_ALL || cmd == CMD_RING) {
		rc = bench_ring_run(&o, socket_path, d.pid);
		failed |= rc != 0;
	}
	bench_daemon_stop(&d);
	if (cmd == CMD_ALL) {
		failed |= bench_gpu_ops_run(&o) != 0;
		failed |= bench_gpu_run(&o) != 0;
	}
	return failed;
}
