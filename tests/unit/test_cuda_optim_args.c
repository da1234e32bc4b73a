/* SPDX-License-Identifier: MIT */
/*
 * The entry points of the CUDA optimizer kernels (kernels/optim.cu) on a
 * machine with or without a GPU: arguments the kernels cannot take are
 * refused with -SHARDD_E_INVALID before anything reaches CUDA, and an
 * empty range returns 0 without a launch (the pointers here are host
 * addresses: a launch would fail, or fault on a GPU). The cuda backend's
 * step relies on both. A build without CUDA has none of it: one skipped
 * test says so.
 */
#include <criterion/criterion.h>

#ifdef SHARDD_HAVE_CUDA
#include "shardd_cuda_kernels.h"
#include "shardd_proto.h"

static float param[4], buf[4], m[4], v[4], vmax[4], grad[4];

static struct shardd_sgd sgd_ok(void)
{
	return (struct shardd_sgd){ .param = param,
				    .grad = grad,
				    .momentum_buffer = buf,
				    .grad_dtype = SHARDD_DTYPE_FP32,
				    .step = 1,
				    .lr = 0.1,
				    .momentum = 0.9,
				    .grad_scale = 1.0f };
}

static struct shardd_adamw adamw_ok(void)
{
	return (struct shardd_adamw){ .param = param,
				      .grad = grad,
				      .exp_avg = m,
				      .exp_avg_sq = v,
				      .max_exp_avg_sq = vmax,
				      .grad_dtype = SHARDD_DTYPE_FP32,
				      .step = 1,
				      .lr = 1e-3,
				      .beta1 = 0.9,
				      .beta2 = 0.999,
				      .eps = 1e-8,
				      .amsgrad = 1,
				      .grad_scale = 1.0f };
}

Test(cuda_optim_args, sgd_refuses_a_bad_grad_dtype_step_zero_and_momentum_without_a_buffer,
     .timeout = 10)
{
	struct shardd_sgd a = sgd_ok();

	a.grad_dtype = 99;
	cr_assert_eq(shardd_cuda_sgd(&a, 0, 4, NULL), -SHARDD_E_INVALID, "grad dtype 99");
	a = sgd_ok();
	a.step = 0;
	cr_assert_eq(shardd_cuda_sgd(&a, 0, 4, NULL), -SHARDD_E_INVALID, "step 0");
	a = sgd_ok();
	a.momentum_buffer = NULL;
	cr_assert_eq(shardd_cuda_sgd(&a, 0, 4, NULL), -SHARDD_E_INVALID,
		     "momentum 0.9 without a buffer");
	/* Without momentum no buffer is needed: an empty range is then accepted and launches nothing. */
	a.momentum = 0.0;
	cr_assert_eq(shardd_cuda_sgd(&a, 3, 3, NULL), 0);
	cr_assert_eq(shardd_cuda_sgd(&a, 4, 2, NULL), 0);
}

Test(cuda_optim_args, adamw_refuses_missing_state_and_amsgrad_without_its_buffer, .timeout = 10)
{
	struct shardd_adamw a = adamw_ok();

	a.exp_avg = NULL;
	cr_assert_eq(shardd_cuda_adamw(&a, 0, 4, NULL), -SHARDD_E_INVALID, "no exp_avg");
	a = adamw_ok();
	a.exp_avg_sq = NULL;
	cr_assert_eq(shardd_cuda_adamw(&a, 0, 4, NULL), -SHARDD_E_INVALID, "no exp_avg_sq");
	a = adamw_ok();
	a.max_exp_avg_sq = NULL;
	cr_assert_eq(shardd_cuda_adamw(&a, 0, 4, NULL), -SHARDD_E_INVALID,
		     "amsgrad without max_exp_avg_sq");
	a = adamw_ok();
	a.grad_dtype = SHARDD_DTYPE_NONE;
	cr_assert_eq(shardd_cuda_adamw(&a, 0, 4, NULL), -SHARDD_E_INVALID, "grad dtype none");
	a = adamw_ok();
	a.step = 0;
	cr_assert_eq(shardd_cuda_adamw(&a, 0, 4, NULL), -SHARDD_E_INVALID, "step 0");
	/* Without amsgrad its buffer is not needed. */
	a = adamw_ok();
	a.amsgrad = 0;
	a.max_exp_avg_sq = NULL;
	cr_assert_eq(shardd_cuda_adamw(&a, 2, 2, NULL), 0);
}

Test(cuda_optim_args, nonfinite_and_grad_norm_refuse_what_they_cannot_read, .timeout = 10)
{
	uint32_t flag = 0;
	double ws[SHARDD_CUDA_NORM_WS];

	cr_assert_eq(shardd_cuda_nonfinite(grad, SHARDD_DTYPE_FP32, 0, 4, NULL, NULL),
		     -SHARDD_E_INVALID, "no flag");
	cr_assert_eq(shardd_cuda_nonfinite(grad, 99, 0, 4, &flag, NULL), -SHARDD_E_INVALID,
		     "grad dtype 99");
	cr_assert_eq(shardd_cuda_nonfinite(grad, SHARDD_DTYPE_BF16, 4, 4, &flag, NULL), 0,
		     "empty range");
	cr_assert_eq(flag, 0u, "an empty range wrote the flag");
	cr_assert_eq(shardd_cuda_grad_norm_part(grad, 99, 0, 4, ws, NULL), -SHARDD_E_INVALID,
		     "grad dtype 99");
}
#else
Test(cuda_optim_args, built_without_cuda, .timeout = 10)
{
	cr_skip_test(
		"built without CUDA (make CUDA=1 with nvcc and nccl.h): no CUDA kernels to check");
}
#endif
