/* SPDX-License-Identifier: MIT */
/*
 * Stream ordering under the cuda backend (shardd_stream_set): the client's
 * half of the fences of shardd_proto.h.
 *
 * Event slots are ring slots, so the ring's own flow control makes reuse
 * safe: our event of SQ slot i is recorded again only after the daemon
 * released the slot, which it does after queueing its wait on the event;
 * the daemon records its event of CQ slot i again only after we released
 * the slot, which we do after queueing our stream's wait on it.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_import.h"
#include "internal.h"

/* The daemon opens one event per SQ slot and makes one per CQ slot before it answers. */
#define SHARDD_STREAM_TIMEOUT_MS 30000

/* Set up the events both ways: ours for the SQ, the daemon's for the CQ. */
static int stream_fences_setup(struct shardd_client *c)
{
	uint32_t nsq = c->ring.sq_mask + 1, ncq = c->ring.cq_mask + 1;
	size_t hsz = sizeof(struct shardd_cuda_ipc_handle);
	size_t len = sizeof(struct shardd_stream_req) + nsq * hsz;
	struct shardd_ctrl_rx rx = { 0 };
	struct shardd_stream_reply rep;
	struct shardd_stream_req *req;
	struct shardd_cuda_fences *f = NULL;
	int ret;

	req = calloc(1, len);
	if (!req)
		return shardd_err_set(-ENOMEM, "out of memory for %u event handles", nsq);
	req->nevents = nsq;
	ret = shardd_cuda_fences_create(c->device, nsq, (struct shardd_cuda_ipc_handle *)(req + 1),
					&f);
	if (ret == 0)
		ret = shardd_client_request(c, SHARDD_MSG_STREAM, req, (uint32_t)len,
					    SHARDD_STREAM_TIMEOUT_MS, SHARDD_MSG_STREAM_REPLY, &rx);
	free(req);
	if (ret < 0)
		goto err;
	if (rx.hdr.length < sizeof(rep)) {
		ret = shardd_err_set(-EPROTO, "STREAM_REPLY of %u bytes is shorter than its header",
				     rx.hdr.length);
		goto err;
	}
	memcpy(&rep, rx.payload, sizeof(rep));
	if (rep.nevents != ncq || rx.hdr.length != sizeof(rep) + ncq * hsz) {
		ret = shardd_err_set(-EPROTO,
				     "STREAM_REPLY carries %u events in %u bytes; the CQ "
				     "has %u slots",
				     rep.nevents, rx.hdr.length, ncq);
		goto err;
	}
	ret = shardd_cuda_fences_open(
		f, ncq, (const struct shardd_cuda_ipc_handle *)(rx.payload + sizeof(rep)));
	if (ret < 0)
		goto err;
	shardd_ctrl_rx_reset(&rx);
	c->fences = f;
	return 0;

err:
	shardd_ctrl_rx_reset(&rx);
	shardd_cuda_fences_free(f);
	return ret;
}

int shardd_stream_set(struct shardd_client *c, void *stream)
{
	int ret;

	shardd_err_clear();
	if (c->welcome.backend != SHARDD_BACKEND_CUDA)
		return shardd_err_set(-ENOTSUP,
				      "set a stream: the daemon runs the %s backend, whose "
				      "completions already mean the results are in memory",
				      c->welcome.backend == SHARDD_BACKEND_HOST ? "host"
										: "unknown");
	if (!c->fences) {
		ret = stream_fences_setup(c);
		if (ret < 0)
			return shardd_err_wrap(ret, "set a stream on device %d", c->device);
	}
	c->stream = stream;
	c->stream_set = 1;
	return 0;
}

void shardd_stream_clear(struct shardd_client *c)
{
	c->stream_set = 0;
	c->stream = NULL;
}

int shardd_client_fence_submit(struct shardd_client *c, uint32_t slot, struct shardd_sqe *sqe)
{
	int ret;

	if (!c->stream_set)
		return 0;
	ret = shardd_cuda_fence_record(c->fences, slot, c->stream);
	if (ret < 0)
		return ret;
	sqe->fence = SHARDD_FENCE_WAIT | SHARDD_FENCE_SIGNAL;
	return 0;
}

void shardd_client_fence_reap(struct shardd_client *c, uint32_t slot, struct shardd_completion *cp)
{
	int ret;

	if (!c->fences) {
		ret = shardd_err_set(-EPROTO, "the daemon fenced a completion of this client, "
					      "which set up no stream");
	} else {
		/* A stream cleared since the submission: the CPU waits, as for an unfenced op. */
		ret = shardd_cuda_fence_wait(c->fences, slot, c->stream_set, c->stream);
	}
	if (ret < 0 && cp->res >= 0) {
		cp->res = ret;
		snprintf(cp->msg, sizeof(cp->msg),
			 "the op completed but its results cannot be "
			 "ordered: %s",
			 shardd_last_error());
	}
}
