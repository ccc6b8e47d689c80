/* fp32 rows times a weight kept in a GGUF file's own blocks, for CPU (ttft_sse/engine/cpu/kernel.py builds it).

   y[M,N] = x[M,K] . W[N,K]^T. W's blocks of 32 inputs hold w = q * scale + zero, one scale and one zero a block
   (q: 4-bit codes less 8, or 8-bit codes); or, with bits SIXTEEN (Q6_K's), w = q * scale with 8-bit codes and one
   scale each 16 inputs, no zero (the kernel adds -0.0, which changes no value). kernel.py lays them out in panels
   of 16 outputs (N padded to whole panels with zero weights):
     4-bit codes: panels x K/2 x 16 bytes; byte j of row i holds output j's code for input 2i (low nibble) and for
                  input 2i+1 (high nibble), each plus 8;
     8-bit codes: panels x K x 16 signed bytes (SIXTEEN's too);
     scale, zero: panels x K/32 x 16 floats (SIXTEEN: scale panels x K/16 x 16 floats, zero unread);
     dense (HALF, BRAIN, FULL: an F16, BF16 or F32 file's weights): panels x K x 16 values, no scale or zero, each
                  widened exactly to fp32 as it is read (fp16 by F16C, bf16 by a shift).
   Each input's 16 weights of a panel are expanded to fp32 (the values transformers' loader gives: q * scale, then
   + zero) and multiplied into 16 outputs at once: out[n] = fma(x[k], w[k][n], out[n]) for k = 0, 1, ..., K-1, from
   zero. That chain is the same whatever M is and wherever a row falls, so a row's result does not depend on the
   other rows of the call (a stream's answer does not depend on its batch). A tile of rows (up to 8 rows x 48
   outputs with AVX-512, 4 x 16 with AVX2) expands the codes in registers for all its rows at once, in calls of up
   to FUSED_ROWS rows; longer calls expand three panels at a time into a buffer once and reuse them for every tile
   (8 rows x 48 outputs with AVX-512, 4 x 24 with AVX2). Both give the same bits. Built with -ffp-contract=off: only
   the written fused multiply-adds fuse. */

#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel.h"

#define P 16          /* outputs a panel */
#define BLOCK 32      /* inputs a block */
#define SIXTEEN 6     /* bits of Q6_K's layout: 8-bit codes, a scale each 16 inputs, no zero */
#define HALF 16       /* dense layouts (F16, BF16 and F32 files): the weights themselves, no scale or zero: fp16, */
#define BRAIN 17      /* bf16 */
#define FULL 32       /* and fp32 values */
#define GROUP 3       /* panels expanded into the buffer at a time */
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

