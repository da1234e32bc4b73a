/* SPDX-License-Identifier: MIT */
/*
 * A session: one connected client. It starts in the handshake (peer
 * credentials, HELLO), then owns the client's ring region and doorbell,
 * serves its control messages and takes its ring entries, and delivers
 * completions. The connection's life is the client's life: EOF on the socket
 * or the client's pidfd turning readable ends the session at once.
 *
 * Five files, each calling only those before it: session.c (the object,
 * its list, its end), session_out.c (what it sends, refusals), ring.c (the
 * ring service, the job's sink), hello.c (the handshake), control.c
 * (accept, reading, dispatch). Its job reaches it only through the sink it
 * gave at attach (job.h). None of them reads the daemon's `server` global.
 */
#ifndef SHD_SESSION_H
#define SHD_SESSION_H

#include <stdint.h>
#include <sys/types.h>

#include "metrics.h"
#include "shardd_ctrl.h"
#include "shardd_proto.h"
#include "shardd_ring.h"

struct shd_engine;
struct shd_job;
struct shd_loop;
struct shd_loop_event;
struct shd_session_out;

/*
 * Bytes of replies a session may have queued because its client does not
 * read them (the largest message is 64 MiB); past this the client is dropped.
 */
#define SHD_SESSION_OUT_MAX (64ull * 1024 * 1024)
/*
 * Descriptors a session's queued replies may hold (duplicated, 4 per GROUP
 * reply): a client that asks for group after group and reads none of the
 * replies is dropped here, not when the daemon runs out of descriptors.
 */
#define SHD_SESSION_OUT_MAX_FDS 64
/* Datagrams read from one session per loop turn: a flooding client cannot starve the rest. */
#define SHD_SESSION_READ_BUDGET 64
/*
 * How long a refused connection stays open after its ERROR went out: long
 * enough for the client to read the reply (its EOF usually comes first),
 * short enough that refused connections do not pile up.
 */
#define SHD_SESSION_LINGER_MS 2000

/* The client's credentials, from SO_PEERCRED. */
struct shd_peer {
	pid_t pid;
	uid_t uid;
	gid_t gid;
};

enum shd_session_state {
	SHD_SESSION_HANDSHAKE = 0, /* connected, no HELLO accepted yet */
	SHD_SESSION_ATTACHED = 1,  /* welcomed: rank of a job, ring live */
	SHD_SESSION_DEAD = 2,      /* closed; freed at the next reap */
	SHD_SESSION_LINGER = 3,    /* refused: detached, its ERROR sent, our side shut for
				       * writing; closed at the client's EOF or linger_until_ns */
};

/* Per-session counters, for shardctl. */
struct shd_session_stats {
	uint64_t ops_taken;     /* SQ entries taken */
	uint64_t ops_completed; /* CQ entries pushed */
	uint64_t ops_failed;    /* of those, with res < 0 */
	uint32_t last_taken_op;
	uint64_t last_taken_step;
	uint64_t attached_ns; /* CLOCK_MONOTONIC of the welcome */
};

struct shd_session {
	struct shd_session *next, *prev; /* shd_sessions_env.list */
	uint32_t id;                     /* client_id of the welcome; the engine token */
	int state;                       /* enum shd_session_state */
	int fd;                          /* control socket */
	struct shd_peer cred;            /* SO_PEERCRED at accept */
	struct shd_loop_event *sock_ev;
	struct shardd_ctrl_rx rx; /* control message being reassembled */
	int read_backlog;         /* the last read stopped at the budget: read on next turn */
	uint64_t connected_ns;    /* CLOCK_MONOTONIC of the accept: handshake timeout */
	int spoke;                /* a complete message arrived: no handshake timeout */
	struct shd_session_out *out_head, *out_tail; /* replies not sent yet, in order */
	uint64_t out_bytes;            /* their unsent bytes, <= SHD_SESSION_OUT_MAX */
	int out_fds;                   /* descriptors they hold, <= SHD_SESSION_OUT_MAX_FDS */
	struct shd_loop_event *out_ev; /* POLLOUT, registered while out_head is set */
	/* attached state */
	struct shd_job *job;
	uint32_t rank;
	int32_t device;            /* hello.device */
	uint16_t minor;            /* hello.minor: what the client's replies may hold */
	struct shd_fences *fences; /* SHARDD_MSG_STREAM's events, NULL until then */
	int pidfd;                 /* -1 when the kernel has no pidfd_open */
	struct shd_loop_event *pidfd_ev;
	int doorbell_fd; /* eventfd the client writes when we sleep */
	struct shd_loop_event *doorbell_ev;
	void *ring_mem; /* our mapping of the ring memfd */
	uint64_t ring_size;
	struct shardd_ring ring;
	uint32_t inflight;         /* taken entries whose completion is not pushed yet */
	struct shd_op_clock clock; /* take times of those entries: op latency */
	struct shd_session_stats stats;
	int closing;              /* found broken mid-push: closed at the loop's next safe point */
	char closing_why[256];    /* why, logged when it is closed */
	uint64_t linger_until_ns; /* SHD_SESSION_LINGER: close by then (CLOCK_MONOTONIC) */
};

/*
 * What every session needs from the daemon, given once at start
 * (shd_sessions_init): the session files never read the daemon's global.
 */
