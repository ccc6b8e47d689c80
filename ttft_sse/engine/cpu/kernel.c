/* fp32 rows times a weight kept in a GGUF file's own blocks, for CPU (ttft_sse/engine/cpu/kernel.py builds it).

   y[M,N] = x[M,K] . W[N,K]^T. W's blocks of 32 inputs hold w = q * scale + zero, one scale and one zero a block
   (q: 4-bit codes less 8, or 8-bit codes); or, with bits SIXTEEN (Q6_K's), w = q * scale with 8-bit codes and one
   scale each 16 inputs, no zero (the kernel adds -0.0, which changes no value). kernel.py lays them out in panels
   of 16 outputs (N padded to whole panels with zero weights):
     4-bit codes: panels x K/2 x 16 bytes; byte j of row i holds output j's code for input 2i (low nibble) and for
                  input 2i+1 (high nibble), each plus 8;
     8-bit codes: panels x K x 16 signed bytes (SIXTEEN's too);
     scale, zero: panels x K/32 x 16 floats (SIXTEEN: scale panels x K/16 x 16 floats, zero unread; with
                  F16_SCALES, where every scale is the file's fp16 d and every zero -0.0 (Q4_0, Q5_0, Q8_0): scale
                  panels x K/32 x 16 fp16 values, widened exactly, zero unread: 8.5 bits an input instead of 10,
                  or 4.5 instead of 6; with K_SCALES (Q4_K): Q4_K's own factors, a record of 320 bytes a
                  super-block of 256 inputs of a panel (16 fp16 d, 16 fp16 dmin, then 8 blocks' 16 sc, then their
                  16 m), from which the scale d * sc and the zero 8 * scale - dmin * m are computed exactly as the
                  codes' are: 4.625 bits an input instead of 6);
     dense (HALF, BRAIN, FULL: an F16, BF16 or F32 file's weights): panels x K x 16 values, no scale or zero, each
                  widened exactly to fp32 as it is read (fp16 by F16C, bf16 by a shift).
   Each input's 16 weights of a panel are expanded to fp32 (the values transformers' loader gives: q * scale, then
   + zero) and multiplied into 16 outputs at once: out[n] = fma(x[k], w[k][n], out[n]) for k = 0, 1, ..., K-1, from
   zero. That chain is the same whatever M is and wherever a row falls, so a row's result does not depend on the
   other rows of the call (a stream's answer does not depend on its batch). A tile of rows (up to 8 rows x 48
   outputs with AVX-512, 4 x 16 with AVX2) expands the codes in registers for all its rows at once, in calls of up
   to FUSED_ROWS rows; longer calls expand three panels at a time into a buffer once and reuse them for every tile
   (8 rows x 48 outputs with AVX-512, 4 x 24 with AVX2), as tiles over a dense layer's own values do; a call of one
   row expands the codes of up to 8 panels at a time (4 with AVX2), so that more chains are in flight. All give the
   same bits. Built with -ffp-contract=off: only the written fused multiply-adds fuse. */

#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "kernel.h"

#define HALF 16       /* dense layouts (F16, BF16 and F32 files): the weights themselves, no scale or zero: fp16, */
#define BRAIN 17      /* bf16 */
#define FULL 32       /* and fp32 values */
#define B_COLS 3      /* columns a tile over the buffer */

/* Inputs a scale (and a zero) covers, and bytes a panel's codes take for K inputs. */
static inline int64_t scale_inputs(int bits) { return bits == SIXTEEN ? 16 : BLOCK; }
static inline int64_t code_bytes(int64_t K, int bits) {
    return bits == 4 ? K * P / 2 : bits == FULL ? K * P * 4 : bits == HALF || bits == BRAIN ? K * P * 2 : K * P;
}
static inline int dense_bits(int bits) { return bits == HALF || bits == BRAIN || bits == FULL; }

#if defined(__AVX512F__)
/* 16 outputs in one register; tiles of up to 8 rows x 3 panels: 24 accumulators. */
#define ROWS 8
#define PANELS 3
#define WIDE 8 /* panels a one-row call's tile */
#define FUSED_ROWS 16 /* calls of up to this many rows expand the codes in registers in every tile */
typedef __m512 pv;
static inline pv pv_zero(void) { return _mm512_setzero_ps(); }
static inline pv pv_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void pv_store(float *p, pv v) { _mm512_storeu_ps(p, v); }
static inline pv pv_fma(float x, pv w, pv acc) { return _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc); }
static inline pv pv_set1(float x) { return _mm512_set1_ps(x); }
/* Longer calls: tiles of up to 8 rows x 3 columns of 16 outputs over the expanded panels: a column is a panel, and
   the panel's helpers serve. */
