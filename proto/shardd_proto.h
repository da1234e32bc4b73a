/* SPDX-License-Identifier: MIT */
/*
 * shardd wire and shared-memory protocol.
 *
 * Every struct here has a fixed little-endian layout, checked with
 * _Static_assert below; proto/PROTOCOL.md documents each field. This header
 * includes libc only, so any client (C, or another language reading
 * PROTOCOL.md) can speak the protocol without libshardd.
 */
#ifndef SHARDD_PROTO_H
#define SHARDD_PROTO_H

#include <stddef.h>
#include <stdint.h>

/* C++ (nvcc, C++ clients) spells C11's _Static_assert as static_assert. */
#if defined(__cplusplus) && !defined(_Static_assert)
#define _Static_assert static_assert
#endif

/* ------------------------------------------------------------------ */
/* Constants                                                           */
/* ------------------------------------------------------------------ */

#define SHARDD_MAGIC       0x44524853u /* "SHRD" as little-endian bytes */
#define SHARDD_RING_MAGIC  0x474e4952u /* "RING" */
#define SHARDD_PROTO_MAJOR 1           /* incompatible changes bump this */
#define SHARDD_PROTO_MINOR 5           /* compatible additions bump this */

#define SHARDD_NAME_MAX       64    /* job and group names, NUL included */
#define SHARDD_PARAM_NAME_MAX 80    /* param names, NUL included */
#define SHARDD_MAX_DIMS       8     /* param rank */
#define SHARDD_MAX_WORLD      1024  /* replicate * shard */
#define SHARDD_MAX_PARAMS     65536 /* params in one group */
#define SHARDD_ALIGN          64    /* every param offset in every buffer */

/*
 * A control message larger than one datagram is split: the first datagram
 * holds the header and the first payload bytes, each following datagram
 * holds only payload bytes, every datagram at most SHARDD_CTRL_CHUNK bytes.
 * Receivers reassemble until hdr.length payload bytes have arrived.
 */
#define SHARDD_CTRL_CHUNK (60u * 1024u)
#define SHARDD_CTRL_MAX   (64u * 1024u * 1024u) /* payload limit */

#define SHARDD_RING_ENTRIES_DEFAULT 1024 /* SQ and CQ each, power of two */
#define SHARDD_RING_MSG_SIZE        256  /* error text slot per CQ entry */
#define SHARDD_CACHELINE            64

/* ------------------------------------------------------------------ */
/* Enumerations                                                        */
/* ------------------------------------------------------------------ */

enum shardd_dtype {
	SHARDD_DTYPE_NONE = 0, /* "not set" in policies: FSDP2's None */
	SHARDD_DTYPE_FP32 = 1,
	SHARDD_DTYPE_BF16 = 2,
	SHARDD_DTYPE_FP16 = 3,
	SHARDD_DTYPE_COUNT /* codes >= this are invalid */
};

enum shardd_backend {
	SHARDD_BACKEND_HOST = 1,
	SHARDD_BACKEND_CUDA = 2,
};

enum shardd_op {
	SHARDD_OP_NOP = 1,       /* completes at once: latency probe */
	SHARDD_OP_BARRIER = 2,   /* job-wide, keyed by sqe.step */
	SHARDD_OP_UNSHARD = 3,   /* collective over the shard group, by step */
	SHARDD_OP_REDUCE = 4,    /* collective over the shard group (+replicas) */
	SHARDD_OP_RESHARD = 5,   /* drop this rank's hold on the unsharded copy */
	SHARDD_OP_ZERO_GRAD = 6, /* this rank's sharded grads: zero, "absent" */
	SHARDD_OP_STEP = 7,      /* the group's optimizer on this rank's shard, once per step */
	SHARDD_OP_GRAD_NORM = 8, /* job-wide: total norm of every group's sharded grads (minor 3) */
	SHARDD_OP_CHECKPOINT =
		9, /* job-wide: save every group to the daemon's --state-dir (minor 4) */
	SHARDD_OP_COUNT
};

/*
 * SHARDD_OP_STEP: sqe.step is the step number (>= 1), sqe.flags
 * SHARDD_STEP_*, sqe.arg[SHARDD_SQE_STEP_LR] the learning rate as the
 * bits of an IEEE-754 double, and with SHARDD_STEP_CLIP
 * sqe.arg[SHARDD_SQE_STEP_CLIP] the clip coefficient (clip_grad_norm_'s
 * max_norm / (total_norm + 1e-6), clamped to 1 by the caller) as double
 * bits, rounded to fp32 and multiplied into the grad. With
 * SHARDD_STEP_CLIP_JOB the same word holds clip_grad_norm_'s max_norm
 * instead (finite, > 0) and the daemon computes the coefficient from the
 * job's grad_norm of the same step number, as torch does in fp32:
 * min(1, max_norm * (1 / (norm + 1e-6))). SHARDD_STEP_SKIP_JOB_NONFINITE
 * skips the step on every rank when that grad_norm found a NaN or Inf.
 * The daemon keeps the grad_norm results of the job's last
 * SHARDD_GRAD_NORM_KEPT step numbers; a step that names one it does not
 * hold fails (-SHARDD_E_STATE). SHARDD_STEP_REPLAY (alone, lr and clip
 * words 0): apply the step with the flags and words another rank of the
 * group submitted for the same step number (a restarted rank's catch-up).
 * Other arg words stay zero. The completion's res is one of enum
 * shardd_step_result or a negative error.
 */
