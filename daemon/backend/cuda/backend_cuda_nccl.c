/* SPDX-License-Identifier: MIT */
/*
 * NCCL for the cuda backend (backend_cuda_nccl.h).
 *
 * libnccl.so.2 is opened with dlopen at the first collective across
 * devices, never linked: shardd starts and runs the host backend, and the
 * cuda backend on one device, where NCCL is absent. nccl.h is read for its
 * types and prototypes only; every call goes through the pointers below.
 *
 * Polling: a non-blocking communicator answers ncclInProgress while NCCL
 * works in the background (its own threads); until every communicator
 * of the call leaves that state no other NCCL call may be made and no
 * work queued on the streams NCCL uses. The waits here poll
 * ncclCommGetAsyncError every NCCL_POLL_NS up to the deadline.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <errno.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend_cuda_nccl.h"
#include "clock.h"
#include "log.h"
#include "shardd_cuda.h"
#include "shardd_proto.h"
#include "world_boot.h"

/* Non-blocking communicators and ncclCommFinalize came with NCCL 2.14. */
#define NCCL_MIN_VERSION 21400
/* Between two polls of a communicator's state: short next to a collective's set-up, long next to a syscall. */
#define NCCL_POLL_NS 20000

struct nccl_api {
	__typeof__(ncclGetVersion) *get_version;
	__typeof__(ncclGetErrorString) *get_error_string;
	__typeof__(ncclGetLastError) *get_last_error;
	__typeof__(ncclGetUniqueId) *get_unique_id;
	__typeof__(ncclCommInitRankConfig) *comm_init_rank_config;
	__typeof__(ncclCommGetAsyncError) *comm_get_async_error;
	__typeof__(ncclCommFinalize) *comm_finalize;
	__typeof__(ncclCommDestroy) *comm_destroy;
	__typeof__(ncclCommAbort) *comm_abort;
	__typeof__(ncclGroupStart) *group_start;
	__typeof__(ncclGroupEnd) *group_end;
	__typeof__(ncclAllGather) *all_gather;
	__typeof__(ncclReduceScatter) *reduce_scatter;
	__typeof__(ncclAllReduce) *all_reduce;
};

static struct nccl_api api;

#define API(field, sym) SHARDD_CUDA_SYMBOL(struct nccl_api, field, sym)
static const struct shardd_cuda_symbol api_symbols[] = {
	API(get_version, "ncclGetVersion"),
	API(get_error_string, "ncclGetErrorString"),
	API(get_last_error, "ncclGetLastError"),
	API(get_unique_id, "ncclGetUniqueId"),
	API(comm_init_rank_config, "ncclCommInitRankConfig"),
	API(comm_get_async_error, "ncclCommGetAsyncError"),
	API(comm_finalize, "ncclCommFinalize"),
	API(comm_destroy, "ncclCommDestroy"),
	API(comm_abort, "ncclCommAbort"),
	API(group_start, "ncclGroupStart"),
	API(group_end, "ncclGroupEnd"),
	API(all_gather, "ncclAllGather"),
	API(reduce_scatter, "ncclReduceScatter"),
	API(all_reduce, "ncclAllReduce"),
};
#undef API
_Static_assert(sizeof(api_symbols) / sizeof(api_symbols[0]) * sizeof(void *) ==
		       sizeof(struct nccl_api),
	       "every entry point of struct nccl_api has its name");

_Static_assert(sizeof(ncclUniqueId) == SHD_WORLD_ID_BYTES,
	       "world_boot.c moves ncclUniqueIds as SHD_WORLD_ID_BYTES");

static pthread_once_t api_once = PTHREAD_ONCE_INIT;
static int api_status;      /* 0 once every entry point resolved and the version is new enough */
static char api_error[320]; /* why not, when api_status < 0 */

struct shd_nccl_clique {
	struct shd_nccl_clique *next;
	const void *job;
	char job_name[SHARDD_NAME_MAX];
	uint32_t n;
	int32_t *devices;  /* [n]: member k's device (NCCL rank k, but across nodes ranks[k]) */
	ncclComm_t *comms; /* [n]: NULL where not made */
	/* Across nodes (shd_nccl_span_make): members of one communicator of nranks, made from node 0's id. */
	int span;
	uint64_t key;    /* the group's stream (world_boot.h) */
	uint32_t index;  /* which of the group's communicators */
	uint32_t nranks; /* its size over every node */
	int32_t *ranks;  /* [n]: member k's NCCL rank */
};

