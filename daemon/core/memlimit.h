/* SPDX-License-Identifier: MIT */
/*
 * Memory limits (--max-memory, --max-job-memory): their default, read
 * from the node's physical memory and the daemon's cgroup memory limit, and
 * byte counts as people write and read them. The engine enforces the
 * limits at registration (registry.c: every buffer a group will ever need is
 * counted and committed before the group exists).
 */
#ifndef SHD_MEMLIMIT_H
#define SHD_MEMLIMIT_H

#include <stddef.h>
#include <stdint.h>

/* The default --max-memory is this percentage of the memory the daemon may use. */
#define SHD_MAX_MEMORY_DEFAULT_PERCENT 80

/*
 * Parse a byte count: decimal digits, optionally followed by K, M, G or T
 * (powers of 1024, upper or lower case, an optional "iB" or "B" after
 * them). 0 and *out, or -EINVAL (not a count, or past 2^64 - 1 bytes).
 */
int shd_memlimit_parse(const char *s, uint64_t *out);

/* "512 B", "64.0 MiB", "1.5 TiB" into buf; returns buf. */
const char *shd_memlimit_str(uint64_t bytes, char *buf, size_t len);

/*
 * The memory limit of the cgroups named in `proc_cgroup` (a file in the
 * format of /proc/self/cgroup) under `cgroup_root` (/sys/fs/cgroup): the
 * lowest memory.max of the cgroup v2 ("0::/path") and its ancestors, and
 * memory.limit_in_bytes of the cgroup v1 memory controller
 * ("N:memory:/path", under cgroup_root/memory) and its ancestors; or
 * UINT64_MAX when none is set ("max", absent, unreadable).
 */
uint64_t shd_memlimit_cgroup_max(const char *proc_cgroup, const char *cgroup_root);

/*
 * The default --max-memory: SHD_MAX_MEMORY_DEFAULT_PERCENT of the
 * physical memory, or of the daemon's cgroup limit when one is set and
 * lower. `from` (may be NULL) says which, for the log and shardctl status:
 * "80% of physical memory (23.4 GiB)". 0 and *out, or -EIO when the
 * physical memory cannot be read.
 */
int shd_memlimit_default(uint64_t *out, char *from, size_t fromlen);

#endif /* SHD_MEMLIMIT_H */