#define SHARDD_STEP_SKIP_NONFINITE \
	(1u << 0) /* skip (no update) when this rank's sharded grad holds a NaN or Inf */
#define SHARDD_STEP_CLIP (1u << 1) /* arg[SHARDD_SQE_STEP_CLIP] holds a clip coefficient */
#define SHARDD_STEP_CLIP_JOB \
	(1u                  \
	 << 2) /* arg[SHARDD_SQE_STEP_CLIP] holds max_norm; the job's grad_norm gives the coefficient (minor 4) */
#define SHARDD_STEP_SKIP_JOB_NONFINITE \
	(1u                            \
	 << 3) /* skip on every rank when the job's grad_norm of this step was non-finite (minor 4) */
#define SHARDD_STEP_REPLAY \
	(1u << 4) /* as another rank of the group submitted this step (minor 4) */
#define SHARDD_STEP_FLAGS_MASK                                                  \
	(SHARDD_STEP_SKIP_NONFINITE | SHARDD_STEP_CLIP | SHARDD_STEP_CLIP_JOB | \
	 SHARDD_STEP_SKIP_JOB_NONFINITE | SHARDD_STEP_REPLAY)
#define SHARDD_GRAD_NORM_KEPT 2 /* grad_norm results the daemon keeps per job, by step number */
#define SHARDD_SQE_STEP_LR    0
#define SHARDD_SQE_STEP_CLIP  1

enum shardd_step_result {
	SHARDD_STEP_APPLIED = 0, /* the update was applied; the sharded grad is cleared */
	SHARDD_STEP_SKIPPED =
		1, /* SKIP_NONFINITE and a non-finite grad: params and state unchanged, grad cleared */
	SHARDD_STEP_ALREADY =
		2, /* a step >= this one was applied or skipped before: nothing changed */
};

/*
 * SHARDD_OP_GRAD_NORM: job-wide like BARRIER (sqe.group and sqe.flags 0),
 * keyed by sqe.step and the norm type, sqe.arg[SHARDD_SQE_GRAD_NORM_TYPE]
 * as double bits: 2.0 or +inf. A completion with res 0 carries the total
 * norm as double bits in cqe.result[SHARDD_CQE_GRAD_NORM] and 1 in
 * cqe.result[SHARDD_CQE_GRAD_NORM_NONFINITE] when some grad element is NaN
 * or Inf (then the norm is NaN or Inf too).
 */
/*
 * SHARDD_OP_CHECKPOINT: job-wide like BARRIER (sqe.group, sqe.flags and
 * arg 0), keyed by sqe.step, the step boundary it is taken at. When every
 * rank has arrived the daemon writes every group's params and optimizer
 * state into <--state-dir>/<job>/step-<step, 12 digits> (docs/CHECKPOINTS.md);
 * each rank's completion comes when the checkpoint is durable (res 0) or
 * has failed. Submit it after the completions of the step's ops.
 */
#define SHARDD_SQE_GRAD_NORM_TYPE      0
#define SHARDD_CQE_GRAD_NORM           0
#define SHARDD_CQE_GRAD_NORM_NONFINITE 1

/*
 * SHARDD_OP_BARRIER failing with -SHARDD_E_MISMATCH: cqe.result
 * [SHARDD_CQE_BARRIER_OTHER] is the barrier number the rank was refused
 * against (the newcomer's for the ranks that waited, the waiting ranks'
 * for the newcomer), so a client can tell whose barrier it met (minor 4).
 */
#define SHARDD_CQE_BARRIER_OTHER 0

/* Optimizers (struct shardd_optim_config.kind). */
enum shardd_optim {
	SHARDD_OPTIM_NONE = 0,
	SHARDD_OPTIM_SGD = 1,   /* torch.optim.SGD */
	SHARDD_OPTIM_ADAMW = 2, /* torch.optim.AdamW */
	SHARDD_OPTIM_COUNT
};

