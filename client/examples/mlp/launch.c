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
#include <unistd.h>

#include "launch.h"
#include "shardd.h"

static void usage(FILE *f)
{
	fprintf(f,
"usage: train_mlp --spawn N [--steps K] [--socket PATH] [--job NAME] [--dump FILE]\n"
"                 [--device N]\n"
"       train_mlp --rank R --world N [--steps K] [--socket PATH] [--job NAME] [--dump FILE]\n"
"                 [--device N] [--resume-step T [--attempt A]] [--trainer-sgd]\n"
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
"                    and join the retry of step T\n"
"  --attempt A       with --resume-step: the attempt number of the retry (default 1)\n"
"  --trainer-sgd     run SGD in the trainer on the flat shard instead of the\n"
"                    daemon's step op (the cuda backend always does: it has no step)\n"
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
		fprintf(stderr, "train_mlp: %s '%s' is not an integer in 0..%" PRIu64 "\n", what, s, max);
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
		{ "steps", required_argument, NULL, 'k' },
		{ "socket", required_argument, NULL, 'S' },
		{ "job", required_argument, NULL, 'j' },
		{ "dump", required_argument, NULL, 'd' },
		{ "reference", no_argument, NULL, 'R' },
		{ "resume-step", required_argument, NULL, 'U' },
		{ "attempt", required_argument, NULL, 'A' },
		{ "device", required_argument, NULL, 'D' },
		{ "trainer-sgd", no_argument, NULL, 'T' },
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
		case 'k':
			if (parse_u64(optarg, "--steps", 1u << 24, &v))
				goto bad;
			o->steps = v;
			break;
		case 'S': o->socket = optarg; break;
		case 'j': o->job = optarg; break;
		case 'd': o->dump = optarg; break;
		case 'R': lo->reference = 1; break;
		case 'T': o->trainer_sgd = 1; break;
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
		fprintf(stderr, "train_mlp: give exactly one of --spawn N, --rank R --world N, --reference --world N\n");
		goto bad;
	}
	if (lo->spawn)
		o->world = lo->spawn;
	if (!o->world) {
		fprintf(stderr, "train_mlp: --world N is required with --rank and --reference\n");
		goto bad;
	}
	if (lo->rank >= (int64_t)o->world) {
		fprintf(stderr, "train_mlp: --rank %" PRId64 " is not below --world %u\n", lo->rank, o->world);
		goto bad;
	}
	if (o->resume_step >= (int64_t)o->steps) {
		fprintf(stderr, "train_mlp: --resume-step %" PRId64 " is not below --steps %" PRIu64 "\n",
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

struct child {
	pid_t pid;   /* 0: exited */
	int pidfd;
	int restarted;
};

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

static void kill_children(struct child *ch, uint32_t n)
{
	for (uint32_t r = 0; r < n; r++)
		if (ch[r].pid > 0)
			kill(ch[r].pid, SIGTERM);
}

/*
 * Take loss reports; print each step's mean loss once every rank reported
 * it, with the mean over ranks of the step's time and of its split into
 * compute and time in shardd calls.
 */
static int take_reports(int fd, const struct trainer_opts *o, struct loss_report *reps, uint32_t *have,
			uint64_t *next)
{
	struct loss_report rep;
	ssize_t n;

	while ((n = read(fd, &rep, sizeof(rep))) == (ssize_t)sizeof(rep)) {
		if (rep.rank >= o->world || rep.step >= o->steps) {
			fprintf(stderr, "train_mlp: bad loss report (rank %u, step %" PRIu64 ")\n",
				rep.rank, rep.step);
			return -EPROTO;
		}
		reps[rep.step * o->world + rep.rank] = rep;
		have[rep.step]++;
		while (*next < o->steps && have[*next] == o->world) {
			double sum = 0.0, step_ns = 0.0, shardd_ns = 0.0;

			for (uint32_t r = 0; r < o->world; r++) {
				const struct loss_report *p = &reps[*next * o->world + r];

				sum += p->loss;
				step_ns += (double)p->step_ns;
				shardd_ns += (double)p->shardd_ns;
			}
			printf("step %" PRIu64 " loss %.6f time_us %.1f compute_us %.1f shardd_us %.1f\n", *next,
			       sum / o->world, step_ns / o->world / 1e3, (step_ns - shardd_ns) / o->world / 1e3,
			       shardd_ns / o->world / 1e3);
			fflush(stdout);
			(*next)++;
		}
	}
	if (n < 0 && errno != EAGAIN) {
		fprintf(stderr, "train_mlp: reading loss reports: %s\n", strerror(errno));
		return -errno;
	}
	return n == 0 ? 1 : 0; /* 1: EOF */
}

/*
 * Whether the hooks start rank r again after it ended with wait status st:
 * asked once per rank, while the run has not failed; *ro its options.
 */
static int want_restart(const struct launch_hooks *hooks, struct child *c, uint32_t r, int st,
			int failed, const struct trainer_opts *o, struct trainer_opts *ro)
{
	if (!hooks || !hooks->restart || c->restarted || failed)
		return 0;
	c->restarted = 1;
	*ro = *o;
	return hooks->restart(hooks->arg, r, st, ro);
}

int launch_spawn(const struct trainer_opts *o, const struct launch_hooks *hooks)
{
	const struct rank_hooks *rh = hooks ? hooks->rank : NULL;
	uint32_t n = o->world, live = 0;
	struct child *ch = calloc(n, sizeof(*ch));
	struct pollfd *pfd = calloc(n + 1, sizeof(*pfd));
	struct loss_report *reps = calloc(o->steps ? o->steps * n : 1, sizeof(*reps));
	uint32_t *have = calloc(o->steps ? o->steps : 1, sizeof(*have));
	uint64_t next = 0;
	int pipefd[2] = { -1, -1 }, failed = 0, ret;

	if (!ch || !pfd || !reps || !have) {
		fprintf(stderr, "train_mlp: out of memory\n");
		failed = 1;
		goto out;
	}
	/* Non-blocking read end: take_reports reads what is there, poll says when. */
	if (pipe2(pipefd, O_CLOEXEC) < 0 || fcntl(pipefd[0], F_SETFL, O_NONBLOCK) < 0) {
		fprintf(stderr, "train_mlp: pipe: %s\n", strerror(errno));
		failed = 1;
		goto out;
	}
	for (uint32_t r = 0; r < n; r++)
		ch[r].pidfd = -1;
	for (uint32_t r = 0; r < n; r++) {
		ch[r].pid = spawn_rank(o, r, pipefd[0], pipefd[1], rh);
		if (ch[r].pid > 0)
			ch[r].pidfd = pidfd_open(ch[r].pid, 0);
		if (ch[r].pid <= 0 || ch[r].pidfd < 0) {
			if (ch[r].pid > 0)
				fprintf(stderr, "train_mlp: pidfd_open(rank %u): %s\n", r, strerror(errno));
			failed = 1;
			kill_children(ch, n);
			break;
		}
		live++;
	}
	/*
	 * Children's liveness is watched through pidfds (pfd[r + 1]; -1, which
	 * poll skips, once rank r is gone), reports through the pipe.
	 */
	while (live > 0) {
		pfd[0] = (struct pollfd){ .fd = pipefd[0], .events = POLLIN };
		for (uint32_t r = 0; r < n; r++)
			pfd[r + 1] = (struct pollfd){ .fd = ch[r].pid > 0 ? ch[r].pidfd : -1,
						      .events = POLLIN };
		if (poll(pfd, n + 1, -1) < 0) {
			if (errno == EINTR)
				continue;
			fprintf(stderr, "train_mlp: poll: %s\n", strerror(errno));
			failed = 1;
			kill_children(ch, n);
			break;
		}
		if (pfd[0].revents & POLLIN) {
			if (take_reports(pipefd[0], o, reps, have, &next) < 0) {
				failed = 1;
				kill_children(ch, n);
			}
		}
		for (uint32_t r = 0; r < n; r++) {
			struct trainer_opts ro;
			int st;

			if (ch[r].pid <= 0 || !pfd[r + 1].revents)
				continue;
			if (waitpid(ch[r].pid, &st, 0) < 0) {
				fprintf(stderr, "train_mlp: waitpid(rank %u): %s\n", r, strerror(errno));
				st = 0xff00;
			}
			close(ch[r].pidfd);
			ch[r].pidfd = -1;
			ch[r].pid = 0;
			live--;
			if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
				continue;
			if (want_restart(hooks, &ch[r], r, st, failed, o, &ro)) {
				ch[r].pid = spawn_rank(&ro, r, pipefd[0], pipefd[1], rh);
				if (ch[r].pid > 0)
					ch[r].pidfd = pidfd_open(ch[r].pid, 0);
				if (ch[r].pid > 0 && ch[r].pidfd >= 0) {
					live++;
					continue;
				}
				if (ch[r].pid > 0)
					kill(ch[r].pid, SIGKILL);
				ch[r].pid = 0;
			} else if (WIFSIGNALED(st)) {
				fprintf(stderr, "train_mlp: rank %u killed by signal %d\n", r, WTERMSIG(st));
			} else {
				fprintf(stderr, "train_mlp: rank %u exited with status %d\n", r, WEXITSTATUS(st));
			}
			if (!failed)
				kill_children(ch, n);
			failed = 1;
		}
	}
	/* Every writer but ours is gone: read what is left up to EOF. */
	close(pipefd[1]);
	pipefd[1] = -1;
	if (!failed && (ret = take_reports(pipefd[0], o, reps, have, &next)) != 1)
		failed = 1;
	if (!failed && next != o->steps) {
		fprintf(stderr, "train_mlp: only %" PRIu64 " of %" PRIu64 " steps were reported by every rank\n",
			next, o->steps);
		failed = 1;
	}
out:
	if (pipefd[0] >= 0)
		close(pipefd[0]);
	if (pipefd[1] >= 0)
		close(pipefd[1]);
	free(have);
	free(reps);
	free(pfd);
	free(ch);
	return failed ? -1 : 0;
}
