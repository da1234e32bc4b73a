/* SPDX-License-Identifier: MIT */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rendezvous.h"

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

	return (x > y) - (x < y);
}

int shd_rdv_init(struct shd_rdv *r, const uint32_t *ranks, uint32_t n)
{
	memset(r, 0, sizeof(*r));
	if (n == 0)
		return -EINVAL;
	r->ranks = malloc(sizeof(*r->ranks) * n);
	r->arrived = calloc(n, sizeof(*r->arrived));
	r->gave_up = calloc(n, sizeof(*r->gave_up));
	if (!r->ranks || !r->arrived || !r->gave_up)
		goto err_nomem;
	memcpy(r->ranks, ranks, sizeof(*r->ranks) * n);
	qsort(r->ranks, n, sizeof(*r->ranks), cmp_u32);
	for (uint32_t i = 1; i < n; i++)
		if (r->ranks[i] == r->ranks[i - 1])
			goto err_inval;
	r->nexpected = n;
	return 0;

err_inval:
	shd_rdv_free(r);
	return -EINVAL;
err_nomem:
	shd_rdv_free(r);
	return -ENOMEM;
}

void shd_rdv_free(struct shd_rdv *r)
{
	free(r->ranks);
	free(r->arrived);
	free(r->gave_up);
	memset(r, 0, sizeof(*r));
}

void shd_rdv_reset(struct shd_rdv *r)
{
	if (r->arrived)
		memset(r->arrived, 0, r->nexpected);
	r->narrived = 0;
	r->step = 0;
	r->flags = 0;
	r->first_rank = 0;
	r->deadline_ns = 0;
	r->active = 0;
}

/* Index of `rank` in the expected set, or -ENOENT. */
static int64_t rdv_index(const struct shd_rdv *r, uint32_t rank)
{
	uint32_t lo = 0, hi = r->nexpected;

	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;

		if (r->ranks[mid] == rank)
			return mid;
		if (r->ranks[mid] < rank)
			lo = mid + 1;
		else
			hi = mid;
	}
	return -ENOENT;
}

int shd_rdv_expects(const struct shd_rdv *r, uint32_t rank)
{
	return rdv_index(r, rank) >= 0;
}

int shd_rdv_has_arrived(const struct shd_rdv *r, uint32_t rank)
{
	int64_t i = rdv_index(r, rank);

	return i >= 0 && r->arrived[i];
}

int shd_rdv_arrive(struct shd_rdv *r, uint32_t rank, uint64_t step, uint32_t flags, uint64_t now_ns,
		   uint64_t timeout_ns, char *err, size_t errlen)
{
	int64_t i = rdv_index(r, rank);

	if (errlen)
		err[0] = '\0';
	if (i < 0) {
		snprintf(err, errlen, "rank %u is not part of this rendezvous",
			 r->shown_base + rank);
		return -EINVAL;
	}
	if (r->arrived[i]) {
		snprintf(err, errlen,
			 "rank %u submitted step %llu while its step %llu is still waiting",
			 r->shown_base + rank, (unsigned long long)step,
			 (unsigned long long)r->step);
		return -EINVAL;
	}
	if (r->gave_up[i] == SHD_RDV_GAVE_UP_LATE) {
		/* Its first arrival since the expiry settles it: late with that key, or moved on. */
		r->gave_up[i] = SHD_RDV_GAVE_UP_NONE;
		/* Others who came back with the same key are waiting for it: it joins them. */
		if (step == r->gave_up_step && flags == r->gave_up_flags &&
		    !(r->active && r->step == step && r->flags == flags))
			return SHD_RDV_LATE;
	}
	if (!r->active) {
		r->active = 1;
		r->step = step;
		r->flags = flags;
		r->first_rank = rank;
		r->deadline_ns =
			timeout_ns > UINT64_MAX - now_ns ? UINT64_MAX : now_ns + timeout_ns;
	} else if (r->step != step || r->flags != flags) {
		snprintf(
			err, errlen,
			"rank %u submitted step %llu flags 0x%x but rank %u submitted step %llu flags 0x%x",
			r->shown_base + rank, (unsigned long long)step, flags,
			r->shown_base + r->first_rank, (unsigned long long)r->step, r->flags);
		return SHD_RDV_MISMATCH;
	}
	r->arrived[i] = 1;
	r->narrived++;
	return r->narrived == r->nexpected ? SHD_RDV_COMPLETE : SHD_RDV_WAIT;
}

int shd_rdv_leave(struct shd_rdv *r, uint32_t rank)
{
	int64_t i = rdv_index(r, rank);

	if (i < 0 || !r->arrived[i])
		return 0;
	r->arrived[i] = 0;
	r->narrived--;
	return 1;
}

int shd_rdv_expired(const struct shd_rdv *r, uint64_t now_ns)
{
	return r->active && now_ns >= r->deadline_ns;
}

