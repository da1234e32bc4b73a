/* SPDX-License-Identifier: MIT */
/*
 * Control-plane framing over a SOCK_SEQPACKET socket (PROTOCOL.md
 * "Control messages"): a message is a struct shardd_msg_hdr and `length`
 * payload bytes, split into datagrams of at most SHARDD_CTRL_CHUNK bytes.
 * File descriptors ride on the first datagram only. libc only.
 */
#ifndef SHARDD_CTRL_H
#define SHARDD_CTRL_H

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "shardd_proto.h"

#define SHARDD_CTRL_MAX_FDS 8

/* Linux's POLLRDHUP (peer shut down its writing side); <poll.h> names it only under _GNU_SOURCE. */
#define SHARDD_CTRL_POLLRDHUP 0x2000

/*
 * Send one datagram: `iov` (its bytes at most SHARDD_CTRL_CHUNK), with `fds`
 * (may be NULL) by SCM_RIGHTS. `flags` are sendmsg's (MSG_DONTWAIT for a
 * sender that must never block); MSG_NOSIGNAL is always added. Returns the
 * bytes sent (a SOCK_SEQPACKET datagram goes whole or not at all) or -errno.
 */
static inline ssize_t shardd_ctrl_send_dgram(int sock, struct iovec *iov, int iovcnt,
					     const int *fds, int nfds, int flags)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * SHARDD_CTRL_MAX_FDS)];
		struct cmsghdr align;
	} ctl;
	struct msghdr mh = { .msg_iov = iov, .msg_iovlen = (size_t)iovcnt };
	ssize_t r;

	if (nfds < 0 || nfds > SHARDD_CTRL_MAX_FDS)
		return -EINVAL;
	if (nfds > 0) {
		struct cmsghdr *c;

		memset(&ctl, 0, sizeof(ctl));
		mh.msg_control = ctl.buf;
		mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
		c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
	}
	do
		r = sendmsg(sock, &mh, flags | MSG_NOSIGNAL);
	while (r < 0 && errno == EINTR);
	return r < 0 ? -errno : r;
}

/*
 * Send one message, blocking until every datagram is sent. `fds` (may be
 * NULL) travel with SCM_RIGHTS on the first datagram. Returns 0 or -errno
 * (-EMSGSIZE when len > SHARDD_CTRL_MAX).
 */
static inline int shardd_ctrl_send(int sock, uint16_t type, uint32_t seq, const void *payload,
				   uint32_t len, const int *fds, int nfds)
{
	struct shardd_msg_hdr hdr = {
		.magic = SHARDD_MAGIC,
		.type = type,
		.flags = 0,
		.length = len,
		.seq = seq,
	};
	const uint8_t *p = payload;
	uint32_t sent = 0;
	int first = 1;

	if (len > SHARDD_CTRL_MAX)
		return -EMSGSIZE;
	if (nfds < 0 || nfds > SHARDD_CTRL_MAX_FDS)
		return -EINVAL;
	do {
		struct iovec iov[2];
		int iovcnt = 0;
		uint32_t room = SHARDD_CTRL_CHUNK - (first ? sizeof(hdr) : 0);
		uint32_t n = len - sent < room ? len - sent : room;
		ssize_t r;

		if (first)
			iov[iovcnt++] = (struct iovec){ &hdr, sizeof(hdr) };
		if (n)
			iov[iovcnt++] = (struct iovec){ (void *)(p + sent), n };
		r = shardd_ctrl_send_dgram(sock, iov, iovcnt, first ? fds : NULL, first ? nfds : 0,
					   0);
		if (r < 0)
			return (int)r;
		sent += n;
		first = 0;
	} while (sent < len);
	return 0;
}

/* Reassembly state of one incoming message. */
struct shardd_ctrl_rx {
	struct shardd_msg_hdr hdr; /* valid once a message started */
	uint8_t *payload; /* malloc'd; hdr.length bytes, owned by the caller once complete */
	uint32_t have;    /* payload bytes received so far */
	uint32_t cap;     /* bytes allocated at payload: grows with have, <= hdr.length */
	int started;      /* 1 while a message is being reassembled */
	int fds[SHARDD_CTRL_MAX_FDS]; /* received with the first datagram */
	int nfds;
};

