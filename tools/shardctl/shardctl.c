/* SPDX-License-Identifier: MIT */
/*
 * shardctl: the command line of shardd's admin requests. Each command is
 * one SHARDD_MSG_ADMIN request on a fresh connection (no HELLO) and one
 * SHARDD_MSG_ADMIN_REPLY; --json prints the reply as it came, otherwise
 * render.c prints it for people. Exit status: 0 done, 1 the daemon or the
 * connection failed, 2 usage error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "shardctl.h"
#include "shardd_ctrl.h"
#include "shardd_proto.h"
#include "shardd_socket.h"

#define REPLY_TIMEOUT_MS 10000 /* the daemon answers from its loop: seconds mean it is stuck */

static const char usage_text[] =
	"Usage: shardctl [--socket PATH] [--json] COMMAND [ARGS]\n"
	"Inspect a running shardd: jobs, ranks, groups, buffer contents, op statistics.\n"
	"Every command is read-only but end and checkpoint.\n"
	"\n"
	"Commands:\n"
	"  status                 version, backend, uptime, socket, memory held by kind\n"
	"  jobs                   jobs with their mesh, attached ranks, groups, memory, and\n"
	"                         for a job without ranks when --job-linger ends it\n"
	"  ranks [JOB]            per rank: pid, attached since, last op submitted and\n"
	"                         taken, the latest-taken op completed, ops in flight, the\n"
	"                         last step the daemon's optimizer applied on its shards\n"
	"                         (OPTIM: the training step), its furthest op step\n"
	"                         (OP_STEP: unshard, reduce, reshard as the trainer numbers\n"
	"                         them; zero_grad, nop and barriers carry none) and how many\n"
	"                         op steps it is behind the furthest rank, the collective it\n"
	"                         waits in: which rank is stuck\n"
	"  groups [JOB]           per group: params, bytes, unsharded holders, pending\n"
	"                         collectives (arrived and missing ranks), HSDP partials\n"
	"  show GROUP             per param: name, dtype, shape, shard rows, offsets\n"
	"  dump GROUP PARAM       min, max, mean, L2 norm, NaN and Inf counts of one param\n"
	"                         in one buffer, then its first values. A racy snapshot:\n"
	"                         the buffer is read while training may be writing it\n"
	"  stats                  per op: count, failures, bytes, latency mean/p50/p99/max\n"
	"                         (daemon taking the SQ entry to pushing the completion;\n"
	"                         p50/p99 from log2 buckets, exact to a factor of two)\n"
	"  watch                  status, ranks and stats, refreshed (Ctrl-C ends it)\n"
	"  metrics                Prometheus text exposition of the same numbers\n"
	"  end JOB                end the job now and free its memory: its attached ranks'\n"
	"                         ops fail with an error naming this end, and their\n"
	"                         connections close (shardd's own uid only)\n"
	"  checkpoint JOB [DIR]   save the job's params and optimizer state at its next step\n"
	"                         boundary into DIR (it must not exist), else into shardd's\n"
	"                         --state-dir/JOB/step-N; waits until it is written\n"
	"                         (docs/CHECKPOINTS.md)\n"
	"  checkpoints JOB        the job's armed, in-progress and last checkpoint\n"
	"\n"
	"Options:\n"
	"  --socket PATH          shardd's socket (default $SHARDD_SOCKET, else\n"
	"                         $XDG_RUNTIME_DIR/shardd/shardd.sock, else\n"
	"                         /run/shardd/shardd.sock)\n"
	"  --json                 print the daemon's JSON reply (watch: one object a line)\n"
	"  --job NAME             show, dump: the job, when several have the group\n"
	"  --rank R               dump: whose buffer (default 0)\n"
	"  --what param|grad|unsharded|momentum|exp_avg|exp_avg_sq|max_exp_avg_sq\n"
	"                         dump: the rank's shard (default), its sharded grad, its\n"
	"                         replica's unsharded copy, or a state of the group's optimizer\n"
	"  --rows A:B             dump: rows A..B-1 of the leading dim (default: the rows\n"
	"                         holding data, padding excluded)\n"
	"  --limit N              dump: values to print (default 64, at most 65536);\n"
	"                         statistics always cover every selected row\n"
	"  --interval S           watch: seconds between refreshes (default 1)\n"
	"  --count N              watch: stop after N refreshes (default: never)\n"
	"  --version              print the version and exit\n"
	"  --help                 print this help\n";