void shd_rdv_expire(struct shd_rdv *r, uint64_t now_ns)
{
	for (uint32_t i = 0; i < r->nexpected; i++)
		r->gave_up[i] = r->arrived[i] ? SHD_RDV_GAVE_UP_WAITED : SHD_RDV_GAVE_UP_LATE;
	r->gave_up_step = r->step;
	r->gave_up_flags = r->flags;
	r->gave_up_ns = now_ns;
}

/* Longest rank phrase shd_rdv_missing_msg holds ("..." ends a longer one). */
#define RDV_WHO_MAX 1024

/* Comma-separated list of expected ranks whose state in `of` (arrived or gave_up) is `want`, but `skip`. */
static void rdv_list(const struct shd_rdv *r, const uint8_t *of, uint8_t want, uint32_t skip,
		     char *buf, size_t len)
{
	size_t off = 0;

	if (!len)
		return;
	buf[0] = '\0';
	for (uint32_t i = 0; i < r->nexpected; i++) {
		int n;

		if (of[i] != want || r->ranks[i] == skip)
			continue;
		n = snprintf(buf + off, len - off, "%s%u", off ? "," : "",
			     r->shown_base + r->ranks[i]);
		if (n < 0 || (size_t)n >= len - off) {
			/* Truncated: end with "..." where it fits, so a reader sees the list is longer. */
			if (len >= 4)
				memcpy(buf + len - 4, "...", 4);
			return;
		}
		off += (size_t)n;
	}
}

void shd_rdv_missing(const struct shd_rdv *r, char *buf, size_t len)
{
	rdv_list(r, r->arrived, 0, UINT32_MAX, buf, len);
}

void shd_rdv_present(const struct shd_rdv *r, char *buf, size_t len)
{
	rdv_list(r, r->arrived, 1, UINT32_MAX, buf, len);
}

void shd_rdv_failing(const struct shd_rdv *r, uint32_t rank, char *buf, size_t len)
{
	size_t off = 0;

	if (!len)
		return;
	buf[0] = '\0';
	for (uint32_t i = 0; i < r->nexpected && off < len; i++)
		if (r->arrived[i] || r->ranks[i] == rank)
			off += (size_t)snprintf(buf + off, len - off, "%s%u", off ? "," : "",
						r->shown_base + r->ranks[i]);
}

/* "rank 3" / "ranks 3,5" / "no rank": the `n` ranks whose state in `of` is `want`, but `skip`. */
static void rdv_who(const struct shd_rdv *r, const uint8_t *of, uint8_t want, uint32_t skip,
		    uint32_t n, char *buf, size_t len)
{
	int off;

	if (!n) {
		snprintf(buf, len, "no rank");
		return;
	}
	off = snprintf(buf, len, "%s ", n == 1 ? "rank" : "ranks");
	if (off >= 0 && (size_t)off < len)
		rdv_list(r, of, want, skip, buf + off, len - (size_t)off);
}

void shd_rdv_who_missing(const struct shd_rdv *r, char *buf, size_t len)
{
	rdv_who(r, r->arrived, 0, UINT32_MAX, r->nexpected - r->narrived, buf, len);
}

void shd_rdv_who_present(const struct shd_rdv *r, char *buf, size_t len)
{
	rdv_who(r, r->arrived, 1, UINT32_MAX, r->narrived, buf, len);
}

void shd_rdv_who_present_but(const struct shd_rdv *r, uint32_t rank, char *buf, size_t len)
{
	rdv_who(r, r->arrived, 1, rank, r->narrived - (uint32_t)shd_rdv_has_arrived(r, rank), buf,
		len);
}

void shd_rdv_missing_msg(const struct shd_rdv *r, const char *did, const char *within, char *buf,
			 size_t len)
{
	char missing[RDV_WHO_MAX] = "", present[RDV_WHO_MAX] = "";
	size_t part = len / 3 < sizeof(missing) ? len / 3 : sizeof(missing);

	shd_rdv_who_missing(r, missing, part);
	shd_rdv_who_present(r, present, part);
	snprintf(buf, len, "%s %s within %s; %s %s waiting", missing, did, within, present,
		 r->narrived == 1 ? "is" : "are");
}

void shd_rdv_late_msg(const struct shd_rdv *r, uint32_t rank, const char *did, const char *within,
		      uint64_t now_ns, char *buf, size_t len)
{
	char waited[RDV_WHO_MAX] = "";
	size_t part = len / 2 < sizeof(waited) ? len / 2 : sizeof(waited);
	uint32_t n = 0;

	for (uint32_t i = 0; i < r->nexpected; i++)
		n += r->gave_up[i] == SHD_RDV_GAVE_UP_WAITED;
	rdv_who(r, r->gave_up, SHD_RDV_GAVE_UP_WAITED, UINT32_MAX, n, waited, part);
	snprintf(
		buf, len,
		"rank %u %s %.2f s after %s gave up waiting for it (the collective timeout, %s); failed at once: "
		"retry with the others",
		r->shown_base + rank, did,
		(double)(now_ns > r->gave_up_ns ? now_ns - r->gave_up_ns : 0) / 1e9, waited,
		within);
}
