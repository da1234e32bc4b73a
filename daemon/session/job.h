/* SPDX-License-Identifier: MIT */
/*
 * A job: one training run on the node, named, with a mesh of
 * replicate x shard ranks. It owns its engine job (groups and collectives)
 * and the job-wide barrier. Created by the first HELLO that names it; ends
 * when every rank has said goodbye. A rank that vanishes without goodbye
 * leaves the job in place so that a restarted trainer can re-attach; a job
 * left with no attached rank ends after --job-linger seconds (cron), and an
 * admin ends one at once with `shardctl end`.
 */
#ifndef SHD_JOB_H
#define SHD_JOB_H

#include <stddef.h>
#include <stdint.h>

#include "rendezvous.h"
#include "shardd_proto.h"

struct shd_engine;
struct shd_engine_job;
struct shardd_cuda_ipc_handle;
struct shardd_group_reply;
struct shardd_param_layout;
struct shardd_param_spec;

/*
 * How the job reaches the client of a rank: given by the session when it
 * attaches (shd_job_attach), so that the job never calls the session.
 * Every completion of the rank's ops, the engine's and the barrier's alike,
 * goes out through `complete`. Each is called on the loop thread with the
 * sink's ctx.
 */
struct shd_rank_sink_ops {
	/* Push the completion of a taken entry; `msg` (may be NULL) is the error text. */
	void (*complete)(void *ctx, const struct shardd_sqe *sqe, int res, const char *msg);
	/* Send the reply of a group registration or open (shd_engine_reply_fn). */
	void (*group_reply)(void *ctx, uint32_t seq, int res, const char *msg,
			    const struct shardd_group_reply *reply,
			    const struct shardd_param_layout *layouts,
			    const struct shardd_param_spec *specs, const int *fds, int nfds,
			    const struct shardd_cuda_ipc_handle *ipc, int nipc);
	/* Tell the client something it did not ask about (an ERROR with seq 0). */
	void (*notify)(void *ctx, int code, const char *text);
	/* Is the client gone (socket hung up, process exited)? Never waits. */
	int (*gone)(void *ctx);
	/* Close the client now; `why` is logged. Detaches the rank (shd_job_detach). */
	void (*close)(void *ctx, const char *why);
	/* Stop using the client and close it at the loop's next safe point. */
	void (*close_later)(void *ctx, const char *why);
	/* The job ended: the client belongs to no job any more. */
	void (*job_ended)(void *ctx);
};

struct shd_rank_sink {
	const struct shd_rank_sink_ops *ops; /* NULL: no client attached */
	void *ctx;                           /* the client (its session) */
	uint64_t token;                      /* its client id: the engine's token for its ops */
};

/* What every job needs from the daemon, given once at start (shd_jobs_init). */
struct shd_jobs_env {
	struct shd_job **list; /* head of the daemon's list of jobs */
	struct shd_engine *engine;
	uint64_t collective_timeout_ns; /* a barrier fails after this */
	double collective_timeout_s;    /* the same, as given (--collective-timeout) */
	uint64_t linger_ns;             /* --job-linger; 0 = forever */
	double linger_s;
	const char *state_dir; /* --state-dir, or NULL: where the checkpoint op writes */
	uint32_t keep;         /* --keep */
};

/* The job-wide rendezvous ops, each over every rank of the job. */
enum shd_job_rdv_kind {
	SHD_JOB_BARRIER, /* key step */
	SHD_JOB_GNORM,   /* grad_norm; key (step, norm type) */
	SHD_JOB_CKPT,    /* checkpoint; key step */
	SHD_JOB_NRDV
};

/* A rank waiting in one job-wide rendezvous op. */
struct shd_job_wait {
	uint64_t token;        /* session that waits */
	struct shardd_sqe sqe; /* its entry, for the completion */
};

struct shd_job_rank {
	struct shd_rank_sink client;            /* attached client; client.ops NULL when none */
	uint32_t pid;                           /* pid of the latest client of this rank */
	int attached_once;                      /* some client has held this rank */
	int goodbye;                            /* said goodbye since its last attach */
	char left_why[96];                      /* why its last client left without a goodbye ("died
					   (connection closed)"); rendezvous failures name it */
	struct shd_job_wait wait[SHD_JOB_NRDV]; /* per rendezvous op (shd_job_rdv_kind) */
	int ckpt_waits;                         /* its checkpoint op waits for the write to end */
};

struct shd_job {
	struct shd_job *next, *prev; /* shd_jobs_env.list */
	char name[SHARDD_NAME_MAX];
	uint32_t replicate;         /* mesh rows */
	uint32_t shard;             /* mesh columns: shard group size */
	uint32_t world;             /* replicate * shard */
	uint32_t nattached;         /* ranks with a client now */
	struct shd_job_rank *ranks; /* world entries */
	struct shd_engine_job *ejob;
	struct shd_rdv rdv[SHD_JOB_NRDV]; /* barrier, grad_norm, checkpoint (shd_job_rdv_kind) */
	uint64_t orphaned_ns; /* CLOCK_MONOTONIC when its last attached rank left; 0 while
					   one is attached: --job-linger counts from here */
	/*
	 * A job across nodes (shd_job_span): the whole mesh, this node, and
	 * rank_base = node * world, the global rank of its rank 0 (messages and
	 * shardctl name global ranks). span_nodes 0 and rank_base 0 on one node.
	 */
	uint32_t span_nodes, span_node, span_replicate, span_shard, rank_base;
};

/* Set the environment of every job; before the first HELLO. */
void shd_jobs_init(const struct shd_jobs_env *env);

