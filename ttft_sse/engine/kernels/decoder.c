/* A decoder layer's arithmetic around its attention, for CPU (ttft_sse/engine/library/decoder.py builds it with
   kernel.c).

   A Llama decoder layer is, for each row x (hidden values):
     h = norm(x);  q, k, v = h.Wq, h.Wk, h.Wv;  q, k = rotary(q), rotary(k)       (ttft_decoder_head)
     attention, by the library's cache and the engine's attention function        (not here)
     x = x + a.Wo;  h = norm(x);  x = x + (silu(h.Wg) * h.Wu).Wd                  (ttft_decoder_tail)
   with norm(x) = w * (x * (1 / sqrt(mean(x^2) + eps))) and silu(g) = g / (1 + exp(-g)). Other families add parts,
   each where its pointer in struct layer is not NULL (decoder.py's Family says which):
     Qwen 2:   q, k, v = h.Wq + bq, h.Wk + bk, h.Wv + bv
     Qwen 3:   q, k = norm(q), norm(k) over each head (weights of dim values), before the rotary embedding
     Gemma 3:  the same head norms; x = x + norm(a.Wo) and x = x + norm((gelu(h.Wg) * h.Wu).Wd), with
               gelu(g) = g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))); its norms' weights are 1 + w (decoder.py
               hands them over so: the same fp32 value Gemma's norm multiplies by). In a batched step over a
   paged KV cache read in place, ttft_decoder_layer does all three in one call: the head, the new keys and values
   written into the cache's rows, the attention by attention.c's function (handed over as a pointer: it is built into
   its own library), the tail; and ttft_decoder_stack runs a step's layers one after another in one call, stopping
   between two of them when a newcomer waits (stack.py's run_layers).

   Every linear layer is the block kernel's (kernel.c), on the layer's GGUF blocks, with fp32 rows or rows quantised
   to int8. Each step is one row's own arithmetic, so a row's result does not depend on the other rows of the call, as
   with the kernel alone. The rotary embedding and the sums are the same operations, rounded the same way, as
   transformers' torch code; the norm's mean sums in another order, and exp is Cephes' polynomial (within 2 ulp of
   exp), so the results are within roundings of the library's layer (decoder.py checks them against it at load; with
   int8 rows a rounding can move a value across a step, by 1/127 of its block's largest). Built with
   -ffp-contract=off: only written fused multiply-adds fuse, and this file writes none. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h" /* fp32 rounded to fp16 in plain C, for a build without F16C */
#include "kernel.h"

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));

static inline vf splat(float x) { return (vf){0} + x; }
static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf pick(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* exp(x) for x in [-87, 88] (clamped there; outside, silu is 0 or x to fp32 precision): Cephes' expf, the
   polynomial of degree 7 on r = x - n ln2 (n = x / ln2 rounded to nearest), times 2^n built in the exponent. */
static inline vf exp_(vf x) {
    x = pick(x > splat(88.0f), splat(88.0f), x);
    x = pick(x < splat(-87.0f), splat(-87.0f), x);
    const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, held in the low bits */
    vf t = x * splat(1.44269504088896341f) + splat(round);
    vf n = t - splat(round);
    vi whole = (vi)t - (vi)splat(round);
    vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    vf y = p * (r * r) + r + splat(1.0f);
    return y * (vf)((whole + 127) << 23);
}

/* gelu(g), tanh's approximation as torch computes it, with tanh(t) = 1 - 2 / (exp(2t) + 1). */
static inline vf gelu_(vf g) {
    vf inner = splat(0.7978845608028654f) * (g + splat(0.044715f) * (g * g * g));
    vf tanh = splat(1.0f) - splat(2.0f) / (exp_(inner + inner) + splat(1.0f));
    return splat(0.5f) * g * (splat(1.0f) + tanh);
}

/* g[i] = gelu(g[i]) * u[i], i < n. Returns 0. */
int ttft_gelu_mul(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) store(g + i, gelu_(load(g + i)) * load(u + i));
    if (i < n) {
        float a[LANES] = {0}, b[LANES] = {0};
        memcpy(a, g + i, sizeof(float) * (n - i));
        memcpy(b, u + i, sizeof(float) * (n - i));
        store(a, gelu_(load(a)) * load(b));
        memcpy(g + i, a, sizeof(float) * (n - i));
    }
    return 0;
}

/* g[i] = silu(g[i]) * u[i], i < n. Returns 0. */
int ttft_silu_mul(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf a = load(g + i);
        store(g + i, a / (splat(1.0f) + exp_(-a)) * load(u + i));
    }
    if (i < n) { /* the tail, through a padded vector */
        float a[LANES] = {0}, b[LANES] = {0};
        memcpy(a, g + i, sizeof(float) * (n - i));
        memcpy(b, u + i, sizeof(float) * (n - i));
        vf s = load(a);
        store(a, s / (splat(1.0f) + exp_(-s)) * load(b));
        memcpy(g + i, a, sizeof(float) * (n - i));
    }
    return 0;
}

