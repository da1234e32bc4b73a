/* SPDX-License-Identifier: MIT */
#define _GNU_SOURCE
/*
 * shardd: the per-node ZeRO-3 parameter server. main() only reads the flags
 * and hands over to server.c; every global lives there, so tests can link
 * the daemon's modules without this file.
 */
#include <errno.h>
#include <grp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend_cuda.h"
#include "memlimit.h"
#include "log.h"
#include "metrics_http.h"
#include "server.h"
#include "shardd_socket.h"
#include "world.h"

/* --world mpi and --internode-dtype (world.h): the daemon world, outside shd_config. */
static int world_mpi;
static uint32_t internode_dtype = SHD_INTERNODE_FP32;

static void usage(FILE *f)
{
	char def[sizeof(((struct shd_config *)0)->socket_path)];

	shardd_socket_path_default(def, sizeof(def));
	fprintf(f,
		"Usage: shardd [OPTIONS]\n"
		"Per-node ZeRO-3 (FSDP2) parameter server: trainer processes attach over a Unix\n"
		"socket and a shared-memory ring and run unshard/reduce/reshard through it.\n"
		"\n"
		"shardd always runs in the foreground and logs to stderr: run it under systemd\n"
		"or another supervisor. It prints 'shardd: ready on PATH' once it accepts clients,\n"
		"and shuts down cleanly on SIGTERM or SIGINT. Under systemd socket activation\n"
		"(LISTEN_FDS=1, see shardd.socket) it serves the socket passed as fd 3.\n"
		"\n"
		"Options:\n"
		"  --socket PATH              listen on PATH (default %s;\n"
		"                             $XDG_RUNTIME_DIR/shardd/shardd.sock, else\n"
		"                             /run/shardd/shardd.sock)\n"
		"  --backend host|cuda        where buffers live (default host)\n"
		"  --cuda-export auto|fd|ipc  how the cuda backend hands buffers to trainers:\n"
		"                             fd (virtual memory API, POSIX file descriptors),\n"
		"                             ipc (cudaMalloc, legacy CUDA IPC handles), or\n"
		"                             auto: fd where the device supports it, else ipc,\n"
		"                             chosen per device (default auto; --backend cuda only)\n"
		"  --collective-timeout SECS  fail a collective or barrier that waits longer\n"
		"                             than SECS, naming the missing ranks (default %g)\n"
		"  --handshake-timeout SECS   close a connection that sent no complete message\n"
		"                             (HELLO or an admin request) within SECS of\n"
		"                             connecting (default %g)\n"
		"  --job-linger SECS          end a job that has had no attached rank for SECS\n"
		"                             and free its memory; a rank that re-attaches\n"
		"                             before then keeps it (default %g; 0 = never)\n"
		"  --workers N                engine worker threads (default: online cores)\n"
		"  --allow-gid GID            also accept clients of group GID (number or name;\n"
		"                             repeatable); by default only shardd's own uid\n"
		"  --socket-mode MODE         octal mode of the socket (default 0660 with\n"
		"                             --allow-gid, else 0600); its directory, when\n"
		"                             shardd creates it, gets search for the same classes\n"
		"                             (0750 for 0660)\n"
		"  --socket-group GROUP       group of the socket and of the directory shardd\n"
		"                             creates (number or name; default: the first\n"
		"                             --allow-gid)\n"
		"  --metrics-listen [ADDR:]PORT  serve Prometheus text on http://ADDR:PORT/metrics\n"
		"                             (ADDR defaults to 127.0.0.1; [::1]:PORT for IPv6)\n"
		"  --max-memory BYTES         bytes of parameter-group buffers all jobs together\n"
		"                             may hold (suffix K, M, G or T: powers of 1024).\n"
		"                             A registration past it is refused, naming the\n"
		"                             job, the group and the bytes; buffers are\n"
		"                             committed at registration, so running out is a\n"
		"                             refusal, never an OOM kill (default %d%% of the\n"
		"                             physical memory, or of the daemon's cgroup limit,\n"
		"                             v2 memory.max or v1 memory.limit_in_bytes, when\n"
		"                             one is set and lower; host backend only)\n"
		"  --max-job-memory BYTES     the same limit for one job's buffers\n"
		"                             (default: --max-memory)\n"
		"  --state-dir DIR            keep each job's checkpoints in DIR/JOB/step-N\n"
		"                             (the checkpoint op; docs/CHECKPOINTS.md)\n"
		"  --import-dir DIR           a client of another uid (let in by --allow-gid)\n"
		"                             may restore from checkpoints and weights under\n"
		"                             DIR (repeatable, at most %d); by default only\n"
		"                             from under --state-dir\n"
		"  --checkpoint-every STEPS   also checkpoint every job into --state-dir at each\n"
		"                             step boundary that is a multiple of STEPS\n"
		"  --keep N                   keep the newest N checkpoints of each job in\n"
		"                             --state-dir, removing older ones (default 0: all)\n"
		"  --world mpi                one daemon per node started by mpirun or srun\n"
		"                             (MPI rank = node index); jobs may span the nodes\n"
		"                             (docs/MULTINODE.md)\n"
		"  --internode-dtype fp32|reduce  how HSDP partials travel between nodes\n"
		"                             (default fp32; reduce: the group's reduce dtype)\n"
		"  --log-level LEVEL          error, warn, info or debug (default info)\n"
		"  --foreground               accepted for supervisors; shardd never daemonizes\n"
		"  --version                  print the version and exit\n"
		"  --help                     print this help and exit\n",
		def, SHD_TIMEOUT_DEFAULT_S, SHD_HANDSHAKE_TIMEOUT_DEFAULT_S,
		SHD_JOB_LINGER_DEFAULT_S, SHD_MAX_MEMORY_DEFAULT_PERCENT, SHD_MAX_IMPORT_DIRS);
}