/* struct shardd_optim_config.flags */
#define SHARDD_OPTIM_NESTEROV (1u << 0) /* SGD */
#define SHARDD_OPTIM_MAXIMIZE (1u << 1) /* both */
#define SHARDD_OPTIM_AMSGRAD  (1u << 2) /* AdamW */
#define SHARDD_OPTIM_FLAGS_MASK \
	(SHARDD_OPTIM_NESTEROV | SHARDD_OPTIM_MAXIMIZE | SHARDD_OPTIM_AMSGRAD)

/* sqe.flags for SHARDD_OP_REDUCE */
#define SHARDD_REDUCE_ALL_REDUCE (1u << 0) /* HSDP: all-reduce across replicas now */
/*
 * Step each rank's shard right after the reduce, as SHARDD_OP_STEP with
 * the reduce's step number and sqe.arg[SHARDD_SQE_STEP_LR] as its lr (no
 * clipping, no skipping); the reduce's res is then the step's result. Under
 * HSDP only with SHARDD_REDUCE_ALL_REDUCE.
 */
#define SHARDD_REDUCE_STEP       (1u << 1)
#define SHARDD_REDUCE_FLAGS_MASK (SHARDD_REDUCE_ALL_REDUCE | SHARDD_REDUCE_STEP)

/*
 * Error codes. Calls and completions report 0 or a negative value: either
 * -errno or -SHARDD_E*. Project codes start at 1000, above every errno.
 */
enum shardd_error {
	SHARDD_E_BASE = 1000,
	SHARDD_E_MAGIC = 1001,      /* wrong magic in a message or ring */
	SHARDD_E_VERSION = 1002,    /* protocol major version differs */
	SHARDD_E_MALFORMED = 1003,  /* truncated or malformed message */
	SHARDD_E_PERM = 1004,       /* peer credentials not allowed */
	SHARDD_E_RANK_TAKEN = 1005, /* another live client holds this rank */
	SHARDD_E_MESH = 1006,       /* mesh differs from the job's */
	SHARDD_E_INVALID = 1007,    /* a field has an invalid value */
	SHARDD_E_TIMEOUT = 1008,    /* collective timeout: ranks missing */
	SHARDD_E_PEER_DIED = 1009,  /* a rank of the rendezvous died */
	SHARDD_E_MISMATCH = 1010,   /* ranks disagree on step, flags or spec */
	SHARDD_E_SHUTDOWN = 1011,   /* the daemon is shutting down */
	SHARDD_E_NOGROUP = 1012,    /* unknown group id or name */
	SHARDD_E_STATE = 1013,      /* op not allowed in this state */
	SHARDD_E_NOMEM = 1014,      /* daemon could not allocate */
	SHARDD_E_BACKEND = 1015,    /* backend failure (message says which) */
	SHARDD_E_NOJOB = 1016,      /* unknown job (admin) */
	SHARDD_E_MAX
};

/*
 * How one buffer of a GROUP reply travels (shardd_group_reply.export_kind).
 * Zero is what the host backend always sends, so a reply whose kinds are all
 * zero means what it meant before the field existed: four fds.
 */
enum shardd_export_kind {
	SHARDD_EXPORT_FD = 0, /* an fd in the message's SCM_RIGHTS: a memfd, or a cuda VMM fd */
	SHARDD_EXPORT_CUDA_IPC = 1, /* no fd: a struct shardd_cuda_ipc_handle in the payload */
	SHARDD_EXPORT_COUNT         /* codes >= this are invalid */
};

/* Control message types */
enum shardd_msg_type {
	SHARDD_MSG_HELLO = 1,           /* client -> daemon */
	SHARDD_MSG_WELCOME = 2,         /* daemon -> client, fds: ring, doorbell */
	SHARDD_MSG_ERROR = 3,           /* daemon -> client */
	SHARDD_MSG_GOODBYE = 4,         /* client -> daemon, no reply */
	SHARDD_MSG_REGISTER_GROUP = 5,  /* client -> daemon */
	SHARDD_MSG_OPEN_GROUP = 6,      /* client -> daemon */
	SHARDD_MSG_GROUP = 7,           /* daemon -> client, fds: 4 buffers */
	SHARDD_MSG_ADMIN = 8,           /* client -> daemon, JSON payload */
	SHARDD_MSG_ADMIN_REPLY = 9,     /* daemon -> client, JSON payload */
	SHARDD_MSG_STREAM = 10,         /* client -> daemon: its fence events (cuda backend) */
	SHARDD_MSG_STREAM_REPLY = 11,   /* daemon -> client: the daemon's fence events */
	SHARDD_MSG_EXEC_MAP = 12,       /* client -> daemon: rank-executed mappings (minor 5) */
	SHARDD_MSG_EXEC_MAP_REPLY = 13, /* daemon -> client, fds: a peer's shard and grad buffer */
	SHARDD_MSG_COUNT
};

