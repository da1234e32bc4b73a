/* SPDX-License-Identifier: MIT */
/*
 * Registration (engine_int.h): a group comes to exist when every rank of
 * the job registered it with the same spec. The first registration
 * defines it and commits its memory; the last one places its ranks on
 * devices, allocates its buffers and answers every rank with them.
 * OPEN_GROUP hands a registered group's buffers to a rank again.
 *
 *   register (rank a) --> pending: spec, memory committed --(every rank, same spec)-->
 *       placement, buffers --> complete: every rank gets its reply
 *
 * A mismatch, a rank gone or the timeout fails the pending registration
 * for every rank that arrived, and the group is forgotten.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "clock.h"
#include "engine_int.h"
#include "memlimit.h"
#include "placement.h"

/* Descriptors kept from the groups for connections and the daemon's own files: RLIMIT_NOFILE / 4, within these. */
#define GROUP_FDS_RESERVE_MIN 32
#define GROUP_FDS_RESERVE_MAX 1024

/* The job's group named `name` (engine_int.h). */
struct eng_group *eng_group_by_name(const struct shd_engine_job *j, const char *name)
{
	for (uint32_t i = 0; i < j->ngroups; i++) {
		if (j->groups[i] && !strcmp(j->groups[i]->g->name, name))
			return j->groups[i];
	}
	return NULL;
}

/* Free a group's engine state and buffers; handles a partly built one. */
static void group_destroy(struct eng_group *eg, struct shd_engine_job *j)
{
	for (uint32_t r = 0; eg->dhead && r < j->world; r++) {
		while (eg->dhead[r]) {
			struct eng_deferred *d = eg->dhead[r];

			eg->dhead[r] = d->next;
			free(d);
		}
	}
	free(eg->dhead);
	free(eg->dtail);
	shd_rdv_free(&eg->reg);
	for (uint32_t u = 0; eg->unshard && u < j->replicate; u++)
		eng_coll_free(&eg->unshard[u]);
	for (uint32_t u = 0; eg->rs && u < j->replicate; u++)
		eng_coll_free(&eg->rs[u]);
	eng_coll_free(&eg->ar);
	free(eg->unshard);
	free(eg->rs);
	free(eg->regs);
	free(eg->exec_renewing);
	free(eg->exec_open);
	free(eg->exec_sealer);
	free(eg->restore);
	eng_world_group_free(eg);
	shd_group_destroy(eg->g, j->e->backend);
	j->mem_committed -= eg->mem_committed;
	j->e->mem_committed -= eg->mem_committed;
	j->e->fds_committed -= eg->fds_committed;
	free(eg);
}

/* Forget a group: its id is never reused, so a stale id finds nothing. */
void eng_group_free(struct eng_group *eg)
{
	eg->j->groups[eg->g->id - 1] = NULL;
	group_destroy(eg, eg->j);
}

/*
 * Count every buffer the group will ever hold against the limits
 * (--max-job-memory for its job, --max-memory for all jobs) before any
 * exists: 0 with the bytes committed in eg, the job and the engine, or
 * -ENOMEM with `err` naming the job, the group, the bytes it needs, those
 * in use, the limit and the flag that raises it. The host backend commits
 * the pages themselves when it allocates (fallocate), so an op never finds
 * memory missing. Device memory (cuda) is not counted.
 */
