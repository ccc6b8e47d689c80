/* Q6_K's panels in fewer bytes (kernel.c's SIX_SCALES and SIX_PACKED, laid out by layouts.six_records and
   six_codes): a block's scale (d * sc each 16 inputs) as a super-block's fp32 factor times a signed byte, and on a
   build with AVX-512 VBMI the codes in 6 bits; the unpacking, the scales and the one-row tile over the 6-bit codes. */

#ifndef TTFT_SIX_H
#define TTFT_SIX_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "blocks.h"
#include "vectors.h"

#define SIX_QUAD 48 /* bytes of a SIX_PACKED panel's four inputs: 64 codes of 6 bits */

/* The scales of block b (16 inputs) of panel g's records (`blocks` scales an output; K_RECORD bytes a super-block:
   16 fp32 factors D, then 16 blocks' 16 signed sc): D * sc, exact (layouts.six_factors checked that each product
   is the scale), times 2^-26 where the codes are `packed` (SIX_PACKED's codes are taken times 2^26: six_quad). */
static inline pv six_scale(const float *scale, int64_t g, int64_t blocks, int64_t b, int packed) {
    const uint8_t *record = (const uint8_t *)scale + (g * (blocks / 16) + b / 16) * K_RECORD;
    __m128i sc = _mm_loadu_si128((const __m128i *)(record + 4 * P + P * (b % 16)));
    pv s = pv_mul(pv_load((const float *)record), pv_q(sc));
    return packed ? pv_mul(s, pv_set1(0x1p-26f)) : s; /* exact: a power of two */
}

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define SIX_CODES /* this build multiplies SIX_PACKED panels */

/* Inputs 4t .. 4t+3 of a SIX_PACKED panel as floats times 2^26, exactly. The panel's 48 bytes for its four inputs
   hold 64 codes (q - 32, 6-bit two's complement), code w at bits 6w .. 6w+5, w = 16 (o / 4) + 4 j + o % 4 for
   input 4t + j and output o: each 128-bit lane's codes are its 4 outputs' of the 4 inputs. vpermb spreads each 6
   bytes (8 codes) into a quadword, vpmultishiftqb gives each code a byte with the code in its top 6 bits (the 2
   bits below it, the previous code's, cleared): (q - 32) * 4 as a signed byte; then for input j vpshufb puts its
   4 bytes of each lane in the top byte of that lane's 32-bit lanes, zeroing the rest: (q - 32) * 2^26, converted
   exactly. The panel's scales are taken times 2^-26 (kernel.c's block_scales), so that a block's share is the
   same product: scaling by a power of two is exact (short of overflow, inputs beyond 1e29, or products below
   fp32's normal range, which a model's rows are not). A panel's `last` four inputs are loaded masked to their 48
   bytes, since the last panel's end the array; the others whole (64 bytes: a masked load from memory misses the
   hardware prefetcher, 40 % slower out of the caches). */
static inline __attribute__((always_inline)) void six_quad(const uint8_t *codes, int64_t t, pv w[4], int last) {
    /* quadword g takes bytes 6g .. 6g+5 (its top two bytes are zeroed); byte b of a quadword the bits from 6b - 2 */
    const __m512i spread = _mm512_set_epi64(0x2F2E2D2C2B2A, 0x292827262524, 0x232221201F1E, 0x1D1C1B1A1918,
                                            0x171615141312, 0x11100F0E0D0C, 0x0B0A09080706, 0x050403020100);
    const __m512i shifts = _mm512_set1_epi64(0x28221C16100A043ELL), keep = _mm512_set1_epi8((char)0xFC);
    const uint8_t *at = codes + SIX_QUAD * t;
    __m512i raw = last ? _mm512_maskz_loadu_epi8(0xFFFFFFFFFFFFULL, at) : _mm512_loadu_si512(at);
    __m512i q = _mm512_maskz_permutexvar_epi8(0x3F3F3F3F3F3F3F3FULL, spread, raw);
    q = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, q), keep);
    for (int j = 0; j < 4; j++) { /* byte 4m+3 of each lane from the lane's byte 4j+m; the others zero (0x80) */
        const __m512i top = _mm512_set4_epi32((4 * j + 3) << 24 | 0x808080, (4 * j + 2) << 24 | 0x808080,
                                              (4 * j + 1) << 24 | 0x808080, (4 * j) << 24 | 0x808080);
        w[j] = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(q, top));
    }
}