/* ------------------------------------------------------------------ */
/* Control plane                                                       */
/* ------------------------------------------------------------------ */

/* Every control message starts with this header. */
struct shardd_msg_hdr {
	uint32_t magic;  /* SHARDD_MAGIC */
	uint16_t type;   /* enum shardd_msg_type */
	uint16_t flags;  /* zero */
	uint32_t length; /* payload bytes after the header, all datagrams */
	uint32_t seq;    /* request number; a reply echoes it */
};

#define SHARDD_HELLO_DEVICE_HOST (-1)

struct shardd_hello {
	uint16_t major;            /* SHARDD_PROTO_MAJOR of the client */
	uint16_t minor;            /* SHARDD_PROTO_MINOR of the client */
	uint32_t pid;              /* client pid, for pidfd liveness */
	char job[SHARDD_NAME_MAX]; /* NUL-terminated job name */
	uint32_t rank;             /* global rank = replica * shard + shard_rank */
	uint32_t replicate;        /* mesh rows (1 for plain FSDP) */
	uint32_t shard;            /* mesh columns: shard group size */
	int32_t device;            /* CUDA device ordinal; SHARDD_HELLO_DEVICE_HOST */
	uint32_t sq_entries;       /* requested SQ/CQ size; 0 = default */
	uint32_t flags;            /* zero */
	uint8_t rsvd[16];          /* zero */
};

struct shardd_welcome {
	uint16_t major;      /* daemon's SHARDD_PROTO_MAJOR */
	uint16_t minor;      /* daemon's SHARDD_PROTO_MINOR */
	uint32_t client_id;  /* daemon-wide id of this connection */
	uint32_t backend;    /* enum shardd_backend */
	uint32_t sq_entries; /* SQ capacity, power of two */
	uint32_t cq_entries; /* CQ capacity, power of two, >= sq_entries */
	uint32_t daemon_pid;
	uint64_t ring_size; /* bytes of the ring memfd (fd 0) */
	uint32_t collective_timeout_ms;
	uint32_t rsvd0;
	uint8_t rsvd[24];
};

/* SHARDD_MSG_ERROR payload: code, then msg_len bytes of UTF-8 text. */
struct shardd_error_msg {
	int32_t code;     /* negative: -SHARDD_E* or -errno */
	uint32_t msg_len; /* bytes of text following, no NUL */
};

/*
 * Who moves a group's bytes in unshard, reduce and reshard (minor 5;
 * PROTOCOL.md "Rank-executed groups"). Chosen per group at registration:
 * every rank registers the same value.
 */
enum shardd_exec {
	SHARDD_EXEC_AUTO = 0,   /* the daemon picks: ranks below --rank-exec-max, else daemon */
	SHARDD_EXEC_DAEMON = 1, /* the daemon runs the kernels (its worker pool) */
	SHARDD_EXEC_RANKS = 2,  /* each rank runs them in its own process, on the job's buffers */
	SHARDD_EXEC_COUNT       /* codes >= this are invalid */
};

/* Initial values of a group's params: who writes them. */
enum shardd_init {
	SHARDD_INIT_ZERO = 0,    /* shards start zeroed; each rank writes its own */
	SHARDD_INIT_RESTORE = 1, /* params and optimizer state from a checkpoint (minor 4): a
				    struct shardd_restore and its path follow the payload */
};

/*
 * SHARDD_INIT_RESTORE: after the optimizer config (if any), this, then
 * path_len bytes of a directory path (no NUL): a checkpoint directory (its
 * manifest.json), or a folder of step-N checkpoints (the newest complete
 * one). path_len 0: the newest checkpoint of the job in the daemon's
 * --state-dir, or zeroed shards when it has none (a first run). Every rank
 * registers the same path.
 */
#define SHARDD_RESTORE_PATH_MAX 4096 /* path_len < this */
struct shardd_restore {
	uint32_t path_len;
	uint32_t rsvd; /* zero */
};

/* One param of a group, as registered. */
struct shardd_param_spec {
	char name[SHARDD_PARAM_NAME_MAX]; /* NUL-terminated, unique */
	uint32_t dtype;                   /* enum shardd_dtype, the param's original dtype */
	uint32_t ndim;                    /* 0..SHARDD_MAX_DIMS */
	uint32_t shard_dim;               /* FSDP2 Shard(i): 0 by default, < ndim */
	uint32_t flags;                   /* zero */
	uint64_t shape[SHARDD_MAX_DIMS];  /* first ndim used, rest zero */
};

/* shardd_register_group.flags */
#define SHARDD_REGISTER_OPTIMIZER  (1u << 0) /* a struct shardd_optim_config follows the specs */
#define SHARDD_REGISTER_FLAGS_MASK (SHARDD_REGISTER_OPTIMIZER)

