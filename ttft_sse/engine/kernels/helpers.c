/* Helper threads: the other cores' idle time for the block kernel (ttft_helper_start), built into its library
   beside kernel.c (ttft_sse/engine/kernels/kernel.py).

   A call of at least SHARE_WORK multiply-adds is cut into chunks of whole panels. The calling thread takes chunks
   from the first up, each helper from the last down, each chunk claimed by a compare-and-swap on its state, until
   they meet. A helper computes into its own buffer, and the caller copies its chunks into y: a helper never writes
   the caller's memory, and it reads the rows from the share's own copy. The caller never waits on a helper that
   does not run: helpers run at SCHED_IDLE, so any other task of the machine (the prefill process, the event loop,
   a client) takes the core from them at once, and a chunk a helper holds longer than twice the caller's own time
   a chunk is taken back and computed by the caller (the helper's result is then dropped). Each chunk is computed
   by the same code whoever computes it, and an output's arithmetic does not depend on how the panels are split (the
   rows' blocks' sums are taken once, with the share's copy of the rows), so the results are the same bits shared
   or not.
   The weights a helper may still be reading (a chunk taken back from it) must outlive its chunk: whoever frees
   weights calls ttft_helper_fence first (kernel.py's layers do, as they go). The share's copy of the rows grows
   only while no helper is inside a chunk (a call that finds one there runs alone rather than wait), and a helper's
   buffer holds a whole output, so calls of more than SHARE_OUTPUTS outputs run alone. A forked child starts with
   no helpers and shares nothing until it starts its own.
   A batched step's attention (decoder.c) is shared the same way, by parts of query rows and KV heads (attention.c's
   ttft_attention_part: each head of each row computed from its own inputs alone): the helpers read the share's
   copies of the queries and of the step's key index, and the layer's KV cache, which lives as long as the engine
   (whoever frees it fences first).
   Since a helper still inside a taken-back attention chunk could read a key index rewritten under it, an
   attention call is shared only while no helper is inside an attention chunk. */

#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "blocks.h"
#include "kernel.h"

#define HELPERS 8                /* at most */
#define SHARE_CHUNKS 1024        /* chunks a call at most (larger chunks beyond) */
#define SHARE_WORK (1 << 18)     /* multiply-adds a call needs to be shared */
#define SHARE_OUTPUTS (1 << 23)  /* outputs a call at most (a helper's buffer holds them: 32 MiB) */
#define CHUNK_WORK (1 << 16)     /* multiply-adds a chunk at least */
#define SPIN_NS 500000           /* a helper polls this long for the next call before it sleeps */
#define TAKE_BACK_NS 20000       /* the caller's patience, at least, for a chunk a helper holds */

enum { FREE, CALLERS, HELD, READY, TAKEN }; /* a chunk's state: the low 3 bits, its helper above them, the call's
                                               generation from bit 8 */

struct attention {
    ttft_attention_part_fn part;
    const void *k, *v;        /* the layer's KV cache rows (fp32 or fp16 values: part's) */
    const int64_t *index;     /* the share's copy of the step's key index */
    const int32_t *cu_q, *cu_k; /* the share's copies */
    int64_t heads, kv_heads, dim, key_stride, head_stride, requests, max_rows;
    float scale;
};

enum { LINEAR, ATTENTION };

struct job {
    int kind, int8;
    const float *rows; /* the share's copy: fp32 rows, or the rows quantised (q8_floats floats); the queries */
    int64_t M, K, N, panels, per, chunks; /* attention: M parts of N floats, a chunk `per` parts */
    const uint8_t *codes;                 /* panels, or int8 records */
    int bits;
    const float *scale, *zero;
    struct attention a;
};

