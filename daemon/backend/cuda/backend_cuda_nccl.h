/* SPDX-License-Identifier: MIT */
/*
 * NCCL for the cuda backend (backend_cuda_nccl.c): the library, loaded
 * with dlopen at first use, and the daemon's communicators.
 *
 * A clique is one NCCL communicator per device of an ordered device list
 * (NCCL rank k on devices[k]), owned by one job: the shard group of a
 * replica whose ranks sit on distinct GPUs, or the replicate group of a
 * shard index. Cliques are made at the first collective that needs them,
 * kept by (job, device list), and destroyed when their job ends; one that
 * fails or outlives the deadline of a call is aborted and forgotten, and
 * the next collective makes it again.
 *
 * The communicators are non-blocking (ncclConfig_t.blocking = 0), so that
 * no call can hang: every call that returns ncclInProgress is followed by
 * polling ncclCommGetAsyncError on each communicator until it leaves that
 * state, or the deadline passes.
 *
 * Every call but shd_nccl_load, shd_nccl_create,
 * shd_nccl_destroy, shd_nccl_devices_str, shd_nccl_unique_ids,
 * shd_nccl_span_make, shd_nccl_span_abort and shd_nccl_span_collective
 * must be made under one
 * lock the caller holds for all of them (cuda_nccl_lock,
 * backend_cuda_device.c): NCCL calls on a communicator must not run
 * concurrently, and queueing every collective of the daemon
 * in one order keeps two collectives from waiting on each other across
 * devices.
 */
#ifndef SHD_BACKEND_CUDA_NCCL_H
#define SHD_BACKEND_CUDA_NCCL_H

#include <stddef.h>
#include <stdint.h>

struct shd_nccl;        /* every clique of every job */
struct shd_nccl_clique; /* one communicator per device of a device list */

enum shd_nccl_coll {
	SHD_NCCL_ALL_GATHER = 1, /* recv[k] = send[0] .. send[n-1], `count` elements each */
	SHD_NCCL_REDUCE_SCATTER =
		2,               /* recv[k] = sum over members of block k of send (`count` each) */
	SHD_NCCL_ALL_REDUCE = 3, /* recv[k] = sum over members of send (`count`) */
};

/*
 * Load libnccl.so.2 (once per process; later calls return the first
 * outcome). 0, or -SHARDD_E_BACKEND with `err` saying why and what to do.
 */
int shd_nccl_load(char *err, size_t errlen);

/* `timeout_ns`: the deadline of every wait on NCCL (the daemon's collective timeout). 0 or -ENOMEM. */
int shd_nccl_create(uint64_t timeout_ns, struct shd_nccl **out);
/* Destroys every clique left (as shd_nccl_job_end does). Also takes NULL. */
void shd_nccl_destroy(struct shd_nccl *nc);

/*
 * The clique of `job` (its name `job_name`, for messages) over devices[0..n)
 * (n >= 2, pairwise distinct), made now when there is none: one
 * ncclCommInitRankConfig per device in one group call. Needs
 * shd_nccl_load. 0, or -SHARDD_E_BACKEND with `err` naming the devices
 * and the cause.
 */
int shd_nccl_clique(struct shd_nccl *nc, const void *job, const char *job_name,
		    const int32_t *devices, uint32_t n, struct shd_nccl_clique **out, char *err,
		    size_t errlen);

/*
 * Queue one collective on every member k of `c`: send[k] -> recv[k] on
 * streams[k] (cudaStream_t), `count` elements of `dtype` (an enum
 * shardd_dtype; SHARDD_DTYPE_NONE moves bytes), summed for the reductions.
 * Returns once NCCL has queued it on every stream. 0, or
 * -SHARDD_E_BACKEND with `err` naming the devices: the clique was then
 * aborted and forgotten (`c` is gone).
 */
int shd_nccl_collective(struct shd_nccl *nc, struct shd_nccl_clique *c, uint32_t coll,
			void *const *send, void *const *recv, size_t count, uint32_t dtype,
			void *const *streams, char *err, size_t errlen);