#define B_ROWS 8
#define CV 16
typedef pv cv;
#define cv_zero pv_zero
#define cv_load pv_load
#define cv_store pv_store
#define cv_fma pv_fma
/* 16 signed codes to q * scale + zero in one fused multiply-add: q * scale is exact (at most 8 bits times an fp16
   scale's 11), so the one rounding is that of the sum, as in transformers' q * scale, then + zero (a test checks
   the weights bit for bit). A multiply and an add would give the same bits, a little slower. */
static inline pv pv_codes(__m128i q, pv scale, pv zero) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale, zero);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 16 outputs in two registers; tiles of up to 4 rows x 1 panel. */
#define ROWS 4
#define PANELS 1
#define WIDE 4 /* panels a one-row call's tile */
/* Calls of up to this many rows (one tile) expand the codes in registers; longer ones through the buffer, once for
   all their tiles: a second tile expanding the codes again costs more than the buffer, and a single tile through
   the buffer more than in registers. */
#define FUSED_ROWS 4
/* Longer calls: tiles of up to 4 rows x 3 columns of 8 outputs (half a panel) over the expanded panels: 12 chains of
   fused multiply-adds, where 4 rows x 16 outputs have 8 (AVX2 has 16 registers), so more of them run at once. The
   same bits either way. */
#define B_ROWS 4
#define CV 8
typedef __m256 cv;
static inline cv cv_zero(void) { return _mm256_setzero_ps(); }
static inline cv cv_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void cv_store(float *p, cv v) { _mm256_storeu_ps(p, v); }
static inline cv cv_fma(float x, cv w, cv acc) { return _mm256_fmadd_ps(_mm256_set1_ps(x), w, acc); }
/* A panel is two columns. */
typedef struct {
    cv lo, hi;
} pv;
static inline pv pv_zero(void) { return (pv){cv_zero(), cv_zero()}; }
static inline pv pv_load(const float *p) { return (pv){cv_load(p), cv_load(p + CV)}; }
static inline void pv_store(float *p, pv v) {
    cv_store(p, v.lo);
    cv_store(p + CV, v.hi);
}
static inline pv pv_fma(float x, pv w, pv acc) { return (pv){cv_fma(x, w.lo, acc.lo), cv_fma(x, w.hi, acc.hi)}; }
static inline pv pv_set1(float x) { return (pv){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline __m256 codes8(__m128i q, __m256 scale, __m256 zero) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale, zero);
}
static inline pv pv_codes(__m128i q, pv scale, pv zero) {
    return (pv){codes8(q, scale.lo, zero.lo), codes8(_mm_srli_si128(q, 8), scale.hi, zero.hi)};
}
#else
#error "this kernel needs AVX2 and FMA (or AVX-512)"
#endif

/* A panel's weights for inputs 2i and 2i+1. */
static inline void pair(const uint8_t *codes, int bits, int64_t i, pv scale, pv zero, pv *w0, pv *w1) {
    __m128i a, b;
#if defined(__AVX512F__)
    if (bits == 4) {
        /* q - 8 as a float, from a table of -8..7 by vpermps, which reads only a lane's low 4 bits: each byte
           zero-extended to its lane gives the low nibble's value, and shifted right by 4 the high nibble's. The
           same floats as converting q - 8, in 4 instructions for two inputs where the conversion takes 9. */
        const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + P * i)));
        *w0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(raw, table), scale, zero);
        *w1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table), scale, zero);
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
    *w0 = pv_codes(a, scale, zero);
    *w1 = pv_codes(b, scale, zero);
}

/* A column's CV results into y, or only the first `left` of them (the last panel of the matrix may have fewer than
   16 real outputs). */
static inline void put_column(float *y, cv v, int64_t left) {
    if (left >= CV) {
        cv_store(y, v);
    } else if (left > 0) {
        float out[CV];
        cv_store(out, v);
        memcpy(y, out, sizeof(float) * (size_t)left);
    }
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

#if !defined(__AVX512F__) && !defined(__F16C__)
/* An fp16 value in fp32, exactly (subnormals, infinities and NaNs included): for an AVX2 build without F16C. */
static inline float half_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000 | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: mantissa * 2^-24, normalised */
        uint32_t e = 113;
        while (!(mantissa & 0x400)) mantissa <<= 1, e--;
        bits = sign | (e << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* CV weights of a dense panel from element `at` (fp16 and bf16 widened exactly; fp32 as they are). */
static inline cv cv_dense(const uint8_t *w, int64_t at, int bits) {
#if defined(__AVX512F__)
    if (bits == FULL) return _mm512_loadu_ps((const float *)w + at);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at));
    if (bits == HALF) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
    if (bits == FULL) return _mm256_loadu_ps((const float *)w + at);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + at));
