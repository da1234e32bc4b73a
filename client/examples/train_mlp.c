/* SPDX-License-Identifier: MIT */
/*
 * train_mlp: a real FSDP2 (ZeRO-3) training run through shardd.
 *
 * A 3-layer MLP learns a fixed random teacher network on synthetic data,
 * one parameter group per layer, every rank running FSDP2's schedule with
 * reshard_after_forward=True. The example is three modules under mlp/:
 *
 *   model.[ch]    the model in fp32 and --reference, the same run in one
 *                 process on the union of the ranks' batches
 *   trainer.[ch]  one rank attached to shardd: the schedule, retries of a
 *                 step a dead rank broke, re-attach with --resume-step
 *   launch.[ch]   the command line and the --spawn N supervisor
 *
 * The tests' fault injection (a rank that kills itself in the middle of a
 * reduce, and its restart) is tests/integration/train_mlp_faults.c, built
 * on the same modules (client/examples/train_mlp.mk).
 */
#include <stddef.h>

#include "mlp/launch.h"
#include "mlp/model.h"
#include "mlp/trainer.h"

int main(int argc, char **argv)
{
	struct launch_opts o;
	int ret;

	if (launch_opts_parse(argc, argv, &o) < 0)
		return 2;
	if (o.reference)
		ret = mlp_reference(o.t.world, o.t.steps, o.t.dump);
	else if (o.spawn)
		ret = launch_spawn(&o.t, NULL);
	else
		ret = rank_main(&o.t, (uint32_t)o.rank, -1, NULL);
	return ret < 0 ? 1 : 0;
}