/*
 * A group's optimizer: torch.optim's hyperparameters except the learning
 * rate, which travels with each step. SGD reads momentum, dampening,
 * weight_decay (L2) and NESTEROV, MAXIMIZE; AdamW reads beta1, beta2, eps,
 * weight_decay (decoupled) and AMSGRAD, MAXIMIZE. Fields the optimizer
 * does not read must be zero. Every rank registers the same config.
 */
struct shardd_optim_config {
	uint32_t kind;  /* enum shardd_optim, not NONE */
	uint32_t flags; /* SHARDD_OPTIM_* */
	double momentum;
	double dampening;
	double weight_decay;
	double beta1;
	double beta2;
	double eps;
	uint64_t rsvd[2]; /* zero */
};

/*
 * SHARDD_MSG_REGISTER_GROUP payload: this, then nparams param specs, then
 * with SHARDD_REGISTER_OPTIMIZER in flags one struct shardd_optim_config.
 */
struct shardd_register_group {
	char name[SHARDD_NAME_MAX]; /* NUL-terminated group name */
	uint32_t nparams;           /* 1..SHARDD_MAX_PARAMS */
	uint32_t param_dtype;       /* MixedPrecisionPolicy.param_dtype or NONE */
	uint32_t reduce_dtype;      /* MixedPrecisionPolicy.reduce_dtype or NONE */
	uint32_t init;              /* enum shardd_init */
	uint32_t flags;             /* SHARDD_REGISTER_* */
	uint32_t exec;              /* enum shardd_exec (minor 5; older clients send 0: daemon) */
};

/* SHARDD_MSG_OPEN_GROUP payload. */
struct shardd_open_group {
	char name[SHARDD_NAME_MAX];
};

/* Buffers of a GROUP reply: unsharded, grad, flat shard, sharded grad, in this order. */
#define SHARDD_GROUP_BUFS 4

/*
 * An opaque 64-byte CUDA IPC handle: a legacy memory handle
 * (cudaIpcMemHandle_t, the driver's CUipcMemHandle, opened with
 * cuIpcOpenMemHandle) or an event handle (cudaIpcEventHandle_t /
 * CUipcEventHandle). Spelled out here so that proto/ needs no CUDA header.
 */
struct shardd_cuda_ipc_handle {
	uint8_t bytes[64];
};

/*
 * SHARDD_MSG_STREAM payload: this, then nevents handles of interprocess
 * CUDA events the client created on its device, one per SQ slot
 * (nevents == the welcome's sq_entries). The client records event i on
 * its stream before it publishes an entry in SQ slot i with
 * SHARDD_FENCE_WAIT; the daemon's stream waits on it before the op reads
 * the rank's buffers. Answered by SHARDD_MSG_STREAM_REPLY or ERROR; sent
 * at most once per connection.
 */
struct shardd_stream_req {
	uint32_t nevents;
	uint32_t rsvd; /* zero */
};

/*
 * SHARDD_MSG_STREAM_REPLY payload: this, then nevents handles of the
 * daemon's interprocess events, one per CQ slot (nevents == cq_entries).
 * A completion in CQ slot i with cqe.fence set follows a record of event i
 * on the daemon's stream after the op's work: the client's stream waits on
 * it before the client releases the slot.
 */
struct shardd_stream_reply {
	uint32_t nevents;
	uint32_t rsvd; /* zero */
};

/* Where one param lives in each buffer, for the receiving rank. */
struct shardd_param_layout {
	uint64_t unsharded_offset; /* bytes into the unsharded buffer */
	uint64_t unsharded_bytes;  /* numel * sizeof(param dtype used) */
	uint64_t grad_offset;      /* bytes into this rank's grad buffer */
	uint64_t grad_bytes;       /* numel * sizeof(grad dtype) */
	uint64_t shard_offset;     /* bytes into this rank's flat shard and sharded grad */
	uint64_t shard_bytes;      /* shard numel * sizeof(orig dtype), padding included */
	uint64_t shard_row_begin;  /* first row (along shard_dim) of the shard */
	uint64_t shard_rows_valid; /* rows of real data; the rest is padding */
};

/*
 * SHARDD_MSG_GROUP payload: this, then nparams param layouts, then the
 * nparams param specs as registered (so a rank that opens a group by name
 * learns names, dtypes and shapes), then one struct shardd_cuda_ipc_handle
 * per buffer of kind SHARDD_EXPORT_CUDA_IPC, in buffer order. The message
 * carries one fd per buffer of kind SHARDD_EXPORT_FD, in buffer order:
 * unsharded (read-only), grad (rw), flat shard (rw), sharded grad (rw).
 * Sizes below are the mapping sizes.
 */