static int group_commit_memory(struct shd_engine_job *j, struct eng_group *eg, char *err,
			       size_t errlen)
{
	struct shd_engine *e = j->e;
	struct shd_group_memory m;
	const char *flag = NULL, *holder = NULL;
	uint64_t used = 0, limit = 0;
	char need[32], held[32], max[32];

	if (e->cfg.backend != SHARDD_BACKEND_HOST)
		return 0;
	eng_world_orphans_sweep(e);
	shd_group_memory_need(eg->g, &m);
	if (e->cfg.max_job_memory && (m.total > e->cfg.max_job_memory ||
				      j->mem_committed > e->cfg.max_job_memory - m.total)) {
		flag = "--max-job-memory";
		holder = "the job";
		used = j->mem_committed;
		limit = e->cfg.max_job_memory;
	} else if (e->cfg.max_memory && (m.total > e->cfg.max_memory ||
					 e->mem_committed > e->cfg.max_memory - m.total)) {
		flag = "--max-memory";
		holder = "the daemon (all jobs)";
		used = e->mem_committed;
		limit = e->cfg.max_memory;
	}
	if (flag) {
		char span[128] = "";

		if (m.internode)
			eng_fmt(span, sizeof(span),
				", of which %s (%llu bytes) inter-node buffers across %u nodes",
				shd_memlimit_str(m.internode, held, sizeof(held)),
				(unsigned long long)m.internode, j->span_nodes);
		eng_fmt(err, errlen,
			"register group '%s' of job '%s': its buffers need %s (%llu bytes%s), but %s holds %s "
			"(%llu bytes) of its limit of %s (%llu bytes); raise %s, or end jobs or register smaller groups",
			eg->g->name, j->name, shd_memlimit_str(m.total, need, sizeof(need)),
			(unsigned long long)m.total, span, holder,
			shd_memlimit_str(used, held, sizeof(held)), (unsigned long long)used,
			shd_memlimit_str(limit, max, sizeof(max)), (unsigned long long)limit, flag);
		return -ENOMEM;
	}
	eg->mem_committed = m.total;
	j->mem_committed += m.total;
	e->mem_committed += m.total;
	return 0;
}

/* vm.max_map_count: the daemon maps every buffer it holds. 0 when unknown. */
static uint64_t max_map_count(void)
{
	static uint64_t cached;
	unsigned long long v = 0;
	FILE *f;

	if (cached)
		return cached;
	f = fopen("/proc/sys/vm/max_map_count", "re");
	if (f) {
		if (fscanf(f, "%llu", &v) != 1)
			v = 0;
		fclose(f);
	}
	cached = v;
	return cached;
}

/*
 * Count the descriptors and mappings the group's buffers will hold (one
 * each per buffer, at most) against RLIMIT_NOFILE and vm.max_map_count,
 * less a reserve for connections and the daemon's own files: a client
 * registering group after group is refused here, not left to run the
 * daemon out of descriptors for everyone else (a group of one element
 * counts only 64 bytes against --max-memory). 0 with the count committed
 * in eg and the engine, or -EMFILE with `err`.
 */
static int group_commit_fds(struct shd_engine_job *j, struct eng_group *eg, char *err,
			    size_t errlen)
{
	struct shd_engine *e = j->e;
	const struct shd_group *g = eg->g;
	uint64_t need, reserve, budget, limit = UINT64_MAX, maps = max_map_count();
	const char *what = "RLIMIT_NOFILE", *fix = "raise shardd's limit (ulimit -n, LimitNOFILE=)";
	struct rlimit rl;

	/*
	 * Per rank: its unsharded copy (at most), shard, sharded grad, grad,
	 * optimizer states, partial; a rank-executed group's sync page.
	 */
	need = (uint64_t)g->world *
		       (4 + shd_group_optim_states(&g->optim) + (g->partial_size ? 1 : 0)) +
	       (g->exec == SHARDD_EXEC_RANKS);
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
		limit = rl.rlim_cur;
	if (maps && maps < limit) {
		limit = maps;
		what = "vm.max_map_count";
		fix = "raise vm.max_map_count (sysctl)";
	}
	if (limit == UINT64_MAX)
		goto commit;
	reserve = limit / 4;
	reserve = reserve < GROUP_FDS_RESERVE_MIN   ? GROUP_FDS_RESERVE_MIN
		  : reserve > GROUP_FDS_RESERVE_MAX ? GROUP_FDS_RESERVE_MAX
						    : reserve;
	budget = limit > reserve ? limit - reserve : 0;
	if (need > budget || e->fds_committed > budget - need) {
		eng_fmt(err, errlen,
			"register group '%s' of job '%s': its buffers need up to %llu file descriptors and mappings, "
			"but the groups of all jobs hold %llu of the %llu that shardd gives them (%s = %llu, less "
			"%llu kept for connections); %s, or end jobs or register fewer, larger groups",
			g->name, j->name, (unsigned long long)need,
			(unsigned long long)e->fds_committed, (unsigned long long)budget, what,
			(unsigned long long)limit, (unsigned long long)reserve, fix);
		return -EMFILE;
	}
commit:
	eg->fds_committed = need;
	e->fds_committed += need;
	return 0;
}

