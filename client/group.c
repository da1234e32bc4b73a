/* SPDX-License-Identifier: MIT */
/*
 * Groups on the client side: registration and opening, checking the
 * daemon's layout reply against the fds and CUDA IPC handles it came with,
 * mapping the four buffers, and copying a rank's shard out of a full
 * tensor.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda_import.h"
#include "internal.h"
#include "shardd_exec.h"

_Static_assert(SHARDD_BUF_COUNT == SHARDD_GROUP_BUFS, "a group maps every buffer of a GROUP reply");

static const char *const buf_name[SHARDD_BUF_COUNT] = {
	[SHARDD_BUF_UNSHARDED] = "unsharded",
	[SHARDD_BUF_GRAD] = "grad",
	[SHARDD_BUF_SHARD] = "flat shard",
	[SHARDD_BUF_SHARD_GRAD] = "sharded grad",
};

/* --------------------------------------------------------------------- */
/* Checking and mapping a GROUP reply                                    */
/* --------------------------------------------------------------------- */

static int check_range(const struct shardd_group *g, uint32_t i, const char *field, uint64_t off,
		       uint64_t bytes, enum shardd_group_buf b)
{
	uint64_t size = g->buf[b].size;

	if (off % SHARDD_ALIGN || off > size || bytes > size - off)
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "param %u: %s_offset %llu + %llu bytes does not fit the "
				      "%llu-byte %s buffer at %d-byte alignment",
				      i, field, (unsigned long long)off, (unsigned long long)bytes,
				      (unsigned long long)size, buf_name[b], SHARDD_ALIGN);
	return 0;
}

static int check_bytes(uint32_t i, const char *name, const char *field, uint64_t got, uint64_t want)
{
	if (got != want)
		return shardd_err_set(
			-SHARDD_E_MALFORMED,
			"param %u '%s': daemon's %s is %llu, FSDP2 sharding gives %llu", i, name,
			field, (unsigned long long)got, (unsigned long long)want);
	return 0;
}

/* A registered param's layout must be what its shape and the mesh imply. */
static int check_against_spec(const struct shardd_group *g, uint32_t i)
{
	const struct shardd_param_spec *p = &g->specs[i];
	const struct shardd_param_layout *l = &g->layouts[i];
	uint32_t world = g->info.shard_world;
	uint32_t full_dtype =
		g->info.param_dtype != SHARDD_DTYPE_NONE ? g->info.param_dtype : p->dtype;
	size_t esz = shardd_dtype_size(p->dtype), full_esz = shardd_dtype_size(full_dtype);
	struct shardd_shard_geometry geo;
	int ret;

	if (!esz || !full_esz)
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "param %u '%s': daemon accepted dtype %u / param_dtype %u, "
				      "which this libshardd does not know",
				      i, p->name, p->dtype, g->info.param_dtype);
	ret = shardd_group_geometry(p, world, g->client->rank % world, &geo);
	if (ret < 0)
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "param %u '%s': daemon accepted a shape that %s", i, p->name,
				      ret == -EOVERFLOW
					      ? "overflows 64 bits"
					      : "does not split evenly along its shard dim");
	ret = check_bytes(i, p->name, "unsharded_bytes", l->unsharded_bytes, geo.numel * full_esz);
	if (!ret)
		ret = check_bytes(i, p->name, "grad_bytes", l->grad_bytes, geo.numel * full_esz);
	if (!ret)
		ret = check_bytes(i, p->name, "shard_bytes", l->shard_bytes, geo.shard_numel * esz);
	if (!ret)
		ret = check_bytes(i, p->name, "shard_row_begin", l->shard_row_begin, geo.begin);
	if (!ret)
		ret = check_bytes(i, p->name, "shard_rows_valid", l->shard_rows_valid, geo.valid);
	return ret;
}

/*
 * Cuda backend: a device allocation, imported on this rank's device from
 * its fd, or from its CUDA IPC handle when `ipc` is not NULL.
 */
