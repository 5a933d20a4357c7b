/* Paged attention for the CPU, float32: reads K/V pages where they lie (no gather).
 *
 * The algorithm of cbrun/kernels/paged_attention.py (softmax attention over the pages of a block table, as in vLLM's
 * paged attention), written for a CPU core. One work item is (request, tile of up to TILE_Q query rows, a run of KV
 * heads -- all of them unless there are too few items for the threads); work items are spread over OpenMP threads.
 * A page's token rows hold every KV head side by side, so taking all heads in one item reads each page as one
 * stream, and the query heads of a KV head's group share its keys, so K and V are read once per tile.
 *
 * Two ways through a tile, with the same result up to float rounding:
 * - the three passes (the usual one, whenever the tile's scores fit TWO_PASS_MAX_SCORES): every score first,
 *   then each query vector's max, exp and sum as long vector loops, then the weighted sum of V. As in vLLM's CPU
 *   paged attention, this beats an online softmax for decode rows, whose per-page bookkeeping costs more than
 *   their arithmetic. attend_tile_two_pass_simd runs them in 8-lane registers for head_dim % 8 == 0 (every real
 *   model), with the floats of the generic attend_tile_two_pass, which runs the other head sizes.
 * - attend_tile: FlashAttention-2's online softmax (Dao 2023), one page at a time, for contexts too long to hold.
 * Scores come from one of: a transposed copy of the page (short heads, tiles of many query vectors), SIMD dot
 * products reduced by a shuffle butterfly (head_dim a multiple of 8), or plain dot products. exp is Cephes'
 * polynomial, vectorised. Which order sums a score, a softmax sum or an output depends only on the tile's shape,
 * never on the thread or the work split, so outputs are the same at any thread count.
 *
 * Decode on a large batch is bound by memory, not arithmetic: each request's pages are scattered 2 KiB blocks
 * (page_size 16, 4 KV heads of 8), and every page is a fresh 4 KiB memory page (a TLB miss, expensive under
 * virtualisation). Pages are fetched one ahead of the score pass, a few lines per key block: issued all at once,
 * a page's prefetches wait for free line-fill buffers and stall the scoring behind them (perf put half of the
 * kernel's samples on them).
 *
 * Layouts (all contiguous, float32 unless said):
 *   query, out:          (T, num_heads, head_dim)
 *   k_cache, v_cache:    (num_pages, page_size, num_kv_heads, head_dim)
 *   block_tables:        (num_requests, bt_stride) int32, page of each logical block (page_offset added)
 *   cu_seqlens_q:        (num_requests + 1,) int32;  seqlens_k: (num_requests,) int32 (this step's tokens included)
 * Query row j of request b sits at position seqlens_k[b] - q_len + j and attends to positions <= its own (and
 * > position - sliding_window when sliding_window > 0). Query head h uses KV head h / (num_heads / num_kv_heads).
 * Built and loaded by cbrun/kernels/cpu_attention.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_Q 16

typedef struct {
    int32_t request;
    int32_t row_start;     /* first query row of the tile, relative to the request */
    int32_t kv_head_begin; /* KV heads [kv_head_begin, kv_head_end) */
    int32_t kv_head_end;
    int64_t cost;          /* item_cost: the order in which threads take items */
} WorkItem;

/* exp(x) for x <= 0, vectorisable (no libm call, no branch): Cephes' expf (S. L. Moshier, Cephes Math Library,
 * netlib), i.e. x = n ln2 + r with |r| <= ln2 / 2, a degree-7 polynomial for e^r, and 2^n built in the exponent
 * bits. Relative error about 1e-7 (1-2 ulp), like libm's expf. Below -87.3 (2^n would be subnormal) it returns 0,
 * which is what a softmax weight that small rounds to next to the row's maximum weight of 1. */
static inline float exp_nonpositive(float x) {
    const float underflows = x < -87.3f ? 0.0f : 1.0f;  /* selects, not branches: the loops calling this vectorise */
    x = x < -87.3f ? -87.3f : x;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits */
    const float t = x * 1.44269504088896341f + shifter;
    const float n = t - shifter;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f; /* ln 2 split in two, as in Cephes */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } scale;
    scale.f = t;
    scale.i = (scale.i - 0x4B400000 + 127) << 23; /* the integer n, then 2^n */
    return p * scale.f * underflows;
}

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define KEY_BLOCK 8 /* keys scored together: one 8-lane register of scores */
#define TWO_PASS_MAX_SCORES 65536 /* floats of scores (256 KiB) a tile may hold for attend_tile_two_pass */

/* Which keys a tile of query rows sees: its rows (at most TILE_Q, from row_start), the positions of its first and
 * last row, and lo, the first key any of them attends to (0, or the sliding window's start for the first row). */
typedef struct {
    int rows, first_pos, last_pos, lo;
} TileKeys;

ALWAYS_INLINE TileKeys tile_keys(int32_t q_len, int32_t seqlen_k, int32_t row_start, int32_t sliding_window) {
    TileKeys t;
    t.rows = q_len - row_start < TILE_Q ? q_len - row_start : TILE_Q;
    t.first_pos = seqlen_k - q_len + row_start;
    t.last_pos = t.first_pos + t.rows - 1;
    t.lo = sliding_window > 0 && t.first_pos - sliding_window + 1 > 0 ? t.first_pos - sliding_window + 1 : 0;
    return t;
}

/* s[0..n) = q . k_j for the n keys whose transposed rows are kt[d * kt_stride + j] (j from 0): head_dim vector
 * FMAs per block of KEY_BLOCK keys, the scores held in one register, no horizontal sums. Lanes past n hold
 * garbage that the caller never reads. */
ALWAYS_INLINE void scores_transposed(const float *q, const float *kt, int kt_stride, int n, int head_dim, float *s) {
    for (int b = 0; b < n; b += KEY_BLOCK) {
        float block[KEY_BLOCK] = {0.f};
        for (int d = 0; d < head_dim; d++) {
            const float qd = q[d];
            const float *kd = kt + (int64_t)d * kt_stride + b;
#pragma omp simd
            for (int j = 0; j < KEY_BLOCK; j++) block[j] += qd * kd[j];
        }
        memcpy(s + b, block, sizeof(block));
    }
}

/* The softmax weight of query head `head`'s sink next to a row whose largest score is row_max: exp(sink - row_max),
 * added to the row's sum and to no output (gpt-oss's attention sinks: one learned logit per head with no value). 0
 * without sinks, so the sum keeps its floats. sink - row_max may be positive: libm's expf, not exp_nonpositive. */
