/* SPDX-License-Identifier: MIT */
/*
 * A registered parameter group (FSDP2's FSDPParamGroup): its spec as the
 * first rank registered it, its layout, its buffers on the backend and the
 * per-rank state the ops keep (grads present, HSDP partials, holds on the
 * unsharded copy). The collectives on it live in collective.c, the ops'
 * arithmetic in task.c.
 */
#ifndef SHD_GROUP_H
#define SHD_GROUP_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "layout.h"
#include "placement.h"
#include "shardd_exec.h"
#include "shardd_proto.h"

/*
 * What travels with a rank's GROUP reply besides the reply's export_kind:
 * the fds of the buffers exported as fds and the handles of those exported
 * as CUDA IPC handles, each in buffer order.
 */
struct shd_group_export {
	int fds[SHARDD_GROUP_BUFS + 1]; /* new fds (+ a rank-executed group's sync page);
					   shd_group_export_close closes them */
	int nfds;
	struct shardd_cuda_ipc_handle ipc[SHARDD_GROUP_BUFS];
	int nipc;
};

/* Most optimizer states a shard has: AdamW's exp_avg, exp_avg_sq, max_exp_avg_sq. */
#define SHD_OPTIM_STATES 3

struct shd_group {
	uint32_t id; /* nonzero; sqe.group */
	char name[SHARDD_NAME_MAX];
	struct shardd_register_group hdr; /* the first registration's header */
	struct shardd_param_spec *specs;  /* its params (hdr.nparams) */
	uint32_t replicate, shard, world; /* mesh R x S, world = R * S */
	uint32_t shard_base;              /* FSDP across nodes: the shard rank of this node's rank 0
					       (layout.world is the whole shard group's); else 0 */
	struct shd_layout layout;         /* built for the shard group size S */
	uint32_t grad_dtype;              /* uniform grad dtype, NONE when params differ */
	uint32_t reduce_dtype;            /* policy reduce_dtype, else grad_dtype */
	char grad_dtypes[64];             /* "{fp32, bf16}": the distinct grad dtypes, in order */
	uint64_t *shard_offsets;          /* per param: bytes into a flat shard / sharded grad */
	uint64_t *reduce_offsets;         /* per param: bytes into one shard in the reduce dtype
					       (shd_placement_reduce_shard): an HSDP partial, a staging block */
	uint64_t reduce_shard_size; /* bytes of such a shard; 0 without a uniform reduce dtype */
	/* bytes of one partial: reduce_shard_size with a replicate dim, else 0 */
	uint64_t partial_size;
	/*
	 * bytes of the inter-node exchange buffers (world_collective.c): 0 unless the job spans
	 * nodes
	 */
	uint64_t internode_size;
	uint64_t internode_held; /* of those, allocated now */

	int allocated;             /* buffers below were allocated (each: shd_buf_allocated) */
	uint8_t *unsharded_own;    /* [replicate]: each rank of the replica has its own unsharded
					       buffer (its shard group runs NCCL), else all share one */
	struct shd_buf *unsharded; /* [world], lent read-only: allocated for every rank of a replica
					       with unsharded_own, else only for its first rank (shared) */
	struct shd_buf *shards;    /* [world]: flat shards, params' dtypes */
	struct shd_buf *sharded_grads; /* [world]: reduce outputs, params' dtypes */
	struct shd_buf *grads;         /* [world]: unsharded grads, grad dtype */
	/* [world] when replicate > 1: reduce-scatter sums kept for the all-reduce */
	struct shd_buf *partials;

	/* Written only by the group's running task: tasks of a group run one at a time. */
	uint8_t *grad_present;    /* [world]: sharded grad holds a value (accumulate into it) */
	uint8_t *partial_present; /* [world]: partial holds a reduce-scatter output */

	/* The optimizer (kind NONE: none) and its fp32 state per rank, each like a flat shard. */
	struct shardd_optim_config optim;
	struct shd_buf *optim_state[SHD_OPTIM_STATES]; /* [k][world]: shd_group_optim_state_name */
	/* Written by the group's running task (step), read atomically by GROUP replies. */
	uint64_t *last_step;   /* [world]: last step applied or skipped on the rank's shard */
	uint64_t *optim_steps; /* [world]: updates applied (torch's state['step']) */

	/* Loop thread only. */
	uint8_t *holds; /* [world]: rank holds its replica's unsharded copy */

