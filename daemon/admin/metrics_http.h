/* SPDX-License-Identifier: MIT */
/*
 * --metrics-listen: GET /metrics over HTTP, the Prometheus text exposition
 * of shd_admin_metrics_render() (admin.h). libmicrohttpd runs without a
 * thread of its own: its epoll fd is a file event of the daemon's loop, so
 * every request is answered on the loop thread, which owns all the state
 * the exposition reads.
 */
#ifndef SHD_METRICS_HTTP_H
#define SHD_METRICS_HTTP_H

#include <stddef.h>

struct shd_loop;
struct shd_metrics_http;

/*
 * Parse "[ADDR:]PORT" (ADDR a host name, an IPv4 address or a bracketed
 * IPv6 one; 127.0.0.1 when absent; PORT 0..65535, 0 picks a free one) into
 * host and port. Returns 0, or -EINVAL with a sentence for the user in err.
 */
int shd_metrics_http_parse(const char *spec, char *host, size_t host_len, char *port,
			   size_t port_len, char *err, size_t errlen);

/*
 * Listen on `spec` and serve from `loop`. Returns 0 and *out, or a negative
 * errno after printing why on stderr.
 */
int shd_metrics_http_start(const char *spec, struct shd_loop *loop, struct shd_metrics_http **out);

/* "http://127.0.0.1:9464/metrics": where it listens (the port picked for 0). */
const char *shd_metrics_http_url(const struct shd_metrics_http *h);

/* Close every connection and the listening socket; NULL is a no-op. */
void shd_metrics_http_stop(struct shd_metrics_http *h, struct shd_loop *loop);

#endif /* SHD_METRICS_HTTP_H */
