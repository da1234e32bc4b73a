/* SPDX-License-Identifier: MIT */
/*
 * Communicators that span the nodes of the daemon world (docs/CUDA.md,
 * "Across nodes"): which communicator and which rank each of a node's
 * ranks takes, and the bootstrap by which every node's daemon makes them
 * from node 0's unique ids. No CUDA and no MPI here: the bootstrap moves
 * its bytes through the exchange it is given (the world's, world.h, in the
 * daemon; an in-memory one in tests/unit/test_world_boot.c) and makes its
 * communicators through the calls it is given (NCCL's, in
 * backend_cuda_world.c).
 *
 * The two layouts (docs/MULTINODE.md), with N nodes of L ranks each,
 * global rank n*L + k on node n:
 *   HSDP (replicate = N, shard = L): L communicators, one per local index
 *        k, each over the N ranks with that index (NCCL rank = node): the
 *        all-reduce of shard k among the nodes.
 *   FSDP (replicate = 1, shard = N*L): one communicator over every rank
 *        (NCCL rank = global rank): the all-gather and reduce-scatter.
 */
#ifndef SHD_WORLD_BOOT_H
#define SHD_WORLD_BOOT_H

#include <stddef.h>
#include <stdint.h>

/* Bytes of one unique id (NCCL_UNIQUE_ID_BYTES; backend_cuda_nccl.c checks it). */
#define SHD_WORLD_ID_BYTES 128
/*
 * World exchanges an op across nodes may make, numbered seq .. seq + 3 of
 * its group's stream: the agreement, node 0's ids, every node's set-up
 * outcome, and the probe after a collective failed. The engine takes all
 * four for every op, used or not, so that the nodes' streams stay paired.
 */
#define SHD_WORLD_SEQS 4

enum shd_world_boot_layout {
	SHD_WORLD_HSDP = 1,
	SHD_WORLD_FSDP = 2,
};

/* One op of a job spanning the world, as the engine hands it to a backend that crosses nodes. */
struct shd_world_boot {
	uint32_t layout;      /* enum shd_world_boot_layout */
	uint32_t nodes, node; /* the world's nodes, this daemon's index */
	uint32_t local;       /* L: ranks per node; this node's are n*L .. n*L+L-1 */
	uint64_t key;         /* the group's stream of world exchanges (equal on every node) */
	uint64_t seq;         /* the first of the SHD_WORLD_SEQS numbers this op owns */
	uint64_t check;       /* what every node's messages must agree on (the group and the op) */
	uint64_t timeout_ns;  /* the collective timeout: bounds every wait */
};

/* Communicators a node holds for one group: L under HSDP, 1 under FSDP. */
uint32_t shd_world_boot_comms(const struct shd_world_boot *s);

/*
 * Local rank k (0 <= k < L) of this node: the communicator it belongs to
 * (0 .. shd_world_boot_comms - 1), its NCCL rank there and the communicator's
 * size. -SHARDD_E_INVALID for a k or a span out of range.
 */
int shd_world_boot_member(const struct shd_world_boot *s, uint32_t k, uint32_t *comm,
			  uint32_t *rank, uint32_t *nranks);

/* "node 1 (ranks 2..3), node 2 (ranks 4..5)" of the nodes with marked[k] != 0; "" when none. */
void shd_world_boot_who(const struct shd_world_boot *s, const uint8_t *marked, char *buf,
			size_t len);

/* How the bootstrap reaches the other nodes and makes communicators. */
struct shd_world_boot_ops {
	void *ctx;
	/*
	 * All-gather: `bytes` of `mine` to every node; node k's land at
	 * all + k * bytes. Exchange `seq` of the op's stream, waiting until
	 * `deadline_ns` (shd_now_ns clock). 0, or a negative code with `err`
	 * written and missing[k] = 1 for each node whose bytes did not come.
	 */
	int (*exchange)(void *ctx, uint64_t seq, const void *mine, void *all, size_t bytes,
			uint64_t deadline_ns, uint8_t *missing, char *err, size_t errlen);
	/* Node 0 only: `n` new unique ids into ids (n * SHD_WORLD_ID_BYTES). 0 or a negative code with `err`. */
	int (*make_ids)(void *ctx, uint8_t *ids, uint32_t n, char *err, size_t errlen);
	/*
	 * Make this node's members of every communicator from node 0's `ids`
	 * (communicator c from ids + c * SHD_WORLD_ID_BYTES), waiting for the
	 * other nodes to join until `deadline_ns`. 0, or a negative code with
	 * `err`, nothing left made.
	 */
	int (*init)(void *ctx, const uint8_t *ids, uint64_t deadline_ns, char *err, size_t errlen);
	/* Abort and forget this node's communicators of the group, if any. */
	void (*drop)(void *ctx);
};

/*
 * Make sure every node holds the group's communicators, made together.
 * `*gen` is this node's generation of them (0: it holds none). The nodes
 * exchange their generations (seq); when all hold the same live one, that
 * is all. Otherwise every node drops what it holds, node 0 makes the ids,
 * every node takes node 0's (seq + 1) and makes its members inside one
 * set-up bounded by the collective timeout, and the nodes exchange the
 * outcome (seq + 2): where every node succeeded, *gen becomes one more
 * than the largest generation seen, on every node alike; where any
 * failed, every node drops its communicators again. 0, or a negative
 * code with `err` naming the nodes that did not join and why; *gen is
 * then 0.
 */
int shd_world_bootstrap(const struct shd_world_boot *s, const struct shd_world_boot_ops *ops,
			uint32_t *gen, char *err, size_t errlen);

/*
 * After a collective failed on this node: ask every node (seq + 3) to
 * answer within the collective timeout, and write the ones that did not
 * into `who` (shd_world_boot_who; "" when every node answered).
 */
void shd_world_boot_probe(const struct shd_world_boot *s, const struct shd_world_boot_ops *ops,
			  char *who, size_t len);

#endif /* SHD_WORLD_BOOT_H */