/* A tile of up to ROWS rows against `panels` panels, the codes expanded in registers. */
static inline __attribute__((always_inline)) void fused(int rows, int panels, const uint8_t *codes,
                                                        int64_t panel_bytes, int bits, const float *scale,
                                                        const float *zero, const float *x, int64_t K, float *y,
                                                        int64_t N, int64_t outputs) {
    pv acc[ROWS][PANELS];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < panels; g++) acc[r][g] = pv_zero();
    int64_t inputs = scale_inputs(bits), blocks = K / inputs;
    for (int64_t b = 0; b < blocks; b++) {
        pv s[PANELS], z[PANELS];
        for (int g = 0; g < panels; g++) {
            s[g] = pv_load(scale + (g * blocks + b) * P);
            z[g] = bits == SIXTEEN ? pv_set1(-0.0f) : pv_load(zero + (g * blocks + b) * P);
        }
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
                                                          int bits, const float *scale, const float *zero,
                                                          const float *x, int64_t K, float *y, int64_t outputs) {
    pv acc[WIDE];
    for (int g = 0; g < panels; g++) acc[g] = pv_zero();
    int64_t inputs = scale_inputs(bits), blocks = K / inputs;
    for (int64_t b = 0; b < blocks; b++) {
        pv s[WIDE], z[WIDE];
        for (int g = 0; g < panels; g++) {
            s[g] = pv_load(scale + (g * blocks + b) * P);
            z[g] = bits == SIXTEEN ? pv_set1(-0.0f) : pv_load(zero + (g * blocks + b) * P);
        }
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

/* Up to B_ROWS rows against `cols` columns (CV outputs each), from column c0, of the panels expanded in w (K x 16
   floats a panel); `outputs`: the real outputs from w's first. */
static inline __attribute__((always_inline)) void buffered(int rows, int cols, int c0, const float *w, const float *x,
                                                           int64_t K, float *y, int64_t N, int64_t outputs) {
    cv acc[B_ROWS][B_COLS];
    const float *at[B_COLS];
    for (int c = 0; c < cols; c++) at[c] = w + (c0 + c) * CV / P * K * P + (c0 + c) * CV % P;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = cv_zero();
    for (int64_t k = 0; k < K; k++) {
        cv wk[B_COLS];
        for (int c = 0; c < cols; c++) wk[c] = cv_load(at[c] + k * P);
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) acc[r][c] = cv_fma(x[r * K + k], wk[c], acc[r][c]);
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            int64_t first = (int64_t)(c0 + c) * CV;
            put_column(y + r * N + first, acc[r][c], outputs - first);
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

/* Up to B_ROWS rows against `cols` columns (CV outputs each), from column c0, of the dense panels at w (K x 16
   values a panel): as buffered, the weights read from the layer's own values, so the same chain of multiply-adds
   for each output as every other path. */
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

static void expand(const uint8_t *codes, int bits, const float *scale, const float *zero, int64_t K, float *w) {
    int64_t inputs = scale_inputs(bits);
    for (int64_t b = 0; b < K / inputs; b++) {
        pv s = pv_load(scale + P * b), z = bits == SIXTEEN ? pv_set1(-0.0f) : pv_load(zero + P * b);
        for (int64_t i = b * inputs / 2; i < (b + 1) * inputs / 2; i++) {
            pv w0, w1;
            pair(codes, bits, i, s, z, &w0, &w1);
            pv_store(w + 2 * i * P, w0);
            pv_store(w + (2 * i + 1) * P, w1);
        }
    }
}

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

/* Panels [p0, p1) of y = x . W^T for a dense layout: GROUP panels at a time, in tiles of up to B_ROWS rows. */
static void dense_panels(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, int64_t N, float *y,
                         int64_t p0, int64_t p1) {
    int64_t panel_bytes = code_bytes(K, bits);
    for (int64_t p = p0; p < p1; p += GROUP) {
        int group = p1 - p < GROUP ? (int)(p1 - p) : GROUP;
        const uint8_t *w = codes + p * panel_bytes;
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
}

/* Panels [p0, p1) of y = x . W^T (N outputs a row of y), `buffer` holding GROUP panels when M > FUSED_ROWS: calls
   of up to FUSED_ROWS rows expand the codes in registers in every tile; longer ones expand GROUP panels at a time
   into the buffer once, and their tiles read them there. Each output's chain of multiply-adds is the same whatever
   the range and the tiles, so the results are the same bits however a call's panels are split. */
static void fp32_panels(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
                        const float *zero, int64_t N, float *y, int64_t p0, int64_t p1, float *buffer) {
    if (dense_bits(bits)) {
        dense_panels(x, M, K, codes, bits, N, y, p0, p1);
        return;
    }
    int64_t panel_bytes = code_bytes(K, bits), blocks = K / scale_inputs(bits); /* blocks: scales a panel's output */
    if (M == 1) {
        for (int64_t q = p0; q < p1; q += WIDE) {
            int panels = p1 - q < WIDE ? (int)(p1 - q) : WIDE;
            const uint8_t *c = codes + q * panel_bytes;
            const float *s = scale + q * blocks * P, *z = zero + q * blocks * P;
            float *yq = y + q * P;
            switch (panels) { /* a constant count in each (always_inline) */
#define ONE_ROW(G)                                                                                                         case G: if (G <= WIDE) one_row(G, c, panel_bytes, bits, s, z, x, K, yq, N - q * P); break;
                ONE_ROW(8) ONE_ROW(7) ONE_ROW(6) ONE_ROW(5) ONE_ROW(4) ONE_ROW(3) ONE_ROW(2)
                default: one_row(1, c, panel_bytes, bits, s, z, x, K, yq, N - q * P);
            }
        }
        return;
    }
    for (int64_t p = p0; p < p1; p += GROUP) {
        int group = p1 - p < GROUP ? (int)(p1 - p) : GROUP;
        if (M > FUSED_ROWS) {
            for (int g = 0; g < group; g++) {
                int64_t at = p + g;
                expand(codes + at * panel_bytes, bits, scale + at * blocks * P, zero + at * blocks * P, K,
                       buffer + g * K * P);
            }
            int columns = group * P / CV;
            int64_t tiles = (M + B_ROWS - 1) / B_ROWS, r = 0;
            for (int64_t t = 0; t < tiles; t++) {
                int64_t rows = tile_rows(M, r, t, tiles);
                for (int c0 = 0; c0 < columns; c0 += B_COLS) {
                    int cols = columns - c0 < B_COLS ? columns - c0 : B_COLS;
#define BUFFERED(R, C)                                                                                                 \
    if (R <= B_ROWS) buffered(R, C, c0, buffer, x + r * K, K, y + r * N + p * P, N, N - p * P)
                    BY_ROWS(BUFFERED, rows, cols)
                }
                r += rows;
            }
            continue;
        }
        for (int64_t q = p; q < p + group; q += PANELS) {
            int panels = p + group - q < PANELS ? (int)(p + group - q) : PANELS;
            const uint8_t *c = codes + q * panel_bytes;
            const float *s = scale + q * blocks * P, *z = zero + q * blocks * P;
            int64_t tiles = (M + ROWS - 1) / ROWS, r = 0;
            for (int64_t t = 0; t < tiles; t++) {
                int64_t rows = tile_rows(M, r, t, tiles);
#define FUSED(R, G)                                                                                                    \
    if (R <= ROWS && G <= PANELS) fused(R, G, c, panel_bytes, bits, s, z, x + r * K, K, y + r * N + q * P, N, N - q * P)
                BY_ROWS(FUSED, rows, panels)
                r += rows;
            }
        }
    }
}

/* Sets *buffer to the buffer fp32_panels needs for M rows (one a thread, kept; NULL where it needs none). Returns 0,
   or -1 if it cannot be allocated. */
static int fp32_buffer(int64_t M, int64_t K, float **buffer) {
    static _Thread_local struct ttft_buffer kept = {NULL, 0};
    *buffer = M > FUSED_ROWS ? ttft_grow(&kept, GROUP * P * K) : NULL;
    return M > FUSED_ROWS && *buffer == NULL ? -1 : 0;
}

static int shared_fp32(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
                       const float *zero, int64_t N, float *y);

/* Returns 0, or -1 if K is not whole blocks, bits is not 4, 8, SIXTEEN or a dense layout's, or a buffer cannot be
   allocated. With the helper thread started (ttft_helper_start, below), a call large enough
   shares its panels with it. */
int ttft_blocks_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
                       const float *zero, int64_t N, float *y) {
    if (K % BLOCK != 0 || (bits != 4 && bits != 8 && bits != SIXTEEN && !dense_bits(bits))) return -1;
    if (M <= 0) return 0;
    int shared = shared_fp32(x, M, K, codes, bits, scale, zero, N, y);
    if (shared <= 0) return shared;
    float *buffer;
    if (fp32_buffer(M, K, &buffer) != 0) return -1;
    fp32_panels(x, M, K, codes, bits, scale, zero, N, y, 0, (N + P - 1) / P, buffer);
    return 0;
}

/* ---- int8 rows (TTFT_GGUF_ACTIVATIONS=int8): the rows quantised as llama.cpp quantises them ----

   Each row is quantised per block of 32 inputs, as llama.cpp's Q8_0: d = max|x| / 127, xq = x * (127 / max|x|)
   rounded (halves to even). A weight is w = scale * c + offset with an unsigned code c (4-bit codes 0..15, 8-bit
   codes plus 128), so a block's share of output n is scale * d * sum(c * xq) + offset * d * sum(xq): the integer
   sum exact, then two fused multiply-adds a block, block after block from zero. As above, that chain does not
   depend on M or on the row's place in the call; and the integer sums are exact on both builds below, which then
   round the same operations in the same order, so they give the same bits.
   Layout (kernel.py's records): panels of 16 outputs, each K/32 records of a block, one after the other:
     4-bit codes: 4 groups of 64 bytes; byte 4j+t of group g holds output j's code for input 8g+t (low nibble) and
                  for input 8g+4+t (high nibble);
     8-bit codes: 8 groups of 64 bytes; byte 4j+t of group g: output j's code for input 4g+t, plus 128;
     then the 16 outputs' scales and the 16 offsets, fp16 (the file's own values).
   AVX-512 VNNI: vpdpbusd sums four code x row products into a lane of 32 bits. Tiles of up to 4 rows x 3 panels:
   of the shapes that fit the registers, the best or near it from 1 to 128 rows.
   AVX2 (with F16C, for the fp16 scales): vpmaddubsw sums two products into 16 bits, and the same lanes of 64 bytes
   (a group) are two registers of 8 outputs. A 4-bit block's 16 products an output-half lane add up to at most
   16 * 15 * 127 < 2^15, so they sum in 16 bits and widen once a block (vpmaddwd by ones). 8-bit codes would
   overflow 16 bits (255 * 127 * 2): they are taken as signed codes c - 128 (llama.cpp's sign trick: |c - 128| times
   xq with c's sign), widened every group, and 128 * sum(xq) is added back: the same integer sum as vpdpbusd's. */

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q_VNNI
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q_AVX2
#endif

/* The rows' steps (M x K bytes: M * K / 4 floats, K being whole blocks of 32), then d, d * sum and sum: the floats
   a call of M rows needs for its quantised rows. */
static inline int64_t q8_floats(int64_t M, int64_t K) { return M * K / 4 + 3 * M * (K / BLOCK); }

#if defined(Q_VNNI) || defined(Q_AVX2)
#define RECORD(bits) ((bits) == 4 ? 256 + 64 : 512 + 64)

#if defined(Q_VNNI)
#define Q_ROWS 4
#define Q_PANELS 3

/* Rows quantised: xq (M x K int8), d, d * sum(xq) and sum(xq) (M x K/32 each). */
static void quantise(const float *x, int64_t M, int64_t K, int8_t *xq, float *d, float *ds, int32_t *sx) {
    int64_t blocks = K / BLOCK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + r * K + b * BLOCK;
            __m512 a = _mm512_loadu_ps(v), c = _mm512_loadu_ps(v + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
            float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m512 iv = _mm512_set1_ps(inverse);
            __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, iv)), qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, iv));
            int8_t *out = xq + r * K + b * BLOCK;
            _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtsepi32_epi8(qc));
            int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
            d[r * blocks + b] = scale;
            ds[r * blocks + b] = scale * (float)sum;
            sx[r * blocks + b] = sum;
        }
}