struct shardd_group_reply {
	uint32_t group_id; /* nonzero, used in sqe.group */
	uint32_t nparams;
	uint32_t param_dtype;    /* dtype of the unsharded buffer, per param if NONE */
	uint32_t reduce_dtype;   /* as registered */
	uint32_t grad_dtype;     /* dtype of the grad buffer; NONE if params differ */
	uint32_t shard_world;    /* shard group size used for the layout */
	uint64_t unsharded_size; /* bytes */
	uint64_t grad_size;      /* bytes */
	uint64_t shard_size;     /* bytes of the flat shard, also of the sharded grad */
	uint8_t export_kind[SHARDD_GROUP_BUFS]; /* per buffer, enum shardd_export_kind */
	uint32_t optimizer;                     /* enum shardd_optim registered with the group */
	/* the last step applied or skipped on the receiving rank's shard; 0: none */
	uint64_t last_step;
	uint64_t peer_last_step; /* the highest last_step of any rank of the group (minor 4) */
	/* minor 5: SHARDD_EXEC_DAEMON or SHARDD_EXEC_RANKS, what the group runs as; with RANKS
	   the message carries a fifth fd, the group's sync page (shardd_exec.h), read-only */
	uint32_t exec;
	uint32_t rsvd; /* zero */
};

/* Bytes of struct shardd_group_reply sent to a client of minor 4 (no exec). */
#define SHARDD_GROUP_REPLY_SIZE_V4 72

/*
 * SHARDD_MSG_EXEC_MAP payload (minor 5), on a rank-executed group. `peer`
 * is the sender's own rank: it has mapped its GROUP reply's buffers, and
 * the daemon seals its flat shard and grad buffer against any new writable
 * mapping and publishes them to its peers (sync page gen[rank]); the reply
 * carries no fd. Another rank of the job: that rank's flat shard and grad
 * buffer (its slot included), read-only, once it has published them. Answered
 * by SHARDD_MSG_EXEC_MAP_REPLY or ERROR.
 */
struct shardd_exec_map {
	uint32_t group_id;
	uint32_t peer; /* global rank */
};

/* SHARDD_MSG_EXEC_MAP_REPLY payload; fds: none for the sender's own rank, else 2. */
struct shardd_exec_map_reply {
	uint32_t group_id;
	uint32_t peer;
	uint32_t gen;            /* the peer's generation: nonzero, as in the sync page when sent */
	uint32_t nfds;           /* 0 or 2: the peer's flat shard, then its grad buffer */
	uint64_t shard_map_size; /* bytes to map of each */
	uint64_t grad_map_size;
};

/* Bytes of struct shardd_group_reply sent to a client of minor < 4 (no peer_last_step). */
#define SHARDD_GROUP_REPLY_SIZE_V3 64

/* ------------------------------------------------------------------ */
/* Data plane: the ring region                                         */
/* ------------------------------------------------------------------ */

/* Submission queue entry: client -> daemon. */
/* sqe.fence: ordering with the client's stream (after SHARDD_MSG_STREAM) */
#define SHARDD_FENCE_WAIT   (1u << 0) /* the op waits on the client's event of this SQ slot */
#define SHARDD_FENCE_SIGNAL (1u << 1) /* complete when queued; signal the event of the CQ slot */
#define SHARDD_FENCE_MASK   (SHARDD_FENCE_WAIT | SHARDD_FENCE_SIGNAL)

struct shardd_sqe {
	uint8_t op;         /* enum shardd_op */
	uint8_t fence;      /* SHARDD_FENCE_*; zero: ordered by the CPU */
	uint8_t rsvd0[2];   /* zero */
	uint32_t group;     /* group id; zero for nop and barrier */
	uint64_t step;      /* step number (barrier number for barrier) */
	uint64_t user_data; /* echoed in the completion */
	uint32_t flags;     /* per-op flags, e.g. SHARDD_REDUCE_* */
	uint32_t rsvd1;     /* zero */
	uint64_t arg[4];    /* the op's arguments: SHARDD_SQE_* words (STEP, GRAD_NORM, REDUCE
	                     * with SHARDD_REDUCE_STEP); zero where the op takes none */
};

/* Completion queue entry: daemon -> client. */
struct shardd_cqe {
	uint64_t user_data; /* from the sqe */
	int32_t res;        /* 0 or negative error */
	uint8_t op;         /* from the sqe */
	uint8_t has_msg;    /* 1: error text in the message slot of this index */
	uint8_t fence;      /* 1: the daemon recorded its event of this CQ slot after the op */
	uint8_t rsvd0;
	uint32_t group; /* from the sqe */
	uint32_t rsvd1;
	uint64_t step;      /* from the sqe */
	uint64_t result[4]; /* the op's results: SHARDD_CQE_* words (GRAD_NORM, a BARRIER
	                     * mismatch); zero otherwise */
};

