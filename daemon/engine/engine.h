/* SPDX-License-Identifier: MIT */
/*
 * The op engine: registered groups and the FSDP2 collectives on them.
 *
 * The loop thread hands the engine control messages (register / open group)
 * and ring entries (unshard, reduce, reshard, zero_grad). Rendezvous
 * bookkeeping happens on the loop thread; the arithmetic runs on the worker
 * pool through a backend table (backend.h), so the engine knows nothing of
 * memory kinds. Finished ops are queued and signalled on an eventfd; the loop
 * calls shd_engine_drain, which delivers them through the callbacks below.
 * A task as small as the backend's inline_max_bytes (backend.h) runs on the
 * loop thread instead, and its completions are delivered before the call
 * that started it returns.
 */
#ifndef SHD_ENGINE_H
#define SHD_ENGINE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "shardd_proto.h"

struct shd_engine;     /* one per daemon: backend, worker pool, finished-op queue */
struct shd_engine_job; /* one per job: its groups and their rendezvous */

/*
 * Callbacks run on the loop thread, from inside engine calls (submit,
 * register, drain, cron, rank_gone, job_destroy); they may submit more ops
 * but must not destroy the job or the engine.
 */
/* Deliver a completion for an op submitted with engine_submit (loop thread only). */
typedef void (*shd_engine_complete_fn)(void *job_ctx, uint32_t rank, uint64_t token,
				       const struct shardd_sqe *sqe, int res, const char *msg);
/* Deliver a register/open reply (loop thread only). On success res == 0, reply/layouts/specs/fds/ipc
   valid for the duration of the call (the callee sends them; fds are closed by the engine
   after the call returns): the fds and CUDA IPC handles of the buffers, each in buffer
   order, as reply->export_kind says. On failure res < 0 and msg says why; the pointers are NULL. */
typedef void (*shd_engine_reply_fn)(void *job_ctx, uint32_t rank, uint64_t token, uint32_t seq,
				    int res, const char *msg,
				    const struct shardd_group_reply *reply,
				    const struct shardd_param_layout *layouts,
				    const struct shardd_param_spec *specs, const int *fds, int nfds,
				    const struct shardd_cuda_ipc_handle *ipc, int nipc);

struct shd_engine_config {
	uint32_t backend;     /* enum shardd_backend */
	uint32_t cuda_export; /* cuda backend: enum shd_cuda_export (backend_cuda.h) */
	uint32_t collective_timeout_ms;
	unsigned workers;          /* worker threads; 0 = number of online cores */
	uint64_t max_memory;       /* host backend: bytes of buffers of all jobs; 0 = no limit */
	uint64_t max_job_memory;   /* host backend: bytes of one job's buffers; 0 = no limit */
	const char *state_dir;     /* --state-dir (checkpoints of job J in state_dir/J), or NULL */
	uint32_t keep;             /* --keep: checkpoints kept per job in the state dir; 0 = all */
	uint32_t checkpoint_every; /* --checkpoint-every: a checkpoint at every step boundary that
					     is a multiple of it (needs state_dir); 0 = none */
	/* --checkpoint-rate: MB/s a snapshot's files are written at, at most; 0 = the disk's speed */
	uint32_t checkpoint_rate;
	/* --rank-exec-max: groups registered exec=auto of at most this many unsharded bytes run
	   rank-executed where they can (exec.c) */
	uint64_t rank_exec_max;
	uid_t uid;                      /* shardd's uid: a registration of another uid restores
					     only from under state_dir or import_dirs */
	const char *const *import_dirs; /* --import-dir, each resolved (realpath) */
	unsigned nimport_dirs;
	shd_engine_complete_fn complete;
	shd_engine_reply_fn reply;
};

/* 0 or -errno / -SHARDD_E_BACKEND (logged with shd_log). */
int shd_engine_create(const struct shd_engine_config *cfg, struct shd_engine **out);
void shd_engine_destroy(struct shd_engine *e);
/* The backend that holds every job's buffers (sessions open their fences through it). */
struct shd_backend_ctx *shd_engine_backend(struct shd_engine *e);
/* Readable when finished ops wait: the loop then calls drain. */
int shd_engine_event_fd(struct shd_engine *e);
/* Loop thread: deliver finished ops via the callbacks. */
void shd_engine_drain(struct shd_engine *e);
/* Fail rendezvous past their deadline (call every ~100 ms). */
void shd_engine_cron(struct shd_engine *e, uint64_t now_ns);

