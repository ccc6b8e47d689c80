/* fp32 rows times a weight kept in a GGUF file's own blocks, for CPU (ttft_sse/engine/kernels/kernel.py builds it).

   y[M,N] = x[M,K] . W[N,K]^T. W's blocks of 32 inputs hold w = q * scale + zero, one scale and one zero a block
   (q: 4-bit codes less 8, 5-bit codes less 16, or 8-bit codes); or, with bits SIXTEEN (Q6_K's), w = q * scale with
   8-bit codes and one scale each 16 inputs, no zero (the kernel adds -0.0, which changes no value). kernel.py lays
   them out in panels of 16 outputs (N padded to whole panels with zero weights):
     4-bit codes: panels x K/2 x 16 bytes; byte j of row i holds output j's code for input 2i (low nibble) and for
                  input 2i+1 (high nibble), each plus 8;
     5-bit codes (FIVE: the Q5 types' q - 16; AVX-512 builds): panels x K/2 x FIVE_PAIR (20) bytes; each two
                  inputs' 16 bytes of low nibbles as 4-bit codes lie (plus 16), then input 2i's fifth bits, 16 as a
                  little-endian uint16 (bit j: output j's), then input 2i+1's: 5 bits an input instead of 8;
     8-bit codes: panels x K x 16 signed bytes (SIXTEEN's too);
     scale, zero: panels x K/32 x 16 floats (SIXTEEN: scale panels x K/16 x 16 floats, zero unread; with
                  F16_SCALES, where every scale is the file's fp16 d and every zero -0.0 (Q4_0, Q5_0, Q8_0): scale
                  panels x K/32 x 16 fp16 values, widened exactly, zero unread: 8.5 bits an input instead of 10,
                  or 4.5 instead of 6 (FIVE: 5.5); with K_SCALES (Q4_K, Q5_K): the K-quant's own factors, a
                  record of 320 bytes a super-block of 256 inputs of a panel (16 fp16 d, 16 fp16 dmin, then 8
                  blocks' 16 sc, then their 16 m), from which the scale d * sc and the zero 8 * scale - dmin * m
                  (FIVE: 16 * scale) are computed exactly as the codes' are: 4.625 bits an input instead of 6, or
                  5.625 instead of 7);
     SIXTEEN with SIX_SCALES (Q6_K): 8-bit codes, and a record of 320 bytes a super-block of 256 inputs of a
                  panel (16 fp32 factors D, then 16 blocks' 16 signed sc), each scale D * sc, exact: 8.625 bits an
                  input instead of 10; with SIX_PACKED instead (a build with AVX-512 VBMI), the codes in 6 bits,
                  panels x K/4 x 48 bytes (six.h's six_quad), each code taken times 2^26 and each scale D * sc
                  times 2^-26 (exact): 6.625 bits an input;
     dense (HALF, BRAIN, FULL: an F16, BF16 or F32 file's weights): panels x K x 16 values, no scale or zero, each
                  widened exactly to fp32 as it is read (fp16 by F16C, bf16 by a shift).
   A block's share of an output is taken as the block's inputs times its codes, then times its scale, then plus its
   zero times the block's sum of inputs: part = fma(x[k], q[k][n], part) for the block's inputs k in order, from zero
   (the codes as floats, exact), then out[n] = fma(scale[n], part, out[n]) and, where the blocks have zeros,
   out[n] = fma(zero[n], sum, out[n]) (sum: fp32_sums, in one order on every build and path), block by block from
   zero. That is Σ x (q * scale + zero) with fp32's roundings, as the weights-first product is, in one multiply-add
   an input and output where the weights-first product takes two (expand q * scale + zero, then multiply). A dense
   layer's values are the weights: out[n] = fma(x[k], w[k][n], out[n]) for k = 0, 1, ..., K-1, from zero. The
   arithmetic is the same whatever M is and wherever a row falls, so a row's result does not depend on the other
   rows of the call (a stream's answer does not depend on its batch). A tile of rows (up to 8 rows x 48 outputs
   with AVX-512, 4 x 16 with AVX2) expands the codes in registers for all its rows at once, in calls of up to
   FUSED_ROWS rows; longer calls expand three panels at a time into a buffer once (codes as floats, scales and
   zeros as fp32) and reuse them for every tile (8 rows x 48 outputs with AVX-512, 4 x 24 with AVX2), as tiles over
   a dense layer's own values do; a call of one row expands the codes of up to 8 panels at a time (4 with AVX2), so
   that more chains are in flight. All give the same bits. Built with -ffp-contract=off: only the written fused
   multiply-adds fuse. */