static struct {
    pthread_mutex_t starting;
    _Atomic int helpers;
    int forks_reset; /* forked is registered */
    atomic_flag busy;     /* a caller holds the job */
    _Atomic uint64_t gen; /* odd while the job is being written */
    _Atomic uint32_t bell;
    _Atomic int sleeping, in_chunk, in_attention; /* helpers inside a chunk; inside an attention chunk */
    struct job job;
    struct ttft_buffer rows, keys; /* keys: the step's key index and request starts (attention) */
    float *_Atomic out[HELPERS];
    _Atomic uint64_t state[SHARE_CHUNKS];
    _Atomic int64_t calls, by_caller, by_helpers, taken, pause_us, leave_us;
} share = {.starting = PTHREAD_MUTEX_INITIALIZER, .busy = ATOMIC_FLAG_INIT};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void sleep_ns(int64_t ns) {
    struct timespec t = {ns / 1000000000, ns % 1000000000};
    nanosleep(&t, NULL);
}

/* The end of chunk c, whose first unit (an attention part, or a panel) is c * j->per, among `units`. */
static int64_t chunk_end(const struct job *j, int64_t c, int64_t units) {
    return (c + 1) * j->per < units ? (c + 1) * j->per : units;
}

/* Chunk c's panels of y (the caller's output, or a helper's buffer laid out as it); an attention chunk's rows.
   Returns 0, or an attention call's error. */
static int run_chunk(const struct job *j, int64_t c, float *y, float *buffer) {
    if (j->kind == ATTENTION) {
        const struct attention *a = &j->a;
        return a->part(j->rows, a->heads, a->kv_heads, a->dim, a->k, a->v, a->key_stride, a->head_stride, a->index,
                       a->cu_q, a->cu_k, a->requests, a->max_rows, a->scale, c * j->per, chunk_end(j, c, j->M), y);
    }
    int64_t p0 = c * j->per, p1 = chunk_end(j, c, j->panels);
#if defined(Q_VNNI) || defined(Q_AVX2)
    if (j->int8) {
        q8_panels(q8_view((float *)j->rows, j->M, j->K), j->M, j->K, j->codes, j->bits, j->N, y, p0, p1);
        return 0;
    }
#endif
    fp32_panels(j->rows, j->rows + j->M * j->K, j->M, j->K, j->codes, j->bits, j->scale, j->zero, j->N, y, p0, p1,
                buffer); /* the rows' sums after them (share_run) */
    return 0;
}

/* Chunk c's outputs, computed into `from` (a helper's buffer, laid out as y), into y. */
static void copy_chunk(const struct job *j, int64_t c, const float *from, float *y) {
    if (j->kind == ATTENTION) {
        int64_t first = c * j->per, last = chunk_end(j, c, j->M);
        memcpy(y + first * j->N, from + first * j->N, sizeof(float) * (size_t)((last - first) * j->N));
        return;
    }
    int64_t first = c * j->per * P, last = chunk_end(j, c, j->panels) * P;
    if (last > j->N) last = j->N;
    for (int64_t r = 0; r < j->M; r++)
        memcpy(y + r * j->N + first, from + r * j->N + first, sizeof(float) * (size_t)(last - first));
}

/* Until no helper is inside a chunk (of a call that may have ended). A forked child has none (forked, below). */
static void fence(void) {
    while (atomic_load(&share.in_chunk) > 0) sleep_ns(20000);
}

int ttft_helper_fence(void) {
    fence();
    return 0;
}