/* 0, -ENOMEM or -SHARDD_E_INVALID (mesh out of range). */
int shd_engine_job_create(struct shd_engine *e, void *job_ctx, const char *job_name,
			  uint32_t replicate, uint32_t shard, struct shd_engine_job **out);
/*
 * The job spans the daemon world (docs/MULTINODE.md): its engine mesh is
 * this node's ranks, node `node` of `nodes`, and the whole mesh is
 * replicate x shard (HSDP with replicate = nodes). Before any registration.
 * 0, or -SHARDD_E_INVALID when the meshes do not fit.
 */
int shd_engine_job_span(struct shd_engine_job *j, uint32_t replicate, uint32_t shard,
			uint32_t nodes, uint32_t node);
/* Pending ops fail with -SHARDD_E_SHUTDOWN via callbacks before it returns. */
void shd_engine_job_destroy(struct shd_engine_job *j);
/*
 * shd_engine_job_destroy whose failures say how the job ended: "job 'J'
 * <why> before this op on group 'G' ran" (why: "was ended by ...", NULL: "ended").
 */
void shd_engine_job_end(struct shd_engine_job *j, const char *why);

/* Control plane: payload of SHARDD_MSG_REGISTER_GROUP / OPEN_GROUP (untrusted, validated
   here). Reply via the reply cb, now or later. `uid`: the registering client's (SO_PEERCRED);
   `minor`: its protocol minor (below 5 it runs no rank-executed group). */
void shd_engine_register_group(struct shd_engine_job *j, uint32_t rank, uint64_t token,
			       uint32_t seq, const void *payload, size_t len, uid_t uid,
			       uint16_t minor);
void shd_engine_open_group(struct shd_engine_job *j, uint32_t rank, uint64_t token, uint32_t seq,
			   const void *payload, size_t len, uint16_t minor);
/*
 * SHARDD_MSG_EXEC_MAP of `rank` (client `token`; payload untrusted): 0 with *rep and fds
 * (-1 where none; the caller sends, then closes them), or a negative code
 * with `err` saying why.
 */
int shd_engine_exec_map(struct shd_engine_job *j, uint32_t rank, uint64_t token,
			const void *payload, size_t len, struct shardd_exec_map_reply *rep,
			int fds[2], char *err, size_t errlen);
/*
 * Data plane: `sqe`, copied into daemon memory and checked against the op
 * table (shd_op_check), of an op of group scope (op_table.h); the engine
 * checks only what depends on its state: the group id and the group op's
 * flags. Completes via the complete cb, now or later.
 */
void shd_engine_submit(struct shd_engine_job *j, uint32_t rank, uint64_t token,
		       const struct shardd_sqe *sqe);
/* The rank's client (this token) is gone (EOF, death, goodbye): fail rendezvous it was part
   of (others get -SHARDD_E_PEER_DIED naming it), drop its holds. Its shards stay. */
void shd_engine_rank_gone(struct shd_engine_job *j, uint32_t rank, uint64_t token);
/* The rank attached (again), naming CUDA device `device` (hello.device): groups registered from
   now on put its buffers there, and collectives wait for it again after it left. A rank out of
   the mesh is ignored (the session validated it). */
void shd_engine_rank_attached(struct shd_engine_job *j, uint32_t rank, int32_t device);

/* ---- Introspection for admin requests (loop thread only; results valid until the next engine call) ---- */

/*
 * A rank of a rank-executed group, as its slot and the sync page say
 * (written by the rank itself: counts it reports, not ones the daemon
 * checked).
 */
struct shd_engine_exec_rank {
	uint64_t unshards, reduces, reshards; /* ops it ran */
	uint32_t gen;                         /* its published buffers; 0: not published */
	uint32_t epoch;                       /* the group's */
	uint32_t wait_op;                     /* the op it waits in (enum shardd_op); 0: none */
	uint32_t wait_peer;                   /* shown rank + 1 it waits for */
	uint64_t wait_since_ns;               /* CLOCK_MONOTONIC */
	int grad_present;                     /* its sharded grad holds a reduce's value */
};

/* 0 with *out, or -ENOENT: no such group, not rank-executed, or no such rank. */
int shd_engine_exec_rank(const struct shd_engine_job *j, uint32_t id, uint32_t rank,
			 struct shd_engine_exec_rank *out);

struct shd_group;
struct shd_rdv;

/*
 * Bytes of buffers committed at registration (host backend; 0 on another):
 * by every group of every job, or of one job, registered or still
 * registering. A group's bytes are released when it is freed.
 */
uint64_t shd_engine_memory_committed(const struct shd_engine *e);
uint64_t shd_engine_job_memory_committed(const struct shd_engine_job *j);

