/* The block kernel's parts, built into one library with decoder.c (ttft_sse/engine/kernels/kernel.py): kernel.c (fp32
   rows, with its headers: vectors.h the build's vectors, five.h the Q5 types' 5-bit codes, six.h Q6_K's short panels,
   dense.h the dense layers) and int8_rows.c (rows quantised to int8) give helpers.c (the helper threads that share a
   call's panels, above them, and kernel.h's entry points) what it calls. kernel.h holds what the library gives
   decoder.c and attention.c. */

#ifndef TTFT_BLOCKS_H
#define TTFT_BLOCKS_H

#include <stdint.h>

#define P 16     /* outputs a panel */
#define BLOCK 32 /* inputs a block */
#define GROUP 3  /* panels kernel.c expands into its buffer at a time: a shared call's chunks are whole groups */
#define SIXTEEN 6 /* bits of Q6_K's codes: 8-bit codes, a scale each 16 inputs, no zero */
#define FIVE 5       /* bits of 5-bit codes (Q5_0, Q5_1, Q5_K's q - 16) */
#define FIVE_PAIR 20 /* bytes of a FIVE panel's two inputs: 16 of low nibbles as 4-bit codes lie, 2 x 2 of fifth bits */
#define Q_WIDE 64 /* added to int8 records' bits (4 or 8): fp32 scales and zeros, where fp16 cannot hold them */
#define F16_SCALES 128 /* added to fp32 rows' bits (4 or 8): the scales are the file's fp16 values, the zeros -0.0 */
#define K_SCALES 256   /* added to fp32 rows' bits (4, FIVE): a K-quant's d, dmin, sc, m instead of scales and zeros */
#define SIX_PACKED 512 /* added to fp32 rows' bits (SIXTEEN): 6-bit codes, a super-block's factor and signed sc */
#define K_RECORD 320 /* K_SCALES's bytes a super-block of a panel: d, dmin (16 fp16 each), 8 x 16 sc, 8 x 16 m; and
                            SIX_SCALES's and SIX_PACKED's: 16 fp32 D, 16 x 16 sc */
#define SIX_SCALES 1024 /* added to fp32 rows' bits (SIXTEEN): 8-bit codes, a super-block's factor and signed sc */

/* int8 rows on this build: AVX-512 VNNI, or AVX2 with F16C (int8_rows.c). */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q_VNNI
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q_AVX2
#endif

/* A tile's row and panel (or column) counts as constants for the compiler (at most 8 and 3). */
#define BY_COUNT(CALL, R, count)                                                                                      \
    switch (count) {                                                                                                   \
    case 3: CALL(R, 3); break;                                                                                         \
    case 2: CALL(R, 2); break;                                                                                         \
    default: CALL(R, 1); break;                                                                                        \
    }
#define BY_ROWS(CALL, rows, count)                                                                                     \
    switch (rows) {                                                                                                    \
    case 8: BY_COUNT(CALL, 8, count) break;                                                                            \
    case 7: BY_COUNT(CALL, 7, count) break;                                                                            \
    case 6: BY_COUNT(CALL, 6, count) break;                                                                            \
    case 5: BY_COUNT(CALL, 5, count) break;                                                                            \
    case 4: BY_COUNT(CALL, 4, count) break;                                                                            \
    case 3: BY_COUNT(CALL, 3, count) break;                                                                            \
    case 2: BY_COUNT(CALL, 2, count) break;                                                                            \
    default: BY_COUNT(CALL, 1, count) break;                                                                           \
    }

/* Tiles of at most `most` rows out of M, as even as they can be (9 rows in tiles of 8: 4 + 5, not 8 + 1), the
   larger ones last: the rows of tile t of `tiles`, r rows before it. */
static inline int64_t tile_rows(int64_t M, int64_t r, int64_t t, int64_t tiles) { return (M - r) / (tiles - t); }

#pragma GCC visibility push(hidden) /* the library's own: not among the names ctypes finds */

/* kernel.c: whether it multiplies codes of these bits with K inputs; a call computed by the calling thread alone (0,
   or -1 if its buffers cannot be allocated); whether panels of these bits have zeros, which multiply each block of
   32 inputs' sum of the rows; those sums of M rows (M x K/32 floats); panels [p0, p1) of y = x . W^T for fp32 rows,
   `sums` holding fp32_sums of them where fp32_needs_sums (else unread) and `buffer` what fp32_buffer gives for M
   rows. */
int fp32_takes(int64_t K, int bits);
int fp32_needs_sums(int bits);
int fp32_alone(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
               const float *zero, int64_t N, float *y);
void fp32_sums(const float *x, int64_t M, int64_t K, float *sums);
void fp32_panels(const float *x, const float *sums, int64_t M, int64_t K, const uint8_t *codes, int bits,
                 const float *scale, const float *zero, int64_t N, float *y, int64_t p0, int64_t p1, float *buffer);
int fp32_buffer(int64_t M, int64_t K, float **buffer);

/* int8_rows.c: whether it multiplies records of these bits (4 or 8, each plus Q_WIDE or not, or SIXTEEN); the rows'
   steps (M x K bytes: M * K / 4 floats, K being whole blocks of 32), then d, d * sum, sum and the sum of the first
   16 steps: the floats a call of M rows needs for its quantised rows; their places in such a buffer; the rows
   quantised into it; panels [p0, p1) of y for them; and a call computed by the calling thread alone (0, or -1 if
   its buffer cannot be allocated). On a build with int8 rows (Q_VNNI or Q_AVX2). */
static inline int q8_takes(int bits) {
    return bits == 4 || bits == 8 || bits == (4 | Q_WIDE) || bits == (8 | Q_WIDE) || bits == SIXTEEN;
}
static inline int64_t q8_floats(int64_t M, int64_t K) { return M * K / 4 + 4 * M * (K / BLOCK); }
struct q8_rows {
    int8_t *xq;
    float *d, *ds;
    int32_t *sx, *sh;
};
struct q8_rows q8_view(float *buffer, int64_t M, int64_t K);
struct q8_rows q8_quantise(const float *x, int64_t M, int64_t K, float *buffer);
void q8_panels(struct q8_rows q, int64_t M, int64_t K, const uint8_t *records, int bits, int64_t N, float *y,
               int64_t p0, int64_t p1);
int q8_alone(const float *x, int64_t M, int64_t K, const uint8_t *records, int bits, int64_t N, float *y);

#pragma GCC visibility pop

#endif
