/* SPDX-License-Identifier: MIT */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "admin.h"
#include "clock.h"
#include "engine.h"
#include "job.h"
#include "memlimit.h"
#include "log.h"
#include "loop.h"
#include "metrics_http.h"
#include "server.h"
#include "session.h"
#include "shardd_socket.h"
#include "state.h"

/* ------------------------------------------------------------------ */
/* Globals                                                             */
/* ------------------------------------------------------------------ */

struct shd_server server = { .listen_fd = -1, .signal_fd = -1, .accept_reserve_fd = -1 };

/* ------------------------------------------------------------------ */
/* Config                                                              */
/* ------------------------------------------------------------------ */

const char *shd_backend_name(uint32_t backend)
{
	return backend == SHARDD_BACKEND_HOST   ? "host"
	       : backend == SHARDD_BACKEND_CUDA ? "cuda"
						: "unknown";
}

void shd_config_defaults(struct shd_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	shardd_socket_path_default(cfg->socket_path, sizeof(cfg->socket_path));
	cfg->log_level = SHD_LOG_INFO;
	cfg->backend = SHARDD_BACKEND_HOST;
	cfg->collective_timeout_s = SHD_TIMEOUT_DEFAULT_S;
	cfg->handshake_timeout_s = SHD_HANDSHAKE_TIMEOUT_DEFAULT_S;
	cfg->workers = 0;
	cfg->job_linger_s = SHD_JOB_LINGER_DEFAULT_S;
	cfg->rank_exec_max = SHD_RANK_EXEC_MAX_DEFAULT;
}

/* ------------------------------------------------------------------ */
/* Loop callbacks: signals, engine, cron, sleep hooks                  */
/* ------------------------------------------------------------------ */

/* The sessions' admin requests (shd_sessions_env.admin_request): answered by admin.h. */
static void server_admin_request(struct shd_session *s, uint32_t seq, const void *payload,
				 size_t len)
{
	struct shd_admin_reply reply;

	shd_admin_handle(payload, len, s->cred.uid, s->cred.pid, &reply);
	/* Queued when the socket is full; a client that never reads is dropped (session.h). */
	shd_session_send(s, SHARDD_MSG_ADMIN_REPLY, seq, reply.text, (uint32_t)reply.len, NULL, 0);
	shd_admin_reply_free(&reply);
}

static void server_signal(void *arg, int fd, uint32_t revents)
{
	struct signalfd_siginfo si;

	(void)arg;
	(void)revents;
	if (read(fd, &si, sizeof(si)) != sizeof(si))
		return;
	shd_log_info("received %s, shutting down", si.ssi_signo == SIGINT ? "SIGINT" : "SIGTERM");
	shd_loop_stop(server.loop);
}

static void server_engine_ready(void *arg, int fd, uint32_t revents)
{
	(void)arg;
	(void)fd;
	(void)revents;
	shd_engine_drain(server.engine);
	/* The same fd wakes the loop when a grad_norm's sum across nodes ends. */
	for (struct shd_job *j = server.jobs; j; j = j->next)
		shd_job_gnorm_poll(j);
}

static void server_heartbeat(uint64_t now_ns)
{
	server.last_heartbeat_ns = now_ns;
	for (struct shd_session *s = server.sessions; s; s = s->next)
		if (s->state == SHD_SESSION_ATTACHED)
			/* Diagnostics only: clients and shardctl read it to see the loop turn. */
			shardd_ring_note_heartbeat(&s->ring, now_ns);
}

static void server_cron(void *arg)
{
	uint64_t now = shd_now_ns();
	struct shd_job *j = server.jobs;

	(void)arg;
	while (j) {
		/* Read next first: a job that lingered past --job-linger ends here. */
		struct shd_job *next = j->next;

		shd_job_cron(j, now);
		j = next;
	}
	shd_engine_cron(server.engine, now);
	shd_session_cron(now);
	server_heartbeat(now);
}

void shd_server_schedule_reap(void)
{
	server.need_reap = 1;
}

void shd_server_schedule_close(void)
{
	server.need_close = 1;
}

void shd_server_note_work(uint64_t now_ns)
{
	server.last_work_ns = now_ns;
}