#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "kernel.h"
#include "vectors.h"
#include "five.h"
#include "six.h"
#include "dense.h"

/* Inputs a scale (and a zero) covers, and bytes a panel's codes take for K inputs. */
static inline int64_t scale_inputs(int bits) { return bits == SIXTEEN ? 16 : BLOCK; }
static inline int64_t code_bytes(int64_t K, int bits) {
    return bits == 4      ? K * P / 2
           : bits == FIVE ? K / 2 * FIVE_PAIR
           : bits == FULL ? K * P * 4
           : bits == HALF || bits == BRAIN ? K * P * 2
                                          : K * P;
}
static inline int dense_bits(int bits) { return bits == HALF || bits == BRAIN || bits == FULL; }

enum { SCALES_FP32, SCALES_F16, SCALES_K, SCALES_SC, SCALES_SIX }; /* a panel's scales and codes: fp32 scales and
                                                                       zeros, F16_SCALES, K_SCALES, SIX_SCALES,
                                                                       SIX_PACKED */

/* A panel's codes for inputs 2i and 2i+1, as floats (exact: q - 8 for 4-bit codes, q - 16 for 5-bit ones). */
static inline void pair(const uint8_t *codes, int bits, int64_t i, pv *w0, pv *w1) {
    __m128i a, b;
#if FIVE_BUILT
    if (bits == FIVE) {
        five_pair(codes, i, w0, w1);
        return;
    }
#endif
#if defined(__AVX512F__)
    if (bits == 4) {
        /* q - 8 as a float, from a table of -8..7 by vpermps, which reads only a lane's low 4 bits: each byte
           zero-extended to its lane gives the low nibble's value, and shifted right by 4 the high nibble's. The
           same floats as converting q - 8, in 4 instructions for two inputs where the conversion takes 9. */
        const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + P * i)));
        *w0 = _mm512_permutexvar_ps(raw, table);
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table);
        return;
    }
#endif
    if (bits == 4) {
        const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
        __m128i raw = _mm_loadu_si128((const __m128i *)(codes + P * i));
        a = _mm_sub_epi8(_mm_and_si128(raw, low), eight);
        b = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), low), eight);
    } else {
        a = _mm_loadu_si128((const __m128i *)(codes + 2 * P * i));
        b = _mm_loadu_si128((const __m128i *)(codes + 2 * P * i + P));
    }
    *w0 = pv_q(a);
    *w1 = pv_q(b);
}

/* The form of a panel's scales (and codes) that fp32 rows' bits say (F16_SCALES, K_SCALES, SIX_SCALES, SIX_PACKED,
   else fp32 scales and zeros). */
static inline int form_of(int bits) {
    return bits & F16_SCALES   ? SCALES_F16
           : bits & K_SCALES   ? SCALES_K
           : bits & SIX_SCALES ? SCALES_SC
           : bits & SIX_PACKED ? SCALES_SIX
                               : SCALES_FP32;
}
#define FORMS (F16_SCALES | K_SCALES | SIX_SCALES | SIX_PACKED)

/* Bytes a panel's codes take: SIX_PACKED's 6 bits an input, else code_bytes. */
static inline int64_t panel_bytes_of(int64_t K, int bits, int form) {
    return form == SCALES_SIX ? K / 4 * SIX_QUAD : code_bytes(K, bits);
}

/* Whether a form's blocks have zeros to add: fp32 scales and zeros (SIXTEEN's are -0.0, unread) and Q4_K's factors
   do; F16_SCALES's are -0.0, not stored. */
static inline int has_zeros(int bits, int form) {
    return form == SCALES_K || (form == SCALES_FP32 && bits != SIXTEEN);
}

/* A block's share of 16 outputs added to acc: its scale times the sum of the inputs times the codes (part), then its
   zero times the sum of the inputs (sum): two fused multiply-adds, the zero's only where the form has zeros. */