#define WORKERS_MAX 4096 /* --workers */

/* Print "shardd: <message>" and a pointer to --help; returns the exit status 2. */
static int __attribute__((format(printf, 1, 2))) usage_error(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "shardd: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\nTry 'shardd --help'.\n");
	return 2;
}

/* Parse a decimal unsigned in [lo, hi]. 0 or -1. */
static int parse_uint(const char *s, unsigned long lo, unsigned long hi, unsigned long *out)
{
	char *end;
	unsigned long v;

	if (!*s || *s == '-' || *s == '+')
		return -1;
	errno = 0;
	v = strtoul(s, &end, 10);
	if (errno || *end || v < lo || v > hi)
		return -1;
	*out = v;
	return 0;
}

/* A gid as a number or a group name. 0 or -1. */
static int parse_gid(const char *s, gid_t *out)
{
	unsigned long v;
	struct group *g;

	if (parse_uint(s, 0, (gid_t)-1 - 1, &v) == 0) {
		*out = (gid_t)v;
		return 0;
	}
	g = getgrnam(s);
	if (!g)
		return -1;
	*out = g->gr_gid;
	return 0;
}

/* A timeout flag's value: seconds in (0, SHD_TIMEOUT_MAX_S]. 0, or 2 after a usage error. */
static int parse_seconds(const char *flag, const char *val, double *out)
{
	char *end;
	double t;

	errno = 0;
	t = strtod(val, &end);
	if (errno || end == val || *end || !(t > 0) || t > SHD_TIMEOUT_MAX_S)
		return usage_error("%s: '%s' is not a number of seconds in (0, %g]", flag, val,
				   SHD_TIMEOUT_MAX_S);
	*out = t;
	return 0;
}

/*
 * Apply one flag with its value (NULL for flags without). 0, or 2 after a
 * usage error. *cuda_export_given is set when --cuda-export is seen.
 */
