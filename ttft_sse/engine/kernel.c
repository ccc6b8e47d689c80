/* fp32 rows times a weight kept in a GGUF file's own blocks, for CPU (ttft_sse/engine/kernel.py builds it).

   y[M,N] = x[M,K] . W[N,K]^T, where W is stored as blocks of 32 inputs: w = (q - c) * scale + zero, one scale and
   one zero a block. 4-bit codes (Q4_0, Q4_1): K/2 bytes a row, c = 8; in a block's 16 bytes the low nibbles hold its
   first 16 inputs and the high nibbles its last 16 (GGUF's order). 8-bit codes (Q8_0): K signed bytes a row, c = 0.
   scale and zero: N x K/32 floats.

   Each weight row is expanded to fp32 (the same values transformers' loader gives) in a small buffer, then every
   output is one chain of fused multiply-adds over K, in order, one vector lane per K mod the vector width, summed
   across lanes at the end. That chain is the same whatever M is and wherever the row falls in a tile, so a row's
   result does not depend on the other rows of the call (a stream's answer does not depend on the batch).
   Built with -ffp-contract=off: only the written fused multiply-adds fuse. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* The sum of 4 lanes, in a fixed order. */
static inline float sum4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define WIDTH 16
typedef __m512 vec;
#define LOAD _mm512_loadu_ps
#define FMA _mm512_fmadd_ps
#define ZERO _mm512_setzero_ps
static inline float lanes_sum(vec v) {
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return sum4(_mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
}
/* 16 signed codes to (q * scale) + zero. */
static inline void store16(float *out, __m128i q, float scale, float zero) {
    __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(scale));
    _mm512_storeu_ps(out, _mm512_add_ps(w, _mm512_set1_ps(zero)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define WIDTH 8
typedef __m256 vec;
#define LOAD _mm256_loadu_ps
#define FMA _mm256_fmadd_ps
#define ZERO _mm256_setzero_ps
static inline float lanes_sum(vec v) {
    return sum4(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}
static inline void store8(float *out, __m128i q, __m256 scale, __m256 zero) {
    __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale);
    _mm256_storeu_ps(out, _mm256_add_ps(w, zero));
}
static inline void store16(float *out, __m128i q, float scale, float zero) {
    __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero);
    store8(out, q, s, z);
    store8(out + 8, _mm_srli_si128(q, 8), s, z);
}
#else
#error "this kernel needs AVX2 and FMA (or AVX-512)"
#endif

#define BLOCK 32
#define ROWS 6    /* rows of x a tile: 6 x 4 accumulators, 4 weight vectors and one row vector fit 32 registers */
#define OUTPUTS 4 /* weight rows a tile */

static void expand(const uint8_t *codes, int bits, const float *scale, const float *zero, int64_t blocks, float *w) {
    const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    for (int64_t b = 0; b < blocks; b++) {
        float *out = w + BLOCK * b;
        if (bits == 4) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(codes + 16 * b));
            store16(out, _mm_sub_epi8(_mm_and_si128(raw, low), eight), scale[b], zero[b]);
            store16(out + 16, _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), low), eight), scale[b], zero[b]);
        } else {
            store16(out, _mm_loadu_si128((const __m128i *)(codes + BLOCK * b)), scale[b], zero[b]);
            store16(out + 16, _mm_loadu_si128((const __m128i *)(codes + BLOCK * b + 16)), scale[b], zero[b]);
        }
    }
}

/* rows x outputs results: x's rows (K apart) against w's expanded rows (K apart), into y (N apart). */
static inline __attribute__((always_inline)) void tile(int rows, int outputs, const float *w, const float *x,
                                                       int64_t K, float *y, int64_t N) {
    vec acc[ROWS][OUTPUTS];
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < outputs; o++) acc[r][o] = ZERO();
    for (int64_t k = 0; k < K; k += WIDTH) {
        vec wk[OUTPUTS];
        for (int o = 0; o < outputs; o++) wk[o] = LOAD(w + o * K + k);
        for (int r = 0; r < rows; r++) {
            vec xk = LOAD(x + r * K + k);
            for (int o = 0; o < outputs; o++) acc[r][o] = FMA(wk[o], xk, acc[r][o]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < outputs; o++) y[r * N + o] = lanes_sum(acc[r][o]);
}

/* Every row of x against `outputs` expanded weight rows, in tiles of at most ROWS rows, as even as they can be
   (8 rows: 4 + 4, not 6 + 2); the row count of each tile is a constant for the compiler. */
static inline __attribute__((always_inline)) void all_rows(int outputs, const float *w, const float *x, int64_t M,
                                                           int64_t K, float *y, int64_t N) {
    int64_t tiles = (M + ROWS - 1) / ROWS, r = 0;
    for (int64_t t = 0; t < tiles; t++) {
        int64_t rows = (M - r) / (tiles - t); /* the larger tiles come last */
        const float *xt = x + r * K;
        float *yt = y + r * N;
        switch (rows) {
        case 6: tile(6, outputs, w, xt, K, yt, N); break;
        case 5: tile(5, outputs, w, xt, K, yt, N); break;
        case 4: tile(4, outputs, w, xt, K, yt, N); break;
        case 3: tile(3, outputs, w, xt, K, yt, N); break;
        case 2: tile(2, outputs, w, xt, K, yt, N); break;
        default: tile(1, outputs, w, xt, K, yt, N); break;
        }
        r += rows;
    }
}

/* Returns 0, or -1 if K is not whole blocks or the buffer cannot be allocated (y is then untouched). */
int ttft_blocks_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
                       const float *zero, int64_t N, float *y) {
    if (K % BLOCK != 0 || (bits != 4 && bits != 8)) return -1;
    int64_t blocks = K / BLOCK, row_bytes = K * bits / 8;
    float *w = malloc(sizeof(float) * OUTPUTS * K);
    if (w == NULL) return -1;
    int64_t n = 0;
    for (; n + OUTPUTS <= N; n += OUTPUTS) {
        for (int o = 0; o < OUTPUTS; o++)
            expand(codes + (n + o) * row_bytes, bits, scale + (n + o) * blocks, zero + (n + o) * blocks, blocks,
                   w + o * K);
        all_rows(OUTPUTS, w, x, M, K, y + n, N);
    }
    for (; n < N; n++) {
        expand(codes + n * row_bytes, bits, scale + n * blocks, zero + n * blocks, blocks, w);
        all_rows(1, w, x, M, K, y + n, N);
    }
    free(w);
    return 0;
}
