/* SPDX-License-Identifier: MIT */
/*
 * The checkpoint format (docs/CHECKPOINTS.md): a directory of safetensors
 * files holding full (unsharded) tensors named by their param names, the
 * optimizer state in files of its own (`<param>.exp_avg`, ...), and a
 * manifest, `manifest.json`, holding what a job needs to be registered
 * again at any mesh: groups, param specs, policies, optimizer
 * hyperparameters, each group's applied step, and every file's size and
 * CRC-32 (zlib).
 *
 * A safetensors file is an 8-byte little-endian header length, a JSON
 * header mapping each tensor name to {dtype, shape, data_offsets} (and an
 * optional "__metadata__" of strings), then the data: tensors packed
 * back to back, offsets relative to the end of the header.
 *
 * Every file read here is untrusted: the parsers bound the header length,
 * check every offset is in range and that the tensors tile the data
 * exactly (no overlap, no hole: the safetensors rule), that each tensor's
 * bytes match its dtype and shape, and the manifest's every field; an
 * error names the field, the value and the rule.
 */
#ifndef SHD_SAFETENSORS_H
#define SHD_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "shardd_proto.h"

#define SHD_CKPT_VERSION            1 /* manifest "version" this daemon writes and reads */
#define SHD_CKPT_MANIFEST           "manifest.json"
#define SHD_CKPT_INDEX              "model.safetensors.index.json" /* Hugging Face's, when split */
#define SHD_SAFETENSORS_HEADER_MAX  (64u << 20) /* bytes of a safetensors JSON header */
#define SHD_SAFETENSORS_TENSORS_MAX (1u << 20)  /* tensors in one safetensors file */
#define SHD_CKPT_MANIFEST_MAX       (64u << 20) /* bytes of a manifest */
#define SHD_CKPT_GROUPS_MAX         65536       /* groups in a manifest */
#define SHD_CKPT_NAME_MAX           128         /* tensor names, NUL included */
#define SHD_CKPT_FILE_NAME_MAX      64          /* file names in a checkpoint, NUL included */

/* One tensor of a safetensors file. */
struct shd_safetensors_tensor {
	char name[SHD_CKPT_NAME_MAX];
	uint32_t dtype;                  /* enum shardd_dtype: F32, BF16, F16 */
	uint32_t ndim;                   /* 0..SHARDD_MAX_DIMS */
	uint64_t shape[SHARDD_MAX_DIMS]; /* first ndim used, rest zero */
	uint64_t begin, end;             /* data_offsets: bytes from the start of the data */
};

/* A parsed safetensors header. */
struct shd_safetensors_file {
	uint64_t data_start; /* 8 + header length: file offset of the data */
	uint64_t data_size;  /* bytes of data: the sum of the tensors' */
	uint32_t ntensors;
	struct shd_safetensors_tensor *tensors; /* ascending begin (file order) */
	uint32_t *by_name; /* indices into tensors, names ascending (shd_safetensors_find) */
};

/* The safetensors dtype string of a shardd dtype ("F32", "BF16", "F16"), or NULL. */
const char *shd_safetensors_dtype_name(uint32_t dtype);

/* Elements of a tensor (1 for 0-d), or UINT64_MAX when the product overflows. */
uint64_t shd_safetensors_numel(const struct shd_safetensors_tensor *t);

/*
 * Lay out `n` tensors (name, dtype, ndim, shape filled) back to back in
 * the given order: sets each begin/end, and returns in *hdr (malloc'd, the
 * caller frees) the file's first *hdrlen bytes, the 8-byte length and the
 * JSON header padded with spaces to a multiple of 8 bytes, with
 * "__metadata__" {"format": "pt"}. *data_size gets the data's bytes.
 * 0, -SHARDD_E_INVALID with `err` naming the tensor and field (a name
 * that is not UTF-8, a dtype, a duplicate name, bytes past the limits),
 * or -ENOMEM.
 */
int shd_safetensors_build(struct shd_safetensors_tensor *t, uint32_t n, uint8_t **hdr,
			  size_t *hdrlen, uint64_t *data_size, char *err, size_t errlen);

/*
 * Parse the start of a safetensors file of `file_size` bytes: `buf` holds
 * its first `len` bytes (at least 8 plus the header length the first 8
 * bytes give). Fills *out (free with shd_safetensors_free). 0, or -SHARDD_E_MALFORMED
 * with `err` naming the field, the value and the rule (file name prefixed
 * by the caller), or -ENOMEM. On error *out holds no allocation.
 */
int shd_safetensors_parse(const uint8_t *buf, size_t len, uint64_t file_size,
			  struct shd_safetensors_file *out, char *err, size_t errlen);

/*
 * Read and parse the header of the safetensors file open at `fd`, named
 * `path` in errors. 0, -SHARDD_E_MALFORMED, -ENOMEM or -errno, with `err`.
 */
int shd_safetensors_read(int fd, const char *path, struct shd_safetensors_file *out, char *err,
			 size_t errlen);

