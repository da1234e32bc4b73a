/* SPDX-License-Identifier: MIT */
/*
 * What the engine's checkpoint files share: a checkpoint being written
 * (ckpt_save.c) and one armed for the next step boundary (ckpt_arm.c).
 * ckpt_arm.c sits above ckpt_save.c: it starts checkpoints through
 * eng_ckpt_start; ckpt_save.c calls nothing of it.
 */
#ifndef SHD_CKPT_INT_H
#define SHD_CKPT_INT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt_files.h"
#include "safetensors.h"
#include "engine_int.h"

/* A checkpoint armed for the next step boundary (shd_engine_job_checkpoint_arm). */
struct eng_ckpt_req {
	uint64_t id;
	char *dir; /* NULL: keep_root/step-N */
	char *keep_root;
	uint32_t keep;
};

struct eng_ckpt {
	struct shd_engine_job *j;
	uint64_t id;
	struct shd_ckpt_manifest m; /* groups and files; file sizes and CRCs filled by the tasks */
	struct eng_group **egs;     /* [m.ngroups] */
	/* [2 * m.ngroups]: group i's params and optimizer file in m.files, or -1 */
	int32_t *file_of;
	char *dir, *tmp, *parent, *keep_root;
	uint32_t keep;
	int dirfd;           /* the temporary directory */
	uint32_t pending;    /* SAVE and SAVE_WRITE tasks not yet delivered */
	uint64_t staged;     /* bytes of staging memory committed (0: written in place) */
	uint8_t **stage;     /* [2 * m.ngroups]: a file's image (header, tensors), until written */
	uint64_t *stage_len; /* [2 * m.ngroups]: its bytes */
	struct dio_file *sfiles;  /* [2 * m.ngroups]: its file, open while stage is set */
	struct ckpt_pace pace;    /* --checkpoint-rate: the bound on the snapshot files' writes */
	struct eng_task **wtasks; /* [m.ngroups]: a group's SAVE_WRITE being written, or NULL */
	pthread_t *threads; /* [m.ngroups]: the thread of its own running its SAVE or SAVE_WRITE */
	uint8_t *thread_on; /* [m.ngroups]: 1 while threads[i] is to be joined */
	int res;            /* the first failure */
	char msg[ENGINE_MSG_MAX];
	uint64_t bytes; /* written, all files (atomic: pool threads add as they write) */
	uint64_t total; /* the tensors' bytes of all files (headers not counted) */
	uint64_t start_ns;
	shd_engine_ckpt_fn done;
	void *ctx;
};

/*
 * Loop thread: start writing a checkpoint of the job with id `id` into
 * tg->dir (shd_engine_job_checkpoint, engine.h, says what it checks).
 * 0: `done` will be called; else a negative code with `err`.
 */
int eng_ckpt_start(struct shd_engine_job *j, const struct shd_engine_ckpt_target *tg, uint64_t id,
		   shd_engine_ckpt_fn done, void *ctx, char *err, size_t errlen);
/*
 * Loop thread: a checkpoint that could not start (or failed) as the job's
 * last one, read by `shardctl checkpoints` and the metrics; logged.
 */
void eng_ckpt_record_failure(struct shd_engine_job *j, uint64_t id, int res, const char *msg,
			     const char *dir, uint64_t step);
/* Release an armed request; safe on NULL. */
void eng_ckpt_req_free(struct eng_ckpt_req *r);

#endif /* SHD_CKPT_INT_H */