static int map_cuda_buffer(struct shardd_group *g, enum shardd_group_buf b, int fd,
			   const struct shardd_cuda_ipc_handle *ipc, uint64_t size)
{
	struct shardd_cuda_mapping m;
	int ret;

	g->buf[b].size = size;
	if (!size)
		return 0;
	if (ipc)
		ret = shardd_cuda_import_ipc(ipc, g->client->device, size, &m);
	else
		ret = shardd_cuda_import(fd, g->client->device, size, &m);
	if (ret < 0)
		return shardd_err_wrap(ret, "map %s buffer", buf_name[b]);
	g->buf[b].addr = (void *)(uintptr_t)m.ptr;
	g->buf[b].cuda_size = m.size;
	g->buf[b].cuda_kind = m.kind;
	g->buf[b].cuda_device = m.device;
	return 0;
}

static int map_buffer(struct shardd_group *g, enum shardd_group_buf b, int fd, uint64_t size)
{
	/* Daemon-executed: the unsharded copy is the daemon's output. Rank-executed: this rank's. */
	int lent_ro = b == SHARDD_BUF_UNSHARDED && g->info.exec != SHARDD_EXEC_RANKS;
	int prot;
	struct stat st;
	int seals;
	void *addr;

	if (g->client->welcome.backend == SHARDD_BACKEND_CUDA)
		return map_cuda_buffer(g, b, fd, NULL, size);

	if (fstat(fd, &st) < 0)
		return shardd_err_set(-errno, "fstat %s fd: %s", buf_name[b], strerror(errno));
	if (size > (uint64_t)st.st_size || size > SIZE_MAX)
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "reply says the %s buffer has %llu bytes, its fd has %lld",
				      buf_name[b], (unsigned long long)size, (long long)st.st_size);
	g->buf[b].size = size;
	if (!size)
		return 0;
	/* Without the shrink seal the daemon could truncate it under us (SIGBUS). */
	seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0 || !(seals & F_SEAL_SHRINK))
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "%s fd is not a memfd sealed against shrinking (seals %d)",
				      buf_name[b], seals);
	/* A read-only buffer that one rank could reopen O_RDWR would let it rewrite every rank's params. */
	/*
	 * A rank-executed group's shard and grad buffer come sealed when this
	 * client opens the group a second time: this handle only reads them.
	 */
	if (g->info.exec == SHARDD_EXEC_RANKS && (b == SHARDD_BUF_GRAD || b == SHARDD_BUF_SHARD) &&
	    (seals & F_SEAL_FUTURE_WRITE))
		g->exec_second = 1;
	prot = lent_ro || ((b == SHARDD_BUF_GRAD || b == SHARDD_BUF_SHARD) && g->exec_second)
		       ? PROT_READ
		       : PROT_READ | PROT_WRITE;
	if (lent_ro && !(seals & F_SEAL_FUTURE_WRITE))
		return shardd_err_set(
			-SHARDD_E_MALFORMED,
			"%s fd is lent read-only but is not sealed against writes "
			"(F_SEAL_FUTURE_WRITE missing from seals 0x%x): upgrade shardd",
			buf_name[b], (unsigned)seals);
	addr = mmap(NULL, (size_t)size, prot, MAP_SHARED, fd, 0);
	if (addr == MAP_FAILED)
		return shardd_err_set(-errno, "mmap %s buffer of %llu bytes: %s", buf_name[b],
				      (unsigned long long)size, strerror(errno));
	g->buf[b].addr = addr;
	return 0;
}

/*
 * Take the param specs of a GROUP reply. A registering rank must get back
 * exactly what it sent; an opening rank learns names, dtypes and shapes.
 */
static int specs_from_reply(struct shardd_group *g, const uint8_t *at)
{
	uint32_t n = g->info.nparams;
	struct shardd_param_spec *specs = malloc(sizeof(*specs) * n);

	if (!specs)
		return shardd_err_set(-ENOMEM, "%u param specs: out of memory", n);
	memcpy(specs, at, sizeof(*specs) * n);
	for (uint32_t i = 0; i < n; i++) {
		const struct shardd_param_spec *p = &specs[i];

		if (strnlen(p->name, sizeof(p->name)) == sizeof(p->name) ||
		    !shardd_dtype_size(p->dtype) || p->ndim > SHARDD_MAX_DIMS ||
		    (p->ndim ? p->shard_dim >= p->ndim : p->shard_dim != 0)) {
			free(specs);
			return shardd_err_set(
				-SHARDD_E_MALFORMED,
				"GROUP reply: param %u spec is invalid (dtype %u, ndim %u, "
				"shard_dim %u)",
				i, p->dtype, p->ndim, p->shard_dim);
		}
		/* Bytes past a name's NUL are not part of the spec: another rank may differ there. */
		if (g->specs &&
		    (strcmp(p->name, g->specs[i].name) != 0 ||
		     memcmp(&p->dtype, &g->specs[i].dtype,
			    sizeof(*p) - offsetof(struct shardd_param_spec, dtype)) != 0)) {
			free(specs);
			return shardd_err_set(
				-SHARDD_E_MALFORMED,
				"GROUP reply: param %u ('%s') differs from the registered spec", i,
				p->name);
		}
	}
	free(g->specs);
	g->specs = specs;
	return 0;
}