static inline __attribute__((always_inline)) void q_tile(int rows, int panels, const uint8_t *records,
                                                         int64_t panel_bytes, int bits, const int8_t *xq,
                                                         const float *d, const float *ds, const int32_t *sx,
                                                         int64_t K, float *y, int64_t N, int64_t outputs) {
    (void)sx;
    pv acc[ROWS][PANELS]; /* pv is __m512 here; the fp32 tiles' shape, so that put() stores it (Q_ROWS <= ROWS) */
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < panels; g++) acc[r][g] = pv_zero();
    int64_t blocks = K / BLOCK, record = RECORD(bits);
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sums[Q_ROWS][Q_PANELS];
        const uint8_t *block[Q_PANELS];
        for (int g = 0; g < panels; g++) block[g] = records + g * panel_bytes + b * record;
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < panels; g++) sums[r][g] = _mm512_setzero_si512();
        if (bits == 4) {
            for (int i = 0; i < 4; i++) {
                __m512i lo[Q_PANELS], hi[Q_PANELS];
                for (int g = 0; g < panels; g++) {
                    __m512i raw = _mm512_loadu_si512(block[g] + 64 * i);
                    lo[g] = _mm512_and_si512(raw, low);
                    hi[g] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                }
                for (int r = 0; r < rows; r++) {
                    int32_t first, second;
                    memcpy(&first, xq + r * K + b * BLOCK + 8 * i, 4);
                    memcpy(&second, xq + r * K + b * BLOCK + 8 * i + 4, 4);
                    __m512i xa = _mm512_set1_epi32(first), xb = _mm512_set1_epi32(second);
                    for (int g = 0; g < panels; g++) {
                        sums[r][g] = _mm512_dpbusd_epi32(sums[r][g], lo[g], xa);
                        sums[r][g] = _mm512_dpbusd_epi32(sums[r][g], hi[g], xb);
                    }
                }
            }
        } else {
            for (int i = 0; i < 8; i++) {
                __m512i c[Q_PANELS];
                for (int g = 0; g < panels; g++) c[g] = _mm512_loadu_si512(block[g] + 64 * i);
                for (int r = 0; r < rows; r++) {
                    int32_t four;
                    memcpy(&four, xq + r * K + b * BLOCK + 4 * i, 4);
                    __m512i xa = _mm512_set1_epi32(four);
                    for (int g = 0; g < panels; g++) sums[r][g] = _mm512_dpbusd_epi32(sums[r][g], c[g], xa);
                }
            }
        }
        for (int g = 0; g < panels; g++) {
            const uint8_t *tail = block[g] + record - 64;
            __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tail));
            __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tail + 32)));
            for (int r = 0; r < rows; r++) {
                __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(d[r * blocks + b]));
                acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][g]), sd, acc[r][g]);
                acc[r][g] = _mm512_fmadd_ps(o, _mm512_set1_ps(ds[r * blocks + b]), acc[r][g]);
            }
        }
    }
    put(rows, panels, acc, y, N, outputs);
}

