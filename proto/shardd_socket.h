/* SPDX-License-Identifier: MIT */
/*
 * Where the control socket lives (PROTOCOL.md "Connecting"). The one
 * resolver of the daemon (its default path), libshardd and shardctl (a
 * given path, else $SHARDD_SOCKET, else the daemon's default). The Python
 * client mirrors it in client/python/shardd/client.py (default_socket_path):
 * change both together. libc only.
 */
#ifndef SHARDD_SOCKET_H
#define SHARDD_SOCKET_H

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#define SHARDD_SOCKET_ENV    "SHARDD_SOCKET" /* clients' override; the daemon ignores it */
#define SHARDD_SOCKET_SYSTEM "/run/shardd/shardd.sock" /* no $XDG_RUNTIME_DIR: a system service */

/*
 * The daemon's default socket path into out: $XDG_RUNTIME_DIR/shardd/shardd.sock,
 * else /run/shardd/shardd.sock. Returns the path's length as snprintf does:
 * len or more means out holds it cut short.
 */
static inline int shardd_socket_path_default(char *out, size_t len)
{
	const char *xdg = getenv("XDG_RUNTIME_DIR");

	if (xdg && *xdg)
		return snprintf(out, len, "%s/shardd/shardd.sock", xdg);
	return snprintf(out, len, "%s", SHARDD_SOCKET_SYSTEM);
}

/*
 * The socket path a client connects to, into out: given when it is neither
 * NULL nor "" (an unset string field of a zeroed options struct), else
 * $SHARDD_SOCKET, else shardd_socket_path_default(). Returns as
 * shardd_socket_path_default().
 */
static inline int shardd_socket_path_resolve(const char *given, char *out, size_t len)
{
	const char *env = getenv(SHARDD_SOCKET_ENV);

	if (given && *given)
		return snprintf(out, len, "%s", given);
	if (env && *env)
		return snprintf(out, len, "%s", env);
	return shardd_socket_path_default(out, len);
}

#endif /* SHARDD_SOCKET_H */