struct shd_nccl {
	uint64_t timeout_ns;
	struct shd_nccl_clique *cliques;
};

/* ------------------------------------------------------------------ */
/* The library                                                         */
/* ------------------------------------------------------------------ */

/* A shardd_cuda_lookup_fn: dlsym in the library `ctx`. */
static int api_lookup(void *ctx, const char *name, void **fn, char *err, size_t errlen)
{
	*fn = dlsym(ctx, name);
	if (*fn)
		return 0;
	snprintf(err, errlen, "libnccl.so.2 has no %s; install NCCL 2.14 or later", name);
	return -SHARDD_E_BACKEND;
}

static void api_load(void)
{
	void *lib;
	int version = 0;

	api_status = -SHARDD_E_BACKEND;
	lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		snprintf(
			api_error, sizeof(api_error),
			"NCCL is not installed (dlopen libnccl.so.2: %s); install NCCL 2.14 or later "
			"where the loader finds it, or put every rank of a group on one GPU",
			dlerror());
		return;
	}
	if (shardd_cuda_resolve(&api, api_symbols, sizeof(api_symbols) / sizeof(api_symbols[0]),
				api_lookup, lib, api_error, sizeof(api_error)))
		return;
	if (api.get_version(&version) != ncclSuccess || version < NCCL_MIN_VERSION) {
		snprintf(
			api_error, sizeof(api_error),
			"libnccl.so.2 is version code %d; non-blocking communicators need NCCL 2.14 "
			"(version code %d) or later",
			version, NCCL_MIN_VERSION);
		return;
	}
	shd_log_info("cuda backend: NCCL %d.%d.%d loaded for collectives across GPUs",
		     version / 10000, version / 100 % 100, version % 100);
	/* The library stays loaded for the life of the process: communicators live in it. */
	api_status = 0;
}

int shd_nccl_load(char *err, size_t errlen)
{
	pthread_once(&api_once, api_load);
	if (api_status)
		snprintf(err, errlen, "%s", api_error);
	return api_status;
}

/* ------------------------------------------------------------------ */
/* Messages and polling                                                */
/* ------------------------------------------------------------------ */

void shd_nccl_devices_str(const int32_t *devices, uint32_t n, char *buf, size_t len)
{
	size_t off = (size_t)snprintf(buf, len, "devices");

	for (uint32_t k = 0; k < n && off < len; k++)
		off += (size_t)snprintf(buf + off, len - off, "%s%d", k ? "," : " ", devices[k]);
}

/* err = "NCCL <what> on devices ... of job 'j': <cause>" */
static void nccl_error(const struct shd_nccl_clique *c, const char *what, ncclResult_t r, char *err,
		       size_t errlen)
{
	char devs[192];
	const char *last = api.get_last_error(NULL);

	shd_nccl_devices_str(c->devices, c->n, devs, sizeof(devs));
	if (c->span) {
		size_t off = strlen(devs);

		snprintf(devs + off, sizeof(devs) - off, " (NCCL rank%s", c->n > 1 ? "s" : "");
		for (uint32_t k = 0; k < c->n && (off = strlen(devs)) < sizeof(devs); k++)
			snprintf(devs + off, sizeof(devs) - off, "%s%d", k ? "," : " ",
				 c->ranks[k]);
		off = strlen(devs);
		snprintf(devs + off, sizeof(devs) - off, " of %u across nodes)", c->nranks);
	}
	snprintf(err, errlen, "NCCL %s on %s of job '%s': %s (%d)%s%s", what, devs, c->job_name,
		 api.get_error_string(r), (int)r, last && last[0] ? ": " : "", last ? last : "");
}

static void poll_pause(void)
{
	struct timespec ts = { 0, NCCL_POLL_NS };

	nanosleep(&ts, NULL);
}

/*
 * Poll every communicator of `c` until none is ncclInProgress. ncclSuccess,
 * the first error a communicator reports, or ncclInProgress when the
 * deadline passed first.
 */
