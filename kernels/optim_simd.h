/* SPDX-License-Identifier: MIT */
/*
 * The vector loops of the optimizer kernels, written once and compiled
 * once per instruction set: optim.c defines the vector type and its
 * operations and includes this file, once for AVX2 and once for AVX-512.
 * Each loop applies, lane by lane, exactly the fp32 operations of the
 * scalar functions in optim.c (sgd_one, adamw_one), in the same order, so
 * every path gives the same bits; the elements after the last whole vector
 * go through those scalar functions.
 *
 * Expects: OPT_ISA (the name suffix), OPT_TARGET (the target attribute),
 * V (the vector type), W (its lanes), and vload, vstore, vset1, vadd, vsub,
 * vmul, vdiv, vsqrt and vmax (vmax(a, b) = a > b ? a : b, as MAXPS); it
 * undefines them all at its end.
 */

#define OPT_CAT2(a, b) a##_##b
#define OPT_CAT(a, b)  OPT_CAT2(a, b)
#define OPT_FN(name)   OPT_CAT(name, OPT_ISA)

OPT_TARGET static void OPT_FN(sgd_f32)(const struct shardd_sgd_coefs *c, float *restrict p,
				       const float *restrict g, float *restrict b, size_t n)
{
	const V gm = vset1(c->grad_mul), wd = vset1(c->weight_decay), mom = vset1(c->momentum);
	const V dc = vset1(c->damp_c), nlr = vset1(c->neg_lr);
	size_t i = 0;

	for (; i + W <= n; i += W) {
		V pi = vload(p + i), d = vmul(vload(g + i), gm);

		if (c->use_wd)
			d = vadd(d, vmul(wd, pi));
		if (c->use_momentum) {
			V bi = c->first ? d : vadd(vmul(vload(b + i), mom), vmul(dc, d));

			vstore(b + i, bi);
			d = c->nesterov ? vadd(d, vmul(mom, bi)) : bi;
		}
		vstore(p + i, vadd(pi, vmul(nlr, d)));
	}
	for (; i < n; i++)
		sgd_one(c, p + i, g[i], b ? b + i : NULL);
}

OPT_TARGET static void OPT_FN(adamw_f32)(const struct shardd_adamw_coefs *c, float *restrict p,
					 const float *restrict g, float *restrict m,
					 float *restrict v, float *restrict vmax_state, size_t n)
{
	const V gm = vset1(c->grad_mul), decay = vset1(c->decay), w = vset1(c->lerp_w);
	const V wc = vset1(c->lerp_wc), b2 = vset1(c->beta2), b2c = vset1(c->beta2c);
	const V bc2 = vset1(c->bc2_sqrt), eps = vset1(c->eps), nss = vset1(c->neg_step_size);
	size_t i = 0;

	for (; i + W <= n; i += W) {
		V gi = vmul(vload(g + i), gm);
		V pi = vmul(vload(p + i), decay);
		V mi = vload(m + i), vi = vload(v + i), den;

		mi = c->lerp_small ? vadd(mi, vmul(w, vsub(gi, mi)))
				   : vsub(gi, vmul(vsub(gi, mi), wc));
		vi = vadd(vmul(vi, b2), vmul(vmul(b2c, gi), gi));
		vstore(m + i, mi);
		vstore(v + i, vi);
		if (c->amsgrad) {
			vi = vmax(vload(vmax_state + i), vi);
			vstore(vmax_state + i, vi);
		}
		den = vadd(vdiv(vsqrt(vi), bc2), eps);
		vstore(p + i, vadd(pi, vdiv(vmul(nss, mi), den)));
	}
	for (; i < n; i++)
		adamw_one(c, p + i, g[i], m + i, v + i, vmax_state ? vmax_state + i : NULL);
}

#undef OPT_FN
#undef OPT_CAT
#undef OPT_CAT2
/* The parameters too, so the next instruction set defines its own. */
#undef OPT_ISA
#undef OPT_TARGET
#undef V
#undef W
#undef vload
#undef vstore
#undef vset1
#undef vadd
#undef vsub
#undef vmul
#undef vdiv
#undef vsqrt
#undef vmax
