/* SPDX-License-Identifier: MIT */
/*
 * Backend table: where a group's buffers live and who moves their bytes.
 *
 * The engine decides what an op computes (which buffers, which shard, which
 * reduce math, in what order); a backend decides how: host memory and CPU
 * kernels on the worker pool (backend_host.c), or device memory and device
 * kernels / NCCL (a cuda backend, same table). Buffers are opaque handles
 * that a backend exports to clients (an fd, or a CUDA IPC handle), so the
 * engine never touches memory itself.
 *
 * Calls are made from pool threads (host: also the loop thread, for small
 * tasks), one call at a time per buffer. A backend with `sync` queues the
 * work of unshard, reduce and zero on its device and returns; the results
 * are visible to clients after `sync`, or to a client stream that waited
 * on a fence signalled after the call. A backend without `sync` returns
 * when the results are visible. Every call returns 0 or a negative errno /
 * -SHARDD_E_*.
 */
#ifndef SHD_BACKEND_H
#define SHD_BACKEND_H

#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include "layout.h"
#include "shardd_kernels.h"
#include "shardd_proto.h"

struct shd_backend_ctx;
struct shd_fences;
struct shd_world_boot;
struct shd_pool;

/*
 * One buffer of a group. It is allocated exactly when priv is not NULL: a
 * buffer exported as a CUDA IPC handle is allocated and has no fd.
 */
struct shd_buf {
	uint64_t bytes; /* size as allocated (and as a client maps it) */
	int fd;         /* exported as an fd: clients receive duplicates of it; else -1 */
	void *priv; /* the backend's own state (a host mapping, a device buffer); NULL: unallocated */
};

static inline int shd_buf_allocated(const struct shd_buf *buf)
{
	return buf->priv != NULL;
}

/*
 * End of a backend's free: close the exported fd if there is one and leave
 * the buffer unallocated (priv NULL, fd -1), the state free accepts again
 * as a no-op. The backend has released what priv pointed to before.
 */
static inline void shd_buf_forget(struct shd_buf *buf)
{
	if (buf->fd >= 0)
		close(buf->fd);
	buf->priv = NULL;
	buf->fd = -1;
	buf->bytes = 0;
}

/*
 * Operand holding one shard of every param of a group: the flat shard, the
 * sharded grad, or an HSDP partial reduce-scatter output.
 */
struct shd_shard_view {
	struct shd_buf *buf;
	const uint64_t *offsets; /* per param: bytes into buf where its shard starts */
	uint32_t dtype;          /* elements' dtype; SHARDD_DTYPE_NONE: each param's own dtype */
};

/* The dtype of param `p`'s elements in view `v`. */
static inline uint32_t shd_shard_view_dtype(const struct shd_shard_view *v,
					    const struct shd_layout_param *p)
{
	return v->dtype != SHARDD_DTYPE_NONE ? v->dtype : p->dtype;
}

/*
 * Per-job state of a backend (the cuda backend's NCCL communicators); the
 * engine opens it with the job and passes it with every collective.
 */
struct shd_backend_job;

/*
 * FSDP2 all-gather + copy-out of one shard group into its unsharded
 * buffers. Each shard rank has an output; ranks that share one unsharded
 * buffer have the same pointer there, and a backend writes each distinct
 * buffer once.
 */
struct shd_unshard_args {
	struct shd_backend_job *job;
	const struct shd_layout *layout;
	uint32_t nshards;              /* S: shard ranks 0..S-1 in order */
	struct shd_buf *const *shards; /* [S] flat shards, layout shard offsets, params' dtypes */
	struct shd_buf *const
		*unsharded; /* [S] out: each param in its unsharded dtype, padding dropped */
	char *err;          /* out: why the call failed, for the op's completion; */
	size_t errlen;      /* the backend may leave it empty */
	/*
	 * Only the elements that come from shards [part_first, part_first +
	 * part_count), the rest of the unsharded copy left as it is; count 0:
	 * every shard. The host backend's (across nodes, world_host.c gathers
	 * a node's own shards while the others' travel); a backend that
	 * crosses nodes itself (span_unshard) is never given a part.
	 */
	uint32_t part_first, part_count;
};

enum shd_reduce_src {
	/* Inputs are unsharded grad buffers (layout grad offsets, grad dtype): a
	   reduce-scatter; member k's output is shard k's rows of the result. */
	SHD_REDUCE_SRC_GRAD = 1,
	/* Inputs are shard views: the HSDP all-reduce across replicas; every
	   member's output is the whole result (shard `shard_rank`'s rows). */
	SHD_REDUCE_SRC_SHARD = 2,
};