/* Release whatever `rx` holds (payload and unclaimed fds) and reset it. */
static inline void shardd_ctrl_rx_reset(struct shardd_ctrl_rx *rx)
{
	for (int i = 0; i < rx->nfds; i++)
		close(rx->fds[i]);
	free(rx->payload);
	memset(rx, 0, sizeof(*rx));
}

/*
 * Feed one received datagram (`data`, `n` bytes, with `nfds` <=
 * SHARDD_CTRL_MAX_FDS fds, as shardd_ctrl_recv_dgram delivers). Returns 1 when
 * the message is complete (hdr, payload, fds valid; the caller takes them
 * and calls shardd_ctrl_rx_reset after clearing what it took), 0 when more
 * datagrams are needed, or a negative error: -SHARDD_E_MAGIC (wrong magic),
 * -SHARDD_E_MALFORMED (short header, or more bytes than announced),
 * -EMSGSIZE (length over `max_len`), -ENOMEM. On error, fds that `rx` did
 * not take are closed; shardd_ctrl_rx_reset() releases those it took.
 *
 * The payload buffer grows as datagrams arrive (doubling, capped at the
 * announced length), never to the announced length up front: a peer that
 * announces a large message and sends little of it makes the receiver
 * hold at most twice what it sent.
 */
static inline int shardd_ctrl_rx_feed(struct shardd_ctrl_rx *rx, const uint8_t *data, size_t n,
				      const int *fds, int nfds, uint32_t max_len)
{
	if (!rx->started) {
		if (n < sizeof(rx->hdr)) {
			for (int i = 0; i < nfds; i++)
				close(fds[i]);
			return -SHARDD_E_MALFORMED;
		}
		memcpy(&rx->hdr, data, sizeof(rx->hdr));
		data += sizeof(rx->hdr);
		n -= sizeof(rx->hdr);
		rx->started = 1;
		for (int i = 0; i < nfds; i++)
			rx->fds[rx->nfds++] = fds[i];
		if (rx->hdr.magic != SHARDD_MAGIC)
			return -SHARDD_E_MAGIC;
		if (rx->hdr.length > max_len)
			return -EMSGSIZE;
	} else {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		if (nfds)
			return -SHARDD_E_MALFORMED;
	}
	if (n > rx->hdr.length - rx->have)
		return -SHARDD_E_MALFORMED;
	if (rx->have + n > rx->cap) {
		/* have + n <= hdr.length (checked above), so the cap never passes it. */
		uint64_t cap = 2 * (uint64_t)rx->cap;
		uint8_t *p;

		if (cap > rx->hdr.length)
			cap = rx->hdr.length;
		if (cap < rx->have + n)
			cap = rx->have + n;
		p = realloc(rx->payload, (size_t)cap);
		if (!p)
			return -ENOMEM;
		rx->payload = p;
		rx->cap = (uint32_t)cap;
	}
	if (n)
		memcpy(rx->payload + rx->have, data, n);
	rx->have += (uint32_t)n;
	return rx->have == rx->hdr.length;
}

/*
 * Receive one datagram from `sock` into `buf` (SHARDD_CTRL_CHUNK bytes) and
 * its fds. `flags` are recvmsg's (MSG_DONTWAIT for a receiver that must
 * never block); MSG_CMSG_CLOEXEC is always added. Returns the bytes
 * received (> 0, with *nfds fds the caller now owns), 0 on EOF, or a
 * negative error with every fd that came already closed (*nfds = 0):
 *   -EBADMSG       a zero-length datagram (never a message: a header has
 *                  16 bytes), told from EOF by the peer's socket still being
 *                  open;
 *   -EMSGSIZE      a datagram over SHARDD_CTRL_CHUNK bytes (MSG_TRUNC);
 *   -ETOOMANYREFS  more than SHARDD_CTRL_MAX_FDS fds: the kernel dropped
 *                  the rest (MSG_CTRUNC with every slot filled);
 *   -EMFILE        the kernel dropped fds it could not install: this
 *                  process is at its fd limit (MSG_CTRUNC with slots left);
 *   -EAGAIN        MSG_DONTWAIT found nothing to read; or -errno of recvmsg.
 * A peer that closed with our data unread makes the kernel report
 * ECONNRESET once, even though its last datagrams still wait to be read:
 * that report is taken and the read retried, so a reply sent just before
 * a close (a refusal's ERROR) is never lost.
 */
