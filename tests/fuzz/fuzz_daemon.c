/* SPDX-License-Identifier: MIT */
/*
 * One fuzz input (fuzz_daemon.h): the jobs set up, the program run, and the
 * checks of what is owed at its end; the libFuzzer hooks.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <linux/sockios.h>

#include <jansson.h>
#include <sanitizer/allocator_interface.h>

#include "clock.h"
#include "engine.h"
#include "group.h"
#include "job.h"
#include "log.h"
#include "loop.h"
#include "metrics.h"
#include "server.h"
#include "session.h"
#include "shardd_ctrl.h"
#include "shardd_proto.h"
#include "shardd_ring.h"

#include "fuzz_daemon.h"
#include "fuzz_harness.h"

/* ------------------------------------------------------------------ */
/* One input                                                           */
/* ------------------------------------------------------------------ */

static void setup_jobs(struct fz_in *in, int njobs)
{
	njobs = 1 + in_u8(in) % njobs;
	for (int j = 0; j < njobs; j++) {
		st.jobs[j].replicate = 1 + in_u8(in) % 2;
		st.jobs[j].shard = 1 + in_u8(in) % 3;
		for (uint32_t r = 0; r < st.jobs[j].replicate * st.jobs[j].shard; r++) {
			struct fz_client *c = attach_rank(j, r);

			if (!c || !c->attached)
				fail("setup: job %s rank %u was not welcomed", job_names[j], r);
		}
	}
}

/* End every job and session as shardd's shutdown does, then check what is owed. */
/*
 * Every session is closed: every client still connected must reach EOF
 * within a few turns, or something of the daemon (a poll, a queue) still
 * holds its socket (finding F2 of docs/RELIABILITY.md).
 */
static void check_closed(void)
{
	for (int k = 0; k < FZ_SETTLE; k++) {
		unsigned open = 0;

		turn();
		for (unsigned i = 0; i < st.nclients; i++)
			open += st.c[i].fd >= 0 && !st.c[i].eof;
		if (!open)
			return;
	}
	for (unsigned i = 0; i < st.nclients; i++)
		if (st.c[i].fd >= 0 && !st.c[i].eof)
			fail("client %u: its session is closed, but the connection never reached EOF "
			     "after %d loop turns: the daemon still holds the socket",
			     i, FZ_SETTLE);
}

static void input_end(void)
{
	int live[FZ_CLIENTS];

	settle();
	for (unsigned i = 0; i < st.nclients; i++)
		live[i] = st.c[i].fd >= 0 && !st.c[i].eof;
	/* Jobs first: collectives, barriers and registrations still waiting fail into live rings. */
	while (server.jobs)
		shd_job_destroy(server.jobs);
	turn();
	for (unsigned i = 0; i < st.nclients; i++) {
		struct fz_client *c = &st.c[i];

		if (!live[i])
			continue;
		if (!c->loose && c->npending)
			fail("client %u: %u request(s) never answered, the first seq %u type %u", i,
			     c->npending, c->pending[0].seq, c->pending[0].type);
		for (unsigned k = 0; k < st.nops; k++)
			if (st.ops[k].client == (int)i && !st.ops[k].done)
				fail("client %u: %s (group %u step %" PRIu64
				     ", user_data 0x%" PRIx64 ") never completed",
				     i,
				     shardd_op_name(st.ops[k].sqe.op)
					     ? shardd_op_name(st.ops[k].sqe.op)
					     : "?",
				     st.ops[k].sqe.group, st.ops[k].sqe.step,
				     st.ops[k].sqe.user_data);
	}
	for (struct shd_session *s = server.sessions; s; s = s->next)
		shd_session_close(s, "the fuzz input ended");
	check_closed();
	for (unsigned i = 0; i < st.nclients; i++)
		client_close(&st.c[i]);
	/* Reap the sessions, and let the loop take back the events they cancelled. */
	daemon_turn();
	daemon_turn();
	if (server.sessions || server.jobs)
		fail("sessions or jobs outlive the input's end");
}

static int fuzz_run(const struct fuzz_target *t, const uint8_t *data, size_t size)
{
	struct fz_in in = { data, size };
	int fds0, fds1;

	target_name = t->name;
	memset(&st, 0, sizeof(st));
	fds0 = fd_count();
	st.heap0 = __sanitizer_get_current_allocated_bytes();
	if (t->attach_jobs)
		setup_jobs(&in, t->attach_jobs);
	while (in.n) {
		switch (t->actions[in_u8(&in) % t->nactions]) {
		case FZ_CONNECT:
			client_connect();
			break;
		case FZ_HELLO:
			act_hello(&in);
			break;
		case FZ_MSG:
			act_msg(&in);
			break;
		case FZ_RAW:
			act_raw(&in);
			break;
		case FZ_SPLIT:
			act_split(&in);
			break;
		case FZ_REGISTER:
			act_register(&in);
			break;
		case FZ_REGISTER_ALL:
			act_register_all(&in);
			break;
		case FZ_OPEN:
			act_open(&in);
			break;
		case FZ_ADMIN:
			act_admin(&in);
			break;
		case FZ_GOODBYE:
			act_goodbye(&in);
			break;
		case FZ_CLOSE:
			act_close(&in);
			break;
		case FZ_SHUT_WR:
			act_shut_wr(&in);
			break;
		case FZ_SQE:
			act_sqe(&in);
			break;
		case FZ_SQE_BURST:
			act_sqe_burst(&in);
			break;
		case FZ_REATTACH:
			act_reattach(&in);
			break;
		case FZ_WRITE_BUF:
			act_write_buf(&in);
			break;
		case FZ_EXEC_MAP:
			act_exec_map(&in);
			break;
		case FZ_TURN:
			act_turn(&in);
			break;
		case FZ_CRON:
			act_cron(&in);
			break;
		case FZ_ACTION_COUNT:
			break;
		}
	}
	input_end();
	if (buf_bytes())
		fail("%" PRIu64 " bytes of buffers remain after every job ended", buf_bytes());
	fds1 = fd_count();
	if (fds1 != fds0) {
		fprintf(stderr, "shardd fuzz: open fds now:\n");
		fd_list();
		fail("the input leaked fds: %d open before it, %d after", fds0, fds1);
	}
	return 0;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	return fuzz_init();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	return fuzz_run(&fuzz_target, data, size);
}