/*
 * The total norm of the job's sharded grads (grad_norm.c): 2-norm, or the
 * inf-norm when `inf`; *nonfinite 1 when some element is NaN or Inf. 0, or
 * a negative code with `err` saying why (-SHARDD_E_STATE: a group still
 * runs an op). Loop thread.
 */
int shd_engine_job_grad_norm(struct shd_engine_job *j, int inf, double *norm, int *nonfinite,
			     char *err, size_t errlen);
/*
 * Keep the result of the job's grad_norm of step `step` for its steps with
 * SHARDD_STEP_CLIP_JOB / SHARDD_STEP_SKIP_JOB_NONFINITE: replaces an older
 * result of the same step, else the oldest of the SHARDD_GRAD_NORM_KEPT
 * kept. Loop thread.
 */
void shd_engine_job_grad_norm_keep(struct shd_engine_job *j, uint64_t step, double norm,
				   int nonfinite);
/*
 * grad_norm of an FSDP job across nodes (shd_engine_job_spans_fsdp): _span
 * computes this node's part and starts summing the nodes' parts without
 * waiting (0, or a negative code with `err`); the engine's event fd fires
 * when it ends, and _poll then gives the job-wide norm (0) or the error
 * naming the nodes (negative); 1 while it runs. _abandon gives it up (the
 * job ends). Loop thread.
 */
int shd_engine_job_spans_fsdp(const struct shd_engine_job *j);
int shd_engine_job_grad_norm_span(struct shd_engine_job *j, int inf, uint64_t step, char *err,
				  size_t errlen);
int shd_engine_job_grad_norm_pending(const struct shd_engine_job *j);
int shd_engine_job_grad_norm_poll(struct shd_engine_job *j, double *norm, int *nonfinite, char *err,
				  size_t errlen);
void shd_engine_job_grad_norm_abandon(struct shd_engine_job *j);
/*
 * clip_grad_norm_'s coefficient as torch computes it on a 0-d fp32 norm:
 * min(1, fp32(max_norm) * (1 / (fp32(norm) + fp32(1e-6)))), every
 * operation in fp32 (NaN stays NaN).
 */
float shd_clip_coefficient(double norm, double max_norm);

/*
 * Checkpoints (ckpt_save.c, ckpt_arm.c, docs/CHECKPOINTS.md). The end of a checkpoint,
 * on the loop thread, exactly once: res 0 with `dir` the directory it now
 * is, `bytes` written and `seconds` taken; else a negative code and `msg`.
 */
typedef void (*shd_engine_ckpt_fn)(void *ctx, int res, const char *msg, const char *dir,
				   uint64_t bytes, double seconds);

struct shd_engine_ckpt_target {
	const char *dir;       /* the checkpoint's directory: must not exist yet */
	const char *keep_root; /* with keep > 0: the folder whose oldest step-* directories go */
	uint32_t keep;         /* --keep: checkpoints kept in keep_root; 0 = all */
	uint64_t step;         /* the step boundary it is taken at (the manifest's "step") */
};

/*
 * Start writing a checkpoint of every group of the job into a temporary
 * directory beside `t->dir`, renamed to it once every file and the
 * directory are synced: each group's save runs on the worker pool, in its
 * group's queue, so the group's later ops wait for it. Needs every group
 * registered and idle, and each optimizer's last step the same on every
 * rank. 0: `done` will be called; else a negative code with `err` (done is
 * not called). Loop thread.
 */
int shd_engine_job_checkpoint(struct shd_engine_job *j, const struct shd_engine_ckpt_target *t,
			      shd_engine_ckpt_fn done, void *ctx, char *err, size_t errlen);
/*
 * Arm a checkpoint taken at the job's next step boundary (at once when it
 * is at one now): every group registered and idle, and every optimizer
 * group's last step the same on every rank and in every group. Into `dir`,
 * or with dir NULL into keep_root/step-<that step>; `keep` as above. 0 with
 * *id the checkpoint's id (shd_engine_job_checkpoint_status), or a
 * negative code with `err` (one is armed or being written already).
 */
int shd_engine_job_checkpoint_arm(struct shd_engine_job *j, const char *dir, const char *keep_root,
				  uint32_t keep, uint64_t *id, char *err, size_t errlen);

/*
 * Why a restore failed, or skipped a damaged checkpoint for an older one:
 * the reason label of the restore metrics and `shardctl checkpoints`.
 */
