/* SPDX-License-Identifier: MIT */
/*
 * libshardd: the C client of shardd, the per-node ZeRO-3 parameter server.
 *
 * A trainer process ("rank") attaches to the daemon with shardd_connect(),
 * registers its parameter groups and gets their buffers as shared memory,
 * then submits ops (unshard, reduce, reshard, zero_grad, nop, barrier)
 * through a shared-memory ring and reaps their completions.
 *
 * Return values: every call that can fail returns 0 (or a documented
 * non-negative value) or a negative error code, either -errno or
 * -SHARDD_E_* from shardd_proto.h. shardd_strerror() names a code;
 * shardd_last_error() gives the calling thread's full context chain of the
 * last failure, including the daemon's own message text.
 *
 * Threading: a client handle, and the groups opened through it, are used by
 * one thread at a time (callers serialize); different handles are
 * independent and may be used from different threads at once. Buffer
 * mappings of a group stay valid until shardd_group_close(), even after
 * the client handle is closed. Close every group before or after its
 * client, but use a group's ops only while its client is open. (Under
 * the cuda backend's legacy IPC export, the memory also ends when the
 * daemon ends the job: docs/CUDA.md.)
 */
#ifndef SHARDD_H
#define SHARDD_H

#include <stdint.h>

#include "shardd_proto.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The libshardd release this header belongs to (the Makefile's VERSION);
 * shardd_version() says which release the library linked at run time is.
 */
#define SHARDD_VERSION_MAJOR  0
#define SHARDD_VERSION_MINOR  1
#define SHARDD_VERSION_PATCH  0
#define SHARDD_VERSION_STRING "0.1.0"

/* user_data values with this bit set are reserved for the sync wrappers. */
#define SHARDD_USER_DATA_RESERVED (1ull << 63)

/* Handshake timeout used when shardd_attach_opts.timeout_ms is 0. */
#define SHARDD_CONNECT_TIMEOUT_MS 10000

/* A call kept under its old name for one release: using it warns with its replacement. */
#define SHARDD_DEPRECATED(use) __attribute__((deprecated(use)))

/* ------------------------------------------------------------------ */
/* Structs                                                             */
/* ------------------------------------------------------------------ */

struct shardd_client; /* opaque: one attachment of one rank */
struct shardd_group;  /* opaque: one group's layout and buffer mappings */

struct shardd_attach_opts {
	const char *socket_path; /* NULL or "": $SHARDD_SOCKET, else the default path */
	const char *job;         /* job name, shorter than SHARDD_NAME_MAX */
	uint32_t rank;           /* global rank = replica * shard + shard_rank */
	uint32_t replicate;      /* mesh rows (1 for plain FSDP) */
	uint32_t shard;          /* mesh columns: shard group size */
	int32_t device;          /* CUDA device ordinal, or SHARDD_HELLO_DEVICE_HOST */
	uint32_t ring_entries;   /* SQ/CQ capacity to ask for; 0: the daemon's default */
	int timeout_ms;          /* handshake timeout; 0: SHARDD_CONNECT_TIMEOUT_MS */
};

/* One param of a group to register. */
struct shardd_param_desc {
	const char *name; /* unique in the group, shorter than SHARDD_PARAM_NAME_MAX */
	uint32_t dtype;   /* enum shardd_dtype: the param's original dtype */
	uint32_t ndim;    /* 0..SHARDD_MAX_DIMS */
	uint64_t shape[SHARDD_MAX_DIMS]; /* first ndim used */
	uint32_t shard_dim;              /* FSDP2 Shard(i); 0 for the default dim-0 sharding */
};

/*
 * FSDP2's MixedPrecisionPolicy: the dtypes a group's collectives run in.
 * SHARDD_DTYPE_NONE (0) leaves one unset: each param's own dtype.
 */
struct shardd_precision {
	uint32_t param_dtype;  /* the unsharded buffer's dtype, the unshard's output */
	uint32_t reduce_dtype; /* the dtype the reduce-scatter sums in */
};

