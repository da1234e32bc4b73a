/* SPDX-License-Identifier: MIT */
/* The launcher of train_mlp: command line and --spawn supervisor (launch.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "launch.h"
#include "shardd.h"

static void usage(FILE *f)
{
	fprintf(f,
		"usage: train_mlp --spawn N [--replicate R] [--steps K] [--socket PATH] [--job NAME]\n"
		"                 [--dump FILE] [--device N] [--checkpoint-every N] [--resume]\n"
		"       train_mlp --rank R --world N [--replicate R] [--steps K] [--socket PATH] [--job NAME]\n"
		"                 [--dump FILE] [--device N] [--resume-step T [--attempt A]] [--trainer-sgd]\n"
		"                 [--checkpoint-every N] [--resume]\n"
		"       train_mlp --reference --world N [--steps K] [--dump FILE]\n"
		"\n"
		"Trains a 32-64-64-1 tanh MLP on a fixed random teacher, FSDP2-style, through\n"
		"a running shardd daemon: one parameter group per layer, unshard with prefetch,\n"
		"reshard after forward, reduce after each layer's backward, the daemon's SGD on\n"
		"each rank's own shard (shardd_step). Prints 'step N loss X time_us T compute_us C\n"
		"shardd_us S' per step: the loss, the step's wall time, and its split into compute\n"
		"and time spent in shardd_submit/shardd_wait (each the mean over the ranks).\n"
		"\n"
		"  --spawn N         fork N rank processes and supervise them\n"
		"  --rank R          run rank R of --world N (prints 'rank R step N loss X ...')\n"
		"  --replicate R     HSDP: R replicas of N / R shards, reduces all-reduced over\n"
		"                    every rank (default 1: FSDP over the N ranks)\n"
		"  --reference       train the same model in this process, no daemon, on the\n"
		"                    union of the N ranks' batches\n"
		"  --steps K         training steps (default %d)\n"
		"  --socket PATH     daemon socket (default: $SHARDD_SOCKET, else the default path)\n"
		"  --job NAME        job name (default '%s')\n"
		"  --device N        attach on CUDA device N: needed when the daemon runs\n"
		"                    --backend cuda (the buffers are then device memory)\n"
		"  --dump FILE       write the final params as raw little-endian fp32: per layer\n"
		"                    fc0, fc1, fc2 the weight (out x in, row-major) then the bias;\n"
		"                    with --rank, rank 0 writes it\n"
		"  --resume-step T   re-attach to a running job (groups opened, not registered)\n"
		"                    and join the retry of step T (T = K: the final unshard),\n"
		"                    as the other ranks print when they wait for this one\n"
		"  --attempt A       with --resume-step: the attempt number of the retry (default 1)\n"
		"  --trainer-sgd     run SGD in the trainer on the flat shard instead of the\n"
		"                    daemon's step op\n"
		"  --checkpoint-every N\n"
		"                    after each step whose number (counted from 1) is a multiple\n"
		"                    of N, every rank asks the daemon for a checkpoint of the job\n"
		"                    and waits until it is written to <--state-dir>/<job>/step-<n>\n"
		"                    (the daemon needs --state-dir; docs/CHECKPOINTS.md)\n"
		"  --resume          register from the job's newest checkpoint in the daemon's\n"
		"                    --state-dir and train from its step to --steps (prints\n"
		"                    'resume at step N'); with none, start afresh at step 0\n"
		"  --version         print the version and exit\n",
		MLP_DEFAULT_STEPS, MLP_DEFAULT_JOB);
}

static int parse_u64(const char *s, const char *what, uint64_t max, uint64_t *out)
{
	char *end;
	unsigned long long v;

	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || end == s || *end || s[0] == '-' || v > max) {
		fprintf(stderr, "train_mlp: %s '%s' is not an integer in 0..%" PRIu64 "\n", what, s,
			max);
		return -EINVAL;
	}
	*out = v;
	return 0;
}

int launch_opts_parse(int argc, char **argv, struct launch_opts *lo)
{
	static const struct option longopts[] = {
		{ "spawn", required_argument, NULL, 's' },
		{ "rank", required_argument, NULL, 'r' },
		{ "world", required_argument, NULL, 'w' },
		{ "replicate", required_argument, NULL, 'P' },
		{ "steps", required_argument, NULL, 'k' },
		{ "socket", required_argument, NULL, 'S' },
		{ "job", required_argument, NULL, 'j' },
		{ "dump", required_argument, NULL, 'd' },
		{ "reference", no_argument, NULL, 'R' },
		{ "resume-step", required_argument, NULL, 'U' },
		{ "attempt", required_argument, NULL, 'A' },
		{ "device", required_argument, NULL, 'D' },
		{ "trainer-sgd", no_argument, NULL, 'T' },
		{ "checkpoint-every", required_argument, NULL, 'C' },
		{ "resume", no_argument, NULL, 'e' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 },
	};
	uint64_t v;
	struct trainer_opts *o = &lo->t;
	int c;

	memset(lo, 0, sizeof(*lo));
	lo->rank = -1;
	o->steps = MLP_DEFAULT_STEPS;
	o->job = MLP_DEFAULT_JOB;
	o->resume_step = -1;
	o->attempt = 1;
	o->replicate = 1;
	o->device = SHARDD_HELLO_DEVICE_HOST;
	while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
		switch (c) {
		case 's':
			if (parse_u64(optarg, "--spawn", SHARDD_MAX_WORLD, &v) || v == 0)
				goto bad;
			lo->spawn = (uint32_t)v;
			break;
		case 'r':
			if (parse_u64(optarg, "--rank", SHARDD_MAX_WORLD - 1, &v))
				goto bad;
			lo->rank = (int64_t)v;
			break;
		case 'w':
			if (parse_u64(optarg, "--world", SHARDD_MAX_WORLD, &v) || v == 0)
				goto bad;
			o->world = (uint32_t)v;
			break;
		case 'P':
			if (parse_u64(optarg, "--replicate", SHARDD_MAX_WORLD, &v) || v == 0)
				goto bad;
			o->replicate = (uint32_t)v;
			break;
		case 'k':
			if (parse_u64(optarg, "--steps", 1u << 24, &v))
				goto bad;
			o->steps = v;
			break;
		case 'S':
			o->socket = optarg;
			break;
		case 'j':
			o->job = optarg;
			break;
		case 'd':
			o->dump = optarg;
			break;
		case 'R':
			lo->reference = 1;
			break;
		case 'T':
			o->trainer_sgd = 1;
			break;
		case 'e':
			o->resume = 1;
			break;
		case 'C':
			if (parse_u64(optarg, "--checkpoint-every", 1u << 24, &v) || v == 0)
				goto bad;
			o->checkpoint_every = v;
			break;
		case 'U':
			if (parse_u64(optarg, "--resume-step", 1u << 24, &v))
				goto bad;
			o->resume_step = (int64_t)v;
			break;
		case 'D':
			if (parse_u64(optarg, "--device", 1023, &v))
				goto bad;
			o->device = (int32_t)v;
			break;
		case 'A':
			if (parse_u64(optarg, "--attempt", MLP_MAX_ATTEMPTS - 1, &v) || v == 0)
				goto bad;
			o->attempt = (uint32_t)v;
			break;
		case 'h':
			usage(stdout);
			exit(0);
		case 'V':
			printf("train_mlp (shardd %s, protocol %d.%d)\n", SHARDD_VERSION,
			       SHARDD_PROTO_MAJOR, SHARDD_PROTO_MINOR);
			exit(0);
		default:
			goto bad;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "train_mlp: unexpected argument '%s'\n", argv[optind]);
		goto bad;
	}
	if (!!lo->spawn + !!lo->reference + (lo->rank >= 0) != 1) {
		fprintf(stderr,
			"train_mlp: give exactly one of --spawn N, --rank R --world N, --reference --world N\n");
		goto bad;
	}
	if (lo->spawn)
		o->world = lo->spawn;
	if (!o->world) {
		fprintf(stderr, "train_mlp: --world N is required with --rank and --reference\n");
		goto bad;
	}
	if (lo->rank >= (int64_t)o->world) {
		fprintf(stderr, "train_mlp: --rank %" PRId64 " is not below --world %u\n", lo->rank,
			o->world);
		goto bad;
	}
	if (o->world % o->replicate) {
		fprintf(stderr, "train_mlp: --replicate %u does not divide the world of %u ranks\n",
			o->replicate, o->world);
		goto bad;
	}
	if (o->trainer_sgd && (o->checkpoint_every || o->resume)) {
		fprintf(stderr,
			"train_mlp: --checkpoint-every and --resume need the daemon's SGD (a checkpoint"
			" records the step it applied last): drop --trainer-sgd\n");
		goto bad;
	}
	if (lo->reference && (o->checkpoint_every || o->resume)) {
		fprintf(stderr,
			"train_mlp: --reference runs without a daemon: it takes no --checkpoint-every"
			" nor --resume\n");
		goto bad;
	}
	if (o->resume_step > (int64_t)o->steps) {
		fprintf(stderr,
			"train_mlp: --resume-step %" PRId64 " is above --steps %" PRIu64 "\n",
			o->resume_step, o->steps);
		goto bad;
	}
	return 0;
bad:
	fprintf(stderr, "train_mlp: see --help\n");
	return -EINVAL;
}

/* ------------------------------------------------------------------ */
/* Supervisor: --spawn N                                               */
/* ------------------------------------------------------------------ */