/* A pending group for the first registration of `hdr`; takes `specs` on success. */
static int group_new(struct shd_engine_job *j, const struct shardd_register_group *hdr,
		     struct shardd_param_spec *specs, const struct shardd_optim_config *optim,
		     uint32_t rank, struct eng_group **out, char *err, size_t errlen)
{
	struct eng_group *eg;
	uint32_t *all = NULL;
	int ret = -ENOMEM;

	if (j->ngroups == j->cap) {
		uint32_t cap = j->cap ? j->cap * 2 : 16;
		struct eng_group **ng = cap > j->cap ? realloc(j->groups, cap * sizeof(*ng)) : NULL;

		if (!ng)
			goto err_msg;
		j->groups = ng;
		j->cap = cap;
	}
	eg = calloc(1, sizeof(*eg));
	if (!eg)
		goto err_msg;
	eg->j = j;
	eg->first_rank = rank;
	ret = shd_group_create(j->ngroups + 1, hdr, specs, j->replicate, j->shard, &eg->g, err,
			       errlen);
	if (ret) {
		free(eg);
		return ret;
	}
	/* HSDP across nodes: this node's one replica keeps partials for the all-reduce among nodes. */
	if (eng_mesh_replicate(j) > 1)
		eg->g->partial_size = eg->g->reduce_shard_size;
	if (j->span_nodes > 1) {
		ret = eng_world_group_init(eg, err, errlen);
		if (ret) {
			eg->g->specs = NULL; /* still the caller's on failure */
			group_destroy(eg, j);
			return ret;
		}
	}
	if (optim->kind != SHARDD_OPTIM_NONE && !j->e->backend->ops->step) {
		eng_fmt(err, errlen,
			"register group '%s': the %s backend has no optimizer step; register the "
			"group without an optimizer and update the shards in the trainer, or run the daemon with "
			"--backend host",
			hdr->name, j->e->backend->ops->name);
		ret = -ENOTSUP;
	} else {
		ret = shd_group_set_optim(eg->g, optim, err, errlen);
		if (ret == -ENOMEM)
			eng_fmt(err, errlen, "register group '%s': out of memory", hdr->name);
	}
	if (!ret)
		ret = eng_exec_choose(eg, hdr->exec, err, errlen);
	if (!ret)
		ret = group_commit_memory(j, eg, err, errlen);
	if (!ret)
		ret = group_commit_fds(j, eg, err, errlen);
	if (ret) {
		eg->g->specs = NULL; /* still the caller's on failure */
		group_destroy(eg, j);
		return ret;
	}
	ret = -ENOMEM;
	all = malloc(j->world * sizeof(*all));
	eg->regs = calloc(j->world, sizeof(*eg->regs));
	eg->unshard = calloc(j->replicate, sizeof(*eg->unshard));
	eg->rs = calloc(j->replicate, sizeof(*eg->rs));
	eg->dhead = calloc(j->world, sizeof(*eg->dhead));
	eg->dtail = calloc(j->world, sizeof(*eg->dtail));
	eg->exec_renewing = calloc(j->world, 1);
	eg->exec_open = calloc(j->world, sizeof(*eg->exec_open));
	eg->exec_sealer = calloc(j->world, sizeof(*eg->exec_sealer));
	if (!all || !eg->regs || !eg->unshard || !eg->rs || !eg->dhead || !eg->dtail ||
	    !eg->exec_renewing || !eg->exec_open || !eg->exec_sealer)
		goto err_group;
	for (uint32_t r = 0; r < j->world; r++)
		all[r] = r;
	if (shd_rdv_init(&eg->reg, all, j->world))
		goto err_group;
	for (uint32_t u = 0; u < j->replicate; u++) {
		if (eng_coll_init(&eg->unshard[u], u * j->shard, j->shard, SHARDD_OP_UNSHARD) ||
		    eng_coll_init(&eg->rs[u], u * j->shard, j->shard, SHARDD_OP_REDUCE))
			goto err_group;
	}
	if (j->replicate > 1 && eng_coll_init(&eg->ar, 0, j->world, SHARDD_OP_REDUCE))
		goto err_group;
	/* A job across nodes: its rendezvous name global ranks. */
	eg->reg.shown_base = eng_rank_shown(j, 0);
	for (uint32_t u = 0; u < j->replicate; u++) {
		eg->unshard[u].rdv.shown_base = eng_rank_shown(j, 0);
		eg->rs[u].rdv.shown_base = eng_rank_shown(j, 0);
	}
	eg->ar.rdv.shown_base = eng_rank_shown(j, 0);
	free(all);
	j->groups[j->ngroups++] = eg;
	*out = eg;
	return 0;

err_group:
	eg->g->specs = NULL; /* still the caller's on failure */
	group_destroy(eg, j);
	free(all);
err_msg:
	eng_fmt(err, errlen, "register group '%s': the daemon is out of memory", hdr->name);
	return ret;
}

