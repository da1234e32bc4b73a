/* SPDX-License-Identifier: MIT */
/*
 * The training example against `shardd --backend cuda`: train_mlp's ranks
 * share device 0 (--device 0), the daemon runs unshard and reduce with the
 * CUDA kernels, and the final params and the losses must match the
 * single-process reference as on the host backend (tolerances:
 * tests/lib/train.h; the CUDA kernels promise the CPU kernels' numerics,
 * so every param is expected bit-identical). Both export kinds: VMM file
 * descriptors and legacy CUDA IPC handles. Skips without a GPU.
 */
#include <criterion/criterion.h>

#include "train.h"

static void need_gpu(void)
{
	if (harness_cuda_devices() == 0)
		cr_skip_test("no CUDA device visible");
}

TestSuite(train_cuda, .init = need_gpu, .timeout = 120);

Test(train_cuda, two_ranks_on_one_gpu_match_reference)
{
	const char *args[] = { "--backend", "cuda", "--cuda-export", "fd", NULL };
	double a[TRAIN_STEPS], b[TRAIN_STEPS];

	train_parity(2, 1, args, "0", a, b);
	train_expect_losses_match(a, b, "cuda, fd export, world 2");
	cr_expect(a[TRAIN_STEPS - 1] < a[0] / 2, "loss went from %.6f to %.6f", a[0],
		  a[TRAIN_STEPS - 1]);
}

Test(train_cuda, three_ranks_uneven_shards_through_ipc_handles_match_reference)
{
	const char *args[] = { "--backend", "cuda", "--cuda-export", "ipc", NULL };
	double a[TRAIN_STEPS], b[TRAIN_STEPS];

	train_parity(3, 1, args, "0", a, b);
	train_expect_losses_match(a, b, "cuda, ipc export, world 3");
}
