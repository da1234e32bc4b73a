/* SPDX-License-Identifier: MIT */
/*
 * libshardd internals shared by its modules: the handle structs and the
 * error-context helpers. Not installed; symbols here are hidden in the .so.
 */
#ifndef SHARDD_CLIENT_INTERNAL_H
#define SHARDD_CLIENT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/un.h>
#include <time.h>

#include "shardd.h"
#include "shardd_ctrl.h"
#include "shardd_ring.h"

#define SHARDD_HIDDEN __attribute__((visibility("hidden")))

/* Completions reaped while a sync wrapper waited for its own: a FIFO. */
struct shardd_stash {
	struct shardd_completion *v; /* cap slots */
	uint32_t head;               /* index of the oldest */
	uint32_t count;
	uint32_t cap; /* 0 or a power of two */
};

struct shardd_cuda_fences;
struct shardd_xop;
struct shardd_exec_slot;
struct shardd_exec_sync;

struct shardd_client {
	int sock;       /* SOCK_SEQPACKET control connection */
	int doorbell;   /* eventfd the daemon sleeps on */
	void *ring_mem; /* welcome.ring_size bytes, MAP_SHARED rw */
	struct shardd_ring ring;
	struct shardd_welcome welcome;
	uint32_t seq;        /* last control request number */
	int send_timeout_ms; /* SO_SNDTIMEO of sock */
	uint64_t next_sync;  /* counter of sync wrappers' user_data */
	struct shardd_stash stash;
	int32_t daemon_code;                    /* unsolicited ERROR's code, 0 when none came */
	char daemon_text[SHARDD_RING_MSG_SIZE]; /* and its text */
	char job[SHARDD_NAME_MAX];
	uint32_t rank;
	uint32_t shard;
	int32_t device; /* hello.device: where cuda-backend buffers are mapped */
	/* stream.c: events of both rings, NULL until a stream is set */
	struct shardd_cuda_fences *fences;
	void *stream; /* the CUstream ops are ordered with, while stream_set */
	int stream_set;
	char socket_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
	/* exec.c: ops of rank-executed groups not complete yet, in submission order */
	struct shardd_xop *xhead, *xtail;
	/* exec.c: reduces that ran here and whose step ops.c has yet to submit, oldest first */
	struct shardd_xop *xsteps, *xsteps_tail;
	struct {
		/* what the first of them waits for (shardd_exec_progress): a peer's word, or the
		   sync page's change counter (word NULL); mine NULL: none */
		struct shardd_exec_slot *mine;
		uint64_t *word;
		uint64_t seen;
		struct shardd_exec_sync *sync;
		uint32_t changes;
	} xwait;
};

/* One mapped buffer of a group. */
struct shardd_mapping {
	void *addr; /* NULL when size is 0; a device address under the cuda backend */
	uint64_t size;
	uint64_t cuda_size;  /* cuda backend: shardd_cuda_mapping.size; 0: a host mmap */
	uint32_t cuda_kind;  /* cuda backend: how it was imported (enum shardd_export_kind) */
	int32_t cuda_device; /* cuda backend: the device it was imported on */
};

/*
 * Where one param's shard sits in the full tensor, by FSDP2's padded
 * chunking along shard_dim: the tensor is outer x dim x inner elements,
 * this rank holds rows [begin, begin + rows) of dim, of which `valid`
 * are real data (dim-0 padding; Shard(i > 0) is even, so always all).
 */
struct shardd_shard_geometry {
	uint64_t numel;
	uint64_t outer;
	uint64_t dim;
	uint64_t inner;
	uint64_t rows;
	uint64_t begin;
	uint64_t valid;
	uint64_t shard_numel;
};

enum shardd_group_buf {
	SHARDD_BUF_UNSHARDED = 0,
	SHARDD_BUF_GRAD,
	SHARDD_BUF_SHARD,
	SHARDD_BUF_SHARD_GRAD,
	SHARDD_BUF_COUNT
};