static int apply_flag(struct shd_config *cfg, const char *flag, const char *val,
		      int *cuda_export_given)
{
	unsigned long v;

	if (strcmp(flag, "--socket") == 0) {
		if (!*val)
			return usage_error("%s: the path is empty", flag);
		if (strlen(val) >= sizeof(cfg->socket_path))
			return usage_error("--socket: the path is longer than %zu bytes: %s",
					   sizeof(cfg->socket_path) - 1, val);
		snprintf(cfg->socket_path, sizeof(cfg->socket_path), "%s", val);
	} else if (strcmp(flag, "--log-level") == 0) {
		int level = shd_log_level_parse(val);

		if (level < 0)
			return usage_error("--log-level: '%s' is not one of error, warn, info, debug",
					   val);
		cfg->log_level = level;
	} else if (strcmp(flag, "--backend") == 0) {
		if (strcmp(val, "host") == 0)
			cfg->backend = SHARDD_BACKEND_HOST;
		else if (strcmp(val, "cuda") == 0)
			cfg->backend = SHARDD_BACKEND_CUDA;
		else
			return usage_error("--backend: '%s' is not one of host, cuda", val);
	} else if (strcmp(flag, "--cuda-export") == 0) {
		if (strcmp(val, "auto") == 0)
			cfg->cuda_export = SHD_CUDA_EXPORT_AUTO;
		else if (strcmp(val, "fd") == 0)
			cfg->cuda_export = SHD_CUDA_EXPORT_FD;
		else if (strcmp(val, "ipc") == 0)
			cfg->cuda_export = SHD_CUDA_EXPORT_IPC;
		else
			return usage_error("--cuda-export: '%s' is not one of auto, fd, ipc", val);
		*cuda_export_given = 1;
	} else if (strcmp(flag, "--collective-timeout") == 0) {
		return parse_seconds(flag, val, &cfg->collective_timeout_s);
	} else if (strcmp(flag, "--handshake-timeout") == 0) {
		return parse_seconds(flag, val, &cfg->handshake_timeout_s);
	} else if (strcmp(flag, "--workers") == 0) {
		if (parse_uint(val, 1, WORKERS_MAX, &v) < 0)
			return usage_error("--workers: '%s' is not a thread count in [1, %d]", val,
					   WORKERS_MAX);
		cfg->workers = (unsigned)v;
	} else if (strcmp(flag, "--allow-gid") == 0) {
		gid_t gid;

		if (parse_gid(val, &gid) < 0)
			return usage_error("--allow-gid: '%s' is neither a gid nor a group "
					   "name", val);
		if (cfg->nallow_gids == SHD_MAX_ALLOW_GIDS)
			return usage_error("--allow-gid: more than %d groups (at '%s')",
					   SHD_MAX_ALLOW_GIDS, val);
		cfg->allow_gids[cfg->nallow_gids++] = gid;
	} else if (strcmp(flag, "--max-memory") == 0 || strcmp(flag, "--max-job-memory") == 0) {
		uint64_t bytes;

		if (shd_memlimit_parse(val, &bytes) < 0 || bytes == 0)
			return usage_error("%s: '%s' is not a byte count above 0 (digits, then "
					   "optionally K, M, G or T)", flag, val);
		if (strcmp(flag, "--max-memory") == 0)
			cfg->max_memory = bytes;
		else
			cfg->max_job_memory = bytes;
	} else if (strcmp(flag, "--job-linger") == 0) {
		char *end;
		double t;

		errno = 0;
		t = strtod(val, &end);
		if (errno || end == val || *end || !(t >= 0) || t > SHD_JOB_LINGER_MAX_S)
			return usage_error("--job-linger: '%s' is not a number of seconds in [0, %g] "
					   "(0 keeps a job without ranks forever)", val,
					   SHD_JOB_LINGER_MAX_S);
		cfg->job_linger_s = t;
	} else if (strcmp(flag, "--socket-mode") == 0) {
		char *end;

		errno = 0;
		v = strtoul(val, &end, 8);
		if (errno || end == val || *end || *val == '-' || *val == '+' || v > 0777 ||
		    (v & 0600) != 0600)
			return usage_error("--socket-mode: '%s' is not an octal mode in [0600, 0777] "
					   "that keeps the owner's rw (e.g. 0660)", val);
		cfg->socket_mode = (unsigned)v;
	} else if (strcmp(flag, "--socket-group") == 0) {
		if (parse_gid(val, &cfg->socket_group) < 0)
			return usage_error("--socket-group: '%s' is neither a gid nor a group name",
					   val);
		cfg->socket_group_set = 1;
	} else if (strcmp(flag, "--metrics-listen") == 0) {
		char host[128], port[16], why[256];

		if (strlen(val) >= sizeof(cfg->metrics_listen) ||
		    shd_metrics_http_parse(val, host, sizeof(host), port, sizeof(port), why,
					      sizeof(why)) < 0)
			return usage_error("--metrics-listen %s", strlen(val) >=
					   sizeof(cfg->metrics_listen) ? "is too long" : why);
		snprintf(cfg->metrics_listen, sizeof(cfg->metrics_listen), "%s", val);
	} else if (strcmp(flag, "--state-dir") == 0) {
		if (!val[0] || strlen(val) >= sizeof(cfg->state_dir) - 200)
			return usage_error("--state-dir: '%.64s' is empty or longer than %zu bytes", val,
					   sizeof(cfg->state_dir) - 201);
		snprintf(cfg->state_dir, sizeof(cfg->state_dir), "%s", val);
	} else if (strcmp(flag, "--import-dir") == 0) {
		struct stat st;
		char *real;

		if (cfg->nimport_dirs == SHD_MAX_IMPORT_DIRS)
			return usage_error("--import-dir: more than %d directories (at '%s')",
					   SHD_MAX_IMPORT_DIRS, val);
		/* Resolved now: a restore path is checked against where DIR really is. */
		real = val[0] ? realpath(val, NULL) : NULL;
		if (!real || stat(real, &st) || !S_ISDIR(st.st_mode)) {
			int err = !val[0] ? ENOENT : real ? ENOTDIR : errno;

			free(real);
			return usage_error("--import-dir: '%s' is not a directory (%s); create it or "
					   "name an existing one", val, strerror(err));
		}
		cfg->import_dirs[cfg->nimport_dirs++] = real;
	} else if (strcmp(flag, "--checkpoint-every") == 0) {
		char *end;

		errno = 0;
		v = strtoul(val, &end, 10);
		if (errno || end == val || *end || *val == '-' || v == 0 || v > UINT32_MAX)
			return usage_error("--checkpoint-every: '%s' is not a step count in [1, %u]", val,
					   UINT32_MAX);
		cfg->checkpoint_every = (uint32_t)v;
	} else if (strcmp(flag, "--keep") == 0) {
		char *end;

		errno = 0;
		v = strtoul(val, &end, 10);
		if (errno || end == val || *end || *val == '-' || v > 1000000)
			return usage_error("--keep: '%s' is not a count in [0, 1000000] (0 keeps every "
					   "checkpoint)", val);
		cfg->keep = (uint32_t)v;
	} else if (strcmp(flag, "--world") == 0) {
		if (strcmp(val, "mpi") != 0)
			return usage_error("--world: '%s' is not mpi (the only world there is)", val);
		world_mpi = 1;
	} else if (strcmp(flag, "--internode-dtype") == 0) {
		if (strcmp(val, "fp32") == 0)
			internode_dtype = SHD_INTERNODE_FP32;
		else if (strcmp(val, "reduce") == 0)
			internode_dtype = SHD_INTERNODE_REDUCE;
		else
			return usage_error("--internode-dtype: '%s' is not one of fp32, reduce", val);
	} else if (strcmp(flag, "--foreground") == 0) {
		/* shardd never forks into the background; the flag is for supervisors' habits. */
	} else {
		return usage_error("unknown flag '%s'", flag);
	}
	return 0;
}