#else /* Q_AVX2 */
/* Tiles of up to 4 rows x 1 panel (16 outputs: 2 registers), both halves sharing each row's broadcast steps: tiles
   of 2 or 3 rows do alike, and more panels, or each half panel in turn, are slower. */
#define Q_ROWS 4
#define Q_PANELS 1

/* As the VNNI build's: the same roundings (one product, one conversion a value), the same integer sums. */
static void quantise(const float *x, int64_t M, int64_t K, int8_t *xq, float *d, float *ds, int32_t *sx) {
    int64_t blocks = K / BLOCK;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + r * K + b * BLOCK;
            __m256 a[4];
            for (int j = 0; j < 4; j++) a[j] = _mm256_loadu_ps(v + 8 * j);
            __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(a[0], magnitude), _mm256_and_ps(a[1], magnitude)),
                                     _mm256_max_ps(_mm256_and_ps(a[2], magnitude), _mm256_and_ps(a[3], magnitude)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float amax = _mm_cvtss_f32(h);
            float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m256 iv = _mm256_set1_ps(inverse);
            __m256i q[4];
            for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(a[j], iv));
            __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + r * K + b * BLOCK), _mm256_permutevar8x32_epi32(packed, order));
            __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
            int sum = _mm_cvtsi128_si32(t);
            d[r * blocks + b] = scale;
            ds[r * blocks + b] = scale * (float)sum;
            sx[r * blocks + b] = sum;
        }
}

/* 8 results into y, or only the first `left` of them. */
static inline void q_put(float *y, __m256 v, int64_t left) {
    if (left >= 8) {
        _mm256_storeu_ps(y, v);
    } else if (left > 0) {
        float out[8];
        _mm256_storeu_ps(out, v);
        memcpy(y, out, sizeof(float) * (size_t)left);
    }
}

/* A tile of up to Q_ROWS rows x Q_PANELS panels, each panel two registers of 8 outputs, block after block. */
static inline __attribute__((always_inline)) void q_tile(int rows, int panels, const uint8_t *records,
                                                         int64_t panel_bytes, int bits, const int8_t *xq,
                                                         const float *d, const float *ds, const int32_t *sx,
                                                         int64_t K, float *y, int64_t N, int64_t outputs) {
    enum { H = 2 * Q_PANELS }; /* columns of 8 outputs */
    __m256 acc[Q_ROWS][H];
    int columns = 2 * panels;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < columns; c++) acc[r][c] = _mm256_setzero_ps();
    int64_t blocks = K / BLOCK, record = RECORD(bits);
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block[Q_PANELS];
        for (int g = 0; g < panels; g++) block[g] = records + g * panel_bytes + b * record;
        __m256i sums[Q_ROWS][H];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < columns; c++) sums[r][c] = _mm256_setzero_si256();
        if (bits == 4) {
            for (int i = 0; i < 4; i++) {
                __m256i lo[H], hi[H];
                for (int c = 0; c < columns; c++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(block[c / 2] + 64 * i + 32 * (c % 2)));
                    lo[c] = _mm256_and_si256(raw, low);
                    hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                }
                for (int r = 0; r < rows; r++) {
                    int32_t first, second;
                    memcpy(&first, xq + r * K + b * BLOCK + 8 * i, 4);
                    memcpy(&second, xq + r * K + b * BLOCK + 8 * i + 4, 4);
                    __m256i xa = _mm256_set1_epi32(first), xb = _mm256_set1_epi32(second);
                    for (int c = 0; c < columns; c++) {
                        sums[r][c] = _mm256_add_epi16(sums[r][c], _mm256_maddubs_epi16(lo[c], xa));
                        sums[r][c] = _mm256_add_epi16(sums[r][c], _mm256_maddubs_epi16(hi[c], xb));
                    }
                }
            }
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < columns; c++) sums[r][c] = _mm256_madd_epi16(sums[r][c], ones);
        } else {
            for (int i = 0; i < 8; i++) {
                __m256i code[H], magnitude[H];
                for (int c = 0; c < columns; c++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(block[c / 2] + 64 * i + 32 * (c % 2)));
                    code[c] = _mm256_xor_si256(raw, bias); /* c - 128, signed */
                    magnitude[c] = _mm256_abs_epi8(code[c]);
                }
                for (int r = 0; r < rows; r++) {
                    int32_t four;
                    memcpy(&four, xq + r * K + b * BLOCK + 4 * i, 4);
                    __m256i xa = _mm256_set1_epi32(four);
                    for (int c = 0; c < columns; c++) {
                        __m256i pairs = _mm256_maddubs_epi16(magnitude[c], _mm256_sign_epi8(xa, code[c]));
                        sums[r][c] = _mm256_add_epi32(sums[r][c], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
            for (int r = 0; r < rows; r++) {
                __m256i back = _mm256_set1_epi32(128 * sx[r * blocks + b]);
                for (int c = 0; c < columns; c++) sums[r][c] = _mm256_add_epi32(sums[r][c], back);
            }
        }
        for (int c = 0; c < columns; c++) {
            const uint8_t *tail = block[c / 2] + record - 64 + 16 * (c % 2);
            __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tail));
            __m256 o = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tail + 32)));
            for (int r = 0; r < rows; r++) {
                __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(d[r * blocks + b]));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][c]), sd, acc[r][c]);
                acc[r][c] = _mm256_fmadd_ps(o, _mm256_set1_ps(ds[r * blocks + b]), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < columns; c++) q_put(y + r * N + 8 * c, acc[r][c], outputs - 8 * (int64_t)c);
}
#endif

struct q8_rows {
    int8_t *xq;
    float *d, *ds;
    int32_t *sx;
};

/* The quantised rows of M x K laid out in `buffer` (q8_floats floats). */
static struct q8_rows q8_view(float *buffer, int64_t M, int64_t K) {
    int64_t blocks = K / BLOCK;
    struct q8_rows q = {(int8_t *)buffer, buffer + M * K / 4, buffer + M * K / 4 + M * blocks, NULL};
    q.sx = (int32_t *)(q.ds + M * blocks);
    return q;
}

