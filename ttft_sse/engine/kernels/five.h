/* The Q5 types' codes in 5 bits (kernel.c's FIVE panels, laid out by layouts.five_codes): each two inputs' FIVE_PAIR
   bytes, their 16 bytes of low nibbles as 4-bit codes lie (q + 16), then the first input's fifth bits, 16 as a
   little-endian uint16 (bit j: output j's), then the second's; unpacked to q - 16 exactly. Two inputs' bytes lie
   together so that one index reaches both (a one-row call keeps 8 panels' pointers in registers). AVX-512 builds
   only: with AVX2 the unpacking (each bit spread to a byte) made a one-row call 1.8x slower than 8-bit codes, and
   those builds hold the Q5 types in 8 bits (kernel.takes_five). */

#ifndef TTFT_FIVE_H
#define TTFT_FIVE_H

#include <immintrin.h>
#include <stdint.h>

#include "blocks.h"
#include "vectors.h"

#if defined(__AVX512F__)
#define FIVE_BUILT 1 /* this build multiplies FIVE panels (a constant, so that kernel.c's C can test it too) */
#else
#define FIVE_BUILT 0
#endif

#if FIVE_BUILT
/* Inputs 2i and 2i+1 of a FIVE panel as floats: each nibble less 16 from a table by vpermps (which reads only a
   lane's low 4 bits, as 4-bit codes are read), then 16 added where its fifth bit is set, under that mask. */
static inline void five_pair(const uint8_t *codes, int64_t i, pv *w0, pv *w1) {
    const uint8_t *pair = codes + FIVE_PAIR * i, *fifth = pair + P;
    const __m512 table = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m512 sixteen = _mm512_set1_ps(16.0f);
    __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)pair));
    __m512 low = _mm512_permutexvar_ps(raw, table), high = _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table);
    *w0 = _mm512_mask_add_ps(low, _load_mask16((__mmask16 *)fifth), low, sixteen);
    *w1 = _mm512_mask_add_ps(high, _load_mask16((__mmask16 *)(fifth + 2)), high, sixteen);
}
#endif

#endif