static inline pv pv_block(pv acc, pv part, pv s, pv z, float sum, int zeros) {
    acc = pv_madd(s, part, acc);
    return zeros ? pv_fma(sum, z, acc) : acc;
}
static inline cv cv_block(cv acc, cv part, cv s, cv z, float sum, int zeros) {
    acc = cv_madd(s, part, acc);
    return zeros ? cv_fma(sum, z, acc) : acc;
}

/* A tile's results into y (N apart), `outputs` of them real from its first panel's first. */
static inline __attribute__((always_inline)) void put(int rows, int panels, pv acc[ROWS][PANELS], float *y, int64_t N,
                                                      int64_t outputs) {
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < panels; g++) {
            float *at = y + r * N + g * P;
            int64_t left = outputs - (int64_t)g * P;
#if defined(__AVX512F__)
            put_column(at, acc[r][g], left);
#else
            put_column(at, acc[r][g].lo, left);
            put_column(at + CV, acc[r][g].hi, left - CV);
#endif
        }
}

/* A K-quant's scale d * sc and zero middle * scale - dmin * m from its factors (middle: 8 for Q4_K's codes, 16 for
   Q5_K's), one rounding each as codes.py computes them (d * sc and dmin * m are exact: 11 bits times 6; middle *
   scale too). */
static inline void pv_k(pv d, pv dmin, pv sc, pv m, float middle, pv *s, pv *z) {
#if defined(__AVX512F__)
    *s = _mm512_mul_ps(d, sc);
    *z = _mm512_fmsub_ps(_mm512_set1_ps(middle), *s, _mm512_mul_ps(dmin, m));
#else
    const __m256 times = _mm256_set1_ps(middle);
    *s = (pv){_mm256_mul_ps(d.lo, sc.lo), _mm256_mul_ps(d.hi, sc.hi)};
    *z = (pv){_mm256_fmsub_ps(times, s->lo, _mm256_mul_ps(dmin.lo, m.lo)),
              _mm256_fmsub_ps(times, s->hi, _mm256_mul_ps(dmin.hi, m.hi))};
#endif
}

/* Block b's scales and zeros of `panels` panels, by their `form`: fp32 (SIXTEEN's zeros -0.0, unread); fp16 scales,
   blocks x 16 a panel, and zeros -0.0, not stored; Q4_K's factors, a K_RECORD a super-block; or Q6_K's records
   (SIX_SCALES, SIX_PACKED: times 2^-26), a K_RECORD a super-block of 16 blocks (zeros -0.0, unread). */
static inline __attribute__((always_inline)) void block_scales(int panels, const float *scale, const float *zero,
                                                               int bits, int form, int64_t blocks, int64_t b, pv *s,
                                                               pv *z) {
    for (int g = 0; g < panels; g++) {
        if (form == SCALES_F16) {
            s[g] = pv_half((const uint16_t *)scale + (g * blocks + b) * P);
            z[g] = pv_set1(-0.0f);
        } else if (form == SCALES_K) {
            const uint8_t *k = (const uint8_t *)scale + (g * (blocks / 8) + b / 8) * K_RECORD;
            int64_t j = b % 8;
            pv_k(pv_half((const uint16_t *)k), pv_half((const uint16_t *)(k + 32)), pv_bytes(k + 64 + P * j),
                 pv_bytes(k + 64 + 8 * P + P * j), bits == FIVE ? 16.0f : 8.0f, &s[g], &z[g]);
        } else if (form == SCALES_SC || form == SCALES_SIX) {
            s[g] = six_scale(scale, g, blocks, b, form == SCALES_SIX);
            z[g] = pv_set1(-0.0f);
        } else {
            s[g] = pv_load(scale + (g * blocks + b) * P);
            z[g] = bits == SIXTEEN ? pv_set1(-0.0f) : pv_load(zero + (g * blocks + b) * P);
        }
    }
}