#define MLP_RESTART_WAIT_MS \
	330000 /* the others' retry reports: past the default collective timeout */

struct child {
	pid_t pid; /* 0: not running */
	int pidfd;
	int pending;   /* died, to be restarted once every other rank reported its retry */
	int restarted; /* restarted at least once: its reports of the steps before may be lost */
	uint64_t pending_ns; /* CLOCK_MONOTONIC when it died */
	int owed;      /* retry reports still expected from it (a rank died); below 0: early */
	int has_retry; /* retry_step and retry_attempt hold its latest retry report */
	uint64_t retry_step;
	uint32_t retry_attempt;
	struct trainer_opts ro; /* pending: the options it restarts with */
};

/* The supervisor's state. */
struct sup {
	const struct trainer_opts *o;
	const struct launch_hooks *hooks;
	struct child *ch;
	struct loss_report *reps; /* [step * world + rank] */
	uint8_t *seen;  /* the same: 0 none yet, 1 reported, 2 lost with a rank that died */
	uint32_t *have; /* per step: reports seen or lost */
	uint64_t next;  /* the first step not printed */
	uint64_t start; /* the step the ranks train from (their MLP_REPORT_START) */
	int started;    /* a rank sent its MLP_REPORT_START */
	int report_rd, report_wr;
	uint32_t live; /* children running */
	int failed;
};