/* Rows x quantised into `buffer` (q8_floats floats). */
static struct q8_rows q8_quantise(const float *x, int64_t M, int64_t K, float *buffer) {
    struct q8_rows q = q8_view(buffer, M, K);
    quantise(x, M, K, q.xq, q.d, q.ds, q.sx);
    return q;
}

/* Panels [p0, p1) of y for the quantised rows q. */
static void q8_panels(struct q8_rows q, int64_t M, int64_t K, const uint8_t *records, int bits, int64_t N, float *y,
                      int64_t p0, int64_t p1) {
    int64_t blocks = K / BLOCK, panel_bytes = blocks * RECORD(bits);
    for (int64_t p = p0; p < p1; p += Q_PANELS) {
        int panels = p1 - p < Q_PANELS ? (int)(p1 - p) : Q_PANELS;
        const uint8_t *c = records + p * panel_bytes;
        int64_t tiles = (M + Q_ROWS - 1) / Q_ROWS, r = 0;
        for (int64_t t = 0; t < tiles; t++) {
            int64_t rows = tile_rows(M, r, t, tiles);
#define Q_TILE(R, G)                                                                                                   \
    if (R <= Q_ROWS && G <= Q_PANELS)                                                                                  \
    q_tile(R, G, c, panel_bytes, bits, q.xq + r * K, q.d + r * blocks, q.ds + r * blocks, q.sx + r * blocks, K,        \
           y + r * N + p * P, N, N - p * P)
            BY_ROWS(Q_TILE, rows, panels)
            r += rows;
        }
    }
}

static int shared_q8(const float *x, int64_t M, int64_t K, const uint8_t *records, int bits, int64_t N, float *y);

/* Returns 0; -1 if K is not whole blocks, bits is neither 4 nor 8, or the row buffer cannot be allocated. With the
   helper thread started, a call large enough shares its panels with it. */
int ttft_q8_linear(const float *x, int64_t M, int64_t K, const uint8_t *records, int bits, int64_t N, float *y) {
    static _Thread_local struct ttft_buffer kept = {NULL, 0};
    if (K % BLOCK != 0 || (bits != 4 && bits != 8)) return -1;
    if (M <= 0) return 0;
    int shared = shared_q8(x, M, K, records, bits, N, y);
    if (shared <= 0) return shared;
    float *buffer = ttft_grow(&kept, q8_floats(M, K));
    if (buffer == NULL) return -1;
    q8_panels(q8_quantise(x, M, K, buffer), M, K, records, bits, N, y, 0, (N + P - 1) / P);
    return 0;
}
#else
int ttft_q8_linear(const float *x, int64_t M, int64_t K, const uint8_t *records, int bits, int64_t N, float *y) {
    (void)x, (void)M, (void)K, (void)records, (void)bits, (void)N, (void)y;
    return -2; /* built without AVX-512 VNNI or AVX2 with F16C */
}
#endif

/* ---- Helper threads: the other cores' idle time for the kernel (ttft_helper_start) ----

   A call of at least SHARE_WORK multiply-adds is cut into chunks of whole panels. The calling thread takes chunks
   from the first up, each helper from the last down, each chunk claimed by a compare-and-swap on its state, until
   they meet. A helper computes into its own buffer, and the caller copies its chunks into y: a helper never writes
   the caller's memory, and it reads the rows from the share's own copy. The caller never waits on a helper that
   does not run: helpers run at SCHED_IDLE, so any other task of the machine (the prefill process, the event loop,
   a client) takes the core from them at once, and a chunk a helper holds longer than twice the caller's own time
   a chunk is taken back and computed by the caller (the helper's result is then dropped). Each chunk is computed
   by the same code whoever computes it, and an output's chain of multiply-adds does not depend on how the panels
   are split, so the results are the same bits shared or not.
   The weights a helper may still be reading (a chunk taken back from it) must outlive its chunk: whoever frees
   weights calls ttft_helper_fence first (kernel.py's layers do, as they go). The share's copy of the rows grows
   only while no helper is inside a chunk (a call that finds one there runs alone rather than wait), and a helper's
   buffer holds a whole output, so calls of more than SHARE_OUTPUTS outputs run alone. A forked child starts with
   no helpers and shares nothing until it starts its own.
   A batched step's attention (decoder.c) is shared the same way, by parts of query rows and KV heads (attention.c's
   ttft_attention_part: each head of each row computed from its own inputs alone): the helpers read the share's
   copies of the queries and of the step's key index, and the layer's KV cache, which lives as long as the engine
   (whoever frees it fences first).
   Since a helper still inside a taken-back attention chunk could read a key index rewritten under it, an
   attention call is shared only while no helper is inside an attention chunk. */

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define HELPERS 8                /* at most */
#define SHARE_CHUNKS 1024        /* chunks a call at most (larger chunks beyond) */
#define SHARE_WORK (1 << 18)     /* multiply-adds a call needs to be shared */
#define SHARE_OUTPUTS (1 << 23)  /* outputs a call at most (a helper's buffer holds them: 32 MiB) */
#define CHUNK_WORK (1 << 16)     /* multiply-adds a chunk at least */
#define SPIN_NS 500000           /* a helper polls this long for the next call before it sleeps */
#define TAKE_BACK_NS 20000       /* the caller's patience, at least, for a chunk a helper holds */

enum { FREE, CALLERS, HELD, READY, TAKEN }; /* a chunk's state: the low 3 bits, its helper above them, the call's
                                               generation from bit 8 */

struct attention {
    ttft_attention_part_fn part;
    const float *k, *v;       /* the layer's KV cache rows */
    const int64_t *index;     /* the share's copy of the step's key index */
    const int32_t *cu_q, *cu_k; /* the share's copies */
    int64_t heads, kv_heads, dim, key_stride, head_stride, requests, max_rows;
    float scale;
};

