/* SPDX-License-Identifier: MIT */
/*
 * Shapes at the edge against a real shardd (issue 11, hole 1): params with
 * a zero-size dim (FSDP2 accepts zero-numel params) sharded on dim 0 or on
 * a later dim, beside ordinary params, go through unshard, reduce,
 * zero_grad and reshard with results equal to the FSDP2 reference
 * (tests/lib/reference.c); dims whose product wraps 64 bits are refused at
 * registration, naming the param and the dim. Before the fix a zero-size
 * dim with shard_dim > 0 made the host backend divide by zero at the next
 * unshard (SIGFPE: the daemon and every job on it gone).
 *
 * Ranks are forked processes of the test, each its own libshardd client.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "reference.h"
#include "shardd_ctrl.h"

#define CHILD_WAIT_MS 20000
#define MAX_RANKS     4
#define MAX_PARAMS    8

static struct harness_daemon daemon_;

static void start_daemon(void)
{
	static const char *const extra[] = { "--collective-timeout", "10", NULL };

	harness_daemon_start_or_fail(&daemon_, extra);
}

static void stop_daemon(void)
{
	harness_daemon_stop_expect_clean(&daemon_);
}

TestSuite(shapes, .init = start_daemon, .fini = stop_daemon, .timeout = 60);

struct shape_case {
	const char *job;
	uint32_t shard;
	uint32_t nparams;
	struct shardd_param_desc params[MAX_PARAMS];
};

struct rank_args {
	const struct shape_case *sc;
	uint32_t rank;
};

static struct ref_param ref_of(const struct shardd_param_desc *d)
{
	struct ref_param p = { .ndim = d->ndim, .shard_dim = d->shard_dim, .dtype = d->dtype };

	memcpy(p.shape, d->shape, sizeof(p.shape[0]) * d->ndim);
	return p;
}

/* Exactly representable in fp32: small integers over 4. */
static double param_value(uint32_t param, uint64_t e)
{
	return (double)((int)((param * 7 + e * 3) % 23) - 11) / 4.0;
}

static double grad_value(uint32_t rank, uint32_t param, uint64_t e)
{
	return (double)((int)((rank * 5 + param * 11 + e) % 19) - 9) / 8.0;
}

/* Rank a->rank's sharded grads against a fresh FSDP2 reduce of every rank's grads. */
static int check_reduce(const struct rank_args *a, struct shardd_group *g)
{
	const struct shape_case *sc = a->sc;

	for (uint32_t i = 0; i < sc->nparams; i++) {
		struct ref_param p = ref_of(&sc->params[i]);
		struct ref_reduce_cfg cfg = {
			.R = 1, .S = sc->shard, .grad_dtype = p.dtype, .reduce_dtype = p.dtype
		};
		struct ref_grad_state st[MAX_RANKS];
		const double *grads[MAX_RANKS];
		const float *got = shardd_group_shard_grad(g, i);
		struct ref_dims d;

		ref_dims(&p, sc->shard, &d);
		CHILD_CHECK(shardd_group_layout(g, i)->shard_bytes == d.shard_numel * sizeof(float),
			    "param %u: shard_bytes %llu, want %llu", i,
			    (unsigned long long)shardd_group_layout(g, i)->shard_bytes,
			    (unsigned long long)(d.shard_numel * sizeof(float)));
		/* A zero-numel param has nothing to compare (and its outer dim may be huge). */
		if (d.numel == 0)
			continue;
		memset(st, 0, sizeof(st));
		for (uint32_t r = 0; r < sc->shard; r++) {
			double *full = malloc(d.numel * sizeof(double));

			CHILD_CHECK(full, "out of memory");
			for (uint64_t e = 0; e < d.numel; e++)
				full[e] = grad_value(r, i, e);
			grads[r] = full;
			st[r].sgrad = calloc(d.shard_numel + 1, sizeof(struct ref_val));
			st[r].partial = calloc(d.shard_numel + 1, sizeof(struct ref_val));
			CHILD_CHECK(st[r].sgrad && st[r].partial, "out of memory");
		}
		ref_reduce(&p, &cfg, grads, st);
		for (uint64_t e = 0; e < d.shard_numel; e++) {
			struct ref_val w = st[a->rank].sgrad[e];

			CHILD_CHECK(
				fabs((double)got[e] - w.v) <= w.err,
				"rank %u param %u '%s' sharded grad element %llu: %.9g, want %.9g within %.3g",
				a->rank, i, sc->params[i].name, (unsigned long long)e,
				(double)got[e], w.v, w.err);
		}
		for (uint32_t r = 0; r < sc->shard; r++) {
			free((void *)grads[r]);
			free(st[r].sgrad);
			free(st[r].partial);
		}
	}
	return 0;
}