/*
 * Fail a pending registration for every rank that arrived, and forget the group.
 *
 * The group leaves the job before any reply is sent: a reply that cannot be
 * sent drops its client, whose departure (shd_engine_rank_gone) would
 * otherwise find this group still pending, fail it again and free it under
 * this loop.
 */
static void reg_fail(struct eng_group *eg, int res, const char *msg, uint32_t skip_rank)
{
	struct shd_engine_job *j = eg->j;

	j->groups[eg->g->id - 1] = NULL;
	for (uint32_t r = 0; r < j->world; r++) {
		if (r != skip_rank && shd_rdv_has_arrived(&eg->reg, r))
			eng_reply_err(j, r, eg->regs[r].token, eg->regs[r].seq, res, msg);
	}
	group_destroy(eg, j);
}

/* Send `rank` its GROUP reply (OPEN_GROUP of a registered group, or the registration's end). */
static void reply_group(struct eng_group *eg, uint32_t rank, uint64_t token, uint32_t seq)
{
	struct shd_engine_job *j = eg->j;
	struct shardd_group_reply reply;
	struct shardd_param_layout *layouts;
	struct shd_group_export ex;
	char msg[ENGINE_MSG_MAX];
	int ret;

	layouts = malloc((size_t)eg->g->hdr.nparams * sizeof(*layouts));
	if (!layouts) {
		eng_fmt(msg, sizeof(msg), "shardd: group '%s': the daemon is out of memory",
			eg->g->name);
		eng_reply_err(j, rank, token, seq, -SHARDD_E_NOMEM, msg);
		return;
	}
	ret = shd_group_reply(eg->g, j->e->backend, rank, &reply, layouts, &ex);
	if (ret) {
		eng_fmt(msg, sizeof(msg),
			"shardd: group '%s': cannot export its buffers to rank %u: %s", eg->g->name,
			rank, strerror(-ret));
		eng_reply_err(j, rank, token, seq, ret, msg);
	} else {
		j->e->cfg.reply(j->ctx, rank, token, seq, 0, NULL, &reply, layouts, eg->g->specs,
				ex.fds, ex.nfds, ex.ipc, ex.nipc);
		shd_group_export_close(&ex);
	}
	free(layouts);
}

/*
 * Where the group's collectives run (placement.h): refuse ranks of a shard
 * or replicate group that partly share devices, and collectives across
 * devices that the backend cannot run. 0 with *planned set when `pl`
 * holds the plan (0: the backend ignores devices, and every replica shares
 * one unsharded buffer), or an error with `err`.
 */
