/* SPDX-License-Identifier: MIT */
/*
 * The handshake: a HELLO is validated field by field, its job and rank are
 * claimed, the ring (a sealed memfd), the doorbell eventfd and the pidfd
 * are created, and the WELCOME carries the ring and the doorbell to the
 * client. Also the one other setup message, SHARDD_MSG_STREAM, which
 * exchanges the stream fences of a CUDA rank's ring slots.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "backend.h"
#include "engine.h"
#include "job.h"
#include "log.h"
#include "loop.h"
#include "memlimit.h"
#include "session_int.h"
#include "world.h"

#define SQ_ENTRIES_MIN 8
#define SQ_ENTRIES_MAX 65536
#define CQ_PER_SQ      2 /* CQ twice the SQ: a client that reaps late rarely stalls intake */

/* ------------------------------------------------------------------ */
/* Handshake                                                           */
/* ------------------------------------------------------------------ */

/* Validate the job name of a hello: NUL-terminated, non-empty, printable ASCII, not a path. */
static int hello_job_ok(struct shd_session *s, uint32_t seq, const struct shardd_hello *h)
{
	size_t n = strnlen(h->job, sizeof(h->job));

	if (n == sizeof(h->job)) {
		shd_session_reject(s, seq, -SHARDD_E_INVALID,
				   "hello.job is not NUL-terminated within %d bytes",
				   SHARDD_NAME_MAX);
		return 0;
	}
	if (n == 0) {
		shd_session_reject(s, seq, -SHARDD_E_INVALID, "hello.job is empty: name the job");
		return 0;
	}
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)h->job[i];

		if (c < 0x20 || c > 0x7e) {
			shd_session_reject(
				s, seq, -SHARDD_E_INVALID,
				"hello.job byte %zu = 0x%02x: job names are printable ASCII", i, c);
			return 0;
		}
	}
	/* The name is a directory under --state-dir (checkpoints, --keep retention). */
	if (memchr(h->job, '/', n) || strcmp(h->job, ".") == 0 || strcmp(h->job, "..") == 0) {
		shd_session_reject(
			s, seq, -SHARDD_E_INVALID,
			"hello.job = '%s': a job name is one directory name under --state-dir, "
			"not '.', '..' or one with '/'",
			h->job);
		return 0;
	}
	return 1;
}

/* Validate every field of a hello that does not depend on existing jobs. */
static int hello_fields_ok(struct shd_session *s, uint32_t seq, const struct shardd_hello *h)
{
	uint64_t world = (uint64_t)h->replicate * h->shard;

	if (!hello_job_ok(s, seq, h))
		return 0;
	if (h->pid != (uint32_t)s->cred.pid) {
		shd_session_reject(s, seq, -SHARDD_E_INVALID,
				   "hello.pid = %u but the socket's peer is pid %d", h->pid,
				   (int)s->cred.pid);
		return 0;
	}
	if (h->replicate == 0 || h->shard == 0) {
		shd_session_reject(s, seq, -SHARDD_E_INVALID, "hello.%s = 0: must be at least 1",
				   h->replicate == 0 ? "replicate" : "shard");
		return 0;
	}
	if (world > SHARDD_MAX_WORLD) {
		shd_session_reject(s, seq, -SHARDD_E_INVALID,
				   "hello mesh %ux%u = %llu ranks exceeds the limit of %d",
				   h->replicate, h->shard, (unsigned long long)world,
				   SHARDD_MAX_WORLD);
		return 0;
	}
	if (h->rank >= world) {
		shd_session_reject(s, seq, -SHARDD_E_INVALID,
				   "hello.rank = %u: mesh %ux%u has ranks 0..%llu", h->rank,
				   h->replicate, h->shard, (unsigned long long)world - 1);
		return 0;
	}
	if (h->sq_entries != 0 &&
	    (!shardd_is_pow2(h->sq_entries) || h->sq_entries < SQ_ENTRIES_MIN ||
	     h->sq_entries > SQ_ENTRIES_MAX)) {
		shd_session_reject(
			s, seq, -SHARDD_E_INVALID,
			"hello.sq_entries = %u: must be 0 (default %d) or a power of two in "
			"[%d, %d]",
			h->sq_entries, SHARDD_RING_ENTRIES_DEFAULT, SQ_ENTRIES_MIN, SQ_ENTRIES_MAX);
		return 0;
	}
	if (h->device < SHARDD_HELLO_DEVICE_HOST) {
		shd_session_reject(s, seq, -SHARDD_E_INVALID,
				   "hello.device = %d: must be %d (host) or a CUDA device ordinal",
				   h->device, SHARDD_HELLO_DEVICE_HOST);
		return 0;
	}
	if (h->flags) {
		shd_session_reject(s, seq, -SHARDD_E_INVALID,
				   "hello.flags = 0x%x: reserved, must be 0", h->flags);
		return 0;
	}
	for (size_t i = 0; i < sizeof(h->rsvd); i++) {
		if (h->rsvd[i]) {
			shd_session_reject(s, seq, -SHARDD_E_INVALID,
					   "hello.rsvd[%zu] = 0x%x: reserved, must be 0", i,
					   h->rsvd[i]);
			return 0;
		}
	}
	return 1;
}