/* y = norm(x) for M rows of n values (y may be x). */
static void norm(const float *x, int64_t M, int64_t n, const float *w, float eps, float *y) {
    for (int64_t r = 0; r < M; r++) {
        const float *a = x + r * n;
        float *b = y + r * n;
        vf acc = splat(0.0f);
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) acc += load(a + i) * load(a + i);
        float sum = 0.0f;
        for (int j = 0; j < LANES; j++) sum += acc[j];
        for (; i < n; i++) sum += a[i] * a[i];
        float inverse = 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(sum / (float)n + eps)));
        for (i = 0; i < n; i++) b[i] = w[i] * (a[i] * inverse);
    }
}

/* q[r, h, :] = q * cos[r] + rotate_half(q) * sin[r] for every head h, with rotate_half(q) = (-q2, q1). */
static void rotary(float *q, int64_t M, int64_t heads, int64_t dim, const float *cos, const float *sin) {
    int64_t half = dim / 2;
    float turned[512];
    for (int64_t r = 0; r < M; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = q + (r * heads + h) * dim;
            for (int64_t i = 0; i < half; i++) turned[i] = -v[i + half];
            for (int64_t i = half; i < dim; i++) turned[i] = v[i - half];
            for (int64_t i = 0; i < dim; i++) v[i] = v[i] * c[i] + turned[i] * s[i];
        }
    }
}

struct linear { /* a layer in the block kernel's layout */
    const uint8_t *codes; /* fp32 rows: kernel.py's panels, with scale and zero; int8 rows: its records */
    const float *scale, *zero;
    int64_t inputs, outputs, bits;
    int64_t int8; /* rows quantised to int8 (TTFT_GGUF_ACTIVATIONS=int8) */
};

struct layer { /* decoder.py's Layer */
    int64_t hidden, heads, kv_heads, dim, intermediate;
    double eps;
    const float *input_norm, *post_norm; /* weights */
    struct linear q, k, v, o, gate, up, down;
    /* q, k and v side by side, and gate and up (kernel.py's join: the same panels, so each output the same bits),
       one call each instead of three and two: a call shared with the kernel's helpers costs its rows' copy and a
       start whatever its size. codes NULL: not joined, the layers one by one. */
    struct linear qkv, gate_up;
    /* A family's extra parts (the file's head), NULL or 0 where it has none. */
    const float *q_bias, *k_bias, *v_bias; /* Qwen 2 */
    const float *q_norm, *k_norm;          /* Qwen 3, Gemma 3: each head's norm weights (dim values) */
    const float *attention_norm, *mlp_norm; /* Gemma 3: the norms of a.Wo and of the MLP's output */
    int64_t gelu;                          /* Gemma 3: gelu(g) * u, not silu(g) * u */
};

static void add_bias(float *y, int64_t M, int64_t n, const float *b) {
    if (b == NULL) return;
    for (int64_t r = 0; r < M; r++)
        for (int64_t i = 0; i < n; i++) y[r * n + i] = y[r * n + i] + b[i];
}

static int multiply(const struct linear *l, const float *x, int64_t M, float *y) {
    if (l->int8) return ttft_q8_linear(x, M, l->inputs, l->codes, (int)l->bits, l->outputs, y);
    return ttft_blocks_linear(x, M, l->inputs, l->codes, (int)l->bits, l->scale, l->zero, l->outputs, y);
}

/* One buffer a thread, kept (kernel.c's ttft_grow). Calls take their rows CHUNK at a time, so that it stays small
   whatever a prompt's length; chunks of this size cost no more than whole calls. */
#define CHUNK 64

static float *scratch(int64_t floats) {
    static _Thread_local struct ttft_buffer kept = {NULL, 0};
    return ttft_grow(&kept, floats);
}