struct opts {
	char socket[sizeof(((struct sockaddr_un *)0)->sun_path)];
	int json;
	const char *job;
	long long rank;
	const char *what;
	const char *rows;
	long long limit;
	double interval;
	long long count;
};

static int usage_error(const char *fmt, const char *arg)
{
	fprintf(stderr, "shardctl: ");
	fprintf(stderr, fmt, arg);
	fprintf(stderr, "\nTry 'shardctl --help'.\n");
	return 2;
}

/* ------------------------------------------------------------------ */
/* Talking to the daemon                                               */
/* ------------------------------------------------------------------ */

/* Print a failure; with --json also as {"ok": false, ...} on stdout. */
static void __attribute__((format(printf, 3, 4)))
fail(const struct opts *o, int code, const char *fmt, ...)
{
	char text[2048];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	fprintf(stderr, "shardctl: %s\n", text);
	if (o->json) {
		json_t *j = json_pack("{s:b, s:s, s:i}", "ok", 0, "error", text, "code", code);

		if (j) {
			json_dumpf(j, stdout, JSON_COMPACT);
			fputc('\n', stdout);
			json_decref(j);
		}
	}
}

static int connect_daemon(const struct opts *o)
{
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	struct stat st;
	int fd, err;

	snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", o->socket);
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		fail(o, -errno, "socket: %s", strerror(errno));
		return -1;
	}
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) == 0)
		return fd;
	err = errno;
	close(fd);
	if (err == EACCES || err == EPERM) {
		unsigned uid = (unsigned)geteuid(), gid = (unsigned)getegid();

		if (stat(o->socket, &st) == 0)
			fail(o, -err,
			     "permission denied at %s (connect: %s): the socket belongs to "
			     "uid %u gid %u, mode %04o, and shardctl runs as uid %u gid %u; run "
			     "shardctl as uid %u, or start shardd with --allow-gid %u (it then "
			     "makes the socket and its directory group-accessible)",
			     o->socket, strerror(err), (unsigned)st.st_uid, (unsigned)st.st_gid,
			     (unsigned)(st.st_mode & 07777), uid, gid, (unsigned)st.st_uid, gid);
		else
			fail(o, -err,
			     "permission denied at %s (connect: %s): a directory on the "
			     "path does not let uid %u gid %u through; run shardctl as shardd's "
			     "user, or start shardd with --allow-gid %u (it then makes the "
			     "socket's directory group-accessible)",
			     o->socket, strerror(err), uid, gid, gid);
	} else {
		fail(o, -err,
		     "no shardd at %s (connect: %s); start one with `shardd --socket %s` "
		     "or pass --socket",
		     o->socket, strerror(err), o->socket);
	}
	return -1;
}

/*
 * One request on its own connection: the reply object (ok or not), or NULL
 * after printing why there is none.
 */