/* Flags that take a value, as "--flag VALUE" or "--flag=VALUE". */
static int takes_value(const char *flag)
{
	static const char *const with_value[] = {
		"--socket", "--log-level", "--backend", "--cuda-export", "--collective-timeout",
		"--handshake-timeout", "--workers", "--allow-gid", "--job-linger", "--socket-mode",
		"--socket-group", "--metrics-listen", "--max-memory", "--max-job-memory",
		"--state-dir", "--keep", "--checkpoint-every", "--import-dir",
		"--world", "--internode-dtype",
	};

	for (size_t i = 0; i < sizeof(with_value) / sizeof(with_value[0]); i++)
		if (strcmp(flag, with_value[i]) == 0)
			return 1;
	return 0;
}

/*
 * Raise the soft RLIMIT_NOFILE to the hard one: every buffer of every group
 * is a descriptor the daemon holds, counted against this limit at
 * registration (registry.c), and a login shell's soft 1024 would refuse a
 * model of a few dozen groups. A limit set on purpose stays: `ulimit -n N`
 * and systemd's LimitNOFILE= set the hard limit too.
 */
static void raise_fd_limit(void)
{
	struct rlimit rl;
	rlim_t was;

	if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == rl.rlim_max)
		return;
	was = rl.rlim_cur;
	rl.rlim_cur = rl.rlim_max;
	if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
		shd_log_warn("cannot raise the descriptor limit (RLIMIT_NOFILE) from %llu to %llu: %s",
			     (unsigned long long)was, (unsigned long long)rl.rlim_max, strerror(errno));
	else
		shd_log_info("raised the descriptor limit (RLIMIT_NOFILE) from %llu to its hard limit %llu",
			     (unsigned long long)was, (unsigned long long)rl.rlim_max);
}