static uint64_t mono_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Fork rank `rank`: it trains and reports losses on report_wr. */
static pid_t spawn_rank(const struct trainer_opts *o, uint32_t rank, int report_rd, int report_wr,
			const struct rank_hooks *hooks)
{
	pid_t pid;

	fflush(NULL);
	pid = fork();
	if (pid < 0) {
		fprintf(stderr, "train_mlp: fork of rank %u failed: %s\n", rank, strerror(errno));
		return -errno;
	}
	if (pid == 0) {
		int ret;

		close(report_rd);
		ret = rank_main(o, rank, report_wr, hooks);
		fflush(NULL);
		_exit(ret < 0 ? 1 : 0);
	}
	return pid;
}

/* Fail the run: every rank still running is asked to end. */
static void sup_fail(struct sup *s)
{
	if (!s->failed)
		for (uint32_t r = 0; r < s->o->world; r++)
			if (s->ch[r].pid > 0)
				kill(s->ch[r].pid, SIGTERM);
	s->failed = 1;
}

/* Start rank r with options o; 0 or -1 (printed, the run failed). */
static int sup_spawn(struct sup *s, uint32_t r, const struct trainer_opts *o)
{
	struct child *c = &s->ch[r];

	c->pid = spawn_rank(o, r, s->report_rd, s->report_wr, s->hooks ? s->hooks->rank : NULL);
	if (c->pid > 0)
		c->pidfd = pidfd_open(c->pid, 0);
	if (c->pid > 0 && c->pidfd >= 0) {
		s->live++;
		return 0;
	}
	if (c->pid > 0) {
		fprintf(stderr, "train_mlp: pidfd_open(rank %u): %s\n", r, strerror(errno));
		kill(c->pid, SIGKILL);
		waitpid(c->pid, NULL, 0);
	}
	c->pid = 0;
	sup_fail(s);
	return -1;
}