static json_t *request(const struct opts *o, json_t *req)
{
	struct shardd_ctrl_rx rx = { 0 };
	json_error_t jerr;
	json_t *reply = NULL;
	char *text = json_dumps(req, JSON_COMPACT);
	int fd, ret;

	if (!text) {
		fail(o, -ENOMEM, "out of memory");
		return NULL;
	}
	fd = connect_daemon(o);
	if (fd < 0)
		goto out;
	ret = shardd_ctrl_send(fd, SHARDD_MSG_ADMIN, 1, text, (uint32_t)strlen(text), NULL, 0);
	if (ret < 0 && ret != -EPIPE && ret != -ECONNRESET) {
		fail(o, ret, "cannot send to shardd at %s: %s", o->socket, strerror(-ret));
		goto out;
	}
	/* After EPIPE the daemon may still have sent why it closed: read it. */
	ret = shardd_ctrl_recv(fd, &rx, REPLY_TIMEOUT_MS);
	if (ret == -ETIMEDOUT) {
		fail(o, ret, "shardd at %s did not answer within %d s: its event loop may be stuck",
		     o->socket, REPLY_TIMEOUT_MS / 1000);
		goto out;
	}
	if (ret < 0) {
		fail(o, ret, "shardd at %s closed the connection without a reply (%s)", o->socket,
		     ret == -ECONNRESET ? "EOF" : strerror(-ret));
		goto out;
	}
	if (rx.hdr.type == SHARDD_MSG_ERROR && rx.have >= sizeof(struct shardd_error_msg)) {
		struct shardd_error_msg em;
		size_t n;

		memcpy(&em, rx.payload, sizeof(em));
		n = rx.have - sizeof(em) < em.msg_len ? rx.have - sizeof(em) : em.msg_len;
		fail(o, em.code, "shardd at %s refused: %.*s", o->socket, (int)n,
		     (const char *)rx.payload + sizeof(em));
		goto out;
	}
	if (rx.hdr.type != SHARDD_MSG_ADMIN_REPLY) {
		fail(o, -SHARDD_E_MALFORMED,
		     "shardd at %s answered with message type %u, not an "
		     "admin reply (%d): is it an older shardd?",
		     o->socket, rx.hdr.type, SHARDD_MSG_ADMIN_REPLY);
		goto out;
	}
	reply = json_loadb((const char *)rx.payload, rx.have, 0, &jerr);
	if (!reply || !json_is_object(reply)) {
		fail(o, -SHARDD_E_MALFORMED, "shardd's reply is not a JSON object: %s", jerr.text);
		json_decref(reply);
		reply = NULL;
	}
out:
	shardd_ctrl_rx_reset(&rx);
	if (fd >= 0)
		close(fd);
	free(text);
	return reply;
}

/* 0 when the reply says ok; else print its error and return 1. */
static int reply_failed(const json_t *r)
{
	if (json_is_true(json_object_get(r, "ok")))
		return 0;
	fprintf(stderr, "shardctl: %s\n",
		json_string_value(json_object_get(r, "error"))
			? json_string_value(json_object_get(r, "error"))
			: "shardd reported a failure");
	return 1;
}

static void print_json(const json_t *r, size_t flags)
{
	json_dumpf(r, stdout, flags);
	fputc('\n', stdout);
	fflush(stdout);
}

/* ------------------------------------------------------------------ */
/* Commands                                                            */
/* ------------------------------------------------------------------ */

typedef void (*render_fn)(FILE *, const json_t *);

/* Send `req` (taken), print the reply with `render` or as JSON. Exit status. */
static int run_one(const struct opts *o, json_t *req, render_fn render)
{
	json_t *r;
	int ret;

	if (!req) {
		fail(o, -ENOMEM, "out of memory");
		return 1;
	}
	r = request(o, req);
	json_decref(req);
	if (!r)
		return 1;
	/* The error on stderr first: who merges both streams gets the JSON last. */
	ret = reply_failed(r);
	if (o->json)
		print_json(r, JSON_INDENT(2));
	else if (!ret && render)
		render(stdout, r);
	else if (!ret)
		fputs(json_string_value(json_object_get(r, "text"))
			      ? json_string_value(json_object_get(r, "text"))
			      : "",
		      stdout);
	json_decref(r);
	return ret;
}

static json_t *cmd_req(const char *cmd)
{
	return json_pack("{s:s}", "cmd", cmd);
}

/* req["job"] = job when given. */
static json_t *with_job(json_t *req, const char *job)
{
	if (req && job && json_object_set_new(req, "job", json_string(job))) {
		json_decref(req);
		return NULL;
	}
	return req;
}