/* Returns 0, -1 if a buffer cannot be allocated or the kernel refuses a layer, -2 for a head over 512 values. */
int ttft_decoder_head(const struct layer *L, const float *x, int64_t M, const float *cos, const float *sin, float *q,
                      float *k, float *v) {
    if (L->dim > 512) return -2;
    int64_t H = L->hidden, Q = L->heads * L->dim, KV = L->kv_heads * L->dim, J = Q + 2 * KV;
    float *h = scratch(CHUNK * (H + J)), *t = h + CHUNK * H; /* t: the joined call's rows, q k v side by side */
    if (h == NULL) return -1;
    for (int64_t r = 0; r < M; r += CHUNK) {
        int64_t m = M - r < CHUNK ? M - r : CHUNK;
        norm(x + r * H, m, H, L->input_norm, (float)L->eps, h);
        if (L->qkv.codes != NULL) {
            if (multiply(&L->qkv, h, m, t)) return -1;
            for (int64_t i = 0; i < m; i++) {
                memcpy(q + (r + i) * Q, t + i * J, sizeof(float) * (size_t)Q);
                memcpy(k + (r + i) * KV, t + i * J + Q, sizeof(float) * (size_t)KV);
                memcpy(v + (r + i) * KV, t + i * J + Q + KV, sizeof(float) * (size_t)KV);
            }
        } else if (multiply(&L->q, h, m, q + r * Q) || multiply(&L->k, h, m, k + r * KV) ||
                   multiply(&L->v, h, m, v + r * KV))
            return -1;
        add_bias(q + r * Q, m, Q, L->q_bias);
        add_bias(k + r * KV, m, KV, L->k_bias);
        add_bias(v + r * KV, m, KV, L->v_bias);
        if (L->q_norm != NULL) norm(q + r * Q, m * L->heads, L->dim, L->q_norm, (float)L->eps, q + r * Q);
        if (L->k_norm != NULL) norm(k + r * KV, m * L->kv_heads, L->dim, L->k_norm, (float)L->eps, k + r * KV);
        rotary(q + r * Q, m, L->heads, L->dim, cos + r * L->dim, sin + r * L->dim);
        rotary(k + r * KV, m, L->kv_heads, L->dim, cos + r * L->dim, sin + r * L->dim);
    }
    return 0;
}

/* out = the layer's output for rows x, given a (the attention's output, heads x dim a row). */
int ttft_decoder_tail(const struct layer *L, const float *x, const float *a, int64_t M, float *out) {
    int64_t H = L->hidden, I = L->intermediate, A = L->heads * L->dim;
    int64_t D = H > I ? H : I; /* d's room: the down layer's outputs */
    float *h = scratch(CHUNK * (H + 4 * I + D));
    if (h == NULL) return -1;
    float *g = h + CHUNK * H, *u = g + CHUNK * I, *d = u + CHUNK * I, *t = d + CHUNK * D; /* t: gate, up joined */
    for (int64_t r = 0; r < M; r += CHUNK) {
        int64_t m = M - r < CHUNK ? M - r : CHUNK;
        float *y = out + r * H;
        const float *xr = x + r * H;
        if (multiply(&L->o, a + r * A, m, y)) return -1;
        if (L->attention_norm != NULL) norm(y, m, H, L->attention_norm, (float)L->eps, y);
        for (int64_t i = 0; i < m * H; i++) y[i] = xr[i] + y[i];
        norm(y, m, H, L->post_norm, (float)L->eps, h);
        if (L->gate_up.codes != NULL) {
            if (multiply(&L->gate_up, h, m, t)) return -1;
            for (int64_t i = 0; i < m; i++) {
                memcpy(g + i * I, t + i * 2 * I, sizeof(float) * (size_t)I);
                memcpy(u + i * I, t + i * 2 * I + I, sizeof(float) * (size_t)I);
            }
        } else if (multiply(&L->gate, h, m, g) || multiply(&L->up, h, m, u))
            return -1;
        if (L->gelu)
            ttft_gelu_mul(g, u, m * I);
        else
            ttft_silu_mul(g, u, m * I);
        if (multiply(&L->down, g, m, d)) return -1;
        if (L->mlp_norm != NULL) norm(d, m, H, L->mlp_norm, (float)L->eps, d);
        for (int64_t i = 0; i < m * H; i++) y[i] = y[i] + d[i];
    }
    return 0;
}

struct step { /* decoder.py's Step: what the layers of a batched step share (attention.py's Step) */
    ttft_attention_fn attend; /* attention.c's function for the cache's values (fp32, or fp16: its _f16 one) */
    ttft_attention_part_fn attend_part; /* NULL: never shared */
    const int64_t *write; /* the cache row of each new row's key and value */
    const int64_t *index; /* the keys the attention reads, request after request */
    const int32_t *cu_q, *cu_k;
    int64_t requests, key_stride, head_stride, max_rows; /* strides in values: a cache row, a KV head */
    int64_t half;                                       /* the cache holds fp16 values (TTFT_KV_DTYPE=f16), else fp32 */
    float scale;
};

/* n fp32 values into the cache: as they are, or rounded to the nearest fp16 (ties to even, as torch's
   .to(torch.float16) and F16C's conversion round; half.h's plain C on a build without F16C). Returns 0. Exported for
   decoder.py's tests of each build's rounding. */
int ttft_kv_write(void *to, const float *from, int64_t n, int64_t half) {
    if (!half) {
        memcpy(to, from, sizeof(float) * (size_t)n);
        return 0;
    }
    uint16_t *h = to;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(h + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) h[i] = float_half(from[i]);
    return 0;
}

