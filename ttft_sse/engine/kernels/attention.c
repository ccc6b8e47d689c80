/* Attention of a batched step, request by request, over keys and values read in place from the paged KV cache; and
   of the single-request engine's calls, over its dense cache (ttft_sse/engine/kernels/attention.py builds it and calls
   it).

   A step of continuous batching holds several requests side by side: request s has query rows cu_q[s] ..
   cu_q[s+1]-1 and keys cu_k[s] .. cu_k[s+1]-1, and its row i (of lq rows, lk keys) sees its own keys 0 .. lk-lq+i
   (its past, then its new rows up to itself). Key j of KV head g is dim floats at k + index[j] * key_stride +
   g * head_stride (likewise in v): in the paged cache's layout ([rows, kv_heads, dim]: key_stride kv_heads * dim,
   head_stride dim) nothing is gathered first; a dense cache ([kv_heads, keys, dim], the single-request engine's)
   is read the same way with its own strides. Query heads h*groups .. h*groups+groups-1 share KV head h. q and out
   are [rows, heads, dim].

   Requests with more than max_rows query rows (long prompts) are left out, for the caller's SDPA (from ~1000 rows
   on, its blocked products are faster). The rest cost one dot product and one multiply-add of dim floats per query
   head and visible key, where one masked attention over the whole step costs them for every key of every request.

   Per row and head: scores s_j = q.k_j * scale, m = max s_j, p_j = exp(s_j - m) (a polynomial, as Cephes' expf),
   out = sum p_j v_j / sum p_j, in fp32, 16 floats at a time: one AVX-512 register, or two AVX2 ones (with FMA).
   Without either it returns -2 (the caller keeps the library's path). dim must be a multiple of 16, up to 256
   (else -1). The two builds sum in other orders (each is the same for every row, whatever else the step holds).

   Loads, more than multiply-adds, bound these products, so each value loaded serves several: a row's scores take
   4 keys at a time against its query heads (held in registers on AVX-512), and on AVX-512 2 consecutive rows of a
   request are attended together, each key and value row read once for both. A row's result is the same bits in a
   block or alone (see attend_n).

   A KV cache in f16 (TTFT_KV_DTYPE) holds fp16 values, read by the functions named _f16: each key and value is
   widened to fp32 as it is loaded (exactly: every fp16 value is an fp32 one; AVX-512's vcvtph2ps, F16C's on AVX2,
   half.h's plain C on an AVX2 build without F16C), then the same arithmetic as over fp32 values. So the attention
   over an f16 cache gives the bits the fp32 functions give over the same values rounded to fp16 and held in fp32:
   what the single engine's dense cache holds (engine/library/half_cache.py). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "half.h"   /* fp16 widened in plain C, for an AVX2 build without F16C */
#include "kernel.h" /* the pointer types decoder.c and kernel.c call this file's functions through */

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define MAX_DIM 256

#if defined(__AVX512F__)
typedef __m512 v16; /* 16 floats */
static inline v16 v_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
/* 16 fp16 values widened to fp32, exactly. */
static inline v16 v_load_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void v_store(float *p, v16 x) { _mm512_storeu_ps(p, x); }
static inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
/* max(top, x) in the first n lanes (n >= 1), top in the others. */
static inline v16 v_max_first(v16 top, v16 x, int64_t n) { return _mm512_mask_max_ps(top, first(n), top, x); }
/* x in the first n lanes, 0 in the others. */
static inline v16 v_first(v16 x, int64_t n) { return _mm512_maskz_mov_ps(first(n), x); }
static inline float v_max_all(v16 x) { return _mm512_reduce_max_ps(x); }
static inline float v_sum_all(v16 x) { return _mm512_reduce_add_ps(x); }

static inline v16 v_fnma(v16 a, v16 b, v16 c) { return _mm512_fnmadd_ps(a, b, c); }
static inline v16 v_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
static inline v16 v_round(v16 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* p * 2^n, n whole. */
static inline v16 v_scale2(v16 p, v16 n) { return _mm512_scalef_ps(p, n); }

/* The sums of 16 vectors' lanes (r[i]: a[i]'s 16 lanes; a transpose as it adds) in two steps: each 4 vectors'
   lanes added pairwise twice (v_quarter: a[4i .. 4i+3]'s, 4 sums of 4 lanes each, in one vector), then the four
   quarters' (v_sums_quarters). */
typedef __m512 quarter;
static inline quarter v_quarter(v16 a0, v16 a1, v16 a2, v16 a3) {
    __m512d x = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1)));
    __m512d y = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3)));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