/* The job's restores: counts, then the last failure and fallback with their whole messages. */
static void render_restores(FILE *f, const json_t *x)
{
	const json_t *lf = json_object_get(x, "last_failed");
	const json_t *fb = json_object_get(x, "last_fallback");

	if (!x)
		return;
	fprintf(f, "  restores: %lld restored, %lld failed, %lld damaged checkpoints skipped\n",
		(long long)json_integer_value(json_object_get(x, "restored")),
		(long long)json_integer_value(json_object_get(x, "failed")),
		(long long)json_integer_value(json_object_get(x, "fallbacks")));
	if (json_is_object(lf))
		fprintf(f, "  last failed restore: group '%s' (%s): %s\n",
			json_string_value(json_object_get(lf, "group")),
			json_string_value(json_object_get(lf, "reason")),
			json_string_value(json_object_get(lf, "error")));
	if (json_is_object(fb))
		fprintf(f, "  last fallback: group '%s' (%s): %s\n",
			json_string_value(json_object_get(fb, "group")),
			json_string_value(json_object_get(fb, "reason")),
			json_string_value(json_object_get(fb, "error")));
}

static void render_checkpoints(FILE *f, const json_t *r)
{
	const json_t *a = json_object_get(r, "armed"), *w = json_object_get(r, "writing");
	const json_t *l = json_object_get(r, "last");

	fprintf(f, "job '%s'\n", json_string_value(json_object_get(r, "job")));
	if (json_integer_value(json_object_get(a, "id")))
		fprintf(f, "  armed:   checkpoint %lld, waiting for the next step boundary\n",
			(long long)json_integer_value(json_object_get(a, "id")));
	if (json_integer_value(json_object_get(w, "id"))) {
		double bytes = (double)json_integer_value(json_object_get(w, "bytes"));
		double total = (double)json_integer_value(json_object_get(w, "total"));
		double secs = json_number_value(json_object_get(w, "seconds"));
		double rate = secs > 0 ? bytes / secs : 0;

		fprintf(f,
			"  writing: checkpoint %lld of step %lld to %s: %.0f of about %.0f bytes in %.1f s "
			"(%.2f GB/s",
			(long long)json_integer_value(json_object_get(w, "id")),
			(long long)json_integer_value(json_object_get(w, "step")),
			json_string_value(json_object_get(w, "dir")), bytes, total, secs,
			rate / 1e9);
		if (rate > 0 && total > bytes)
			fprintf(f, ", about %.1f s left", (total - bytes) / rate);
		fprintf(f, ")\n");
	}
	if (!json_integer_value(json_object_get(l, "id")))
		fprintf(f, "  last:    none\n");
	else if (json_integer_value(json_object_get(l, "code")))
		fprintf(f, "  last:    checkpoint %lld failed: %s\n",
			(long long)json_integer_value(json_object_get(l, "id")),
			json_string_value(json_object_get(l, "error")));
	else
		fprintf(f, "  last:    checkpoint %lld of step %lld in %s: %lld bytes in %.3f s\n",
			(long long)json_integer_value(json_object_get(l, "id")),
			(long long)json_integer_value(json_object_get(l, "step")),
			json_string_value(json_object_get(l, "dir")),
			(long long)json_integer_value(json_object_get(l, "bytes")),
			json_number_value(json_object_get(l, "seconds")));
	render_restores(f, json_object_get(r, "restore"));
}

/* The request's reply when it is ok, else NULL after printing why. */
static json_t *request_ok(const struct opts *o, json_t *req)
{
	json_t *r;

	if (!req) {
		fail(o, -ENOMEM, "out of memory");
		return NULL;
	}
	r = request(o, req);
	json_decref(req);
	if (r && reply_failed(r)) {
		if (o->json)
			print_json(r, JSON_INDENT(2));
		json_decref(r);
		return NULL;
	}
	return r;
}

/*
 * checkpoint JOB [DIR]: arm it, then ask `checkpoints` until the daemon
 * reports it ended (a poll: admin requests are answered at once).
 */
