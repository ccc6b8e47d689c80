/* fp32 rows times a weight kept in a GGUF file's own blocks, for CPU (ttft_sse/engine/kernel.py builds it).

   y[M,N] = x[M,K] . W[N,K]^T. W's blocks of 32 inputs hold w = q * scale + zero, one scale and one zero a block
   (q: 4-bit codes less 8, or 8-bit codes). kernel.py lays them out in panels of 16 outputs (N padded to whole
   panels with zero weights):
     4-bit codes: panels x K/2 x 16 bytes; byte j of row i holds output j's code for input 2i (low nibble) and for
                  input 2i+1 (high nibble), each plus 8;
     8-bit codes: panels x K x 16 signed bytes;
     scale, zero: panels x K/32 x 16 floats.
   Each input's 16 weights of a panel are expanded to fp32 (the values transformers' loader gives: q * scale, then
   + zero) and multiplied into 16 outputs at once: out[n] = fma(x[k], w[k][n], out[n]) for k = 0, 1, ..., K-1, from
   zero. That chain is the same whatever M is and wherever a row falls, so a row's result does not depend on the
   other rows of the call (a stream's answer does not depend on its batch). A tile of rows (up to 8 rows x 48
   outputs with AVX-512, 4 x 16 with AVX2) expands the codes in registers for all its rows at once, in calls of up
   to FUSED_ROWS rows; longer calls expand the panels into a buffer once and reuse them for every tile. Both give the
   same bits. Built with -ffp-contract=off: only the written fused multiply-adds fuse. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define P 16          /* outputs a panel */
#define BLOCK 32      /* inputs a block */
#define FUSED_ROWS 16 /* calls of up to this many rows expand the codes in registers in every tile (measured) */

#if defined(__AVX512F__)
/* 16 outputs in one register; tiles of up to 8 rows x 3 panels: 24 accumulators. */
#define ROWS 8
#define PANELS 3
typedef __m512 pv;
static inline pv pv_zero(void) { return _mm512_setzero_ps(); }
static inline pv pv_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void pv_store(float *p, pv v) { _mm512_storeu_ps(p, v); }
static inline pv pv_fma(float x, pv w, pv acc) { return _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc); }
/* 16 signed codes to q * scale + zero. */
static inline pv pv_codes(__m128i q, pv scale, pv zero) {
    return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale), zero);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 16 outputs in two registers; tiles of up to 4 rows x 1 panel. */