static inline ssize_t shardd_ctrl_recv_dgram(int sock, uint8_t *buf, int *fds, int *nfds, int flags)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * SHARDD_CTRL_MAX_FDS)];
		struct cmsghdr align;
	} ctl;
	struct iovec iov = { buf, SHARDD_CTRL_CHUNK };
	struct msghdr mh = { .msg_iov = &iov,
			     .msg_iovlen = 1,
			     .msg_control = ctl.buf,
			     .msg_controllen = sizeof(ctl.buf) };
	int reset_seen = 0;
	ssize_t r;

	*nfds = 0;
	for (;;) {
		r = recvmsg(sock, &mh, flags | MSG_CMSG_CLOEXEC);
		if (r >= 0)
			break;
		if (errno == EINTR)
			continue;
		if (errno != ECONNRESET || reset_seen)
			return -errno;
		reset_seen = 1;
	}
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));

			for (int i = 0; i < k; i++) {
				int fd;

				memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
				if (*nfds < SHARDD_CTRL_MAX_FDS)
					fds[(*nfds)++] = fd;
				else
					close(fd);
			}
		}
	}
	if (r == 0 && *nfds == 0 && !(mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
		/* EOF and an empty datagram both read as 0 bytes: a hung-up peer is EOF. */
		struct pollfd p = { .fd = sock, .events = SHARDD_CTRL_POLLRDHUP };

		if (poll(&p, 1, 0) < 0 || (p.revents & (SHARDD_CTRL_POLLRDHUP | POLLHUP | POLLERR)))
			return 0;
		return -EBADMSG;
	}
	if (r == 0 || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
		int full = *nfds == SHARDD_CTRL_MAX_FDS;

		for (int i = 0; i < *nfds; i++)
			close(fds[i]);
		*nfds = 0;
		if (mh.msg_flags & MSG_TRUNC)
			return -EMSGSIZE;
		if (mh.msg_flags & MSG_CTRUNC)
			return full ? -ETOOMANYREFS : -EMFILE;
		return -EBADMSG;
	}
	return r;
}

/*
 * Blocking receive of one whole message, each datagram waited for at most
 * `timeout_ms` (-1: forever). Returns 0 (rx complete), -ECONNRESET on EOF,
 * -ETIMEDOUT, another negative error of shardd_ctrl_recv_dgram() or
 * shardd_ctrl_rx_feed(). No fd that came is left open on an error.
 * `rx` must be zeroed; on error it is reset.
 */
static inline int shardd_ctrl_recv(int sock, struct shardd_ctrl_rx *rx, int timeout_ms)
{
	uint8_t *buf = malloc(SHARDD_CTRL_CHUNK);
	int ret;

	if (!buf)
		return -ENOMEM;
	for (;;) {
		struct pollfd pfd = { .fd = sock, .events = POLLIN };
		int fds[SHARDD_CTRL_MAX_FDS], nfds;
		ssize_t n;

		ret = poll(&pfd, 1, timeout_ms);
		if (ret < 0 && errno == EINTR)
			continue;
		if (ret < 0) {
			ret = -errno;
			break;
		}
		if (ret == 0) {
			ret = -ETIMEDOUT;
			break;
		}
		n = shardd_ctrl_recv_dgram(sock, buf, fds, &nfds, 0);
		if (n == 0) {
			ret = -ECONNRESET;
			break;
		}
		if (n < 0) {
			ret = (int)n;
			break;
		}
		ret = shardd_ctrl_rx_feed(rx, buf, (size_t)n, fds, nfds, SHARDD_CTRL_MAX);
		if (ret != 0)
			break;
	}
	free(buf);
	if (ret == 1)
		return 0;
	shardd_ctrl_rx_reset(rx);
	return ret;
}

#endif /* SHARDD_CTRL_H */
