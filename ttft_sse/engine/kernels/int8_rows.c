/* Rows quantised to int8 times a weight kept in a GGUF file's own blocks (TTFT_GGUF_ACTIVATIONS=int8): the block
   kernel's second arithmetic, built into its library beside kernel.c (ttft_sse/engine/kernels/kernel.py). */

#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "kernel.h"

/* The rows are quantised as llama.cpp quantises them: each row per block of 32 inputs, as llama.cpp's Q8_0:
   d = max|x| / 127, xq = x * (127 / max|x|) rounded (halves to even). A weight is w = scale * c + offset with an
   unsigned code c (4-bit codes 0..15, 8-bit codes plus 128), so a block's share of output n is
   scale * d * sum(c * xq) + offset * d * sum(xq): the integer sum exact, then two fused multiply-adds a block, block
   after block from zero. As with fp32 rows (kernel.c), that chain does not depend on M or on the row's place in
   the call; and the integer sums are exact on both builds below, which then round the same operations in the same
   order, so they give the same bits.
   Layout (layouts.py's records): panels of 16 outputs, each K/32 records of a block, one after the other:
     4-bit codes: 4 groups of 64 bytes; byte 4j+t of group g holds output j's code for input 8g+t (low nibble) and
                  for input 8g+4+t (high nibble);
     8-bit codes: 8 groups of 64 bytes; byte 4j+t of group g: output j's code for input 4g+t, plus 128;
     then the tail, by the records' bits:
       4, 8:            the 16 outputs' scales and the 16 offsets, fp16 (the file's own values: Q4_0, Q4_1, Q5_0,
                        Q8_0);
       4 or 8 + Q_WIDE: the 16 scales and the 16 zeros of w = scale * q + zero in fp32 (q = c - 8, or c - 128: the
                        codes of codes.py), where fp16 cannot hold them (a K-quant's d * sc, Q5_1's zero): a block's
                        share is scale * d * sum(q * xq) + zero * d * sum(xq), its integer sum the unsigned one less
                        8 (or 128) * sum(xq);
       SIXTEEN:         8-bit codes (Q6_K's q - 32, plus 128) and fp32 scales: the 16 of inputs 0..15, then the 16
                        of inputs 16..31, no zero: each half's share scale * d * sum(q * xq), the first half first.
   AVX-512 VNNI: vpdpbusd sums four code x row products into a lane of 32 bits. Tiles of up to 4 rows x 3 panels:
   of the shapes that fit the registers, the best or near it from 1 to 128 rows.
   AVX2 (with F16C, for the fp16 scales): vpmaddubsw sums two products into 16 bits, and the same lanes of 64 bytes
   (a group) are two registers of 8 outputs. A 4-bit block's 16 products an output-half lane add up to at most
   16 * 15 * 127 < 2^15, so they sum in 16 bits and widen once a block (vpmaddwd by ones). 8-bit codes would
   overflow 16 bits (255 * 127 * 2): they are taken as signed codes c - 128 (llama.cpp's sign trick: |c - 128| times
   xq with c's sign), widened every group, and 128 * sum(xq) is added back where the tail's offsets need it: the
   same integer sums as vpdpbusd's. */

#if defined(Q_VNNI) || defined(Q_AVX2)
/* Whether the records' codes are 4-bit ones; whether their tail is fp16 scales and offsets; a record's bytes. */
static inline int four_bit(int bits) { return bits == 4 || bits == (4 | Q_WIDE); }
static inline int narrow(int bits) { return bits == 4 || bits == 8; }
#define RECORD(bits) ((four_bit(bits) ? 256 : 512) + (narrow(bits) ? 64 : 128))

/* Row r's part of the quantised rows. */
static inline struct q8_rows q8_row(struct q8_rows q, int64_t r, int64_t K) {
    int64_t blocks = K / BLOCK;
    return (struct q8_rows){q.xq + r * K, q.d + r * blocks, q.ds + r * blocks, q.sx + r * blocks, q.sh + r * blocks};
}