static int reg_place(struct eng_group *eg, struct shd_placement *pl, int *planned, char *err,
		     size_t errlen)
{
	struct shd_engine_job *j = eg->j;
	struct shd_backend_ctx *b = j->e->backend;
	char why[320];
	int ret;

	*planned = 0;
	if (!b->ops->multi_device)
		return 0;
	ret = shd_placement_plan(eg->g->name, j->devices, j->replicate, j->shard, pl, err, errlen);
	if (ret)
		return ret;
	*planned = 1;
	if (!pl->nccl)
		return 0;
	ret = b->ops->multi_device(b, why, sizeof(why));
	if (ret)
		eng_fmt(err, errlen,
			"register group '%s': its ranks sit on different GPUs, where collectives need NCCL: %s",
			eg->g->name, why);
	return ret;
}

static void reg_finish(struct eng_group *eg)
{
	struct shd_engine_job *j = eg->j;
	struct shd_placement *pl;
	char err[ENGINE_MSG_MAX], msg[ENGINE_MSG_MAX];
	int planned = 0, ret;

	pl = malloc(sizeof(*pl));
	if (!pl) {
		eng_fmt(msg, sizeof(msg),
			"shardd: register group '%s': the daemon is out of memory", eg->g->name);
		reg_fail(eg, -SHARDD_E_NOMEM, msg, UINT32_MAX);
		return;
	}
	ret = reg_place(eg, pl, &planned, err, sizeof(err));
	if (!ret)
		ret = shd_group_alloc(eg->g, j->e->backend, j->devices, planned ? pl : NULL, err,
				      sizeof(err));
	if (!ret && j->span_nodes > 1)
		ret = eng_world_group_alloc(eg, err, sizeof(err));
	if (!ret)
		eng_exec_init(eg);
	free(pl);
	if (ret) {
		eng_fmt(msg, sizeof(msg), "shardd: %s", err);
		reg_fail(eg, ret, msg, UINT32_MAX);
		return;
	}
	if (eg->restore) {
		static const struct eng_task_ops restore_hooks = { .exec = eng_restore_exec,
								   .delivered =
									   eng_restore_delivered };
		struct eng_task *t = eng_task_new(eg, TASK_RESTORE, 1);

		if (!t) {
			eng_fmt(msg, sizeof(msg),
				"shardd: register group '%s': the daemon is out of memory",
				eg->g->name);
			reg_fail(eg, -SHARDD_E_NOMEM, msg, UINT32_MAX);
			return;
		}
		t->hooks = &restore_hooks;
		t->ops[0].sqe.op = SHARDD_OP_NOP;
		eg->restoring = 1;
		eng_group_enqueue(eg, t);
		return;
	}
	eg->complete = 1;
	for (uint32_t r = 0; r < j->world; r++)
		reply_group(eg, r, eg->regs[r].token, eg->regs[r].seq);
	shd_rdv_reset(&eg->reg);
}

void eng_restore_delivered(struct eng_task *t)
{
	struct eng_group *eg = t->eg;
	struct shd_engine_job *j = eg->j;

	eg->restoring = 0;
	eng_restore_record(t);
	if (!t->res && eg->restore_fail) {
		t->res = eg->restore_fail;
		snprintf(t->msg, sizeof(t->msg), "%s", eg->restore_msg);
	}
	if (t->res) {
		reg_fail(eg, t->res, t->msg, UINT32_MAX);
		return;
	}
	eg->complete = 1;
	for (uint32_t r = 0; r < j->world; r++)
		reply_group(eg, r, eg->regs[r].token, eg->regs[r].seq);
	shd_rdv_reset(&eg->reg);
}

