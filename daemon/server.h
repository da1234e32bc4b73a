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

#include "config.h"
#include "shardd_proto.h"

struct shd_loop;
struct shd_loop_event;
struct shd_engine;
struct shd_session;
struct shd_job;
struct shd_metrics_http;

struct shd_server {
	struct shd_config cfg;
	uint64_t collective_timeout_ns;
	uint64_t handshake_timeout_ns; /* a connection with no complete message by then is closed */
	uid_t uid;                     /* clients must run as this uid (or an allowed gid) */
	pid_t pid;
	uint64_t start_ns;     /* CLOCK_MONOTONIC at init: uptime */
	int listen_fd;         /* -1 when not listening */
	int signal_fd;         /* SIGTERM, SIGINT */
	int socket_bound;      /* we created socket_path: unlink it on exit */
	int accept_reserve_fd; /* /dev/null held back to answer a connection at the fd
					* limit (shd_session_accept); -1 while spent */
	int socket_activated;  /* listen_fd came from systemd (LISTEN_FDS) */
	struct shd_metrics_http *metrics_http; /* --metrics-listen; NULL without */
	struct shd_loop *loop;
	struct shd_engine *engine;
	struct shd_session *sessions; /* every connected client, dead ones until reaped */
	struct shd_job *jobs;
	uint64_t last_work_ns;  /* the last time a ring had work: spin window */
	uint64_t last_yield_ns; /* the spin window's last sched_yield() */
	uint64_t last_heartbeat_ns;
	int need_reap;          /* some session is dead and waits to be freed */
	int need_close;         /* some session is marked closing (shd_session_close_later) */
	uint64_t job_linger_ns; /* --job-linger; 0 = forever */
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