int main(int argc, char **argv)
{
	/* Static: the --import-dir strings it holds stay reachable on every way out. */
	static struct shd_config cfg;
	int cuda_export_given = 0, ret;

	shd_config_defaults(&cfg);
	for (int i = 1; i < argc; i++) {
		char flag[64];
		const char *arg = argv[i], *val = NULL, *eq;

		if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
			usage(stdout);
			return 0;
		}
		if (strcmp(arg, "--version") == 0) {
			printf("shardd %s (protocol %d.%d, backends: host%s)\n", SHARDD_VERSION,
			       SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR,
#ifdef SHARDD_HAVE_CUDA
			       ", cuda"
#else
			       ""
#endif
			       );
			return 0;
		}
		if (strncmp(arg, "--", 2) != 0)
			return usage_error("unexpected argument '%s'", arg);
		eq = strchr(arg, '=');
		if (eq && (size_t)(eq - arg) < sizeof(flag)) {
			snprintf(flag, sizeof(flag), "%.*s", (int)(eq - arg), arg);
			val = eq + 1;
		} else {
			snprintf(flag, sizeof(flag), "%s", arg);
		}
		if (takes_value(flag)) {
			if (!val) {
				if (i + 1 >= argc)
					return usage_error("%s needs a value", flag);
				val = argv[++i];
			}
		} else if (val) {
			if (strcmp(flag, "--foreground") == 0)
				return usage_error("%s takes no value", flag);
			return usage_error("unknown flag '%s'", arg);
		}
		ret = apply_flag(&cfg, flag, val, &cuda_export_given);
		if (ret)
			return ret;
	}
	/* Flags come in any order: only now is the backend known. */
	if (cuda_export_given && cfg.backend != SHARDD_BACKEND_CUDA)
		return usage_error("--cuda-export applies to --backend cuda only; the backend is %s",
				   shd_backend_name(cfg.backend));

#ifndef SHARDD_HAVE_CUDA
	if (cfg.backend == SHARDD_BACKEND_CUDA) {
		fprintf(stderr, "shardd: --backend cuda: this shardd was built without CUDA "
			"(rebuild where nvcc and NCCL are installed, e.g. make CUDA=1), or use "
			"--backend host\n");
		return 1;
	}
#endif
	raise_fd_limit();
	if (world_mpi) {
		char why[320];

		if (shd_world_start(internode_dtype, why, sizeof(why)) < 0) {
			fprintf(stderr, "shardd: --world mpi: %s (start one daemon per node with "
				"mpirun -np NODES --map-by ppr:1:node shardd --world mpi, or srun)\n", why);
			return 1;
		}
	}
	ret = shd_server_init(&cfg);
	if (ret < 0) {
		shd_server_shutdown();
		shd_world_stop();
		return 1;
	}
	ret = shd_server_run();
	shd_world_stop();
	/* Open MPI's destructors could wait for the thread a dead world parked inside it (world.h). */
	if (shd_world_dead(NULL, 0)) {
		fflush(NULL);
		_exit(ret);
	}
	return ret;
}