/* A tile of up to ROWS rows against `panels` panels, the codes expanded in registers. */
static inline __attribute__((always_inline)) void fused(int rows, int panels, const uint8_t *codes,
                                                        int64_t panel_bytes, int bits, int form, const float *scale,
                                                        const float *zero, const float *x, const float *sums,
                                                        int64_t K, float *y, int64_t N, int64_t outputs) {
    pv acc[ROWS][PANELS];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < panels; g++) acc[r][g] = pv_zero();
    int64_t inputs = scale_inputs(bits), blocks = K / inputs;
    int zeros = has_zeros(bits, form);
    for (int64_t b = 0; b < blocks; b++) {
        pv s[PANELS], z[PANELS], part[ROWS][PANELS];
        block_scales(panels, scale, zero, bits, form, blocks, b, s, z);
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < panels; g++) part[r][g] = pv_zero();
        for (int64_t t = b * inputs / 4; form == SCALES_SIX && t < (b + 1) * inputs / 4; t++) {
            pv w[PANELS][4];
            for (int g = 0; g < panels; g++) six_quad(codes + g * panel_bytes, t, w[g], t == K / 4 - 1);
            for (int j = 0; j < 4; j++)
                for (int r = 0; r < rows; r++)
                    for (int g = 0; g < panels; g++) part[r][g] = pv_fma(x[r * K + 4 * t + j], w[g][j], part[r][g]);
        }
        for (int64_t i = b * inputs / 2; form != SCALES_SIX && i < (b + 1) * inputs / 2; i++) {
            pv w0[PANELS], w1[PANELS];
            for (int g = 0; g < panels; g++) pair(codes + g * panel_bytes, bits, i, &w0[g], &w1[g]);
            for (int r = 0; r < rows; r++)
                for (int g = 0; g < panels; g++) part[r][g] = pv_fma(x[r * K + 2 * i], w0[g], part[r][g]);
            for (int r = 0; r < rows; r++)
                for (int g = 0; g < panels; g++) part[r][g] = pv_fma(x[r * K + 2 * i + 1], w1[g], part[r][g]);
        }
        for (int r = 0; r < rows; r++) {
            float sum = zeros ? sums[r * (K / BLOCK) + b] : 0.0f;
            for (int g = 0; g < panels; g++) acc[r][g] = pv_block(acc[r][g], part[r][g], s[g], z[g], sum, zeros);
        }
    }
    put(rows, panels, acc, y, N, outputs);
}

/* A call of one row against up to WIDE panels, the codes expanded in registers: the same arithmetic for each output
   as fused's, but WIDE chains in flight at once where a one-row tile of fused has PANELS, each waiting on the
   latency of its last fused multiply-add (a decode step of one stream is mostly such calls). */
static inline __attribute__((always_inline)) void one_row(int panels, const uint8_t *codes, int64_t panel_bytes,
                                                          int bits, int form, const float *scale, const float *zero,
                                                          const float *x, const float *sums, int64_t K, float *y,
                                                          int64_t outputs) {
    pv acc[WIDE];
    for (int g = 0; g < panels; g++) acc[g] = pv_zero();
    int64_t inputs = scale_inputs(bits), blocks = K / inputs;
    int zeros = has_zeros(bits, form);
    for (int64_t b = 0; b < blocks; b++) {
        pv s[WIDE], z[WIDE], part[WIDE];
        block_scales(panels, scale, zero, bits, form, blocks, b, s, z);
        for (int g = 0; g < panels; g++) part[g] = pv_zero();
        for (int64_t i = b * inputs / 2; i < (b + 1) * inputs / 2; i++) {
            float x0 = x[2 * i], x1 = x[2 * i + 1];
            for (int g = 0; g < panels; g++) {
                pv w0, w1;
                pair(codes + g * panel_bytes, bits, i, &w0, &w1);
                part[g] = pv_fma(x1, w1, pv_fma(x0, w0, part[g]));
            }
        }
        float sum = zeros ? sums[b] : 0.0f;
        for (int g = 0; g < panels; g++) acc[g] = pv_block(acc[g], part[g], s[g], z[g], sum, zeros);
    }
    for (int g = 0; g < panels; g++) {
        int64_t left = outputs - (int64_t)g * P;
#if defined(__AVX512F__)
        put_column(y + g * P, acc[g], left);
#else
        put_column(y + g * P, acc[g].lo, left);
        put_column(y + g * P + CV, acc[g].hi, left - CV);
#endif
    }
}

/* Up to B_ROWS rows against `cols` columns (CV outputs each), from column c0, of GROUP panels' codes expanded into
   the buffer (codes: K x 16 floats a panel; scale and zero: blocks x 16 floats a panel): fused's arithmetic. */