struct shd_sessions_env {
	struct shd_session **list; /* head of the daemon's list of sessions */
	struct shd_loop *loop;
	struct shd_engine *engine;
	uid_t uid;               /* clients must run as this uid (or an allowed gid) */
	pid_t pid;               /* the daemon's */
	const gid_t *allow_gids; /* --allow-gid */
	unsigned nallow_gids;
	const char *socket_path;        /* --socket, for messages */
	int listen_fd;                  /* the listening socket */
	int *accept_reserve_fd;         /* /dev/null held back to answer a connection at the
					  * fd limit (shd_session_accept); -1 while spent */
	uint32_t backend;               /* --backend: enum shardd_backend, for the welcome */
	uint64_t collective_timeout_ns; /* for the welcome */
	uint64_t handshake_timeout_ns; /* a connection with no complete message by then is closed */
	double handshake_timeout_s;    /* the same, as given (--handshake-timeout) */
	uint64_t rings_limit;          /* bytes the rings of all sessions may hold; 0: no limit */
	void (*schedule_close)(
		void); /* a session was marked closing: close it at the next safe point */
	void (*schedule_reap)(void);        /* a session died: free it at the next safe point */
	void (*note_work)(uint64_t now_ns); /* some ring had work now (spin window) */
	/* Answer the SHARDD_MSG_ADMIN request `payload` (`len` bytes, untrusted) of session s,
	 * sequence seq: the server hands it to the admin requests (admin.h) and sends the reply. */
	void (*admin_request)(struct shd_session *s, uint32_t seq, const void *payload, size_t len);
};

/* Set the environment of every session; before the first accept. */
void shd_sessions_init(const struct shd_sessions_env *env);

/*
 * The rings of all sessions (their memfds, mapped and written by the
 * daemon) may hold --max-memory / 8 bytes, and at least this.
 */
#define SHD_SESSION_RINGS_MIN (256ull << 20)
/* rings_limit for --max-memory max_memory (0: no limit). */
uint64_t shd_session_rings_limit(uint64_t max_memory);

/* Accept every pending connection on the listening socket (loop callback). */
void shd_session_accept(void *arg, int fd, uint32_t revents);

/*
 * Take entries from the session's SQ while its CQ has unreserved room.
 * Returns the number taken (0 when none or when the session is dead).
 */
unsigned shd_session_service(struct shd_session *s);
/*
 * The loop is about to sleep: set NEED_WAKEUP on the ring and re-check it.
 * Returns 1 when entries that can be taken arrived meanwhile (do not
 * sleep), else 0. Entries stalled on a full CQ keep NEED_WAKEUP set, so the
 * client's next reap rings the doorbell.
 */
int shd_session_prepare_sleep(struct shd_session *s);

/*
 * Push the completion of a taken entry (releases its CQ reservation). `msg`
 * (may be NULL) is the error text. A client whose ring is corrupt is marked
 * closing (shd_session_close_later); completions to a closing session are
 * dropped.
 */
void shd_session_complete(struct shd_session *s, const struct shardd_sqe *sqe, int res,
			  const char *msg);

/*
 * Send a control message to the session's client without ever blocking:
 * what the socket does not take now is queued, in order, and sent when it
 * turns writable (the fds are duplicated and stay with the message's first
 * datagram). Returns 0 (sent or queued), -EINVAL (len over
 * SHARDD_CTRL_MAX or nfds out of range: nothing sent), or another negative
 * errno with the session marked closing: its client hung up, is gone, or
 * let more than SHD_SESSION_OUT_MAX bytes of replies pile up (logged,
 * naming it).
 */
int shd_session_send(struct shd_session *s, uint16_t type, uint32_t seq, const void *payload,
		     uint32_t len, const int *fds, int nfds);

/*
 * Tell the client something it did not ask about: an ERROR (code, text)
 * with seq 0, which libshardd keeps and reports when it then finds its
 * connection closed ("daemon closed the connection: <text>").
 */
void shd_session_notify(struct shd_session *s, int code, const char *text);

/*
 * Send the reply of a group registration or open: SHARDD_MSG_GROUP with the
 * fds of its fd-exported buffers and, after the specs, the handles of its
 * CUDA IPC ones; or SHARDD_MSG_ERROR when res < 0 (shd_session_send).
 */
void shd_session_send_group(struct shd_session *s, uint32_t seq, int res, const char *msg,
			    const struct shardd_group_reply *reply,
			    const struct shardd_param_layout *layouts,
			    const struct shardd_param_spec *specs, const int *fds, int nfds,
			    const struct shardd_cuda_ipc_handle *ipc, int nipc);

/*
 * End the session: detach it from its job (the engine and the barrier learn
 * that the rank is gone), mark its ring dead, close its descriptors. `why` is
 * logged. The memory is freed at the next reap.
 */
void shd_session_close(struct shd_session *s, const char *why);
/*
 * A session found broken while the engine, a barrier or the ring service
 * pushes to it (a failed send, a corrupt ring): stop using it now and close
 * it at the loop's next safe point (shd_session_close_marked), so that no
 * engine loop sees a rank detach in the middle of its own iteration. `why`
 * is kept for the close; the first reason wins.
 */
void shd_session_close_later(struct shd_session *s, const char *why);
/* Close every session marked closing (loop thread, between event callbacks). */
void shd_session_close_marked(void);
/*
 * Read on from a session whose last read stopped at
 * SHD_SESSION_READ_BUDGET (loop thread, between event callbacks).
 * Returns 1 when datagrams are still waiting after this turn's budget.
 */
int shd_session_read_backlog(struct shd_session *s);
/*
 * Close every connection that sent no complete message (no HELLO, no
 * admin request) within the handshake timeout of connecting, naming its
 * pid, and every refused one whose linger ran out. Retries accepting when
 * the fd limit left the listening socket with connections it could not take.
 */
void shd_session_cron(uint64_t now_ns);
/* Free every dead session. */
void shd_session_reap(void);

/* The session attached to `rank` of job `j`, or NULL (views: shardctl, metrics). */
struct shd_session *shd_session_of_rank(const struct shd_job *j, uint32_t rank);

#endif /* SHD_SESSION_H */