int shardd_group_check_exports(const struct shardd_group_reply *info, uint32_t backend, int nfds,
			       size_t tail)
{
	int want_fds = 0, nipc = 0;

	for (int b = 0; b < SHARDD_GROUP_BUFS; b++) {
		uint32_t kind = info->export_kind[b];

		if (kind >= SHARDD_EXPORT_COUNT)
			return shardd_err_set(
				-SHARDD_E_MALFORMED,
				"GROUP reply: export_kind[%d] = %u is not an export kind "
				"(fd = %d, cuda ipc = %d)",
				b, kind, SHARDD_EXPORT_FD, SHARDD_EXPORT_CUDA_IPC);
		if (kind == SHARDD_EXPORT_CUDA_IPC && backend != SHARDD_BACKEND_CUDA)
			return shardd_err_set(
				-SHARDD_E_MALFORMED,
				"GROUP reply: export_kind[%d] = %u (cuda ipc) for the %s "
				"buffer, but the daemon's backend is %u, not cuda (%d)",
				b, kind, buf_name[b], backend, SHARDD_BACKEND_CUDA);
		if (kind == SHARDD_EXPORT_FD)
			want_fds++;
		else
			nipc++;
	}
	if (nfds != want_fds)
		return shardd_err_set(
			-SHARDD_E_MALFORMED,
			"GROUP reply carries %d fds, but its export_kind {%u, %u, %u, %u} "
			"says %d buffers travel as fds",
			nfds, info->export_kind[0], info->export_kind[1], info->export_kind[2],
			info->export_kind[3], want_fds);
	if (tail != (size_t)nipc * sizeof(struct shardd_cuda_ipc_handle))
		return shardd_err_set(
			-SHARDD_E_MALFORMED,
			"GROUP reply has %zu bytes after its param specs, but its export_kind "
			"{%u, %u, %u, %u} says %d CUDA IPC handles of %zu bytes follow",
			tail, info->export_kind[0], info->export_kind[1], info->export_kind[2],
			info->export_kind[3], nipc, sizeof(struct shardd_cuda_ipc_handle));
	return nipc;
}