static void *helper(void *arg) {
    int id = (int)(intptr_t)arg;
    struct sched_param none = {0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &none);
    struct ttft_buffer out = {NULL, 0};
    uint64_t seen = atomic_load(&share.gen);
    int64_t idle_since = now_ns();
    for (;;) {
        uint64_t g = atomic_load(&share.gen);
        if (g == seen || (g & 1)) {
            if (now_ns() - idle_since < SPIN_NS) {
                _mm_pause();
                continue;
            }
            uint32_t bell = atomic_load(&share.bell);
            atomic_fetch_add(&share.sleeping, 1);
            if (atomic_load(&share.gen) == seen) syscall(SYS_futex, &share.bell, FUTEX_WAIT_PRIVATE, bell, NULL, NULL, 0);
            atomic_fetch_sub(&share.sleeping, 1);
            idle_since = now_ns();
            continue;
        }
        struct job j;
        memcpy(&j, &share.job, sizeof j);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load(&share.gen) != g) continue; /* torn: written meanwhile */
        seen = g;
        float *mine = ttft_grow(&out, j.M * j.N), *buffer = NULL;
        if (mine == NULL || (j.kind == LINEAR && !j.int8 && fp32_buffer(j.M, j.K, &buffer) != 0))
            continue; /* the caller does it all */
        atomic_store(&share.out[id], mine);
        uint64_t tag = g << 8 | (uint64_t)id << 3;
        _Atomic int *inside = j.kind == ATTENTION ? &share.in_attention : NULL;
        for (int64_t c = j.chunks - 1; c >= 0; c--) {
            atomic_fetch_add(&share.in_chunk, 1);
            if (inside) atomic_fetch_add(inside, 1);
            uint64_t expect = g << 8 | FREE;
            if (!atomic_compare_exchange_strong(&share.state[c], &expect, tag | HELD)) {
                if (inside) atomic_fetch_sub(inside, 1);
                atomic_fetch_sub(&share.in_chunk, 1);
                if ((expect & 7) == CALLERS || expect >> 8 != g) break; /* met the caller, or the call ended */
                continue;                                                /* another helper's */
            }
            int64_t pause = atomic_load(&share.pause_us);
            if (pause > 0) sleep_ns(pause * 1000);
            expect = tag | HELD;
            if (run_chunk(&j, c, mine, buffer) == 0) /* else left HELD: the caller takes it back and computes it */
                atomic_compare_exchange_strong(&share.state[c], &expect, tag | READY); /* fails if taken back */
            if (inside) atomic_fetch_sub(inside, 1);
            atomic_fetch_sub(&share.in_chunk, 1);
        }
        idle_since = now_ns();
    }
    return NULL;
}

/* A forked child has none of its parent's helpers: it starts from nothing (and shares nothing until it starts
   its own). */
static void forked(void) {
    pthread_mutex_init(&share.starting, NULL);
    atomic_store(&share.helpers, 0);
    atomic_store(&share.in_chunk, 0);
    atomic_store(&share.in_attention, 0);
    atomic_store(&share.sleeping, 0);
    atomic_flag_clear(&share.busy);
    atomic_store(&share.gen, (atomic_load(&share.gen) + 1) & ~(uint64_t)1);
}

/* Starts `count` helper threads (at most HELPERS; more calls add none once started). Returns how many run, or -1
   if none could be started. */
int ttft_helper_start(int count) {
    pthread_mutex_lock(&share.starting);
    if (!share.forks_reset) share.forks_reset = pthread_atfork(NULL, NULL, forked) == 0;
    int running = atomic_load(&share.helpers);
    for (int id = running; id < count && id < HELPERS; id++) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, helper, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (failed) break;
        running = id + 1;
        atomic_store(&share.helpers, running);
    }
    pthread_mutex_unlock(&share.starting);
    return running > 0 ? running : -1;
}

/* out[0..4): calls shared, chunks computed by callers, by helpers, and taken back from helpers. */
int ttft_helper_stats(int64_t *out) {
    out[0] = atomic_load(&share.calls);
    out[1] = atomic_load(&share.by_caller);
    out[2] = atomic_load(&share.by_helpers);
    out[3] = atomic_load(&share.taken);
    return atomic_load(&share.helpers);
}

/* For tests: helpers sleep this long in every chunk they hold, so that the caller takes chunks back. */
int ttft_helper_pause(int64_t microseconds) {
    atomic_store(&share.pause_us, microseconds);
    return 0;
}