static void sup_print_ready(struct sup *s);

/*
 * Take reports; print each step's mean loss once every rank reported it
 * (or died after it: its loss is lost), with the mean over ranks of the
 * step's time and of its split into compute and time in shardd calls.
 * Retry reports go to the ranks' children. 1 at EOF, 0, or a negative error.
 */
static int take_reports(struct sup *s)
{
	const struct trainer_opts *o = s->o;
	struct loss_report rep;
	ssize_t n;

	while ((n = read(s->report_rd, &rep, sizeof(rep))) == (ssize_t)sizeof(rep)) {
		if (rep.rank < o->world && rep.step <= o->steps &&
		    rep.attempt == MLP_REPORT_START) {
			if (!s->started) {
				s->started = 1;
				s->start = rep.step;
				if (s->next < rep.step)
					s->next = rep.step;
				if (o->resume && rep.step)
					printf("resume at step %" PRIu64 " of %" PRIu64 "\n",
					       rep.step, o->steps);
				else if (o->resume)
					printf("start at step 0 of %" PRIu64
					       " (no checkpoint to resume from)\n",
					       o->steps);
				fflush(stdout);
			} else if (rep.step != s->start) {
				fprintf(stderr,
					"train_mlp: rank %u trains from step %" PRIu64
					", another rank"
					" from step %" PRIu64 ": their checkpoints differ\n",
					rep.rank, rep.step, s->start);
				return -EPROTO;
			}
			continue;
		}
		if (rep.rank >= o->world || rep.step > o->steps ||
		    (rep.step == o->steps && !rep.attempt) ||
		    (!rep.attempt && rep.step < s->start) ||
		    (!rep.attempt && s->seen[rep.step * o->world + rep.rank])) {
			fprintf(stderr,
				"train_mlp: bad report (rank %u, step %" PRIu64 ", attempt %u)\n",
				rep.rank, rep.step, rep.attempt);
			return -EPROTO;
		}
		if (rep.attempt) {
			struct child *c = &s->ch[rep.rank];

			c->owed--;
			c->has_retry = 1;
			c->retry_step = rep.step;
			c->retry_attempt = rep.attempt;
			continue;
		}
		s->reps[rep.step * o->world + rep.rank] = rep;
		s->seen[rep.step * o->world + rep.rank] = 1;
		s->have[rep.step]++;
	}
	if (n < 0 && errno != EAGAIN) {
		fprintf(stderr, "train_mlp: reading loss reports: %s\n", strerror(errno));
		return -errno;
	}
	sup_print_ready(s);
	return n == 0 ? 1 : 0;
}

/* Print the steps every rank reported (or lost) that are not printed yet, in order. */
static void sup_print_ready(struct sup *s)
{
	const struct trainer_opts *o = s->o;

	while (s->next < o->steps && s->have[s->next] == o->world) {
		double sum = 0.0, step_ns = 0.0, shardd_ns = 0.0;
		uint32_t k = 0;

		for (uint32_t r = 0; r < o->world; r++) {
			const struct loss_report *p = &s->reps[s->next * o->world + r];

			if (s->seen[s->next * o->world + r] != 1)
				continue;
			sum += p->loss;
			step_ns += (double)p->step_ns;
			shardd_ns += (double)p->shardd_ns;
			k++;
		}
		if (k)
			printf("step %" PRIu64
			       " loss %.6f time_us %.1f compute_us %.1f shardd_us %.1f\n",
			       s->next, sum / k, step_ns / k / 1e3, (step_ns - shardd_ns) / k / 1e3,
			       shardd_ns / k / 1e3);
		fflush(stdout);
		s->next++;
	}
}