static int cmd_checkpoint(const struct opts *o, const char *job, const char *dir)
{
	char abs[4096];
	json_t *req = with_job(cmd_req("checkpoint"), job), *r, *last = NULL;
	json_int_t id;
	int ret = 1;

	if (dir && dir[0] != '/') {
		if (!getcwd(abs, sizeof(abs) - 1) || strlen(abs) + strlen(dir) + 2 > sizeof(abs))
			return usage_error("checkpoint directory '%s': cannot make it absolute",
					   dir);
		strcat(abs, "/");
		strcat(abs, dir);
		dir = abs;
	}
	if (req && dir && json_object_set_new(req, "dir", json_string(dir))) {
		json_decref(req);
		req = NULL;
	}
	r = request_ok(o, req);
	if (!r)
		return 1;
	id = json_integer_value(json_object_get(r, "id"));
	json_decref(r);
	for (unsigned polls = 1;; polls++) {
		struct timespec ts = { .tv_nsec = 100 * 1000 * 1000 };
		json_t *w;

		r = request_ok(o, with_job(cmd_req("checkpoints"), job));
		if (!r)
			return 1;
		last = json_object_get(r, "last");
		if (json_integer_value(json_object_get(last, "id")) >= id)
			break;
		/* Every 10 s, where it is: it waits for the job's ranks, or for the disk. */
		w = json_object_get(r, "writing");
		if (polls % 100 == 0)
			fprintf(stderr,
				"shardctl: checkpoint %lld of job '%s': %s (%lld of about %lld bytes)\n",
				(long long)id, job,
				json_integer_value(json_object_get(w, "id")) == id
					? "being written"
					: "armed, waiting for the job's next step boundary",
				(long long)json_integer_value(json_object_get(w, "bytes")),
				(long long)json_integer_value(json_object_get(w, "total")));
		json_decref(r);
		nanosleep(&ts, NULL);
	}
	if (json_integer_value(json_object_get(last, "code"))) {
		fail(o, (int)json_integer_value(json_object_get(last, "code")), "%s",
		     json_string_value(json_object_get(last, "error")));
	} else {
		ret = 0;
		if (o->json)
			print_json(last, JSON_INDENT(2));
		else
			printf("checkpoint of job '%s' at step %lld written to %s: %lld bytes in %.3f s\n",
			       job, (long long)json_integer_value(json_object_get(last, "step")),
			       json_string_value(json_object_get(last, "dir")),
			       (long long)json_integer_value(json_object_get(last, "bytes")),
			       json_number_value(json_object_get(last, "seconds")));
	}
	json_decref(r);
	return ret;
}

static int parse_rows(const char *s, long long *a, long long *b)
{
	char *end;

	errno = 0;
	*a = strtoll(s, &end, 10);
	if (errno || end == s || *end != ':' || *a < 0)
		return -1;
	s = end + 1;
	*b = strtoll(s, &end, 10);
	if (errno || end == s || *end || *b < *a)
		return -1;
	return 0;
}

static int cmd_dump(const struct opts *o, const char *group, const char *param)
{
	json_t *req =
		with_job(json_pack("{s:s, s:s, s:s, s:s, s:I, s:I}", "cmd", "dump", "group", group,
				   "param", param, "what", o->what ? o->what : "param", "rank",
				   (json_int_t)o->rank, "limit", (json_int_t)o->limit),
			 o->job);

	if (req && o->rows) {
		long long a, b;

		if (parse_rows(o->rows, &a, &b) < 0) {
			json_decref(req);
			return usage_error("--rows '%s': expected A:B with 0 <= A <= B", o->rows);
		}
		if (json_object_set_new(req, "rows",
					json_pack("[I, I]", (json_int_t)a, (json_int_t)b))) {
			json_decref(req);
			req = NULL;
		}
	}
	return run_one(o, req, shardctl_render_dump);
}