uint64_t shd_session_rings_limit(uint64_t max_memory)
{
	return !max_memory                              ? 0
	       : max_memory / 8 > SHD_SESSION_RINGS_MIN ? max_memory / 8
							: SHD_SESSION_RINGS_MIN;
}

/*
 * Room for one more ring of `size` bytes among the rings of all clients
 * (the daemon maps and writes every one: a client choosing the largest on
 * connection after connection would make it hold 44 MiB per socket). 1, or
 * 0 after refusing the hello.
 */
static int hello_ring_fits(struct shd_session *s, uint32_t seq, uint32_t sq_entries, uint64_t size)
{
	uint64_t limit = shd_session_env.rings_limit;
	char need[32], held[32], lim[32];

	if (!limit || (size <= limit && shd_session_rings_bytes <= limit - size))
		return 1;
	shd_session_reject(
		s, seq, -SHARDD_E_NOMEM,
		"hello.sq_entries = %u: its ring needs %s (%llu bytes), but the rings of all "
		"connected clients hold %s of their limit of %s (--max-memory / 8, at least "
		"256 MiB); ask for fewer entries (0: the default %d), or raise --max-memory",
		sq_entries, shd_memlimit_str(size, need, sizeof(need)), (unsigned long long)size,
		shd_memlimit_str(shd_session_rings_bytes, held, sizeof(held)),
		shd_memlimit_str(limit, lim, sizeof(lim)), SHARDD_RING_ENTRIES_DEFAULT);
	return 0;
}

/*
 * The ring region: a sealed memfd (the client can neither shrink nor grow
 * it under our mapping), formatted and mapped. Returns the memfd or -errno.
 */
static int session_ring_create(struct shd_session *s, uint32_t sq_entries, uint32_t cq_entries)
{
	uint64_t size = shardd_ring_region_size(sq_entries, cq_entries);
	int fd, ret;

	fd = memfd_create("shardd-ring", MFD_ALLOW_SEALING | MFD_CLOEXEC);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)size) < 0 ||
	    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		ret = -errno;
		goto err_close;
	}
	s->ring_mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (s->ring_mem == MAP_FAILED) {
		s->ring_mem = NULL;
		ret = -errno;
		goto err_close;
	}
	s->ring_size = size;
	shd_session_rings_bytes += size;
	ret = shardd_ring_format(s->ring_mem, size, sq_entries, cq_entries,
				 (uint32_t)shd_session_env.pid, s->id);
	if (ret == 0)
		ret = shardd_ring_attach(&s->ring, s->ring_mem, size);
	if (ret < 0)
		goto err_close;
	return fd;

err_close:
	close(fd);
	return ret;
}

/* pidfd_open(2) of `pid`: the fd, or -errno (-ENOSYS where the kernel or libc lacks it). */
static int pidfd_open_pid(pid_t pid)
{
#ifdef SYS_pidfd_open
	long fd = syscall(SYS_pidfd_open, pid, 0);

	return fd < 0 ? -errno : (int)fd;
#else
	(void)pid;
	return -ENOSYS;
#endif
}

static void session_pidfd_readable(void *arg, int fd, uint32_t revents)
{
	(void)fd;
	(void)revents;
	shd_session_close(arg, "died (process exited)");
}

static void session_doorbell(void *arg, int fd, uint32_t revents)
{
	uint64_t count;

	(void)arg;
	(void)revents;
	/* Reset the eventfd; the ring itself is served before the loop sleeps again. */
	if (read(fd, &count, sizeof(count)) == sizeof(count))
		shd_session_env.note_work(shd_now_ns());
}

/* ------------------------------------------------------------------ */
/* The daemon world: global ranks and this node's                      */
/* ------------------------------------------------------------------ */

/*
 * Under --world mpi a hello names its rank and mesh over the whole world:
 * with L = replicate * shard / nodes ranks per node, ranks n*L .. n*L+L-1
 * belong to node n (docs/MULTINODE.md). A rank of this node becomes rank
 * (rank - n*L) of the job's node-local mesh 1 x L; the job's engine learns
 * the whole mesh (shd_engine_job_span). Returns 1 with *h rewritten to the
 * node-local mesh, 0 after a refusal, and sets *span when the job spans.
 */