/* Awake: clear NEED_WAKEUP on every attached ring so clients stop ringing. */
static void server_rings_awake(void)
{
	for (struct shd_session *s = server.sessions; s; s = s->next)
		if (s->state == SHD_SESSION_ATTACHED)
			shardd_ring_clear_wakeup(&s->ring);
}

/*
 * Take entries from every attached ring; keeps the spin window open when
 * some had work. Returns how many were taken.
 */
static unsigned server_service(uint64_t now)
{
	unsigned taken = 0;

	for (struct shd_session *s = server.sessions; s; s = s->next)
		if (s->state == SHD_SESSION_ATTACHED)
			taken += shd_session_service(s);
	if (taken)
		server.last_work_ns = now;
	return taken;
}

/*
 * The loop's safe point, between event callbacks: close the sessions found
 * broken while the engine pushed to them, then free the dead ones.
 */
static void server_close_and_reap(void)
{
	if (server.need_close) {
		server.need_close = 0;
		shd_session_close_marked();
	}
	if (server.need_reap) {
		server.need_reap = 0;
		shd_session_reap();
	}
}

/*
 * Read on from the sockets that held more datagrams than one turn's budget
 * (their poll may not fire again). Returns 1 while some still do.
 */
static int server_read_backlogs(void)
{
	int more = 0;

	for (struct shd_session *s = server.sessions; s; s = s->next)
		if (s->read_backlog && shd_session_read_backlog(s))
			more = 1;
	return more;
}

/*
 * Before the loop may block: read the control backlogs, serve every ring,
 * stay awake while work was seen within the spin window, else announce
 * sleep (NEED_WAKEUP) on every ring and re-check, so a submission racing
 * with us is never missed. A turn of the spin window that found nothing
 * yields the CPU, at most every SHD_SPIN_YIELD_NS: a client woken onto
 * this CPU (by a completion's futex wake) runs within that instead of
 * after the window, which matters when processes outnumber cores. On an
 * idle core sched_yield() returns at once, but costs a system call
 * (~1 us here), which a yield on every turn would add to the spinning
 * round trip.
 */
static int server_before_sleep(void *arg)
{
	uint64_t now = shd_now_ns();
	int wake = 0, backlog;
	unsigned taken;

	(void)arg;
	server_close_and_reap();
	backlog = server_read_backlogs();
	taken = server_service(now);
	if (now - server.last_heartbeat_ns >= SHD_HEARTBEAT_PERIOD_NS)
		server_heartbeat(now);
	/* Sessions marked closing by that service are closed on the next turn, without sleeping. */
	if (backlog || server.need_close || server.need_reap)
		return 0;
	if (now - server.last_work_ns < SHD_SPIN_WINDOW_NS) {
		if (!taken && now - server.last_yield_ns >= SHD_SPIN_YIELD_NS) {
			server.last_yield_ns = now;
			sched_yield();
		}
		return 0;
	}
	for (struct shd_session *s = server.sessions; s; s = s->next)
		if (shd_session_prepare_sleep(s))
			wake = 1;
	if (!wake)
		return 1;
	server_rings_awake();
	server.last_work_ns = now;
	return 0;
}

/*
 * Woken up: the usual reason is a doorbell, so serve the rings before
 * anything else. The submission that rang is completed before the loop
 * reads the doorbell eventfd and dispatches the other events, which keeps
 * those system calls off the sleeping round trip. When that took entries,
 * yield at once: the scheduler mostly wakes us onto the CPU of the client
 * that rang, which spins there for its completion, and the yield lets it
 * reap before we read the doorbell and go through the loop's other work
 * (docs/BENCHMARKS.md, "Waking the daemon"). On a core of our own it
 * returns at once.
 */
static void server_after_sleep(void *arg)
{
	uint64_t now = shd_now_ns();

	(void)arg;
	server_rings_awake();
	if (server_service(now)) {
		server.last_yield_ns = now;
		sched_yield();
	}
}

/* ------------------------------------------------------------------ */
/* Init                                                                */
/* ------------------------------------------------------------------ */

/* The socket's mode: --socket-mode, else 0660 with --allow-gid, else 0600. */
static unsigned socket_mode(const struct shd_config *cfg)
{
	if (cfg->socket_mode)
		return cfg->socket_mode;
	return cfg->nallow_gids ? SHD_SOCKET_MODE_GROUP : SHD_SOCKET_MODE_PRIVATE;
}

