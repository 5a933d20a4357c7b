/* The routed experts of one MoE layer on the CPU (SiLU-gated experts, no biases), one call per layer and step.
 *
 * At decode a MoE layer reads far more weight bytes than it does arithmetic: each expert a step hits sees a few
 * rows (T * k / E on average), so the layer is a stream over the hit experts' weights. A GEMM library's blocking
 * pays off only with more rows; at 1 to 4 rows torch.mm streams the weights at a third of the bandwidth a plain
 * pass reaches. Here every weight row (K contiguous values) is read once, in memory order, and dotted with each of
 * the expert's rows while it sits in L1 (up to ROWS_AT_ONCE rows at a time, each with its own 16-lane
 * accumulator): one sequential stream per expert, which the hardware prefetcher follows.
 *
 *   1. group: the (token, slot) pairs sorted by expert (a stable counting sort: (token, slot) order within an
 *      expert), and the active experts listed;
 *   2. gate_up: for each active expert e and each row n of gate_up[e] (2I rows of K = hidden values),
 *      gu[p][n] = dot(x[token(p)], gate_up[e][n]) for the expert's pairs p;
 *   3. h[p] = silu(gu[p][:I]) * gu[p][I:];
 *   4. down: y[pair][n] = dot(h[p], down[e][n]) (hidden rows of K = I values);
 *   5. out[t] = sum over j = 0..k-1, in that order, of w[t][j] * y[t * k + j]: transformers' summation order
 *      (integrations/moe.py: each expert's output times its weight, then the sum over the slots).
 *
 * The floats. A dot product runs over 16-lane blocks of K in order (the last block zero-padded), the lanes added
 * by one fixed tree, products and sums as separate operations (no fused multiply-add: c_build's -ffp-contract=off):
 * so a row's result depends on its values and K alone, never on how many rows its expert has, which other tokens
 * share the step, or the thread count. The sums are float32. bfloat16 values are widened to float32 in registers,
 * and every intermediate torch would store in bfloat16 (the gate_up and down outputs, silu(gate), its product with
 * up, the weighted outputs where the routing weights are bfloat16 too) is rounded to bfloat16 at the same point
 * (round to nearest even), so the kernel follows the grouped GEMM path's roundings.
 *
 * Threads (OpenMP, num_threads): the (expert, block of weight rows) items of each phase, statically split.
 * The lanes' tree uses __builtin_shufflevector (GCC 12 or clang); where the compiler lacks it the build fails and
 * the MoE block keeps its PyTorch path, saying why.
 *
 * Built by cbrun/kernels/c_build.py and called through ctypes by cbrun/kernels/cpu_moe.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
/* Rows dotted with a weight row at once: their accumulators stay in registers beside the weight and row vectors. */
#define ROWS_AT_ONCE 4
/* An expert with at least WIDE_FROM rows takes its weight rows two at a time (each row vector loaded once for both:
 * the loads, not the arithmetic, bound a 1-weight-row tile there), with a software prefetch PREFETCH_AHEAD values
 * ahead in each: two interleaved rows break the sequential stream the hardware prefetcher follows (on a Zen 4
 * core, one row at a time streams at about 25 GB/s, two at 10 without the prefetch). Measured on a Zen 4 core: 20%
 * faster at 16 and 32 rows an expert, no change at 2. */
#define WIDE_FROM 5
#define NWIDE 2
#define PREFETCH_AHEAD 512
/* weight rows per work item of the OpenMP split */
#define ROWS_PER_ITEM 32

#define CBRUN_MOE_OK 0
#define CBRUN_MOE_NO_MEMORY 1
#define CBRUN_MOE_BAD_EXPERT 2

/* 16 lanes: one AVX-512 register, two AVX2 ones (the compiler splits them); the floats are the same on both. */
typedef float f32xL __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16xL __attribute__((vector_size(32)));
typedef uint32_t u32xL __attribute__((vector_size(64)));

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* torch's float -> bfloat16: round to nearest even, NaN kept quiet */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fc0;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline f32xL load_f32(const float *p) {
    f32xL v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline f32xL load_bf16(const uint16_t *p) {
    u16xL h;
    memcpy(&h, p, sizeof(h));
    return (f32xL)(__builtin_convertvector(h, u32xL) << 16);
}

/* LANES weights from k on (bf16 or float32), zeros past K */
static inline f32xL load_weights(const void *w, int bf16, int64_t k, int64_t K) {
    if (k + LANES <= K) {
        return bf16 ? load_bf16((const uint16_t *)w + k) : load_f32((const float *)w + k);
    }
    f32xL v = {0};
    for (int64_t j = k; j < K; j++) {
        v[j - k] = bf16 ? bf16_to_f32(((const uint16_t *)w)[j]) : ((const float *)w)[j];
    }
    return v;
}

