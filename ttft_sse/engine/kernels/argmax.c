/* The greedy pick of a batched step: each row's argmax over the vocabulary (ttft_sse/engine/kernels/argmax.py builds it
   and calls it). torch's CPU argmax reads one value at a time; here a row is read twice, 16 (AVX-512) or 8 (AVX2)
   values at a time: its largest value, then the first place that holds it.

   The rule is torch.argmax's, so that an answer does not depend on which of the two picked its tokens: the first
   index of the largest value (-0.0 and 0.0 are equal, so the first of them), and if the row holds a NaN, the first
   NaN; a row of -inf gives 0. A comparison is exact, so the same rule gives the same index. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* The first index of row x (n floats) holding `top`, a value of x that is not NaN. */
static int64_t first_of(const float *x, int64_t n, float top) {
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 want = _mm512_set1_ps(top);
    for (; i + 16 <= n; i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), want, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#elif defined(__AVX2__)
    __m256 want = _mm256_set1_ps(top);
    for (; i + 8 <= n; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), want, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == top) return i;
    return 0; /* not reached: top is one of x's values */
}

/* The first index of a NaN in row x, or -1 if it holds none. */
static int64_t first_nan(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (isnan(x[i])) return i;
    return -1;
}

/* Row x's argmax (n >= 1), by the rule above. */
static int64_t argmax_row(const float *x, int64_t n) {
    float top = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 most = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        most = _mm512_max_ps(most, v);
    }
    nan = unordered != 0;
    top = _mm512_reduce_max_ps(most);
#elif defined(__AVX2__)
    __m256 most = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        most = _mm256_max_ps(most, v);
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#endif
    for (; i < n; i++) {
        if (isnan(x[i])) nan = 1;
        else if (x[i] > top) top = x[i];
    }
    if (nan) return first_nan(x, n);
    return first_of(x, n, top);
}

/* out[r] = the argmax of row r of x (`rows` rows of n floats, `stride` floats apart). Returns 0, or -1 if n < 1. */
int ttft_argmax(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    if (n < 1) return -1;
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, n);
    return 0;
}