	/*
	 * Who moves the bytes of unshard, reduce and reshard (enum shardd_exec:
	 * DAEMON or RANKS, never AUTO) and why, for shardctl groups. RANKS
	 * (exec.c): every rank has its own unsharded copy, its grad buffer ends
	 * with its slot (shardd_exec.h), `sync` is the group's sync page, and a
	 * rank's flat shard and grad buffer are sealed read-only once it has
	 * mapped them (exec_sealed), then lent to its peers. Loop thread only.
	 */
	uint32_t exec;
	char exec_why[160];
	struct shd_buf sync;
	/* [world]: the generation a rank's buffers were sealed and published under (it stays
	   after the rank left: what it published is final); 0: not sealed */
	uint32_t *exec_sealed;
	uint32_t exec_gen; /* the last generation given to a rank's buffers */
};

/*
 * Validate a SHARDD_MSG_REGISTER_GROUP payload (untrusted) and copy it out:
 * *hdr, and *specs (malloc'd, hdr->nparams entries; the caller frees), and
 * with hdr->init SHARDD_INIT_RESTORE the restore path into `restore`
 * (NUL-terminated; "" for the job's newest checkpoint in --state-dir).
 * Param fields are checked by shd_layout_build. Returns 0,
 * -SHARDD_E_MALFORMED or -SHARDD_E_INVALID with `err` naming the field and
 * value, or -ENOMEM.
 */
int shd_group_parse(const void *payload, size_t len, struct shardd_register_group *hdr,
		    struct shardd_param_spec **specs, struct shardd_optim_config *optim,
		    char restore[SHARDD_RESTORE_PATH_MAX], char *err, size_t errlen);

/* 0, or -SHARDD_E_INVALID with `err` naming the optimizer config's field, value and rule. */
int shd_group_optim_check(const char *group, const struct shardd_optim_config *o, char *err,
			  size_t errlen);

/*
 * Give a created group (no buffers yet) its optimizer `o` (kind NONE: none):
 * every param must be fp32. 0, -SHARDD_E_INVALID with `err`, or -ENOMEM.
 */
int shd_group_set_optim(struct shd_group *g, const struct shardd_optim_config *o, char *err,
			size_t errlen);

/* State buffers per rank the optimizer keeps (SGD: momentum when momentum != 0), and their names. */
uint32_t shd_group_optim_states(const struct shardd_optim_config *o);
const char *shd_group_optim_state_name(const struct shardd_optim_config *o, uint32_t k);

/*
 * A group from a parsed registration for a mesh R x S: builds the layout
 * (its errors are returned with their text) and takes ownership of `specs`
 * on success. No buffers yet. 0, -SHARDD_E_INVALID or -ENOMEM.
 */
int shd_group_create(uint32_t id, const struct shardd_register_group *hdr,
		     struct shardd_param_spec *specs, uint32_t replicate, uint32_t shard,
		     struct shd_group **out, char *err, size_t errlen);

/*
 * 0 when `hdr`/`specs` (registered by `rank`) equal the group's spec
 * (registered by `first_rank`), else 1 with `err` naming the first differing
 * param, the field, both values and both ranks.
 */
int shd_group_compare(const struct shd_group *g, const struct shardd_register_group *hdr,
		      const struct shardd_param_spec *specs,
		      const struct shardd_optim_config *optim, uint32_t rank, uint32_t first_rank,
		      char *err, size_t errlen);

/*
 * Bytes of every buffer a group will ever hold in host memory (the host
 * backend's buffers), by kind: what the engine counts against
 * --max-memory and --max-job-memory when the group is registered.
 */
struct shd_group_memory {
	uint64_t unsharded;     /* one copy per replica */
	uint64_t shards;        /* flat shards (the master params), one per rank */
	uint64_t sharded_grads; /* reduce outputs, one per rank */
	uint64_t grads;         /* unsharded grad buffers (reduce inputs), one per rank */
	uint64_t partials;      /* HSDP reduce-scatter outputs, one per rank with a replicate dim */
	/* optimizer state the daemon keeps per rank shard (fp32, shard-sized) */
	uint64_t optimizer;
	/* a job across nodes: the group's inter-node exchange buffers and scratch */
	uint64_t internode;
	/* rank-executed: each rank's slot page and the group's sync page */
	uint64_t exec;
	uint64_t total; /* the sum */
};