/* What the daemon keeps for a group besides its buffers. */
struct shardd_group_opts {
	/*
	 * The daemon's optimizer for the group (shardd_step), or NULL: none.
	 * Every rank registers the same config; its params must be fp32.
	 */
	const struct shardd_optim_config *optimizer;
	/*
	 * Where the group's params and optimizer state come from
	 * (docs/CHECKPOINTS.md): NULL, zeroed shards; "", the job's newest
	 * checkpoint in the daemon's --state-dir (zeroed when there is none: a
	 * first run); else a checkpoint directory, or a folder of step-N
	 * checkpoints (its newest), saved at any mesh; or plain safetensors
	 * weights to import by name (a .safetensors file, or a directory with
	 * model.safetensors.index.json or model.safetensors), converted to the
	 * params' dtypes. Every rank names the same.
	 * shardd_group_last_step() then says the step to resume after.
	 */
	const char *restore;
	/*
	 * Who moves the group's bytes (enum shardd_exec, docs/DESIGN.md "Who
	 * moves the bytes"): SHARDD_EXEC_AUTO (0: the daemon picks by size,
	 * --rank-exec-max), SHARDD_EXEC_DAEMON, or SHARDD_EXEC_RANKS (this
	 * library runs unshard, reduce and reshard in the submitting thread,
	 * on the job's shared buffers). Every rank registers the same.
	 */
	uint32_t exec;
};

/* One reaped completion. */
struct shardd_completion {
	uint64_t user_data; /* as submitted */
	int32_t res;        /* 0 or a negative error code */
	uint32_t op;        /* enum shardd_op */
	uint32_t group;     /* group id, 0 for nop and barrier */
	uint64_t step;      /* as submitted */
	/* the cqe's result words: grad_norm's (shardd_grad_norm_result); a barrier
	 * mismatch's other barrier number in [0]; else 0 */
	uint64_t result[2];
	char msg[SHARDD_RING_MSG_SIZE]; /* daemon's error text, "" when none */
};

/* Snapshot of a client's ring, for diagnosing who is behind. */
struct shardd_ring_status {
	uint32_t sq_entries;     /* SQ capacity */
	uint32_t cq_entries;     /* CQ capacity */
	uint32_t sq_pending;     /* submitted, not yet taken by the daemon */
	uint32_t cq_ready;       /* completed, not yet reaped */
	uint32_t flags;          /* SHARDD_RING_* as the daemon last wrote them */
	uint32_t daemon_last_op; /* last op the daemon took from this SQ */
	uint64_t daemon_last_step;
	uint64_t daemon_heartbeat_ns; /* CLOCK_MONOTONIC of the daemon's last loop turn */
	uint32_t client_last_op;      /* last op this client submitted */
	uint64_t client_last_step;
};

/* ------------------------------------------------------------------ */
/* Attach                                                              */
/* ------------------------------------------------------------------ */

/*
 * Connect to the daemon, say HELLO for (job, rank, mesh) and map the ring.
 * Returns 0 and *out, or a negative code: -SHARDD_E_* from the daemon's
 * ERROR reply (its text is in shardd_last_error()), -ETIMEDOUT, -errno.
 */
int shardd_connect(const struct shardd_attach_opts *o, struct shardd_client **out);

/* Say GOODBYE, unmap the ring, close the connection. NULL is a no-op. */
void shardd_close(struct shardd_client *c);

/* The library's release, "MAJOR.MINOR.PATCH": SHARDD_VERSION_STRING of the headers it was built with. */
const char *shardd_version(void);

/* Daemon-wide id of this connection, from the WELCOME. */
int shardd_client_id(const struct shardd_client *c);

/* The daemon's collective timeout in ms (0: none). */
uint32_t shardd_client_collective_timeout_ms(const struct shardd_client *c);

/* SQ capacity: how many submissions may be in flight at once. */
uint32_t shardd_client_ring_entries(const struct shardd_client *c);

/*
 * The daemon's backend (enum shardd_backend). SHARDD_BACKEND_CUDA: group
 * buffers are device memory on this rank's device (opts.device), and the
 * shardd_group_* pointers are device addresses.
 */
uint32_t shardd_client_backend(const struct shardd_client *c);

/* Fill *st from the ring header. Returns 0 or -EBADMSG (corrupt counters). */
int shardd_client_ring_status(const struct shardd_client *c, struct shardd_ring_status *st);

/* ------------------------------------------------------------------ */
/* Groups                                                              */
/* ------------------------------------------------------------------ */