/* The socket's group: --socket-group, else the first --allow-gid, else -1 (leave it). */
static gid_t socket_group(const struct shd_config *cfg)
{
	if (cfg->socket_group_set)
		return cfg->socket_group;
	return cfg->nallow_gids ? cfg->allow_gids[0] : (gid_t)-1;
}

/*
 * The directory a socket of mode `mode` sits in: the owner keeps rwx, and
 * each class that may connect gets search and read (0750 for a 0660 socket),
 * since connect() needs search permission on every directory of the path.
 */
static unsigned socket_dir_mode(unsigned mode)
{
	return 0700 | (mode & 0070 ? 0050 : 0) | (mode & 0007 ? 0005 : 0);
}

/*
 * Create the socket's directory if missing, with socket_dir_mode() and the
 * socket's group. An existing directory is left as it is (it may be /tmp or
 * a home), but a warning says when the socket's group cannot search it.
 * 0, or after printing why -ENOTDIR (the path is not a directory) or the
 * negative errno of the call that failed.
 */
static int socket_dir_prepare(const struct shd_config *cfg)
{
	char dir[sizeof(server.cfg.socket_path)];
	unsigned mode = socket_dir_mode(socket_mode(cfg));
	gid_t gid = socket_group(cfg);
	struct stat st;
	char *slash;
	int ret;

	snprintf(dir, sizeof(dir), "%s", cfg->socket_path);
	slash = strrchr(dir, '/');
	if (!slash || slash == dir)
		return 0;
	*slash = '\0';
	if (mkdir(dir, 0700) == 0) {
		/* mkdir's mode passes through the umask: set the group first, then the mode. */
		if (gid != (gid_t)-1 && chown(dir, (uid_t)-1, gid) < 0) {
			ret = -errno;
			shd_log_error("shardd: cannot give the socket directory %s group %u: %s "
				      "(shardd's uid %u must be root or a member of group %u)",
				      dir, (unsigned)gid, strerror(-ret), (unsigned)getuid(),
				      (unsigned)gid);
			return ret;
		}
		if (chmod(dir, mode) < 0) {
			ret = -errno;
			shd_log_error("shardd: cannot set mode %04o on the socket directory %s: %s",
				      mode, dir, strerror(-ret));
			return ret;
		}
		return 0;
	}
	if (errno != EEXIST) {
		ret = -errno;
		shd_log_error("shardd: cannot create the socket directory %s: %s", dir,
			      strerror(-ret));
		return ret;
	}
	if (stat(dir, &st) < 0) {
		ret = -errno;
		shd_log_error("shardd: %s: %s", dir, strerror(-ret));
		return ret;
	}
	if (!S_ISDIR(st.st_mode)) {
		shd_log_error("shardd: %s exists and is not a directory; remove it or pass "
			      "--socket elsewhere",
			      dir);
		return -ENOTDIR;
	}
	if (gid != (gid_t)-1 && !(st.st_mode & 0001) && !(st.st_gid == gid && (st.st_mode & 0010)))
		shd_log_warn("the socket directory %s (mode %04o, group %u) cannot be searched by "
			     "group %u, so its members cannot connect: remove the directory so "
			     "shardd creates it with mode %04o, or chgrp %u and chmod g+x it",
			     dir, (unsigned)(st.st_mode & 07777), (unsigned)st.st_gid,
			     (unsigned)gid, mode, (unsigned)gid);
	return 0;
}

/*
 * Is a daemon already serving `path`? 1 (printed), 0 (free: a stale socket
 * was removed), or after printing why the path cannot be used -ENOTSOCK (it
 * is not a socket) or the negative errno of the call that failed.
 */