/* Fill g from a GROUP reply; `want_nparams` 0 accepts any count. */
static int group_from_reply(struct shardd_group *g, const struct shardd_ctrl_rx *rx,
			    uint32_t want_nparams)
{
	struct shardd_group_reply *info = &g->info;
	/* An older daemon sends the reply without exec (< 5) or peer_last_step (< 4): then 0. */
	size_t isize = g->client->welcome.minor >= 5   ? sizeof(*info)
		       : g->client->welcome.minor == 4 ? SHARDD_GROUP_REPLY_SIZE_V4
						       : SHARDD_GROUP_REPLY_SIZE_V3;
	int ranks, nfds;
	uint64_t sizes[SHARDD_BUF_COUNT];
	const uint8_t *handles;
	size_t specs_end;
	int ret, fi = 0, hi = 0;

	if (rx->hdr.length < isize)
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "GROUP reply of %u bytes, want at least %zu", rx->hdr.length,
				      isize);
	memset(info, 0, sizeof(*info));
	memcpy(info, rx->payload, isize);
	if (!info->nparams || info->nparams > SHARDD_MAX_PARAMS ||
	    (want_nparams && info->nparams != want_nparams))
		return shardd_err_set(-SHARDD_E_MALFORMED, "GROUP reply has %u params, want %u",
				      info->nparams,
				      want_nparams ? want_nparams : SHARDD_MAX_PARAMS);
	specs_end = isize + (size_t)info->nparams * (sizeof(struct shardd_param_layout) +
						     sizeof(struct shardd_param_spec));
	if (rx->hdr.length < specs_end)
		return shardd_err_set(
			-SHARDD_E_MALFORMED,
			"GROUP reply of %u bytes, %u params need %zu before any CUDA IPC handle",
			rx->hdr.length, info->nparams, specs_end);
	if (!info->group_id)
		return shardd_err_set(-SHARDD_E_MALFORMED, "GROUP reply has group id 0");
	if (!info->shard_world || info->shard_world != g->client->shard)
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "GROUP reply has shard_world %u, the mesh's shard size is %u",
				      info->shard_world, g->client->shard);
	if (info->exec != SHARDD_EXEC_DAEMON && info->exec != SHARDD_EXEC_RANKS &&
	    !(isize < sizeof(*info) && info->exec == 0))
		return shardd_err_set(
			-SHARDD_E_MALFORMED,
			"GROUP reply has exec = %u, neither daemon (%d) nor ranks (%d)", info->exec,
			SHARDD_EXEC_DAEMON, SHARDD_EXEC_RANKS);
	/* A rank-executed group's sync page travels after the buffers' fds. */
	ranks = info->exec == SHARDD_EXEC_RANKS;
	nfds = rx->nfds - ranks;
	if (nfds < 0)
		return shardd_err_set(-SHARDD_E_MALFORMED,
				      "GROUP reply of a rank-executed group carries no fd");
	ret = shardd_group_check_exports(info, g->client->welcome.backend, nfds,
					 rx->hdr.length - specs_end);
	if (ret < 0)
		return ret;
	handles = rx->payload + specs_end;
	g->layouts = malloc(sizeof(*g->layouts) * info->nparams);
	if (!g->layouts)
		return shardd_err_set(-ENOMEM, "%u param layouts: out of memory", info->nparams);
	memcpy(g->layouts, rx->payload + isize, sizeof(*g->layouts) * info->nparams);
	ret = specs_from_reply(g, rx->payload + isize + sizeof(*g->layouts) * info->nparams);
	if (ret < 0)
		return ret;
	sizes[SHARDD_BUF_UNSHARDED] = info->unsharded_size;
	sizes[SHARDD_BUF_GRAD] =
		ranks ? shardd_exec_grad_map_size(info->grad_size) : info->grad_size;
	sizes[SHARDD_BUF_SHARD] = info->shard_size;
	sizes[SHARDD_BUF_SHARD_GRAD] = info->shard_size;
	/* fds and handles each come in buffer order, for the buffers of their kind. */
	for (int b = 0; b < SHARDD_BUF_COUNT; b++) {
		struct shardd_cuda_ipc_handle h;

		if (info->export_kind[b] == SHARDD_EXPORT_FD) {
			ret = map_buffer(g, (enum shardd_group_buf)b, rx->fds[fi++], sizes[b]);
		} else {
			/* The payload may sit at any alignment: copy the handle out. */
			memcpy(&h, handles + (size_t)hi++ * sizeof(h), sizeof(h));
			ret = map_cuda_buffer(g, (enum shardd_group_buf)b, -1, &h, sizes[b]);
		}
		if (ret < 0)
			return ret;
	}
	for (uint32_t i = 0; i < info->nparams; i++) {
		const struct shardd_param_layout *l = &g->layouts[i];

		ret = check_range(g, i, "unsharded", l->unsharded_offset, l->unsharded_bytes,
				  SHARDD_BUF_UNSHARDED);
		if (!ret)
			ret = check_range(g, i, "grad", l->grad_offset, l->grad_bytes,
					  SHARDD_BUF_GRAD);
		if (!ret)
			ret = check_range(g, i, "shard", l->shard_offset, l->shard_bytes,
					  SHARDD_BUF_SHARD);
		if (!ret)
			ret = check_against_spec(g, i);
		if (ret < 0)
			return ret;
	}
	return ranks ? shardd_exec_attach(g, rx->fds[nfds]) : 0;
}