static int hello_world(struct shd_session *s, uint32_t seq, struct shardd_hello *h, int *span)
{
	uint32_t nodes = shd_world_nodes(), node = shd_world_node();
	uint64_t world = (uint64_t)h->replicate * h->shard;
	uint32_t L, owner;
	char dead[320];

	*span = 0;
	if (nodes <= 1)
		return 1;
	/* Every mesh of a world spans its nodes: none can run once the world is dead. */
	if (shd_world_dead(dead, sizeof(dead))) {
		shd_session_reject(s, seq, -SHARDD_E_PEER_DIED,
				   "mesh %ux%u spans the %u nodes of this world, and %s",
				   h->replicate, h->shard, nodes, dead);
		return 0;
	}
	if (world % nodes) {
		shd_session_reject(
			s, seq, -SHARDD_E_MESH,
			"mesh %ux%u (%llu ranks) does not split over the %u nodes of this world: "
			"each node must hold the same number of ranks (replicate x shard a "
			"multiple of %u)",
			h->replicate, h->shard, (unsigned long long)world, nodes, nodes);
		return 0;
	}
	L = (uint32_t)(world / nodes);
	owner = h->rank / L;
	if (owner != node) {
		shd_session_reject(
			s, seq, -SHARDD_E_INVALID,
			"hello.rank = %u belongs to node %u (ranks %u..%u of mesh %ux%u over %u "
			"nodes, %u per node); this daemon is node %u: attach to node %u's daemon",
			h->rank, owner, owner * L, owner * L + L - 1, h->replicate, h->shard, nodes,
			L, node, owner);
		return 0;
	}
	if ((h->replicate != nodes || h->shard != L) && (h->replicate != 1 || h->shard != world)) {
		shd_session_reject(
			s, seq, -SHARDD_E_MESH,
			"mesh %ux%u spans %u nodes in a layout shardd does not run: across nodes "
			"it runs HSDP with replicate = nodes and shard = ranks per node (mesh "
			"%ux%u here), or FSDP with one shard group over every rank (mesh 1x%llu)",
			h->replicate, h->shard, nodes, nodes, L, (unsigned long long)world);
		return 0;
	}
	/* Both layouts run on both backends: host over the world, cuda with NCCL over the nodes. */
	if (shd_session_env.backend != SHARDD_BACKEND_HOST &&
	    shd_session_env.backend != SHARDD_BACKEND_CUDA) {
		shd_session_reject(
			s, seq, -SHARDD_E_MESH,
			"mesh %ux%u spans %u nodes: jobs across nodes run on --backend host or cuda",
			h->replicate, h->shard, nodes);
		return 0;
	}
	h->rank -= node * L;
	h->replicate = 1;
	h->shard = L;
	*span = 1;
	return 1;
}