/* For tests: the caller leaves each call's last chunk to the helpers for up to this long, sleeping, so that a
   helper (at SCHED_IDLE) takes part even on a machine whose every core is busy; then it computes the chunk itself. */
int ttft_helper_leave(int64_t microseconds) {
    atomic_store(&share.leave_us, microseconds);
    return 0;
}

/* Runs the call j, cut into j.chunks, with the helpers: its inputs (x: the rows, quantised first for int8; or the
   queries, with the step's key index and request starts) copied into the share's buffers first. Returns 1 if it
   is not shared (another caller holds the job; an attention call while a helper is inside an attention chunk):
   the caller computes it alone; else 0, or -1 if a buffer cannot be allocated or a chunk fails. */
static int share_run(struct job j, const float *x, const int64_t *index, const int32_t *cu_q, const int32_t *cu_k,
                     float *y) {
    if (atomic_flag_test_and_set(&share.busy)) return 1;
    float *buffer = NULL;
    int attention = j.kind == ATTENTION;
    int64_t floats = attention ? j.M * j.N : j.int8 ? q8_floats(j.M, j.K) : j.M * j.K + j.M * (j.K / BLOCK);
    int64_t keys = attention ? cu_k[j.a.requests] : 0, key_floats = attention ? 2 * keys + 2 * (j.a.requests + 1) : 0;
    if ((share.rows.capacity < floats && atomic_load(&share.in_chunk) > 0) ||
        (attention && atomic_load(&share.in_attention) > 0)) {
        /* A helper may still read the share's copies (a chunk taken back from it): grow the rows, or rewrite (or
           grow) the key index, at a later call, not waiting. A helper in a linear chunk reads no key index. */
        atomic_flag_clear(&share.busy);
        return 1;
    }
    if ((!attention && !j.int8 && fp32_buffer(j.M, j.K, &buffer) != 0) ||
        (share.rows.capacity < floats && ttft_grow(&share.rows, floats) == NULL) ||
        (share.keys.capacity < key_floats && ttft_grow(&share.keys, key_floats) == NULL)) {
        atomic_flag_clear(&share.busy);
        return -1;
    }
    uint64_t g = atomic_load(&share.gen) + 1; /* odd: being written */
    atomic_store_explicit(&share.gen, g, memory_order_relaxed);
    atomic_thread_fence(memory_order_release); /* the odd generation before the job's stores */
    g += 1;
    if (attention) {
        int64_t *ix = (int64_t *)share.keys.floats;
        int32_t *starts = (int32_t *)(ix + keys);
        memcpy(ix, index, sizeof(int64_t) * (size_t)keys);
        memcpy(starts, cu_q, sizeof(int32_t) * (size_t)(j.a.requests + 1));
        memcpy(starts + j.a.requests + 1, cu_k, sizeof(int32_t) * (size_t)(j.a.requests + 1));
        j.a.index = ix, j.a.cu_q = starts, j.a.cu_k = starts + j.a.requests + 1;
    }
#if defined(Q_VNNI) || defined(Q_AVX2)
    if (j.int8)
        q8_quantise(x, j.M, j.K, share.rows.floats);
    else
#endif
    if (attention) {
        memcpy(share.rows.floats, x, sizeof(float) * (size_t)floats); /* the queries */
    } else { /* the fp32 rows, then their blocks' sums where the layer's zeros multiply them */
        memcpy(share.rows.floats, x, sizeof(float) * (size_t)(j.M * j.K));
        if (fp32_needs_sums(j.bits)) fp32_sums(x, j.M, j.K, share.rows.floats + j.M * j.K);
    }
    j.rows = share.rows.floats;
    share.job = j;
    for (int64_t c = 0; c < j.chunks; c++) atomic_store_explicit(&share.state[c], g << 8 | FREE, memory_order_relaxed);
    atomic_store(&share.gen, g);
    if (atomic_load(&share.sleeping) > 0) {
        atomic_fetch_add(&share.bell, 1);
        syscall(SYS_futex, &share.bell, FUTEX_WAKE_PRIVATE, HELPERS, NULL, NULL, 0);
    }
    int failed = 0;
    int64_t c = 0, start = now_ns(), leave_ns = atomic_load(&share.leave_us) * 1000;
    for (; c < j.chunks; c++) {
        uint64_t expect = g << 8 | FREE;
        if (c == j.chunks - 1 && leave_ns > 0) { /* tests: the last chunk waits for a helper first */
            int64_t waiting = now_ns();
            while (atomic_load(&share.state[c]) == expect && now_ns() - waiting < leave_ns) sleep_ns(50000);
            start += now_ns() - waiting; /* the caller's own time a chunk, without the wait */
        }
        if (!atomic_compare_exchange_strong(&share.state[c], &expect, g << 8 | CALLERS)) break;
        failed |= run_chunk(&j, c, y, buffer);
    }
    int64_t mine = c, patience = mine > 0 ? 2 * (now_ns() - start) / mine : 0;
    if (patience < TAKE_BACK_NS) patience = TAKE_BACK_NS;
    int64_t taken = 0;
    for (int64_t d = j.chunks - 1; d >= mine; d--) { /* the helpers' chunks, the last claimed last */
        uint64_t s = atomic_load(&share.state[d]);
        int64_t waiting = now_ns();
        while ((s & 7) == HELD && now_ns() - waiting < patience) {
            _mm_pause();
            s = atomic_load(&share.state[d]);
        }
        if ((s & 7) == HELD && atomic_compare_exchange_strong(&share.state[d], &s, (s & ~(uint64_t)7) | TAKEN)) {
            failed |= run_chunk(&j, d, y, buffer);
            taken++;
            continue;
        }
        copy_chunk(&j, d, atomic_load(&share.out[(s >> 3) & 31]), y); /* READY (a failed take: it just became so) */
    }
    atomic_fetch_add(&share.calls, 1);
    atomic_fetch_add(&share.by_caller, mine + taken);
    atomic_fetch_add(&share.by_helpers, j.chunks - mine - taken);
    atomic_fetch_add(&share.taken, taken);
    atomic_flag_clear(&share.busy);
    return failed ? -1 : 0;
}