#define ROWS 4
#define PANELS 1
typedef struct {
    __m256 lo, hi;
} pv;
static inline pv pv_zero(void) { return (pv){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline pv pv_load(const float *p) { return (pv){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void pv_store(float *p, pv v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline pv pv_fma(float x, pv w, pv acc) {
    __m256 b = _mm256_set1_ps(x);
    return (pv){_mm256_fmadd_ps(b, w.lo, acc.lo), _mm256_fmadd_ps(b, w.hi, acc.hi)};
}
static inline __m256 codes8(__m128i q, __m256 scale, __m256 zero) {
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale), zero);
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

/* A tile's results into y (N apart); the last panel of the matrix may have fewer than 16 real outputs. */
static inline __attribute__((always_inline)) void put(int rows, int panels, pv acc[ROWS][PANELS], float *y, int64_t N,
                                                      int64_t outputs) {
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < panels; g++) {
            int64_t left = outputs - (int64_t)g * P;
            if (left >= P) {
                pv_store(y + r * N + g * P, acc[r][g]);
            } else if (left > 0) {
                float out[P];
                pv_store(out, acc[r][g]);
                memcpy(y + r * N + g * P, out, sizeof(float) * (size_t)left);
            }
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
    int64_t blocks = K / BLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        pv s[PANELS], z[PANELS];
        for (int g = 0; g < panels; g++) {
            s[g] = pv_load(scale + (g * blocks + b) * P);
            z[g] = pv_load(zero + (g * blocks + b) * P);
        }
        for (int64_t i = b * BLOCK / 2; i < (b + 1) * BLOCK / 2; i++) {
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

/* Up to ROWS rows against `panels` panels expanded in w (K x 16 floats a panel). */
static inline __attribute__((always_inline)) void buffered(int rows, int panels, const float *w, const float *x,
                                                           int64_t K, float *y, int64_t N, int64_t outputs) {
    pv acc[ROWS][PANELS];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < panels; g++) acc[r][g] = pv_zero();
    for (int64_t k = 0; k < K; k++) {
        pv wk[PANELS];
        for (int g = 0; g < panels; g++) wk[g] = pv_load(w + (g * K + k) * P);
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < panels; g++) acc[r][g] = pv_fma(x[r * K + k], wk[g], acc[r][g]);
    }
    put(rows, panels, acc, y, N, outputs);
}

static void expand(const uint8_t *codes, int bits, const float *scale, const float *zero, int64_t K, float *w) {
    for (int64_t b = 0; b < K / BLOCK; b++) {
        pv s = pv_load(scale + P * b), z = pv_load(zero + P * b);
        for (int64_t i = b * BLOCK / 2; i < (b + 1) * BLOCK / 2; i++) {
            pv w0, w1;
            pair(codes, bits, i, s, z, &w0, &w1);
            pv_store(w + 2 * i * P, w0);
            pv_store(w + (2 * i + 1) * P, w1);
        }
    }
}

/* The row and panel counts of a tile as constants for the compiler (ROWS <= 8, PANELS <= 3). */
#define BY_PANELS(CALL, R)                                                                                            \
    switch (panels) {                                                                                                  \
    case 3: CALL(R, 3); break;                                                                                         \
    case 2: CALL(R, 2); break;                                                                                         \
    default: CALL(R, 1); break;                                                                                        \
    }
#define BY_ROWS(CALL, rows)                                                                                            \
    switch (rows) {                                                                                                    \
    case 8: BY_PANELS(CALL, 8) break;                                                                                  \
    case 7: BY_PANELS(CALL, 7) break;                                                                                  \
    case 6: BY_PANELS(CALL, 6) break;                                                                                  \
    case 5: BY_PANELS(CALL, 5) break;                                                                                  \
    case 4: BY_PANELS(CALL, 4) break;                                                                                  \
    case 3: BY_PANELS(CALL, 3) break;                                                                                  \
    case 2: BY_PANELS(CALL, 2) break;                                                                                  \
    default: BY_PANELS(CALL, 1) break;                                                                                 \
    }

/* Every row, in tiles of at most ROWS rows as even as they can be (9 rows: 4 + 5, not 8 + 1): each tile expands
   the codes in registers or, when w is given, reads the panels expanded there (K x 16 floats a panel). */
static void all_rows(int panels, const uint8_t *codes, int64_t panel_bytes, int bits, const float *scale,
                     const float *zero, const float *w, const float *x, int64_t M, int64_t K, float *y, int64_t N,
                     int64_t outputs) {
    int64_t tiles = (M + ROWS - 1) / ROWS, r = 0;
    for (int64_t t = 0; t < tiles; t++) {
        int64_t rows = (M - r) / (tiles - t); /* the larger tiles come last */
        const float *xt = x + r * K;
        float *yt = y + r * N;
#define FUSED(R, G)                                                                                                    \
    if (R <= ROWS && G <= PANELS) fused(R, G, codes, panel_bytes, bits, scale, zero, xt, K, yt, N, outputs)
#define BUFFERED(R, G)                                                                                                 \
    if (R <= ROWS && G <= PANELS) buffered(R, G, w, xt, K, yt, N, outputs)
        if (w == NULL) {
            BY_ROWS(FUSED, rows)
        } else {
            BY_ROWS(BUFFERED, rows)
        }
        r += rows;
    }
}

/* Returns 0, or -1 if K is not whole blocks, bits is neither 4 nor 8, or the buffer cannot be allocated. */
int ttft_blocks_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
                       const float *zero, int64_t N, float *y) {
    /* One buffer a thread, kept: allocating it at every call would map and fault in fresh pages. */
    static _Thread_local float *buffer = NULL;
    static _Thread_local int64_t capacity = 0;
    if (K % BLOCK != 0 || (bits != 4 && bits != 8)) return -1;
    if (M <= 0) return 0;
    if (M > FUSED_ROWS && capacity < PANELS * P * K) {
        float *grown = realloc(buffer, sizeof(float) * PANELS * P * K);
        if (grown == NULL) return -1;
        buffer = grown;
        capacity = PANELS * P * K;
    }
    int64_t all = (N + P - 1) / P, panel_bytes = K * P * bits / 8, blocks = K / BLOCK;
    for (int64_t p = 0; p < all; p += PANELS) {
        int panels = all - p < PANELS ? (int)(all - p) : PANELS;
        const uint8_t *c = codes + p * panel_bytes;
        const float *s = scale + p * blocks * P, *z = zero + p * blocks * P;
        float *w = NULL;
        if (M > FUSED_ROWS) {
            w = buffer;
            for (int g = 0; g < panels; g++)
                expand(c + g * panel_bytes, bits, s + g * blocks * P, z + g * blocks * P, K, w + g * K * P);
        }
        all_rows(panels, c, panel_bytes, bits, s, z, w, x, M, K, y + p * P, N, N - p * P);
    }
    return 0;
}
