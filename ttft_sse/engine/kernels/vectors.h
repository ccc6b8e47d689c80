/* The fp32 rows' vectors on this build (kernel.c): a panel's 16 outputs as one AVX-512 register or two AVX2 ones
   (pv), a column of a buffered tile (cv: a panel with AVX-512, half a panel with AVX2), the tile sizes that fit the
   build's registers, codes as floats, and a dense layer's fp16, bf16 and fp32 values widened exactly. */

#ifndef TTFT_VECTORS_H
#define TTFT_VECTORS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "half.h" /* half_float: fp16 widened in plain C, for an AVX2 build without F16C */

#define HALF 16 /* dense layouts (F16, BF16 and F32 files): the weights themselves, no scale or zero: fp16, */
#define BRAIN 17 /* bf16 */
#define FULL 32  /* and fp32 values */

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
static inline pv pv_madd(pv a, pv b, pv acc) { return _mm512_fmadd_ps(a, b, acc); }
static inline pv pv_set1(float x) { return _mm512_set1_ps(x); }
static inline pv pv_mul(pv a, pv b) { return _mm512_mul_ps(a, b); }
/* Longer calls: tiles of up to 8 rows x 3 columns of 16 outputs over the expanded panels: a column is a panel, and
   the panel's helpers serve. */
#define B_ROWS 8
#define CV 16
typedef pv cv;
#define cv_zero pv_zero
#define cv_load pv_load
#define cv_store pv_store
#define cv_fma pv_fma
#define cv_madd pv_madd
/* 16 signed codes as floats (exact). */
static inline pv pv_q(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
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
static inline cv cv_madd(cv a, cv b, cv acc) { return _mm256_fmadd_ps(a, b, acc); }
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
static inline pv pv_madd(pv a, pv b, pv acc) { return (pv){cv_madd(a.lo, b.lo, acc.lo), cv_madd(a.hi, b.hi, acc.hi)}; }
static inline pv pv_set1(float x) { return (pv){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline pv pv_mul(pv a, pv b) { return (pv){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
/* 16 signed codes as floats (exact). */
static inline pv pv_q(__m128i q) {
    return (pv){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
}
#else
#error "this kernel needs AVX2 and FMA (or AVX-512)"
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

#endif