/* ring flags, written by the daemon */
#define SHARDD_RING_NEED_WAKEUP (1u << 0) /* daemon sleeps: ring the doorbell */
#define SHARDD_RING_DEAD        (1u << 1) /* daemon gone or detached this ring */

/*
 * Ring header, at offset 0 of the ring memfd. Each line is written by one
 * side only; the owner is in the comment.
 */
struct shardd_ring_hdr {
	/* line 0: immutable once version is published (daemon) */
	uint32_t magic;   /* SHARDD_RING_MAGIC */
	uint32_t version; /* major << 16 | minor; written last, release */
	uint32_t sq_entries;
	uint32_t cq_entries;
	uint32_t sq_off; /* bytes from the region start to SQ entries */
	uint32_t cq_off;
	uint32_t msg_off;  /* cq_entries * SHARDD_RING_MSG_SIZE bytes */
	uint32_t msg_size; /* SHARDD_RING_MSG_SIZE */
	uint64_t region_size;
	uint32_t daemon_pid;
	uint32_t client_id;
	uint8_t pad0[16];
	/* line 1 (daemon) */
	uint32_t sq_head; /* SQ entries consumed */
	uint8_t pad1[60];
	/* line 2 (client) */
	uint32_t sq_tail; /* SQ entries published */
	uint8_t pad2[60];
	/* line 3 (client) */
	uint32_t cq_head;    /* CQ entries consumed */
	uint32_t cq_waiters; /* client threads futex-waiting on cq_tail */
	uint8_t pad3[56];
	/* line 4 (daemon): cq_tail is the futex word */
	uint32_t cq_tail; /* CQ entries published */
	uint8_t pad4[60];
	/* line 5 (daemon) */
	uint32_t flags;               /* SHARDD_RING_* */
	uint32_t daemon_last_op;      /* last op the daemon took from this SQ */
	uint64_t daemon_last_step;    /* its step */
	uint64_t daemon_heartbeat_ns; /* CLOCK_MONOTONIC of the last loop turn */
	uint8_t pad5[40];
	/* line 6 (client) */
	uint32_t client_last_op; /* last op the client submitted */
	uint32_t rsvd6;
	uint64_t client_last_step;
	uint8_t pad6[48];
	/* line 7: spare */
	uint8_t pad7[64];
};

/* ------------------------------------------------------------------ */
/* Layout checks                                                       */
/* ------------------------------------------------------------------ */

_Static_assert(sizeof(struct shardd_msg_hdr) == 16, "msg_hdr");
_Static_assert(sizeof(struct shardd_hello) == 112, "hello");
_Static_assert(offsetof(struct shardd_hello, job) == 8, "hello.job");
_Static_assert(offsetof(struct shardd_hello, rank) == 72, "hello.rank");
_Static_assert(offsetof(struct shardd_hello, device) == 84, "hello.device");
_Static_assert(sizeof(struct shardd_welcome) == 64, "welcome");
_Static_assert(offsetof(struct shardd_welcome, ring_size) == 24, "welcome.ring_size");
_Static_assert(sizeof(struct shardd_error_msg) == 8, "error_msg");
_Static_assert(sizeof(struct shardd_param_spec) == 160, "param_spec");
_Static_assert(offsetof(struct shardd_param_spec, shape) == 96, "param_spec.shape");
_Static_assert(sizeof(struct shardd_register_group) == 88, "register_group");
_Static_assert(sizeof(struct shardd_open_group) == 64, "open_group");
_Static_assert(sizeof(struct shardd_param_layout) == 64, "param_layout");
_Static_assert(sizeof(struct shardd_group_reply) == 80, "group_reply");
_Static_assert(offsetof(struct shardd_group_reply, exec) == SHARDD_GROUP_REPLY_SIZE_V4,
	       "group_reply.exec");
_Static_assert(sizeof(struct shardd_exec_map) == 8, "exec_map");
_Static_assert(sizeof(struct shardd_exec_map_reply) == 32, "exec_map_reply");
_Static_assert(offsetof(struct shardd_group_reply, unsharded_size) == 24,
	       "group_reply.unsharded_size");
_Static_assert(offsetof(struct shardd_group_reply, export_kind) == 48, "group_reply.export_kind");
_Static_assert(offsetof(struct shardd_group_reply, optimizer) == 52, "group_reply.optimizer");
_Static_assert(offsetof(struct shardd_group_reply, last_step) == 56, "group_reply.last_step");
_Static_assert(offsetof(struct shardd_group_reply, peer_last_step) == SHARDD_GROUP_REPLY_SIZE_V3,
	       "group_reply.peer_last_step");
