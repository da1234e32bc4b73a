/* SPDX-License-Identifier: MIT */
/*
 * Drives the optimizer kernels for test_optim_kernels.py, which compares
 * the result with torch.optim:
 *
 *   optim_step sgd|adamw N K IN OUT key=value...
 *
 * IN holds fp32: the initial param[N], then the grads of steps 1..K, N
 * each. OUT receives fp32: the param after K steps, then the state
 * (sgd: momentum_buffer; adamw: exp_avg, exp_avg_sq, max_exp_avg_sq).
 * Keys: the fields of struct shardd_sgd / shardd_adamw (lr, momentum,
 * dampening, weight_decay, nesterov, maximize, beta1, beta2, eps, amsgrad,
 * grad_scale) and lr_growth: step k uses lr * (1 + lr_growth * (k - 1)).
 * Exit status 0, or 1 with a message naming what was wrong.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardd_kernels.h"
#include "shardd_proto.h"

struct params {
	double lr, momentum, dampening, weight_decay, beta1, beta2, eps, grad_scale, lr_growth;
	double nesterov, maximize, amsgrad;
};

static int parse_kv(const char *kv, struct params *p)
{
	static const struct {
		const char *key;
		size_t off;
	} keys[] = {
		{ "lr", offsetof(struct params, lr) },
		{ "momentum", offsetof(struct params, momentum) },
		{ "dampening", offsetof(struct params, dampening) },
		{ "weight_decay", offsetof(struct params, weight_decay) },
		{ "beta1", offsetof(struct params, beta1) },
		{ "beta2", offsetof(struct params, beta2) },
		{ "eps", offsetof(struct params, eps) },
		{ "grad_scale", offsetof(struct params, grad_scale) },
		{ "lr_growth", offsetof(struct params, lr_growth) },
		{ "nesterov", offsetof(struct params, nesterov) },
		{ "maximize", offsetof(struct params, maximize) },
		{ "amsgrad", offsetof(struct params, amsgrad) },
	};
	const char *eq = strchr(kv, '=');
	char *end;

	for (size_t i = 0; eq && i < sizeof(keys) / sizeof(keys[0]); i++) {
		if (strlen(keys[i].key) == (size_t)(eq - kv) &&
		    !strncmp(kv, keys[i].key, (size_t)(eq - kv))) {
			double v = strtod(eq + 1, &end);

			if (end == eq + 1 || *end)
				break;
			memcpy((char *)p + keys[i].off, &v, sizeof(v));
			return 0;
		}
	}
	fprintf(stderr,
		"optim_step: argument '%s': expected key=number with a key of struct shardd_sgd/adamw\n",
		kv);
	return -EINVAL;
}

int main(int argc, char **argv)
{
	struct params p = { .grad_scale = 1.0, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8 };
	float *param, *grads, *state[3];
	size_t n, k, nstate;
	int adamw;
	FILE *f;
	char why[256];

	if (argc < 6 || (strcmp(argv[1], "sgd") && strcmp(argv[1], "adamw"))) {
		fprintf(stderr, "usage: optim_step sgd|adamw N K IN OUT key=value...\n");
		return 1;
	}
	adamw = !strcmp(argv[1], "adamw");
	n = strtoul(argv[2], NULL, 10);
	k = strtoul(argv[3], NULL, 10);
	for (int i = 6; i < argc; i++)
		if (parse_kv(argv[i], &p))
			return 1;
	nstate = adamw ? 3 : 1;
	param = calloc(n + 1, sizeof(float));
	grads = calloc(n * k + 1, sizeof(float));
	for (size_t s = 0; s < 3; s++)
		state[s] = calloc(n + 1, sizeof(float));
	if (!param || !grads || !state[0] || !state[1] || !state[2]) {
		fprintf(stderr, "optim_step: out of memory for %zu elements\n", n);
		return 1;
	}
	f = fopen(argv[4], "rb");
	if (!f || fread(param, sizeof(float), n, f) != n ||
	    fread(grads, sizeof(float), n * k, f) != n * k) {
		fprintf(stderr, "optim_step: %s: cannot read %zu fp32 values\n", argv[4],
			n * (k + 1));
		return 1;
	}
	fclose(f);

	for (size_t step = 1; step <= k; step++) {
		double lr = p.lr * (1.0 + p.lr_growth * (double)(step - 1));
		const float *g = grads + (step - 1) * n;
		int ret;

		if (adamw) {
			struct shardd_adamw a = {
				.param = param,
				.grad = g,
				.grad_dtype = SHARDD_DTYPE_FP32,
				.exp_avg = state[0],
				.exp_avg_sq = state[1],
				.max_exp_avg_sq = p.amsgrad != 0 ? state[2] : NULL,
				.step = step,
				.lr = lr,
				.beta1 = p.beta1,
				.beta2 = p.beta2,
				.eps = p.eps,
				.weight_decay = p.weight_decay,
				.amsgrad = p.amsgrad != 0,
				.maximize = p.maximize != 0,
				.grad_scale = (float)p.grad_scale,
			};

			ret = shardd_k_adamw_check(&a, why, sizeof(why));
			if (!ret)
				shardd_k_adamw(&a, 0, n);
		} else {
			struct shardd_sgd a = {
				.param = param,
				.grad = g,
				.grad_dtype = SHARDD_DTYPE_FP32,
				.momentum_buffer = p.momentum != 0 ? state[0] : NULL,
				.step = step,
				.lr = lr,
				.momentum = p.momentum,
				.dampening = p.dampening,
				.weight_decay = p.weight_decay,
				.nesterov = p.nesterov != 0,
				.maximize = p.maximize != 0,
				.grad_scale = (float)p.grad_scale,
			};

			ret = shardd_k_sgd_check(&a, why, sizeof(why));
			if (!ret)
				shardd_k_sgd(&a, 0, n);
		}
		if (ret) {
			fprintf(stderr, "optim_step: %s\n", why);
			return 1;
		}
	}

	f = fopen(argv[5], "wb");
	if (!f || fwrite(param, sizeof(float), n, f) != n) {
		fprintf(stderr, "optim_step: %s: cannot write\n", argv[5]);
		return 1;
	}
	for (size_t s = 0; s < nstate; s++)
		if (fwrite(state[s], sizeof(float), n, f) != n) {
			fprintf(stderr, "optim_step: %s: cannot write\n", argv[5]);
			return 1;
		}
	if (fclose(f)) {
		fprintf(stderr, "optim_step: %s: cannot write\n", argv[5]);
		return 1;
	}
	for (size_t s = 0; s < 3; s++)
		free(state[s]);
	free(grads);
	free(param);
	return 0;
}