static ncclResult_t clique_wait(const struct shd_nccl_clique *c, uint64_t deadline_ns)
{
	for (;;) {
		int pending = 0;

		for (uint32_t k = 0; k < c->n; k++) {
			ncclResult_t state = ncclSuccess, r;

			if (!c->comms[k])
				continue;
			r = api.comm_get_async_error(c->comms[k], &state);
			if (r != ncclSuccess)
				return r;
			if (state == ncclInProgress)
				pending = 1;
			else if (state != ncclSuccess)
				return state;
		}
		if (!pending)
			return ncclSuccess;
		if (shd_now_ns() >= deadline_ns)
			return ncclInProgress;
		poll_pause();
	}
}

/* A group call's outcome: the first of the calls' own results, then ncclGroupEnd's. */
static ncclResult_t group_result(ncclResult_t calls, ncclResult_t end)
{
	if (calls != ncclSuccess && calls != ncclInProgress)
		return calls;
	return end;
}

/* ------------------------------------------------------------------ */
/* Cliques                                                             */
/* ------------------------------------------------------------------ */

static void clique_free(struct shd_nccl_clique *c)
{
	free(c->ranks);
	free(c->devices);
	free(c->comms);
	free(c);
}

/* A clique of job's communicators on `devices` (n), none made yet; with_ranks: room for their NCCL ranks. */
static struct shd_nccl_clique *clique_new(const void *job, const char *job_name,
					  const int32_t *devices, uint32_t n, int with_ranks,
					  char *err, size_t errlen)
{
	struct shd_nccl_clique *c = calloc(1, sizeof(*c));

	if (c) {
		c->devices = malloc(n * sizeof(*c->devices));
		c->ranks = with_ranks ? malloc(n * sizeof(*c->ranks)) : NULL;
		c->comms = calloc(n, sizeof(*c->comms));
	}
	if (!c || !c->devices || (with_ranks && !c->ranks) || !c->comms) {
		snprintf(err, errlen, "out of memory for the NCCL communicators of job '%s'",
			 job_name);
		if (c)
			clique_free(c);
		return NULL;
	}
	c->job = job;
	snprintf(c->job_name, sizeof(c->job_name), "%s", job_name);
	c->n = n;
	memcpy(c->devices, devices, n * sizeof(*devices));
	return c;
}

/* Abort every communicator made: it stops what is still running on the devices. */
static void clique_abort(struct shd_nccl_clique *c)
{
	for (uint32_t k = 0; k < c->n; k++) {
		if (c->comms[k])
			api.comm_abort(c->comms[k]);
		c->comms[k] = NULL;
	}
}

/* Unlink `c` from the cache (it must be there). */
static void clique_unlink(struct shd_nccl *nc, struct shd_nccl_clique *c)
{
	struct shd_nccl_clique **pp = &nc->cliques;

	while (*pp != c)
		pp = &(*pp)->next;
	*pp = c->next;
}

/*
 * Finalize every communicator (grouped: one thread finalizes them all,
 * which NCCL requires in one group call), wait, then destroy them, which is
 * local once finalized. Abort instead when any of that fails or the
 * deadline passes.
 */
static void clique_destroy(struct shd_nccl *nc, struct shd_nccl_clique *c)
{
	ncclResult_t calls = ncclSuccess, r;
	char devs[128];

	/*
	 * Across nodes, aborted: its collectives all finished (their op waited
	 * for them), and a finalize could wait for peers that ended the job
	 * later, or never will.
	 */
	if (c->span) {
		clique_abort(c);
		clique_free(c);
		return;
	}
	r = api.group_start();
	for (uint32_t k = 0; r == ncclSuccess && k < c->n; k++) {
		ncclResult_t one = api.comm_finalize(c->comms[k]);

		if (one != ncclSuccess && calls == ncclSuccess)
			calls = one;
	}
	if (r == ncclSuccess)
		r = group_result(calls, api.group_end());
	if (r == ncclSuccess || r == ncclInProgress)
		r = clique_wait(c, shd_now_ns() + nc->timeout_ns);
	if (r == ncclSuccess) {
		for (uint32_t k = 0; k < c->n; k++)
			api.comm_destroy(c->comms[k]);
	} else {
		shd_nccl_devices_str(c->devices, c->n, devs, sizeof(devs));
		shd_log_warn(
			"shardd: cuda backend: NCCL communicators on %s of job '%s' did not finalize (%s); "
			"aborted",
			devs, c->job_name,
			r == ncclInProgress ? "timed out" : api.get_error_string(r));
		clique_abort(c);
	}
	clique_free(c);
}