static int cmd_watch(const struct opts *o)
{
	struct timespec ts = { (time_t)o->interval,
			       (long)((o->interval - (double)(time_t)o->interval) * 1e9) };
	int tty = isatty(STDOUT_FILENO), ret = 0;
	json_t *reqs[3] = { cmd_req("status"), cmd_req("ranks"), cmd_req("stats") };

	if (!reqs[0] || !reqs[1] || !reqs[2]) {
		fail(o, -ENOMEM, "out of memory");
		ret = 1;
	}
	for (long long n = 0; !ret && (o->count <= 0 || n < o->count); n++) {
		json_t *st, *rk, *sa;
		int bad;

		if (n)
			nanosleep(&ts, NULL);
		st = request(o, reqs[0]);
		rk = st ? request(o, reqs[1]) : NULL;
		sa = rk ? request(o, reqs[2]) : NULL;
		bad = !sa || reply_failed(st) || reply_failed(rk) || reply_failed(sa);
		if (!bad && o->json) {
			json_t *all = json_pack("{s:O, s:O, s:O}", "status", st, "ranks", rk,
						"stats", sa);

			if (all)
				print_json(all, JSON_COMPACT);
			json_decref(all);
		} else if (!bad) {
			/* Clear the screen only for a terminal: a pipe gets plain frames. */
			if (tty)
				fputs("\033[H\033[2J", stdout);
			else if (n)
				fputc('\n', stdout);
			shardctl_render_status(stdout, st);
			fputc('\n', stdout);
			shardctl_render_ranks(stdout, rk);
			fputc('\n', stdout);
			shardctl_render_stats(stdout, sa);
			fflush(stdout);
		}
		json_decref(st);
		json_decref(rk);
		json_decref(sa);
		ret = bad;
	}
	for (int i = 0; i < 3; i++)
		json_decref(reqs[i]);
	return ret;
}

/* ------------------------------------------------------------------ */
/* main                                                                */
/* ------------------------------------------------------------------ */

enum {
	OPT_SOCKET = 256,
	OPT_JSON,
	OPT_JOB,
	OPT_RANK,
	OPT_WHAT,
	OPT_ROWS,
	OPT_LIMIT,
	OPT_INTERVAL,
	OPT_COUNT,
	OPT_HELP,
	OPT_VERSION
};

static int parse_ll(const char *flag, const char *s, long long lo, long long hi, long long *out)
{
	char *end;

	errno = 0;
	*out = strtoll(s, &end, 10);
	if (errno || end == s || *end || *out < lo || *out > hi) {
		fprintf(stderr,
			"shardctl: %s '%s': expected an integer in [%lld, %lld]\n"
			"Try 'shardctl --help'.\n",
			flag, s, lo, hi);
		return -1;
	}
	return 0;
}

