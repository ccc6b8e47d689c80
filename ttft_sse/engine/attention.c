/* Attention of a batched step, request by request, over keys and values read in place from the paged KV cache; and
   of the single-request engine's calls, over its dense cache (ttft_sse/engine/attention.py builds it and calls it).

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
   out = sum p_j v_j / sum p_j, in fp32. AVX-512 only (returns -2 without it: the caller keeps the library's path);
   dim must be a multiple of 16, up to 256 (else -1). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#define MAX_DIM 256

static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f)); /* exp(-87) ~ 1.6e-38, near fp32's smallest normal: adds nothing */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* x - n ln 2, in two parts */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* r[i] = the sum of a[i]'s 16 lanes, for 16 vectors at once (a transpose as it adds). */
static inline __m512 sums16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

#define GROUP 4 /* query heads that share a KV head, attended together: each key and value row is read once */

/* One query row, for query heads q[0..heads-1] (rows of dim = 16 * parts floats, dim apart) that share one KV
   head, against keys key[0..count-1] (row numbers into k and v); p: GROUP x (count rounded up to 16) floats of
   room. Inlined with constant heads and parts (see attend), so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_n(int heads, int64_t parts, const float *q, const float *k,
                                                           const float *v, const int64_t *key, int64_t count,
                                                           int64_t stride, float scale, float *p, float *out) {
    int64_t dim = 16 * parts, room = (count + 15) / 16 * 16;
    if (count <= 0) { /* no key to see (not in a step continuous batching builds) */
        for (int64_t d = 0; d < heads * dim; d++) out[d] = 0.0f;
        return;
    }
    __m512 scales = _mm512_set1_ps(scale), part[GROUP][16];
    for (int64_t j0 = 0; j0 < room; j0 += 16) {
        for (int l = 0; l < 16; l++) {
            if (j0 + l >= count) {
                for (int h = 0; h < heads; h++) part[h][l] = _mm512_setzero_ps();
                continue;
            }
            const float *kr = k + key[j0 + l] * stride;
            for (int h = 0; h < heads; h++) {
                const float *qh = q + h * dim;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kr));
                for (int64_t d = 16; d < dim; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), _mm512_loadu_ps(kr + d), acc);
                part[h][l] = acc;
            }
        }
        for (int h = 0; h < heads; h++) _mm512_storeu_ps(p + h * room + j0, _mm512_mul_ps(sums16(part[h]), scales));
    }
    float inverse[GROUP];
    for (int h = 0; h < heads; h++) {
        float *ph = p + h * room;
        __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < room; j += 16) {
            __mmask16 live = count - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - j)) - 1);
            top = _mm512_mask_max_ps(top, live, top, _mm512_loadu_ps(ph + j));
        }
        __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        for (int64_t j = 0; j < room; j += 16) {
            __mmask16 live = count - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - j)) - 1);
            __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(ph + j), max)));
            _mm512_storeu_ps(ph + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        inverse[h] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    __m512 acc[GROUP][MAX_DIM / 16];
    for (int h = 0; h < heads; h++)
        for (int64_t d = 0; d < parts; d++) acc[h][d] = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; j++) {
        const float *vr = v + key[j] * stride;
        for (int64_t d = 0; d < parts; d++) {
            __m512 x = _mm512_loadu_ps(vr + 16 * d);
            for (int h = 0; h < heads; h++) acc[h][d] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * room + j]), x, acc[h][d]);
        }
    }
    for (int h = 0; h < heads; h++) {
        __m512 scaled = _mm512_set1_ps(inverse[h]);
        for (int64_t d = 0; d < parts; d++) _mm512_storeu_ps(out + h * dim + 16 * d, _mm512_mul_ps(acc[h][d], scaled));
    }
}

static void attend(int heads, int64_t dim, const float *q, const float *k, const float *v, const int64_t *key,
                   int64_t count, int64_t stride, float scale, float *p, float *out) {
#define ATTEND(h, parts) attend_n(h, parts, q, k, v, key, count, stride, scale, p, out)
    switch (heads * 100 + dim / 16) {
    case 104: ATTEND(1, 4); break;
    case 204: ATTEND(2, 4); break;
    case 304: ATTEND(3, 4); break;
    case 404: ATTEND(4, 4); break;
    case 108: ATTEND(1, 8); break;
    case 208: ATTEND(2, 8); break;
    case 308: ATTEND(3, 8); break;
    case 408: ATTEND(4, 8); break;
    default: ATTEND(heads, dim / 16);
    }
#undef ATTEND
}

int ttft_paged_attention(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const float *k,
                         const float *v, int64_t key_stride, int64_t head_stride, const int64_t *index,
                         const int32_t *cu_q, const int32_t *cu_k, int64_t requests, int64_t max_rows, float scale,
                         float *out) {
    if (dim % 16 || dim > MAX_DIM || kv_heads <= 0 || heads % kv_heads) return -1;
    int64_t groups = heads / kv_heads, longest = 0;
    for (int64_t s = 0; s < requests; s++)
        if (cu_k[s + 1] - cu_k[s] > longest) longest = cu_k[s + 1] - cu_k[s];
    float *p = malloc((size_t)GROUP * (size_t)(longest + 16) * sizeof(float));
    if (!p) return -3;
    for (int64_t s = 0; s < requests; s++) {
        int64_t q0 = cu_q[s], lq = cu_q[s + 1] - q0, lk = cu_k[s + 1] - cu_k[s];
        if (lq > max_rows) continue;
        const int64_t *key = index + cu_k[s];
        for (int64_t i = 0; i < lq; i++) {
            int64_t count = lk - lq + i + 1;
            for (int64_t h = 0; h < heads;) {
                int64_t left = groups - h % groups; /* query heads of this KV head from h on */
                int n = (int)(left < GROUP ? left : GROUP);
                int64_t at = ((q0 + i) * heads + h) * dim, kv = (h / groups) * head_stride;
                attend(n, dim, q + at, k + kv, v + kv, key, count, key_stride, scale, p, out + at);
                h += n;
            }
        }
    }
    free(p);
    return 0;
}
#else
int ttft_paged_attention(const float *q, int64_t heads, int64_t kv_heads, int64_t dim, const float *k,
                         const float *v, int64_t key_stride, int64_t head_stride, const int64_t *index,
                         const int32_t *cu_q, const int32_t *cu_k, int64_t requests, int64_t max_rows, float scale,
                         float *out) {
    (void)q, (void)heads, (void)kv_heads, (void)dim, (void)k, (void)v, (void)key_stride, (void)head_stride;
    (void)index, (void)cu_q, (void)cu_k, (void)requests, (void)max_rows, (void)scale, (void)out;
    return -2; /* built without AVX-512 */
}
#endif
