/* SPDX-License-Identifier: MIT */
/*
 * The op engine's private state, shared by its files, among them:
 *
 *   engine.c      the engine and its jobs: create/destroy, job lifecycle,
 *                 submit and dispatch of ring entries, per-rank order
 *                 (deferred ops), departures and the cron, introspection
 *   registry.c    registration and OPEN_GROUP: a group's spec, memory,
 *                 placement and buffers, and its replies; a group by name
 *   collective.c  unshard and reduce rendezvous: arrival, launch, failure,
 *                 departure and timeout of a collective
 *   task.c        what each op computes (unshard, reduce-scatter, HSDP
 *                 partials and all-reduce, zero_grad) and where it runs:
 *                 the loop thread or the worker pool, and delivery
 *   step.c        the optimizer step's exactly-once policy (step.h): a
 *                 step admitted or refused, planned in its task, recorded
 *   delivery.c    below the others: the text of a failure, an op's
 *                 completion and a failed reply through the engine's
 *                 callbacks, the words of an expired rendezvous
 *
 * Everything here is loop-thread state unless a field says otherwise.
 */
#ifndef SHD_ENGINE_INT_H
#define SHD_ENGINE_INT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "engine.h"
#include "group.h"
#include "op_table.h"
#include "pool.h"
#include "rendezvous.h"
#include "shardd_proto.h"

#define ENGINE_MSG_MAX 512
/* "rank 3" / "ranks 2,3" of a collective's or a registration's ranks in a message. */
#define ENGINE_WHO_MAX 168

/* One submitted op waiting for its completion. */
struct eng_op {
	uint32_t rank;
	uint64_t token;
	struct shardd_sqe sqe;
	int res; /* a task's result of this op when the task's res is 0 (a step's outcome) */
	/* A step's job-wide decisions, taken at submission from the job's grad_norm (step.c). */
	uint8_t job_skip;     /* SHARDD_STEP_SKIP_JOB_NONFINITE and the norm was non-finite */
	uint8_t job_clip_set; /* SHARDD_STEP_CLIP_JOB: job_clip is the coefficient */
	float job_clip;
};

/* The result of one grad_norm of the job, kept for the steps that clip or skip by it. */
struct eng_gnorm_rec {
	uint64_t step; /* 0: empty slot */
	int nonfinite;
	double norm;
};

/* One rank's pending registration. */
struct eng_reg {
	uint64_t token;
	uint32_t seq;
};

enum eng_task_kind {
	TASK_UNSHARD = 1,    /* all-gather of one replica's shard group */
	TASK_REDUCE_PARTIAL, /* HSDP, no all-reduce: one replica's reduce-scatter into partials */
	TASK_REDUCE,         /* reduce-scatter (+ HSDP all-reduce) into sharded grads */
	TASK_ZERO_GRAD,      /* one rank's sharded grads become absent */
	TASK_STEP,           /* one rank's optimizer step on its shard */
	TASK_SAVE, /* checkpoint: write the group's params and optimizer state (ckpt_save.c) */
	TASK_SAVE_FINAL, /* checkpoint: manifest, fsync, rename, retention (ckpt_save.c) */
	TASK_SAVE_WRITE, /* checkpoint: a group's snapshot to its files, off the group's queue */
	TASK_RESTORE, /* registration: params and optimizer state from a checkpoint (ckpt_load.c) */
	TASK_EXEC_RENEW, /* rank-executed: a rank that left gets buffers it can map again (exec.c) */
};

struct eng_ckpt;
struct eng_ckpt_req;

struct eng_group;

struct eng_task;

/*
 * The work and the end of a task kind computed outside task.c (checkpoint
 * saves and restores), given by the file that creates it, so task.c runs
 * them without naming that file.
 */
struct eng_task_ops {
	void (*exec)(struct eng_task *t);      /* pool (or loop) thread: sets res and msg */
	void (*delivered)(struct eng_task *t); /* loop thread: it ended, or failed unrun with res */
	/* Loop thread, optional: start a task due to run on a thread of its own (0), else the pool runs it. */
	int (*spawn)(struct eng_task *t);
};