enum { LINEAR, ATTENTION };

struct job {
    int kind, int8;
    const float *rows; /* the share's copy: fp32 rows, or the rows quantised (q8_floats floats); the queries */
    int64_t M, K, N, panels, per, chunks; /* attention: M parts of N floats, a chunk `per` parts */
    const uint8_t *codes;                 /* panels, or int8 records */
    int bits;
    const float *scale, *zero;
    struct attention a;
};

static struct {
    pthread_mutex_t starting;
    _Atomic int helpers;
    int forks_reset; /* forked is registered */
    atomic_flag busy;     /* a caller holds the job */
    _Atomic uint64_t gen; /* odd while the job is being written */
    _Atomic uint32_t bell;
    _Atomic int sleeping, in_chunk, in_attention; /* helpers inside a chunk; inside an attention chunk */
    struct job job;
    struct ttft_buffer rows, keys; /* keys: the step's key index and request starts (attention) */
    float *_Atomic out[HELPERS];
    _Atomic uint64_t state[SHARE_CHUNKS];
    _Atomic int64_t calls, by_caller, by_helpers, taken, pause_us, leave_us;
} share = {.starting = PTHREAD_MUTEX_INITIALIZER, .busy = ATOMIC_FLAG_INIT};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void sleep_ns(int64_t ns) {
    struct timespec t = {ns / 1000000000, ns % 1000000000};
    nanosleep(&t, NULL);
}

/* The end of chunk c, whose first unit (an attention part, or a panel) is c * j->per, among `units`. */
static int64_t chunk_end(const struct job *j, int64_t c, int64_t units) {
    return (c + 1) * j->per < units ? (c + 1) * j->per : units;
}

/* Chunk c's panels of y (the caller's output, or a helper's buffer laid out as it); an attention chunk's rows.
   Returns 0, or an attention call's error. */
static int run_chunk(const struct job *j, int64_t c, float *y, float *buffer) {
    if (j->kind == ATTENTION) {
        const struct attention *a = &j->a;
        return a->part(j->rows, a->heads, a->kv_heads, a->dim, a->k, a->v, a->key_stride, a->head_stride, a->index,
                       a->cu_q, a->cu_k, a->requests, a->max_rows, a->scale, c * j->per, chunk_end(j, c, j->M), y);
    }
    int64_t p0 = c * j->per, p1 = chunk_end(j, c, j->panels);
#if defined(Q_VNNI) || defined(Q_AVX2)
    if (j->int8) {
        q8_panels(q8_view((float *)j->rows, j->M, j->K), j->M, j->K, j->codes, j->bits, j->N, y, p0, p1);
        return 0;
    }
#endif
    fp32_panels(j->rows, j->M, j->K, j->codes, j->bits, j->scale, j->zero, j->N, y, p0, p1, buffer);
    return 0;
}

/* Chunk c's outputs, computed into `from` (a helper's buffer, laid out as y), into y. */
static void copy_chunk(const struct job *j, int64_t c, const float *from, float *y) {
    if (j->kind == ATTENTION) {
        int64_t first = c * j->per, last = chunk_end(j, c, j->M);
        memcpy(y + first * j->N, from + first * j->N, sizeof(float) * (size_t)((last - first) * j->N));
        return;
    }
    int64_t first = c * j->per * P, last = chunk_end(j, c, j->panels) * P;
    if (last > j->N) last = j->N;
    for (int64_t r = 0; r < j->M; r++)
        memcpy(y + r * j->N + first, from + r * j->N + first, sizeof(float) * (size_t)(last - first));
}

/* Until no helper is inside a chunk (of a call that may have ended). A forked child has none (forked, below). */
static void fence(void) {
    while (atomic_load(&share.in_chunk) > 0) sleep_ns(20000);
}

int ttft_helper_fence(void) {
    fence();
    return 0;
}

static void *helper(void *arg) {
    int id = (int)(intptr_t)arg;
    struct sched_param none = {0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &none);
    struct ttft_buffer out = {NULL, 0};
    uint64_t seen = atomic_load(&share.gen);
    int64_t idle_since = now_ns();
    for (;;) {
        uint64_t g = atomic_load(&share.gen);
        if (g == seen || (g & 1)) {
            if (now_ns() - idle_since < SPIN_NS) {
                _mm_pause();
                continue;
            }
            uint32_t bell = atomic_load(&share.bell);
            atomic_fetch_add(&share.sleeping, 1);
            if (atomic_load(&share.gen) == seen) syscall(SYS_futex, &share.bell, FUTEX_WAIT_PRIVATE, bell, NULL, NULL, 0);
            atomic_fetch_sub(&share.sleeping, 1);
            idle_since = now_ns();
            continue;
        }
        struct job j;
        memcpy(&j, &share.job, sizeof j);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load(&share.gen) != g) continue; /* torn: written meanwhile */
        seen = g;
        float *mine = ttft_grow(&out, j.M * j.N), *buffer = NULL;
        if (mine == NULL || (j.kind == LINEAR && !j.int8 && fp32_buffer(j.M, j.K, &buffer) != 0))
            continue; /* the caller does it all */
        atomic_store(&share.out[id], mine);
        uint64_t tag = g << 8 | (uint64_t)id << 3;
        _Atomic int *inside = j.kind == ATTENTION ? &share.in_attention : NULL;
        for (int64_t c = j.chunks - 1; c >= 0; c--) {
            atomic_fetch_add(&share.in_chunk, 1);
            if (inside) atomic_fetch_add(inside, 1);
            uint64_t expect = g << 8 | FREE;
            if (!atomic_compare_exchange_strong(&share.state[c], &expect, tag | HELD)) {
                if (inside) atomic_fetch_sub(inside, 1);
                atomic_fetch_sub(&share.in_chunk, 1);
                if ((expect & 7) == CALLERS || expect >> 8 != g) break; /* met the caller, or the call ended */
                continue;                                                /* another helper's */
            }
            int64_t pause = atomic_load(&share.pause_us);
            if (pause > 0) sleep_ns(pause * 1000);
            expect = tag | HELD;
            if (run_chunk(&j, c, mine, buffer) == 0) /* else left HELD: the caller takes it back and computes it */
                atomic_compare_exchange_strong(&share.state[c], &expect, tag | READY); /* fails if taken back */
            if (inside) atomic_fetch_sub(inside, 1);
            atomic_fetch_sub(&share.in_chunk, 1);
        }
        idle_since = now_ns();
    }
    return NULL;
}