/* A linear call, cut into chunks of whole panels (see share_run). */
static int share_call(struct job j, const float *x, float *y) {
    if (atomic_load(&share.helpers) == 0) return 1; /* none started, or a forked child's (forked: reset) */
    j.panels = (j.N + P - 1) / P;
    if (j.M * j.K * j.N < SHARE_WORK || j.panels < 2 || j.M * j.N > SHARE_OUTPUTS) return 1;
    int64_t panel_work = j.M * j.K * P;
    j.per = (CHUNK_WORK + panel_work - 1) / panel_work;
    j.per = (j.per + GROUP - 1) / GROUP * GROUP; /* whole groups: the buffered tiles' and int8 tiles' width */
    while ((j.panels + j.per - 1) / j.per > SHARE_CHUNKS) j.per *= 2;
    j.chunks = (j.panels + j.per - 1) / j.per;
    if (j.chunks < 2) return 1;
    return share_run(j, x, NULL, NULL, NULL, y);
}

/* A batched step's attention (decoder.c), as attention.c's ttft_paged_attention computes it, shared with the
   helpers by parts: `part` is attention.c's ttft_attention_part (a part: a query row's heads of one KV head, so a
   single row is shared too). Returns 1 if it is not shared (no helper, too small, a request of more than max_rows
   rows, a shape `part` refuses: the caller computes it alone), else 0, or -1 (share_run). */
