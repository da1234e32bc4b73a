/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend's ops across devices (backend_cuda_int.h): unshard and
 * reduce of members on pairwise distinct GPUs (placement.h), with NCCL
 * (backend_cuda_nccl.c) through a second stream per device.
 *
 * The device's NCCL stream waits for an event recorded on its stream after
 * the op's inputs (copy-in kernels, or the client's fence), NCCL runs
 * there, and the device's stream waits for an event recorded after the
 * collective before the copy-out kernels. So the device's stream orders
 * everything as before (sync, fences), and no kernel of another op ever
 * enters a stream NCCL is still queueing into (non-blocking communicators
 * forbid that). An NCCL op is queued whole (copy-in, collective, copy-out,
 * on every device) under one daemon-wide lock (cuda_nccl_lock): NCCL
 * collectives reach every device's streams in one order, so two of them
 * can never wait for each other across devices. Its staging buffer is per
 * device (S flat shards for an all-gather, S shards in the reduce dtype
 * for a reduce-scatter), grown to the largest op and used under that lock
 * only.
 */
#include <errno.h>
#include <stdio.h>

#include "backend_cuda_int.h"
#include "placement.h"

/* The members of one NCCL op: their devices, NCCL streams and staging buffers. */
struct cuda_nccl_op {
	struct shd_nccl_clique *clique;
	const int32_t *devices; /* [n]: member k's device, NCCL rank k */
	uint32_t n;
	struct cuda_device *d[SHARDD_MAX_WORLD];
	uint8_t *staging[SHARDD_MAX_WORLD]; /* NULL without staging */
	void *streams[SHARDD_MAX_WORLD];    /* NCCL streams */
};

/* ------------------------------------------------------------------ */
/* An NCCL op: everything under nccl_lock                              */
/* ------------------------------------------------------------------ */

/* `device`'s staging buffer, grown to at least `bytes`. */
static int cuda_staging(struct cuda_backend *cb, int device, struct cuda_device *d, uint64_t bytes,
			uint8_t **out)
{
	char what[96];
	int ret;

	if (d->staging.bytes < bytes) {
		/* Waits for the work queued on the device, the last op's use of the old buffer with it. */
		cuda_free(&cb->base, &d->staging);
		snprintf(what, sizeof(what), "the NCCL staging buffer of device %d", device);
		ret = cuda_alloc(&cb->base, bytes, device, what, &d->staging);
		if (ret)
			return ret;
	}
	*out = dptr(&d->staging, 0);
	return 0;
}

/*
 * Start an NCCL op of `job` over members on `devices` (pairwise distinct):
 * each device ready for NCCL with a staging buffer of `staging` bytes (0:
 * none), and the job's clique over the devices. 0, or an error with `err`.
 */
static int nccl_op_begin(struct cuda_backend *cb, struct shd_backend_job *job,
			 const int32_t *devices, uint32_t n, uint64_t staging,
			 struct cuda_nccl_op *op, char *err, size_t errlen)
{
	int ret;

	/* Communicators belong to a job: a call without one (tools, tests) has none to use. */
	if (!job) {
		snprintf(err, errlen,
			 "a collective across devices needs the job its communicators belong to");
		return -EINVAL;
	}
	op->devices = devices;
	op->n = n;
	for (uint32_t k = 0; k < n; k++) {
		op->staging[k] = NULL;
		ret = cuda_device_get(cb, devices[k], &op->d[k]);
		if (!ret)
			ret = cuda_device_nccl_setup(op->d[k]);
		if (!ret && staging)
			ret = cuda_staging(cb, devices[k], op->d[k], staging, &op->staging[k]);
		if (ret) {
			snprintf(
				err, errlen,
				"device %d cannot take part in NCCL collectives (see the daemon's log)",
				devices[k]);
			return ret;
		}
		op->streams[k] = op->d[k]->nccl_stream;
	}
	return shd_nccl_clique(cb->nccl, job, job->name, devices, n, &op->clique, err, errlen);
}

/*
 * Hand the op to NCCL (`to_nccl`: each NCCL stream waits for the work
 * queued so far on its device's stream, the op's inputs) or back (each
 * device's stream waits for its NCCL stream, the collective).
 */