/*
 * Make the communicators of a new clique: from `span_id` across nodes,
 * else from an id made here. Waits until `deadline_ns`. 0, or an error
 * with nothing left made.
 */
static int clique_init(struct shd_nccl_clique *c, const uint8_t *span_id, uint64_t deadline_ns,
		       char *err, size_t errlen)
{
	ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
	ncclResult_t calls = ncclSuccess, r;
	ncclUniqueId id;
	cudaError_t e = cudaSuccess;

	/* Non-blocking: a set-up that never ends is aborted at the deadline instead of hanging a worker. */
	config.blocking = 0;
	if (span_id) {
		memcpy(&id, span_id, sizeof(id));
	} else {
		r = api.get_unique_id(&id);
		if (r != ncclSuccess) {
			nccl_error(c, "ncclGetUniqueId", r, err, errlen);
			return -SHARDD_E_BACKEND;
		}
	}
	r = api.group_start();
	if (r != ncclSuccess) {
		nccl_error(c, "ncclGroupStart", r, err, errlen);
		return -SHARDD_E_BACKEND;
	}
	for (uint32_t k = 0; k < c->n; k++) {
		ncclResult_t one;

		/* A communicator belongs to the device current when it is made. */
		e = cudaSetDevice(c->devices[k]);
		if (e != cudaSuccess)
			break;
		one = api.comm_init_rank_config(&c->comms[k], c->span ? (int)c->nranks : (int)c->n,
						id, c->span ? c->ranks[k] : (int)k, &config);
		if (one != ncclSuccess && one != ncclInProgress) {
			calls = one;
			break;
		}
	}
	/* A group that was started ends, whatever happened inside it. */
	r = group_result(calls, api.group_end());
	if (e != cudaSuccess) {
		snprintf(err, errlen,
			 "cudaSetDevice before making NCCL communicators of job '%s': %s",
			 c->job_name, cudaGetErrorString(e));
		clique_abort(c);
		return -SHARDD_E_BACKEND;
	}
	if (r == ncclSuccess || r == ncclInProgress)
		r = clique_wait(c, deadline_ns);
	if (r != ncclSuccess) {
		nccl_error(c,
			   r == ncclInProgress ? "communicator set-up timed out"
					       : "ncclCommInitRankConfig",
			   r, err, errlen);
		clique_abort(c);
		return -SHARDD_E_BACKEND;
	}
	return 0;
}

int shd_nccl_create(uint64_t timeout_ns, struct shd_nccl **out)
{
	struct shd_nccl *nc = calloc(1, sizeof(*nc));

	if (!nc)
		return -ENOMEM;
	nc->timeout_ns = timeout_ns;
	*out = nc;
	return 0;
}

void shd_nccl_destroy(struct shd_nccl *nc)
{
	if (!nc)
		return;
	while (nc->cliques) {
		struct shd_nccl_clique *c = nc->cliques;

		nc->cliques = c->next;
		clique_destroy(nc, c);
	}
	free(nc);
}

int shd_nccl_clique(struct shd_nccl *nc, const void *job, const char *job_name,
		    const int32_t *devices, uint32_t n, struct shd_nccl_clique **out, char *err,
		    size_t errlen)
{
	struct shd_nccl_clique *c;
	char devs[128];
	int ret;

	for (c = nc->cliques; c; c = c->next) {
		if (!c->span && c->job == job && c->n == n &&
		    !memcmp(c->devices, devices, n * sizeof(*devices))) {
			*out = c;
			return 0;
		}
	}
	ret = shd_nccl_load(err, errlen);
	if (ret)
		return ret;
	c = clique_new(job, job_name, devices, n, 0, err, errlen);
	if (!c)
		return -ENOMEM;
	ret = clique_init(c, NULL, shd_now_ns() + nc->timeout_ns, err, errlen);
	if (ret) {
		clique_free(c);
		return ret;
	}
	shd_nccl_devices_str(devices, n, devs, sizeof(devs));
	shd_log_info("cuda backend: NCCL communicators of job '%s' on %s ready", job_name, devs);
	c->next = nc->cliques;
	nc->cliques = c;
	*out = c;
	return 0;
}

static ncclDataType_t nccl_dtype(uint32_t dtype)
{
	switch (dtype) {
	case SHARDD_DTYPE_FP32:
		return ncclFloat32;
	case SHARDD_DTYPE_BF16:
		return ncclBfloat16;
	case SHARDD_DTYPE_FP16:
		return ncclFloat16;
	default:
		return ncclUint8;
	}
}

