/* What the block kernel (kernel.c, int8_rows.c, helpers.c) gives decoder.c: they are built into one library
   (ttft_sse/engine/kernels/kernel.py), and all include this, so that a change of one of these declarations is one
   change, checked by the compiler on every side.
   So does attention.c, built into its own library, for the pointer types its two functions are called by. */

#ifndef TTFT_KERNEL_H
#define TTFT_KERNEL_H

#include <stdint.h>

/* A buffer kept by its owner (one a thread), grown to at least `floats` floats by ttft_grow (NULL if it cannot be).
   Kept, because allocating it at every call would map and fault in fresh pages. */
struct ttft_buffer {
    float *floats;
    int64_t capacity;
};
float *ttft_grow(struct ttft_buffer *b, int64_t floats);

/* y[M,N] = x[M,K] . W[N,K]^T on a layer's GGUF blocks: fp32 rows (kernel.py's panels, scales and zeros), or rows
   quantised to int8 (kernel.py's records). 0, or -1 (see kernel.c, int8_rows.c). */
int ttft_blocks_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
                       const float *zero, int64_t N, float *y);
int ttft_q8_linear(const float *x, int64_t M, int64_t K, const uint8_t *records, int bits, int64_t N, float *y);

/* attention.c's ttft_paged_attention (built into its own library, handed over as a pointer): a batched step's
   attention, whole. k and v are the KV cache's rows: fp32 values, or fp16 ones for the functions of an f16 cache
   (ttft_paged_attention_f16, ttft_attention_part_f16), their strides counted in values either way. */
typedef int (*ttft_attention_fn)(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const void *k,
                                 const void *v, int64_t key_stride, int64_t head_stride, const int64_t *index,
                                 const int32_t *cu_q, const int32_t *cu_k, int64_t requests, int64_t max_rows,
                                 float scale, float *out);

/* attention.c's ttft_attention_part (likewise): the parts (query row, KV head) first .. last-1 of a batched step's
   attention into out. */
typedef int (*ttft_attention_part_fn)(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const void *k,
                                      const void *v, int64_t key_stride, int64_t head_stride, const int64_t *index,
                                      const int32_t *cu_q, const int32_t *cu_k, int64_t requests, int64_t max_rows,
                                      float scale, int64_t first, int64_t last, float *out);

/* A batched step's attention shared with the kernel's helper threads by parts; 1 where it is not shared (the
   caller computes it alone), else 0 or -1. */
int ttft_share_attention(ttft_attention_part_fn part, const float *q, int64_t heads, int64_t kv_heads, int64_t dim,
                         const void *k, const void *v, int64_t key_stride, int64_t head_stride,
                         const int64_t *index, const int32_t *cu_q, const int32_t *cu_k, int64_t requests,
                         int64_t max_rows, float scale, float *out);

#endif