static int nccl_op_handover(struct cuda_nccl_op *op, int to_nccl)
{
	cudaError_t e = cudaSuccess;

	for (uint32_t k = 0; k < op->n && e == cudaSuccess; k++) {
		struct cuda_device *d = op->d[k];
		cudaEvent_t ev = to_nccl ? d->staged : d->collected;

		/* An event is recorded on a stream of its own device. */
		e = cudaSetDevice(op->devices[k]);
		if (e == cudaSuccess)
			e = cudaEventRecord(ev, to_nccl ? d->stream : d->nccl_stream);
		if (e == cudaSuccess)
			e = cudaStreamWaitEvent(to_nccl ? d->nccl_stream : d->stream, ev, 0);
	}
	return e == cudaSuccess ? 0
				: cuda_rt_fail("order a device's stream with its NCCL stream", e);
}

/* ------------------------------------------------------------------ */
/* Unshard and reduce                                                  */
/* ------------------------------------------------------------------ */

/*
 * Unshard of a shard group whose ranks sit on distinct devices: the flat
 * shards all-gathered as bytes into each device's staging buffer, then
 * copied out into each rank's own unsharded buffer on its device.
 */
int cuda_unshard_nccl(struct cuda_backend *cb, const struct shd_unshard_args *a,
		      const int32_t *devices)
{
	const struct shd_layout *l = a->layout;
	uint32_t n = a->nshards;
	struct cuda_nccl_op op;
	void *send[SHARDD_MAX_WORLD], *recv[SHARDD_MAX_WORLD];
	uint8_t *src[SHARDD_MAX_WORLD];
	char why[512] = "", devs[128];
	int ret = 0;

	for (uint32_t k = 0; k < n && !ret; k++)
		ret = cuda_on_device(a->unsharded[k], devices[k], k, "unsharded buffer", a->err,
				     a->errlen, "unshard");
	if (ret)
		return ret;
	cuda_nccl_lock(cb);
	ret = nccl_op_begin(cb, a->job, devices, n,
			    shd_placement_staging_bytes(n, l->shard_size, 0), &op, why,
			    sizeof(why));
	if (!ret)
		ret = nccl_op_handover(&op, 1);
	for (uint32_t k = 0; k < n && !ret; k++) {
		send[k] = dptr(a->shards[k], 0);
		recv[k] = op.staging[k];
	}
	if (!ret)
		ret = shd_nccl_collective(cb->nccl, op.clique, SHD_NCCL_ALL_GATHER, send, recv,
					  l->shard_size, SHARDD_DTYPE_NONE, op.streams, why,
					  sizeof(why));
	if (!ret)
		ret = nccl_op_handover(&op, 0);
	/* Each device copies out of its own staging buffer, where shard s sits at s x shard_size. */
	for (uint32_t k = 0; k < n && !ret; k++) {
		for (uint32_t s = 0; s < n; s++)
			src[s] = op.staging[k] + s * l->shard_size;
		ret = cudaSetDevice(devices[k]) == cudaSuccess ? 0 : -SHARDD_E_BACKEND;
		if (!ret)
			ret = cuda_queued(
				cuda_copy_out(l, n, src, a->unsharded[k], op.d[k]->stream),
				"unshard");
	}
	cuda_nccl_unlock(cb);
	if (ret) {
		shd_nccl_devices_str(devices, n, devs, sizeof(devs));
		cuda_op_fail(ret, a->err, a->errlen, "unshard", "all-gather on %s: %s", devs,
			     why[0] ? why : "a CUDA call failed (see the daemon's log)");
	}
	return ret;
}

/*
 * Reduce of members on distinct devices. SRC_GRAD (a shard group's
 * reduce-scatter): copy-in into each device's staging buffer, an in-place
 * ncclReduceScatter with ncclSum in the reduce dtype (member k's block k),
 * then the post kernel into its output. SRC_SHARD (a replicate group's
 * all-reduce of HSDP partials): an in-place ncclAllReduce of each member's
 * view buffer, then the post kernel. Summation order and rounding are
 * NCCL's (in the reduce dtype), not the host's (docs/CUDA.md).
 */