#if defined(Q_VNNI)
#define Q_ROWS 4
#define Q_PANELS 3

/* Rows quantised: xq (M x K int8), d, d * sum(xq), sum(xq) and the sum of a block's first 16 (M x K/32 each). */
static void quantise(const float *x, int64_t M, int64_t K, struct q8_rows q) {
    int8_t *xq = q.xq;
    float *d = q.d, *ds = q.ds;
    int32_t *sx = q.sx, *sh = q.sh;
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
            sh[r * blocks + b] = _mm512_reduce_add_epi32(qa);
        }
}

/* 16 results into y, or only the first `left` of them (the last panel of the matrix may have fewer real outputs). */
static inline void q_put(float *y, __m512 v, int64_t left) {
    if (left >= 16)
        _mm512_storeu_ps(y, v);
    else if (left > 0)
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << left) - 1), v);
}

/* acc += sums * (scale * d) for each row and panel of a tile, then + zero (or offset) * d * sum(xq) where `z` is
   given: a block's share of its outputs (or a half block's, SIXTEEN's). */
static inline __attribute__((always_inline)) void q_add(int rows, int panels, __m512i sums[Q_ROWS][Q_PANELS],
                                                        const __m512 *s, const __m512 *z, const float *d,
                                                        const float *ds, int64_t blocks,
                                                        __m512 acc[Q_ROWS][Q_PANELS]) {
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < panels; g++) {
            __m512 sd = _mm512_mul_ps(s[g], _mm512_set1_ps(d[r * blocks]));
            acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][g]), sd, acc[r][g]);
            if (z != NULL) acc[r][g] = _mm512_fmadd_ps(z[g], _mm512_set1_ps(ds[r * blocks]), acc[r][g]);
        }
}

/* Each row's sums less `shift` times its sum of steps over the inputs summed: `count`, less `but` where given. */
static inline __attribute__((always_inline)) void q_less(int rows, int panels, __m512i sums[Q_ROWS][Q_PANELS],
                                                         int shift, const int32_t *count, const int32_t *but,
                                                         int64_t blocks) {
    for (int r = 0; r < rows; r++) {
        __m512i less = _mm512_set1_epi32(shift * (count[r * blocks] - (but == NULL ? 0 : but[r * blocks])));
        for (int g = 0; g < panels; g++) sums[r][g] = _mm512_sub_epi32(sums[r][g], less);
    }
}

