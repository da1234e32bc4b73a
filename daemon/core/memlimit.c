/* SPDX-License-Identifier: MIT */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "memlimit.h"

int shd_memlimit_parse(const char *s, uint64_t *out)
{
	static const char suffixes[] = "KMGT";
	unsigned long long v;
	const char *at;
	char *end;
	int shift = 0;

	if (!s || !isdigit((unsigned char)*s))
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno)
		return -EINVAL;
	if (*end) {
		at = strchr(suffixes, toupper((unsigned char)*end));
		if (!at)
			return -EINVAL;
		shift = 10 * (int)(at - suffixes + 1);
		end++;
		if (*end && strcasecmp(end, "iB") && strcasecmp(end, "B"))
			return -EINVAL;
		if (v > (UINT64_MAX >> shift))
			return -EINVAL;
	}
	*out = (uint64_t)v << shift;
	return 0;
}

const char *shd_memlimit_str(uint64_t bytes, char *buf, size_t len)
{
	static const char *const unit[] = { "B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB" };
	double v = (double)bytes;
	int u = 0;

	while (v >= 1024 && u < 6) {
		v /= 1024;
		u++;
	}
	if (u == 0)
		snprintf(buf, len, "%llu B", (unsigned long long)bytes);
	else
		snprintf(buf, len, "%.1f %s", v, unit[u]);
	return buf;
}

#define CGROUP_DIR_MAX 4200 /* a cgroup root and a path of /proc/self/cgroup */

/* `file` of one cgroup directory as a number, or UINT64_MAX ("max", absent, unreadable). */
static uint64_t read_limit(const char *dir, const char *file)
{
	char path[CGROUP_DIR_MAX + 32], text[64];
	unsigned long long v;
	char *end;
	FILE *f;

	if ((size_t)snprintf(path, sizeof(path), "%s/%s", dir, file) >= sizeof(path))
		return UINT64_MAX;
	f = fopen(path, "re");
	if (!f)
		return UINT64_MAX;
	if (!fgets(text, sizeof(text), f)) {
		fclose(f);
		return UINT64_MAX;
	}
	fclose(f);
	errno = 0;
	v = strtoull(text, &end, 10);
	if (errno || end == text || (*end && *end != '\n'))
		return UINT64_MAX;
	return v;
}

/* The lowest `file` of cgroup `path` (from /proc/self/cgroup) under `root` and of its ancestors. */
static uint64_t lowest_limit(const char *root, const char *path, const char *file)
{
	char dir[CGROUP_DIR_MAX];
	uint64_t lowest = UINT64_MAX;
	size_t root_len = strlen(root);

	if ((size_t)snprintf(dir, sizeof(dir), "%s%s", root, path) >= sizeof(dir))
		return UINT64_MAX;
	for (;;) {
		char *slash = strrchr(dir + root_len, '/');
		uint64_t v = read_limit(dir, file);

		if (v < lowest)
			lowest = v;
		if (!slash || slash == dir + root_len)
			break;
		*slash = '\0';
	}
	return lowest;
}

uint64_t shd_memlimit_cgroup_max(const char *proc_cgroup, const char *cgroup_root)
{
	char line[4096], root[CGROUP_DIR_MAX];
	uint64_t lowest = UINT64_MAX, v;
	FILE *f;

	f = fopen(proc_cgroup, "re");
	if (!f)
		return UINT64_MAX;
	while (fgets(line, sizeof(line), f)) {
		char *ctrl = strchr(line, ':'), *path = ctrl ? strchr(ctrl + 1, ':') : NULL;

		if (!path)
			continue;
		*path++ = '\0';
		*ctrl++ = '\0';
		path[strcspn(path, "\n")] = '\0';
		if (path[0] != '/')
			continue;
		if (strcmp(line, "0") == 0 && !ctrl[0]) {
			/* cgroup v2: "0::/path" */
			v = lowest_limit(cgroup_root, path, "memory.max");
		} else if (strstr(ctrl, "memory") &&
			   (size_t)snprintf(root, sizeof(root), "%s/memory", cgroup_root) <
				   sizeof(root)) {
			/* cgroup v1: "4:memory:/path" (the controller may be listed with others) */
			v = lowest_limit(root, path, "memory.limit_in_bytes");
		} else {
			continue;
		}
		if (v < lowest)
			lowest = v;
	}
	fclose(f);
	return lowest;
}

int shd_memlimit_default(uint64_t *out, char *from, size_t fromlen)
{
	long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
	uint64_t phys, cg, base;
	char a[32];

	if (pages <= 0 || page <= 0)
		return -EIO;
	phys = (uint64_t)pages * (uint64_t)page;
	cg = shd_memlimit_cgroup_max("/proc/self/cgroup", "/sys/fs/cgroup");
	base = cg < phys ? cg : phys;
	/* Split so that no product overflows, whatever base is. */
	*out = base / 100 * SHD_MAX_MEMORY_DEFAULT_PERCENT +
	       base % 100 * SHD_MAX_MEMORY_DEFAULT_PERCENT / 100;
	if (from)
		snprintf(from, fromlen, "%d%% of %s (%s)", SHD_MAX_MEMORY_DEFAULT_PERCENT,
			 cg < phys ? "the cgroup memory limit" : "physical memory",
			 shd_memlimit_str(base, a, sizeof(a)));
	return 0;
}