void shardd_group_close(struct shardd_group *g)
{
	if (!g)
		return;
	shardd_exec_detach(g);
	for (int b = 0; b < SHARDD_BUF_COUNT; b++) {
		if (g->buf[b].cuda_size) {
			struct shardd_cuda_mapping m = { (uint64_t)(uintptr_t)g->buf[b].addr,
							 g->buf[b].cuda_size, g->buf[b].cuda_kind,
							 g->buf[b].cuda_device };

			shardd_cuda_unmap(&m);
		} else if (g->buf[b].addr) {
			munmap(g->buf[b].addr, (size_t)g->buf[b].size);
		}
	}
	free(g->layouts);
	free(g->specs);
	free(g);
}

/* Send a REGISTER_GROUP or OPEN_GROUP request, take the reply into a new group. */
static int group_request(struct shardd_client *c, const char *name, uint16_t type,
			 const void *payload, uint32_t len, struct shardd_param_spec *specs,
			 uint32_t nparams, int timeout_ms, struct shardd_group **out)
{
	struct shardd_ctrl_rx rx = { 0 };
	struct shardd_group *g;
	int ret;

	g = calloc(1, sizeof(*g));
	if (!g) {
		free(specs);
		return shardd_err_set(-ENOMEM, "out of memory");
	}
	g->client = c;
	g->specs = specs;
	snprintf(g->name, sizeof(g->name), "%s", name);
	ret = shardd_client_request(c, type, payload, len, timeout_ms, SHARDD_MSG_GROUP, &rx);
	if (ret < 0)
		goto err;
	ret = group_from_reply(g, &rx, nparams);
	shardd_ctrl_rx_reset(&rx);
	if (ret < 0)
		goto err;
	*out = g;
	return 0;
err:
	shardd_group_close(g);
	return ret;
}

static int check_name(const char *name, size_t max, const char *what)
{
	if (!name)
		return shardd_err_set(-EINVAL, "%s name missing", what);
	if (strnlen(name, max) >= max)
		return shardd_err_set(-ENAMETOOLONG, "%s name '%.*s...' is longer than %zu bytes",
				      what, 32, name, max - 1);
	return 0;
}

