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
#ifndef SHARDD_JOB_H
#define SHARDD_JOB_H

#include <stdint.h>

#include "rendezvous.h"
#include "shardd_proto.h"

struct shardd_session;
struct shardd_engine_job;

struct shardd_job_rank {
	struct shardd_session *session; /* attached client, or NULL */
	uint32_t pid;                   /* pid of the latest client of this rank */
	int      attached_once;         /* some client has held this rank */
	int      goodbye;               /* said goodbye since its last attach */
	uint64_t barrier_token;         /* session that waits in the barrier */
	struct shardd_sqe barrier_sqe;  /* its entry, for the completion */
};

struct shardd_job {
	struct shardd_job *next, *prev; /* server.jobs */
	char     name[SHARDD_NAME_MAX];
	uint32_t replicate;             /* mesh rows */
	uint32_t shard;                 /* mesh columns: shard group size */
	uint32_t world;                 /* replicate * shard */
	uint32_t nattached;             /* ranks with a client now */
	struct shardd_job_rank *ranks;  /* world entries */
	struct shardd_engine_job *ejob;
	struct shardd_rdv barrier;      /* over every rank of the job */
	uint64_t orphaned_ns;           /* CLOCK_MONOTONIC when its last attached rank left; 0 while
					   one is attached: --job-linger counts from here */
};

struct shardd_job *shardd_job_find(const char *name);
/* Create the job and its engine job; 0, -ENOMEM or the engine's error. */
int shardd_job_create(const char *name, uint32_t replicate, uint32_t shard,
		      struct shardd_job **out);
/* Fail its barrier with -SHARDD_E_SHUTDOWN, destroy the engine job, free it. */
void shardd_job_destroy(struct shardd_job *j);

/* Bind `s` as the client of `rank` (the slot must be free). */
void shardd_job_attach(struct shardd_job *j, uint32_t rank, struct shardd_session *s);
/*
 * The client of `rank` is gone: `goodbye` says whether it said so, `why` is
 * how it went ("died", "said goodbye", ...). Fails a barrier in progress and
 * tells the engine. Destroys the job when every rank has said goodbye.
 */
void shardd_job_detach(struct shardd_job *j, uint32_t rank, int goodbye, const char *why);

/* The session of `rank` if its token is `token`, else NULL (a stale completion). */
struct shardd_session *shardd_job_session(struct shardd_job *j, uint32_t rank, uint64_t token);

/* A BARRIER entry (already validated) from the client of `rank`. */
void shardd_job_barrier(struct shardd_job *j, uint32_t rank, const struct shardd_sqe *sqe);
/*
 * Fail a barrier waiting past the collective timeout; end the job when it
 * has had no attached rank for --job-linger seconds (then `j` is freed).
 */
void shardd_job_cron(struct shardd_job *j, uint64_t now_ns);

/*
 * Seconds until a job without attached ranks ends (--job-linger), or a
 * negative value when it does not: a rank is attached, or --job-linger 0.
 */
double shardd_job_ends_in_s(const struct shardd_job *j, uint64_t now_ns);

/*
 * End the job now, for the reason `why` ("was ended by ..."): the ops in
 * flight of its attached ranks fail with error completions that say why,
 * each attached client gets an ERROR notice saying why and its connection
 * is closed at the loop's next safe point, and the job's buffers are freed
 * (`j` is freed). Logs the job, `why` and the bytes freed; returns those
 * bytes.
 */
uint64_t shardd_job_end(struct shardd_job *j, const char *why);

struct shardd_group_memory;
/* Add the bytes of every buffer job `j` holds now, by kind, to *m (group.h). */
void shardd_job_memory_held(const struct shardd_job *j, struct shardd_group_memory *m);
/* The bytes of every buffer of every job, by kind, into *m. */
void shardd_jobs_memory_held(struct shardd_group_memory *m);

#endif /* SHARDD_JOB_H */