static inline v16 v_sums_quarters(const quarter c[4]) {
    __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

#define ACCUMULATORS 24 /* the values' sums a block of rows keeps in registers (a row's head's 16-float part each) */
#define ROWS 2          /* query rows of one request attended together, at most (rows_for) */
#else
typedef struct {
    __m256 lo, hi;
} v16; /* 16 floats, in two registers */
static inline v16 v_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 v_set1(float x) { return (v16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline v16 v_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
/* 16 fp16 values widened to fp32, exactly: by F16C, else in plain C. */
static inline v16 v_load_half(const uint16_t *p) {
#if defined(__F16C__)
    return (v16){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
#else
    float widened[16];
    for (int i = 0; i < 16; i++) widened[i] = half_float(p[i]);
    return v_load(widened);
#endif
}
static inline void v_store(float *p, v16 x) {
    _mm256_storeu_ps(p, x.lo);
    _mm256_storeu_ps(p + 8, x.hi);
}
static inline v16 v_add(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline v16 v_sub(v16 a, v16 b) { return (v16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline v16 v_mul(v16 a, v16 b) { return (v16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline v16 v_fma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
/* All ones in the first n lanes of 16 (n >= 1), zeros in the others. */
static inline v16 first(int64_t n) {
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), count = _mm256_set1_epi32((int)(n < 16 ? n : 16));
    return (v16){_mm256_castsi256_ps(_mm256_cmpgt_epi32(count, lanes)),
                 _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, _mm256_add_epi32(lanes, _mm256_set1_epi32(8))))};
}
static inline v16 v_max_first(v16 top, v16 x, int64_t n) {
    v16 live = first(n);
    return (v16){_mm256_blendv_ps(top.lo, _mm256_max_ps(top.lo, x.lo), live.lo),
                 _mm256_blendv_ps(top.hi, _mm256_max_ps(top.hi, x.hi), live.hi)};
}
static inline v16 v_first(v16 x, int64_t n) {
    v16 live = first(n);
    return (v16){_mm256_and_ps(x.lo, live.lo), _mm256_and_ps(x.hi, live.hi)};
}
static inline float sum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float v_max_all(v16 x) {
    __m256 m = _mm256_max_ps(x.lo, x.hi);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline float v_sum_all(v16 x) { return sum8(_mm256_add_ps(x.lo, x.hi)); }

static inline v16 v_fnma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16 v_max(v16 a, v16 b) { return (v16){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline v16 v_round(v16 x) {
    return (v16){_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                 _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
/* p * 2^n, n whole, in [-126, 0] here (see v_exp): 2^n built in its exponent bits, a normal number. */
static inline __m256 scale2(__m256 p, __m256 n) {
    __m256i two = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two));
}
static inline v16 v_scale2(v16 p, v16 n) { return (v16){scale2(p.lo, n.lo), scale2(p.hi, n.hi)}; }

/* The sums of 16 vectors' lanes in two steps, as AVX-512's: each vector's halves added, then each 4 vectors' sums
   of 2 lanes added pairwise twice (v_quarter: 2 sums of 4 lanes for each of the 4, in one register), then the
   quarters' halves (v_sums_quarters). */
typedef __m256 quarter;
static inline quarter v_quarter(v16 a0, v16 a1, v16 a2, v16 a3) {
    __m256 h0 = _mm256_add_ps(a0.lo, a0.hi), h1 = _mm256_add_ps(a1.lo, a1.hi);
    __m256 h2 = _mm256_add_ps(a2.lo, a2.hi), h3 = _mm256_add_ps(a3.lo, a3.hi);
    return _mm256_hadd_ps(_mm256_hadd_ps(h0, h1), _mm256_hadd_ps(h2, h3)); /* halves: a0..a3, low then high */
}
static inline __m256 halves8(quarter u0, quarter u1) {
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
static inline v16 v_sums_quarters(const quarter c[4]) { return (v16){halves8(c[0], c[1]), halves8(c[2], c[3])}; }

#define ACCUMULATORS 4 /* the values' sums kept in registers (two each, of 16) */
/* One row at a time: a block of 2 rows' sums spill AVX2's 16 registers for 3 query heads a KV head (measured slower
   on Zen 4), and gained ~5 % for 1 or 2, where a decode step's row, alone in a block's code, took 10-75 % longer. */
#define ROWS 1
#endif

/* exp(x) for x <= 0 (scores minus their max), as Cephes' expf: n = round(x / ln 2), exp(x) = 2^n exp(x - n ln 2),
   the latter by a polynomial. */
static inline v16 v_exp(v16 x) {
    x = v_max(x, v_set1(-87.0f)); /* exp(-87) ~ 1.6e-38, near fp32's smallest normal: adds nothing */
    v16 n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
    v16 r = v_fnma(n, v_set1(0.693359375f), x); /* x - n ln 2, in two parts */
    r = v_fnma(n, v_set1(-2.12194440e-4f), r);
    v16 p = v_set1(1.9875691500e-4f);
    p = v_fma(p, r, v_set1(1.3981999507e-3f));
    p = v_fma(p, r, v_set1(8.3334519073e-3f));
    p = v_fma(p, r, v_set1(4.1665795894e-2f));
    p = v_fma(p, r, v_set1(1.6666665459e-1f));
    p = v_fma(p, r, v_set1(5.0000001201e-1f));
    p = v_fma(p, v_mul(r, r), v_add(r, v_set1(1.0f)));
    return v_scale2(p, n);
}

#define GROUP 4 /* query heads that share a KV head, attended together: each key and value row is read once */

/* Query rows attended together for `heads` query heads: as many (up to ROWS) as keep the values' sums of a block
   (rows x heads, a 16-float part of each at least) within ACCUMULATORS. */
static inline __attribute__((always_inline)) int rows_for(int heads) {
    int most = ACCUMULATORS / heads;
    return most < 1 ? 1 : most > ROWS ? ROWS : most;
}

/* 16 values of a KV row from value `at` on, as fp32: fp16 ones (half) widened, or fp32 ones as they are. */
static inline __attribute__((always_inline)) v16 kv_load(const void *row, int64_t at, int half) {
    return half ? v_load_half((const uint16_t *)row + at) : v_load((const float *)row + at);
}

/* KV row `i` of rows `stride` values apart from `base`, values of 2 bytes (half) or 4. */
static inline __attribute__((always_inline)) const void *kv_row(const void *base, int64_t i, int64_t stride,
                                                                int half) {
    return (const char *)base + i * stride * (half ? 2 : 4);
}

/* Consecutive query rows 0 .. rows-1 of one request (rows <= R = rows_for(heads)), row r seeing keys key[0 .. count
   + r - 1] (row numbers into k and v, which hold fp16 values where half, else fp32; count >= 1), for the query heads
   q[r * row_stride + h * dim ..] (h < heads, dim = 16 * parts floats) that share one KV head; out laid out as q. p:
   R x heads x (count + rows - 1 rounded up to 16) floats of room. Inlined with constant R, heads, parts and half
   (ATTEND_TYPED), so that the sums stay in registers.

   Each key and value row is read once for the block's rows and heads, and each row's result is the bits it has in
   a block of one: its scores are the same products summed in the same order (a key past its count, up to the
   block's last row's, gets a score too, never read: the max and the exponentials take the row's own count of
   lanes, and its sum of values stops at its count), its exponentials and sums the same, over its own keys. */
static inline __attribute__((always_inline)) void attend_n(int R, int heads, int64_t parts, int half, int rows,
                                                           const float *q, int64_t row_stride, const void *k,
                                                           const void *v, const int64_t *key, int64_t count,
                                                           int64_t stride, float scale, float *p, float *out) {
    int64_t dim = 16 * parts, most = count + rows - 1, room = (most + 15) / 16 * 16; /* the block's keys */
#define AT(r, h, j) (p + ((r) * heads + (h)) * room + (j)) /* row r's head h's score (then weight) of key j */
    v16 scales = v_set1(scale);
    for (int64_t j0 = 0; j0 < room; j0 += 16) {
        for (int r = 0; r < R; r++) {
            if (r >= rows) continue;
            const float *qr = q + r * row_stride;
            quarter quarters[GROUP][4];
            for (int t = 0; t < 4; t++) { /* keys j0 + 4t .. j0 + 4t + 3; past the block's last, the last again */
                const void *kr[4];
                for (int l = 0; l < 4; l++) {
                    int64_t j = j0 + 4 * t + l;
                    kr[l] = kv_row(k, key[j < most ? j : most - 1], stride, half);
                }
                v16 acc[GROUP][4]; /* key l's products with head h, summed part after part */
                for (int l = 0; l < 4; l++) {
                    v16 x = kv_load(kr[l], 0, half);
                    for (int h = 0; h < heads; h++) acc[h][l] = v_mul(v_load(qr + h * dim), x);
                }
                for (int64_t d = 16; d < dim; d += 16)
                    for (int l = 0; l < 4; l++) {
                        v16 x = kv_load(kr[l], d, half);
                        for (int h = 0; h < heads; h++) acc[h][l] = v_fma(v_load(qr + h * dim + d), x, acc[h][l]);
                    }
                for (int h = 0; h < heads; h++) quarters[h][t] = v_quarter(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
            }
            for (int h = 0; h < heads; h++) v_store(AT(r, h, j0), v_mul(v_sums_quarters(quarters[h]), scales));
        }
    }
    float inverse[ROWS][GROUP];
    for (int r = 0; r < R; r++) {
        if (r >= rows) continue;
        int64_t seen = count + r, through = (seen + 15) / 16 * 16; /* row r's keys, and its tiles' */
        for (int h = 0; h < heads; h++) {
            v16 top = v_set1(-INFINITY), sum = v_zero();
            for (int64_t j = 0; j < through; j += 16) top = v_max_first(top, v_load(AT(r, h, j)), seen - j);
            v16 max = v_set1(v_max_all(top));
            for (int64_t j = 0; j < through; j += 16) {
                v16 e = v_first(v_exp(v_sub(v_load(AT(r, h, j)), max)), seen - j);
                v_store(AT(r, h, j), e);
                sum = v_add(sum, e);
            }
            inverse[r][h] = 1.0f / v_sum_all(sum);
        }
    }
    /* The values' parts d0 .. d0+C-1 at a time, over every key: C as many as keep the block's sums in registers. */
    int C = ACCUMULATORS / (R * heads) < 1 ? 1 : ACCUMULATORS / (R * heads);
    if (C > parts) C = (int)parts;
    for (int64_t d0 = 0; d0 < parts; d0 += C) {
        int n = d0 + C < parts ? C : (int)(parts - d0);
        /* Row r's head h's part d0 + c summed in acc[(r * heads + h) * C + c]. */
        v16 acc[ACCUMULATORS > ROWS * GROUP ? ACCUMULATORS : ROWS * GROUP];
        for (int a = 0; a < R * heads * C; a++) acc[a] = v_zero();
        for (int64_t j = 0; j < most; j++) { /* key j: every row sees it up to count, then rows j - count + 1 on */
            const void *vr = kv_row(v, key[j], stride, half);
            int64_t from = j < count ? 0 : j - count + 1;
            for (int c = 0; c < C; c++) {
                if (c >= n) continue;
                v16 x = kv_load(vr, 16 * (d0 + c), half);
                for (int r = 0; r < R; r++) {
                    if (r >= rows || r < from) continue;
                    for (int h = 0; h < heads; h++) {
                        v16 *sum = &acc[(r * heads + h) * C + c];
                        *sum = v_fma(v_set1(*AT(r, h, j)), x, *sum);
                    }
                }
            }
        }
        for (int r = 0; r < R; r++) {
            if (r >= rows) continue;
            for (int h = 0; h < heads; h++) {
                v16 scaled = v_set1(inverse[r][h]);
                float *o = out + r * row_stride + h * dim + 16 * d0;
                for (int c = 0; c < n; c++) v_store(o + 16 * c, v_mul(acc[(r * heads + h) * C + c], scaled));
            }
        }
    }
#undef AT
}

/* attend_n for one element type of the cache: its common shapes inlined with constant heads and parts (and so
   rows_for's R). */
#define ATTEND_TYPED(name, half)                                                                                    \
    static void name(int heads, int64_t dim, int rows, const float *q, int64_t row_stride, const void *k,         \
                     const void *v, const int64_t *key, int64_t count, int64_t stride, float scale, float *p,     \
                     float *out) {                                                                                 \
        switch (heads * 100 + dim / 16) {                                                                          \
        case 104: ATTEND(1, 4, half); break;                                                                       \
        case 204: ATTEND(2, 4, half); break;                                                                       \
        case 304: ATTEND(3, 4, half); break;                                                                       \
        case 404: ATTEND(4, 4, half); break;                                                                       \
        case 108: ATTEND(1, 8, half); break;                                                                       \
        case 208: ATTEND(2, 8, half); break;                                                                       \
        case 308: ATTEND(3, 8, half); break;                                                                       \
        case 408: ATTEND(4, 8, half); break;                                                                       \
        default: ATTEND(heads, dim / 16, half);                                                                    \
        }                                                                                                          \
    }
#define ATTEND(heads, parts, half)                                                                                  \
    attend_n(rows_for(heads), heads, parts, half, rows, q, row_stride, k, v, key, count, stride, scale, p, out)
ATTEND_TYPED(attend_full, 0)
ATTEND_TYPED(attend_half, 1)
#undef ATTEND
#undef ATTEND_TYPED

/* `floats` of room, kept by each thread (the caller's, the kernel's helpers): no allocation a call, and none that
   could wait on another thread's. */
static float *scratch(int64_t floats) {
    static _Thread_local float *kept = NULL;
    static _Thread_local int64_t capacity = 0;
    if (capacity < floats) {
        free(kept);
        kept = malloc(sizeof(float) * (size_t)floats);
        capacity = kept ? floats : 0;
    }
    return kept;
}

/* Parts first .. last-1 of the step's attention into out, where part u is query row u / kv_heads of the step (rows
   of all its requests, in order) for the query heads of KV head u % kv_heads: heads / kv_heads x dim floats,
   contiguous in out, part after part. Parts of requests of more than max_rows rows are left alone. A request's
   parts go KV head by KV head (its keys and values stay in the core's caches for the next rows), its rows of one KV
   head in blocks of consecutive rows (attend_n), each row getting the bits it gets alone: any split of the parts
   gives the same bits (the kernel's helper threads share a step's attention this way: helpers.c). k and v hold
   fp16 values where half, else fp32. */
static inline __attribute__((always_inline)) int part_of(const float *q, int64_t heads, int64_t kv_heads, int64_t dim,
                                                         const void *k, const void *v, int64_t key_stride,
                                                         int64_t head_stride, const int64_t *index,
                                                         const int32_t *cu_q, const int32_t *cu_k, int64_t requests,
                                                         int64_t max_rows, float scale, int64_t first, int64_t last,
                                                         float *out, int half) {
    if (dim % 16 || dim > MAX_DIM || kv_heads <= 0 || heads % kv_heads) return -1;
    int64_t groups = heads / kv_heads, longest = 0;
    for (int64_t s = 0; s < requests; s++)
        if (cu_q[s + 1] * kv_heads > first && cu_q[s] * kv_heads < last && cu_k[s + 1] - cu_k[s] > longest)
            longest = cu_k[s + 1] - cu_k[s];
    float *p = scratch(ROWS * GROUP * (longest + 16));
    if (!p) return -3;
    for (int64_t s = 0; s < requests; s++) {
        int64_t q0 = cu_q[s], lq = cu_q[s + 1] - q0, lk = cu_k[s + 1] - cu_k[s];
        int64_t u0 = q0 * kv_heads, u1 = (q0 + lq) * kv_heads;
        if (lq > max_rows || u1 <= first || u0 >= last) continue;
        const int64_t *key = index + cu_k[s];
        for (int64_t g = 0; g < kv_heads; g++) {
            /* The request's rows i0 .. i1-1 whose part of KV head g, (q0 + i) * kv_heads + g, is one of these. */
            int64_t from = first - u0 - g, to = last - u0 - g;
            int64_t i0 = from <= 0 ? 0 : (from + kv_heads - 1) / kv_heads;
            int64_t i1 = to <= 0 ? 0 : (to + kv_heads - 1) / kv_heads;
            if (i1 > lq) i1 = lq;
            const void *kh = kv_row(k, g, head_stride, half), *vh = kv_row(v, g, head_stride, half);
            for (int64_t h = g * groups; h < (g + 1) * groups;) {
                int64_t left = (g + 1) * groups - h; /* query heads of this KV head from h on */
                int n = (int)(left < GROUP ? left : GROUP);
                for (int64_t i = i0; i < i1;) {
                    int64_t count = lk - lq + i + 1; /* row i's keys; the next row's one more */
                    int64_t at = ((q0 + i) * heads + h) * dim;
                    if (count <= 0) { /* no key to see (not in a step continuous batching builds) */
                        for (int64_t d = 0; d < n * dim; d++) out[at + d] = 0.0f;
                        i++;
                        continue;
                    }
                    int rows = (int)(i1 - i < rows_for(n) ? i1 - i : rows_for(n));
                    if (half)
                        attend_half(n, dim, rows, q + at, heads * dim, kh, vh, key, count, key_stride, scale, p,
                                    out + at);
                    else
                        attend_full(n, dim, rows, q + at, heads * dim, kh, vh, key, count, key_stride, scale, p,
                                    out + at);
                    i += rows;
                }
                h += n;
            }
        }
    }
    return 0;
}
#define PART_BODY(half)                                                                                             \
    part_of(q, heads, kv_heads, dim, k, v, key_stride, head_stride, index, cu_q, cu_k, requests, max_rows, scale,   \
            first, last, out, half)
#else
#define PART_BODY(half) ((void)q, (void)heads, (void)kv_heads, (void)dim, (void)k, (void)v, (void)key_stride,        \
                         (void)head_stride, (void)index, (void)cu_q, (void)cu_k, (void)requests, (void)max_rows,     \
                         (void)scale, (void)first, (void)last, (void)out, -2) /* built without AVX-512 or AVX2+FMA */
#endif

/* The parts first .. last-1 of a step's attention (part_of) over a KV cache of fp32 values. */
int ttft_attention_part(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const void *k, const void *v,
                        int64_t key_stride, int64_t head_stride, const int64_t *index, const int32_t *cu_q,
                        const int32_t *cu_k, int64_t requests, int64_t max_rows, float scale, int64_t first,
                        int64_t last, float *out) {
    return PART_BODY(0);
}

/* The same over a KV cache of fp16 values (TTFT_KV_DTYPE=f16), strides counted in values. */
int ttft_attention_part_f16(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const void *k,
                            const void *v, int64_t key_stride, int64_t head_stride, const int64_t *index,
                            const int32_t *cu_q, const int32_t *cu_k, int64_t requests, int64_t max_rows, float scale,
                            int64_t first, int64_t last, float *out) {
    return PART_BODY(1);
}
#undef PART_BODY

/* The whole step's attention: every part of out (but those of requests of more than max_rows rows). */
int ttft_paged_attention(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const void *k, const void *v,
                         int64_t key_stride, int64_t head_stride, const int64_t *index, const int32_t *cu_q,
                         const int32_t *cu_k, int64_t requests, int64_t max_rows, float scale, float *out) {
    int64_t parts = requests > 0 ? cu_q[requests] * kv_heads : 0;
    return ttft_attention_part(q, heads, kv_heads, dim, k, v, key_stride, head_stride, index, cu_q, cu_k, requests,
                               max_rows, scale, 0, parts, out);
}

/* The same over a KV cache of fp16 values. */
int ttft_paged_attention_f16(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const void *k,
                             const void *v, int64_t key_stride, int64_t head_stride, const int64_t *index,
                             const int32_t *cu_q, const int32_t *cu_k, int64_t requests, int64_t max_rows, float scale,
                             float *out) {
    int64_t parts = requests > 0 ? cu_q[requests] * kv_heads : 0;
    return ttft_attention_part_f16(q, heads, kv_heads, dim, k, v, key_stride, head_stride, index, cu_q, cu_k,
                                   requests, max_rows, scale, 0, parts, out);
}

/* The kernel's library calls these functions through kernel.h's pointer types: they must agree. */
_Static_assert(__builtin_types_compatible_p(__typeof__(&ttft_paged_attention), ttft_attention_fn),
               "ttft_paged_attention is not what kernel.h's ttft_attention_fn points to");
_Static_assert(__builtin_types_compatible_p(__typeof__(&ttft_paged_attention_f16), ttft_attention_fn),
               "ttft_paged_attention_f16 is not what kernel.h's ttft_attention_fn points to");
_Static_assert(__builtin_types_compatible_p(__typeof__(&ttft_attention_part), ttft_attention_part_fn),
               "ttft_attention_part is not what kernel.h's ttft_attention_part_fn points to");
_Static_assert(__builtin_types_compatible_p(__typeof__(&ttft_attention_part_f16), ttft_attention_part_fn),
               "ttft_attention_part_f16 is not what kernel.h's ttft_attention_part_fn points to");
