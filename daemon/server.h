/* SPDX-License-Identifier: MIT */
/*
 * The daemon as a whole: its configuration, the listening socket, the event
 * loop, the op engine, and the lists of sessions (connected clients) and
 * jobs. One global `server`, touched by the loop thread only.
 */
#ifndef SHD_SERVER_H
#define SHD_SERVER_H

#include <stdint.h>
#include <sys/types.h>
#include <sys/un.h>

#include "shardd_proto.h"

/* SHARDD_VERSION comes from the Makefile (-DSHARDD_VERSION), the one place it is set. */

#define SHD_MAX_ALLOW_GIDS        32      /* --allow-gid may repeat this often */
#define SHD_MAX_IMPORT_DIRS       32      /* --import-dir may repeat this often */
#define SHD_CRON_PERIOD_MS        100     /* barrier and collective timeouts, heartbeats */
#define SHD_SPIN_WINDOW_NS        50000   /* keep polling rings this long after work */
#define SHD_SPIN_YIELD_NS         4000    /* an idle spin turn yields at most this often */
#define SHD_HEARTBEAT_PERIOD_NS   1000000 /* ring heartbeats at most this often */
#define SHD_TIMEOUT_DEFAULT_S     300.0   /* --collective-timeout */
#define SHD_TIMEOUT_MAX_S         604800.0 /* one week; fits the welcome's u32 ms */
#define SHD_HANDSHAKE_TIMEOUT_DEFAULT_S 10.0 /* --handshake-timeout: first message due */
#define SHD_JOB_LINGER_DEFAULT_S  3600.0  /* --job-linger: a job without ranks ends after this */
#define SHD_JOB_LINGER_MAX_S      31536000.0 /* one year; 0 means forever */
#define SHD_SOCKET_MODE_PRIVATE   0600    /* the socket without --allow-gid */
#define SHD_SOCKET_MODE_GROUP     0660    /* with --allow-gid: the group may connect */
#define SHD_LISTEN_FDS_START      3       /* systemd's first passed fd (sd_listen_fds) */

struct shd_loop;
struct shd_loop_event;
struct shd_engine;
struct shd_session;
struct shd_job;
struct shd_metrics_http;

struct shd_config {
	char     socket_path[sizeof(((struct sockaddr_un *)0)->sun_path)]; /* --socket */
	int      log_level;             /* --log-level: enum shd_log_level */
	uint32_t backend;               /* --backend: enum shardd_backend */
	uint32_t cuda_export;           /* --cuda-export: enum shd_cuda_export (backend_cuda.h) */
	double   collective_timeout_s;  /* --collective-timeout */
	double   handshake_timeout_s;   /* --handshake-timeout */
	unsigned workers;               /* --workers; 0 = online cores */
	gid_t    allow_gids[SHD_MAX_ALLOW_GIDS]; /* --allow-gid */
	unsigned nallow_gids;
	uint64_t max_memory;            /* --max-memory: bytes of buffers of all jobs; 0 = the default
					   (memlimit.h), set by shd_server_init */
	uint64_t max_job_memory;        /* --max-job-memory: bytes of one job's buffers; 0 = max_memory */
	char     max_memory_from[96];   /* where max_memory comes from: "--max-memory" or the default's basis */
	double   job_linger_s;          /* --job-linger; 0 = a job without ranks is kept forever */
	unsigned socket_mode;           /* --socket-mode; 0: 0660 with --allow-gid, else 0600 */
	gid_t    socket_group;          /* --socket-group; else the first --allow-gid */
	int      socket_group_set;      /* --socket-group was given */
	char     metrics_listen[128];   /* --metrics-listen [ADDR:]PORT; "" = no HTTP endpoint */
	char     state_dir[3072];       /* --state-dir: checkpoints go to <state_dir>/<job>/; "" = none */
	uint32_t keep;                  /* --keep N: checkpoints kept per job in the state dir; 0 = all */
	uint32_t checkpoint_every;      /* --checkpoint-every STEPS; 0 = none */
	char    *import_dirs[SHD_MAX_IMPORT_DIRS]; /* --import-dir, resolved (realpath, malloc'd) */
	unsigned nimport_dirs;
};

struct shd_server {
	struct shd_config cfg;
	uint64_t collective_timeout_ns;
	uint64_t handshake_timeout_ns;  /* a connection with no complete message by then is closed */
	uid_t    uid;                  /* clients must run as this uid (or an allowed gid) */
	pid_t    pid;
	uint64_t start_ns;             /* CLOCK_MONOTONIC at init: uptime */
	int      listen_fd;            /* -1 when not listening */
	int      signal_fd;            /* SIGTERM, SIGINT */
	int      socket_bound;         /* we created socket_path: unlink it on exit */
	int      accept_reserve_fd;    /* /dev/null held back to answer a connection at the fd
					* limit (shd_session_accept); -1 while spent */
	int      socket_activated;     /* listen_fd came from systemd (LISTEN_FDS) */
	struct shd_metrics_http *metrics_http; /* --metrics-listen; NULL without */
	struct shd_loop   *loop;
	struct shd_engine *engine;
	struct shd_session *sessions;  /* every connected client, dead ones until reaped */
	struct shd_job     *jobs;
	uint64_t last_work_ns;         /* the last time a ring had work: spin window */
	uint64_t last_yield_ns;        /* the spin window's last sched_yield() */
	uint64_t last_heartbeat_ns;
	int      need_reap;            /* some session is dead and waits to be freed */
	int      need_close;           /* some session is marked closing (shd_session_close_later) */
	uint64_t job_linger_ns;        /* --job-linger; 0 = forever */
};

extern struct shd_server server;

/* Defaults of every flag (socket path: shardd_socket_path_default(), shardd_socket.h). */
void shd_config_defaults(struct shd_config *cfg);
/* "host", "cuda" (enum shardd_backend), or "unknown". */
const char *shd_backend_name(uint32_t backend);

/*
 * Bind the socket, create the engine and the loop. Returns 0, or a negative
 * error after printing why on stderr (the caller exits 1).
 */
int shd_server_init(const struct shd_config *cfg);
/* Serve until SIGTERM/SIGINT, then shut down cleanly. Returns the exit status. */
int shd_server_run(void);
/* Fail everything in flight, close every client, free all. Safe after a failed init. */
void shd_server_shutdown(void);

/* A session died or detached: free it at the next safe point of the loop. */
void shd_server_schedule_reap(void);
/* A session was marked closing: close it at the next safe point of the loop. */
void shd_server_schedule_close(void);
/* Note that some ring had work now (keeps the spin window open). */
void shd_server_note_work(uint64_t now_ns);

#endif /* SHD_SERVER_H */