struct eng_task {
	struct shd_pool_task pt; /* first member: the pool hands it back */
	struct eng_task *next;   /* group queue, then the engine's finished list */
	struct eng_group *eg;
	uint32_t kind;                    /* enum eng_task_kind */
	const struct eng_task_ops *hooks; /* SAVE, SAVE_FINAL, SAVE_WRITE, RESTORE, EXEC_RENEW;
					     else NULL */
	uint32_t replica;                 /* UNSHARD, REDUCE_PARTIAL */
	uint32_t rank;                    /* ZERO_GRAD, STEP */
	struct eng_ckpt *ckpt;            /* SAVE, SAVE_FINAL: the checkpoint it is part of */
	void *priv;                       /* EXEC_RENEW: its hooks' own state */
	uint32_t gindex;                  /* SAVE: the group's index in the checkpoint's manifest */
	int finished;                     /* on the finished list; under engine lock */
	int abandoned; /* loop: its job ended while it waited for other nodes (eng_tasks_stop) */
	int res;
	char msg[ENGINE_MSG_MAX];
	char why[320]; /* the backend's reason of a failure, or empty */
	uint32_t nops;
	struct eng_op ops[]; /* completions to deliver */
};

/* An op of a rank kept back so that the rank's ops on a group apply in the order it submitted them. */
struct eng_deferred {
	struct eng_deferred *next;
	struct eng_op op;
};

/* A collective being gathered: a rendezvous over ranks base..base+n-1 and their ops. */
struct eng_coll {
	struct shd_rdv rdv;
	uint32_t base;
	uint32_t op;        /* SHARDD_OP_UNSHARD or SHARDD_OP_REDUCE */
	struct eng_op *ops; /* [rdv.nexpected], valid where arrived */
};

struct eng_group {
	struct shd_group *g;
	struct shd_engine_job *j;
	int complete;           /* buffers allocated, every rank got its reply */
	uint64_t mem_committed; /* bytes counted in its job's and the engine's mem_committed */
	/* descriptors of its buffers, counted in the engine's fds_committed */
	uint64_t fds_committed;
	struct shd_rdv reg;       /* registration over all ranks */
	struct eng_reg *regs;     /* [world] */
	uint32_t first_rank;      /* whose spec defines the group */
	struct eng_coll *unshard; /* [replicate]: over each shard group */
	struct eng_coll *rs;      /* [replicate]: reduce (R > 1: without ALL_REDUCE) */
	struct eng_coll ar;       /* R > 1: reduce with ALL_REDUCE, over all ranks */
	struct eng_task *running; /* on the pool or finished, not yet drained */
	struct eng_task *qhead, *qtail;
	/*
	 * Per rank: ops submitted while the rank waits in a collective of this
	 * group and that must not overtake it (zero_grad, reshard), and any op
	 * it submits after them. Released in order by group_flush (engine.c).
	 */
	struct eng_deferred **dhead, **dtail; /* [world] */
	int flushing;
	/*
	 * The highest step any rank submitted to the group (a STEP, or a
	 * REDUCE with SHARDD_REDUCE_STEP) and its entry, for SHARDD_STEP_REPLAY
	 * (step.c).
	 */
	struct shardd_sqe last_sub; /* last_sub.step 0: none yet */
	char *restore;        /* SHARDD_INIT_RESTORE: the path every rank registered; else NULL */
	int restore_confined; /* a rank of another uid than shardd's registered a non-empty
					restore path: it must lie under --state-dir or an --import-dir */
	uid_t restore_uid;    /* the first such rank's uid, for the refusal */
	int restoring;        /* its TASK_RESTORE runs: the registration completes when it ends */
	int restore_fail;     /* a rank left or the job ended meanwhile: the registration fails */
	char restore_msg[ENGINE_MSG_MAX];
	/* its TASK_RESTORE's damaged checkpoints skipped, the last one's reason and message (ckpt_load.c) */
	uint32_t restore_skipped, restore_skip_reason;
	char restore_skip_msg[ENGINE_MSG_MAX];
	/* exchanges among nodes so far (world_collective.c); its running task's */
	uint64_t span_seq;
	/*
	 * A job across nodes (world_collective.c): the buffer MPI sends from and
	 * receives into, and FSDP's reduce scratch, sized and committed at
	 * registration (g->internode_size), allocated with the group's
	 * buffers and reused by every op (one task of a group runs at a time).
	 */
	struct shd_world_buf *span_buf;
	uint64_t span_buf_bytes;
	/* FSDP reduce: fp32 node sums (wire dtype not fp32), total, prepared inputs */
	uint8_t *span_scratch;
	/* offsets in span_scratch (span_sums_at: UINT64_MAX = in span_buf) */
	uint64_t span_sums_at, span_tot_at, span_tmp_at;
	/* FSDP reduce: each param's offset in an fp32 reduce shard [nparams + 1] */
	uint64_t *span_off32;
	uint64_t span_F; /* FSDP reduce: bytes of such an fp32 shard */
	int span_nobuf; /* loop: no buffer for the next task (MPI holds the old one, no room for another) */
	char span_nobuf_msg[ENGINE_MSG_MAX];
	/*
	 * Rank-executed (exec.c), per rank: its buffers are being renewed after
	 * it left, and the OPEN_GROUP that waits for them (token 0: none).
	 */
	uint8_t *exec_renewing;    /* [world] */
	struct eng_reg *exec_open; /* [world] */
	uint64_t *exec_sealer;     /* [world]: the client whose EXEC_MAP sealed its buffers */
};