/* One buffer a thread for the rows' q, k, v and attention, kept. */
static float *rows_scratch(int64_t floats) {
    static _Thread_local struct ttft_buffer kept = {NULL, 0};
    return ttft_grow(&kept, floats);
}

/* out = the layer's output for rows x in a batched step: the head; each row's key and value into the cache rows
   keys and values (the layer's: [slots, kv_heads, dim] with S's strides, fp32 values or fp16 ones) at S->write;
   the attention over the keys S->index names; the tail. The same arithmetic as the head, the library's update (a
   copy, or a conversion to fp16) and attention.c's function called one after the other. Returns 0, the head's or
   the tail's error, or -3 if the attention fails. */
int ttft_decoder_layer(const struct layer *L, const struct step *S, const float *x, int64_t M, const float *cos,
                       const float *sin, void *keys, void *values, float *out) {
    int64_t Q = L->heads * L->dim, KV = L->kv_heads * L->dim;
    float *q = rows_scratch(M * (2 * Q + 2 * KV));
    if (q == NULL) return -1;
    float *k = q + M * Q, *v = k + M * KV, *a = v + M * KV;
    int status = ttft_decoder_head(L, x, M, cos, sin, q, k, v);
    if (status != 0) return status;
    size_t size = S->half ? 2 : 4; /* a value's bytes in the cache */
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < L->kv_heads; g++) {
            size_t at = (size_t)(S->write[r] * S->key_stride + g * S->head_stride) * size;
            ttft_kv_write((char *)keys + at, k + r * KV + g * L->dim, L->dim, S->half);
            ttft_kv_write((char *)values + at, v + r * KV + g * L->dim, L->dim, S->half);
        }
    status = ttft_share_attention(S->attend_part, q, L->heads, L->kv_heads, L->dim, keys, values, S->key_stride,
                                  S->head_stride, S->index, S->cu_q, S->cu_k, S->requests, S->max_rows, S->scale, a);
    if (status == 1) /* not shared: alone */
        status = S->attend(q, L->heads, L->kv_heads, L->dim, keys, values, S->key_stride, S->head_stride, S->index,
                           S->cu_q, S->cu_k, S->requests, S->max_rows, S->scale, a);
    if (status != 0) return -3;
    return ttft_decoder_tail(L, x, a, M, out);
}

struct stack { /* decoder.py's Stack: a batched step's layers, in order */
    int64_t count;
    const struct layer *const *layers;
    const struct step *const *steps; /* each layer's */
    void *const *keys, *const *values;  /* each layer's cache rows (fp32 or fp16 values: its step's half) */
    const volatile int32_t *waiting;    /* nonzero: a newcomer waits (the interludes' flag); NULL: never */
    const float *const *cos, *const *sin; /* each layer's rotary embedding (Gemma 3's two kinds); NULL: the call's */
};

/* One buffer a thread for the rows between two layers of a stack (two halves, in turn), kept. */
static float *stack_scratch(int64_t floats) {
    static _Thread_local struct ttft_buffer kept = {NULL, 0};
    return ttft_grow(&kept, floats);
}

/* Layers from .. count-1 of S, each ttft_decoder_layer on the previous one's output (x for the first), the last
   one's output into out (which may be x). Before each layer after the first, a nonzero *waiting stops it: out
   then holds the output of the layers done, and it returns the layer it stopped before, for the caller to go on
   from there. Returns count once all are done, or the error of a layer (negative: ttft_decoder_layer's, or -1 if
   a buffer cannot be allocated). The same calls as the layers one by one, so the same bits. */
int ttft_decoder_stack(const struct stack *S, int64_t from, const float *x, int64_t M, const float *cos,
                       const float *sin, float *out) {
    if (from >= S->count || M <= 0) { /* nothing to compute: out is x */
        if (M > 0 && S->count > 0 && out != x) memcpy(out, x, sizeof(float) * (size_t)(M * S->layers[0]->hidden));
        return (int)S->count;
    }
    int64_t H = S->layers[0]->hidden;
    float *halves = stack_scratch(2 * M * H);
    if (halves == NULL) return -1;
    const float *in = x;
    float *next = halves;
    int64_t i = from;
    for (; i < S->count; i++) {
        if (i > from && S->waiting != NULL && *S->waiting != 0) break;
        const float *c = S->cos == NULL ? cos : S->cos[i], *s = S->sin == NULL ? sin : S->sin[i];
        int status = ttft_decoder_layer(S->layers[i], S->steps[i], in, M, c, s, S->keys[i], S->values[i], next);
        if (status != 0) return status;
        in = next;
        next = next == halves ? halves + M * H : halves;
    }
    if (in != out) memcpy(out, in, sizeof(float) * (size_t)(M * H));
    return (int)i;
}