struct shardd_group {
	struct shardd_client *client;
	char name[SHARDD_NAME_MAX];
	struct shardd_group_reply info;
	struct shardd_param_layout *layouts; /* info.nparams */
	struct shardd_param_spec *specs;     /* info.nparams, from the GROUP reply */
	struct shardd_mapping buf[SHARDD_BUF_COUNT];
	struct shardd_exec_state *x; /* rank-executed (exec.c); NULL for a daemon-executed group */
	/* rank-executed, opened again by the client that holds it: its shard and grad buffer
	   are mapped read-only here, and its ops run through the first handle */
	int exec_second;
};

/* One iteration of a spin-wait: let the sibling hyperthread run. */
static inline void shardd_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield" ::: "memory");
#else
	atomic_signal_fence(memory_order_seq_cst);
#endif
}

/* CLOCK_MONOTONIC, for the deadlines of waits. */
static inline int64_t shardd_client_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int64_t shardd_client_now_ms(void)
{
	return shardd_client_now_ns() / 1000000;
}

/*
 * error.c: the thread-local context chain. Public calls clear it on entry,
 * the place a failure starts sets it, each layer above prefixes its own
 * context. Set and wrap return `err`.
 */
SHARDD_HIDDEN void shardd_err_clear(void);
SHARDD_HIDDEN int shardd_err_set(int err, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
SHARDD_HIDDEN int shardd_err_wrap(int err, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

/*
 * client.c: send one control request and receive its reply, waiting up to
 * timeout_ms (-1: while the daemon lives). An ERROR reply becomes its code
 * with "daemon: <text>" as the error context. On success `rx` holds a
 * reply of type `want` (payload and fds owned by the caller).
 */
SHARDD_HIDDEN int shardd_client_request(struct shardd_client *c, uint16_t type, const void *payload,
					uint32_t len, int timeout_ms, uint16_t want,
					struct shardd_ctrl_rx *rx);

/*
 * client.c: is the daemon still there? 0, or -ECONNRESET with the reason
 * (connection closed, ring marked dead). Reads a pending notice ERROR.
 */
SHARDD_HIDDEN int shardd_client_check_alive(struct shardd_client *c);

/*
 * stream.c: with a stream set, record the event of SQ slot `slot` on it and
 * fence `sqe`; without, nothing. 0 or a code with context.
 */
SHARDD_HIDDEN int shardd_client_fence_submit(struct shardd_client *c, uint32_t slot,
					     struct shardd_sqe *sqe);
/*
 * stream.c: a fenced completion in CQ slot `slot`, before the slot is
 * released: order the stream after the op (or, with none set now, wait
 * here). A failure becomes the completion's error.
 */
SHARDD_HIDDEN void shardd_client_fence_reap(struct shardd_client *c, uint32_t slot,
					    struct shardd_completion *cp);

/*
 * group.c: check how a GROUP reply's buffers travel: every info->export_kind
 * known and allowed under `backend` (CUDA IPC only under the cuda backend),
 * `nfds` fds for the FD buffers, and `tail` payload bytes after the param
 * specs holding exactly the CUDA IPC handles. Returns the number of
 * handles, or -SHARDD_E_MALFORMED with the error context naming the field
 * and the value.
 */
SHARDD_HIDDEN int shardd_group_check_exports(const struct shardd_group_reply *info,
					     uint32_t backend, int nfds, size_t tail);

/*
 * geometry.c: the first dim (< ndim) at which the product of `p`'s nonzero
 * dims stops fitting 64 bits as a byte count of up to 8-byte elements, or
 * -1 when it fits.
 */
SHARDD_HIDDEN int shardd_shape_overflow_dim(const struct shardd_param_spec *p);
/*
 * geometry.c: param `p`'s geometry for shard rank `shard_rank` of `world`
 * (`p` checked: ndim and shard_dim in range). 0, -EOVERFLOW or -EINVAL
 * (Shard(i > 0) that does not split evenly).
 */
SHARDD_HIDDEN int shardd_group_geometry(const struct shardd_param_spec *p, uint32_t world,
					uint32_t shard_rank, struct shardd_shard_geometry *geo);

/*
 * exec.c: a rank-executed group (info.exec RANKS) after its GROUP reply was
 * mapped: map the sync page (`sync_fd`, still the caller's), check the slot, and
 * publish this rank's buffers to its peers (EXEC_MAP). 0 or a code with
 * context.
 */
SHARDD_HIDDEN int shardd_exec_attach(struct shardd_group *g, int sync_fd);
SHARDD_HIDDEN void shardd_exec_detach(struct shardd_group *g);
/*
 * exec.c: submit unshard, reduce or reshard of a rank-executed group. Its
 * inputs are final now: the op is published to the peers, and runs in
 * this process as they arrive, when the client polls or waits
 * (shardd_exec_progress), with the daemon's numbers and errors. Its
 * completion goes to the stash, or with `out` there (and *finished set),
 * for a sync call. A reduce with SHARDD_REDUCE_STEP (`args`: its lr) then
 * submits its step to the daemon, whose completion is the op's. 0, or a
 * code with context (nothing was submitted).
 */
SHARDD_HIDDEN int shardd_exec_submit(struct shardd_group *g, uint32_t op, uint64_t step,
				     uint32_t flags, const uint64_t *args, uint64_t user_data,
				     struct shardd_completion *out, int *finished);
/* Some op of a rank-executed group is pending. */
SHARDD_HIDDEN int shardd_exec_pending(const struct shardd_client *c);
/*
 * Advance every pending op as far as it goes without waiting: the number
 * completed, or a negative code (a completion could not be queued).
 */
SHARDD_HIDDEN int shardd_exec_progress(struct shardd_client *c);
/* Sleep up to max_ns on what the first pending op waits for (after a progress pass). */
SHARDD_HIDDEN void shardd_exec_nap(struct shardd_client *c, int64_t max_ns);
/*
 * The daemon detached this client (its job ended, or it is gone): every
 * pending op fails with `res` and `msg` (no peer can finish it with this
 * rank now), and the steps its reduces asked for are dropped. The number
 * failed, or a negative code (a completion could not be queued).
 */
SHARDD_HIDDEN int shardd_exec_fail_all(struct shardd_client *c, int res, const char *msg);
/* Drop the group's pending ops and unsubmitted steps (it is being closed). */
SHARDD_HIDDEN void shardd_exec_forget(struct shardd_client *c, const struct shardd_group *g);

/*
 * A rank-executed reduce with SHARDD_REDUCE_STEP that ran here: the
 * daemon's REDUCE entry that runs its step (ops.c submits it; its
 * completion is the op's).
 */
struct shardd_exec_step {
	uint32_t group_id, flags;
	uint64_t step, user_data;
	uint64_t args[2];
};

/* exec.c: the oldest such step not submitted yet, taken into *out: 1, or 0 when none. */
SHARDD_HIDDEN int shardd_exec_next_step(struct shardd_client *c, struct shardd_exec_step *out);

/* stash.c: queue a completion for poll and wait (0 or -ENOMEM with context); take the oldest (1, or 0). */
SHARDD_HIDDEN int shardd_stash_push(struct shardd_stash *s, const struct shardd_completion *cp);
SHARDD_HIDDEN int shardd_stash_pop(struct shardd_stash *s, struct shardd_completion *out);

/* ops.c: submit one op and wait for its own completion; returns its res. */
SHARDD_HIDDEN int shardd_client_op_sync(struct shardd_client *c, uint32_t op, uint32_t group,
					uint64_t step, uint32_t flags, const char *what);
/* The same with sqe.arg[0..1] = args[0..1] (NULL: zero), e.g. a step's lr and clip coefficient. */
SHARDD_HIDDEN int shardd_client_op_sync_args(struct shardd_client *c, uint32_t op, uint32_t group,
					     uint64_t step, uint32_t flags, const uint64_t *args,
					     const char *what);

#endif /* SHARDD_CLIENT_INTERNAL_H */