static inline __attribute__((always_inline)) void blocked(int rows, int cols, int c0, const float *codes,
                                                          const float *scale, const float *zero, int64_t inputs,
                                                          int zeros, const float *x, const float *sums, int64_t K,
                                                          float *y, int64_t N, int64_t outputs) {
    cv acc[B_ROWS][B_COLS];
    int64_t blocks = K / inputs, at[B_COLS], in_scales[B_COLS];
    for (int c = 0; c < cols; c++) {
        int64_t panel = (int64_t)(c0 + c) * CV / P, lane = (int64_t)(c0 + c) * CV % P;
        at[c] = panel * K * P + lane;
        in_scales[c] = panel * blocks * P + lane;
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = cv_zero();
    for (int64_t b = 0; b < blocks; b++) {
        cv part[B_ROWS][B_COLS];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) part[r][c] = cv_zero();
        for (int64_t k = b * inputs; k < (b + 1) * inputs; k++) {
            cv wk[B_COLS];
            for (int c = 0; c < cols; c++) wk[c] = cv_load(codes + at[c] + k * P);
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < cols; c++) part[r][c] = cv_fma(x[r * K + k], wk[c], part[r][c]);
        }
        for (int c = 0; c < cols; c++) {
            cv s = cv_load(scale + in_scales[c] + b * P), z = zeros ? cv_load(zero + in_scales[c] + b * P) : cv_zero();
            for (int r = 0; r < rows; r++)
                acc[r][c] = cv_block(acc[r][c], part[r][c], s, z, zeros ? sums[r * (K / BLOCK) + b] : 0.0f, zeros);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            int64_t first = (int64_t)(c0 + c) * CV;
            put_column(y + r * N + first, acc[r][c], outputs - first);
        }
}

/* A panel's codes as floats into w (K x 16), and its blocks' scales and zeros as fp32 into scales and zeros (blocks
   x 16 each; zeros only where the form has them). */
static void expand(const uint8_t *codes, int bits, int form, const float *scale, const float *zero, int64_t K,
                   float *w, float *scales, float *zeros) {
    int64_t inputs = scale_inputs(bits), blocks = K / inputs;
    for (int64_t b = 0; b < blocks; b++) {
        pv s, z;
        block_scales(1, scale, zero, bits, form, blocks, b, &s, &z);
        pv_store(scales + b * P, s);
        if (has_zeros(bits, form)) pv_store(zeros + b * P, z);
        for (int64_t t = b * inputs / 4; form == SCALES_SIX && t < (b + 1) * inputs / 4; t++) {
            pv q[4];
            six_quad(codes, t, q, t == K / 4 - 1);
            for (int j = 0; j < 4; j++) pv_store(w + (4 * t + j) * P, q[j]);
        }
        for (int64_t i = b * inputs / 2; form != SCALES_SIX && i < (b + 1) * inputs / 2; i++) {
            pv w0, w1;
            pair(codes, bits, i, &w0, &w1);
            pv_store(w + 2 * i * P, w0);
            pv_store(w + (2 * i + 1) * P, w1);
        }
    }
}

/* Each block of 32 inputs' sum, a row's K / 32 of them, into sums (M x K/32): each half's 16 inputs added as a tree
   (8 pairs 8 apart, then 4 apart, 2, 1), then the two halves; the same order on every build and every path. */
static inline float sum16(const float *x) {
    float t[8];
    for (int j = 0; j < 8; j++) t[j] = x[j] + x[j + 8];
    for (int j = 0; j < 4; j++) t[j] += t[j + 4];
    for (int j = 0; j < 2; j++) t[j] += t[j + 2];
    return t[0] + t[1];
}
void fp32_sums(const float *x, int64_t M, int64_t K, float *sums) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < K / BLOCK; b++) sums[r * (K / BLOCK) + b] = sum16(x + r * K + b * BLOCK) +
                                                                         sum16(x + r * K + b * BLOCK + 16);
}

/* kernel.h's buffers (one a thread, kept): the fp32 and int8 rows keep one, and decoder.c too. */
float *ttft_grow(struct ttft_buffer *b, int64_t floats) {
    if (b->capacity < floats) {
        float *grown = realloc(b->floats, sizeof(float) * floats);
        if (grown == NULL) return NULL;
        b->floats = grown;
        b->capacity = floats;
    }
    return b->floats;
}

/* Panels p .. p+group-1 of y = x . W^T from their codes expanded into the buffer (expand: GROUP panels' codes, then
   their scales, then their zeros), in tiles of up to B_ROWS rows. */
