/* SPDX-License-Identifier: MIT */
/*
 * The daemon's configuration: every flag of `shardd` (main.c parses them,
 * shd_config_defaults in server.c fills the defaults), the limits and
 * defaults of those flags, and the server's timing constants. Plain data:
 * the server owns the one instance, and the reports read it (admin/state.h).
 */
#ifndef SHD_CONFIG_H
#define SHD_CONFIG_H

#include <stdint.h>
#include <sys/types.h>
#include <sys/un.h>

/* SHARDD_VERSION comes from the Makefile (-DSHARDD_VERSION), the one place it is set. */

#define SHD_MAX_ALLOW_GIDS              32       /* --allow-gid may repeat this often */
#define SHD_MAX_IMPORT_DIRS             32       /* --import-dir may repeat this often */
#define SHD_CRON_PERIOD_MS              100      /* barrier and collective timeouts, heartbeats */
#define SHD_SPIN_WINDOW_NS              50000    /* keep polling rings this long after work */
#define SHD_SPIN_YIELD_NS               4000     /* an idle spin turn yields at most this often */
#define SHD_HEARTBEAT_PERIOD_NS         1000000  /* ring heartbeats at most this often */
#define SHD_TIMEOUT_DEFAULT_S           300.0    /* --collective-timeout */
#define SHD_TIMEOUT_MAX_S               604800.0 /* one week; fits the welcome's u32 ms */
#define SHD_HANDSHAKE_TIMEOUT_DEFAULT_S 10.0     /* --handshake-timeout: first message due */
#define SHD_JOB_LINGER_DEFAULT_S        3600.0 /* --job-linger: a job without ranks ends after this */
/*
 * --rank-exec-max: up to this many unsharded bytes an exec=auto group runs
 * rank-executed. 64 KiB: where the rank-executed unshard is no slower than
 * the daemon's and the small ops' fixed cost is what it saves
 * (docs/BENCHMARKS.md, "Rank-executed collectives").
 */
#define SHD_RANK_EXEC_MAX_DEFAULT (64 * 1024)
#define SHD_JOB_LINGER_MAX_S      31536000.0 /* one year; 0 means forever */
#define SHD_SOCKET_MODE_PRIVATE   0600       /* the socket without --allow-gid */
#define SHD_SOCKET_MODE_GROUP     0660       /* with --allow-gid: the group may connect */
#define SHD_LISTEN_FDS_START      3          /* systemd's first passed fd (sd_listen_fds) */

struct shd_config {
	char socket_path[sizeof(((struct sockaddr_un *)0)->sun_path)]; /* --socket */
	int log_level;               /* --log-level: enum shd_log_level */
	uint32_t backend;            /* --backend: enum shardd_backend */
	uint32_t cuda_export;        /* --cuda-export: enum shd_cuda_export (backend_cuda.h) */
	double collective_timeout_s; /* --collective-timeout */
	double handshake_timeout_s;  /* --handshake-timeout */
	unsigned workers;            /* --workers; 0 = online cores */
	gid_t allow_gids[SHD_MAX_ALLOW_GIDS]; /* --allow-gid */
	unsigned nallow_gids;
	uint64_t max_memory;     /* --max-memory: bytes of buffers of all jobs; 0 = the default
					   (memlimit.h), set by shd_server_init */
	uint64_t max_job_memory; /* --max-job-memory: bytes of one job's buffers; 0 = max_memory */
	/* --rank-exec-max: exec=auto groups of at most this many unsharded bytes are
	   rank-executed where they can be; 0 = never */
	uint64_t rank_exec_max;
	/* where max_memory comes from: "--max-memory" or the default's basis */
	char max_memory_from[96];
	double job_linger_s;      /* --job-linger; 0 = a job without ranks is kept forever */
	unsigned socket_mode;     /* --socket-mode; 0: 0660 with --allow-gid, else 0600 */
	gid_t socket_group;       /* --socket-group; else the first --allow-gid */
	int socket_group_set;     /* --socket-group was given */
	char metrics_listen[128]; /* --metrics-listen [ADDR:]PORT; "" = no HTTP endpoint */
	char state_dir[3072];     /* --state-dir: checkpoints go to <state_dir>/<job>/; "" = none */
	uint32_t keep;            /* --keep N: checkpoints kept per job in the state dir; 0 = all */
	uint32_t checkpoint_every;              /* --checkpoint-every STEPS; 0 = none */
	uint32_t checkpoint_rate;               /* --checkpoint-rate MB/s; 0 = the disk's speed */
	char *import_dirs[SHD_MAX_IMPORT_DIRS]; /* --import-dir, resolved (realpath, malloc'd) */
	unsigned nimport_dirs;
};

#endif /* SHD_CONFIG_H */