int shardd_group_register(struct shardd_client *c, const char *name,
			  const struct shardd_param_desc *params, uint32_t nparams,
			  const struct shardd_precision *precision,
			  const struct shardd_group_opts *opts, struct shardd_group **out)
{
	uint32_t ct = c->welcome.collective_timeout_ms;
	struct shardd_register_group *reg = NULL;
	struct shardd_param_spec *specs = NULL;
	char restore_abs[PATH_MAX];
	const char *restore = NULL;
	size_t len;
	int ret;

	shardd_err_clear();
	ret = check_name(name, SHARDD_NAME_MAX, "group");
	if (ret < 0)
		return shardd_err_wrap(ret, "register group");
	if (!nparams || nparams > SHARDD_MAX_PARAMS || !params) {
		ret = shardd_err_set(-EINVAL, "nparams %u: a group has 1..%d params", nparams,
				     SHARDD_MAX_PARAMS);
		goto err;
	}
	len = sizeof(*reg) + sizeof(*specs) * nparams;
	if (opts && opts->optimizer)
		len += sizeof(*opts->optimizer);
	if (opts && opts->restore) {
		/* The daemon runs elsewhere: a relative path is made absolute here, where it means something. */
		if (opts->restore[0] && opts->restore[0] != '/' &&
		    realpath(opts->restore, restore_abs))
			restore = restore_abs;
		else
			restore = opts->restore;
		if (strlen(restore) >= SHARDD_RESTORE_PATH_MAX) {
			ret = shardd_err_set(-EINVAL, "restore path of %zu bytes; at most %d",
					     strlen(restore), SHARDD_RESTORE_PATH_MAX - 1);
			goto err;
		}
		len += sizeof(struct shardd_restore) + strlen(restore);
	}
	reg = calloc(1, len);
	specs = calloc(nparams, sizeof(*specs));
	if (!reg || !specs) {
		ret = shardd_err_set(-ENOMEM, "%u param specs: out of memory", nparams);
		goto err;
	}
	memcpy(reg->name, name, strlen(name));
	reg->nparams = nparams;
	reg->param_dtype = precision ? precision->param_dtype : SHARDD_DTYPE_NONE;
	reg->reduce_dtype = precision ? precision->reduce_dtype : SHARDD_DTYPE_NONE;
	reg->init = SHARDD_INIT_ZERO;
	reg->exec = opts ? opts->exec : SHARDD_EXEC_AUTO;
	if (reg->exec >= SHARDD_EXEC_COUNT) {
		ret = shardd_err_set(-EINVAL, "exec = %u; known: auto %d, daemon %d, ranks %d",
				     reg->exec, SHARDD_EXEC_AUTO, SHARDD_EXEC_DAEMON,
				     SHARDD_EXEC_RANKS);
		goto err;
	}
	for (uint32_t i = 0; i < nparams; i++) {
		const struct shardd_param_desc *d = &params[i];
		struct shardd_param_spec *p = &specs[i];

		ret = check_name(d->name, SHARDD_PARAM_NAME_MAX, "param");
		if (ret < 0) {
			shardd_err_wrap(ret, "param %u", i);
			goto err;
		}
		if (d->ndim > SHARDD_MAX_DIMS) {
			ret = shardd_err_set(-EINVAL, "param %u '%s': ndim %u, at most %d", i,
					     d->name, d->ndim, SHARDD_MAX_DIMS);
			goto err;
		}
		memcpy(p->name, d->name, strlen(d->name));
		p->dtype = d->dtype;
		p->ndim = d->ndim;
		p->shard_dim = d->shard_dim;
		memcpy(p->shape, d->shape, sizeof(p->shape[0]) * d->ndim);
		if (shardd_shape_overflow_dim(p) >= 0) {
			int bad = shardd_shape_overflow_dim(p);

			ret = shardd_err_set(-EINVAL,
					     "param %u '%s': shape[%d] = %llu takes the product of "
					     "the nonzero dims past 64 bits of bytes",
					     i, d->name, bad, (unsigned long long)d->shape[bad]);
			goto err;
		}
	}
	memcpy(reg + 1, specs, sizeof(*specs) * nparams);
	if (opts && opts->optimizer) {
		reg->flags |= SHARDD_REGISTER_OPTIMIZER;
		memcpy((uint8_t *)(reg + 1) + sizeof(*specs) * nparams, opts->optimizer,
		       sizeof(*opts->optimizer));
	}
	if (restore) {
		struct shardd_restore rs = { .path_len = (uint32_t)strlen(restore) };
		uint8_t *at = (uint8_t *)reg + len - sizeof(rs) - rs.path_len;

		reg->init = SHARDD_INIT_RESTORE;
		memcpy(at, &rs, sizeof(rs));
		memcpy(at + sizeof(rs), restore, rs.path_len);
	}
	/* The daemon answers once every rank registered, or fails at its collective timeout. */
	ret = group_request(c, name, SHARDD_MSG_REGISTER_GROUP, reg, (uint32_t)len, specs, nparams,
			    ct ? (int)(ct + 5000) : -1, out);
	specs = NULL;
	if (ret < 0)
		goto err;
	free(reg);
	return 0;
err:
	free(specs);
	free(reg);
	return shardd_err_wrap(ret, "register group '%s'", name);
}

int shardd_group_open(struct shardd_client *c, const char *name, struct shardd_group **out)
{
	struct shardd_open_group req = { { 0 } };
	int ret;

	shardd_err_clear();
	ret = check_name(name, SHARDD_NAME_MAX, "group");
	if (ret < 0)
		return shardd_err_wrap(ret, "open group");
	memcpy(req.name, name, strlen(name));
	ret = group_request(c, name, SHARDD_MSG_OPEN_GROUP, &req, sizeof(req), NULL, 0,
			    SHARDD_CONNECT_TIMEOUT_MS, out);
	if (ret < 0)
		return shardd_err_wrap(ret, "open group '%s'", name);
	return 0;
}

/* --------------------------------------------------------------------- */
/* Accessors                                                             */
/* --------------------------------------------------------------------- */

uint64_t shardd_group_last_step(const struct shardd_group *g)
{
	return g->info.last_step;
}

uint64_t shardd_group_peer_last_step(const struct shardd_group *g)
{
	return g->info.peer_last_step;
}

uint32_t shardd_group_id(const struct shardd_group *g)
{
	return g->info.group_id;
}