/* the lanes' sum by one fixed tree: lane j + lane j + 8, then j + j + 4, then (0 + 2) + (1 + 3) */
static inline float sum_lanes(f32xL v) {
    const f32x8 half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                       __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const f32x4 quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

/* out[r * out_stride + j] = dot(rows[r], w_j) for r < count and j < nw (both constants where inlined; count <=
 * ROWS_AT_ONCE, nw <= NWIDE), w_j the weight row j (w + j * w_stride elements) of K values; the rows are float32,
 * zero-padded to a multiple of LANES. */
static inline __attribute__((always_inline)) void dot_tile(const float *const *rows, int count, int nw, const void *w,
                                                           int64_t w_stride, int bf16, int64_t K, float *out,
                                                           int64_t out_stride) {
    const size_t size = bf16 ? 2 : 4;
    f32xL acc[ROWS_AT_ONCE][NWIDE];
    for (int r = 0; r < count; r++) {
        for (int j = 0; j < nw; j++) {
            acc[r][j] = (f32xL){0};
        }
    }
    for (int64_t k = 0; k < K; k += LANES) {
        f32xL wv[NWIDE];
        for (int j = 0; j < nw; j++) {
            const char *wj = (const char *)w + (size_t)j * (size_t)w_stride * size;
            wv[j] = load_weights(wj, bf16, k, K);
            if (nw > 1) {
                __builtin_prefetch(wj + (k + PREFETCH_AHEAD) * size, 0, 0);
            }
        }
        for (int r = 0; r < count; r++) {
            const f32xL xv = load_f32(rows[r] + k);
            for (int j = 0; j < nw; j++) {
                acc[r][j] += xv * wv[j];
            }
        }
    }
    for (int r = 0; r < count; r++) {
        for (int j = 0; j < nw; j++) {
            out[r * out_stride + j] = sum_lanes(acc[r][j]);
        }
    }
}

static inline __attribute__((always_inline)) void dot_rows_any(const float *const *rows, int64_t count, int nw,
                                                               const void *w, int64_t w_stride, int bf16, int64_t K,
                                                               float *out, int64_t out_stride) {
    for (int64_t r = 0; r < count; r += ROWS_AT_ONCE) {
        const float *const *rr = rows + r;
        float *o = out + r * out_stride;
        switch (count - r < ROWS_AT_ONCE ? count - r : ROWS_AT_ONCE) {
        case 1:
            dot_tile(rr, 1, nw, w, w_stride, bf16, K, o, out_stride);
            break;
        case 2:
            dot_tile(rr, 2, nw, w, w_stride, bf16, K, o, out_stride);
            break;
        case 3:
            dot_tile(rr, 3, nw, w, w_stride, bf16, K, o, out_stride);
            break;
        default:
            dot_tile(rr, 4, nw, w, w_stride, bf16, K, o, out_stride);
        }
    }
}

/* out[r * out_stride + n] for the count rows and weight rows [first, last) of w (row stride w_stride elements) */
static inline __attribute__((always_inline)) void dot_block(const float *const *rows, int64_t count, const void *w,
                                                            int bf16, int64_t w_stride, int64_t K, int64_t first,
                                                            int64_t last, float *out, int64_t out_stride) {
    const size_t size = bf16 ? 2 : 4;
    int64_t n = first;
    if (count >= WIDE_FROM) {
        for (; n + NWIDE <= last; n += NWIDE) {
            dot_rows_any(rows, count, NWIDE, (const char *)w + (size_t)n * (size_t)w_stride * size, w_stride, bf16, K,
                         out + n, out_stride);
        }
    }
    for (; n < last; n++) {
        dot_rows_any(rows, count, 1, (const char *)w + (size_t)n * (size_t)w_stride * size, w_stride, bf16, K,
                     out + n, out_stride);
    }
}

static void dot_block_f32(const float *const *rows, int64_t count, const void *w, int64_t w_stride, int64_t K,
                          int64_t first, int64_t last, float *out, int64_t out_stride) {
    dot_block(rows, count, w, 0, w_stride, K, first, last, out, out_stride);
}

static void dot_block_bf16(const float *const *rows, int64_t count, const void *w, int64_t w_stride, int64_t K,
                           int64_t first, int64_t last, float *out, int64_t out_stride) {
    dot_block(rows, count, w, 1, w_stride, K, first, last, out, out_stride);
}

/* One layer's pairs grouped by expert. */
typedef struct {
    int64_t *start;  /* (E + 1,) expert e's pairs are sorted positions [start[e], start[e + 1]) */
    int64_t *order;  /* (S,) the pair (t * k + j) at each sorted position */
    int64_t *where;  /* (S,) each pair's sorted position */
    int64_t *active; /* the experts with at least one pair, ascending */
    int64_t num_active;
} Groups;

/* A stable counting sort of the pairs by expert; CBRUN_MOE_BAD_EXPERT for an id outside [0, E). */
static int group_pairs(const int64_t *ids, int64_t S, int64_t E, Groups *g) {
    memset(g->start, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < S; p++) {
        if (ids[p] < 0 || ids[p] >= E) {
            return CBRUN_MOE_BAD_EXPERT;
        }
        g->start[ids[p] + 1]++;
    }
    g->num_active = 0;
    for (int64_t e = 0; e < E; e++) {
        if (g->start[e + 1]) {
            g->active[g->num_active++] = e;
        }
        g->start[e + 1] += g->start[e];
    }
    for (int64_t p = 0; p < S; p++) { /* start[e] runs up to expert e's end, then start[] shifts back */
        g->order[g->start[ids[p]]++] = p;
    }
    for (int64_t e = E; e > 0; e--) {
        g->start[e] = g->start[e - 1];
    }
    g->start[0] = 0;
    for (int64_t q = 0; q < S; q++) {
        g->where[g->order[q]] = q;
    }
    return CBRUN_MOE_OK;
}

/* The layer's shapes and flags. */
typedef struct {
    int64_t T, H, k, E, I;
    int64_t gate_up_expert_stride, gate_up_row_stride, down_expert_stride, down_row_stride; /* elements */
    int bf16;                /* x, the experts and out are bfloat16 (else float32) */
    int bf16_route_products; /* the routing weights are bfloat16 values: round each weighted output */
} Shape;

static inline int64_t padded(int64_t n) { return (n + LANES - 1) / LANES * LANES; }

/* xs[t] = x[t] as float32, zero-padded to padded(H) */
static void widen_rows(const void *x, const Shape *s, float *xs, int threads) {
    const int64_t Hp = padded(s->H);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < s->T; t++) {
        float *row = xs + t * Hp;
        for (int64_t i = 0; i < s->H; i++) {
            row[i] = s->bf16 ? bf16_to_f32(((const uint16_t *)x)[t * s->H + i]) : ((const float *)x)[t * s->H + i];
        }
        for (int64_t i = s->H; i < Hp; i++) {
            row[i] = 0.0f;
        }
    }
}