/* A forked child has none of its parent's helpers: it starts from nothing (and shares nothing until it starts
   its own). */
static void forked(void) {
    pthread_mutex_init(&share.starting, NULL);
    atomic_store(&share.helpers, 0);
    atomic_store(&share.in_chunk, 0);
    atomic_store(&share.in_attention, 0);
    atomic_store(&share.sleeping, 0);
    atomic_flag_clear(&share.busy);
    atomic_store(&share.gen, (atomic_load(&share.gen) + 1) & ~(uint64_t)1);
}

/* Starts `count` helper threads (at most HELPERS; more calls add none once started). Returns how many run, or -1
   if none could be started. */
int ttft_helper_start(int count) {
    pthread_mutex_lock(&share.starting);
    if (!share.forks_reset) share.forks_reset = pthread_atfork(NULL, NULL, forked) == 0;
    int running = atomic_load(&share.helpers);
    for (int id = running; id < count && id < HELPERS; id++) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, helper, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (failed) break;
        running = id + 1;
        atomic_store(&share.helpers, running);
    }
    pthread_mutex_unlock(&share.starting);
    return running > 0 ? running : -1;
}

/* out[0..4): calls shared, chunks computed by callers, by helpers, and taken back from helpers. */
int ttft_helper_stats(int64_t *out) {
    out[0] = atomic_load(&share.calls);
    out[1] = atomic_load(&share.by_caller);
    out[2] = atomic_load(&share.by_helpers);
    out[3] = atomic_load(&share.taken);
    return atomic_load(&share.helpers);
}

/* For tests: helpers sleep this long in every chunk they hold, so that the caller takes chunks back. */
int ttft_helper_pause(int64_t microseconds) {
    atomic_store(&share.pause_us, microseconds);
    return 0;
}

/* For tests: the caller leaves each call's last chunk to the helpers for up to this long, sleeping, so that a
   helper (at SCHED_IDLE) takes part even on a machine whose every core is busy; then it computes the chunk itself. */
int ttft_helper_leave(int64_t microseconds) {
    atomic_store(&share.leave_us, microseconds);
    return 0;
}

/* Runs the call j, cut into j.chunks, with the helpers: its inputs (x: the rows, quantised first for int8; or the
   queries, with the step's key index and request starts) copied into the share's buffers first. Returns 1 if it
   is not shared (another caller holds the job; an attention call while a helper is inside an attention chunk):
   the caller computes it alone; else 0, or -1 if a buffer cannot be allocated or a chunk fails. */
static int share_run(struct job j, const float *x, const int64_t *index, const int32_t *cu_q, const int32_t *cu_k,
                     float *y) {
    if (atomic_flag_test_and_set(&share.busy)) return 1;
    float *buffer = NULL;
    int attention = j.kind == ATTENTION;
    int64_t floats = attention ? j.M * j.N : j.int8 ? q8_floats(j.M, j.K) : j.M * j.K;
    int64_t keys = attention ? cu_k[j.a.requests] : 0, key_floats = attention ? 2 * keys + 2 * (j.a.requests + 1) : 0;
    if ((share.rows.capacity < floats && atomic_load(&share.in_chunk) > 0) ||
        (attention && atomic_load(&share.in_attention) > 0)) {
        /* A helper may still read the share's copies (a chunk taken back from it): grow the rows, or rewrite (or
           grow) the key index, at a later call, not waiting. A helper in a linear chunk reads no key index. */
        atomic_flag_clear(&share.busy);
        return 1;
    }
    if ((!attention && !j.int8 && fp32_buffer(j.M, j.K, &buffer) != 0) ||
        (share.rows.capacity < floats && ttft_grow(&share.rows, floats) == NULL) ||
        (share.keys.capacity < key_floats && ttft_grow(&share.keys, key_floats) == NULL)) {
        atomic_flag_clear(&share.busy);
        return -1;
    }
    uint64_t g = atomic_load(&share.gen) + 1; /* odd: being written */
    atomic_store_explicit(&share.gen, g, memory_order_relaxed);
    atomic_thread_fence(memory_order_release); /* the odd generation before the job's stores */
    g += 1;
    if (attention) {
        int64_t *ix = (int64_t *)share.keys.floats;
        int32_t *starts = (int32_t *)(ix + keys);
        memcpy(ix, index, sizeof(int64_t) * (size_t)keys);
        memcpy(starts, cu_q, sizeof(int32_t) * (size_t)(j.a.requests + 1));
        memcpy(starts + j.a.requests + 1, cu_k, sizeof(int32_t) * (size_t)(j.a.requests + 1));
        j.a.index = ix, j.a.cu_q = starts, j.a.cu_k = starts + j.a.requests + 1;
    }
#if defined(Q_VNNI) || defined(Q_AVX2)
    if (j.int8)
        q8_quantise(x, j.M, j.K, share.rows.floats);
    else
#endif
        memcpy(share.rows.floats, x, sizeof(float) * (size_t)floats); /* the fp32 rows, or the queries */
    j.rows = share.rows.floats;
    share.job = j;
    for (int64_t c = 0; c < j.chunks; c++) atomic_store_explicit(&share.state[c], g << 8 | FREE, memory_order_relaxed);
    atomic_store(&share.gen, g);
    if (atomic_load(&share.sleeping) > 0) {
        atomic_fetch_add(&share.bell, 1);
        syscall(SYS_futex, &share.bell, FUTEX_WAKE_PRIVATE, HELPERS, NULL, NULL, 0);
    }
    int failed = 0;
    int64_t c = 0, start = now_ns(), leave_ns = atomic_load(&share.leave_us) * 1000;
    for (; c < j.chunks; c++) {
        uint64_t expect = g << 8 | FREE;
        if (c == j.chunks - 1 && leave_ns > 0) { /* tests: the last chunk waits for a helper first */
            int64_t waiting = now_ns();
            while (atomic_load(&share.state[c]) == expect && now_ns() - waiting < leave_ns) sleep_ns(50000);
            start += now_ns() - waiting; /* the caller's own time a chunk, without the wait */
        }
        if (!atomic_compare_exchange_strong(&share.state[c], &expect, g << 8 | CALLERS)) break;
        failed |= run_chunk(&j, c, y, buffer);
    }
    int64_t mine = c, patience = mine > 0 ? 2 * (now_ns() - start) / mine : 0;
    if (patience < TAKE_BACK_NS) patience = TAKE_BACK_NS;
    int64_t taken = 0;
    for (int64_t d = j.chunks - 1; d >= mine; d--) { /* the helpers' chunks, the last claimed last */
        uint64_t s = atomic_load(&share.state[d]);
        int64_t waiting = now_ns();
        while ((s & 7) == HELD && now_ns() - waiting < patience) {
            _mm_pause();
            s = atomic_load(&share.state[d]);
        }
        if ((s & 7) == HELD && atomic_compare_exchange_strong(&share.state[d], &s, (s & ~(uint64_t)7) | TAKEN)) {
            failed |= run_chunk(&j, d, y, buffer);
            taken++;
            continue;
        }
        copy_chunk(&j, d, atomic_load(&share.out[(s >> 3) & 31]), y); /* READY (a failed take: it just became so) */
    }
    atomic_fetch_add(&share.calls, 1);
    atomic_fetch_add(&share.by_caller, mine + taken);
    atomic_fetch_add(&share.by_helpers, j.chunks - mine - taken);
    atomic_fetch_add(&share.taken, taken);
    atomic_flag_clear(&share.busy);
    return failed ? -1 : 0;
}