void shd_engine_register_group(struct shd_engine_job *j, uint32_t rank, uint64_t token,
			       uint32_t seq, const void *payload, size_t len, uid_t uid,
			       uint16_t minor)
{
	struct shardd_register_group hdr;
	struct shardd_param_spec *specs = NULL;
	struct shardd_optim_config optim;
	struct eng_group *eg;
	char err[480], why[384], ranks[160], who[ENGINE_WHO_MAX], msg[ENGINE_MSG_MAX];
	char restore[SHARDD_RESTORE_PATH_MAX];
	int ret;

	if (rank >= j->world) {
		eng_fmt(msg, sizeof(msg),
			"shardd: register group: rank %u is outside job '%s' of %u ranks", rank,
			j->name, j->world);
		eng_reply_err(j, rank, token, seq, -SHARDD_E_INVALID, msg);
		return;
	}
	ret = shd_group_parse(payload, len, &hdr, &specs, &optim, restore, err, sizeof(err));
	if (ret) {
		eng_fmt(msg, sizeof(msg), "shardd: %s",
			ret == -ENOMEM ? "register group: out of memory" : err);
		eng_reply_err(j, rank, token, seq, ret, msg);
		return;
	}
	/* An older client sends 0 there (rsvd) and runs no op itself: its groups are the daemon's. */
	if (minor < 5)
		hdr.exec = SHARDD_EXEC_DAEMON;
	eg = eng_group_by_name(j, hdr.name);
	if (eg && eg->complete) {
		eng_fmt(msg, sizeof(msg),
			"shardd: group '%s' is already registered in job '%s' (id %u); use OPEN_GROUP to re-attach to it",
			hdr.name, j->name, eg->g->id);
		eng_reply_err(j, rank, token, seq, -EEXIST, msg);
		goto out;
	}
	if (!eg) {
		ret = group_new(j, &hdr, specs, &optim, rank, &eg, err, sizeof(err));
		if (ret) {
			eng_fmt(msg, sizeof(msg), "shardd: %s", err);
			eng_reply_err(j, rank, token, seq, ret, msg);
			goto out;
		}
		specs = NULL; /* the group owns them */
		if (hdr.init == SHARDD_INIT_RESTORE && !(eg->restore = strdup(restore))) {
			eng_fmt(msg, sizeof(msg), "shardd: register group '%s': out of memory",
				hdr.name);
			reg_fail(eg, -SHARDD_E_NOMEM, msg, UINT32_MAX);
			eng_reply_err(j, rank, token, seq, -SHARDD_E_NOMEM, msg);
			goto out;
		}
	} else if (shd_rdv_has_arrived(&eg->reg, rank)) {
		shd_rdv_who_missing(&eg->reg, who, sizeof(who));
		eng_fmt(msg, sizeof(msg),
			"shardd: rank %u already registered group '%s'; it waits for %s to register it",
			eng_rank_shown(j, rank), hdr.name, who);
		eng_reply_err(j, rank, token, seq, -SHARDD_E_STATE, msg);
		goto out;
	} else if (shd_group_compare(eg->g, &hdr, specs, &optim, eng_rank_shown(j, rank),
				     eng_rank_shown(j, eg->first_rank), why, sizeof(why))) {
		shd_rdv_present(&eg->reg, ranks, sizeof(ranks));
		eng_fmt(msg, sizeof(msg), "shardd: %s; registration failed for ranks %s,%u", why,
			ranks, eng_rank_shown(j, rank));
		/*
		 * The group is failed before this rank is answered: a reply that
		 * cannot be sent drops the rank, and its departure must not find
		 * (and free) the group we are still failing.
		 */
		reg_fail(eg, -SHARDD_E_MISMATCH, msg, UINT32_MAX);
		eng_reply_err(j, rank, token, seq, -SHARDD_E_MISMATCH, msg);
		goto out;
	} else if (hdr.exec != SHARDD_EXEC_AUTO && hdr.exec != eg->g->exec) {
		/* auto takes what the group runs as; an explicit ask must be it. */
		shd_rdv_present(&eg->reg, ranks, sizeof(ranks));
		eng_fmt(msg, sizeof(msg),
			"shardd: register group '%s': exec differs: rank %u asks %s%s, but the group "
			"runs %s (%s, as rank %u registered it); registration failed for ranks %s,%u",
			hdr.name, eng_rank_shown(j, rank), shardd_exec_name(hdr.exec),
			minor < 5
				? " (its client, of protocol minor < 5, runs daemon-executed groups "
				  "only)"
				: "",
			shardd_exec_name(eg->g->exec), eg->g->exec_why,
			eng_rank_shown(j, eg->first_rank), ranks, eng_rank_shown(j, rank));
		reg_fail(eg, -SHARDD_E_MISMATCH, msg, UINT32_MAX);
		eng_reply_err(j, rank, token, seq, -SHARDD_E_MISMATCH, msg);
		goto out;
	} else if (eg->restore && strcmp(eg->restore, restore)) {
		shd_rdv_present(&eg->reg, ranks, sizeof(ranks));
		eng_fmt(msg, sizeof(msg),
			"shardd: group '%s': rank %u restores from '%s' but rank %u from '%s'; "
			"registration failed for ranks %s,%u",
			hdr.name, eng_rank_shown(j, rank), restore,
			eng_rank_shown(j, eg->first_rank), eg->restore, ranks,
			eng_rank_shown(j, rank));
		reg_fail(eg, -SHARDD_E_MISMATCH, msg, UINT32_MAX);
		eng_reply_err(j, rank, token, seq, -SHARDD_E_MISMATCH, msg);
		goto out;
	}
	/* Another uid is trusted with what it could read itself: eng_restore_exec confines the path. */
	if (eg->restore && eg->restore[0] && uid != j->e->cfg.uid && !eg->restore_confined) {
		eg->restore_confined = 1;
		eg->restore_uid = uid;
	}
	ret = shd_rdv_arrive(&eg->reg, rank, 0, 0, shd_now_ns(), j->e->timeout_ns, why,
			     sizeof(why));
	eg->regs[rank] = (struct eng_reg){ .token = token, .seq = seq };
	if (ret == SHD_RDV_COMPLETE)
		reg_finish(eg);
out:
	free(specs);
}