/* A tile of up to Q_ROWS rows x Q_PANELS panels, block after block. */
static inline __attribute__((always_inline)) void q_tile(int rows, int panels, const uint8_t *records,
                                                         int64_t panel_bytes, int bits, struct q8_rows q, int64_t K,
                                                         float *y, int64_t N, int64_t outputs) {
    __m512 acc[Q_ROWS][Q_PANELS];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < panels; g++) acc[r][g] = _mm512_setzero_ps();
    int64_t blocks = K / BLOCK, record = RECORD(bits);
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sums[Q_ROWS][Q_PANELS];
        const uint8_t *block[Q_PANELS];
        __m512 s[Q_PANELS], z[Q_PANELS];
        for (int g = 0; g < panels; g++) block[g] = records + g * panel_bytes + b * record;
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < panels; g++) sums[r][g] = _mm512_setzero_si512();
        if (four_bit(bits)) {
            for (int i = 0; i < 4; i++) {
                __m512i lo[Q_PANELS], hi[Q_PANELS];
                for (int g = 0; g < panels; g++) {
                    __m512i raw = _mm512_loadu_si512(block[g] + 64 * i);
                    lo[g] = _mm512_and_si512(raw, low);
                    hi[g] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                }
                for (int r = 0; r < rows; r++) {
                    int32_t first, second;
                    memcpy(&first, q.xq + r * K + b * BLOCK + 8 * i, 4);
                    memcpy(&second, q.xq + r * K + b * BLOCK + 8 * i + 4, 4);
                    __m512i xa = _mm512_set1_epi32(first), xb = _mm512_set1_epi32(second);
                    for (int g = 0; g < panels; g++) {
                        sums[r][g] = _mm512_dpbusd_epi32(sums[r][g], lo[g], xa);
                        sums[r][g] = _mm512_dpbusd_epi32(sums[r][g], hi[g], xb);
                    }
                }
            }
        } else {
            for (int i = 0; i < 8; i++) {
                if (bits == SIXTEEN && i == 4) { /* the first half's share, by its own scales */
                    for (int g = 0; g < panels; g++) s[g] = _mm512_loadu_ps((const float *)(block[g] + 512));
                    q_less(rows, panels, sums, 128, q.sh + b, NULL, blocks);
                    q_add(rows, panels, sums, s, NULL, q.d + b, q.ds + b, blocks, acc);
                    for (int r = 0; r < rows; r++)
                        for (int g = 0; g < panels; g++) sums[r][g] = _mm512_setzero_si512();
                }
                __m512i c[Q_PANELS];
                for (int g = 0; g < panels; g++) c[g] = _mm512_loadu_si512(block[g] + 64 * i);
                for (int r = 0; r < rows; r++) {
                    int32_t four;
                    memcpy(&four, q.xq + r * K + b * BLOCK + 4 * i, 4);
                    __m512i xa = _mm512_set1_epi32(four);
                    for (int g = 0; g < panels; g++) sums[r][g] = _mm512_dpbusd_epi32(sums[r][g], c[g], xa);
                }
            }
        }
        if (narrow(bits)) {
            for (int g = 0; g < panels; g++) {
                const uint8_t *tail = block[g] + record - 64;
                s[g] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tail));
                z[g] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tail + 32)));
            }
        } else {
            for (int g = 0; g < panels; g++) {
                const float *tail = (const float *)(block[g] + record - 128);
                s[g] = _mm512_loadu_ps(tail);
                z[g] = _mm512_loadu_ps(tail + 16);
            }
            q_less(rows, panels, sums, four_bit(bits) ? 8 : 128, q.sx + b, bits == SIXTEEN ? q.sh + b : NULL, blocks);
        }
        if (bits == SIXTEEN) /* the second half's share, by the tail's second scales */
            q_add(rows, panels, sums, z, NULL, q.d + b, q.ds + b, blocks, acc);
        else
            q_add(rows, panels, sums, s, z, q.d + b, q.ds + b, blocks, acc);
    }
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < panels; g++) q_put(y + r * N + g * P, acc[r][g], outputs - (int64_t)g * P);
}

#else /* Q_AVX2 */
/* Tiles of up to 4 rows x 1 panel (16 outputs: 2 registers), both halves sharing each row's broadcast steps: tiles
   of 2 or 3 rows do alike, and more panels, or each half panel in turn, are slower. */
#define Q_ROWS 4
#define Q_PANELS 1

/* The sum of 8 lanes. */
static inline int lanes_sum(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

/* As the VNNI build's: the same roundings (one product, one conversion a value), the same integer sums. */
static void quantise(const float *x, int64_t M, int64_t K, struct q8_rows rows) {
    int8_t *xq = rows.xq;
    float *d = rows.d, *ds = rows.ds;
    int32_t *sx = rows.sx, *sh = rows.sh;
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
            __m256i first = _mm256_add_epi32(q[0], q[1]);
            int sum = lanes_sum(_mm256_add_epi32(first, _mm256_add_epi32(q[2], q[3])));
            d[r * blocks + b] = scale;
            ds[r * blocks + b] = scale * (float)sum;
            sx[r * blocks + b] = sum;
            sh[r * blocks + b] = lanes_sum(first);
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

enum { H = 2 * Q_PANELS }; /* columns of 8 outputs */

/* acc += sums * (scale * d) for each row and column of a tile, then + zero (or offset) * d * sum(xq) where `z` is
   given: a block's share of its outputs (or a half block's, SIXTEEN's). */
static inline __attribute__((always_inline)) void q_add(int rows, int columns, __m256i sums[Q_ROWS][H],
                                                        const __m256 *s, const __m256 *z, const float *d,
                                                        const float *ds, int64_t blocks, __m256 acc[Q_ROWS][H]) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < columns; c++) {
            __m256 sd = _mm256_mul_ps(s[c], _mm256_set1_ps(d[r * blocks]));
            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][c]), sd, acc[r][c]);
            if (z != NULL) acc[r][c] = _mm256_fmadd_ps(z[c], _mm256_set1_ps(ds[r * blocks]), acc[r][c]);
        }
}