#if defined(__F16C__)
    if (bits == HALF) return _mm256_cvtph_ps(h);
#else
    if (bits == HALF) {
        float widened[CV];
        for (int i = 0; i < CV; i++) widened[i] = half_float(((const uint16_t *)w)[at + i]);
        return _mm256_loadu_ps(widened);
    }
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#endif
}

/* 16 fp16 scales (F16_SCALES) in fp32, exactly, as a dense fp16 panel's values are widened. */
static inline pv pv_half(const uint16_t *h) {
#if defined(__AVX512F__)
    return cv_dense((const uint8_t *)h, 0, HALF);
#else
    return (pv){cv_dense((const uint8_t *)h, 0, HALF), cv_dense((const uint8_t *)h, CV, HALF)};
#endif
}

/* 16 bytes (K_SCALES's sc or m) as fp32 values. */
static inline pv pv_bytes(const uint8_t *p) {
#if defined(__AVX512F__)
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return (pv){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))))};
#endif
}

/* Q4_K's scale d * sc and zero 8 * scale - dmin * m from its factors, one rounding each as codes.py computes them
   (d * sc and dmin * m are exact: 11 bits times 6; 8 * scale too). */
static inline void pv_k(pv d, pv dmin, pv sc, pv m, pv *s, pv *z) {
#if defined(__AVX512F__)
    *s = _mm512_mul_ps(d, sc);
    *z = _mm512_fmsub_ps(_mm512_set1_ps(8.0f), *s, _mm512_mul_ps(dmin, m));
#else
    const __m256 eight = _mm256_set1_ps(8.0f);
    *s = (pv){_mm256_mul_ps(d.lo, sc.lo), _mm256_mul_ps(d.hi, sc.hi)};
    *z = (pv){_mm256_fmsub_ps(eight, s->lo, _mm256_mul_ps(dmin.lo, m.lo)),
              _mm256_fmsub_ps(eight, s->hi, _mm256_mul_ps(dmin.hi, m.hi))};
#endif
}

enum { SCALES_FP32, SCALES_F16, SCALES_K }; /* a panel's scales: fp32 scales and zeros, F16_SCALES, K_SCALES */
#define K_RECORD 320 /* K_SCALES's bytes a super-block of a panel: d, dmin (16 fp16 each), 8 x 16 sc, 8 x 16 m */

/* Block b's scales and zeros of `panels` panels, by their `form`: fp32 (SIXTEEN's zeros -0.0, unread); fp16 scales,
   blocks x 16 a panel, and zeros -0.0, not stored; or Q4_K's factors, a K_RECORD a super-block. */
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
                 pv_bytes(k + 64 + 8 * P + P * j), &s[g], &z[g]);
        } else {
            s[g] = pv_load(scale + (g * blocks + b) * P);
            z[g] = bits == SIXTEEN ? pv_set1(-0.0f) : pv_load(zero + (g * blocks + b) * P);
        }
    }
}

/* A tile of up to ROWS rows against `panels` panels, the codes expanded in registers. */
static inline __attribute__((always_inline)) void fused(int rows, int panels, const uint8_t *codes,
                                                        int64_t panel_bytes, int bits, int form, const float *scale,
                                                        const float *zero, const float *x, int64_t K, float *y,
                                                        int64_t N, int64_t outputs) {
    pv acc[ROWS][PANELS];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < panels; g++) acc[r][g] = pv_zero();
    int64_t inputs = scale_inputs(bits), blocks = K / inputs;
    for (int64_t b = 0; b < blocks; b++) {
        pv s[PANELS], z[PANELS];
        block_scales(panels, scale, zero, bits, form, blocks, b, s, z);
        for (int64_t i = b * inputs / 2; i < (b + 1) * inputs / 2; i++) {
            pv w0[PANELS], w1[PANELS];
            for (int g = 0; g < panels; g++) pair(codes + g * panel_bytes, bits, i, s[g], z[g], &w0[g], &w1[g]);
            for (int r = 0; r < rows; r++)
                for (int g = 0; g < panels; g++) acc[r][g] = pv_fma(x[r * K + 2 * i], w0[g], acc[r][g]);
            for (int r = 0; r < rows; r++)
                for (int g = 0; g < panels; g++) acc[r][g] = pv_fma(x[r * K + 2 * i + 1], w1[g], acc[r][g]);
        }
    }
    put(rows, panels, acc, y, N, outputs);
}