static int socket_check_live(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct stat st;
	int fd, live = 0;

	if (lstat(path, &st) < 0) {
		if (errno == ENOENT)
			return 0;
		live = -errno;
		shd_log_error("shardd: %s: %s", path, strerror(-live));
		return live;
	}
	if (!S_ISSOCK(st.st_mode)) {
		shd_log_error("shardd: %s exists and is not a socket; remove it or pass --socket "
			      "elsewhere",
			      path);
		return -ENOTSOCK;
	}
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		live = -errno;
		shd_log_error("shardd: socket: %s", strerror(-live));
		return live;
	}
	memcpy(sa.sun_path, path, strlen(path) + 1);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
		struct ucred cred;
		socklen_t len = sizeof(cred);
		int have_pid =
			getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid > 0;

		if (have_pid && kill(cred.pid, 0) < 0 && errno == ESRCH) {
			/*
			 * The daemon that listened has exited (SIGKILL, OOM), but
			 * the kernel's asynchronous teardown of its io_uring still
			 * holds the listening socket for a moment, so connect
			 * succeeds. Nobody will ever accept: it is stale.
			 */
			if (unlink(path) < 0 && errno != ENOENT) {
				live = -errno;
				shd_log_error(
					"shardd: cannot remove the socket %s of the exited daemon "
					"(pid %d): %s",
					path, (int)cred.pid, strerror(-live));
			} else {
				shd_log_info("removed the socket %s of the exited daemon (pid %d)",
					     path, (int)cred.pid);
			}
		} else if (have_pid) {
			shd_log_error("shardd: another daemon already serves %s (pid %d)", path,
				      (int)cred.pid);
			live = 1;
		} else {
			shd_log_error("shardd: another daemon already serves %s", path);
			live = 1;
		}
	} else if (errno == ECONNREFUSED) {
		/* Nobody listens: a daemon died without unlinking. Replace it. */
		if (unlink(path) < 0 && errno != ENOENT) {
			live = -errno;
			shd_log_error("shardd: cannot remove the stale socket %s: %s", path,
				      strerror(-live));
		} else {
			shd_log_info("removed stale socket %s", path);
		}
	} else {
		live = -errno;
		shd_log_error("shardd: cannot probe %s: %s", path, strerror(-live));
	}
	close(fd);
	return live;
}

/*
 * Bind and listen on cfg->socket_path with socket_mode() and socket_group().
 * fd, or the negative errno of the call that failed after printing why.
 */
static int socket_listen(const struct shd_config *cfg)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	const char *path = cfg->socket_path;
	unsigned mode = socket_mode(cfg);
	gid_t gid = socket_group(cfg);
	mode_t old_umask;
	int fd, ret;

	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0) {
		ret = -errno;
		shd_log_error("shardd: socket: %s", strerror(-ret));
		return ret;
	}
	memcpy(sa.sun_path, path, strlen(path) + 1);
	/* Born owner-only, so nobody connects before the group and mode below are set. */
	old_umask = umask(0177);
	ret = bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ? -errno : 0;
	umask(old_umask);
	if (ret < 0) {
		shd_log_error("shardd: cannot bind %s: %s%s", path, strerror(-ret),
			      ret == -EADDRINUSE ? " (another daemon started at the same time?)"
						 : "");
		goto err;
	}
	server.socket_bound = 1;
	if (gid != (gid_t)-1 && chown(path, (uid_t)-1, gid) < 0) {
		ret = -errno;
		shd_log_error("shardd: cannot give the socket %s group %u: %s (shardd's uid %u "
			      "must be root or a member of group %u)",
			      path, (unsigned)gid, strerror(-ret), (unsigned)getuid(),
			      (unsigned)gid);
		goto err;
	}
	if (chmod(path, mode) < 0) {
		ret = -errno;
		shd_log_error("shardd: cannot set mode %04o on the socket %s: %s", mode, path,
			      strerror(-ret));
		goto err;
	}
	if (listen(fd, SOMAXCONN) < 0) {
		ret = -errno;
		shd_log_error("shardd: cannot listen on %s: %s", path, strerror(-ret));
		goto err;
	}
	return fd;
err:
	close(fd);
	return ret;
}

/*
 * The listening socket systemd passed (socket activation, sd_listen_fds(3)):
 * LISTEN_PID is our pid and LISTEN_FDS counts the fds from fd 3. Returns the
 * fd (its path copied into cfg_path), -ENOENT when none was passed, or after
 * printing why the one passed cannot be used -EINVAL (not one listening Unix
 * SOCK_SEQPACKET socket) or fcntl's negative errno.
 */