struct shd_engine_job {
	struct shd_engine *e;
	void *ctx;
	char name[SHARDD_NAME_MAX];
	uint32_t replicate, shard, world;
	int32_t *devices; /* [world]: each rank's hello.device, where its buffers go */
	/* the backend's state of the job (NCCL communicators), or NULL */
	struct shd_backend_job *bj;
	uint8_t *gone; /* [world]: the rank's client left and it has not attached again */
	struct eng_group **groups; /* index = group id - 1; NULL once a registration failed */
	uint32_t ngroups, cap;
	uint64_t mem_committed; /* its groups' eg->mem_committed, summed */
	struct eng_gnorm_rec gnorm[SHARDD_GRAD_NORM_KEPT]; /* grad_norm results by step (step.c) */
	struct eng_ckpt *ckpt; /* the checkpoint being written, or NULL (ckpt_save.c) */
	/* a checkpoint waiting for the next step boundary, or NULL */
	struct eng_ckpt_req *ckpt_armed;
	uint64_t ckpt_seq;        /* ids given to checkpoints so far */
	uint64_t ckpt_every_last; /* the last step --checkpoint-every took (or tried) */
	/* the last_* fields: the last checkpoint that ended */
	struct shd_engine_ckpt_status ckpt_last;
	int ending; /* shd_engine_job_end runs: start no task */
	/*
	 * Groups of an ended job whose task waiting for other nodes still runs
	 * (eng_tasks_stop left it): the job, out of the engine's list, is freed
	 * with the last of them (job_reap in engine.c).
	 */
	uint32_t lingering;
	/*
	 * A job spanning the nodes of the daemon world (world_collective.c): its
	 * replicate, shard and world above are this node's ranks; span_* the
	 * whole mesh's. span_nodes 0: the job lives on this node.
	 */
	uint32_t span_nodes, span_node, span_replicate, span_shard;
	/* grad_norm of an FSDP job across nodes (grad_norm.c): the gather in flight, its stream position */
	struct shd_world_op *gnorm_op;
	uint64_t gnorm_seq, gnorm_step;
	int gnorm_inf;
	struct shd_engine_job *prev, *next;
};