static const char *coll_name(uint32_t coll)
{
	return coll == SHD_NCCL_ALL_GATHER       ? "ncclAllGather"
	       : coll == SHD_NCCL_REDUCE_SCATTER ? "ncclReduceScatter"
						 : "ncclAllReduce";
}

/* Queue one collective on every member of `c`, waiting until `deadline_ns` for NCCL to have queued it. */
static int clique_collective(struct shd_nccl_clique *c, uint32_t coll, void *const *send,
			     void *const *recv, size_t count, uint32_t dtype, void *const *streams,
			     uint64_t deadline_ns, char *err, size_t errlen)
{
	ncclDataType_t dt = nccl_dtype(dtype);
	ncclResult_t calls = ncclSuccess, r;
	char what[96];

	/* One group call queues every member's part from this one thread. */
	r = api.group_start();
	if (r != ncclSuccess) {
		nccl_error(c, "ncclGroupStart", r, err, errlen);
		return -SHARDD_E_BACKEND;
	}
	for (uint32_t k = 0; k < c->n && (calls == ncclSuccess || calls == ncclInProgress); k++) {
		cudaStream_t s = (cudaStream_t)streams[k];

		if (coll == SHD_NCCL_ALL_GATHER)
			calls = api.all_gather(send[k], recv[k], count, dt, c->comms[k], s);
		else if (coll == SHD_NCCL_REDUCE_SCATTER)
			calls = api.reduce_scatter(send[k], recv[k], count, dt, ncclSum,
						   c->comms[k], s);
		else
			calls = api.all_reduce(send[k], recv[k], count, dt, ncclSum, c->comms[k],
					       s);
	}
	r = group_result(calls, api.group_end());
	if (r == ncclSuccess || r == ncclInProgress)
		r = clique_wait(c, deadline_ns);
	if (r == ncclSuccess)
		return 0;
	snprintf(what, sizeof(what), "%s%s", coll_name(coll),
		 r == ncclInProgress ? " was not queued within the collective timeout" : "");
	nccl_error(c, what, r, err, errlen);
	return -SHARDD_E_BACKEND;
}

int shd_nccl_collective(struct shd_nccl *nc, struct shd_nccl_clique *c, uint32_t coll,
			void *const *send, void *const *recv, size_t count, uint32_t dtype,
			void *const *streams, char *err, size_t errlen)
{
	int ret = clique_collective(c, coll, send, recv, count, dtype, streams,
				    shd_now_ns() + nc->timeout_ns, err, errlen);

	if (ret)
		shd_nccl_drop(nc, c);
	return ret;
}

int shd_nccl_span_collective(struct shd_nccl_clique *c, uint32_t coll, void *const *send,
			     void *const *recv, size_t count, uint32_t dtype, void *const *streams,
			     uint64_t deadline_ns, char *err, size_t errlen)
{
	return clique_collective(c, coll, send, recv, count, dtype, streams, deadline_ns, err,
				 errlen);
}

uint32_t shd_nccl_check_device(struct shd_nccl *nc, int32_t device, int abort_all, char *err,
			       size_t errlen)
{
	struct shd_nccl_clique **pp = &nc->cliques;
	uint32_t aborted = 0;
	size_t off = 0;

	err[0] = '\0';
	while (*pp) {
		struct shd_nccl_clique *c = *pp;
		ncclResult_t bad = ncclSuccess;
		int member = 0;

		/* A span clique is its op's to watch (backend_cuda_world.c): its collectives are done when the op returns. */
		for (uint32_t k = 0; k < c->n && !c->span; k++)
			member |= c->devices[k] == device;
		for (uint32_t k = 0; member && k < c->n && bad == ncclSuccess; k++) {
			ncclResult_t state = ncclSuccess,
				     r = api.comm_get_async_error(c->comms[k], &state);

			bad = r != ncclSuccess ? r : state == ncclInProgress ? ncclSuccess : state;
		}
		if (!member || (bad == ncclSuccess && !abort_all)) {
			pp = &c->next;
			continue;
		}
		if (off < errlen) {
			char one[320];

			if (bad != ncclSuccess)
				nccl_error(c, "communicators failed", bad, one, sizeof(one));
			else
				shd_nccl_devices_str(c->devices, c->n, one, sizeof(one));
			off += (size_t)snprintf(err + off, errlen - off, "%s%s",
						aborted ? "; " : "", one);
		}
		*pp = c->next;
		clique_abort(c);
		clique_free(c);
		aborted++;
	}
	return aborted;
}