/*
 * Cliques with a member on `device` whose communicators report an
 * asynchronous error (or all of them, with `abort_all`) are aborted and
 * forgotten; span cliques are left to their op, which watches them
 * itself. Returns how many; `err` names their devices and causes.
 */
uint32_t shd_nccl_check_device(struct shd_nccl *nc, int32_t device, int abort_all, char *err,
			       size_t errlen);

/* The job ended: destroy its cliques (ncclCommFinalize, then ncclCommDestroy; abort past the deadline). */
void shd_nccl_job_end(struct shd_nccl *nc, const void *job);

/*
 * Across nodes (docs/CUDA.md "Across nodes", world_boot.h). A span clique
 * holds this process's members of one communicator that spans the nodes of
 * the daemon world: member k on devices[k] is NCCL rank ranks[k] of
 * `nranks`. It is kept by (job, key, index), never found by
 * shd_nccl_clique, and otherwise lives as any clique does (collectives,
 * aborted on a device's error, destroyed with its job).
 */

/* `n` new unique ids (ncclGetUniqueId) into ids, SHD_WORLD_ID_BYTES each. 0, or -SHARDD_E_BACKEND with `err`. */
int shd_nccl_unique_ids(uint8_t *ids, uint32_t n, char *err, size_t errlen);

/*
 * Make the span clique (job, key, index) from node 0's `id`
 * (SHD_WORLD_ID_BYTES), in one group call, waiting until `deadline_ns`
 * for every node's members to join. Needs no lock: the clique is new and
 * nobody else's until shd_nccl_span_add (a set-up that waits for other
 * nodes must not hold up this node's collectives, nor the set-up of
 * another group that the other nodes started first). 0, or
 * -SHARDD_E_BACKEND with `err` naming the devices, the NCCL ranks and the
 * cause; nothing is left made.
 */
int shd_nccl_span_make(const void *job, const char *job_name, uint64_t key, uint32_t index,
		       const int32_t *devices, uint32_t n, const uint32_t *ranks, uint32_t nranks,
		       const uint8_t *id, uint64_t deadline_ns, struct shd_nccl_clique **out,
		       char *err, size_t errlen);
/* Keep a clique of shd_nccl_span_make (replacing one of the same job, key and index). */
void shd_nccl_span_add(struct shd_nccl *nc, struct shd_nccl_clique *c);
/* Abort and free a clique of shd_nccl_span_make never added. No lock needed. */
void shd_nccl_span_abort(struct shd_nccl_clique *c);

/* The span clique (job, key, index), or NULL. */
struct shd_nccl_clique *shd_nccl_span_find(struct shd_nccl *nc, const void *job, uint64_t key,
					   uint32_t index);

/*
 * shd_nccl_collective on a span clique, waiting until `deadline_ns` for
 * NCCL to have queued it; no lock needed by the thread that runs its
 * group's op (no other thread uses or frees a span clique while its
 * group's op runs). On failure `c` stays: the caller drops it.
 */
int shd_nccl_span_collective(struct shd_nccl_clique *c, uint32_t coll, void *const *send,
			     void *const *recv, size_t count, uint32_t dtype, void *const *streams,
			     uint64_t deadline_ns, char *err, size_t errlen);

/* Abort and forget `c` (its communicators stop what still runs on the devices). */
void shd_nccl_drop(struct shd_nccl *nc, struct shd_nccl_clique *c);

/* 1 with `err` naming the devices and the cause when a communicator of `c` reports an asynchronous error; else 0. */
int shd_nccl_clique_failed(struct shd_nccl_clique *c, char *err, size_t errlen);

/* "devices 0,1,2" into `buf`, for messages about devices[0..n). */
void shd_nccl_devices_str(const int32_t *devices, uint32_t n, char *buf, size_t len);

#endif /* SHD_BACKEND_CUDA_NCCL_H */