struct shd_engine {
	struct shd_engine_config cfg;
	/* Loop thread, after a task's completions: take an armed checkpoint at a step boundary. */
	void (*at_boundary)(struct shd_engine_job *j);
	uint64_t timeout_ns;
	struct shd_pool *pool;
	struct shd_backend_ctx *backend;
	int efd;
	pthread_mutex_t lock;    /* the finished list */
	pthread_cond_t finished; /* a task reached the finished list */
	struct eng_task *fin_head, *fin_tail;
	struct shd_engine_job *jobs;
	uint64_t mem_committed; /* its jobs' mem_committed, summed */
	uint64_t fds_committed; /* its groups' eg->fds_committed, summed (registry.c) */
	/* threads running inter-node tasks (world_collective.c); under lock */
	uint32_t span_threads;
	/*
	 * Loop thread: exchange buffers that MPI still held when their group
	 * let go of them (a send to a node that stopped answering), counted in
	 * mem_committed until MPI lets go (world_collective.c).
	 */
	struct eng_world_orphan *span_orphans;
	struct shd_engine_restore_counts restores; /* loop thread (eng_restore_record) */
};

struct eng_world_orphan {
	struct eng_world_orphan *next;
	struct shd_world_buf *b;
	uint64_t bytes;
};

/* ---- exec.c: rank-executed groups ---- */

/*
 * Pick the group's executor for the registered `asked` (enum shardd_exec;
 * a client of minor < 5 asks DAEMON) and say why (g->exec_why): RANKS where
 * asked, or with AUTO below --rank-exec-max where the backend and the mesh
 * allow it. 0, or -SHARDD_E_INVALID with `err` when RANKS was asked where
 * it cannot run. Before the group's memory is committed.
 */
int eng_exec_choose(struct eng_group *eg, uint32_t asked, char *err, size_t errlen);
/* After the buffers were allocated: the sync page's header and first epoch. */
void eng_exec_init(struct eng_group *eg);
/* `rank` left: ops that need it fail at once until it attaches again (exec RANKS; else nothing). */
void eng_exec_rank_gone(struct eng_group *eg, uint32_t rank);
/*
 * `rank` attached again: a new epoch (every rank numbers its ops from 1
 * again), and ops wait for it to publish its buffers (exec RANKS; else nothing).
 */
void eng_exec_rank_attached(struct eng_group *eg, uint32_t rank);
/*
 * Queue the renewal of `rank`'s sealed buffers (it attached again);
 * `renewed` runs on the loop thread when it is done (or failed), to answer
 * the rank's OPEN_GROUP waiting in exec_open. 0 or -SHARDD_E_NOMEM.
 */
int eng_exec_renew(struct eng_group *eg, uint32_t rank,
		   void (*renewed)(struct eng_group *eg, uint32_t rank));

/* ---- delivery.c: messages and delivery ---- */

__attribute__((format(printf, 3, 4))) void eng_fmt(char *buf, size_t len, const char *f, ...);
/* A register/open reply that failed: (res, msg) to `rank`. */
void eng_reply_err(struct shd_engine_job *j, uint32_t rank, uint64_t token, uint32_t seq, int res,
		   const char *msg);
/* The completion of `op` (msg only on failure). */
void eng_complete(struct shd_engine_job *j, const struct eng_op *op, int res, const char *msg);
/* "shardd: ranks 2,3 <did> within 30 s; rank 0 is waiting" for an expired rendezvous. */
void eng_expired_msg(const struct shd_engine *e, const struct shd_rdv *rdv, const char *did,
		     char *err, size_t errlen);
/* "shardd: rank 2 <did> 0.84 s after ranks 0,1 gave up waiting for it ..." for an SHD_RDV_LATE arrival. */
void eng_late_msg(const struct shd_engine *e, const struct shd_rdv *rdv, uint32_t rank,
		  const char *did, uint64_t now_ns, char *err, size_t errlen);

/* ---- registry.c: registration ---- */