enum shd_engine_restore_reason {
	SHD_RESTORE_DAMAGED,     /* a manifest, size, safetensors header or CRC-32 that fails */
	SHD_RESTORE_MISSING,     /* the manifest, or a file it lists, is not there */
	SHD_RESTORE_MISMATCH,    /* the checkpoint does not hold the group as registered */
	SHD_RESTORE_PERMISSION,  /* a client of another uid named a path outside its roots */
	SHD_RESTORE_IO,          /* reading failed (the errno text says how) */
	SHD_RESTORE_INVALID,     /* a request that cannot be met (no --state-dir, not a file) */
	SHD_RESTORE_MEMORY,      /* the daemon is out of memory */
	SHD_RESTORE_UNSUPPORTED, /* the backend cannot restore */
	SHD_RESTORE_REASONS
};
/* The reason's label ("damaged", "missing", ...); NULL past the last. */
const char *shd_engine_restore_reason_name(uint32_t reason);
/* Restores since the daemon started, every job's (ended ones too): loop thread. */
struct shd_engine_restore_counts {
	uint64_t restored;                       /* groups filled from a checkpoint or weights */
	uint64_t failed[SHD_RESTORE_REASONS];    /* registrations a restore failed, by reason */
	uint64_t fallbacks[SHD_RESTORE_REASONS]; /* damaged checkpoints skipped, by reason */
};
void shd_engine_restore_counts(const struct shd_engine *e, struct shd_engine_restore_counts *c);

#define SHD_ENGINE_CKPT_TEXT 512
/* A job's checkpoints now (admin `checkpoints`): armed, being written, the last one ended. */
struct shd_engine_ckpt_status {
	uint64_t armed_id;                    /* 0: none armed */
	char armed_dir[SHD_ENGINE_CKPT_TEXT]; /* "" when it goes to keep_root/step-N */
	uint64_t writing_id;                  /* 0: none being written */
	uint64_t writing_step;
	char writing_dir[SHD_ENGINE_CKPT_TEXT];
	uint64_t writing_bytes; /* written so far */
	uint64_t writing_total; /* bytes of its tensors: about what it will write */
	double writing_s;       /* since it started */
	uint64_t last_id;       /* 0: none ended yet */
	int last_res;           /* 0 or the failure's code */
	char last_msg[SHD_ENGINE_CKPT_TEXT];
	char last_dir[SHD_ENGINE_CKPT_TEXT];
	uint64_t last_step, last_bytes;
	double last_s;
	int last_staged; /* 1: written from a snapshot in memory (the groups' ops went on) */
	/* Registrations of the job that restored (ckpt_load.c): how they ended */
	uint64_t restored;          /* groups filled from a checkpoint or plain weights */
	uint64_t restore_failed;    /* registrations a restore failed */
	uint64_t restore_fallbacks; /* damaged checkpoints skipped for an older one */
	/* the last failed restore: its group ("" none), reason and whole message */
	char restore_failed_group[SHARDD_NAME_MAX];
	uint32_t restore_failed_reason; /* enum shd_engine_restore_reason */
	char restore_failed_msg[SHD_ENGINE_CKPT_TEXT];
	/* the last fallback: its group ("" none), the damage's reason, what was skipped and why */
	char restore_fallback_group[SHARDD_NAME_MAX];
	uint32_t restore_fallback_reason;
	char restore_fallback_msg[SHD_ENGINE_CKPT_TEXT];
};
void shd_engine_job_checkpoint_status(const struct shd_engine_job *j,
				      struct shd_engine_ckpt_status *st);
/* 1 while a checkpoint of the job is being written. */
int shd_engine_job_checkpointing(const struct shd_engine_job *j);

/* Group ids of the job run 1..ngroups; an id whose registration failed has no group. */
uint32_t shd_engine_job_ngroups(const struct shd_engine_job *j);
/* The group with this id (complete or still registering), or NULL. */
const struct shd_group *shd_engine_job_group(const struct shd_engine_job *j, uint32_t id);
/* The group named `name` (its id is g->id), or NULL. */
const struct shd_group *shd_engine_job_group_named(const struct shd_engine_job *j,
						   const char *name);
/* 1 when every rank registered group `id` and its buffers exist, else 0. */
int shd_engine_group_complete(const struct shd_engine_job *j, uint32_t id);
/*
 * The i-th rendezvous of group `id` that some rank has arrived at (i from 0):
 * *op is 0 for the registration, else SHARDD_OP_UNSHARD or SHARDD_OP_REDUCE.
 * 0, or -ENOENT past the last one (or no such group).
 */
int shd_engine_group_pending(const struct shd_engine_job *j, uint32_t id, uint32_t i, uint32_t *op,
			     const struct shd_rdv **rdv);

#endif /* SHD_ENGINE_H */