struct shd_job *shd_job_find(const char *name);
/*
 * Who owns a rank: may a new client take `rank` of job `name` with mesh
 * replicate x shard? The job's mesh must match, and the rank must be free;
 * a holder found gone (its EOF not yet seen) is closed first, since a
 * restarted trainer may be faster than its old client's hang-up. Returns 0
 * with *out the job (NULL: no job of that name yet; shd_job_create makes
 * it), or -SHARDD_E_MESH / -SHARDD_E_RANK_TAKEN with `err` saying so.
 */
int shd_job_claim(const char *name, uint32_t replicate, uint32_t shard, uint32_t rank,
		  struct shd_job **out, char *err, size_t errlen);
/*
 * The job spans the daemon world: node `node` of `nodes` holds its ranks,
 * of the whole mesh replicate x shard (shd_engine_job_span); its messages
 * and views name global ranks from now on. Right after shd_job_create.
 */
int shd_job_span(struct shd_job *j, uint32_t replicate, uint32_t shard, uint32_t nodes,
		 uint32_t node);
/* Create the job and its engine job; 0, -ENOMEM or the engine's error. */
int shd_job_create(const char *name, uint32_t replicate, uint32_t shard, struct shd_job **out);
/* Fail its barrier with -SHARDD_E_SHUTDOWN, destroy the engine job, free it. */
void shd_job_destroy(struct shd_job *j);

/*
 * Bind the client reached through `client` (process `pid`, on CUDA device
 * `device` or SHARDD_HELLO_DEVICE_HOST) to `rank` and tell the engine; the
 * slot must be free (shd_job_claim).
 */
void shd_job_attach(struct shd_job *j, uint32_t rank, uint32_t pid, int32_t device,
		    const struct shd_rank_sink *client);
/*
 * The client of `rank` is gone: `goodbye` says whether it said so, `why` is
 * how it went ("died", "said goodbye", ...). Fails a barrier in progress and
 * tells the engine. Destroys the job when every rank has said goodbye.
 */
void shd_job_detach(struct shd_job *j, uint32_t rank, int goodbye, const char *why);

/*
 * The one completion path: an op of `rank`'s client `token` is done (the
 * engine's complete callback, shd_engine_complete_fn, with the job as
 * job_ctx; the barrier uses it too). Goes out through the rank's sink;
 * dropped when that client is gone (a stale token).
 */
void shd_job_op_done(void *job_ctx, uint32_t rank, uint64_t token, const struct shardd_sqe *sqe,
		     int res, const char *msg);
/* The engine's reply callback (shd_engine_reply_fn): the same path for group replies. */
void shd_job_group_reply(void *job_ctx, uint32_t rank, uint64_t token, uint32_t seq, int res,
			 const char *msg, const struct shardd_group_reply *reply,
			 const struct shardd_param_layout *layouts,
			 const struct shardd_param_spec *specs, const int *fds, int nfds,
			 const struct shardd_cuda_ipc_handle *ipc, int nipc);

/*
 * An entry of job scope (op_table.h: barrier, grad_norm, checkpoint) from
 * the client of `rank`, checked by the ring service against the table. A
 * barrier completes every rank once each has arrived with the same
 * number; a grad_norm gives each the total norm of the job's sharded
 * grads (shd_engine_job_grad_norm) once all arrived with the same step and
 * norm type; a checkpoint writes the job's groups to
 * <--state-dir>/<job>/step-<step> once all arrived with the same step, and
 * each rank's completion comes when that is durable or has failed.
 */
void shd_job_submit(struct shd_job *j, uint32_t rank, const struct shardd_sqe *sqe);
/* Finish a grad_norm whose sum across nodes ended (loop thread; nothing when none ended). */
void shd_job_gnorm_poll(struct shd_job *j);
/*
 * An admin checkpoint (shardctl checkpoint): taken at the job's next step
 * boundary into `dir` (an absolute path), or with dir NULL into
 * <--state-dir>/<job>/step-<step>. 0 with *id its id, or a negative code
 * with `err` naming the fix (no --state-dir, a relative dir, one armed).
 */
int shd_job_checkpoint_arm(struct shd_job *j, const char *dir, uint64_t *id, char *err,
			   size_t errlen);
/*
 * Fail a barrier or grad_norm waiting past the collective timeout; end the job when it
 * has had no attached rank for --job-linger seconds (then `j` is freed).
 */
void shd_job_cron(struct shd_job *j, uint64_t now_ns);

/*
 * Seconds until a job without attached ranks ends (--job-linger), or a
 * negative value when it does not: a rank is attached, or --job-linger 0.
 */
double shd_job_ends_in_s(const struct shd_job *j, uint64_t now_ns);

/*
 * End the job now, for the reason `why` ("was ended by ..."): the ops in
 * flight of its attached ranks fail with error completions that say why,
 * each attached client gets an ERROR notice saying why and its connection
 * is closed at the loop's next safe point, and the job's buffers are freed
 * (`j` is freed). Logs the job, `why` and the bytes freed; returns those
 * bytes.
 */
uint64_t shd_job_end(struct shd_job *j, const char *why);

struct shd_group_memory;
/* Add the bytes of every buffer job `j` holds now, by kind, to *m (group.h). */
void shd_job_memory_held(const struct shd_job *j, struct shd_group_memory *m);
/* The bytes of every buffer of every job, by kind, into *m. */
void shd_jobs_memory_held(struct shd_group_memory *m);

#endif /* SHD_JOB_H */