/* The job's group named `name` (complete or still registering), or NULL. */
struct eng_group *eng_group_by_name(const struct shd_engine_job *j, const char *name);
/* Forget a group and free its state and buffers (job end). */
void eng_group_free(struct eng_group *eg);
/* `rank` (this token) left before every rank registered the group: the registration fails. */
void eng_reg_rank_gone(struct eng_group *eg, uint32_t rank, uint64_t token);
/* Fail the registration when it is past its deadline. */
void eng_reg_cron(struct eng_group *eg, uint64_t now_ns);

/* ---- collective.c: collectives ---- */

/* Expect ranks base..base+n-1 for `op`. 0, -EINVAL or -ENOMEM. */
int eng_coll_init(struct eng_coll *c, uint32_t base, uint32_t n, uint32_t op);
/* Also takes one never initialised (zeroed). */
void eng_coll_free(struct eng_coll *c);
/* Fail every collective of the group that ops arrived at with (res, msg). */
void eng_colls_fail(struct eng_group *eg, int res, const char *msg);
/* Arrival of an unshard / a reduce at its rendezvous; launches the task once all arrived. */
void eng_coll_unshard(struct eng_group *eg, const struct eng_op *op);
void eng_coll_reduce(struct eng_group *eg, const struct eng_op *op);
/* 1 when `rank` waits in a collective of the group. */
int eng_coll_rank_waits(const struct eng_group *eg, uint32_t rank);
/* `rank` (this token) left: fail the collectives of the group it is part of. */
void eng_coll_rank_gone(struct eng_group *eg, uint32_t rank, uint64_t token);
/* Fail the collectives of the group past their deadline. */
void eng_coll_cron(struct eng_group *eg, uint64_t now_ns);

/* ---- task.c: tasks ---- */

/* A task of `kind` with room for `nops` completions, or NULL. */
struct eng_task *eng_task_new(struct eng_group *eg, uint32_t kind, uint32_t nops);
/* Loop thread: wait until a task queued on the pool has finished, and take it off the finished list. */
void eng_task_wait_finished(struct shd_engine *e, struct eng_task *t);
/*
 * Loop thread, for shd_engine_drain (engine.c): the tasks finished since the
 * last call, linked by next (the event fd's counter reset first), and one
 * such task's delivery: its completions and its group's next task. An
 * abandoned task (its job ended while it ran) is the drain's, not this.
 */
struct eng_task *eng_tasks_take_finished(struct shd_engine *e);
void eng_task_finished(struct eng_task *t);
/* Queue `t` on its group and start the group's next task if none runs. */
void eng_group_enqueue(struct eng_group *eg, struct eng_task *t);
/*
 * Wait for the group's running task and deliver it, then fail every queued
 * one with (res, msg): the group runs nothing afterwards. A running task
 * that waits for other nodes (eng_world_task) is not waited for: its ops
 * fail now with (res, msg), and it is left to finish on its thread (its
 * exchanges are bounded, world.h); returns 1 then, and the group must
 * outlive it (shd_engine_drain reaps it), else 0.
 */
int eng_tasks_stop(struct eng_group *eg, int res, const char *msg);

/* ---- ckpt_save.c, ckpt_arm.c (eng_ckpt_try_armed): checkpoints ---- */

/* Pool thread: the work of a TASK_SAVE or TASK_SAVE_FINAL; sets t->res and t->msg. */
void eng_ckpt_exec(struct eng_task *t);
/* Loop thread: a TASK_SAVE or TASK_SAVE_FINAL is done (or failed unrun with t->res). */
void eng_ckpt_delivered(struct eng_task *t);
/* Loop thread, after a task's completions: take an armed checkpoint if the job is at a step boundary. */
void eng_ckpt_try_armed(struct shd_engine_job *j);
/* Pool thread (ckpt_load.c): fill a registered group's buffers from its checkpoint; sets t->res, t->msg. */
void eng_restore_exec(struct eng_task *t);
/* Loop thread (registry.c): the TASK_RESTORE of a registration ended; reply to every rank. */
void eng_restore_delivered(struct eng_task *t);
/*
 * Loop thread, as a restore task is delivered (before a rank's leaving
 * may fail its registration): its outcome into the job's checkpoint status
 * and the engine's restore counts (ckpt_load.c).
 */