/* The tensor named `name`, or NULL. */
const struct shd_safetensors_tensor *shd_safetensors_find(const struct shd_safetensors_file *f,
							  const char *name);

/* Release what shd_safetensors_parse allocated; safe on a zeroed file. */
void shd_safetensors_free(struct shd_safetensors_file *f);

/* ------------------------------------------------------------------ */
/* Manifest                                                            */
/* ------------------------------------------------------------------ */

struct shd_ckpt_file {
	/* a plain file name: no '/', not "." or "..", no leading '.' */
	char name[SHD_CKPT_FILE_NAME_MAX];
	uint64_t bytes;
	uint32_t crc32; /* zlib crc32 of the whole file */
};

struct shd_ckpt_group {
	/* name, nparams, param_dtype, reduce_dtype, flags; init 0 */
	struct shardd_register_group hdr;
	struct shardd_param_spec *specs;  /* hdr.nparams */
	struct shardd_optim_config optim; /* kind NONE: no optimizer */
	uint64_t last_step;               /* last step applied or skipped on every rank */
	/* updates applied (torch's state['step']); the most of any rank shard */
	uint64_t optim_steps;
	/*
	 * [manifest's shard]: each rank shard's updates, when a rank skipped a step alone
	 * (SHARDD_STEP_SKIP_NONFINITE); NULL: all optim_steps
	 */
	uint64_t *shard_optim_steps;
	char file[SHD_CKPT_FILE_NAME_MAX];       /* its params */
	char optim_file[SHD_CKPT_FILE_NAME_MAX]; /* its optimizer state; "" when it keeps none */
};

struct shd_ckpt_manifest {
	uint32_t version; /* SHD_CKPT_VERSION */
	char job[SHARDD_NAME_MAX];
	uint64_t step;             /* the step boundary it was taken at */
	uint32_t replicate, shard; /* the mesh that saved it */
	uint32_t ngroups;
	struct shd_ckpt_group *groups;
	uint32_t nfiles;
	struct shd_ckpt_file *files; /* every safetensors file, each once */
};

/*
 * The manifest as JSON text (malloc'd, NUL-terminated, the caller frees).
 * 0, -SHARDD_E_INVALID with `err` (a name that is not UTF-8), or -ENOMEM.
 */
int shd_ckpt_manifest_dump(const struct shd_ckpt_manifest *m, char **json, char *err,
			   size_t errlen);

/*
 * Parse and validate a manifest (`len` bytes, untrusted) into *out (free
 * with shd_ckpt_manifest_free): every field's type and range, names
 * unique, every group's files listed in "files", each param spec valid for
 * some shard group size. 0, -SHARDD_E_MALFORMED with `err` naming the
 * field (its JSON path), the value and the rule, or -ENOMEM. On error *out
 * holds no allocation.
 */
int shd_ckpt_manifest_parse(const char *buf, size_t len, struct shd_ckpt_manifest *out, char *err,
			    size_t errlen);

/* Release a parsed manifest; safe on a zeroed one. */
void shd_ckpt_manifest_free(struct shd_ckpt_manifest *m);

/* The file entry named `name`, or NULL. */
const struct shd_ckpt_file *shd_ckpt_manifest_file(const struct shd_ckpt_manifest *m,
						   const char *name);

/*
 * Names of group `i`'s files in a checkpoint of `n` groups: "model.safetensors"
 * and "optim.safetensors" when n == 1, else the Hugging Face split names
 * "model-00002-of-00003.safetensors", "optim-00002-of-00003.safetensors".
 */
void shd_ckpt_file_names(uint32_t i, uint32_t n, char model[SHD_CKPT_FILE_NAME_MAX],
			 char optim[SHD_CKPT_FILE_NAME_MAX]);

/*
 * The tensors of group `g`'s params file (with `optim` 0) or optimizer-state
 * file (`optim` 1, `nstates` states named by `states`): name, dtype, ndim
 * and shape, in order; params in spec order, states param-major
 * ("w.exp_avg", "w.exp_avg_sq", "b.exp_avg", ...). *out malloc'd.
 * 0 or -ENOMEM.
 */
int shd_ckpt_group_tensors(const struct shd_ckpt_group *g, int optim, uint32_t nstates,
			   const char *const *states, struct shd_safetensors_tensor **out,
			   uint32_t *n);

/*
 * The Hugging Face index (model.safetensors.index.json) of a manifest's
 * params files: {"metadata": {"total_size": bytes of tensors},
 * "weight_map": {param: file}}. `total_size` is the params' data bytes.
 * *json malloc'd. 0, -SHARDD_E_INVALID with `err` (a param name in two
 * groups), or -ENOMEM.
 */
int shd_ckpt_index_dump(const struct shd_ckpt_manifest *m, uint64_t total_size, char **json,
			char *err, size_t errlen);

#endif /* SHD_SAFETENSORS_H */