static int socket_from_systemd(char *cfg_path, size_t path_len)
{
	const char *pid_s = getenv("LISTEN_PID"), *fds_s = getenv("LISTEN_FDS");
	int fd = SHD_LISTEN_FDS_START, type = 0, listening = 0, flags, ret;
	struct sockaddr_un sa;
	socklen_t len = sizeof(type), alen = sizeof(sa);
	char *end;
	long pid, nfds;

	if (!pid_s || !fds_s)
		return -ENOENT;
	errno = 0;
	pid = strtol(pid_s, &end, 10);
	if (errno || *end || pid != (long)getpid())
		return -ENOENT; /* meant for another process (our parent, say) */
	nfds = strtol(fds_s, &end, 10);
	/* Consumed: no child (none exists) and no re-exec may take them for its own. */
	unsetenv("LISTEN_PID");
	unsetenv("LISTEN_FDS");
	unsetenv("LISTEN_FDNAMES");
	if (errno || *end || nfds != 1) {
		shd_log_error("shardd: LISTEN_FDS='%s': shardd takes exactly one socket from "
			      "systemd; give its .socket unit a single ListenSequentialPacket=",
			      fds_s);
		return -EINVAL;
	}
	if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) < 0 || type != SOCK_SEQPACKET ||
	    (len = sizeof(listening), getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len)) <
		    0 ||
	    !listening || getsockname(fd, (struct sockaddr *)&sa, &alen) < 0 ||
	    sa.sun_family != AF_UNIX) {
		shd_log_error(
			"shardd: fd %d from systemd (LISTEN_FDS=1) is not a listening Unix "
			"SOCK_SEQPACKET socket; use ListenSequentialPacket=PATH in the .socket unit",
			fd);
		return -EINVAL;
	}
	flags = fcntl(fd, F_GETFL);
	if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0 ||
	    fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) {
		ret = -errno;
		shd_log_error("shardd: fd %d from systemd: fcntl: %s", fd, strerror(-ret));
		return ret;
	}
	if (alen <= offsetof(struct sockaddr_un, sun_path) || !sa.sun_path[0]) {
		snprintf(cfg_path, path_len, "(fd %d from systemd)", fd);
	} else {
		size_t n = strnlen(sa.sun_path, alen - offsetof(struct sockaddr_un, sun_path));

		snprintf(cfg_path, path_len, "%.*s", (int)n, sa.sun_path);
	}
	return fd;
}

/* SIGTERM and SIGINT arrive on a signalfd; block them before any thread exists. */
static int signals_setup(void)
{
	sigset_t set;

	signal(SIGPIPE, SIG_IGN);
	sigemptyset(&set);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	if (sigprocmask(SIG_BLOCK, &set, NULL) < 0)
		return -errno;
	server.signal_fd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
	return server.signal_fd < 0 ? -errno : 0;
}

static void log_memory_limits(void)
{
	char all[32], job[32];

	shd_log_info("memory limits: %s of buffers in all (%s), %s per job%s",
		     shd_memlimit_str(server.cfg.max_memory, all, sizeof(all)),
		     server.cfg.max_memory_from,
		     shd_memlimit_str(server.cfg.max_job_memory, job, sizeof(job)),
		     server.cfg.backend == SHARDD_BACKEND_HOST
			     ? ""
			     : " (host backend only: device memory is not counted)");
}