/* Each row's sums plus `shift` times `count` (its sum of steps over the inputs summed). */
static inline __attribute__((always_inline)) void q_more(int rows, int columns, __m256i sums[Q_ROWS][H], int shift,
                                                         const int32_t *count, int64_t blocks) {
    for (int r = 0; r < rows; r++) {
        __m256i more = _mm256_set1_epi32(shift * count[r * blocks]);
        for (int c = 0; c < columns; c++) sums[r][c] = _mm256_add_epi32(sums[r][c], more);
    }
}

/* A tile of up to Q_ROWS rows x Q_PANELS panels, each panel two registers of 8 outputs, block after block. */
static inline __attribute__((always_inline)) void q_tile(int rows, int panels, const uint8_t *records,
                                                         int64_t panel_bytes, int bits, struct q8_rows q, int64_t K,
                                                         float *y, int64_t N, int64_t outputs) {
    __m256 acc[Q_ROWS][H];
    int columns = 2 * panels;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < columns; c++) acc[r][c] = _mm256_setzero_ps();
    int64_t blocks = K / BLOCK, record = RECORD(bits);
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block[Q_PANELS];
        __m256 s[H], z[H];
        for (int g = 0; g < panels; g++) block[g] = records + g * panel_bytes + b * record;
        __m256i sums[Q_ROWS][H];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < columns; c++) sums[r][c] = _mm256_setzero_si256();
        if (four_bit(bits)) { /* unsigned sums */
            for (int i = 0; i < 4; i++) {
                __m256i lo[H], hi[H];
                for (int c = 0; c < columns; c++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(block[c / 2] + 64 * i + 32 * (c % 2)));
                    lo[c] = _mm256_and_si256(raw, low);
                    hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                }
                for (int r = 0; r < rows; r++) {
                    int32_t first, second;
                    memcpy(&first, q.xq + r * K + b * BLOCK + 8 * i, 4);
                    memcpy(&second, q.xq + r * K + b * BLOCK + 8 * i + 4, 4);
                    __m256i xa = _mm256_set1_epi32(first), xb = _mm256_set1_epi32(second);
                    for (int c = 0; c < columns; c++) {
                        sums[r][c] = _mm256_add_epi16(sums[r][c], _mm256_maddubs_epi16(lo[c], xa));
                        sums[r][c] = _mm256_add_epi16(sums[r][c], _mm256_maddubs_epi16(hi[c], xb));
                    }
                }
            }
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < columns; c++) sums[r][c] = _mm256_madd_epi16(sums[r][c], ones);
            if (!narrow(bits)) q_more(rows, columns, sums, -8, q.sx + b, blocks);
        } else { /* sums of the signed codes c - 128 */
            for (int i = 0; i < 8; i++) {
                if (bits == SIXTEEN && i == 4) { /* the first half's share, by its own scales */
                    for (int c = 0; c < columns; c++)
                        s[c] = _mm256_loadu_ps((const float *)(block[c / 2] + 512) + 8 * (c % 2));
                    q_add(rows, columns, sums, s, NULL, q.d + b, q.ds + b, blocks, acc);
                    for (int r = 0; r < rows; r++)
                        for (int c = 0; c < columns; c++) sums[r][c] = _mm256_setzero_si256();
                }
                __m256i code[H], magnitude[H];
                for (int c = 0; c < columns; c++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(block[c / 2] + 64 * i + 32 * (c % 2)));
                    code[c] = _mm256_xor_si256(raw, bias); /* c - 128, signed */
                    magnitude[c] = _mm256_abs_epi8(code[c]);
                }
                for (int r = 0; r < rows; r++) {
                    int32_t four;
                    memcpy(&four, q.xq + r * K + b * BLOCK + 4 * i, 4);
                    __m256i xa = _mm256_set1_epi32(four);
                    for (int c = 0; c < columns; c++) {
                        __m256i pairs = _mm256_maddubs_epi16(magnitude[c], _mm256_sign_epi8(xa, code[c]));
                        sums[r][c] = _mm256_add_epi32(sums[r][c], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
            if (narrow(bits)) q_more(rows, columns, sums, 128, q.sx + b, blocks);
        }
        if (narrow(bits)) {
            for (int c = 0; c < columns; c++) {
                const uint8_t *tail = block[c / 2] + record - 64 + 16 * (c % 2);
                s[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tail));
                z[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tail + 32)));
            }
        } else {
            for (int c = 0; c < columns; c++) {
                const float *tail = (const float *)(block[c / 2] + record - 128) + 8 * (c % 2);
                s[c] = _mm256_loadu_ps(tail);
                z[c] = _mm256_loadu_ps(tail + 16);
            }
        }
        if (bits == SIXTEEN) /* the second half's share, by the tail's second scales */
            q_add(rows, columns, sums, z, NULL, q.d + b, q.ds + b, blocks, acc);
        else
            q_add(rows, columns, sums, s, z, q.d + b, q.ds + b, blocks, acc);
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < columns; c++) q_put(y + r * N + 8 * c, acc[r][c], outputs - 8 * (int64_t)c);
}
#endif