/* A call of one row against up to WIDE panels, the codes expanded in registers: the same chain of multiply-adds for
   each output as fused's, but WIDE chains in flight at once where a one-row tile of fused has PANELS, each waiting on
   the latency of its last fused multiply-add (a decode step of one stream is mostly such calls). */
static inline __attribute__((always_inline)) void one_row(int panels, const uint8_t *codes, int64_t panel_bytes,
                                                          int bits, int form, const float *scale, const float *zero,
                                                          const float *x, int64_t K, float *y, int64_t outputs) {
    pv acc[WIDE];
    for (int g = 0; g < panels; g++) acc[g] = pv_zero();
    int64_t inputs = scale_inputs(bits), blocks = K / inputs;
    for (int64_t b = 0; b < blocks; b++) {
        pv s[WIDE], z[WIDE];
        block_scales(panels, scale, zero, bits, form, blocks, b, s, z);
        for (int64_t i = b * inputs / 2; i < (b + 1) * inputs / 2; i++) {
            float x0 = x[2 * i], x1 = x[2 * i + 1];
            for (int g = 0; g < panels; g++) {
                pv w0, w1;
                pair(codes + g * panel_bytes, bits, i, s[g], z[g], &w0, &w1);
                acc[g] = pv_fma(x1, w1, pv_fma(x0, w0, acc[g]));
            }
        }
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


/* Up to B_ROWS rows against `cols` columns (CV outputs each), from column c0, of the panels of values at w (K x 16
   a panel): a dense layer's own (HALF, BRAIN, FULL), or the codes of GROUP panels expanded into fp32 (FULL); the
   same chain of multiply-adds for each output as every other path. */
static inline __attribute__((always_inline)) void dense(int rows, int cols, int c0, const uint8_t *w, int bits,
                                                        const float *x, int64_t K, float *y, int64_t N,
                                                        int64_t outputs) {
    cv acc[B_ROWS][B_COLS];
    int64_t at[B_COLS];
    for (int c = 0; c < cols; c++) at[c] = (int64_t)(c0 + c) * CV / P * K * P + (int64_t)(c0 + c) * CV % P;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = cv_zero();
    for (int64_t k = 0; k < K; k++) {
        cv wk[B_COLS];
        for (int c = 0; c < cols; c++) wk[c] = cv_dense(w, at[c] + k * P, bits);
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) acc[r][c] = cv_fma(x[r * K + k], wk[c], acc[r][c]);
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            int64_t first = (int64_t)(c0 + c) * CV;
            put_column(y + r * N + first, acc[r][c], outputs - first);
        }
}

static void expand(const uint8_t *codes, int bits, int form, const float *scale, const float *zero, int64_t K,
                   float *w) {
    int64_t inputs = scale_inputs(bits);
    for (int64_t b = 0; b < K / inputs; b++) {
        pv s, z;
        block_scales(1, scale, zero, bits, form, K / inputs, b, &s, &z);
        for (int64_t i = b * inputs / 2; i < (b + 1) * inputs / 2; i++) {
            pv w0, w1;
            pair(codes, bits, i, s, z, &w0, &w1);
            pv_store(w + 2 * i * P, w0);
            pv_store(w + (2 * i + 1) * P, w1);
        }
    }
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

/* Panels p .. p+group-1 of y = x . W^T from the panels of values at w (the group's first; K x 16 a panel: a dense
   layer's own, or codes expanded into fp32, FULL), in tiles of up to B_ROWS rows. */
static void dense_group(const float *x, int64_t M, int64_t K, const uint8_t *w, int bits, int64_t N, float *y,
                        int64_t p, int group) {
    int columns = group * P / CV;
    int64_t tiles = (M + B_ROWS - 1) / B_ROWS, r = 0;
    for (int64_t t = 0; t < tiles; t++) {
        int64_t rows = tile_rows(M, r, t, tiles);
        const float *xr = x + r * K;
        float *yr = y + r * N + p * P;
        for (int c0 = 0; c0 < columns; c0 += B_COLS) {
            int cols = columns - c0 < B_COLS ? columns - c0 : B_COLS;
            /* the kind a constant in each specialisation (always_inline): no test in the inner loop */
#define DENSE_HALF(R, C) if (R <= B_ROWS) dense(R, C, c0, w, HALF, xr, K, yr, N, N - p * P)
#define DENSE_BRAIN(R, C) if (R <= B_ROWS) dense(R, C, c0, w, BRAIN, xr, K, yr, N, N - p * P)
#define DENSE_FULL(R, C) if (R <= B_ROWS) dense(R, C, c0, w, FULL, xr, K, yr, N, N - p * P)
            if (bits == HALF) {
                BY_ROWS(DENSE_HALF, rows, cols)
            } else if (bits == BRAIN) {
                BY_ROWS(DENSE_BRAIN, rows, cols)
            } else {
                BY_ROWS(DENSE_FULL, rows, cols)
            }
        }
        r += rows;
    }
}

/* Panels [p0, p1) of y = x . W^T (N outputs a row of y), `buffer` holding GROUP panels when M > FUSED_ROWS: calls
   of up to FUSED_ROWS rows expand the codes in registers in every tile; longer ones expand GROUP panels at a time
   into the buffer once, and their tiles read them there. Each output's chain of multiply-adds is the same whatever
   the range and the tiles, so the results are the same bits however a call's panels are split. */
void fp32_panels(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
                 const float *zero, int64_t N, float *y, int64_t p0, int64_t p1, float *buffer) {
    int form = bits & F16_SCALES ? SCALES_F16 : bits & K_SCALES ? SCALES_K : SCALES_FP32;
    bits &= ~(F16_SCALES | K_SCALES);
    int64_t panel_bytes = code_bytes(K, bits), blocks = K / scale_inputs(bits); /* blocks: scales a panel's output */
    /* floats a panel's scales and zeros take (fp16 scales: half as many; K_SCALES: a K_RECORD a super-block) */
    int64_t scales = form == SCALES_F16 ? blocks * P / 2 : form == SCALES_K ? blocks / 8 * K_RECORD / 4 : blocks * P;
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
            switch (panels) { /* a constant count in each (always_inline) */
#define ONE_ROW(G) \
    case G: if (G <= WIDE) one_row(G, c, panel_bytes, bits, form, s, z, x, K, yq, N - q * P); break;
                ONE_ROW(8) ONE_ROW(7) ONE_ROW(6) ONE_ROW(5) ONE_ROW(4) ONE_ROW(3) ONE_ROW(2)
                default: one_row(1, c, panel_bytes, bits, form, s, z, x, K, yq, N - q * P);
            }
        }
        return;
    }
    for (int64_t p = p0; p < p1; p += GROUP) {
        int group = p1 - p < GROUP ? (int)(p1 - p) : GROUP;
        if (M > FUSED_ROWS) {
            for (int g = 0; g < group; g++) {
                int64_t at = p + g;
                expand(codes + at * panel_bytes, bits, form, scale + at * scales, zero + at * zeros, K,
                       buffer + g * K * P);
            }
            dense_group(x, M, K, (const uint8_t *)buffer, FULL, N, y, p, group);
            continue;
        }
        for (int64_t q = p; q < p + group; q += PANELS) {
            int panels = p + group - q < PANELS ? (int)(p + group - q) : PANELS;
            const uint8_t *c = codes + q * panel_bytes;
            const float *s = scale + q * scales, *z = zero + q * zeros;
            int64_t tiles = (M + ROWS - 1) / ROWS, r = 0;
            for (int64_t t = 0; t < tiles; t++) {
                int64_t rows = tile_rows(M, r, t, tiles);
#define FUSED(R, G)                                                                                                    \
    if (R <= ROWS && G <= PANELS)                                                                                      \
    fused(R, G, c, panel_bytes, bits, form, s, z, x + r * K, K, y + r * N + q * P, N, N - q * P)
                BY_ROWS(FUSED, rows, panels)
                r += rows;
            }
        }
    }
}

/* Sets *buffer to the buffer fp32_panels needs for M rows (one a thread, kept; NULL where it needs none). Returns 0,
   or -1 if it cannot be allocated. */
int fp32_buffer(int64_t M, int64_t K, float **buffer) {
    static _Thread_local struct ttft_buffer kept = {NULL, 0};
    *buffer = M > FUSED_ROWS ? ttft_grow(&kept, GROUP * P * K) : NULL;
    return M > FUSED_ROWS && *buffer == NULL ? -1 : 0;
}

int fp32_takes(int64_t K, int bits) {
    if (bits == (4 | K_SCALES)) return K % 256 == 0;
    int codes = bits & ~F16_SCALES, half = bits != codes;
    return K % BLOCK == 0 && (codes == 4 || codes == 8 || (!half && (bits == SIXTEEN || dense_bits(bits))));
}

int fp32_alone(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
               const float *zero, int64_t N, float *y) {
    float *buffer;
    if (fp32_buffer(M, K, &buffer) != 0) return -1;
    fp32_panels(x, M, K, codes, bits, scale, zero, N, y, 0, (N + P - 1) / P, buffer);
    return 0;
}