int ttft_share_attention(ttft_attention_part_fn part, const float *q, int64_t heads, int64_t kv_heads, int64_t dim,
                         const void *k, const void *v, int64_t key_stride, int64_t head_stride,
                         const int64_t *index, const int32_t *cu_q, const int32_t *cu_k, int64_t requests,
                         int64_t max_rows, float scale, float *out) {
    if (part == NULL || atomic_load(&share.helpers) == 0 || requests <= 0) return 1;
    if (part(q, heads, kv_heads, dim, k, v, key_stride, head_stride, index, cu_q, cu_k, requests, max_rows, scale, 0,
             0, out) != 0)
        return 1; /* a shape it refuses (kv_heads divides heads from here on) */
    int64_t pairs = 0, widest = 0; /* (query row, key); the most rows of a request */
    for (int64_t s = 0; s < requests; s++) {
        int64_t lq = cu_q[s + 1] - cu_q[s], lk = cu_k[s + 1] - cu_k[s];
        if (lq > max_rows) return 1;
        pairs += lq * lk - lq * (lq - 1) / 2;
        if (lq > widest) widest = lq;
    }
    int64_t M = cu_q[requests] * kv_heads, N = heads / kv_heads * dim;
    int64_t work = 2 * pairs * heads * dim; /* multiply-adds: scores and values */
    if (M < 2 || work < SHARE_WORK || M * N > SHARE_OUTPUTS) return 1;
    struct job j = {.kind = ATTENTION, .M = M, .N = N};
    j.a = (struct attention){.part = part, .k = k, .v = v, .heads = heads, .kv_heads = kv_heads, .dim = dim,
                             .key_stride = key_stride, .head_stride = head_stride, .requests = requests,
                             .max_rows = max_rows, .scale = scale};
    j.per = (CHUNK_WORK * M + work - 1) / work;
    if (j.per < 1) j.per = 1;
    /* Chunks of whole pairs of rows where a request has several and that leaves two chunks or more: attention.c
       attends a request's consecutive rows of one KV head together (each key and value read once for both) within
       the parts a call is given, and a long context makes a chunk of each part, which attends each row alone. */
    if (widest > 1 && M >= 4 * kv_heads) j.per = (j.per + 2 * kv_heads - 1) / (2 * kv_heads) * (2 * kv_heads);
    while ((M + j.per - 1) / j.per > SHARE_CHUNKS) j.per *= 2;
    j.chunks = (M + j.per - 1) / j.per;
    if (j.chunks < 2) return 1;
    return share_run(j, q, index, cu_q, cu_k, out);
}

/* kernel.h's two linear functions: a call shared with the helper threads where it can be, else computed alone
   (kernel.c, int8_rows.c). 0, or -1 if K is not whole blocks, the bits are not the arithmetic's, or a buffer cannot
   be allocated; the int8 one -2 on a build without int8 rows. */
int ttft_blocks_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, int bits, const float *scale,
                       const float *zero, int64_t N, float *y) {
    if (!fp32_takes(K, bits)) return -1;
    if (M <= 0) return 0;
    struct job j = {.int8 = 0, .M = M, .K = K, .N = N, .codes = codes, .bits = bits, .scale = scale, .zero = zero};
    int shared = share_call(j, x, y);
    return shared <= 0 ? shared : fp32_alone(x, M, K, codes, bits, scale, zero, N, y);
}

int ttft_q8_linear(const float *x, int64_t M, int64_t K, const uint8_t *records, int bits, int64_t N, float *y) {
#if defined(Q_VNNI) || defined(Q_AVX2)
    if (K % BLOCK != 0 || !q8_takes(bits)) return -1;
    if (M <= 0) return 0;
    struct job j = {.int8 = 1, .M = M, .K = K, .N = N, .codes = records, .bits = bits};
    int shared = share_call(j, x, y);
    return shared <= 0 ? shared : q8_alone(x, M, K, records, bits, N, y);
#else
    (void)x, (void)M, (void)K, (void)records, (void)bits, (void)N, (void)y;
    return -2; /* built without AVX-512 VNNI or AVX2 with F16C */
#endif
}