/* Rank r's missing loss reports of steps below t: lost with a predecessor that died. */
static void sup_mark_lost(struct sup *s, uint32_t r, uint64_t t)
{
	for (uint64_t k = s->start; k < t && k < s->o->steps; k++) {
		if (s->seen[k * s->o->world + r])
			continue;
		fprintf(stderr, "train_mlp: rank %u's loss of step %" PRIu64 " was lost with it\n",
			r, k);
		s->seen[k * s->o->world + r] = 2;
		s->have[k]++;
	}
}

/*
 * Restart the pending rank r once every other running rank reported the
 * retry its death caused: all of them wait at the barrier of the same
 * (step, attempt), which r joins (trainer.h, rank_rejoin). With no other
 * rank running, r resumes from its own shards (MLP_RESUME_OWN). 0, or -1
 * when the run failed.
 */
static int sup_try_restart(struct sup *s, uint32_t r)
{
	struct child *c = &s->ch[r];
	const struct child *first = NULL;
	for (uint32_t q = 0; q < s->o->world; q++) {
		const struct child *cq = &s->ch[q];

		if (q == r || cq->pid <= 0 || cq->pending)
			continue;
		if (cq->owed > 0 || !cq->has_retry) {
			if (mono_ns() - c->pending_ns < (uint64_t)MLP_RESTART_WAIT_MS * 1000000)
				return 0;
			fprintf(stderr,
				"train_mlp: rank %u died and rank %u has not reported the retry of its step"
				" within %d s; giving up\n",
				r, q, MLP_RESTART_WAIT_MS / 1000);
			sup_fail(s);
			return -1;
		}
		if (first && (first->retry_step != cq->retry_step ||
			      first->retry_attempt != cq->retry_attempt)) {
			fprintf(stderr,
				"train_mlp: rank %u died; the others retry different steps (rank %u: step %" PRIu64
				" attempt %u, rank %u: step %" PRIu64
				" attempt %u): cannot restart it\n",
				r, (uint32_t)(first - s->ch), first->retry_step,
				first->retry_attempt, q, cq->retry_step, cq->retry_attempt);
			sup_fail(s);
			return -1;
		}
		first = cq;
	}
	c->ro.resume_step = first ? (int64_t)first->retry_step : MLP_RESUME_OWN;
	c->ro.attempt = first ? first->retry_attempt : 1;
	if (first)
		fprintf(stderr,
			"train_mlp: restarting rank %u into attempt %u of step %" PRIu64 "\n", r,
			c->ro.attempt, first->retry_step);
	else
		fprintf(stderr, "train_mlp: restarting rank %u after its last step in the daemon\n",
			r);
	/* Steps it completed but died before reporting: their losses went with it (alone: at the end). */
	if (first)
		sup_mark_lost(s, r, first->retry_step);
	c->restarted = 1;
	c->pending = 0;
	c->owed = 0;
	c->has_retry = 0;
	return sup_spawn(s, r, &c->ro);
}

/* Rank r ended with wait status st. */
static void sup_reap(struct sup *s, uint32_t r, int st)
{
	struct child *c = &s->ch[r];

	close(c->pidfd);
	c->pidfd = -1;
	c->pid = 0;
	s->live--;
	if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
		return;
	c->ro = *s->o;
	if (!s->failed && s->hooks && s->hooks->restart &&
	    s->hooks->restart(s->hooks->arg, r, st, &c->ro)) {
		c->pending = 1;
		c->pending_ns = mono_ns();
		/* Each rank still running fails its step once and reports the retry. */
		for (uint32_t q = 0; q < s->o->world; q++)
			if (q != r && s->ch[q].pid > 0 && !s->ch[q].pending)
				s->ch[q].owed++;
		return;
	}
	if (WIFSIGNALED(st))
		fprintf(stderr, "train_mlp: rank %u killed by signal %d\n", r, WTERMSIG(st));
	else
		fprintf(stderr, "train_mlp: rank %u exited with status %d\n", r, WEXITSTATUS(st));
	sup_fail(s);
}