/*
 * Register a group of `nparams` params (collective: the daemon answers once
 * every rank of the job has registered it, or fails after its collective
 * timeout) and map its buffers. `precision` NULL: every dtype unset;
 * `opts` NULL: no optimizer, zeroed shards. Returns 0 and *out, or a
 * negative code with shardd_last_error().
 */
int shardd_group_register(struct shardd_client *c, const char *name,
			  const struct shardd_param_desc *params, uint32_t nparams,
			  const struct shardd_precision *precision,
			  const struct shardd_group_opts *opts, struct shardd_group **out);

/*
 * Open a group some rank registered, by name, and map its buffers (a rank
 * re-attaching after a crash). The GROUP reply carries the registered param
 * specs, so shardd_group_find() and shardd_group_load_full() work as on a
 * registered group.
 */
int shardd_group_open(struct shardd_client *c, const char *name, struct shardd_group **out);

/* Unmap the group's buffers and free it. NULL is a no-op. */
void shardd_group_close(struct shardd_group *g);

uint32_t shardd_group_id(const struct shardd_group *g);
uint32_t shardd_group_nparams(const struct shardd_group *g);
const struct shardd_group_reply *shardd_group_info(const struct shardd_group *g);

/* Layout of param `param`, or NULL when out of range. */
const struct shardd_param_layout *shardd_group_layout(const struct shardd_group *g, uint32_t param);

/* Index of the param named `param_name`, or -ENOENT. */
int shardd_group_find(const struct shardd_group *g, const char *param_name);

/*
 * Where param `param` lives in each mapping, or NULL when out of range:
 * the unsharded tensor (read-only, param_dtype), this rank's unsharded
 * gradient (grad dtype), its shard in the flat shard (original dtype,
 * padding rows included) and its sharded grad. Under the cuda backend these
 * are device addresses, and the unsharded tensor is read-only by convention
 * only (the device cannot enforce it): never write it. Without a stream
 * (shardd_stream_set), a completion means the daemon's results are in
 * device memory, and shards and grads must be written (the stream
 * synchronised) before submitting the op that reads them.
 */
const void *shardd_group_unsharded(const struct shardd_group *g, uint32_t param);
void *shardd_group_grad(const struct shardd_group *g, uint32_t param);
void *shardd_group_shard(const struct shardd_group *g, uint32_t param);
void *shardd_group_shard_grad(const struct shardd_group *g, uint32_t param);

/*
 * Copy this rank's shard of param `param` out of `full`, the whole tensor in
 * the param's own dtype and original shape (row-major), into the flat
 * shard; padding rows are zeroed. Handles Shard(i > 0). Under the cuda
 * backend `full` is host memory all the same: the rows are copied to the
 * device, and are there when the call returns. Returns 0, -EINVAL (param
 * out of range, or no data), -ENOMEM, or a CUDA failure with
 * shardd_last_error().
 */
int shardd_group_load_full(struct shardd_group *g, uint32_t param, const void *full);

/* ------------------------------------------------------------------ */
/* Ops: asynchronous                                                   */
/* ------------------------------------------------------------------ */

/*
 * Queue one op of group g (unshard, reduce, reshard, zero_grad); its
 * completion echoes user_data. Returns 0, -EAGAIN when the SQ is full
 * (reap completions, then retry) or -EINVAL (op outside 1..255, user_data
 * with SHARDD_USER_DATA_RESERVED set). The daemon checks everything else
 * and answers a bad op with an error completion.
 */
int shardd_group_submit(struct shardd_group *g, uint32_t op, uint64_t step, uint32_t flags,
			uint64_t user_data);

/*
 * The same for an op of no group, the client's job-wide ones (nop,
 * barrier, checkpoint): sqe.group is 0.
 */
int shardd_client_submit(struct shardd_client *c, uint32_t op, uint64_t step, uint32_t flags,
			 uint64_t user_data);

/* Reap one completion without waiting: 0 and *out, -EAGAIN when none, -EBADMSG. */
int shardd_poll(struct shardd_client *c, struct shardd_completion *out);

/*
 * Reap one completion, waiting up to timeout_ms (< 0: no limit, while the
 * daemon lives; 0: check once). Returns 0 and *out, -ETIMEDOUT,
 * -ECONNRESET (the daemon is gone), the code of the notice the daemon sent
 * when it detached this client (-SHARDD_E_SHUTDOWN: `shardctl end` ended
 * its job) or -EBADMSG.
 */