static void blocked_group(const float *x, const float *sums, int64_t M, int64_t K, const float *buffer, int bits,
                          int form, int64_t N, float *y, int64_t p, int group) {
    int columns = group * P / CV, zeros = has_zeros(bits, form);
    int64_t inputs = scale_inputs(bits), blocks = K / inputs, tiles = (M + B_ROWS - 1) / B_ROWS, r = 0;
    const float *scale = buffer + GROUP * K * P, *zero = scale + GROUP * blocks * P;
    for (int64_t t = 0; t < tiles; t++) {
        int64_t rows = tile_rows(M, r, t, tiles);
        const float *xr = x + r * K, *sr = zeros ? sums + r * (K / BLOCK) : sums;
        float *yr = y + r * N + p * P;
        for (int c0 = 0; c0 < columns; c0 += B_COLS) {
            int cols = columns - c0 < B_COLS ? columns - c0 : B_COLS;
#define BLOCKED(R, C)                                                                                                  \
    if (R <= B_ROWS) blocked(R, C, c0, buffer, scale, zero, inputs, zeros, xr, sr, K, yr, N, N - p * P)
            BY_ROWS(BLOCKED, rows, cols)
        }
        r += rows;
    }
}

/* Panels [p0, p1) of y = x . W^T (N outputs a row of y), `sums` holding fp32_sums of x where the layer's blocks
   have zeros, `buffer` what fp32_buffer gives for M rows: calls of up to FUSED_ROWS rows expand the codes in
   registers in every tile; longer ones expand GROUP panels at a time into the buffer once, and their tiles read
   them there. Each output's arithmetic is the same whatever the range and the tiles, so the results are the same
   bits however a call's panels are split. */
void fp32_panels(const float *x, const float *sums, int64_t M, int64_t K, const uint8_t *codes, int bits,
                 const float *scale, const float *zero, int64_t N, float *y, int64_t p0, int64_t p1, float *buffer) {
    int form = form_of(bits);
    bits &= ~FORMS;
    int64_t panel_bytes = panel_bytes_of(K, bits, form), blocks = K / scale_inputs(bits); /* scales an output */
    /* floats a panel's scales and zeros take (fp16 scales: half as many; K_SCALES: a K_RECORD a super-block of 8
       blocks; SIX_PACKED: of 16) */
    int64_t scales = form == SCALES_F16   ? blocks * P / 2
                     : form == SCALES_K   ? blocks / 8 * K_RECORD / 4
                     : form == SCALES_SC || form == SCALES_SIX ? blocks / 16 * K_RECORD / 4
                                          : blocks * P;
    int64_t zeros = form == SCALES_FP32 ? blocks * P : 0;
    if (dense_bits(bits)) {
        for (int64_t p = p0; p < p1; p += GROUP)
            dense_group(x, M, K, codes + p * panel_bytes, bits, N, y, p, p1 - p < GROUP ? (int)(p1 - p) : GROUP);
        return;
    }
    if (M == 1) {
        for (int64_t q = p0; q < p1; q += WIDE) {
            int panels = p1 - q < WIDE ? (int)(p1 - q) : WIDE;
            const uint8_t *c = codes + q * panel_bytes;
            const float *s = scale + q * scales, *z = zero + q * zeros;
            float *yq = y + q * P;
            if (form == SCALES_SIX) {
                six_row(panels, c, panel_bytes, s, x, K, yq, N - q * P);
                continue;
            }
            /* a constant count in each (always_inline), and FIVE's codes a constant of their own */
#define ONE_ROW(G, B) \
    case G: if (G <= WIDE) one_row(G, c, panel_bytes, B, form, s, z, x, sums, K, yq, N - q * P); break;
#define ONE_ROWS(B)                                                                                                    \
    switch (panels) {                                                                                                  \
        ONE_ROW(8, B) ONE_ROW(7, B) ONE_ROW(6, B) ONE_ROW(5, B) ONE_ROW(4, B) ONE_ROW(3, B) ONE_ROW(2, B)              \
        default: one_row(1, c, panel_bytes, B, form, s, z, x, sums, K, yq, N - q * P);                                 \
    }
            if (FIVE_BUILT && bits == FIVE) ONE_ROWS(FIVE) else ONE_ROWS(bits)
        }
        return;
    }
    for (int64_t p = p0; p < p1; p += GROUP) {
        int group = p1 - p < GROUP ? (int)(p1 - p) : GROUP;
        if (M > FUSED_ROWS) {
            for (int g = 0; g < group; g++) {
                int64_t at = p + g;
                expand(codes + at * panel_bytes, bits, form, scale + at * scales, zero + at * zeros, K,
                       buffer + g * K * P, buffer + GROUP * K * P + g * blocks * P,
                       buffer + GROUP * K * P + (GROUP + g) * blocks * P);
            }
            blocked_group(x, sums, M, K, buffer, bits, form, N, y, p, group);
            continue;
        }
        int most = form == SCALES_SIX ? 2 : PANELS; /* SIX_PACKED's quads of 2 panels fit the registers beside a tile */
        for (int64_t q = p; q < p + group; q += most) {
            int panels = p + group - q < most ? (int)(p + group - q) : most;
            const uint8_t *c = codes + q * panel_bytes;
            const float *s = scale + q * scales, *z = zero + q * zeros;
            int64_t tiles = (M + ROWS - 1) / ROWS, r = 0;
            for (int64_t t = 0; t < tiles; t++) {
                int64_t rows = tile_rows(M, r, t, tiles);
                const float *sr = has_zeros(bits, form) ? sums + r * (K / BLOCK) : sums;
#define FUSED_AS(R, G, B, F) fused(R, G, c, panel_bytes, B, F, s, z, x + r * K, sr, K, y + r * N + q * P, N, N - q * P)
#define FUSED(R, G)                                                                                                    \
    if (R <= ROWS && G <= PANELS) { /* SIX_PACKED's and FIVE's own code: the others' as it was without them */      \
        if (form == SCALES_SIX) FUSED_AS(R, G, bits, SCALES_SIX);                                                      \
        else if (FIVE_BUILT && bits == FIVE) FUSED_AS(R, G, FIVE, form);                                               \
        else FUSED_AS(R, G, bits, form);                                                                               \
    }
                BY_ROWS(FUSED, rows, panels)
                r += rows;
            }
        }
    }
}