int shd_server_init(const struct shd_config *cfg)
{
	struct shd_engine_config ecfg;
	int fd, ret;

	server.cfg = *cfg;
	if (!server.cfg.max_memory) {
		ret = shd_memlimit_default(&server.cfg.max_memory, server.cfg.max_memory_from,
					   sizeof(server.cfg.max_memory_from));
		if (ret < 0) {
			shd_log_error(
				"shardd: cannot read the physical memory size for the default "
				"--max-memory; pass --max-memory BYTES");
			return ret;
		}
	} else {
		snprintf(server.cfg.max_memory_from, sizeof(server.cfg.max_memory_from),
			 "--max-memory");
	}
	if (!server.cfg.max_job_memory)
		server.cfg.max_job_memory = server.cfg.max_memory;
	server.uid = getuid();
	server.pid = getpid();
	server.start_ns = shd_now_ns();
	server.collective_timeout_ns = (uint64_t)(cfg->collective_timeout_s * 1e9);
	server.handshake_timeout_ns = (uint64_t)(cfg->handshake_timeout_s * 1e9);
	server.job_linger_ns = (uint64_t)(cfg->job_linger_s * 1e9);
	shd_log_threshold = cfg->log_level;

	ret = signals_setup();
	if (ret < 0) {
		shd_log_error("shardd: cannot set up signal handling: %s", strerror(-ret));
		return ret;
	}
	fd = socket_from_systemd(server.cfg.socket_path, sizeof(server.cfg.socket_path));
	if (fd < 0 && fd != -ENOENT)
		return fd;
	if (fd >= 0) {
		char def[sizeof(cfg->socket_path)];

		server.listen_fd = fd;
		server.socket_activated = 1;
		shardd_socket_path_default(def, sizeof(def));
		if (strcmp(server.cfg.socket_path, cfg->socket_path) != 0 &&
		    strcmp(cfg->socket_path, def) != 0)
			shd_log_warn("--socket %s ignored: systemd passed the socket %s",
				     cfg->socket_path, server.cfg.socket_path);
		if (cfg->socket_mode || cfg->socket_group_set)
			shd_log_warn(
				"--socket-mode and --socket-group are ignored under socket "
				"activation: set SocketMode= and SocketGroup= in shardd.socket");
	} else {
		ret = socket_dir_prepare(cfg);
		if (ret < 0)
			return ret;
		ret = socket_check_live(cfg->socket_path);
		if (ret != 0)
			return ret < 0 ? ret : -EADDRINUSE;
	}

	memset(&ecfg, 0, sizeof(ecfg));
	ecfg.backend = cfg->backend;
	ecfg.cuda_export = cfg->cuda_export;
	ecfg.collective_timeout_ms = (uint32_t)(server.collective_timeout_ns / 1000000u);
	ecfg.workers = cfg->workers;
	ecfg.max_memory = server.cfg.max_memory;
	ecfg.max_job_memory = server.cfg.max_job_memory;
	ecfg.rank_exec_max = server.cfg.rank_exec_max;
	ecfg.state_dir = server.cfg.state_dir[0] ? server.cfg.state_dir : NULL;
	ecfg.keep = server.cfg.keep;
	ecfg.checkpoint_every = server.cfg.checkpoint_every;
	ecfg.checkpoint_rate = server.cfg.checkpoint_rate;
	ecfg.uid = server.uid;
	ecfg.import_dirs = (const char *const *)server.cfg.import_dirs;
	ecfg.nimport_dirs = server.cfg.nimport_dirs;
	/* Completions and group replies go to the job, which knows each rank's client. */
	ecfg.complete = shd_job_op_done;
	ecfg.reply = shd_job_group_reply;
	ret = shd_engine_create(&ecfg, &server.engine);
	if (ret < 0) {
		shd_log_error("shardd: cannot start the %s backend (see the error above)",
			      shd_backend_name(cfg->backend));
		return ret;
	}
	shd_jobs_init(&(struct shd_jobs_env){
		.list = &server.jobs,
		.engine = server.engine,
		.collective_timeout_ns = server.collective_timeout_ns,
		.collective_timeout_s = server.cfg.collective_timeout_s,
		.linger_ns = server.job_linger_ns,
		.linger_s = server.cfg.job_linger_s,
		.state_dir = server.cfg.state_dir[0] ? server.cfg.state_dir : NULL,
		.keep = server.cfg.keep,
	});

	if (!server.socket_activated) {
		fd = socket_listen(cfg);
		if (fd < 0)
			return fd;
		server.listen_fd = fd;
	}
	server.accept_reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	if (server.accept_reserve_fd < 0) {
		ret = -errno;
		shd_log_error("shardd: cannot open /dev/null: %s", strerror(-ret));
		return ret;
	}
	ret = shd_loop_create(&server.loop);
	if (ret < 0) {
		shd_log_error("shardd: cannot create the io_uring event loop: %s", strerror(-ret));
		return ret;
	}
	shd_sessions_init(&(struct shd_sessions_env){
		.list = &server.sessions,
		.loop = server.loop,
		.engine = server.engine,
		.uid = server.uid,
		.pid = server.pid,
		.allow_gids = server.cfg.allow_gids,
		.nallow_gids = server.cfg.nallow_gids,
		.socket_path = server.cfg.socket_path,
		.listen_fd = server.listen_fd,
		.accept_reserve_fd = &server.accept_reserve_fd,
		.backend = server.cfg.backend,
		.collective_timeout_ns = server.collective_timeout_ns,
		.handshake_timeout_ns = server.handshake_timeout_ns,
		.handshake_timeout_s = server.cfg.handshake_timeout_s,
		.rings_limit = shd_session_rings_limit(server.cfg.max_memory),
		.schedule_close = shd_server_schedule_close,
		.schedule_reap = shd_server_schedule_reap,
		.note_work = shd_server_note_work,
		.admin_request = server_admin_request,
	});
	shd_state_init(&(struct shd_state_source){
		.cfg = &server.cfg,
		.pid = server.pid,
		.uid = server.uid,
		.start_ns = server.start_ns,
		.collective_timeout_ns = server.collective_timeout_ns,
		.engine = &server.engine,
		.jobs = &server.jobs,
		.sessions = &server.sessions,
	});
	if ((ret = shd_loop_add_fd(server.loop, server.listen_fd, POLLIN, shd_session_accept, NULL,
				   NULL)) < 0 ||
	    (ret = shd_loop_add_fd(server.loop, server.signal_fd, POLLIN, server_signal, NULL,
				   NULL)) < 0 ||
	    (ret = shd_loop_add_fd(server.loop, shd_engine_event_fd(server.engine), POLLIN,
				   server_engine_ready, NULL, NULL)) < 0 ||
	    (ret = shd_loop_add_timer(server.loop, SHD_CRON_PERIOD_MS, server_cron, NULL, NULL)) <
		    0) {
		shd_log_error("shardd: cannot register with the event loop: %s", strerror(-ret));
		return ret;
	}
	shd_loop_set_sleep_hooks(server.loop, server_before_sleep, server_after_sleep, NULL);
	if (cfg->metrics_listen[0]) {
		ret = shd_metrics_http_start(cfg->metrics_listen, server.loop,
					     &server.metrics_http);
		if (ret < 0)
			return ret;
		shd_log_info("serving Prometheus metrics on %s",
			     shd_metrics_http_url(server.metrics_http));
	}
	shd_log_info("shardd %s (protocol %d.%d), pid %d, backend %s, collective timeout %g s, "
		     "handshake timeout %g s",
		     SHARDD_VERSION, SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR, (int)server.pid,
		     shd_backend_name(cfg->backend), cfg->collective_timeout_s,
		     cfg->handshake_timeout_s);
	log_memory_limits();
	/* Tests and supervisors wait for exactly this line. */
	fprintf(stderr, "shardd: ready on %s\n", server.cfg.socket_path);
	fflush(stderr);
	return 0;
}