/* A rank-executed rank's buffers were renewed (exec.c): the OPEN_GROUP that waited gets its reply. */
static void open_renewed(struct eng_group *eg, uint32_t rank)
{
	struct eng_reg pending = eg->exec_open[rank];

	eg->exec_open[rank] = (struct eng_reg){ 0 };
	if (pending.token)
		reply_group(eg, rank, pending.token, pending.seq);
}

void shd_engine_open_group(struct shd_engine_job *j, uint32_t rank, uint64_t token, uint32_t seq,
			   const void *payload, size_t len, uint16_t minor)
{
	struct shardd_open_group req;
	struct eng_group *eg;
	char msg[ENGINE_MSG_MAX], who[ENGINE_WHO_MAX];
	size_t off;

	if (rank >= j->world) {
		eng_fmt(msg, sizeof(msg),
			"shardd: open group: rank %u is outside job '%s' of %u ranks", rank,
			j->name, j->world);
		eng_reply_err(j, rank, token, seq, -SHARDD_E_INVALID, msg);
		return;
	}
	if (!payload || len != sizeof(req)) {
		eng_fmt(msg, sizeof(msg), "shardd: open group: payload is %zu bytes, expected %zu",
			len, sizeof(req));
		eng_reply_err(j, rank, token, seq, -SHARDD_E_MALFORMED, msg);
		return;
	}
	memcpy(&req, payload, sizeof(req));
	if (!memchr(req.name, '\0', sizeof(req.name))) {
		eng_fmt(msg, sizeof(msg),
			"shardd: open group: name is not NUL-terminated within %d bytes",
			SHARDD_NAME_MAX);
		eng_reply_err(j, rank, token, seq, -SHARDD_E_INVALID, msg);
		return;
	}
	eg = eng_group_by_name(j, req.name);
	if (eg && eg->complete && eg->g->exec == SHARDD_EXEC_RANKS && minor < 5) {
		eng_fmt(msg, sizeof(msg),
			"shardd: group '%s' is rank-executed (%s): this client (protocol minor %u) "
			"cannot run its ops; upgrade it to minor 5 or later",
			req.name, eg->g->exec_why, minor);
		eng_reply_err(j, rank, token, seq, -SHARDD_E_VERSION, msg);
		return;
	}
	if (eg && eg->complete &&
	    (eg->exec_renewing[rank] ||
	     (eg->g->exec_sealed[rank] && eg->exec_sealer[rank] != token))) {
		/*
		 * Rank-executed, attached again: its sealed buffers are renewed
		 * first, and the reply waits for them (exec.c). The same client
		 * opening it again gets them sealed (group.c), a read-only handle.
		 */
		if (eg->exec_open[rank].token) {
			eng_fmt(msg, sizeof(msg),
				"shardd: rank %u already waits to open group '%s'", rank, req.name);
			eng_reply_err(j, rank, token, seq, -SHARDD_E_STATE, msg);
			return;
		}
		if (!eg->exec_renewing[rank] && eng_exec_renew(eg, rank, open_renewed)) {
			eng_fmt(msg, sizeof(msg), "shardd: open group '%s': out of memory",
				req.name);
			eng_reply_err(j, rank, token, seq, -SHARDD_E_NOMEM, msg);
			return;
		}
		eg->exec_open[rank] = (struct eng_reg){ .token = token, .seq = seq };
		return;
	}
	if (eg && eg->complete) {
		reply_group(eg, rank, token, seq);
		return;
	}
	if (eg) {
		shd_rdv_who_missing(&eg->reg, who, sizeof(who));
		eng_fmt(msg, sizeof(msg),
			"shardd: group '%s' of job '%s' is still being registered: %s have not registered it",
			req.name, j->name, who);
		eng_reply_err(j, rank, token, seq, -SHARDD_E_NOGROUP, msg);
		return;
	}
	off = (size_t)snprintf(msg, sizeof(msg),
			       "shardd: no group '%s' in job '%s'; registered groups:", req.name,
			       j->name);
	for (uint32_t i = 0, n = 0; i < j->ngroups && off < sizeof(msg); i++) {
		if (j->groups[i] && j->groups[i]->complete)
			off += (size_t)snprintf(msg + off, sizeof(msg) - off, "%s '%s'",
						n++ ? "," : "", j->groups[i]->g->name);
	}
	if (off < sizeof(msg) && msg[off - 1] == ':')
		snprintf(msg + off, sizeof(msg) - off, " none");
	eng_reply_err(j, rank, token, seq, -SHARDD_E_NOGROUP, msg);
}