/* What the group's buffers take once allocated (host backend: no unsharded_own). */
void shd_group_memory_need(const struct shd_group *g, struct shd_group_memory *m);
/*
 * Add the bytes of the group's buffers allocated now, by kind, to *m (the
 * total too): what it holds, where memory_need is what it will hold.
 */
void shd_group_memory_held(const struct shd_group *g, struct shd_group_memory *m);

/*
 * Allocate every buffer (zero-filled) on the device of the rank that uses it
 * (`devices`: [world], each rank's hello.device). `pl` is the group's
 * placement (NULL where devices are ignored: the host backend): a replica
 * whose shard group runs NCCL gets one unsharded buffer per rank, on that
 * rank's device; any other replica one, on its first rank's device. 0 or
 * the backend's error, with `err` naming the buffer.
 */
int shd_group_alloc(struct shd_group *g, struct shd_backend_ctx *b, const int32_t *devices,
		    const struct shd_placement *pl, char *err, size_t errlen);

/* The unsharded buffer `rank` reads: its own, or the one its replica shares. */
static inline struct shd_buf *shd_group_unsharded(const struct shd_group *g, uint32_t rank)
{
	uint32_t u = rank / g->shard;

	return &g->unsharded[g->unsharded_own[u] ? rank : u * g->shard];
}

/*
 * The SHARDD_MSG_GROUP reply for `rank`: *reply (export_kind included),
 * layouts[nparams], and in *ex how each buffer (unsharded read-only, grad,
 * flat shard, sharded grad) travels: a new fd the caller closes
 * (shd_group_export_close) or a CUDA IPC handle. 0 or -errno (no fd
 * left open).
 */
int shd_group_reply(const struct shd_group *g, struct shd_backend_ctx *b, uint32_t rank,
		    struct shardd_group_reply *reply, struct shardd_param_layout *layouts,
		    struct shd_group_export *ex);

/* Close the fds of a reply's export. */
void shd_group_export_close(struct shd_group_export *ex);

/* Free the buffers and the group. */
void shd_group_destroy(struct shd_group *g, struct shd_backend_ctx *b);

/* Bytes of each rank's grad buffer: its grads, and a rank-executed group's slot after them. */
static inline uint64_t shd_group_grad_map_size(const struct shd_group *g)
{
	return g->exec == SHARDD_EXEC_RANKS ? shardd_exec_grad_map_size(g->layout.grad_size)
					    : g->layout.grad_size;
}

/* A rank-executed group's rank r's slot, as the daemon maps it (buffers allocated). */
static inline struct shardd_exec_slot *shd_group_exec_slot(const struct shd_group *g,
							   struct shd_backend_ctx *b, uint32_t r)
{
	uint8_t *grad = b->ops->host_map(b, &g->grads[r]);

	return (struct shardd_exec_slot *)(void *)(grad +
						   shardd_exec_slot_offset(g->layout.grad_size));
}

/*
 * Rank r's sharded grad holds a value: the daemon's flag, or in a
 * rank-executed group the rank's reduces since the daemon last cleared it
 * (its slot, the rank's own word: only its own step trusts it).
 */
static inline int shd_group_grad_present(const struct shd_group *g, struct shd_backend_ctx *b,
					 uint32_t r)
{
	const struct shardd_exec_slot *s;

	if (g->exec != SHARDD_EXEC_RANKS)
		return g->grad_present[r];
	s = shd_group_exec_slot(g, b, r);
	return shardd_load_acquire(&s->reduces) != SHARDD_READ_ONCE(s->cleared);
}

/* The daemon zeroed rank r's sharded grad (a step, a zero_grad). */
static inline void shd_group_grad_clear(struct shd_group *g, struct shd_backend_ctx *b, uint32_t r)
{
	struct shardd_exec_slot *s;

	if (g->exec != SHARDD_EXEC_RANKS) {
		g->grad_present[r] = 0;
		return;
	}
	s = shd_group_exec_slot(g, b, r);
	shardd_store_release(&s->cleared, shardd_load_acquire(&s->reduces));
}

/* The shard rank of `rank` of the group: its rows in the layout (shard_base, across nodes). */
static inline uint32_t shd_group_shard_rank(const struct shd_group *g, uint32_t rank)
{
	return g->shard_base + rank % g->shard;
}

#endif /* SHD_GROUP_H */