_Static_assert(sizeof(struct shardd_optim_config) == 72, "optim_config");
_Static_assert(sizeof(struct shardd_restore) == 8, "restore");
_Static_assert(sizeof(struct shardd_cuda_ipc_handle) == 64, "cuda_ipc_handle");
_Static_assert(sizeof(struct shardd_sqe) == 64, "sqe");
_Static_assert(offsetof(struct shardd_sqe, fence) == 1, "sqe.fence");
_Static_assert(offsetof(struct shardd_sqe, step) == 8, "sqe.step");
_Static_assert(offsetof(struct shardd_sqe, user_data) == 16, "sqe.user_data");
_Static_assert(offsetof(struct shardd_sqe, flags) == 24, "sqe.flags");
_Static_assert(sizeof(struct shardd_cqe) == 64, "cqe");
_Static_assert(offsetof(struct shardd_cqe, res) == 8, "cqe.res");
_Static_assert(offsetof(struct shardd_cqe, fence) == 14, "cqe.fence");
_Static_assert(sizeof(struct shardd_cuda_ipc_handle) == 64, "cuda_ipc_handle");
_Static_assert(sizeof(struct shardd_stream_req) == 8, "stream_req");
_Static_assert(sizeof(struct shardd_stream_reply) == 8, "stream_reply");
_Static_assert(offsetof(struct shardd_cqe, group) == 16, "cqe.group");
_Static_assert(offsetof(struct shardd_cqe, step) == 24, "cqe.step");
_Static_assert(sizeof(struct shardd_ring_hdr) == 8 * SHARDD_CACHELINE, "ring_hdr");
_Static_assert(offsetof(struct shardd_ring_hdr, sq_head) == 1 * SHARDD_CACHELINE,
	       "ring_hdr.sq_head");
_Static_assert(offsetof(struct shardd_ring_hdr, sq_tail) == 2 * SHARDD_CACHELINE,
	       "ring_hdr.sq_tail");
_Static_assert(offsetof(struct shardd_ring_hdr, cq_head) == 3 * SHARDD_CACHELINE,
	       "ring_hdr.cq_head");
_Static_assert(offsetof(struct shardd_ring_hdr, cq_tail) == 4 * SHARDD_CACHELINE,
	       "ring_hdr.cq_tail");
_Static_assert(offsetof(struct shardd_ring_hdr, flags) == 5 * SHARDD_CACHELINE, "ring_hdr.flags");
_Static_assert(offsetof(struct shardd_ring_hdr, client_last_op) == 6 * SHARDD_CACHELINE,
	       "ring_hdr.client_last_op");

/* Bytes of one element of a dtype; 0 for NONE and unknown codes. */
static inline size_t shardd_dtype_size(uint32_t dtype)
{
	switch (dtype) {
	case SHARDD_DTYPE_FP32:
		return 4;
	case SHARDD_DTYPE_BF16:
		return 2;
	case SHARDD_DTYPE_FP16:
		return 2;
	default:
		return 0;
	}
}

/* Lower-case name of a dtype, or NULL for an unknown code. */
static inline const char *shardd_dtype_name(uint32_t dtype)
{
	switch (dtype) {
	case SHARDD_DTYPE_NONE:
		return "none";
	case SHARDD_DTYPE_FP32:
		return "fp32";
	case SHARDD_DTYPE_BF16:
		return "bf16";
	case SHARDD_DTYPE_FP16:
		return "fp16";
	default:
		return NULL;
	}
}

/* Lower-case name of an executor, or NULL for an unknown code. */
static inline const char *shardd_exec_name(uint32_t exec)
{
	switch (exec) {
	case SHARDD_EXEC_AUTO:
		return "auto";
	case SHARDD_EXEC_DAEMON:
		return "daemon";
	case SHARDD_EXEC_RANKS:
		return "ranks";
	default:
		return NULL;
	}
}

/* Lower-case name of an op, or NULL for an unknown code. */
static inline const char *shardd_op_name(uint32_t op)
{
	switch (op) {
	case SHARDD_OP_NOP:
		return "nop";
	case SHARDD_OP_BARRIER:
		return "barrier";
	case SHARDD_OP_UNSHARD:
		return "unshard";
	case SHARDD_OP_REDUCE:
		return "reduce";
	case SHARDD_OP_RESHARD:
		return "reshard";
	case SHARDD_OP_ZERO_GRAD:
		return "zero_grad";
	case SHARDD_OP_STEP:
		return "step";
	case SHARDD_OP_GRAD_NORM:
		return "grad_norm";
	case SHARDD_OP_CHECKPOINT:
		return "checkpoint";
	default:
		return NULL;
	}
}

#endif /* SHARDD_PROTO_H */