static inline float sink_weight(const float *sinks, int64_t head, float row_max) {
    return sinks ? expf(sinks[head] - row_max) : 0.f;
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
#if defined(__clang__)
#define SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, (i32x8){__VA_ARGS__})
#endif

static inline f32x8 load8(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* s[0..n) = q . k_j for keys k_j = k + j * stride, head_dim a multiple of 8: per block of 8 keys, eight 8-lane
 * product sums, then one butterfly of shuffles and adds turns them into the 8 keys' scores (the transpose-and-add
 * reduction of SIMD dot products, as in BLAS dot kernels). Keys are read in place; a partial last block repeats
 * key n - 1 and writes lanes past n, which the caller never reads (s needs KEY_BLOCK floats of slack). */
ALWAYS_INLINE void scores_butterfly(const float *q, const float *k, int64_t stride, int n, int head_dim, float *s) {
    for (int b = 0; b < n; b += KEY_BLOCK) {
        f32x8 p[KEY_BLOCK];
        for (int j = 0; j < KEY_BLOCK; j++) {
            const float *kj = k + (int64_t)(b + j < n ? b + j : n - 1) * stride;
            f32x8 sum = load8(q) * load8(kj);
            for (int d = 8; d < head_dim; d += 8) sum += load8(q + d) * load8(kj + d);
            p[j] = sum;
        }
        const f32x8 a0 = SHUFFLE8(p[0], p[1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE8(p[0], p[1], 1, 9, 3, 11, 5, 13, 7, 15);
        const f32x8 a1 = SHUFFLE8(p[2], p[3], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE8(p[2], p[3], 1, 9, 3, 11, 5, 13, 7, 15);
        const f32x8 a2 = SHUFFLE8(p[4], p[5], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE8(p[4], p[5], 1, 9, 3, 11, 5, 13, 7, 15);
        const f32x8 a3 = SHUFFLE8(p[6], p[7], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE8(p[6], p[7], 1, 9, 3, 11, 5, 13, 7, 15);
        const f32x8 b0 = SHUFFLE8(a0, a1, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE8(a0, a1, 2, 3, 10, 11, 6, 7, 14, 15);
        const f32x8 b1 = SHUFFLE8(a2, a3, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE8(a2, a3, 2, 3, 10, 11, 6, 7, 14, 15);
        const f32x8 scores = SHUFFLE8(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE8(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15);
        memcpy(s + b, &scores, sizeof(scores));
    }
}

/* s[0..n) = q . k_j for the keys k_j = k + j * stride, four per pass over q (for long heads, read in place). */
ALWAYS_INLINE void scores_dot(const float *q, const float *k, int64_t stride, int n, int head_dim, float *s) {
    for (int j = 0; j < n; j += 4) {
        const int n_keys = n - j < 4 ? n - j : 4;
        const float *k0 = k + j * stride, *k1 = k0 + (n_keys > 1 ? stride : 0);
        const float *k2 = k0 + (n_keys > 2 ? 2 * stride : 0), *k3 = k0 + (n_keys > 3 ? 3 * stride : 0);
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int d = 0; d < head_dim; d++) {
            s0 += q[d] * k0[d];
            s1 += q[d] * k1[d];
            s2 += q[d] * k2[d];
            s3 += q[d] * k3[d];
        }
        const float all[4] = {s0, s1, s2, s3};
        for (int i = 0; i < n_keys; i++) s[j + i] = all[i];
    }
}

/* One (query vector, page) step of the online softmax: s[0..n) are the vector's raw scores q.k for n consecutive
 * keys of the page, v the first of those keys' V rows; m, l, acc its running max, sum and (head_dim,) output. */
ALWAYS_INLINE void online_softmax_update(float *s, int n, const float *v, int64_t token_stride, int head_dim,
                                         float scale, float softcap, float *m, float *l, float *acc) {
    float page_max = -INFINITY;
    if (softcap > 0.f) {
        for (int j = 0; j < n; j++) s[j] = softcap * tanhf(s[j] * scale / softcap);
    } else {
#pragma omp simd
        for (int j = 0; j < n; j++) s[j] *= scale;
    }
#pragma omp simd reduction(max : page_max)
    for (int j = 0; j < n; j++) page_max = s[j] > page_max ? s[j] : page_max;
    if (page_max > *m) { /* rescale what was summed under the old max */
        const float correction = exp_nonpositive(*m - page_max);
        *l *= correction;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) acc[d] *= correction;
        *m = page_max;
    }
    const float row_max = *m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < n; j++) {
        s[j] = exp_nonpositive(s[j] - row_max);
        sum += s[j];
    }
    *l += sum;
    /* A local accumulator: acc and v could alias as far as the compiler knows, which would store and reload acc
     * after every key. With head_dim a constant it lives in registers. */
    float a[head_dim];
    memcpy(a, acc, sizeof(float) * head_dim);
    for (int j = 0; j < n; j++) {
        const float p = s[j];
        const float *vj = v + j * token_stride;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) a[d] += p * vj[d];
    }
    memcpy(acc, a, sizeof(float) * head_dim);
}

static void prefetch_page(const float *k, const float *v, int64_t token_stride, int page_size, int head_dim) {
    for (int t = 0; t < page_size; t++)
        for (int d = 0; d < head_dim; d += 16) {
            __builtin_prefetch(k + t * token_stride + d);
            __builtin_prefetch(v + t * token_stride + d);
        }
}

/* Scratch floats one tile needs (see attend_tile). */
static size_t tile_scratch_floats(int num_heads, int head_dim, int page_size) {
    const int kt_stride = page_size + KEY_BLOCK;
    return (size_t)TILE_Q * num_heads * (head_dim + 2) + page_size + KEY_BLOCK + (size_t)head_dim * kt_stride;
}

/* Attention of up to TILE_Q query rows of one request, for the query heads of one KV head. head_dim is a
 * compile-time constant at each call site below, so the d loops unroll and the accumulators stay in registers. */
ALWAYS_INLINE void attend_tile(const float *query, const float *k_cache, const float *v_cache, const int32_t *table,
                               int32_t page_offset, int32_t q_start, int32_t q_len, int32_t seqlen_k,
                               int32_t row_start, int32_t kv_head_begin, int32_t kv_head_end, int32_t num_heads,
                               int32_t num_kv_heads,
                               const int head_dim, int32_t page_size, float scale, float softcap,
                               const float *sinks, int32_t sliding_window, float *out, float *scratch) {
    const int group = num_heads / num_kv_heads;
    const TileKeys keys = tile_keys(q_len, seqlen_k, row_start, sliding_window);
    const int rows = keys.rows, first_pos = keys.first_pos, last_pos = keys.last_pos, lo = keys.lo;
    const int heads = kv_head_end - kv_head_begin;
    const int nvec = rows * heads * group;             /* vector (r, kv head, g) is (r * heads + h) * group + g */
    const int kt_stride = page_size + KEY_BLOCK;
    float *acc = scratch;                              /* (nvec, head_dim) */
    float *m = acc + (size_t)nvec * head_dim;          /* (nvec,) running max */
    float *l = m + nvec;                               /* (nvec,) running sum */
    float *s = l + nvec;                               /* (page_size + KEY_BLOCK,) one vector's scores on a page */
    float *kt = s + page_size + KEY_BLOCK;             /* (head_dim, kt_stride) the page's keys, transposed */
    /* Short heads: a transposed page scores with no horizontal sums (see scores_transposed). */
    const int transpose = head_dim <= 16;
    memset(acc, 0, sizeof(float) * (size_t)nvec * head_dim);
    for (int i = 0; i < nvec; i++) { m[i] = -INFINITY; l[i] = 0.f; }
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    for (int page_start = lo - lo % page_size; page_start <= last_pos; page_start += page_size) {
        const int64_t page = (int64_t)table[page_start / page_size] + page_offset;
        const int64_t head_offset = (int64_t)kv_head_begin * head_dim;
        if (page_start + page_size <= last_pos) {  /* the next page's rows are scattered: fetch them early */
            const int64_t next = (int64_t)table[page_start / page_size + 1] + page_offset;
            prefetch_page(k_cache + next * page_size * token_stride + head_offset,
                          v_cache + next * page_size * token_stride + head_offset, token_stride, page_size,
                          heads * head_dim);
        }
        /* Keys of this page that some row of the tile sees: one run [k_lo, k_hi]. */
        const int k_lo = page_start > lo ? page_start : lo;
        const int k_hi = page_start + page_size - 1 < last_pos ? page_start + page_size - 1 : last_pos;
        for (int h = 0; h < heads; h++) {
            const int kv_head = kv_head_begin + h;
            const float *k_page = k_cache + page * page_size * token_stride + (int64_t)kv_head * head_dim;
            const float *v_page = v_cache + page * page_size * token_stride + (int64_t)kv_head * head_dim;
            if (transpose)
                for (int j = 0; j <= k_hi - k_lo; j++) {
                    const float *k = k_page + (int64_t)(k_lo - page_start + j) * token_stride;
                    for (int d = 0; d < head_dim; d++) kt[d * kt_stride + j] = k[d];
                }
            for (int r = 0; r < rows; r++) {
                const int pos = first_pos + r;
                int t_lo = k_lo, t_hi = k_hi < pos ? k_hi : pos;  /* keys of this page the row sees */
                if (sliding_window > 0 && t_lo < pos - sliding_window + 1) t_lo = pos - sliding_window + 1;
                if (t_lo > t_hi) continue;
                const int n = t_hi - t_lo + 1;
                for (int g = 0; g < group; g++) {
                    const int vec = (r * heads + h) * group + g;
                    const float *q = query + ((int64_t)(q_start + row_start + r) * num_heads
                                              + (int64_t)kv_head * group + g) * head_dim;
                    const float *k_first = k_page + (int64_t)(t_lo - page_start) * token_stride;
                    if (transpose)
                        scores_transposed(q, kt + (t_lo - k_lo), kt_stride, n, head_dim, s);
                    else if (head_dim % 8 == 0)
                        scores_butterfly(q, k_first, token_stride, n, head_dim, s);
                    else
                        scores_dot(q, k_first, token_stride, n, head_dim, s);
                    online_softmax_update(s, n, v_page + (int64_t)(t_lo - page_start) * token_stride,
                                          token_stride, head_dim, scale, softcap, m + vec, l + vec,
                                          acc + (size_t)vec * head_dim);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int v = 0; v < heads * group; v++) {  /* query heads kv_head_begin * group + v, in order */
            const int vec = r * heads * group + v;
            float *o = out + ((int64_t)(q_start + row_start + r) * num_heads + (int64_t)kv_head_begin * group + v)
                                 * head_dim;
            const float inv = 1.f / (l[vec] + sink_weight(sinks, (int64_t)kv_head_begin * group + v, m[vec]));
            const float *a = acc + (size_t)vec * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) o[d] = a[d] * inv;
        }
    }
}

/* The same attention as attend_tile in three passes over the whole visible context instead of one online pass
 * over pages: all scores of the tile's vectors for one KV head, then each vector's max, exp and sum as long vector
 * loops, then the weighted sum of V. For decode rows, the online softmax's per-page bookkeeping (a max, a
 * rescale, four short loops per vector and page) costs more than the arithmetic; here it is paid once per vector.
 * Needs heads * rows * group * (span + KEY_BLOCK) floats of scores (span = keys the tile sees), so the caller uses
 * it only when that fits TWO_PASS_MAX_SCORES. */
ALWAYS_INLINE void attend_tile_two_pass(const float *query, const float *k_cache, const float *v_cache,
                                        const int32_t *table, int32_t page_offset, int32_t q_start, int32_t q_len,
                                        int32_t seqlen_k, int32_t row_start, int32_t kv_head_begin,
                                        int32_t kv_head_end, int32_t num_heads, int32_t num_kv_heads,
                                        const int head_dim, int32_t page_size, float scale, float softcap,
                                        const float *sinks, int32_t sliding_window, float *out, float *scratch) {
    const int group = num_heads / num_kv_heads;
    const TileKeys keys = tile_keys(q_len, seqlen_k, row_start, sliding_window);
    const int rows = keys.rows, first_pos = keys.first_pos, last_pos = keys.last_pos, lo = keys.lo;
    const int span = last_pos - lo + 1, s_stride = span + KEY_BLOCK;
    const int kt_stride = page_size + KEY_BLOCK;
    float *kt = scratch;                                   /* (head_dim, kt_stride) one page's keys, transposed */
    float *scores = kt + (size_t)head_dim * kt_stride;     /* (heads, rows * group, s_stride): key t at t - lo */
    /* Transposing a page costs about what scoring it once costs: it pays for a tile of many query vectors. */
    const int transpose = head_dim <= 16 && (rows * group >= 16 || head_dim % 8 != 0);
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int first_page = lo / page_size, last_page = last_pos / page_size;
    const int heads = kv_head_end - kv_head_begin, nvec = rows * group;
    for (int lp = first_page; lp <= last_page; lp++) {  /* pass 1: scores, every head of a page while it is cached */
        const int64_t page = (int64_t)table[lp] + page_offset;
        const int page_start = lp * page_size;
        const int k_lo = page_start > lo ? page_start : lo;
        const int k_hi = page_start + page_size - 1 < last_pos ? page_start + page_size - 1 : last_pos;
        const int n = k_hi - k_lo + 1;
        if (lp < last_page) {  /* pages are scattered: fetch the next one early */
            const int64_t next = ((int64_t)table[lp + 1] + page_offset) * page_size * token_stride
                                 + (int64_t)kv_head_begin * head_dim;
            prefetch_page(k_cache + next, v_cache + next, token_stride, page_size, heads * head_dim);
        }
        for (int h = 0; h < heads; h++) {
            const int kv_head = kv_head_begin + h;
            const float *k_first = k_cache + page * page_size * token_stride + (int64_t)kv_head * head_dim
                                   + (int64_t)(k_lo - page_start) * token_stride;
            if (transpose)
                for (int j = 0; j < n; j++)
                    for (int d = 0; d < head_dim; d++) kt[d * kt_stride + j] = k_first[j * token_stride + d];
            for (int vec = 0; vec < nvec; vec++) {
                const int r = vec / group, g = vec % group;
                const float *q = query + ((int64_t)(q_start + row_start + r) * num_heads
                                          + (int64_t)kv_head * group + g) * head_dim;
                float *s = scores + ((size_t)h * nvec + vec) * s_stride + (k_lo - lo);
                if (transpose)
                    scores_transposed(q, kt, kt_stride, n, head_dim, s);
                else if (head_dim % 8 == 0)
                    scores_butterfly(q, k_first, token_stride, n, head_dim, s);
                else
                    scores_dot(q, k_first, token_stride, n, head_dim, s);
            }
        }
    }
    for (int h = 0; h < heads; h++) {
        const int kv_head = kv_head_begin + h;
        const float *v_head = v_cache + (int64_t)kv_head * head_dim;
        for (int vec = 0; vec < rows * group; vec++) {  /* pass 2: softmax weights; pass 3: weighted sum of V */
            const int r = vec / group, g = vec % group;
            const int pos = first_pos + r;
            int t_lo = lo;
            if (sliding_window > 0 && t_lo < pos - sliding_window + 1) t_lo = pos - sliding_window + 1;
            float *s = scores + ((size_t)h * nvec + vec) * s_stride + (t_lo - lo);
            const int n = pos - t_lo + 1;
            if (softcap > 0.f) {
                for (int j = 0; j < n; j++) s[j] = softcap * tanhf(s[j] * scale / softcap);
            } else {
#pragma omp simd
                for (int j = 0; j < n; j++) s[j] *= scale;
            }
            float row_max = -INFINITY;
#pragma omp simd reduction(max : row_max)
            for (int j = 0; j < n; j++) row_max = s[j] > row_max ? s[j] : row_max;
            /* The sum in one fixed order: 8 lane sums over the full 8-key blocks, the tail added to lane 0, then
             * 0 + lane 0 + ... + lane 7 (softmax_weights, the 8-lane loops, sums the same way). Not an OpenMP simd
             * reduction: GCC sums that in as many lanes as its vector width for the target (16 with AVX-512 on
             * AMD, 4 with SSE only), and the two loops must give the same floats on every x86-64 CPU. */
            float lanes[8] = {0.f};
            int j = 0;
            for (; j + 8 <= n; j += 8)
#pragma omp simd
                for (int l = 0; l < 8; l++) {
                    s[j + l] = exp_nonpositive(s[j + l] - row_max);
                    lanes[l] += s[j + l];
                }
            float lane0 = lanes[0];
            for (; j < n; j++) {
                s[j] = exp_nonpositive(s[j] - row_max);
                lane0 += s[j];
            }
            float sum = 0.f + lane0;
            for (int l = 1; l < 8; l++) sum += lanes[l];
            float a[head_dim];
            memset(a, 0, sizeof(float) * head_dim);
            for (int t = t_lo; t <= pos;) {
                const int page_start = t - t % page_size;
                const int t_end = page_start + page_size - 1 < pos ? page_start + page_size - 1 : pos;
                const float *v = v_head + ((int64_t)table[t / page_size] + page_offset) * page_size * token_stride
                                 + (int64_t)(t - page_start) * token_stride;
                const float *p = s + (t - t_lo);
                for (int j = 0; j <= t_end - t; j++) {
                    const float pj = p[j];
                    const float *vj = v + j * token_stride;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) a[d] += pj * vj[d];
                }
                t = t_end + 1;
            }
            float *o = out + ((int64_t)(q_start + row_start + r) * num_heads + (int64_t)kv_head * group + g) * head_dim;
            const float inv = 1.f / (sum + sink_weight(sinks, (int64_t)kv_head * group + g, row_max));
#pragma omp simd
            for (int d = 0; d < head_dim; d++) o[d] = a[d] * inv;
        }
    }
}

/* ---- attend_tile_two_pass for head_dim % 8 == 0, in 8-lane registers ----
 * The same arithmetic as attend_tile_two_pass, vector for vector: every score, softmax weight and output is the
 * same float (tests/kernels/test_cpu_attention.py checks it against the generic loops). What changes is how much
 * independent work is in flight: the generic loops run one query vector at a time, and each step of its sums waits
 * on the previous add (a head_dim 8 vector's V sum is one register, so one add per token and vector, 3 cycles
 * each), reloads q per key, and walks the V pages once per vector. Here the V pass runs up to eight query vectors
 * of a row at once (eight independent sums, one read of each V row), scores on a transposed page run eight query
 * vectors per key block, butterfly scores load each slice of q once for eight keys, the softmax sum sits in a
 * register (the generic loop's lane sums may live in a stack array), and no loop divides by the group size.
 * Scores are laid out (rows, query vectors of the row, keys) so one row's vectors are a fixed stride apart. */

static inline f32x8 splat8(float x) { return (f32x8){x, x, x, x, x, x, x, x}; }
static inline void store8(float *p, f32x8 v) { memcpy(p, &v, sizeof(v)); }

/* Lane j: the sum of p[j]'s lanes l0..l7 as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), the order of
 * scores_butterfly's butterfly, in 14 one-instruction shuffles (vshufps, vperm2f128 on x86). */
ALWAYS_INLINE f32x8 lane_sums8(const f32x8 *p) {
#define PAIR_SUMS(a, b) (SHUFFLE8(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE8(a, b, 1, 3, 9, 11, 5, 7, 13, 15))
    const f32x8 a0 = PAIR_SUMS(p[0], p[1]), a1 = PAIR_SUMS(p[2], p[3]);
    const f32x8 a2 = PAIR_SUMS(p[4], p[5]), a3 = PAIR_SUMS(p[6], p[7]);
    const f32x8 b0 = PAIR_SUMS(a0, a1), b1 = PAIR_SUMS(a2, a3);
#undef PAIR_SUMS
    return SHUFFLE8(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE8(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Scores of q against keys k0 + j * stride for j < 8 (j past n_keys repeats key n_keys - 1, whose lanes the
 * caller never reads), summed as scores_butterfly sums them: per lane over the 8-float slices of head_dim in order,
 * then lane_sums8. Each slice of q is loaded once for the 8 keys. */
ALWAYS_INLINE f32x8 butterfly_block(const float *q, const float *k0, int64_t stride, const int n_keys,
                                    const int head_dim) {
    const float *k[KEY_BLOCK];
    for (int j = 0; j < KEY_BLOCK; j++) k[j] = k0 + (j < n_keys ? j : n_keys - 1) * stride;
    f32x8 p[KEY_BLOCK];
    const f32x8 q0 = load8(q);
    for (int j = 0; j < KEY_BLOCK; j++) p[j] = q0 * load8(k[j]);
    for (int d = 8; d < head_dim; d += 8) {
        const f32x8 qd = load8(q + d);
        for (int j = 0; j < KEY_BLOCK; j++) p[j] += qd * load8(k[j] + d);
    }
    return lane_sums8(p);
}

/* s[v][b .. b + 8) for NV (<= 8) query vectors q + v * head_dim against keys b .. b + 8 of a transposed page kt,
 * each score summed over d in order from 0 as scores_transposed sums it: NV independent sums per d. */
ALWAYS_INLINE void transposed_block(const float *q, const float *kt, int kt_stride, int b, const int head_dim,
                                    const int NV, float *const *s) {
    f32x8 acc[8];
    for (int v = 0; v < NV; v++) acc[v] = splat8(0.f);
    for (int d = 0; d < head_dim; d++) {
        const f32x8 kd = load8(kt + (int64_t)d * kt_stride + b);
        for (int v = 0; v < NV; v++) acc[v] += splat8(q[v * head_dim + d]) * kd;
    }
    for (int v = 0; v < NV; v++) store8(s[v] + b, acc[v]);
}

/* exp_nonpositive of 8 lanes: the same operations, so the same floats lane for lane. */
ALWAYS_INLINE f32x8 exp8_nonpositive(f32x8 x) {
    const i32x8 underflows = x < splat8(-87.3f); /* all ones where 2^n would be subnormal */
    x = (f32x8)(((i32x8)x & ~underflows) | ((i32x8)splat8(-87.3f) & underflows));
    const f32x8 shifter = splat8(12582912.0f);
    const f32x8 t = x * splat8(1.44269504088896341f) + shifter;
    const f32x8 n = t - shifter;
    const f32x8 r = (x - n * splat8(0.693359375f)) + n * splat8(2.12194440e-4f);
    f32x8 p = splat8(1.9875691500e-4f);
    p = p * r + splat8(1.3981999507e-3f);
    p = p * r + splat8(8.3334519073e-3f);
    p = p * r + splat8(4.1665795894e-2f);
    p = p * r + splat8(1.6666665459e-1f);
    p = p * r + splat8(5.0000001201e-1f);
    p = p * r * r + r + splat8(1.0f);
    const i32x8 scale = ((i32x8)t - 0x4B400000 + 127) << 23;
    return (f32x8)((i32x8)(p * (f32x8)scale) & ~underflows);
}

/* Lanes of a or b, whichever is larger (b where a is NaN), as a bitwise select: GCC's C has no vector ?:. */
ALWAYS_INLINE f32x8 max8(f32x8 a, f32x8 b) {
    const i32x8 take_b = b > a;
    return (f32x8)(((i32x8)b & take_b) | ((i32x8)a & ~take_b));
}

/* The largest of s[0..n) (-inf when n is 0). Four independent maxima in flight: one chain waits on each max's
 * latency. A max is exact, so the order of comparisons never changes the result. */
ALWAYS_INLINE float max_of(const float *s, int n) {
    f32x8 m0 = splat8(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int j = 0;
    for (; j + 32 <= n; j += 32) {
        m0 = max8(m0, load8(s + j));
        m1 = max8(m1, load8(s + j + 8));
        m2 = max8(m2, load8(s + j + 16));
        m3 = max8(m3, load8(s + j + 24));
    }
    for (; j + 8 <= n; j += 8) m0 = max8(m0, load8(s + j));
    m0 = max8(max8(m0, m1), max8(m2, m3));
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = m0[l] > m ? m0[l] : m;
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* Softmax weights of one query vector's n raw scores, in place (scale or softcap, max, exp), and their sum, the
 * floats of attend_tile_two_pass's second pass. Both sum in the order attend_tile_two_pass spells out: 8 lane
 * sums over the full 8-float blocks, the tail added to lane 0, then 0 + lane 0 + ... + lane 7 in order (the test
 * against the generic loops checks it); here the lane sums sit in a register. */
ALWAYS_INLINE float softmax_weights(float *s, int n, float scale, float softcap, const float *sinks, int64_t head) {
    if (softcap > 0.f) {
        for (int j = 0; j < n; j++) s[j] = softcap * tanhf(s[j] * scale / softcap);
    } else {
#pragma omp simd
        for (int j = 0; j < n; j++) s[j] *= scale;
    }
    const float row_max = max_of(s, n);
    f32x8 lanes = splat8(0.f);
    int j = 0;
    for (; j + 16 <= n; j += 16) { /* two 8-lane blocks per step, summed into the lanes one after the other */
        const f32x8 e0 = exp8_nonpositive(load8(s + j) - splat8(row_max));
        const f32x8 e1 = exp8_nonpositive(load8(s + j + 8) - splat8(row_max));
        store8(s + j, e0);
        store8(s + j + 8, e1);
        lanes += e0;
        lanes += e1;
    }
    for (; j + 8 <= n; j += 8) {
        const f32x8 e = exp8_nonpositive(load8(s + j) - splat8(row_max));
        store8(s + j, e);
        lanes += e;
    }
    float lane0 = lanes[0];
    for (; j < n; j++) {
        s[j] = exp_nonpositive(s[j] - row_max);
        lane0 += s[j];
    }
    float sum = 0.f + lane0;
    for (int l = 1; l < 8; l++) sum += lanes[l];
    return sum + sink_weight(sinks, head, row_max);
}

/* The V pass of NV (<= 8) query vectors of one row over positions [t_lo, pos]: o[v][d0 .. d0 + DB) =
 * inv[v] * sum_t p[v * p_stride + t - t_lo] * V_t[v_off[v] + d0 ..], each sum from 0 in order of t, as
 * attend_tile_two_pass sums it. NV * DB / 8 <= 8 accumulator registers; each V row is read once for the NV vectors. */
ALWAYS_INLINE void weighted_v_block(const float *v_cache, const int32_t *table, int32_t page_offset,
                                    int32_t page_size, int64_t token_stride, int t_lo, int pos, const float *p,
                                    int p_stride, const int64_t *v_off, const float *inv, float *o, int64_t o_stride,
                                    int d0, const int DB, const int NV) {
    f32x8 acc[8][8];
    for (int v = 0; v < NV; v++)
        for (int e = 0; e < DB / 8; e++) acc[v][e] = splat8(0.f);
    int lp = t_lo / page_size, t = t_lo, offset = t_lo - lp * page_size;
    while (t <= pos) {
        const int count = page_size - offset < pos - t + 1 ? page_size - offset : pos - t + 1;
        const float *row = v_cache + ((int64_t)table[lp] + page_offset) * page_size * token_stride
                           + (int64_t)offset * token_stride + d0;
        const float *w = p + (t - t_lo);
        for (int j = 0; j < count; j++, row += token_stride, w++)
            for (int v = 0; v < NV; v++) {
                const f32x8 pv = splat8(w[v * p_stride]);
                for (int e = 0; e < DB / 8; e++) acc[v][e] += pv * load8(row + v_off[v] + 8 * e);
            }
        t += count;
        lp++;
        offset = 0;
    }
    for (int v = 0; v < NV; v++)
        for (int e = 0; e < DB / 8; e++) store8(o + v * o_stride + d0 + 8 * e, acc[v][e] * splat8(inv[v]));
}

/* A page's K and V lines still to prefetch, issued a few at a time between key blocks of the score pass: a page's
 * hundreds of prefetches issued at once wait for free line-fill buffers and stall the scoring behind them. */
typedef struct {
    const float *k, *v;
    int64_t next, end; /* floats [next, end) of the page's rows not prefetched yet */
} PrefetchCursor;

ALWAYS_INLINE void prefetch_some(PrefetchCursor *c, int64_t floats) {
    const int64_t stop = c->next + floats < c->end ? c->next + floats : c->end;
    for (; c->next < stop; c->next += 16) {
        __builtin_prefetch(c->k + c->next);
        __builtin_prefetch(c->v + c->next);
    }
}

/* Prefetch one page's rows of the item's KV heads at once (contiguous when the item holds every head). */
static void prefetch_rows(const float *k, const float *v, int64_t token_stride, int page_size, int width) {
    if (width == token_stride) {
        PrefetchCursor whole = {k, v, 0, (int64_t)page_size * token_stride};
        prefetch_some(&whole, whole.end);
    } else {
        prefetch_page(k, v, token_stride, page_size, width);
    }
}

#define PREFETCH_PAGES 1 /* pages scattered in memory are fetched this many pages ahead of the score pass */

/* kt[d * kt_stride + j] = k[j * stride + d] for keys j < n rounded up to 8 (keys past n repeat key n - 1; their
 * scores are never read) and d < head_dim (a multiple of 8): 8 x 8 blocks transposed in registers, 24 shuffles
 * (unpack, shufps, vperm2f128 on x86) instead of 64 scalar loads and stores. A copy: the floats are unchanged. */
ALWAYS_INLINE void transpose_keys(const float *k, int n, int64_t stride, const int head_dim, float *kt,
                                  int kt_stride) {
    for (int b = 0; b < n; b += KEY_BLOCK)
        for (int d0 = 0; d0 < head_dim; d0 += 8) {
            f32x8 r[8];
            for (int j = 0; j < 8; j++) r[j] = load8(k + (b + j < n ? b + j : n - 1) * stride + d0);
            f32x8 t[8], u[8];
            for (int j = 0; j < 8; j += 2) {
                t[j] = SHUFFLE8(r[j], r[j + 1], 0, 8, 1, 9, 4, 12, 5, 13);
                t[j + 1] = SHUFFLE8(r[j], r[j + 1], 2, 10, 3, 11, 6, 14, 7, 15);
            }
            for (int j = 0; j < 8; j += 4)
                for (int h = 0; h < 2; h++) {
                    u[j + 2 * h] = SHUFFLE8(t[j + h], t[j + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
                    u[j + 2 * h + 1] = SHUFFLE8(t[j + h], t[j + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
                }
            /* u[c] (c < 4) holds column c of keys 0..3 then column c + 4; u[4 + c] the same of keys 4..7 */
            for (int c = 0; c < 4; c++) {
                store8(kt + (int64_t)(d0 + c) * kt_stride + b, SHUFFLE8(u[c], u[4 + c], 0, 1, 2, 3, 8, 9, 10, 11));
                store8(kt + (int64_t)(d0 + c + 4) * kt_stride + b,
                       SHUFFLE8(u[c], u[4 + c], 4, 5, 6, 7, 12, 13, 14, 15));
            }
        }
}

/* Pass 1 of attend_tile_two_pass_simd on one page: the raw scores of every query vector of the tile against the
 * page's keys [k_lo, k_lo + n), written at scores + (r * vectors + h * group + g) * s_stride + (k_lo - lo). */
ALWAYS_INLINE void score_page(const float *q_tile, const float *qpack, const float *k_page, int n, int rows,
                              int heads, int group, int kv_head_begin, int32_t num_heads, int64_t token_stride,
                              const int head_dim, int transpose, float *kt, int kt_stride, float *s_page,
                              int s_stride, PrefetchCursor *ahead) {
    const int vectors = heads * group, nvec = rows * group;
    /* ahead's lines spread evenly over this page's calls of prefetch_some (whole 16-float lines per call): one per
     * head on the transposed path, one per full key block of each query vector on the other. A page with no call
     * leaves them all to the caller's flush at the next page. */
    const int calls = transpose ? heads : heads * nvec * (n / KEY_BLOCK);
    const int64_t chunk = calls ? ((ahead->end - ahead->next + calls - 1) / calls + 15) / 16 * 16 : 0;
    for (int h = 0; h < heads; h++) {
        const float *k_first = k_page + (int64_t)(kv_head_begin + h) * head_dim;
        float *s_head = s_page + (size_t)h * group * s_stride;
        if (transpose) {
            prefetch_some(ahead, chunk);
            transpose_keys(k_first, n, token_stride, head_dim, kt, kt_stride);
            const float *q_head = qpack + (size_t)h * nvec * head_dim;
            float *s[8];
            int vec = 0;
#define TRANSPOSED(NV)                                                                                         \
    for (; nvec - vec >= NV; vec += NV) {                                                                      \
        for (int v = 0; v < NV; v++)                                                                           \
            s[v] = s_head + (size_t)((vec + v) / group * vectors + (vec + v) % group) * s_stride;              \
        for (int b = 0; b < n; b += KEY_BLOCK)                                                                 \
            transposed_block(q_head + (size_t)vec * head_dim, kt, kt_stride, b, head_dim, NV, s);             \
    }
            TRANSPOSED(8)
            TRANSPOSED(4)
            TRANSPOSED(1)
#undef TRANSPOSED
        } else {
            for (int r = 0; r < rows; r++)
                for (int g = 0; g < group; g++) {
                    const float *q = q_tile + ((int64_t)r * num_heads + (int64_t)(kv_head_begin + h) * group + g)
                                              * head_dim;
                    float *sv = s_head + (size_t)(r * vectors + g) * s_stride;
                    int b = 0;
                    for (; b + KEY_BLOCK <= n; b += KEY_BLOCK) {
                        prefetch_some(ahead, chunk);
                        store8(sv + b, butterfly_block(q, k_first + b * token_stride, token_stride, KEY_BLOCK,
                                                       head_dim));
                    }
                    if (b < n)
                        store8(sv + b, butterfly_block(q, k_first + b * token_stride, token_stride, n - b, head_dim));
                }
        }
    }
}

/* attend_tile_two_pass for head_dim % 8 == 0 (see the section comment above): the same three passes, the same
 * floats. head_dim is a compile-time constant at each call site of attend_tile_any, so every loop over it unrolls
 * and the accumulators stay in registers. qpack holds TILE_Q * num_heads * head_dim floats, scratch the kt and
 * scores of attend_tile_two_pass. */
ALWAYS_INLINE void attend_tile_two_pass_simd(const float *query, const float *k_cache, const float *v_cache,
                                             const int32_t *table, int32_t page_offset, int32_t q_start,
                                             int32_t q_len, int32_t seqlen_k, int32_t row_start,
                                             int32_t kv_head_begin, int32_t kv_head_end, int32_t num_heads,
                                             int32_t num_kv_heads, const int head_dim, int32_t page_size,
                                             float scale, float softcap, const float *sinks,
                                             int32_t sliding_window, float *out, float *qpack, float *scratch) {
    const int group = num_heads / num_kv_heads;
    const TileKeys keys = tile_keys(q_len, seqlen_k, row_start, sliding_window);
    const int rows = keys.rows, first_pos = keys.first_pos, last_pos = keys.last_pos, lo = keys.lo;
    const int span = last_pos - lo + 1, s_stride = span + KEY_BLOCK;
    const int kt_stride = page_size + KEY_BLOCK;
    const int heads = kv_head_end - kv_head_begin, vectors = heads * group; /* query vectors per row */
    float *kt = scratch;                               /* (head_dim, kt_stride) one page's keys, transposed */
    float *scores = kt + (size_t)head_dim * kt_stride; /* (rows, vectors, s_stride): key t at t - lo */
    /* The same choice of summation order as attend_tile_two_pass. */
    const int transpose = head_dim <= 16 && rows * group >= 16;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t page_floats = (int64_t)page_size * token_stride, head_offset = (int64_t)kv_head_begin * head_dim;
    const int first_page = lo / page_size, last_page = last_pos / page_size;
    const float *q_tile = query + (int64_t)(q_start + row_start) * num_heads * head_dim;
    if (transpose)  /* qpack: (heads, rows * group, head_dim), each KV head's query vectors side by side */
        for (int h = 0; h < heads; h++)
            for (int r = 0; r < rows; r++)
                memcpy(qpack + ((size_t)h * rows + r) * group * head_dim,
                       q_tile + ((int64_t)r * num_heads + (int64_t)(kv_head_begin + h) * group) * head_dim,
                       sizeof(float) * group * head_dim);
    for (int lp = first_page; lp < first_page + PREFETCH_PAGES && lp <= last_page; lp++) {
        const int64_t at = ((int64_t)table[lp] + page_offset) * page_floats + head_offset;
        prefetch_rows(k_cache + at, v_cache + at, token_stride, page_size, heads * head_dim);
    }
    /* The item holds every KV head: a page's rows are one contiguous run, prefetched a little per key block. */
    const int spread = heads == num_kv_heads;
    PrefetchCursor ahead = {k_cache, v_cache, 0, 0};
    for (int lp = first_page; lp <= last_page; lp++) {  /* pass 1: scores, every head of a page while it is cached */
        const int page_start = lp * page_size;
        const int k_lo = page_start > lo ? page_start : lo;
        const int k_hi = page_start + page_size - 1 < last_pos ? page_start + page_size - 1 : last_pos;
        prefetch_some(&ahead, ahead.end);  /* what the last page left (none: its blocks took it all) */
        ahead.end = 0;
        if (lp + PREFETCH_PAGES <= last_page) {
            const int64_t at = ((int64_t)table[lp + PREFETCH_PAGES] + page_offset) * page_floats + head_offset;
            if (spread)
                ahead = (PrefetchCursor){k_cache + at, v_cache + at, 0, page_floats};
            else
                prefetch_rows(k_cache + at, v_cache + at, token_stride, page_size, heads * head_dim);
        }
        const float *k_page = k_cache + ((int64_t)table[lp] + page_offset) * page_floats
                              + (int64_t)(k_lo - page_start) * token_stride;
        score_page(q_tile, qpack, k_page, k_hi - k_lo + 1, rows, heads, group, kv_head_begin, num_heads,
                   token_stride, head_dim, transpose, kt, kt_stride, scores + (k_lo - lo), s_stride, &ahead);
    }
    /* Passes 2 and 3, one row at a time: every vector's weights, then the V sums of up to 8 vectors at once. */
    const int DB = head_dim <= 64 && 64 % head_dim == 0 ? head_dim : (head_dim % 64 == 0 ? 64 : 8);
    const int per_call = 64 / DB; /* vectors per V pass: 8 accumulator registers */
    for (int r = 0; r < rows; r++) {
        const int pos = first_pos + r;
        int t_lo = lo;
        if (sliding_window > 0 && t_lo < pos - sliding_window + 1) t_lo = pos - sliding_window + 1;
        float *s_row = scores + (size_t)r * vectors * s_stride + (t_lo - lo);
        float *o_row = out + ((int64_t)(q_start + row_start + r) * num_heads + (int64_t)kv_head_begin * group)
                             * head_dim;
        float inv[8];
        int64_t v_off[8];
        int u = 0; /* vector u of the row: KV head kv_head_begin + u / group, its query head u % group */
#define V_PASS(NV)                                                                                           \
    for (; vectors - u >= NV; u += NV) {                                                                     \
        for (int v = 0; v < NV; v++) {                                                                       \
            inv[v] = 1.f / softmax_weights(s_row + (size_t)(u + v) * s_stride, pos - t_lo + 1, scale, softcap, \
                                           sinks, (int64_t)kv_head_begin * group + u + v);                   \
            v_off[v] = (int64_t)(kv_head_begin + (u + v) / group) * head_dim;                                \
        }                                                                                                    \
        for (int d0 = 0; d0 < head_dim; d0 += DB)                                                            \
            weighted_v_block(v_cache, table, page_offset, page_size, token_stride, t_lo, pos,                \
                             s_row + (size_t)u * s_stride, s_stride, v_off, inv, o_row + (size_t)u * head_dim, \
                             head_dim, d0, DB, NV);                                                          \
    }
        if (per_call >= 8) V_PASS(8)
        if (per_call >= 4) V_PASS(4)
        if (per_call >= 2) V_PASS(2)
        V_PASS(1)
#undef V_PASS
    }
}

/* attend_tile specialised for the common head sizes (a constant head_dim), generic otherwise. lane_loops = 0 makes
 * tiles with head_dim % 8 == 0 take attend_tile_two_pass too, the loops attend_tile_two_pass_simd reproduces, so
 * tests can check that both give the same floats (a runtime argument, so both are the code the engine runs). */
static void attend_tile_any(const float *query, const float *k_cache, const float *v_cache, const int32_t *table,
                            int32_t page_offset, int32_t q_start, int32_t q_len, int32_t seqlen_k, int32_t row_start,
                            int32_t kv_head_begin, int32_t kv_head_end, int32_t num_heads, int32_t num_kv_heads,
                            int32_t head_dim,
                            int32_t page_size, float scale, float softcap, const float *sinks,
                            int32_t sliding_window, float *out, float *scratch, int32_t lane_loops) {
    const TileKeys keys = tile_keys(q_len, seqlen_k, row_start, sliding_window);
    const int rows = keys.rows;
    const int64_t score_floats = (int64_t)(kv_head_end - kv_head_begin) * rows * (num_heads / num_kv_heads)
                                 * (keys.last_pos - keys.lo + 1 + KEY_BLOCK);
    const int two_pass = score_floats <= TWO_PASS_MAX_SCORES;
    float *two_pass_scratch = scratch + tile_scratch_floats(num_heads, head_dim, page_size);
#define ATTEND(D)                                                                                                 \
    do {                                                                                                          \
        if (two_pass && (D) % 8 == 0 && lane_loops)                                                               \
            attend_tile_two_pass_simd(query, k_cache, v_cache, table, page_offset, q_start, q_len, seqlen_k,      \
                                      row_start, kv_head_begin, kv_head_end, num_heads, num_kv_heads, D,          \
                                      page_size, scale, softcap, sinks, sliding_window, out, scratch,             \
                                      two_pass_scratch);                                                          \
        else if (two_pass)                                                                                        \
            attend_tile_two_pass(query, k_cache, v_cache, table, page_offset, q_start, q_len, seqlen_k, row_start, \
                                 kv_head_begin, kv_head_end, num_heads, num_kv_heads, D, page_size, scale, softcap, \
                                 sinks, sliding_window, out, two_pass_scratch);                                   \
        else                                                                                                      \
            attend_tile(query, k_cache, v_cache, table, page_offset, q_start, q_len, seqlen_k, row_start,         \
                        kv_head_begin, kv_head_end, num_heads, num_kv_heads, D, page_size, scale, softcap,        \
                        sinks, sliding_window, out, scratch);                                                     \
    } while (0)
    switch (head_dim) {
    case 8: ATTEND(8); break;
    case 16: ATTEND(16); break;
    case 32: ATTEND(32); break;
    case 64: ATTEND(64); break;
    case 128: ATTEND(128); break;
    default: ATTEND(head_dim);
    }
#undef ATTEND
}

/* This thread's scratch of at least `floats` floats, kept between calls (OpenMP's threads live as long as the
 * process, so each allocates once and grows it only for a larger shape; never freed). NULL when out of memory. */
static float *thread_scratch(size_t floats) {
    static _Thread_local float *buffer;
    static _Thread_local size_t capacity;
    if (floats > capacity) {
        free(buffer);
        buffer = malloc(sizeof(float) * floats);
        capacity = buffer ? floats : 0;
    }
    return buffer;
}

/* Work of one item in (query row, key) pairs per KV head: its rows times the keys its last row sees. */
static int64_t item_cost(WorkItem it, const int32_t *cu_seqlens_q, const int32_t *seqlens_k,
                         int32_t sliding_window, int tile_rows) {
    const int q_len = cu_seqlens_q[it.request + 1] - cu_seqlens_q[it.request];
    const int rows = q_len - it.row_start < tile_rows ? q_len - it.row_start : tile_rows;
    int64_t keys = seqlens_k[it.request] - q_len + it.row_start + rows;
    if (sliding_window > 0 && keys > sliding_window + rows) keys = sliding_window + rows;
    return rows * keys * (it.kv_head_end - it.kv_head_begin);
}

static int by_cost_descending(const void *a, const void *b) {
    const int64_t ca = ((const WorkItem *)a)->cost, cb = ((const WorkItem *)b)->cost;
    return ca < cb ? 1 : (ca > cb ? -1 : 0);
}

/* Returns 0, or -1 when scratch memory could not be allocated. Rows of requests with no query rows, and rows past
 * cu_seqlens_q[num_requests], are not written. lane_loops: 1 (the engine), or 0 for the generic loops only (tests;
 * see attend_tile_any). sinks: (num_heads,) float32 attention-sink logits (see sink_weight), or NULL for none.
 *
 * batch_invariant: 1 makes every query row a tile of its own, over all KV heads, attended exactly as a decode row
 * at that position is (one query row, the context up to it): its floats then depend on its own query and keys
 * only, never on the other rows of its tile, the step's other requests, how a prefill was chunked or the thread
 * count. A tile of several rows picks its score method and its two-pass-or-online path by the tile's shape, and
 * heads are split by the number of tiles and threads, so without it a row's floats can change with its batch.
 * The cost: a prefill row reads its keys on its own instead of sharing them with its tile's 16 rows. */
int cbrun_paged_attention_f32(const float *query, const float *k_cache, const float *v_cache,
                              const int32_t *block_tables, int64_t bt_stride, int32_t page_offset,
                              const int32_t *cu_seqlens_q, const int32_t *seqlens_k, int32_t num_requests,
                              int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t page_size,
                              float scale, float softcap, const float *sinks, int32_t sliding_window, float *out,
                              int32_t num_threads, int32_t lane_loops, int32_t batch_invariant) {
    const int threads = num_threads > 0 ? num_threads : 1;
    const int tile_rows = batch_invariant ? 1 : TILE_Q;
    int64_t num_tiles = 0;
    for (int b = 0; b < num_requests; b++) {
        const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
        num_tiles += (q_len + tile_rows - 1) / tile_rows;
    }
    if (num_tiles == 0) return 0;
    /* All KV heads in one item reads pages as contiguous streams, and gives the V pass up to 8 query vectors at
     * once (independent sums; with one head of a GQA group it has 2, and waits on each add); split heads only to
     * give a second thread work (never under batch_invariant: the split decides a tile's path). */
    int head_splits = 1;
    while (!batch_invariant && threads > 1 && head_splits < num_kv_heads && num_tiles * head_splits < 4 * threads)
        head_splits *= 2;
    if (head_splits > num_kv_heads) head_splits = num_kv_heads;
    const int64_t num_items = num_tiles * head_splits;
    WorkItem *items = malloc(sizeof(WorkItem) * (size_t)num_items);
    if (!items) return -1;
    int64_t n = 0;
    for (int b = 0; b < num_requests; b++) {
        const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
        for (int row = 0; row < q_len; row += tile_rows)
            for (int split = 0; split < head_splits; split++)
                items[n++] = (WorkItem){b, row, (int32_t)((int64_t)num_kv_heads * split / head_splits),
                                        (int32_t)((int64_t)num_kv_heads * (split + 1) / head_splits), 0};
    }
    /* Largest items first, so that the threads' last items are small ones and they finish together (the longest-
     * processing-time-first rule). Which thread runs an item never changes its floats. */
    if (threads > 1) {
        for (int64_t i = 0; i < num_items; i++)
            items[i].cost = item_cost(items[i], cu_seqlens_q, seqlens_k, sliding_window, tile_rows);
        qsort(items, (size_t)num_items, sizeof(WorkItem), by_cost_descending);
    }
    const size_t scratch_floats = tile_scratch_floats(num_heads, head_dim, page_size)
                                 + (size_t)head_dim * (page_size + KEY_BLOCK) + TWO_PASS_MAX_SCORES;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = thread_scratch(scratch_floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 2)
        for (int64_t i = 0; i < num_items; i++) {
            if (!scratch) continue;
            const WorkItem it = items[i];
            const int32_t b = it.request;
            int32_t q_start = cu_seqlens_q[b], q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
            int32_t seqlen_k = seqlens_k[b], row_start = it.row_start;
            if (batch_invariant) { /* row r as a one-row request at its position: a decode row's call */
                q_start += row_start;
                seqlen_k -= q_len - row_start - 1;
                q_len = 1;
                row_start = 0;
            }
            attend_tile_any(query, k_cache, v_cache, block_tables + (int64_t)b * bt_stride, page_offset, q_start,
                            q_len, seqlen_k, row_start, it.kv_head_begin, it.kv_head_end, num_heads, num_kv_heads,
                            head_dim, page_size, scale, softcap, sinks, sliding_window, out, scratch, lane_loops);
        }
    }
    free(items);
    return failed ? -1 : 0;
}

/* Store num_tokens tokens' K and V rows (row_floats = num_kv_heads * head_dim floats each, rows of key and value
 * contiguous) at cache slots slots[t] + slot_offset of k_cache / v_cache (num_slots rows each). A negative slot
 * (a padding token) is skipped. Every slot is checked before anything is written: returns -1, the cache untouched,
 * when one lies outside [0, num_slots), else 0. A plain copy, so the same bits as the PyTorch reference's
 * index_copy_ (cbrun/kernels/reference.py write_kv_cache_ref). */
int cbrun_write_kv_f32(const float *key, const float *value, float *k_cache, float *v_cache, const int64_t *slots,
                       int64_t num_tokens, int64_t row_floats, int64_t slot_offset, int64_t num_slots) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= 0 && (slots[t] + slot_offset < 0 || slots[t] + slot_offset >= num_slots)) return -1;
    const size_t row_bytes = sizeof(float) * (size_t)row_floats;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        const int64_t slot = slots[t] + slot_offset;
        memcpy(k_cache + slot * row_floats, key + t * row_floats, row_bytes);
        memcpy(v_cache + slot * row_floats, value + t * row_floats, row_bytes);
    }
    return 0;
}

/* RoPE in place on x (num_rows, num_heads, head_dim), row t at position positions[t], rotating the two halves of
 * each head as transformers' rotate_half does: x * cos + rotate_half(x) * sin, with the tables of cbrun/engine/lean_llama.py
 * (cos_table, and sin_signed, whose first half is negated, both (num_positions, head_dim)). The products and the
 * sum are rounded one at a time, as the three PyTorch ops round them: contracting them into fused multiply-adds
 * (GCC's default) would change the floats, so it is off for this function. Returns -1, x untouched, when a
 * position lies outside [0, num_positions), else 0. head_dim is even. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
int cbrun_rope_f32(float *x, const float *cos_table, const float *sin_signed, const int64_t *positions,
                   int64_t num_rows, int32_t num_heads, int32_t head_dim, int64_t num_positions) {
    for (int64_t t = 0; t < num_rows; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
    const int half = head_dim / 2;
    for (int64_t t = 0; t < num_rows; t++) {
        const float *c = cos_table + positions[t] * head_dim, *s = sin_signed + positions[t] * head_dim;
        for (int h = 0; h < num_heads; h++) {
            float *row = x + (t * num_heads + h) * head_dim;
            for (int d = 0; d < half; d++) {
                const float lo = row[d], hi = row[d + half];
                const float lo_cos = lo * c[d], hi_sin = hi * s[d];
                const float hi_cos = hi * c[d + half], lo_sin = lo * s[d + half];
                row[d] = lo_cos + hi_sin;
                row[d + half] = hi_cos + lo_sin;
            }
        }
    }
    return 0;
}
#pragma GCC pop_options

/* out = silu(gate) * up, elementwise over (num_rows, cols) float32 rows, silu(x) = x * sigmoid(x), with sigmoid
 * from exp_nonpositive(-|x|): 1 / (1 + e) for x >= 0, e / (1 + e) below. Every element takes the same arithmetic
 * whatever its index (the vector lanes and any scalar remainder compute the same IEEE operations), and rows are
 * split over threads whole, so a row's floats never depend on how many rows the call has. PyTorch's F.silu does
 * not promise that: its vector loop leaves the last elements of the whole tensor (and of each thread's share) to
 * a scalar exp with other roundings. out may alias gate or up. */
void cbrun_silu_mul_f32(const float *gate, const float *up, float *out, int64_t num_rows, int64_t cols,
                        int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) schedule(static) if (num_rows * cols > 32768)
    for (int64_t t = 0; t < num_rows; t++) {
        const float *g = gate + t * cols, *u = up + t * cols;
        float *o = out + t * cols;
#pragma omp simd
        for (int64_t j = 0; j < cols; j++) {
            const float x = g[j];
            const float e = exp_nonpositive(x < 0.f ? x : -x);
            const float sigmoid = (x < 0.f ? e : 1.f) / (1.f + e);
            o[j] = x * sigmoid * u[j];
        }
    }
}

/* 1: cbrun_paged_attention_f32 takes the sinks argument (cbrun/kernels/cpu_attention.py binds a library by it: a
 * library built from an older checkout's source, for a paired benchmark, has neither). */
int cbrun_paged_attention_has_sinks(void) { return 1; }