static int rank_main(void *arg)
{
	const struct rank_args *a = arg;
	const struct shape_case *sc = a->sc;
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;

	CHILD_CHECK(harness_attach(&daemon_, sc->job, a->rank, 1, sc->shard, &c) == 0, "attach: %s",
		    shardd_last_error());
	CHILD_CHECK(shardd_group_register(c, "edges", sc->params, sc->nparams, NULL, NULL, &g) == 0,
		    "register: %s", shardd_last_error());
	for (uint32_t i = 0; i < sc->nparams; i++) {
		struct ref_param p = ref_of(&sc->params[i]);
		struct ref_dims d;
		float *full;

		ref_dims(&p, sc->shard, &d);
		full = malloc(d.numel * sizeof(float) + 1);
		CHILD_CHECK(full, "out of memory");
		for (uint64_t e = 0; e < d.numel; e++)
			full[e] = (float)param_value(i, e);
		CHILD_CHECK(shardd_group_load_full(g, i, full) == 0, "load param %u: %s", i,
			    shardd_last_error());
		free(full);
	}
	CHILD_CHECK(shardd_unshard(g, 1) == 0, "unshard: %s", shardd_last_error());
	for (uint32_t i = 0; i < sc->nparams; i++) {
		struct ref_param p = ref_of(&sc->params[i]);
		const float *u = shardd_group_unsharded(g, i);
		struct ref_dims d;

		ref_dims(&p, sc->shard, &d);
		CHILD_CHECK(shardd_group_layout(g, i)->unsharded_bytes == d.numel * sizeof(float),
			    "param %u: unsharded_bytes %llu, want %llu", i,
			    (unsigned long long)shardd_group_layout(g, i)->unsharded_bytes,
			    (unsigned long long)(d.numel * sizeof(float)));
		for (uint64_t e = 0; e < d.numel; e++)
			CHILD_CHECK((double)u[e] == param_value(i, e),
				    "rank %u param %u '%s' unsharded element %llu: %g, want %g",
				    a->rank, i, sc->params[i].name, (unsigned long long)e,
				    (double)u[e], param_value(i, e));
	}
	CHILD_CHECK(shardd_reshard(g, 1) == 0, "reshard: %s", shardd_last_error());
	for (uint32_t i = 0; i < sc->nparams; i++) {
		const struct shardd_param_layout *l = shardd_group_layout(g, i);
		float *grad = shardd_group_grad(g, i);

		for (uint64_t e = 0; e < l->grad_bytes / sizeof(float); e++)
			grad[e] = (float)grad_value(a->rank, i, e);
	}
	CHILD_CHECK(shardd_reduce(g, 1, 0) == 0, "reduce: %s", shardd_last_error());
	if (check_reduce(a, g))
		return 1;
	/* zero_grad forgets the sharded grad: the next reduce assigns, it does not accumulate. */
	CHILD_CHECK(shardd_zero_grad(g) == 0, "zero_grad: %s", shardd_last_error());
	for (uint32_t i = 0; i < sc->nparams; i++) {
		const struct shardd_param_layout *l = shardd_group_layout(g, i);
		const float *sg = shardd_group_shard_grad(g, i);

		for (uint64_t e = 0; e < l->shard_bytes / sizeof(float); e++)
			CHILD_CHECK(sg[e] == 0.0f,
				    "param %u sharded grad element %llu after zero_grad: %g", i,
				    (unsigned long long)e, (double)sg[e]);
	}
	CHILD_CHECK(shardd_reduce(g, 2, 0) == 0, "second reduce: %s", shardd_last_error());
	if (check_reduce(a, g))
		return 1;
	CHILD_CHECK(shardd_unshard(g, 2) == 0, "second unshard: %s", shardd_last_error());
	CHILD_CHECK(shardd_reshard(g, 2) == 0, "second reshard: %s", shardd_last_error());
	shardd_group_close(g);
	shardd_close(c);
	return 0;
}