void eng_reg_rank_gone(struct eng_group *eg, uint32_t rank, uint64_t token)
{
	char msg[ENGINE_MSG_MAX], who[ENGINE_WHO_MAX];

	if (shd_rdv_has_arrived(&eg->reg, rank) && eg->regs[rank].token != token)
		return;
	if (eg->restoring) {
		/* The restore reads into the buffers: the registration fails when it ends. */
		if (!eg->restore_fail) {
			eg->restore_fail = -SHARDD_E_PEER_DIED;
			eng_fmt(eg->restore_msg, sizeof(eg->restore_msg),
				"shardd: rank %u left (its client is "
				"gone) while group '%s' was restored from its checkpoint; the registration failed",
				eng_rank_shown(eg->j, rank), eg->g->name);
		}
		return;
	}
	shd_rdv_who_present_but(&eg->reg, rank, who, sizeof(who));
	eng_fmt(msg, sizeof(msg),
		"shardd: rank %u left (its client is gone) before group '%s' was registered by every rank; failed for %s",
		eng_rank_shown(eg->j, rank), eg->g->name, who);
	reg_fail(eg, -SHARDD_E_PEER_DIED, msg, rank);
}

void eng_reg_cron(struct eng_group *eg, uint64_t now_ns)
{
	char did[192], msg[ENGINE_MSG_MAX];

	if (eg->restoring || !shd_rdv_expired(&eg->reg, now_ns))
		return;
	eng_fmt(did, sizeof(did), "never registered group '%s'", eg->g->name);
	eng_expired_msg(eg->j->e, &eg->reg, did, msg, sizeof(msg));
	reg_fail(eg, -SHARDD_E_TIMEOUT, msg, UINT32_MAX);
}