/* out[q][n] = dot(rows[q], weights[e][n]) for every active expert e, its sorted positions q and its N weight rows
 * of K values; the (expert, ROWS_PER_ITEM weight rows) items split over the threads. */
static void experts_gemv(const Groups *g, const float *const *rows, const void *weights, int bf16,
                         int64_t expert_stride, int64_t row_stride, int64_t N, int64_t K, float *out, int threads) {
    const int64_t blocks = (N + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    const size_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t item = 0; item < g->num_active * blocks; item++) {
        const int64_t e = g->active[item / blocks], first = item % blocks * ROWS_PER_ITEM;
        const int64_t last = first + ROWS_PER_ITEM < N ? first + ROWS_PER_ITEM : N;
        const int64_t q = g->start[e], count = g->start[e + 1] - q;
        const void *w = (const char *)weights + (size_t)e * (size_t)expert_stride * size;
        if (bf16) {
            dot_block_bf16(rows + q, count, w, row_stride, K, first, last, out + q * N, N);
        } else {
            dot_block_f32(rows + q, count, w, row_stride, K, first, last, out + q * N, N);
        }
    }
}

/* h[q] = silu(gu[q][:I]) * gu[q][I:], zero-padded to padded(I); gu rounded to bfloat16 first where bf16 (torch's
 * grouped GEMM stores it so), silu's output and the product too. silu(g) = g / (1 + exp(-g)), torch's formula. */
static void silu_and_mul(const float *gu, const Shape *s, int64_t S, float *h, int threads) {
    const int64_t I = s->I, Ip = padded(I);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t q = 0; q < S; q++) {
        const float *gate = gu + q * 2 * I, *up = gate + I;
        float *row = h + q * Ip;
        for (int64_t i = 0; i < I; i++) {
            if (s->bf16) {
                const float g = round_bf16(gate[i]);
                row[i] = round_bf16(round_bf16(g / (1.0f + expf(-g))) * round_bf16(up[i]));
            } else {
                row[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
            }
        }
        for (int64_t i = I; i < Ip; i++) {
            row[i] = 0.0f;
        }
    }
}

