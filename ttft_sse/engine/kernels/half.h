/* fp16 values and fp32 ones, converted in plain C: exactly one way (every fp16 value is an fp32 one), rounded to the
   nearest even the other, as F16C's instructions and torch's .to(torch.float16) convert (infinities beyond fp16's
   range, subnormals kept). For builds without F16C (-mno-f16c): an AVX2 CPU without it, and the tests that check
   that side on every machine. The kernel's dense fp16 layers (vectors.h) and the KV cache in f16 (attention.c reads
   it, decoder.c writes it) take these where the build has no conversion instructions. */

#ifndef TTFT_HALF_H
#define TTFT_HALF_H

#include <stdint.h>
#include <string.h>

/* An fp16 value in fp32, exactly (subnormals, infinities and NaNs included). */
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

/* An fp32 value as the nearest fp16 one, ties to even; beyond fp16's largest (65504, and what rounds above it) an
   infinity; NaN a quiet NaN. */
static inline uint16_t float_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t magnitude = x & 0x7FFFFFFF;
    if (magnitude > 0x7F800000) return (uint16_t)(sign | 0x7E00 | ((magnitude >> 13) & 0x3FF)); /* NaN */
    if (magnitude >= 0x477FF000) return (uint16_t)(sign | 0x7C00); /* 65520 and up (and infinity): rounds past 65504 */
    if (magnitude >= 0x38800000) { /* fp16's normal range (2^-14 and up) */
        uint32_t kept = magnitude >> 13, dropped = magnitude & 0x1FFF;
        uint32_t h = kept - (112 << 10); /* the exponent rebased from 127 to 15 */
        if (dropped > 0x1000 || (dropped == 0x1000 && (kept & 1))) h++; /* carries into the exponent as it should */
        return (uint16_t)(sign | h);
    }
    if (magnitude < 0x33000000) return sign; /* below 2^-25, half the smallest subnormal: zero */
    /* A subnormal: the significand (with its leading 1) shifted to units of 2^-24, rounded to nearest even. */
    uint32_t exponent = magnitude >> 23, significand = (magnitude & 0x7FFFFF) | 0x800000;
    uint32_t shift = 126 - exponent; /* 2^(exponent-127) * significand / 2^23, in units of 2^-24 */
    uint32_t kept = significand >> shift, dropped = significand & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (dropped > half || (dropped == half && (kept & 1))) kept++;
    return (uint16_t)(sign | kept);
}

#endif
