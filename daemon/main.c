/* SPDX-License-Identifier: MIT */
#define _GNU_SOURCE
/*
 * shardd: the per-node ZeRO-3 parameter server. main() only reads the flags
 * and hands over to server.c; every global lives there, so tests can link
 * the daemon's modules without this file.
 */
#include <errno.h>
#include <getopt.h>
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

/* ------------------------------------------------------------------ */
/* Flags                                                               */
/* ------------------------------------------------------------------ */

/* getopt_long's answer for each flag: past every char, so none is taken for a short option. */
enum flag_id {
	FLAG_SOCKET = 256,
	FLAG_BACKEND,
	FLAG_CUDA_EXPORT,
	FLAG_MPS_SM_PERCENT,
	FLAG_COLLECTIVE_TIMEOUT,
	FLAG_HANDSHAKE_TIMEOUT,
	FLAG_JOB_LINGER,
	FLAG_WORKERS,
	FLAG_ALLOW_GID,
	FLAG_SOCKET_MODE,
	FLAG_SOCKET_GROUP,
	FLAG_METRICS_LISTEN,
	FLAG_MAX_MEMORY,
	FLAG_MAX_JOB_MEMORY,
	FLAG_RANK_EXEC_MAX,
	FLAG_STATE_DIR,
	FLAG_IMPORT_DIR,
	FLAG_CHECKPOINT_EVERY,
	FLAG_KEEP,
	FLAG_CHECKPOINT_RATE,
	FLAG_WORLD,
	FLAG_INTERNODE_DTYPE,
	FLAG_LOG_LEVEL,
	FLAG_FOREGROUND,
	FLAG_VERSION,
	FLAG_HELP = 'h', /* also -h */
};

/* One flag of the command line: getopt_long's row of it, and its --help entry. */
struct flag {
	const char *name;  /* after the "--" */
	int id;            /* enum flag_id */
	const char *value; /* the value's name in --help; NULL: the flag takes none */
	double dflt;       /* the number a "%g" in `help` stands for */
	const char *help;  /* --help's text, one line a "\n"; --socket's "%s" is its default path */
};