/*
 * One collective reduction over `n` members (the ranks of a shard group,
 * or of a replicate group), each with an input and an output, per element
 * as shardd_k_reduce: out_k = [accumulate_k] cast(math(inputs) [+ add_k]).
 * Only valid rows are reduced; the outputs' padding rows become zero. A
 * backend may reduce in place in SRC_SHARD views (NCCL's all-reduce does):
 * their contents are undefined afterwards.
 */
struct shd_reduce_args {
	struct shd_backend_job *job;
	const struct shd_layout *layout;
	uint32_t src;                       /* enum shd_reduce_src */
	uint32_t n;                         /* members */
	struct shd_buf *const *grads;       /* SRC_GRAD: [n] grad buffers of shard ranks 0..n-1 */
	const struct shd_shard_view *views; /* SRC_SHARD: [n] */
	uint32_t shard_rank;                /* SRC_SHARD: which shard's rows the views hold */
	uint32_t in_dtype;                  /* SRC_SHARD: dtype of the views (reduce dtype) */
	const struct shd_shard_view *outs;  /* [n] */
	const struct shd_shard_view *adds;  /* [n] addends in math.reduce_dtype (buf NULL: none; may
						  equal the output), or NULL: none at all */
	const uint8_t *accumulate;          /* [n]: add into out_k instead of assigning */
	/* SRC_GRAD: one shard in math.reduce_dtype (shd_placement_reduce_shard), the block
	   a backend that reduces through a staging buffer lays each shard out as. */
	const uint64_t *reduce_offsets;
	uint64_t reduce_shard_size;
	struct shardd_reduce_math math; /* math.add is ignored: `adds` says where */
	char *err;                      /* out: why the call failed, for the op's completion; */
	size_t errlen;                  /* the backend may leave it empty */
};

/*
 * One optimizer step on one rank's flat shard (fp32 params): every param's
 * valid rows (padding rows are never read or written) updated from the
 * sharded grad with the state buffers, each laid out like the flat shard.
 * `sgd` or `adamw` (by `kind`) holds the hyperparameters, step count and
 * grad_scale; the backend fills in their pointers per param. With
 * `skip_nonfinite`, the backend first looks for a NaN or Inf in the grad's
 * valid rows and, if it finds one, sets *skipped and changes nothing.
 */
struct shd_step_args {
	const struct shd_layout *layout;
	uint32_t shard_rank;       /* which shard's rows are valid */
	uint32_t kind;             /* SHARDD_OPTIM_SGD or SHARDD_OPTIM_ADAMW */
	struct shd_buf *shard;     /* fp32 params, layout shard offsets */
	struct shd_buf *grad;      /* sharded grad, same offsets */
	struct shd_buf *state[3];  /* SGD: momentum buffer or NULL; AdamW: exp_avg, exp_avg_sq,
						max_exp_avg_sq or NULL */
	struct shardd_sgd sgd;     /* kind SGD: all but the pointers */
	struct shardd_adamw adamw; /* kind ADAMW: all but the pointers */
	int skip_nonfinite;
	int *skipped; /* out */
	char *err;
	size_t errlen;
};

/* How one buffer travels to a client (a GROUP reply's export_kind and what goes with it). */
struct shd_buf_export {
	uint32_t kind; /* enum shardd_export_kind */
	int fd;        /* SHARDD_EXPORT_FD: a new fd the caller closes; else -1 */
	struct shardd_cuda_ipc_handle ipc; /* SHARDD_EXPORT_CUDA_IPC: the handle */
};

/* How a buffer is lent to a client (export_buf). */
enum shd_export_mode {
	SHD_EXPORT_RW = 0, /* read-write, sealed against resizing and any other seal */
	SHD_EXPORT_RO = 1, /* read-only where the backend can enforce it */
	/*
	 * Read-write to its owner, and left open for seal_readonly: the rank's
	 * flat shard and grad buffer of a rank-executed group, which its peers
	 * read once it has mapped them.
	 */
	SHD_EXPORT_OWNER = 2,
};