void eng_restore_record(const struct eng_task *t);
/* Loop thread, from shd_engine_job_end before any group stops: wait for the SAVE_WRITEs on the pool. */
void eng_ckpt_job_wait(struct shd_engine_job *j);
/* Loop thread, from shd_engine_job_end after every group stopped: fail a checkpoint still open. */
void eng_ckpt_job_end(struct shd_engine_job *j, const char *why);
/* ---- world_collective.c: the parts of a collective between nodes ---- */

/* The replicate size of the job's whole mesh (the divide factors' and HSDP's R). */
static inline uint32_t eng_mesh_replicate(const struct shd_engine_job *j)
{
	return j->span_nodes > 1 ? j->span_replicate : j->replicate;
}

/* The shard group size of the job's whole mesh (the divide factors' S). */
static inline uint32_t eng_mesh_shard(const struct shd_engine_job *j)
{
	return j->span_nodes > 1 ? j->span_shard : j->shard;
}

/* A rank as messages name it: a job across nodes shows global ranks (node * L + node-local rank). */
static inline uint32_t eng_rank_shown(const struct shd_engine_job *j, uint32_t rank)
{
	return j->span_nodes > 1 ? j->span_node * j->world + rank : rank;
}

/* 1 when the job's shard group spans the nodes (FSDP across nodes: mesh 1 x S over them). */
static inline int eng_world_fsdp(const struct shd_engine_job *j)
{
	return j->span_nodes > 1 && j->span_replicate == 1;
}

/* 1 when the task exchanges data with other nodes: never inline, and not on the pool. */
int eng_world_task(const struct eng_task *t);
/*
 * Run the task (t->pt.fn) on a thread of its own: it waits for other nodes,
 * and the worker pool must never wait on the network. 0, or pthread's
 * negative errno when no thread could be started (the caller queues it on
 * the pool instead).
 */
int eng_world_spawn(struct eng_task *t);
/* Wait until no thread of eng_world_spawn runs (engine destroy). */
void eng_world_threads_wait(struct shd_engine *e);
/*
 * A job across nodes, at registration, before its memory is committed:
 * FSDP's layout over the whole shard group and this node's first shard
 * rank, and the bytes of the group's inter-node buffers
 * (g->internode_size); a group whose inter-node message would pass MPI's
 * int count is refused. 0, or an error with `err`.
 */
int eng_world_group_init(struct eng_group *eg, char *err, size_t errlen);
/* Allocate (and touch) the inter-node buffers counted by eng_world_group_init. 0, or -ENOMEM with `err`. */
int eng_world_group_alloc(struct eng_group *eg, char *err, size_t errlen);
/* Free them; one MPI still holds goes to the engine's orphans, still counted, until MPI lets go. */
void eng_world_group_free(struct eng_group *eg);
/* Loop thread: uncount and free the orphans MPI let go of (before a limit is checked). */
void eng_world_orphans_sweep(struct shd_engine *e);
/* Engine destroy: drop every orphan (freed when MPI lets go). */
void eng_world_orphans_free(struct shd_engine *e);
/* FSDP across nodes: node-local gather, inter-node all-gather of node chunks, the unsharded params. */
int eng_world_unshard(struct eng_task *t);
/*
 * FSDP across nodes: node-local fp32 sums of every shard's rows, an
 * exchange of each node's chunk, the sum over nodes and `rs`'s math into
 * this node's sharded grads.
 */
int eng_world_reduce_scatter(struct eng_task *t, const struct shardd_reduce_math *rs);
/*
 * HSDP across nodes: the all-reduce over the nodes of this node's partials
 * (already holding this reduce's reduce-scatter output), into the sharded
 * grads of its ranks with `ar`'s math, as the single-node all-reduce does.
 * 0, a backend error (t->why), or an error with t->msg written.
 */
int eng_world_allreduce(struct eng_task *t, const struct shardd_reduce_math *ar);

#endif /* SHD_ENGINE_INT_H */