/* Every flag and what it means, in --help's order: --help prints this table. */
static const struct flag flags[] = {
	{ "socket", FLAG_SOCKET, "PATH", 0,
	  "listen on PATH (default %s;\n"
	  "$XDG_RUNTIME_DIR/shardd/shardd.sock, else\n"
	  "/run/shardd/shardd.sock)" },
	{ "backend", FLAG_BACKEND, "host|cuda", 0, "where buffers live (default host)" },
	{ "cuda-export", FLAG_CUDA_EXPORT, "auto|fd|ipc", 0,
	  "how the cuda backend hands buffers to trainers:\n"
	  "fd (virtual memory API, POSIX file descriptors),\n"
	  "ipc (cudaMalloc, legacy CUDA IPC handles), or\n"
	  "auto: fd where the device supports it, else ipc,\n"
	  "chosen per device (default auto; --backend cuda only)" },
	{ "mps-sm-percent", FLAG_MPS_SM_PERCENT, "PCT", 0,
	  "under MPS, the share of each GPU's SMs the daemon's\n"
	  "kernels may use, 1 to 100: sets its own\n"
	  "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE before CUDA starts\n"
	  "(default: the environment's, else uncapped;\n"
	  "--backend cuda only; docs/CUDA.md)" },
	{ "collective-timeout", FLAG_COLLECTIVE_TIMEOUT, "SECS", SHD_TIMEOUT_DEFAULT_S,
	  "fail a collective or barrier that waits longer\n"
	  "than SECS, naming the missing ranks (default %g)" },
	{ "handshake-timeout", FLAG_HANDSHAKE_TIMEOUT, "SECS", SHD_HANDSHAKE_TIMEOUT_DEFAULT_S,
	  "close a connection that sent no complete message\n"
	  "(HELLO or an admin request) within SECS of\n"
	  "connecting (default %g)" },
	{ "job-linger", FLAG_JOB_LINGER, "SECS", SHD_JOB_LINGER_DEFAULT_S,
	  "end a job that has had no attached rank for SECS\n"
	  "and free its memory; a rank that re-attaches\n"
	  "before then keeps it (default %g; 0 = never)" },
	{ "workers", FLAG_WORKERS, "N", 0, "engine worker threads (default: online cores)" },
	{ "allow-gid", FLAG_ALLOW_GID, "GID", 0,
	  "also accept clients of group GID (number or name;\n"
	  "repeatable); by default only shardd's own uid" },
	{ "socket-mode", FLAG_SOCKET_MODE, "MODE", 0,
	  "octal mode of the socket (default 0660 with\n"
	  "--allow-gid, else 0600); its directory, when\n"
	  "shardd creates it, gets search for the same classes\n"
	  "(0750 for 0660)" },
	{ "socket-group", FLAG_SOCKET_GROUP, "GROUP", 0,
	  "group of the socket and of the directory shardd\n"
	  "creates (number or name; default: the first\n"
	  "--allow-gid)" },
	{ "metrics-listen", FLAG_METRICS_LISTEN, "[ADDR:]PORT", 0,
	  "serve Prometheus text on http://ADDR:PORT/metrics\n"
	  "(ADDR defaults to 127.0.0.1; [::1]:PORT for IPv6)" },
	{ "max-memory", FLAG_MAX_MEMORY, "BYTES", SHD_MAX_MEMORY_DEFAULT_PERCENT,
	  "bytes of parameter-group buffers all jobs together\n"
	  "may hold (suffix K, M, G or T: powers of 1024).\n"
	  "A registration past it is refused, naming the\n"
	  "job, the group and the bytes; buffers are\n"
	  "committed at registration, so running out is a\n"
	  "refusal, never an OOM kill (default %g%% of the\n"
	  "physical memory, or of the daemon's cgroup limit,\n"
	  "v2 memory.max or v1 memory.limit_in_bytes, when\n"
	  "one is set and lower; host backend only)" },
	{ "max-job-memory", FLAG_MAX_JOB_MEMORY, "BYTES", 0,
	  "the same limit for one job's buffers\n"
	  "(default: --max-memory)" },
	{ "rank-exec-max", FLAG_RANK_EXEC_MAX, "BYTES", 0,
	  "a group registered exec=auto whose unsharded\n"
	  "params take at most BYTES runs rank-executed:\n"
	  "each rank moves its own bytes (host backend,\n"
	  "no HSDP, one node); 0: never (default 64K)" },
	{ "state-dir", FLAG_STATE_DIR, "DIR", 0,
	  "keep each job's checkpoints in DIR/JOB/step-N\n"
	  "(the checkpoint op; docs/CHECKPOINTS.md)" },
	{ "import-dir", FLAG_IMPORT_DIR, "DIR", SHD_MAX_IMPORT_DIRS,
	  "a client of another uid (let in by --allow-gid)\n"
	  "may restore from checkpoints and weights under\n"
	  "DIR (repeatable, at most %g); by default only\n"
	  "from under --state-dir" },
	{ "checkpoint-every", FLAG_CHECKPOINT_EVERY, "STEPS", 0,
	  "also checkpoint every job into --state-dir at each\n"
	  "step boundary that is a multiple of STEPS" },
	{ "keep", FLAG_KEEP, "N", 0,
	  "keep the newest N checkpoints of each job in\n"
	  "--state-dir, removing older ones (default 0: all)" },
	{ "checkpoint-rate", FLAG_CHECKPOINT_RATE, "MBPS", 0,
	  "write a checkpoint's snapshot, which training\n"
	  "goes on beside, at most MBPS MB/s (default 0:\n"
	  "the disk's speed)" },
	{ "world", FLAG_WORLD, "mpi", 0,
	  "one daemon per node started by mpirun or srun\n"
	  "(MPI rank = node index); jobs may span the nodes\n"
	  "(docs/MULTINODE.md)" },
	{ "internode-dtype", FLAG_INTERNODE_DTYPE, "fp32|reduce", 0,
	  "how HSDP partials travel between nodes\n"
	  "(default fp32; reduce: the group's reduce dtype)" },
	{ "log-level", FLAG_LOG_LEVEL, "LEVEL", 0, "error, warn, info or debug (default info)" },
	{ "foreground", FLAG_FOREGROUND, NULL, 0,
	  "accepted for supervisors; shardd never daemonizes" },
	{ "version", FLAG_VERSION, NULL, 0, "print the version and exit" },
	{ "help", FLAG_HELP, NULL, 0, "print this help and exit" },
};