void shd_session_hello(struct shd_session *s, const struct shardd_msg_hdr *hdr,
		       const uint8_t *payload, uint32_t len)
{
	struct shardd_hello h;
	struct shardd_welcome w;
	struct shd_job *job;
	uint32_t sq_entries, mesh_replicate, mesh_shard;
	int created = 0, ringfd = -1, span, ret;
	char name[160], why[256];
	int fds[2];

	/* The version comes first: a newer client may send a longer hello. */
	if (len >= 4) {
		uint16_t major, minor;

		memcpy(&major, payload, sizeof(major));
		memcpy(&minor, payload + 2, sizeof(minor));
		if (major != SHARDD_PROTO_MAJOR) {
			shd_session_reject(s, hdr->seq, -SHARDD_E_VERSION,
					   "client speaks protocol %u.%u, shardd speaks %d.%d",
					   major, minor, SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR);
			return;
		}
	}
	if (len != sizeof(h)) {
		shd_session_reject(s, hdr->seq, -SHARDD_E_MALFORMED,
				   "hello is %u bytes, expected %zu", len, sizeof(h));
		return;
	}
	memcpy(&h, payload, sizeof(h));
	if (!hello_fields_ok(s, hdr->seq, &h))
		return;
	mesh_replicate = h.replicate;
	mesh_shard = h.shard;
	if (!hello_world(s, hdr->seq, &h, &span))
		return;

	/* The job decides who owns a rank. */
	ret = shd_job_claim(h.job, h.replicate, h.shard, h.rank, &job, why, sizeof(why));
	if (ret < 0) {
		shd_session_reject(s, hdr->seq, ret, "%s", why);
		return;
	}
	/* Across nodes the node-local meshes of 2x2 and 1x4 are both 1x2: the whole meshes must match. */
	if (job && span &&
	    (job->span_replicate != mesh_replicate || job->span_shard != mesh_shard)) {
		shd_session_reject(s, hdr->seq, -SHARDD_E_MESH,
				   "job '%s' has mesh %ux%u over %u nodes, hello asked for %ux%u",
				   job->name, job->span_replicate, job->span_shard, job->span_nodes,
				   mesh_replicate, mesh_shard);
		return;
	}

	ret = pidfd_open_pid(s->cred.pid);
	if (ret < 0 && ret != -ENOSYS) {
		shd_session_reject(s, hdr->seq, ret, "pidfd_open(%d): %s", (int)s->cred.pid,
				   strerror(-ret));
		return;
	}
	s->pidfd = ret < 0 ? -1 : ret;
	sq_entries = h.sq_entries ? h.sq_entries : SHARDD_RING_ENTRIES_DEFAULT;
	if (!hello_ring_fits(s, hdr->seq, sq_entries,
			     shardd_ring_region_size(sq_entries, sq_entries * CQ_PER_SQ)))
		return;
	ringfd = session_ring_create(s, sq_entries, sq_entries * CQ_PER_SQ);
	if (ringfd < 0) {
		char lim[96] = "";

		if (ringfd == -EMFILE || ringfd == -ENFILE)
			shd_fd_limit_describe(lim, sizeof(lim));
		shd_session_reject(s, hdr->seq, -SHARDD_E_NOMEM,
				   "cannot create the ring (%u entries): %s%s%s%s", sq_entries,
				   strerror(-ringfd), lim[0] ? " (shardd is at its fd limit: " : "",
				   lim, lim[0] ? "; raise it with ulimit -n or LimitNOFILE=)" : "");
		return;
	}
	/* Every taken entry holds a CQ slot, so at most cq_entries are timed at once. */
	if (shd_op_clock_init(&s->clock, sq_entries * CQ_PER_SQ) < 0) {
		shd_session_reject(s, hdr->seq, -SHARDD_E_NOMEM,
				   "out of memory for the op clock of "
				   "%u entries",
				   sq_entries * CQ_PER_SQ);
		goto out;
	}
	s->doorbell_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (s->doorbell_fd < 0) {
		ret = -errno;
		shd_session_reject(s, hdr->seq, ret, "cannot create the doorbell eventfd: %s",
				   strerror(-ret));
		goto out;
	}
	if (!job) {
		ret = shd_job_create(h.job, h.replicate, h.shard, &job);
		if (ret < 0) {
			shd_session_reject(s, hdr->seq, ret == -ENOMEM ? -SHARDD_E_NOMEM : ret,
					   "cannot create job '%s': %s", h.job,
					   ret == -ENOMEM ? "out of memory"
							  : "the engine refused it");
			goto out;
		}
		created = 1;
		if (span)
			shd_job_span(job, mesh_replicate, mesh_shard, shd_world_nodes(),
				     shd_world_node());
	}

	memset(&w, 0, sizeof(w));
	w.major = SHARDD_PROTO_MAJOR;
	w.minor = SHARDD_PROTO_MINOR;
	w.client_id = s->id;
	w.backend = shd_session_env.backend;
	w.sq_entries = sq_entries;
	w.cq_entries = sq_entries * CQ_PER_SQ;
	w.daemon_pid = (uint32_t)shd_session_env.pid;
	w.ring_size = s->ring_size;
	w.collective_timeout_ms = (uint32_t)(shd_session_env.collective_timeout_ns / 1000000u);
	fds[0] = ringfd;
	fds[1] = s->doorbell_fd;
	if (shd_session_send(s, SHARDD_MSG_WELCOME, hdr->seq, &w, sizeof(w), fds, 2) < 0) {
		/* The session is marked closing; the job it would have created goes. */
		if (created)
			shd_job_destroy(job);
		goto out;
	}

	s->state = SHD_SESSION_ATTACHED;
	s->job = job;
	s->rank = h.rank;
	s->device = h.device;
	s->minor = h.minor;
	s->stats.attached_ns = shd_now_ns();
	shd_job_attach(
		job, h.rank, (uint32_t)s->cred.pid, h.device,
		&(struct shd_rank_sink){ .ops = &shd_session_sink_ops, .ctx = s, .token = s->id });
	if (shd_loop_add_fd(shd_session_env.loop, s->doorbell_fd, POLLIN, session_doorbell, s,
			    &s->doorbell_ev) < 0 ||
	    (s->pidfd >= 0 && shd_loop_add_fd(shd_session_env.loop, s->pidfd, POLLIN,
					      session_pidfd_readable, s, &s->pidfd_ev) < 0)) {
		shd_session_close(s, "could not be registered with the event loop");
		goto out;
	}
	if (span)
		shd_log_info(
			"%s attached: rank %u of mesh %ux%u over %u nodes (node-local rank %u of "
			"1x%u), ring %u/%u entries",
			shd_session_name(s, name, sizeof(name)),
			shd_world_node() * h.shard + h.rank, mesh_replicate, mesh_shard,
			shd_world_nodes(), h.rank, h.shard, sq_entries, sq_entries * CQ_PER_SQ);
	else
		shd_log_info("%s attached: mesh %ux%u, ring %u/%u entries, device %d",
			     shd_session_name(s, name, sizeof(name)), h.replicate, h.shard,
			     sq_entries, sq_entries * CQ_PER_SQ, h.device);
	/* The client may have submitted already; serve its ring before sleeping. */
	shd_session_env.note_work(shd_now_ns());
out:
	/* The client holds its own copy of the ring fd now; our mapping stays. */
	close(ringfd);
}