int main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "socket", required_argument, NULL, OPT_SOCKET },
		{ "json", no_argument, NULL, OPT_JSON },
		{ "job", required_argument, NULL, OPT_JOB },
		{ "rank", required_argument, NULL, OPT_RANK },
		{ "what", required_argument, NULL, OPT_WHAT },
		{ "rows", required_argument, NULL, OPT_ROWS },
		{ "limit", required_argument, NULL, OPT_LIMIT },
		{ "interval", required_argument, NULL, OPT_INTERVAL },
		{ "count", required_argument, NULL, OPT_COUNT },
		{ "help", no_argument, NULL, OPT_HELP },
		{ "version", no_argument, NULL, OPT_VERSION },
		{ NULL, 0, NULL, 0 },
	};
	struct opts o = { .limit = 64, .interval = 1.0 };
	const char *cmd;
	char **pos;
	int npos, c;

	opterr = 0;
	/* GNU getopt permutes: options may come before or after the command's arguments. */
	while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
		char *end;

		switch (c) {
		case OPT_SOCKET:
			if (!*optarg || strlen(optarg) >= sizeof(o.socket))
				return usage_error(
					"--socket '%s': empty or longer than the 107 bytes "
					"a Unix socket path may have",
					optarg);
			snprintf(o.socket, sizeof(o.socket), "%s", optarg);
			break;
		case OPT_JSON:
			o.json = 1;
			break;
		case OPT_JOB:
			o.job = optarg;
			break;
		case OPT_WHAT:
			o.what = optarg;
			break;
		case OPT_ROWS:
			o.rows = optarg;
			break;
		case OPT_RANK:
			if (parse_ll("--rank", optarg, 0, SHARDD_MAX_WORLD - 1, &o.rank) < 0)
				return 2;
			break;
		case OPT_LIMIT:
			if (parse_ll("--limit", optarg, 0, 65536, &o.limit) < 0)
				return 2;
			break;
		case OPT_COUNT:
			if (parse_ll("--count", optarg, 1, 1000000000, &o.count) < 0)
				return 2;
			break;
		case OPT_INTERVAL:
			errno = 0;
			o.interval = strtod(optarg, &end);
			if (errno || end == optarg || *end || !(o.interval >= 0.01) ||
			    o.interval > 86400)
				return usage_error(
					"--interval '%s': expected seconds in [0.01, 86400]",
					optarg);
			break;
		case 'h':
		case OPT_HELP:
			fputs(usage_text, stdout);
			return 0;
		case OPT_VERSION:
			printf("shardctl %s (protocol %d.%d)\n", SHARDD_VERSION, SHARDD_PROTO_MAJOR,
			       SHARDD_PROTO_MINOR);
			return 0;
		default:
			return usage_error("unknown option '%s'", argv[optind - 1]);
		}
	}
	if (!o.socket[0] &&
	    shardd_socket_path_resolve(NULL, o.socket, sizeof(o.socket)) >= (int)sizeof(o.socket))
		return usage_error("default socket path '%s...' ($SHARDD_SOCKET, else "
				   "$XDG_RUNTIME_DIR) is longer than the 107 bytes a Unix socket "
				   "path may have; pass a shorter --socket",
				   o.socket);
	if (optind >= argc)
		return usage_error("%s", "no command given");
	cmd = argv[optind];
	pos = argv + optind + 1;
	npos = argc - optind - 1;

	if (strcmp(cmd, "status") == 0 && npos == 0)
		return run_one(&o, cmd_req("status"), shardctl_render_status);
	if (strcmp(cmd, "jobs") == 0 && npos == 0)
		return run_one(&o, cmd_req("jobs"), shardctl_render_jobs);
	if (strcmp(cmd, "ranks") == 0 && npos <= 1)
		return run_one(&o, with_job(cmd_req("ranks"), npos ? pos[0] : o.job),
			       shardctl_render_ranks);
	if (strcmp(cmd, "groups") == 0 && npos <= 1)
		return run_one(&o, with_job(cmd_req("groups"), npos ? pos[0] : o.job),
			       shardctl_render_groups);
	if (strcmp(cmd, "show") == 0 && npos == 1)
		return run_one(
			&o,
			with_job(json_pack("{s:s, s:s}", "cmd", "show", "group", pos[0]), o.job),
			shardctl_render_show);
	if (strcmp(cmd, "dump") == 0 && npos == 2)
		return cmd_dump(&o, pos[0], pos[1]);
	if (strcmp(cmd, "stats") == 0 && npos == 0)
		return run_one(&o, cmd_req("stats"), shardctl_render_stats);
	if (strcmp(cmd, "metrics") == 0 && npos == 0)
		return run_one(&o, cmd_req("metrics"), NULL);
	if (strcmp(cmd, "watch") == 0 && npos == 0)
		return cmd_watch(&o);
	if (strcmp(cmd, "end") == 0 && npos == 1)
		return run_one(&o, with_job(cmd_req("end"), pos[0]), shardctl_render_end);
	if (strcmp(cmd, "checkpoint") == 0 && (npos == 1 || npos == 2))
		return cmd_checkpoint(&o, pos[0], npos == 2 ? pos[1] : NULL);
	if (strcmp(cmd, "checkpoints") == 0 && npos == 1)
		return run_one(&o, with_job(cmd_req("checkpoints"), pos[0]), render_checkpoints);
	if (strcmp(cmd, "status") == 0 || strcmp(cmd, "jobs") == 0 || strcmp(cmd, "ranks") == 0 ||
	    strcmp(cmd, "groups") == 0 || strcmp(cmd, "show") == 0 || strcmp(cmd, "dump") == 0 ||
	    strcmp(cmd, "stats") == 0 || strcmp(cmd, "metrics") == 0 || strcmp(cmd, "watch") == 0 ||
	    strcmp(cmd, "end") == 0 || strcmp(cmd, "checkpoint") == 0 ||
	    strcmp(cmd, "checkpoints") == 0)
		return usage_error("wrong number of arguments for '%s'", cmd);
	return usage_error("unknown command '%s'", cmd);
}