struct shd_backend_ops {
	const char *name;
	/*
	 * A task of the engine that reads and writes at most this many bytes
	 * runs on the loop thread that started it instead of the worker pool:
	 * for work this small the pool's round trip (two cross-core wake-ups)
	 * costs more than the arithmetic. 0: every task goes to the pool (a
	 * device backend, whose calls need the pool threads it set up).
	 */
	uint64_t inline_max_bytes;
	/*
	 * A zero-filled buffer of `bytes` (> 0) for the rank(s) on CUDA device
	 * `device` (their hello.device; SHARDD_HELLO_DEVICE_HOST when none is
	 * named; the host backend ignores it); `what` names it in errors
	 * ("grad of rank 3").
	 */
	int (*alloc)(struct shd_backend_ctx *b, uint64_t bytes, int32_t device, const char *what,
		     struct shd_buf *out);
	/* Also takes a buffer never allocated (priv NULL, fd -1): a no-op. */
	void (*free)(struct shd_backend_ctx *b, struct shd_buf *buf);
	/*
	 * How a client receives an allocated `buf` (`mode`: enum
	 * shd_export_mode): a new fd or a CUDA IPC handle. 0 or -errno
	 * (-EPERM: the buffer was sealed for another mode); out->fd is -1
	 * unless 0 and kind FD.
	 */
	int (*export_buf)(struct shd_backend_ctx *b, const struct shd_buf *buf, int mode,
			  struct shd_buf_export *out);
	/*
	 * Seal a buffer exported SHD_EXPORT_OWNER so that no descriptor of it
	 * can map it writable or write it from now on (mappings made before
	 * keep writing), and export it SHD_EXPORT_RO from then on. 0 or
	 * -errno (-EPERM: its owner sealed it otherwise). NULL in a backend
	 * that cannot: it has no rank-executed groups.
	 */
	int (*seal_readonly)(struct shd_backend_ctx *b, const struct shd_buf *buf);
	/*
	 * The daemon's own address of an allocated buffer in host memory (a
	 * rank-executed group's slots and sync page), or NULL in a backend
	 * whose buffers are not host memory.
	 */
	void *(*host_map)(struct shd_backend_ctx *b, const struct shd_buf *buf);
	int (*unshard)(struct shd_backend_ctx *b, const struct shd_unshard_args *a);
	int (*reduce)(struct shd_backend_ctx *b, const struct shd_reduce_args *a);
	/* The optimizer step of one rank's shard; NULL in a backend without one (registration refuses it). */
	int (*step)(struct shd_backend_ctx *b, const struct shd_step_args *a);
	/*
	 * A reduce-scatter (SRC_GRAD) whose every member's output is the
	 * grad of a step: the same params and state, bit for bit, as
	 * `reduce` into a->outs followed by `step` of each member k with
	 * steps[k] reading outs[k], but the sum of each block of elements
	 * goes straight into the update, so no output is written and read
	 * back. a->outs are left as they were (the caller's hold zeros and
	 * stand for grads that are absent). Needs a->accumulate all 0,
	 * a->adds NULL, fp32 outputs and no skip_nonfinite (-EINVAL
	 * otherwise); steps[k].grad is not read. A failure comes before any
	 * write: no member is stepped then. NULL in a backend without it:
	 * the engine runs reduce, then step.
	 */
	int (*reduce_step)(struct shd_backend_ctx *b, const struct shd_reduce_args *a,
			   const struct shd_step_args *steps);
	/*
	 * The grad-norm part (shardd_kernels.h) of the valid rows of every
	 * param of shard `shard_rank` in `grad`, an fp32 sharded grad at the
	 * layout's shard offsets: the params' parts merged in order, computed
	 * where the buffer lives, after the work queued on it. Called on the
	 * loop thread once the ops that wrote the grad have completed; `err`
	 * may say why it failed. NULL: the engine reads the buffer back
	 * (`read`) and runs the CPU kernel.
	 */
	int (*grad_norm)(struct shd_backend_ctx *b, const struct shd_layout *l, uint32_t shard_rank,
			 const struct shd_buf *grad, struct shardd_grad_norm_part *out, char *err,
			 size_t errlen);
	/* Zero `bytes` bytes at `offset`. */
	int (*zero)(struct shd_backend_ctx *b, struct shd_buf *buf, uint64_t offset,
		    uint64_t bytes);
	/*
	 * Copy `bytes` bytes at `offset` of an allocated `buf` into `dst`, host
	 * memory (shardctl dump). Called from the loop thread while ops may be
	 * writing the buffer: a snapshot, not a consistent one. -EINVAL past the
	 * buffer's end.
	 */
	int (*read)(struct shd_backend_ctx *b, const struct shd_buf *buf, uint64_t offset,
		    uint64_t bytes, void *dst);
	/*
	 * Copy `bytes` bytes of host memory `src` to `offset` of an allocated
	 * `buf`: a checkpoint's restore, from a pool thread, while no op uses
	 * the buffer. -EINVAL past the buffer's end.
	 */
	int (*write)(struct shd_backend_ctx *b, struct shd_buf *buf, uint64_t offset,
		     uint64_t bytes, const void *src);
	/*
	 * Wait until the work queued so far on every device that holds one of
	 * the `n` buffers `on` has finished; on failure `err` may say why.
	 * NULL in a backend whose calls finish before returning.
	 */
	int (*sync)(struct shd_backend_ctx *b, const struct shd_buf *const *on, uint32_t n,
		    char *err, size_t errlen);
	/*
	 * Fences order the backend's device work with one client stream
	 * (SHARDD_MSG_STREAM), with no CPU wait on either side. Open: import
	 * the client's `nwait` interprocess events, made on CUDA device
	 * `device`, and make `nsignal` of our own there, whose handles go to
	 * `signal_events`. 0, or a negative code with the reason in `err`.
	 * All four are NULL in a backend without devices.
	 */
	int (*fences_open)(struct shd_backend_ctx *b, int32_t device, uint32_t nwait,
			   const struct shardd_cuda_ipc_handle *wait_events, uint32_t nsignal,
			   struct shardd_cuda_ipc_handle *signal_events, struct shd_fences **out,
			   char *err, size_t errlen);
	/* Work queued on the device from now on waits for the client's last record of event `slot`. */
	int (*fence_wait)(struct shd_backend_ctx *b, struct shd_fences *f, uint32_t slot);
	/* Record our event `slot` after all work queued on the device so far. */
	int (*fence_signal)(struct shd_backend_ctx *b, struct shd_fences *f, uint32_t slot);
	/* Also takes NULL. Work already queued that uses the events still completes. */
	void (*fences_close)(struct shd_backend_ctx *b, struct shd_fences *f);
	/*
	 * Collectives whose ranks sit on different devices (a shard group or a
	 * replicate group planned SHD_PLACE_NCCL, placement.h): 0 when this
	 * backend can run them, else -SHARDD_E_BACKEND with `err` saying why
	 * and what to do. NULL in a backend that ignores devices (host).
	 */
	int (*multi_device)(struct shd_backend_ctx *b, char *err, size_t errlen);
	/*
	 * A job's state, passed with its collectives (`job` of the args) and
	 * closed when the job ends, after its groups' buffers were freed.
	 * Both NULL in a backend that keeps none (host: the args' job is NULL).
	 */
	int (*job_open)(struct shd_backend_ctx *b, const char *job, struct shd_backend_job **out);
	void (*job_close)(struct shd_backend_ctx *b, struct shd_backend_job *bj);
	void (*destroy)(struct shd_backend_ctx *b);
	/*
	 * The collectives of a job whose mesh spans the nodes of the daemon
	 * world (`span`, world_boot.h), for a backend that crosses nodes
	 * itself (the cuda backend: NCCL communicators over the nodes). The
	 * args' members are this node's L ranks, member k global rank
	 * node * L + k; the layout is the whole mesh's.
	 *   span_unshard (FSDP): shards[k] and unsharded[k] of member k
	 *     (nshards = L); every unsharded buffer gets all N * L shards.
	 *   span_reduce, SRC_GRAD (FSDP): grads[k], outs[k] of member k, the
	 *     math of one reduce-scatter over every rank.
	 *   span_reduce, SRC_SHARD (HSDP): views[k] of member k holds shard
	 *     k's partial (shard_rank is ignored: member k's shard is k),
	 *     all-reduced among the nodes into outs[k] with math.
	 * Both NULL where the engine moves the bytes between nodes itself
	 * (host: world_collective.c over the world).
	 */
	int (*span_unshard)(struct shd_backend_ctx *b, const struct shd_world_boot *span,
			    const struct shd_unshard_args *a);
	int (*span_reduce)(struct shd_backend_ctx *b, const struct shd_world_boot *span,
			   const struct shd_reduce_args *a);
};

/* Every backend's state begins with this (enum shardd_backend names the kinds). */
struct shd_backend_ctx {
	const struct shd_backend_ops *ops;
	/*
	 * How the daemon's GPU work shares the GPUs with the trainers' compute,
	 * for shardctl status and the metrics: "MPS ..." or "time-sliced: ...";
	 * NULL for a backend without a GPU (host).
	 */
	const char *gpu_sharing;
	int gpu_mps;        /* 1 when every device runs the daemon's contexts as MPS clients */
	int gpu_sm_percent; /* under MPS: the daemon's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, 100 uncapped */
};

/* The host backend: memfd buffers, CPU kernels split across `pool`. 0 or -ENOMEM. */
int shd_backend_host_create(struct shd_pool *pool, struct shd_backend_ctx **out);

#endif /* SHD_BACKEND_H */