/* A linear call, cut into chunks of whole panels (see share_run). */
static int share_call(struct job j, const float *x, float *y) {
    if (atomic_load(&share.helpers) == 0) return 1; /* none started, or a forked child's (forked: reset) */
    j.panels = (j.N + P - 1) / P;
    if (j.M * j.K * j.N < SHARE_WORK || j.panels < 2 || j.M * j.N > SHARE_OUTPUTS) return 1;
    int64_t panel_work = j.M * j.K * P;
    j.per = (CHUNK_WORK + panel_work - 1) / panel_work;
    j.per = (j.per + GROUP - 1) / GROUP * GROUP; /* whole groups: the buffered tiles' and int8 tiles' width */
    while ((j.panels + j.per - 1) / j.per > SHARE_CHUNKS) j.per *= 2;
    j.chunks = (j.panels + j.per - 1) / j.per;
    if (j.chunks < 2) return 1;
    return share_run(j, x, NULL, NULL, NULL, y);
}

/* A batched step's attention (decoder.c), as attention.c's ttft_paged_attention computes it, shared with the
   helpers by parts: `part` is attention.c's ttft_attention_part (a part: a query row's heads of one KV head, so a
   single row is shared too). Returns 1 if it is not shared (no helper, too small, a request of more than max_rows
   rows, a shape `part` refuses: the caller computes it alone), else 0, or -1 (share_run). */
int ttft_share_attention(ttft_attention_part_fn part, const float *q, int64_t heads, int64_t kv_heads, int64_t dim,
                         const float *k, const float *v, int64_t key_stride, int64_t head_stride,
                         const int64_t *index, const int32_t *cu_q, const int32_t *cu_k, int64_t requests,
                         int64_t max_rows, float scale, float *out) {
    if (part == NULL || atomic_load(&share.helpers) == 0 || requests <= 0) return 1;
    if (part(q, heads, kv_heads, dim, k, v, key_stride, head_stride, index, cu_q, cu_k, requests, max_rows, scale, 0,
             0, out) != 0)
        return 1; /* a shape it refuses (kv_heads divides heads from here on) */
    int64_t pairs = 0; /* (query row, key) */
    for (int64_t s = 0; s < requests; s++) {
        int64_t lq = cu_q[s + 1] - cu_q[s], lk = cu_k[s + 1] - cu_k[s];
        if (lq > max_rows) return 1;
        pairs += lq * lk - lq * (lq - 1) / 2;
    }
    int64_t M = cu_q[requests] * kv_heads, N = heads / kv_heads * dim;
    int64_t work = 2 * pairs * heads * dim; /* multiply-adds: scores and values */
    if (M < 2 || work < SHARE_WORK || M * N > SHARE_OUTPUTS) return 1;
    struct job j = {.kind = ATTENTION, .M = M, .N = N};
    j.a = (struct attention){.part = part, .k = k, .v = v, .heads = heads, .kv_heads = kv_heads, .dim = dim,
                             .key_stride = key_stride, .head_stride = head_stride, .requests = requests,
                             .max_rows = max_rows, .scale = scale};
    j.per = (CHUNK_WORK * M + work - 1) / work;
    if (j.per < 1) j.per = 1;
    while ((M + j.per - 1) / j.per > SHARE_CHUNKS) j.per *= 2;
    j.chunks = (M + j.per - 1) / j.per;
    if (j.chunks < 2) return 1;
    return share_run(j, q, index, cu_q, cu_k, out);
}

static int shared_fp32(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
                       const float *zero, int64_t N, float *y) {
    struct job j = {.int8 = 0, .M = M, .K = K, .N = N, .codes = codes, .bits = bits, .scale = scale, .zero = zero};
    return share_call(j, x, y);
}

#if defined(Q_VNNI) || defined(Q_AVX2)
static int shared_q8(const float *x, int64_t M, int64_t K, const uint8_t *records, int bits, int64_t N, float *y) {
    struct job j = {.int8 = 1, .M = M, .K = K, .N = N, .codes = records, .bits = bits};
    return share_call(j, x, y);
}
#endif