int launch_spawn(const struct trainer_opts *o, const struct launch_hooks *hooks)
{
	uint32_t n = o->world;
	size_t cells = (size_t)(o->steps ? o->steps : 1) * n;
	struct sup s = {
		.o = o,
		.hooks = hooks,
		.report_rd = -1,
		.report_wr = -1,
		.ch = calloc(n, sizeof(*s.ch)),
		.reps = calloc(cells, sizeof(*s.reps)),
		.seen = calloc(cells, 1),
		.have = calloc(o->steps ? o->steps : 1, sizeof(*s.have)),
	};
	struct pollfd *pfd = calloc(n + 1, sizeof(*pfd));
	int pipefd[2];

	if (!s.ch || !s.reps || !s.seen || !s.have || !pfd) {
		fprintf(stderr, "train_mlp: out of memory\n");
		s.failed = 1;
		goto out;
	}
	/* Non-blocking read end: take_reports reads what is there, poll says when. */
	if (pipe2(pipefd, O_CLOEXEC) < 0 || fcntl(pipefd[0], F_SETFL, O_NONBLOCK) < 0) {
		fprintf(stderr, "train_mlp: pipe: %s\n", strerror(errno));
		s.failed = 1;
		goto out;
	}
	s.report_rd = pipefd[0];
	s.report_wr = pipefd[1];
	for (uint32_t r = 0; r < n; r++)
		s.ch[r].pidfd = -1;
	for (uint32_t r = 0; r < n && !s.failed; r++)
		sup_spawn(&s, r, o);
	/*
	 * Children's liveness is watched through pidfds (pfd[r + 1]; -1, which
	 * poll skips, once rank r is gone), reports through the pipe. A rank
	 * waiting to be restarted keeps the loop going.
	 */
	for (;;) {
		uint32_t pending = 0;

		for (uint32_t r = 0; r < n; r++)
			pending += s.ch[r].pending;
		if (s.live == 0 && (!pending || s.failed))
			break;
		pfd[0] = (struct pollfd){ .fd = s.report_rd, .events = POLLIN };
		for (uint32_t r = 0; r < n; r++)
			pfd[r + 1] = (struct pollfd){ .fd = s.ch[r].pid > 0 ? s.ch[r].pidfd : -1,
						      .events = POLLIN };
		if (poll(pfd, n + 1, pending ? 1000 : -1) < 0) {
			if (errno == EINTR)
				continue;
			fprintf(stderr, "train_mlp: poll: %s\n", strerror(errno));
			sup_fail(&s);
			break;
		}
		if ((pfd[0].revents & POLLIN) && take_reports(&s) < 0)
			sup_fail(&s);
		for (uint32_t r = 0; r < n; r++) {
			int st;

			if (s.ch[r].pid <= 0 || !pfd[r + 1].revents)
				continue;
			if (waitpid(s.ch[r].pid, &st, 0) < 0) {
				fprintf(stderr, "train_mlp: waitpid(rank %u): %s\n", r,
					strerror(errno));
				st = 0xff00;
			}
			sup_reap(&s, r, st);
		}
		for (uint32_t r = 0; r < n; r++)
			if (s.ch[r].pending && !s.failed)
				sup_try_restart(&s, r);
	}
	/* Every writer but ours is gone: read what is left up to EOF. */
	close(s.report_wr);
	s.report_wr = -1;
	if (!s.failed && take_reports(&s) != 1)
		s.failed = 1;
	/*
	 * A rank restarted alone (MLP_RESUME_OWN) resumed where the daemon's
	 * shards said: the steps it never reported went with its predecessor.
	 */
	for (uint32_t r = 0; r < n && !s.failed; r++)
		if (s.ch[r].restarted)
			sup_mark_lost(&s, r, o->steps);
	sup_print_ready(&s);
	if (!s.failed && s.next != o->steps) {
		fprintf(stderr,
			"train_mlp: only %" PRIu64 " of %" PRIu64
			" steps were reported by every rank\n",
			s.next, o->steps);
		s.failed = 1;
	}
out:
	if (s.report_rd >= 0)
		close(s.report_rd);
	if (s.report_wr >= 0)
		close(s.report_wr);
	free(s.have);
	free(s.seen);
	free(s.reps);
	free(s.ch);
	free(pfd);
	return s.failed ? -1 : 0;
}