/* Sets *buffer to the buffer fp32_panels needs for M rows (one a thread, kept; NULL where it needs none): GROUP
   panels' codes as floats, their scales and their zeros (at most one a 16 inputs each). Returns 0, or -1 if it
   cannot be allocated. */
int fp32_buffer(int64_t M, int64_t K, float **buffer) {
    static _Thread_local struct ttft_buffer kept = {NULL, 0};
    *buffer = M > FUSED_ROWS ? ttft_grow(&kept, GROUP * P * K + 2 * GROUP * P * (K / 16)) : NULL;
    return M > FUSED_ROWS && *buffer == NULL ? -1 : 0;
}

int fp32_takes(int64_t K, int bits) {
    if (bits == (4 | K_SCALES)) return K % 256 == 0;
#if FIVE_BUILT
    if (bits == (FIVE | K_SCALES)) return K % 256 == 0;
#endif
    if (bits == (SIXTEEN | SIX_SCALES)) return K % 256 == 0;
#if defined(SIX_CODES)
    if (bits == (SIXTEEN | SIX_PACKED)) return K % 256 == 0;
#endif
    int codes = bits & ~F16_SCALES, half = bits != codes;
#if FIVE_BUILT
    if (codes == FIVE) return K % BLOCK == 0;
#endif
    return K % BLOCK == 0 && (codes == 4 || codes == 8 || (!half && (bits == SIXTEEN || dense_bits(bits))));
}

int fp32_needs_sums(int bits) {
    return !dense_bits(bits) && has_zeros(bits & ~FORMS, form_of(bits));
}

int fp32_alone(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
               const float *zero, int64_t N, float *y) {
    static _Thread_local struct ttft_buffer kept = {NULL, 0};
    float *buffer, *sums = NULL;
    if (fp32_needs_sums(bits)) {
        if ((sums = ttft_grow(&kept, M * (K / BLOCK))) == NULL) return -1;
        fp32_sums(x, M, K, sums);
    }
    if (fp32_buffer(M, K, &buffer) != 0) return -1;
    fp32_panels(x, sums, M, K, codes, bits, scale, zero, N, y, 0, (N + P - 1) / P, buffer);
    return 0;
}