int cuda_reduce_nccl(struct cuda_backend *cb, const struct shd_reduce_args *a,
		     const int32_t *devices)
{
	uint32_t rd = a->math.reduce_dtype, n = a->n, grad = a->src == SHD_REDUCE_SRC_GRAD;
	size_t rs = shardd_dtype_size(rd);
	uint64_t shard_bytes = a->reduce_shard_size;
	void *send[SHARDD_MAX_WORLD], *recv[SHARDD_MAX_WORLD];
	struct cuda_nccl_op op;
	char why[512] = "", devs[128];
	int ret = 0;

	if (!rs || !a->reduce_offsets || !shard_bytes || shard_bytes % rs ||
	    (!grad && (a->in_dtype != rd || a->math.pre > 1)))
		return cuda_op_fail(
			-EINVAL, a->err, a->errlen, "reduce",
			"NCCL reduce of %u members: reduce dtype %u, shard of %llu bytes, inputs in "
			"dtype %u with pre-divide %g: the shard must hold whole elements, and an "
			"all-reduce takes shards in the reduce dtype, divided before",
			n, rd, (unsigned long long)shard_bytes, a->in_dtype, (double)a->math.pre);
	for (uint32_t k = 0; k < n && !ret; k++) {
		ret = cuda_on_device(a->outs[k].buf, devices[k], k, "output", a->err, a->errlen,
				     "reduce");
		if (!ret && cuda_reduce_add(a, k))
			ret = cuda_on_device(a->adds[k].buf, devices[k], k, "addend", a->err,
					     a->errlen, "reduce");
		if (!ret && !grad && a->views[k].buf->bytes < shard_bytes)
			ret = cuda_op_fail(
				-EINVAL, a->err, a->errlen, "reduce",
				"member %u's view buffer holds %llu bytes, less than a shard's %llu",
				k, (unsigned long long)a->views[k].buf->bytes,
				(unsigned long long)shard_bytes);
	}
	if (ret)
		return ret;
	cuda_nccl_lock(cb);
	ret = nccl_op_begin(cb, a->job, devices, n,
			    grad ? shd_placement_staging_bytes(n, 0, shard_bytes) : 0, &op, why,
			    sizeof(why));
	for (uint32_t k = 0; k < n && !ret && grad; k++) {
		ret = cudaSetDevice(devices[k]) == cudaSuccess ? 0 : -SHARDD_E_BACKEND;
		if (!ret)
			ret = cuda_queued(
				cuda_reduce_copy_in(a, k, n, op.staging[k], op.d[k]->stream),
				"reduce");
	}
	if (!ret)
		ret = nccl_op_handover(&op, 1);
	for (uint32_t k = 0; k < n && !ret; k++) {
		/* In place: NCCL rank k's block k of its staging buffer, or the whole view buffer. */
		send[k] = grad ? (void *)op.staging[k] : dptr(a->views[k].buf, 0);
		recv[k] = grad ? (void *)(op.staging[k] + k * shard_bytes) : send[k];
	}
	if (!ret)
		ret = shd_nccl_collective(
			cb->nccl, op.clique, grad ? SHD_NCCL_REDUCE_SCATTER : SHD_NCCL_ALL_REDUCE,
			send, recv, shard_bytes / rs, rd, op.streams, why, sizeof(why));
	if (!ret)
		ret = nccl_op_handover(&op, 0);
	for (uint32_t k = 0; k < n && !ret; k++) {
		ret = cudaSetDevice(devices[k]) == cudaSuccess ? 0 : -SHARDD_E_BACKEND;
		if (!ret)
			ret = cuda_queued(grad ? cuda_reduce_post(a, k, recv[k], a->reduce_offsets,
								  k, op.d[k]->stream)
					       : cuda_reduce_post(a, k, recv[k],
								  a->views[k].offsets,
								  a->shard_rank, op.d[k]->stream),
					  "reduce");
	}
	cuda_nccl_unlock(cb);
	if (ret) {
		shd_nccl_devices_str(devices, n, devs, sizeof(devs));
		cuda_op_fail(ret, a->err, a->errlen, "reduce", "%s on %s: %s",
			     grad ? "reduce-scatter" : "all-reduce", devs,
			     why[0] ? why : "a CUDA call failed (see the daemon's log)");
	}
	return ret;
}

/* Each staging buffer's free waits on its device, which may ask the communicators. */
void cuda_nccl_staging_free(struct cuda_backend *cb)
{
	for (int i = 0; i < cb->ndevices; i++)
		cuda_free(&cb->base, &cb->devices[i].staging);
}