int shardd_wait(struct shardd_client *c, struct shardd_completion *out, int timeout_ms);

/* ------------------------------------------------------------------ */
/* Ops: synchronous                                                    */
/* ------------------------------------------------------------------ */

/*
 * Each submits one op, waits for that op's completion (completions of
 * other ops that arrive meanwhile are kept for shardd_poll/shardd_wait)
 * and returns its res: 0, the daemon's error (text in shardd_last_error()),
 * -ECONNRESET (the daemon is gone), the code of the daemon's notice when it
 * detached this client (as shardd_wait), or -ETIMEDOUT when no completion
 * came within the daemon's collective timeout + 10 s.
 */
int shardd_nop(struct shardd_client *c);
int shardd_barrier(struct shardd_client *c, uint64_t barrier_number);
int shardd_unshard(struct shardd_group *g, uint64_t step);
int shardd_reduce(struct shardd_group *g, uint64_t step, uint32_t flags);
int shardd_reshard(struct shardd_group *g, uint64_t step);
int shardd_zero_grad(struct shardd_group *g);

/*
 * The group's optimizer (registered in shardd_group_opts.optimizer) on this
 * rank's shard for step `step` (>= 1) with learning rate `lr`. `flags`:
 * - SHARDD_STEP_CLIP: multiply the grad by `clip_coef`, a coefficient
 *   (clip_grad_norm_'s max_norm / (total_norm + 1e-6), clamped to 1);
 * - SHARDD_STEP_CLIP_JOB: clip by clip_grad_norm_'s `max_norm` (finite,
 *   > 0) instead, the daemon computing the coefficient from the job's
 *   grad_norm of `step` (shardd_grad_norm); one of the two clips at most;
 * - SHARDD_STEP_SKIP_NONFINITE: skip when this rank's grad holds a NaN or
 *   Inf; SHARDD_STEP_SKIP_JOB_NONFINITE: skip when the job's grad_norm of
 *   `step` was non-finite, on every rank alike;
 * - SHARDD_STEP_REPLAY, alone: apply the step as the group's other ranks
 *   submitted it (`lr`, `clip_coef` and `max_norm` are ignored).
 * `clip_coef` and `max_norm` are ignored without their flag. The shard's
 * sharded grad is cleared. Exactly once: a step at or below the last one
 * applied or skipped on this shard changes nothing. Returns
 * SHARDD_STEP_APPLIED (0), SHARDD_STEP_SKIPPED, SHARDD_STEP_ALREADY, or a
 * negative code.
 */
int shardd_step(struct shardd_group *g, uint64_t step, double lr, uint32_t flags, double clip_coef,
		double max_norm);
/* The same queued without waiting, as shardd_group_submit: its completion's res is the step's result. */
int shardd_step_submit(struct shardd_group *g, uint64_t step, double lr, uint32_t flags,
		       double clip_coef, double max_norm, uint64_t user_data);

/*
 * Queue the reduce of `step` with SHARDD_REDUCE_STEP (added to `flags`):
 * the daemon steps this rank's shard with `lr` as soon as the reduce has
 * finished (no clipping, no skipping), so the update overlaps the
 * trainer's backward of earlier layers. Every rank of the collective sets
 * the flag. The completion's res is the step's result, as shardd_step's.
 */
int shardd_reduce_step_submit(struct shardd_group *g, uint64_t step, uint32_t flags, double lr,
			      uint64_t user_data);

/*
 * Job-wide: every rank of the job calls it with the same `step` and
 * `norm_type` (2.0 or INFINITY); each gets the total norm of every group's
 * sharded grads (each HSDP replica counted once, padding rows excluded,
 * absent grads as zero) in *norm, and in *nonfinite 1 when some element is
 * NaN or Inf (then *norm is NaN or Inf). clip_grad_norm_'s total_norm with
 * no all-reduce by the trainer. Submit it after the completions of the
 * step's reduces: a group with an op still running fails it
 * (-SHARDD_E_STATE). Returns 0 or a negative code; a mismatch of step or
 * norm_type between ranks fails every waiting rank (-SHARDD_E_MISMATCH).
 */