/* The quantised rows of M x K laid out in `buffer` (q8_floats floats). */
struct q8_rows q8_view(float *buffer, int64_t M, int64_t K) {
    int64_t blocks = K / BLOCK;
    struct q8_rows q = {(int8_t *)buffer, buffer + M * K / 4, buffer + M * K / 4 + M * blocks, NULL, NULL};
    q.sx = (int32_t *)(q.ds + M * blocks);
    q.sh = q.sx + M * blocks;
    return q;
}

/* Rows x quantised into `buffer` (q8_floats floats). */
struct q8_rows q8_quantise(const float *x, int64_t M, int64_t K, float *buffer) {
    struct q8_rows q = q8_view(buffer, M, K);
    quantise(x, M, K, q);
    return q;
}

/* Panels [p0, p1) of y for the quantised rows q. */
void q8_panels(struct q8_rows q, int64_t M, int64_t K, const uint8_t *records, int bits, int64_t N, float *y,
               int64_t p0, int64_t p1) {
    int64_t panel_bytes = K / BLOCK * RECORD(bits);
    for (int64_t p = p0; p < p1; p += Q_PANELS) {
        int panels = p1 - p < Q_PANELS ? (int)(p1 - p) : Q_PANELS;
        const uint8_t *c = records + p * panel_bytes;
        int64_t tiles = (M + Q_ROWS - 1) / Q_ROWS, r = 0;
        for (int64_t t = 0; t < tiles; t++) {
            int64_t rows = tile_rows(M, r, t, tiles);
#define Q_TILE(R, G)                                                                                                   \
    if (R <= Q_ROWS && G <= Q_PANELS)                                                                                  \
    q_tile(R, G, c, panel_bytes, bits, q8_row(q, r, K), K, y + r * N + p * P, N, N - p * P)
            BY_ROWS(Q_TILE, rows, panels)
            r += rows;
        }
    }
}

int q8_alone(const float *x, int64_t M, int64_t K, const uint8_t *records, int bits, int64_t N, float *y) {
    static _Thread_local struct ttft_buffer kept = {NULL, 0};
    float *buffer = ttft_grow(&kept, q8_floats(M, K));
    if (buffer == NULL) return -1;
    q8_panels(q8_quantise(x, M, K, buffer), M, K, records, bits, N, y, 0, (N + P - 1) / P);
    return 0;
}
#endif