/* ------------------------------------------------------------------ */
/* Run and shutdown                                                    */
/* ------------------------------------------------------------------ */

int shd_server_run(void)
{
	int ret = shd_loop_run(server.loop);

	shd_server_shutdown();
	return ret < 0 ? 1 : 0;
}

void shd_server_shutdown(void)
{
	/* Jobs first: barriers and engine ops fail with -SHARDD_E_SHUTDOWN into live rings. */
	while (server.jobs)
		shd_job_destroy(server.jobs);
	for (struct shd_session *s = server.sessions; s; s = s->next)
		shd_session_close(s, "shardd is shutting down");
	shd_session_reap();
	shd_metrics_http_stop(server.metrics_http, server.loop);
	server.metrics_http = NULL;
	shd_loop_destroy(server.loop);
	server.loop = NULL;
	if (server.engine)
		shd_engine_destroy(server.engine);
	server.engine = NULL;
	if (server.listen_fd >= 0)
		close(server.listen_fd);
	server.listen_fd = -1;
	if (server.accept_reserve_fd >= 0)
		close(server.accept_reserve_fd);
	server.accept_reserve_fd = -1;
	if (server.socket_bound && unlink(server.cfg.socket_path) < 0 && errno != ENOENT)
		shd_log_warn("cannot remove %s: %s", server.cfg.socket_path, strerror(errno));
	server.socket_bound = 0;
	if (server.signal_fd >= 0)
		close(server.signal_fd);
	server.signal_fd = -1;
}