/* ------------------------------------------------------------------ */
/* Stream fences                                                       */
/* ------------------------------------------------------------------ */

/*
 * SHARDD_MSG_STREAM: import the client's per-SQ-slot events and answer
 * with ours, one per CQ slot (shardd_proto.h). Once per connection.
 */
void shd_session_stream(struct shd_session *s, uint32_t seq, const uint8_t *payload, uint32_t len)
{
	struct shd_backend_ctx *b = shd_engine_backend(shd_session_env.engine);
	uint32_t nsq = s->ring.sq_mask + 1, ncq = s->ring.cq_mask + 1;
	size_t hsz = sizeof(struct shardd_cuda_ipc_handle);
	struct shardd_stream_reply *rep;
	struct shardd_stream_req req;
	char err[512];
	size_t rlen;

	if (!b->ops->fences_open) {
		shd_session_reply_error(
			s, seq, -ENOTSUP,
			"stream fences need --backend cuda; this shardd runs --backend %s, "
			"whose completions already mean the results are in memory",
			b->ops->name);
		return;
	}
	if (s->fences) {
		shd_session_reply_error(
			s, seq, -SHARDD_E_STATE,
			"this connection set up its stream fences already; STREAM is sent once");
		return;
	}
	if (s->device < 0) {
		shd_session_reply_error(
			s, seq, -SHARDD_E_INVALID,
			"stream fences: this rank attached with hello.device = %d; attach "
			"with the CUDA device its stream runs on",
			s->device);
		return;
	}
	if (len < sizeof(req)) {
		shd_session_reply_error(
			s, seq, -SHARDD_E_MALFORMED,
			"STREAM payload of %u bytes is shorter than its %zu-byte header", len,
			sizeof(req));
		return;
	}
	memcpy(&req, payload, sizeof(req));
	if (req.rsvd) {
		shd_session_reply_error(s, seq, -SHARDD_E_INVALID,
					"stream.rsvd = 0x%x: reserved, must be 0", req.rsvd);
		return;
	}
	if (req.nevents != nsq) {
		shd_session_reply_error(s, seq, -SHARDD_E_INVALID,
					"stream.nevents = %u: must be %u, one event per SQ slot",
					req.nevents, nsq);
		return;
	}
	if (len != sizeof(req) + (uint64_t)nsq * hsz) {
		shd_session_reply_error(
			s, seq, -SHARDD_E_MALFORMED,
			"STREAM payload of %u bytes: a header and %u event handles take %zu", len,
			nsq, sizeof(req) + nsq * hsz);
		return;
	}
	rlen = sizeof(*rep) + ncq * hsz;
	rep = calloc(1, rlen);
	if (!rep) {
		shd_session_reply_error(s, seq, -SHARDD_E_NOMEM,
					"stream fences: out of memory for %u event handles", ncq);
		return;
	}
	err[0] = '\0';
	if (b->ops->fences_open(b, s->device, nsq,
				(const struct shardd_cuda_ipc_handle *)(payload + sizeof(req)), ncq,
				(struct shardd_cuda_ipc_handle *)(rep + 1), &s->fences, err,
				sizeof(err)) < 0) {
		shd_session_reply_error(s, seq, -SHARDD_E_BACKEND, "stream fences on device %d: %s",
					s->device, err[0] ? err : "the backend failed");
		free(rep);
		return;
	}
	rep->nevents = ncq;
	shd_session_send(s, SHARDD_MSG_STREAM_REPLY, seq, rep, (uint32_t)rlen, NULL, 0);
	free(rep);
}