void shd_nccl_job_end(struct shd_nccl *nc, const void *job)
{
	struct shd_nccl_clique **pp = &nc->cliques;

	while (*pp) {
		struct shd_nccl_clique *c = *pp;

		if (c->job != job) {
			pp = &c->next;
			continue;
		}
		*pp = c->next;
		clique_destroy(nc, c);
	}
}

/* ------------------------------------------------------------------ */
/* Across nodes                                                        */
/* ------------------------------------------------------------------ */

int shd_nccl_unique_ids(uint8_t *ids, uint32_t n, char *err, size_t errlen)
{
	int ret = shd_nccl_load(err, errlen);

	for (uint32_t i = 0; i < n && !ret; i++) {
		ncclUniqueId id;
		ncclResult_t r = api.get_unique_id(&id);

		if (r != ncclSuccess) {
			snprintf(
				err, errlen,
				"ncclGetUniqueId: %s (%d); NCCL picks the network interface that the "
				"other nodes reach it on with NCCL_SOCKET_IFNAME",
				api.get_error_string(r), (int)r);
			return -SHARDD_E_BACKEND;
		}
		memcpy(ids + (size_t)i * sizeof(id), &id, sizeof(id));
	}
	return ret;
}

struct shd_nccl_clique *shd_nccl_span_find(struct shd_nccl *nc, const void *job, uint64_t key,
					   uint32_t index)
{
	for (struct shd_nccl_clique *c = nc->cliques; c; c = c->next)
		if (c->span && c->job == job && c->key == key && c->index == index)
			return c;
	return NULL;
}

int shd_nccl_span_make(const void *job, const char *job_name, uint64_t key, uint32_t index,
		       const int32_t *devices, uint32_t n, const uint32_t *ranks, uint32_t nranks,
		       const uint8_t *id, uint64_t deadline_ns, struct shd_nccl_clique **out,
		       char *err, size_t errlen)
{
	struct shd_nccl_clique *c;
	char devs[128];
	int ret;

	ret = shd_nccl_load(err, errlen);
	if (ret)
		return ret;
	c = clique_new(job, job_name, devices, n, 1, err, errlen);
	if (!c)
		return -ENOMEM;
	c->span = 1;
	c->key = key;
	c->index = index;
	c->nranks = nranks;
	for (uint32_t k = 0; k < n; k++)
		c->ranks[k] = (int32_t)ranks[k];
	ret = clique_init(c, id, deadline_ns, err, errlen);
	if (ret) {
		clique_free(c);
		return ret;
	}
	shd_nccl_devices_str(devices, n, devs, sizeof(devs));
	shd_log_info(
		"cuda backend: NCCL communicator %u of job '%s' across nodes ready: %s, NCCL rank%s %d%s of %u",
		index, job_name, devs, n > 1 ? "s" : "", c->ranks[0], n > 1 ? ".." : "", nranks);
	*out = c;
	return 0;
}

void shd_nccl_span_add(struct shd_nccl *nc, struct shd_nccl_clique *c)
{
	struct shd_nccl_clique *old = shd_nccl_span_find(nc, c->job, c->key, c->index);

	if (old)
		shd_nccl_drop(nc, old);
	c->next = nc->cliques;
	nc->cliques = c;
}

void shd_nccl_span_abort(struct shd_nccl_clique *c)
{
	clique_abort(c);
	clique_free(c);
}

void shd_nccl_drop(struct shd_nccl *nc, struct shd_nccl_clique *c)
{
	clique_unlink(nc, c);
	clique_abort(c);
	clique_free(c);
}

int shd_nccl_clique_failed(struct shd_nccl_clique *c, char *err, size_t errlen)
{
	for (uint32_t k = 0; k < c->n; k++) {
		ncclResult_t state = ncclSuccess, r = api.comm_get_async_error(c->comms[k], &state);
		ncclResult_t bad = r != ncclSuccess          ? r
				   : state == ncclInProgress ? ncclSuccess
							     : state;

		if (bad != ncclSuccess) {
			nccl_error(c, "communicator failed", bad, err, errlen);
			return 1;
		}
	}
	return 0;
}