uint32_t shardd_group_nparams(const struct shardd_group *g)
{
	return g->info.nparams;
}

const struct shardd_group_reply *shardd_group_info(const struct shardd_group *g)
{
	return &g->info;
}

const struct shardd_param_layout *shardd_group_layout(const struct shardd_group *g, uint32_t param)
{
	return param < g->info.nparams ? &g->layouts[param] : NULL;
}

int shardd_group_find(const struct shardd_group *g, const char *param_name)
{
	if (!g->specs || !param_name)
		return -ENOENT;
	for (uint32_t i = 0; i < g->info.nparams; i++)
		if (strncmp(g->specs[i].name, param_name, SHARDD_PARAM_NAME_MAX) == 0)
			return (int)i;
	return -ENOENT;
}

/* Byte `offset` of buffer `b`; NULL when the buffer is empty (size 0). */
static void *at(const struct shardd_group *g, enum shardd_group_buf b, uint64_t offset)
{
	return g->buf[b].addr ? (char *)g->buf[b].addr + offset : NULL;
}

const void *shardd_group_unsharded(const struct shardd_group *g, uint32_t param)
{
	return param < g->info.nparams
		       ? at(g, SHARDD_BUF_UNSHARDED, g->layouts[param].unsharded_offset)
		       : NULL;
}

void *shardd_group_grad(const struct shardd_group *g, uint32_t param)
{
	return param < g->info.nparams ? at(g, SHARDD_BUF_GRAD, g->layouts[param].grad_offset)
				       : NULL;
}

void *shardd_group_shard(const struct shardd_group *g, uint32_t param)
{
	return param < g->info.nparams ? at(g, SHARDD_BUF_SHARD, g->layouts[param].shard_offset)
				       : NULL;
}

void *shardd_group_shard_grad(const struct shardd_group *g, uint32_t param)
{
	return param < g->info.nparams
		       ? at(g, SHARDD_BUF_SHARD_GRAD, g->layouts[param].shard_offset)
		       : NULL;
}

int shardd_group_load_full(struct shardd_group *g, uint32_t param, const void *full)
{
	const struct shardd_mapping *m = &g->buf[SHARDD_BUF_SHARD];
	const struct shardd_param_spec *p;
	struct shardd_shard_geometry geo;
	const char *src = full;
	char *dst, *shard;
	size_t esz, chunk;
	int ret = 0;

	shardd_err_clear();
	if (param >= g->info.nparams || !full)
		return shardd_err_set(-EINVAL, "load param %u of group '%s' (%u params)%s", param,
				      g->name, g->info.nparams, full ? "" : ": no data");
	p = &g->specs[param];
	/* Registration checked the shape and the layout against each other. */
	shardd_group_geometry(p, g->info.shard_world, g->client->rank % g->info.shard_world, &geo);
	esz = shardd_dtype_size(p->dtype);
	shard = shardd_group_shard(g, param);
	/* A zero-numel param has no shard bytes, however many outer indices it has. */
	if (!shard || !geo.shard_numel)
		return 0;
	chunk = (size_t)(geo.rows * geo.inner * esz);
	/* Device memory: the rows are laid out in host memory first, then copied in one go. */
	dst = m->cuda_size ? malloc(geo.outer * chunk) : shard;
	if (!dst)
		return shardd_err_set(-ENOMEM,
				      "load param %u of group '%s': out of memory for "
				      "%zu bytes of staging",
				      param, g->name, (size_t)(geo.outer * chunk));
	for (uint64_t o = 0; o < geo.outer; o++) {
		size_t have = (size_t)(geo.valid * geo.inner * esz);

		/* A rank wholly in the padding has no source rows: nothing to point at. */
		if (have)
			memcpy(dst + o * chunk, src + (o * geo.dim + geo.begin) * geo.inner * esz,
			       have);
		memset(dst + o * chunk + have, 0, chunk - have);
	}
	if (dst != shard) {
		ret = shardd_cuda_copy_in(m->cuda_device, (uint64_t)(uintptr_t)shard, dst,
					  geo.outer * chunk);
		free(dst);
		if (ret < 0)
			shardd_err_wrap(ret, "load param %u of group '%s'", param, g->name);
	}
	return ret;
}
