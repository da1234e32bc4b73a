/* SPDX-License-Identifier: MIT */
/*
 * shardctl: inspect a running shardd through admin requests, and end a job
 * (proto/PROTOCOL.md "Admin requests"). shardctl.c parses the command line
 * and talks to the daemon; render.c prints replies for people.
 */
#ifndef SHARDCTL_H
#define SHARDCTL_H

#include <stdio.h>

#include <jansson.h>

/* Human output of one command's successful reply `r` on `f`. */
void shardctl_render_status(FILE *f, const json_t *r);
void shardctl_render_jobs(FILE *f, const json_t *r);
void shardctl_render_ranks(FILE *f, const json_t *r);
void shardctl_render_groups(FILE *f, const json_t *r);
void shardctl_render_show(FILE *f, const json_t *r);
void shardctl_render_dump(FILE *f, const json_t *r);
void shardctl_render_stats(FILE *f, const json_t *r);
void shardctl_render_end(FILE *f, const json_t *r);

#endif /* SHARDCTL_H */