#define NFLAGS (sizeof(flags) / sizeof(flags[0]))

/* --help's columns: where a flag's name starts, and where its text does. */
#define HELP_NAME_COL 2
#define HELP_TEXT_COL 29

static void usage(FILE *f)
{
	char def[sizeof(((struct shd_config *)0)->socket_path)];

	shardd_socket_path_default(def, sizeof(def));
	fputs("Usage: shardd [OPTIONS]\n"
	      "Per-node ZeRO-3 (FSDP2) parameter server: trainer processes attach over a Unix\n"
	      "socket and a shared-memory ring and run unshard/reduce/reshard through it.\n"
	      "\n"
	      "shardd always runs in the foreground and logs to stderr: run it under systemd\n"
	      "or another supervisor. It prints 'shardd: ready on PATH' once it accepts clients,\n"
	      "and shuts down cleanly on SIGTERM or SIGINT. Under systemd socket activation\n"
	      "(LISTEN_FDS=1, see shardd.socket) it serves the socket passed as fd 3.\n"
	      "\n"
	      "Options:\n",
	      f);
	for (const struct flag *fl = flags; fl < flags + NFLAGS; fl++) {
		char name[64], text[1024];

		snprintf(name, sizeof(name), "--%s%s%s", fl->name, fl->value ? " " : "",
			 fl->value ? fl->value : "");
		if (fl->id == FLAG_SOCKET)
			snprintf(text, sizeof(text), fl->help, def);
		else
			snprintf(text, sizeof(text), fl->help, fl->dflt);
		/* A name too long for its column pushes the first line right by the overflow. */
		fprintf(f, "%*s%-*s  ", HELP_NAME_COL, "", HELP_TEXT_COL - HELP_NAME_COL - 2, name);
		for (char *line = text, *nl; line; line = nl) {
			nl = strchr(line, '\n');
			if (nl)
				*nl++ = '\0';
			fprintf(f, "%*s%s\n", line == text ? 0 : HELP_TEXT_COL, "", line);
		}
	}
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

/* Parse a decimal unsigned in [lo, hi]. 0 or -EINVAL. */
static int parse_uint(const char *s, unsigned long lo, unsigned long hi, unsigned long *out)
{
	char *end;
	unsigned long v;

	if (!*s || *s == '-' || *s == '+')
		return -EINVAL;
	errno = 0;
	v = strtoul(s, &end, 10);
	if (errno || *end || v < lo || v > hi)
		return -EINVAL;
	*out = v;
	return 0;
}

/* A gid as a number or a group name. 0, or -ENOENT when it is neither. */
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
		return -ENOENT;
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

/* One word a flag takes, and what it stands for. */
struct choice {
	const char *word;
	uint32_t value;
};

/*
 * `val` as one of the `n` words of `choices`: its value in *out. 0, or 2
 * after a usage error that lists the words.
 */
static int parse_choice(const char *flag, const char *val, const struct choice *choices, size_t n,
			uint32_t *out)
{
	char words[128];
	size_t off = 0;

	for (size_t i = 0; i < n; i++) {
		if (strcmp(val, choices[i].word) == 0) {
			*out = choices[i].value;
			return 0;
		}
		if (off < sizeof(words))
			off += (size_t)snprintf(words + off, sizeof(words) - off, "%s%s",
						i ? ", " : "", choices[i].word);
	}
	return usage_error("%s: '%s' is not one of %s", flag, val, words);
}

#define NCHOICES(c) (sizeof(c) / sizeof((c)[0]))

static const struct choice backends[] = {
	{ "host", SHARDD_BACKEND_HOST },
	{ "cuda", SHARDD_BACKEND_CUDA },
};
static const struct choice cuda_exports[] = {
	{ "auto", SHD_CUDA_EXPORT_AUTO },
	{ "fd", SHD_CUDA_EXPORT_FD },
	{ "ipc", SHD_CUDA_EXPORT_IPC },
};
static const struct choice internode_dtypes[] = {
	{ "fp32", SHD_INTERNODE_FP32 },
	{ "reduce", SHD_INTERNODE_REDUCE },
};

/* --max-memory or --max-job-memory: bytes above 0. 0, or 2 after a usage error. */
static int parse_bytes(const char *flag, const char *val, uint64_t *out)
{
	if (shd_memlimit_parse(val, out) < 0 || *out == 0)
		return usage_error("%s: '%s' is not a byte count above 0 (digits, then "
				   "optionally K, M, G or T)",
				   flag, val);
	return 0;
}

/*
 * Apply flag `id` with its value (NULL for flags without). 0, or 2 after a
 * usage error. *cuda_only names the last flag seen that needs --backend cuda.
 */
static int apply_flag(struct shd_config *cfg, enum flag_id id, const char *val,
		      const char **cuda_only)
{
	unsigned long v;
	char *end;
	double t;

	switch (id) {
	case FLAG_SOCKET:
		if (!*val)
			return usage_error("--socket: the path is empty");
		if (strlen(val) >= sizeof(cfg->socket_path))
			return usage_error("--socket: the path is longer than %zu bytes: %s",
					   sizeof(cfg->socket_path) - 1, val);
		snprintf(cfg->socket_path, sizeof(cfg->socket_path), "%s", val);
		break;
	case FLAG_LOG_LEVEL: {
		int level = shd_log_level_parse(val);

		if (level < 0)
			return usage_error(
				"--log-level: '%s' is not one of error, warn, info, debug", val);
		cfg->log_level = level;
		break;
	}
	case FLAG_BACKEND:
		return parse_choice("--backend", val, backends, NCHOICES(backends), &cfg->backend);
	case FLAG_CUDA_EXPORT:
		*cuda_only = "--cuda-export";
		return parse_choice("--cuda-export", val, cuda_exports, NCHOICES(cuda_exports),
				    &cfg->cuda_export);
	case FLAG_MPS_SM_PERCENT:
		*cuda_only = "--mps-sm-percent";
		if (parse_uint(val, 1, 100, &v) < 0)
			return usage_error("--mps-sm-percent: '%s' is not a percentage in [1, 100]",
					   val);
		/* The driver reads it when CUDA initialises, which the backend does after the flags. */
		if (setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", val, 1))
			return usage_error("--mps-sm-percent: setenv: %s", strerror(errno));
		break;
	case FLAG_COLLECTIVE_TIMEOUT:
		return parse_seconds("--collective-timeout", val, &cfg->collective_timeout_s);
	case FLAG_HANDSHAKE_TIMEOUT:
		return parse_seconds("--handshake-timeout", val, &cfg->handshake_timeout_s);
	case FLAG_WORKERS:
		if (parse_uint(val, 1, WORKERS_MAX, &v) < 0)
			return usage_error("--workers: '%s' is not a thread count in [1, %d]", val,
					   WORKERS_MAX);
		cfg->workers = (unsigned)v;
		break;
	case FLAG_ALLOW_GID: {
		gid_t gid;

		if (parse_gid(val, &gid) < 0)
			return usage_error("--allow-gid: '%s' is neither a gid nor a group "
					   "name",
					   val);
		if (cfg->nallow_gids == SHD_MAX_ALLOW_GIDS)
			return usage_error("--allow-gid: more than %d groups (at '%s')",
					   SHD_MAX_ALLOW_GIDS, val);
		cfg->allow_gids[cfg->nallow_gids++] = gid;
		break;
	}
	case FLAG_MAX_MEMORY:
		return parse_bytes("--max-memory", val, &cfg->max_memory);
	case FLAG_MAX_JOB_MEMORY:
		return parse_bytes("--max-job-memory", val, &cfg->max_job_memory);
	case FLAG_RANK_EXEC_MAX:
		if (shd_memlimit_parse(val, &cfg->rank_exec_max) < 0)
			return usage_error(
				"--rank-exec-max: '%s' is not a byte count (digits, then "
				"optionally K, M, G or T; 0: never)",
				val);
		return 0;
	case FLAG_JOB_LINGER:
		errno = 0;
		t = strtod(val, &end);
		if (errno || end == val || *end || !(t >= 0) || t > SHD_JOB_LINGER_MAX_S)
			return usage_error(
				"--job-linger: '%s' is not a number of seconds in [0, %g] "
				"(0 keeps a job without ranks forever)",
				val, SHD_JOB_LINGER_MAX_S);
		cfg->job_linger_s = t;
		break;
	case FLAG_SOCKET_MODE:
		errno = 0;
		v = strtoul(val, &end, 8);
		if (errno || end == val || *end || *val == '-' || *val == '+' || v > 0777 ||
		    (v & 0600) != 0600)
			return usage_error(
				"--socket-mode: '%s' is not an octal mode in [0600, 0777] "
				"that keeps the owner's rw (e.g. 0660)",
				val);
		cfg->socket_mode = (unsigned)v;
		break;
	case FLAG_SOCKET_GROUP:
		if (parse_gid(val, &cfg->socket_group) < 0)
			return usage_error("--socket-group: '%s' is neither a gid nor a group name",
					   val);
		cfg->socket_group_set = 1;
		break;
	case FLAG_METRICS_LISTEN: {
		char host[128], port[16], why[256];

		if (strlen(val) >= sizeof(cfg->metrics_listen) ||
		    shd_metrics_http_parse(val, host, sizeof(host), port, sizeof(port), why,
					   sizeof(why)) < 0)
			return usage_error(
				"--metrics-listen %s",
				strlen(val) >= sizeof(cfg->metrics_listen) ? "is too long" : why);
		snprintf(cfg->metrics_listen, sizeof(cfg->metrics_listen), "%s", val);
		break;
	}
	case FLAG_STATE_DIR:
		if (!val[0] || strlen(val) >= sizeof(cfg->state_dir) - 200)
			return usage_error("--state-dir: '%.64s' is empty or longer than %zu bytes",
					   val, sizeof(cfg->state_dir) - 201);
		snprintf(cfg->state_dir, sizeof(cfg->state_dir), "%s", val);
		break;
	case FLAG_IMPORT_DIR: {
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
			return usage_error(
				"--import-dir: '%s' is not a directory (%s); create it or "
				"name an existing one",
				val, strerror(err));
		}
		cfg->import_dirs[cfg->nimport_dirs++] = real;
		break;
	}
	case FLAG_CHECKPOINT_EVERY:
		errno = 0;
		v = strtoul(val, &end, 10);
		if (errno || end == val || *end || *val == '-' || v == 0 || v > UINT32_MAX)
			return usage_error(
				"--checkpoint-every: '%s' is not a step count in [1, %u]", val,
				UINT32_MAX);
		cfg->checkpoint_every = (uint32_t)v;
		break;
	case FLAG_KEEP:
		errno = 0;
		v = strtoul(val, &end, 10);
		if (errno || end == val || *end || *val == '-' || v > 1000000)
			return usage_error(
				"--keep: '%s' is not a count in [0, 1000000] (0 keeps every "
				"checkpoint)",
				val);
		cfg->keep = (uint32_t)v;
		break;
	case FLAG_CHECKPOINT_RATE:
		errno = 0;
		v = strtoul(val, &end, 10);
		if (errno || end == val || *end || *val == '-' || v > 1000000)
			return usage_error(
				"--checkpoint-rate: '%s' is not MB/s in [0, 1000000] (0 writes at "
				"the disk's speed)",
				val);
		cfg->checkpoint_rate = (uint32_t)v;
		break;
	case FLAG_WORLD:
		if (strcmp(val, "mpi") != 0)
			return usage_error("--world: '%s' is not mpi (the only world there is)",
					   val);
		world_mpi = 1;
		break;
	case FLAG_INTERNODE_DTYPE:
		return parse_choice("--internode-dtype", val, internode_dtypes,
				    NCHOICES(internode_dtypes), &internode_dtype);
	case FLAG_FOREGROUND:
		/* shardd never forks into the background; the flag is for supervisors' habits. */
		break;
	case FLAG_VERSION:
	case FLAG_HELP:
		/* parse_flags answers these itself: they end shardd before it runs. */
		break;
	}
	return 0;
}

/*
 * `arg`, where getopt_long read a flag, names one the way shardd takes it:
 * a whole flag name (getopt_long would also take any unambiguous prefix of
 * one), or -h on its own (not in a cluster such as -hx). 0, or 2 after a
 * usage error.
 */
static int flag_named_whole(const char *arg)
{
	size_t len;

	if (strncmp(arg, "--", 2) != 0)
		return strcmp(arg, "-h") == 0 ? 0 : usage_error("unexpected argument '%s'", arg);
	len = strcspn(arg + 2, "=");
	for (const struct flag *fl = flags; fl < flags + NFLAGS; fl++)
		if (strlen(fl->name) == len && strncmp(arg + 2, fl->name, len) == 0)
			return 0;
	return usage_error("unknown flag '%s'", arg);
}

static void print_version(void)
{
	printf("shardd %s (protocol %d.%d, backends: host%s)\n", SHARDD_VERSION, SHARDD_PROTO_MAJOR,
	       SHARDD_PROTO_MINOR,
#ifdef SHARDD_HAVE_CUDA
	       ", cuda"
#else
	       ""
#endif
	);
}

/* parse_flags' answer when the flags are good and shardd is to run (not an exit status). */
#define FLAGS_RUN (-1)

/*
 * Read argv's flags into `cfg`, in order. FLAGS_RUN when shardd is to run;
 * else the exit status: 0 after --help or --version, 2 after a usage error.
 */
static int parse_flags(int argc, char **argv, struct shd_config *cfg)
{
	struct option longopts[NFLAGS + 1];
	const char *cuda_only = NULL;

	for (size_t i = 0; i < NFLAGS; i++)
		longopts[i] = (struct option){ flags[i].name,
					       flags[i].value ? required_argument : no_argument,
					       NULL, flags[i].id };
	longopts[NFLAGS] = (struct option){ 0 };
	opterr = 0;
	for (;;) {
		/*
		 * "-": in argv's order, an argument that is no flag comes back
		 * as 1 (so it is refused where it stands); ":": a flag missing
		 * its value comes back as ':'.
		 */
		int at = optind, c = getopt_long(argc, argv, "-:h", longopts, NULL), ret;

		if (c == -1) {
			/* getopt_long stops at "--", which shardd does not take. */
			if (at < argc)
				return usage_error("unknown flag '%s'", argv[at]);
			break;
		}
		if (flag_named_whole(argv[at]))
			return 2;
		switch (c) {
		case ':':
			return usage_error("%s needs a value", argv[at]);
		case '?':
			/* A flag without a value, given one (--flag=VALUE). */
			if (optopt == FLAG_FOREGROUND)
				return usage_error("--foreground takes no value");
			return usage_error("unknown flag '%s'", argv[at]);
		case FLAG_HELP:
			usage(stdout);
			return 0;
		case FLAG_VERSION:
			print_version();
			return 0;
		}
		ret = apply_flag(cfg, c, optarg, &cuda_only);
		if (ret)
			return ret;
	}
	/* Flags come in any order: only now is the backend known. */
	if (cuda_only && cfg->backend != SHARDD_BACKEND_CUDA)
		return usage_error("%s applies to --backend cuda only; the backend is %s",
				   cuda_only, shd_backend_name(cfg->backend));
	return FLAGS_RUN;
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
		shd_log_warn(
			"cannot raise the descriptor limit (RLIMIT_NOFILE) from %llu to %llu: %s",
			(unsigned long long)was, (unsigned long long)rl.rlim_max, strerror(errno));
	else
		shd_log_info(
			"raised the descriptor limit (RLIMIT_NOFILE) from %llu to its hard limit %llu",
			(unsigned long long)was, (unsigned long long)rl.rlim_max);
}

int main(int argc, char **argv)
{
	/* Static: the --import-dir strings it holds stay reachable on every way out. */
	static struct shd_config cfg;
	int ret;

	shd_config_defaults(&cfg);
	ret = parse_flags(argc, argv, &cfg);
	if (ret != FLAGS_RUN)
		return ret;

#ifndef SHARDD_HAVE_CUDA
	if (cfg.backend == SHARDD_BACKEND_CUDA) {
		fprintf(stderr,
			"shardd: --backend cuda: this shardd was built without CUDA "
			"(rebuild where nvcc and NCCL are installed, e.g. make CUDA=1), or use "
			"--backend host\n");
		return 1;
	}
#endif
	raise_fd_limit();
	if (world_mpi) {
		char why[320];

		if (shd_world_start(internode_dtype, why, sizeof(why)) < 0) {
			fprintf(stderr,
				"shardd: --world mpi: %s (start one daemon per node with "
				"mpirun -np NODES --map-by ppr:1:node shardd --world mpi, or srun)\n",
				why);
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