static void run_case(const struct shape_case *sc)
{
	struct rank_args args[MAX_RANKS];

	for (uint32_t r = 0; r < sc->shard; r++)
		args[r] = (struct rank_args){ .sc = sc, .rank = r };
	harness_run_children(rank_main, args, sizeof(args[0]), sc->shard, CHILD_WAIT_MS, &daemon_);
}

#define P(n, nd, sd, ...)                                                                      \
	{                                                                                      \
		.name = n, .dtype = SHARDD_DTYPE_FP32, .ndim = nd, .shard_dim = sd, .shape = { \
			__VA_ARGS__                                                            \
		}                                                                              \
	}

Test(shapes, zero_width_param_sharded_on_dim1_goes_through_every_op_beside_ordinary_params)
{
	static const struct shape_case sc = {
		.job = "zero-width", .shard = 2, .nparams = 6,
		.params = {
			P("w", 2, 0, 3, 4),       /* padded: shard 1 holds one real row of two */
			P("e1", 2, 1, 2, 0),      /* shape (2, 0), Shard(1): the crash of hole 1 */
			P("b", 1, 0, 5),
			P("e0", 2, 0, 0, 3),      /* no rows at all */
			P("e2", 3, 2, 4, 0, 6),   /* zero dim before the shard dim */
			P("v", 3, 1, 2, 4, 3),    /* Shard(1), even */
		},
	};

	run_case(&sc);
}

Test(shapes, zero_numel_params_with_huge_other_dims_complete_without_work)
{
	/*
	 * 2^37 outer indices of no elements each: a backend that visits each
	 * outer index (or a client that copies each one) would run for minutes.
	 */
	static const struct shape_case sc = {
		.job = "zero-huge", .shard = 2, .nparams = 4,
		.params = {
			P("wide", 2, 1, 1ull << 37, 0),
			P("tall", 2, 0, 0, 1ull << 37),
			P("mid", 3, 1, 1ull << 20, 0, 1ull << 16),
			P("w", 2, 1, 3, 4),
		},
	};

	run_case(&sc);
}

Test(shapes, single_rank_group_of_only_zero_numel_params_completes)
{
	static const struct shape_case sc = {
		.job = "zero-only", .shard = 1, .nparams = 2,
		.params = {
			P("a", 1, 0, 0),
			P("b", 2, 1, 7, 0),
		},
	};

	run_case(&sc);
}

/*
 * Register one param straight over the protocol (libshardd refuses these
 * shapes before sending) from rank 0 of a fresh 1x1 job; the daemon must
 * answer with an ERROR whose text names both words.
 */