int shardd_grad_norm(struct shardd_client *c, uint64_t step, double norm_type, double *norm,
		     int *nonfinite);
/* The same queued without waiting; shardd_grad_norm_result reads its completion. */
int shardd_grad_norm_submit(struct shardd_client *c, uint64_t step, double norm_type,
			    uint64_t user_data);
/* The norm and the non-finite flag of a grad_norm completion with res 0. */
void shardd_grad_norm_result(const struct shardd_completion *cp, double *norm, int *nonfinite);

/*
 * Job-wide, every rank with the same `step` after the step's ops completed:
 * the daemon writes every group's params and optimizer state to
 * <--state-dir>/<job>/step-<step> (docs/CHECKPOINTS.md) and completes each
 * rank's op once the checkpoint is durable. 0 or a negative code as above
 * (-SHARDD_E_INVALID: the daemon has no --state-dir).
 */
int shardd_checkpoint(struct shardd_client *c, uint64_t step);

/*
 * The last step applied or skipped on this rank's shard when the group was
 * registered or opened (0: none): where a re-attached rank resumes.
 */
uint64_t shardd_group_last_step(const struct shardd_group *g);
/*
 * The highest last_step of any rank of the group at the same moment (0
 * from a daemon of protocol minor < 4): a restarted rank whose own
 * last_step is one lower replays that step (SHARDD_STEP_REPLAY) to catch
 * up with the others.
 */
uint64_t shardd_group_peer_last_step(const struct shardd_group *g);

/* ------------------------------------------------------------------ */
/* Stream ordering (cuda backend)                                      */
/* ------------------------------------------------------------------ */

/*
 * Order this rank's ops with `stream` (a CUstream / cudaStream_t on the
 * rank's device, opts.device; NULL is that device's legacy default
 * stream) instead of CPU waits:
 * - each submission first records an event on `stream`, and the daemon's
 *   work for the op waits for it: finish nothing before submitting;
 * - each completion, whichever call reaps it, makes `stream` wait for the
 *   op's device work before the call returns it. A completion then comes
 *   as soon as the daemon has queued the work: work queued on `stream`
 *   after the reap sees the results; other streams must wait on `stream`.
 * The first call sets up the events (one per ring slot each way, one
 * control round trip); later calls switch streams. Returns 0, -ENOTSUP
 * (host backend, or a libshardd built without CUDA), or a negative code
 * with shardd_last_error().
 */
int shardd_stream_set(struct shardd_client *c, void *stream);

/*
 * Back to CPU ordering: a completion means the results are in memory (one
 * of an op submitted while a stream was set is waited for when reaped).
 */
void shardd_stream_clear(struct shardd_client *c);

/* ------------------------------------------------------------------ */
/* Errors                                                              */
/* ------------------------------------------------------------------ */

/* Text for 0, -errno or -SHARDD_E_*; never NULL. */
const char *shardd_strerror(int err);

/*
 * The calling thread's last failure with its context chain, e.g.
 * "register group 'layer3': daemon: param 'w' dtype 9: unknown dtype".
 * "" when nothing failed yet. Valid until the thread's next libshardd call.
 */
const char *shardd_last_error(void);

/* ------------------------------------------------------------------ */
/* Deprecated: the old names, kept for one release                     */
/* ------------------------------------------------------------------ */

/* An op with a raw group id (0: none): shardd_group_submit or shardd_client_submit. */
SHARDD_DEPRECATED("use shardd_group_submit, or shardd_client_submit for an op of no group")
int shardd_submit(struct shardd_client *c, uint32_t op, uint32_t group, uint64_t step,
		  uint32_t flags, uint64_t user_data);

/* The client accessors under their old names. */
SHARDD_DEPRECATED("use shardd_client_collective_timeout_ms")
uint32_t shardd_collective_timeout_ms(const struct shardd_client *c);
SHARDD_DEPRECATED("use shardd_client_ring_entries")
uint32_t shardd_ring_entries(const struct shardd_client *c);
SHARDD_DEPRECATED("use shardd_client_backend")
uint32_t shardd_backend(const struct shardd_client *c);
SHARDD_DEPRECATED("use shardd_client_ring_status")
int shardd_ring_status(const struct shardd_client *c, struct shardd_ring_status *st);

#ifdef __cplusplus
}
#endif

#endif /* SHARDD_H */
