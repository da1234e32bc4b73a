/* SPDX-License-Identifier: MIT */
/*
 * The daemon world (`shardd --world mpi`, docs/MULTINODE.md): one daemon
 * per node, started by mpirun or srun; MPI rank = node index. Every MPI
 * call of the daemon is made on one communication thread, which this file
 * owns: it initialises MPI (MPI_THREAD_FUNNELED: that thread is the one
 * that called MPI_Init_thread, so no other level is needed, and Open MPI
 * takes no locks on its progress path at this level), posts the
 * non-blocking sends and receives of every exchange, polls them against
 * their deadline and finalises MPI at shutdown. The event loop never calls
 * in here except to start and stop; a pool thread running an inter-node
 * task hands its exchange to the communication thread and waits, bounded
 * by the collective timeout.
 *
 * Bounded even when MPI never returns (Open MPI can spin inside MPI_Test
 * for good once a peer's socket broke): a watch thread that finds an
 * exchange a second past its deadline while the communication thread has
 * not finished a turn for as long declares the world dead. It parks that
 * thread (a signal whose handler never returns), fails every exchange in
 * flight naming the nodes it still waited for, and from then on every
 * exchange fails at once; the node's own jobs go on (docs/RELIABILITY.md).
 *
 * Without --world the daemon never calls shd_world_start, and MPI is not
 * initialised: single-node use needs no mpirun.
 */
#ifndef SHD_WORLD_H
#define SHD_WORLD_H

#include <stddef.h>
#include <stdint.h>

/* How partial sums travel between nodes (--internode-dtype). */
enum shd_internode_dtype {
	SHD_INTERNODE_FP32 = 0,   /* fp32 (default) */
	SHD_INTERNODE_REDUCE = 1, /* the group's reduce dtype: half the bytes for bf16/fp16 */
};

/*
 * Initialise MPI on a new communication thread and learn this node's index
 * and the number of nodes. 0, or with `err` saying why pthread_create's
 * negative errno, or -EIO when MPI did not initialise (MPI missing, not
 * started by mpirun, ...).
 */
int shd_world_start(uint32_t internode_dtype, char *err, size_t errlen);
/* Fail exchanges in flight, finalise MPI (unless a peer failed) and join the thread. */
void shd_world_stop(void);

/*
 * 1 once the world is dead (its communication thread stuck in MPI and
 * parked, world.c), with `why` (may be NULL) saying so and naming the
 * nodes; 0 while it lives or without --world. Dead, every exchange fails
 * at once with -SHARDD_E_PEER_DIED and that text, and the process must not
 * call exit() (Open MPI's destructors could wait for the parked thread).
 */
int shd_world_dead(char *why, size_t len);

/* Number of nodes of the world; 0 when the daemon runs without --world. */
uint32_t shd_world_nodes(void);
/* This daemon's node index (its MPI rank). */
uint32_t shd_world_node(void);
/* --internode-dtype: enum shd_internode_dtype. */
uint32_t shd_world_internode_dtype(void);

/*
 * One exchange among all nodes (never on the loop thread): `bytes` of
 * send[k] go to node k, and node k's bytes land at recv + k * bytes
 * (send[node] is copied there). `key` names the stream of exchanges (a job
 * and group: equal on every node, so it doubles as the MPI tag) and `seq`
 * its position in that stream; `check` what must be equal on every node (a
 * digest of the group's params, the op and its step): a node's message for another key, seq or
 * check is an error, not data. Waits until every node's bytes arrived, an MPI error,
 * or `deadline_ns` (shd_now_ns clock), or a second after it when MPI does
 * not return (the world dies: shd_world_dead). 0; or -SHARDD_E_TIMEOUT /
 * -SHARDD_E_PEER_DIED / -SHARDD_E_MISMATCH / -SHARDD_E_NOMEM with `err`
 * saying why and missing[k] = 1 for each node k whose bytes did not arrive
 * (missing has nodes entries).
 */
int shd_world_exchange(uint64_t key, uint64_t seq, uint64_t check, const void *const *send,
		       void *recv, size_t bytes, uint64_t deadline_ns, uint8_t *missing, char *err,
		       size_t errlen);

/*
 * The memory of an exchange without copies: the caller fills
 * shd_world_buf_data(b) and drops its reference with shd_world_buf_put;
 * the memory lives on while MPI still uses it (a send to a node that
 * stopped answering), and is freed when the last reference goes (no
 * cache: the engine counts every such buffer against --max-memory,
 * world_collective.c). NULL when out of memory. shd_world_buf_busy: 1 while MPI
 * still holds b for an exchange that ended (or runs), when the caller's is
 * not the only reference; reusing b then would change bytes MPI may still send.
 */
struct shd_world_buf;
struct shd_world_buf *shd_world_buf_new(size_t bytes);
uint8_t *shd_world_buf_data(struct shd_world_buf *b);
int shd_world_buf_busy(struct shd_world_buf *b);
void shd_world_buf_put(struct shd_world_buf *b);

/*
 * shd_world_exchange within one buffer: node k gets the `bytes` at
 * send_off + k * send_stride (send_stride 0: the same bytes to every node),
 * node k's bytes land at recv_off + k * bytes; this node's own slot there
 * is left as it is (its bytes are at send_off + node * send_stride: read
 * them there, or make the two places one).
 * Same results and errors as shd_world_exchange.
 */
int shd_world_xchg(uint64_t key, uint64_t seq, uint64_t check, struct shd_world_buf *b,
		   size_t send_off, size_t send_stride, size_t recv_off, size_t bytes,
		   uint64_t deadline_ns, uint8_t *missing, char *err, size_t errlen);

/*
 * shd_world_xchg in two halves, so that the caller works while the bytes
 * travel (world_host.c sums one chunk of an all-reduce while the next one
 * is exchanged): _start hands the exchange over and returns at once (0,
 * *out set; or -SHARDD_E_NOMEM with err written and nothing started),
 * _wait waits for it and gives shd_world_xchg's result. Every started
 * exchange must be waited for, once; until then b's bytes, missing and
 * err stay the exchange's. One exchange of a key in flight at a time: a
 * second one started before the first ended could take its messages.
 */
struct shd_world_xchg;
int shd_world_xchg_start(uint64_t key, uint64_t seq, uint64_t check, struct shd_world_buf *b,
			 size_t send_off, size_t send_stride, size_t recv_off, size_t bytes,
			 uint64_t deadline_ns, uint8_t *missing, char *err, size_t errlen,
			 struct shd_world_xchg **out);
int shd_world_xchg_wait(struct shd_world_xchg *h);

/*
 * An all-gather that does not wait (for the loop thread): `bytes` of
 * `mine` to every node. When it ends (every node's bytes, an error, the
 * deadline) the communication thread adds 1 to the eventfd `wake_fd`;
 * shd_world_op_done then says 1, and shd_world_op_end gives node k's bytes
 * at recv + k * bytes, or the error as shd_world_exchange does, and frees
 * the op. shd_world_op_abandon gives it up at any time (freed when MPI lets
 * go). 0, or -SHARDD_E_NOMEM with `err` written.
 */
struct shd_world_op;
int shd_world_gather_start(uint64_t key, uint64_t seq, uint64_t check, const void *mine,
			   size_t bytes, uint64_t deadline_ns, int wake_fd,
			   struct shd_world_op **out, char *err, size_t errlen);
int shd_world_op_done(struct shd_world_op *op);
int shd_world_op_end(struct shd_world_op *op, void *recv, uint8_t *missing, char *err,
		     size_t errlen);
void shd_world_op_abandon(struct shd_world_op *op);

#endif /* SHD_WORLD_H */