static void expect_daemon_refuses(const char *job, const struct shardd_param_desc *d,
				  const char *want1, const char *want2)
{
	struct {
		struct shardd_register_group hdr;
		struct shardd_param_spec spec;
	} reg;
	struct shardd_hello h = {
		.major = SHARDD_PROTO_MAJOR,
		.minor = SHARDD_PROTO_MINOR,
		.pid = (uint32_t)getpid(),
		.rank = 0,
		.replicate = 1,
		.shard = 1,
		.device = SHARDD_HELLO_DEVICE_HOST,
	};
	struct shardd_ctrl_rx rx;
	struct shardd_error_msg em;
	char text[1024] = "";
	int fd = harness_raw_connect(daemon_.socket), ret;

	cr_assert_geq(fd, 0, "connect: %s", strerror(-fd));
	snprintf(h.job, sizeof(h.job), "%s", job);
	cr_assert_eq(shardd_ctrl_send(fd, SHARDD_MSG_HELLO, 1, &h, sizeof(h), NULL, 0), 0);
	memset(&rx, 0, sizeof(rx));
	cr_assert_eq(shardd_ctrl_recv(fd, &rx, 5000), 0, "no WELCOME");
	cr_assert_eq(rx.hdr.type, SHARDD_MSG_WELCOME, "hello answered with type %u", rx.hdr.type);
	shardd_ctrl_rx_reset(&rx);

	memset(&reg, 0, sizeof(reg));
	snprintf(reg.hdr.name, sizeof(reg.hdr.name), "g");
	reg.hdr.nparams = 1;
	snprintf(reg.spec.name, sizeof(reg.spec.name), "%s", d->name);
	reg.spec.dtype = d->dtype;
	reg.spec.ndim = d->ndim;
	reg.spec.shard_dim = d->shard_dim;
	memcpy(reg.spec.shape, d->shape, sizeof(reg.spec.shape[0]) * d->ndim);
	cr_assert_eq(shardd_ctrl_send(fd, SHARDD_MSG_REGISTER_GROUP, 2, &reg, sizeof(reg), NULL, 0),
		     0);
	memset(&rx, 0, sizeof(rx));
	ret = shardd_ctrl_recv(fd, &rx, 5000);
	cr_assert_eq(ret, 0, "no reply to the registration of '%s': %s", d->name, strerror(-ret));
	if (rx.hdr.type == SHARDD_MSG_ERROR && rx.hdr.length >= sizeof(em)) {
		size_t n = rx.hdr.length - sizeof(em) < sizeof(text) - 1
				   ? rx.hdr.length - sizeof(em)
				   : sizeof(text) - 1;

		memcpy(&em, rx.payload, sizeof(em));
		memcpy(text, rx.payload + sizeof(em), n);
		text[n] = '\0';
		cr_expect_eq(em.code, -SHARDD_E_INVALID, "code %d (%s)", em.code, text);
	}
	cr_expect_eq(rx.hdr.type, SHARDD_MSG_ERROR,
		     "registering '%s' answered with type %u, want ERROR", d->name, rx.hdr.type);
	cr_expect(strstr(text, want1) && strstr(text, want2), "error '%s' must name '%s' and '%s'",
		  text, want1, want2);
	shardd_ctrl_rx_reset(&rx);
	close(fd);
}

Test(shapes, dims_whose_product_wraps_are_refused_naming_param_and_dim)
{
	/* 0 x 2^63 x 8 wraps the product of the dims after shard_dim 1 to 0. */
	struct shardd_param_desc wrap = P("wrap", 5, 1, 3, 3, 0, 1ull << 63, 8);
	/* 2^32 x 2^33 wraps the product of the dims after shard_dim 0 to 0; the zero row count hid it. */
	struct shardd_param_desc big = P("big", 3, 0, 0, 1ull << 32, 1ull << 33);
	/* No wrap, but 2^40 elements if the zero dim were 1: past the 1 TiB buffer limit. */
	struct shardd_param_desc wide = P("wide", 3, 0, 0, 1ull << 20, 1ull << 20);
	struct shardd_param_desc ok = P("w", 2, 0, 5, 3);
	struct shardd_client *c = NULL;
	struct shardd_group *g = NULL;

	expect_daemon_refuses("wrap", &wrap, "param 'wrap'", "shape[3]");
	expect_daemon_refuses("big", &big, "param 'big'", "shape[2]");
	expect_daemon_refuses("wide", &wide, "param 'wide'", "shape[2]");

	/* libshardd refuses the wrapping shapes itself, naming param and dim. */
	cr_assert_eq(harness_attach(&daemon_, "client-side", 0, 1, 1, &c), 0, "attach: %s",
		     shardd_last_error());
	cr_expect_eq(shardd_group_register(c, "g", &wrap, 1, NULL, NULL, &g), -EINVAL);
	cr_expect(strstr(shardd_last_error(), "param 0 'wrap': shape[3]"), "libshardd's error: %s",
		  shardd_last_error());
	/* The daemon is alive and serves the next group. */
	cr_assert_eq(shardd_group_register(c, "g", &ok, 1, NULL, NULL, &g), 0, "register: %s",
		     shardd_last_error());
	cr_assert_eq(shardd_unshard(g, 1), 0, "unshard: %s", shardd_last_error());
	shardd_group_close(g);
	shardd_close(c);
}