/* Block b's parts (16 inputs) of `panels` SIX_PACKED panels for one row, four inputs at a time (the panels' last
   four loaded masked where `last`, a constant in each call). */
static inline __attribute__((always_inline)) void six_part(int panels, const uint8_t *codes, int64_t panel_bytes,
                                                           const float *x, int64_t b, pv *part, int last) {
    for (int64_t t = 4 * b; t < 4 * b + 4; t++) {
        pv x0 = pv_set1(x[4 * t]), x1 = pv_set1(x[4 * t + 1]), x2 = pv_set1(x[4 * t + 2]), x3 = pv_set1(x[4 * t + 3]);
        for (int g = 0; g < panels; g++) {
            pv w[4];
            six_quad(codes + g * panel_bytes, t, w, last && t == 4 * b + 3);
            part[g] = pv_madd(x3, w[3], pv_madd(x2, w[2], pv_madd(x1, w[1], pv_madd(x0, w[0], part[g]))));
        }
    }
}

/* kernel.c's one_row for SIX_PACKED panels (`scale` their records), four inputs at a time: the same arithmetic,
   with only the chains and the codes of a quad in registers. */
static inline __attribute__((always_inline)) void one_row_six(int panels, const uint8_t *codes, int64_t panel_bytes,
                                                              const float *scale, const float *x, int64_t K, float *y,
                                                              int64_t outputs) {
    pv acc[WIDE];
    for (int g = 0; g < panels; g++) acc[g] = pv_zero();
    for (int64_t b = 0; b < K / 16; b++) {
        pv part[WIDE];
        for (int g = 0; g < panels; g++) part[g] = pv_zero();
        if (b + 1 < K / 16) {
            six_part(panels, codes, panel_bytes, x, b, part, 0);
        } else {
            six_part(panels, codes, panel_bytes, x, b, part, 1);
        }
        for (int g = 0; g < panels; g++) acc[g] = pv_madd(six_scale(scale, g, K / 16, b, 1), part[g], acc[g]);
    }
    for (int g = 0; g < panels; g++) put_column(y + g * P, acc[g], outputs - (int64_t)g * P);
}

/* one_row_six for up to WIDE panels, a constant count in each (kept out of kernel.c's fp32_panels, whose other
   forms' code it would otherwise crowd: 3-5 % slower one-row calls). */
static __attribute__((noinline)) void six_row(int panels, const uint8_t *codes, int64_t panel_bytes,
                                              const float *scale, const float *x, int64_t K, float *y,
                                              int64_t outputs) {
    switch (panels) {
#define ONE_SIX(G) \
    case G: if (G <= WIDE) one_row_six(G, codes, panel_bytes, scale, x, K, y, outputs); break;
        ONE_SIX(8) ONE_SIX(7) ONE_SIX(6) ONE_SIX(5) ONE_SIX(4) ONE_SIX(3) ONE_SIX(2)
        default: one_row_six(1, codes, panel_bytes, scale, x, K, y, outputs);
    }
}
#else
static inline void six_quad(const uint8_t *codes, int64_t t, pv w[4], int last) {
    (void)codes, (void)t, (void)w, (void)last;
    abort(); /* fp32_takes refuses SIX_PACKED on this build */
}
static inline void six_row(int panels, const uint8_t *codes, int64_t panel_bytes, const float *scale,
                           const float *x, int64_t K, float *y, int64_t outputs) {
    (void)panels, (void)codes, (void)panel_bytes, (void)scale, (void)x, (void)K, (void)y, (void)outputs;
    abort();
}
#endif

#endif