/* out[t] = sum over j in order of route[t][j] * y[where[t * k + j]] (y rounded to bfloat16 first where bf16, each
 * product too where the routing weights are bfloat16), float32 sums, written in out's dtype. */
static void weighted_sum(const float *y, const float *route, const Groups *g, const Shape *s, void *out,
                         int threads) {
    const int64_t H = s->H, k = s->k;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < s->T; t++) {
        for (int64_t i = 0; i < H; i++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                const float v = y[g->where[t * k + j] * H + i];
                float product = (s->bf16 ? round_bf16(v) : v) * route[t * k + j];
                acc += s->bf16_route_products ? round_bf16(product) : product;
            }
            if (s->bf16) {
                ((uint16_t *)out)[t * H + i] = f32_to_bf16(acc);
            } else {
                ((float *)out)[t * H + i] = acc;
            }
        }
    }
}

/* Groups' arrays and the float32 work buffers in one allocation (64-byte aligned pieces), or NULL. */
typedef struct {
    Groups g;
    const float **x_rows, **h_rows; /* (S,) each sorted position's row of xs / h */
    float *xs, *gu, *h, *y;         /* (T, Hp), (S, 2I), (S, Ip), (S, H) */
    void *memory;
} Work;

static int allocate(const Shape *s, Work *w) {
    const int64_t S = s->T * s->k, E = s->E;
    const int64_t counts[] = {E + 1, S, S, E, S, S, s->T * padded(s->H), S * 2 * s->I, S * padded(s->I), S * s->H};
    size_t offsets[10], total = 0;
    for (int i = 0; i < 10; i++) {
        offsets[i] = total;
        total += ((size_t)counts[i] * 8 + 63) / 64 * 64; /* 8 bytes an element: enough for every piece */
    }
    char *m = aligned_alloc(64, total);
    if (m == NULL) {
        return CBRUN_MOE_NO_MEMORY;
    }
    w->memory = m;
    w->g.start = (int64_t *)(m + offsets[0]);
    w->g.order = (int64_t *)(m + offsets[1]);
    w->g.where = (int64_t *)(m + offsets[2]);
    w->g.active = (int64_t *)(m + offsets[3]);
    w->x_rows = (const float **)(m + offsets[4]);
    w->h_rows = (const float **)(m + offsets[5]);
    w->xs = (float *)(m + offsets[6]);
    w->gu = (float *)(m + offsets[7]);
    w->h = (float *)(m + offsets[8]);
    w->y = (float *)(m + offsets[9]);
    return CBRUN_MOE_OK;
}

/* The experts' weighted sum for every token: out (T, H) in the experts' dtype.
 *
 * x: (T, H) contiguous; route: (T, k) float32 routing weights; ids: (T, k) int64 expert ids; gate_up: E experts
 * of (2I, H) (strides in elements, unit along H); down: E experts of (H, I) (unit along I). Returns CBRUN_MOE_OK,
 * CBRUN_MOE_NO_MEMORY or CBRUN_MOE_BAD_EXPERT (an id outside [0, E); out is then not written). */
int cbrun_moe_experts(const void *x, const float *route, const int64_t *ids, const void *gate_up, const void *down,
                      void *out, const int64_t *dims, int bf16, int bf16_route_products, int num_threads) {
    const Shape s = {dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8],
                     bf16,    bf16_route_products};
    const int threads = num_threads > 1 ? num_threads : 1;
    const int64_t S = s.T * s.k;
    Work w;
    if (allocate(&s, &w) != CBRUN_MOE_OK) {
        return CBRUN_MOE_NO_MEMORY;
    }
    int status = group_pairs(ids, S, s.E, &w.g);
    if (status == CBRUN_MOE_OK) {
        for (int64_t q = 0; q < S; q++) {
            w.x_rows[q] = w.xs + w.g.order[q] / s.k * padded(s.H);
            w.h_rows[q] = w.h + q * padded(s.I);
        }
        widen_rows(x, &s, w.xs, threads);
        experts_gemv(&w.g, w.x_rows, gate_up, bf16, s.gate_up_expert_stride, s.gate_up_row_stride, 2 * s.I, s.H,
                     w.gu, threads);
        silu_and_mul(w.gu, &s, S, w.h, threads);
        experts_gemv(&w.g, w.h_rows, down, bf16, s.down_expert_stride, s.down_row_stride, s.H, s.I, w.y, threads);
        weighted_sum(w.y, route, &w.g, &s, out, threads);
    }
    free(w.memory);
    return status;
}
