/* The CPU's draw of sampled rows: temperature, top-k, top-p, min-p, the seeded counter-based uniform and the
 * inverse-CDF pick, one call per step for all of them.
 *
 * The algorithm is the sampler's (cbrun/engine/sample/sampler.py, draw_filtered): a row's target is its softmax p
 * restricted to the set T its filters keep (an upper set of p: p(x) >= its k-th largest p and >= min_p * max p, and
 * the mass of the tokens more likely than x below top_p of the top-k set's mass). A token x is drawn from p over a
 * candidate set S (first every token) by the inverse CDF with uniform(seed, position, round); when x is in T it is
 * the row's token, else every token no more likely than x leaves S and the row draws again with the next round's
 * number. T stays inside S, so an accepted x is distributed as p given T (the pivot idea of FlashInfer's
 * sorting-free top-k / top-p sampling). S shrinks every round and always holds the most likely token, which T
 * holds, so a row ends in at most V rounds (most end in the first).
 *
 * The floats. Each row is computed alone, in a fixed order that depends only on V (16 float32 lanes, blocks of
 * 64), so a row's token does not depend on its batch or on the number of threads. Weights are
 * 2^((x - max) * log2(e) / T) in float32 by our exp2 (exp2_nonpositive); sums are float32 lanes per block, then
 * float64, and the inverse-CDF target float64. The weights are not torch's softmax, so a draw whose number lands
 * within about 1e-6 of a boundary may differ from the PyTorch sampler's (tests/kernels/test_cpu_sampler.py
 * compares the two: the same tokens on thousands of random rows).
 *
 * The random stream is the sampler's: uniform = ((mix64(key + draw) >> 11) + 0.5) * 2^-53, where key is the row's
 * row_keys value mix64(seed_hash + position), seed_hash = mix64(seed), and mix64 is SplitMix64's finaliser of x + golden (Steele, Lea and
 * Flood 2014; the constants are Vigna's splitmix64.c).
 *
 * Built by cbrun/kernels/c_build.py and called through ctypes by cbrun/kernels/cpu_sampler.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* The sampler's error codes (cbrun/engine/sample/sampler.py). */
#define CBRUN_OK 0
#define CBRUN_NAN_LOGITS 1
#define CBRUN_NOTHING_LEFT 2
#define CBRUN_OUT_OF_VOCAB 3

#define LANES 16
#define BLOCK 64

static inline uint64_t mix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* uniform_of(key, draw): in (0, 1), never 0 or 1. */
static inline double uniform_of(uint64_t key, uint64_t draw) {
    return ((double)(mix64(key + draw) >> 11) + 0.5) * 0x1p-53;
}

/* 16 lanes: one AVX-512 register, two AVX2 ones (the compiler splits them); the floats are the same on both. */
typedef float f32xL __attribute__((vector_size(64)));
typedef int32_t i32xL __attribute__((vector_size(64)));

static inline f32xL splat(float x) { return x - (f32xL){0}; }

static inline f32xL load(const float *p) {
    f32xL v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* a where mask (all ones), else b */
static inline f32xL select_lanes(i32xL mask, f32xL a, f32xL b) { return (f32xL)((mask & (i32xL)a) | (~mask & (i32xL)b)); }

/* The lanes' sum in float64, lane 0 first (one fixed order). */
static inline double sum_lanes(f32xL v) {
    double sum = 0.0;
    for (int j = 0; j < LANES; j++) {
        sum += (double)v[j];
    }
    return sum;
}

/* 2^y for y <= 0 in LANES lanes (0 below -126, where float32 turns subnormal, and for NaN): y split into an
 * integer n and f in [-1/2, 1/2], 2^f by Cephes' degree-6 polynomial for exp2f (about 1 ulp), 2^n by the exponent
 * bits. 2^0 is exactly 1. Scores reach it as (x - max) * log2(e) / T: one product, so a weight's relative error
 * grows with |y| (2e-6 at weight 1e-6), far below any weight that matters to a draw. */
static inline f32xL exp2_nonpositive(f32xL y) {
    const i32xL under = ~(y >= splat(-126.0f)); /* -inf, NaN (-inf * 0 at an infinite temperature) included */
    const f32xL shifter = splat(12582912.0f);    /* 1.5 * 2^23: adding it rounds to an integer in the low bits */
    const f32xL t = y + shifter;
    const f32xL f = y - (t - shifter);
    f32xL p = splat(1.535336188319500e-4f);
    p = p * f + splat(1.339887440266574e-3f);
    p = p * f + splat(9.618437357674640e-3f);
    p = p * f + splat(5.550332471162809e-2f);
    p = p * f + splat(2.402264791363012e-1f);
    p = p * f + splat(6.931472028550421e-1f);
    p = p * f + splat(1.0f);
    const i32xL scale = ((i32xL)t << 23) + (int32_t)((uint32_t)(127 - 0x4B400000) << 23); /* 2^n */
    return (f32xL)((i32xL)(p * (f32xL)scale) & ~under);
}

/* The row's largest score, and whether it holds a NaN. */
static float row_max(const float *x, int64_t width, int *nan) {
    f32xL top_l = splat(-INFINITY);
    i32xL nan8 = {0};
    int64_t i = 0;
    for (; i + LANES <= width; i += LANES) {
        const f32xL v = load(x + i);
        nan8 |= v != v;
        top_l = select_lanes(v > top_l, v, top_l);
    }
    float top = -INFINITY;
    int any = 0;
    for (int j = 0; j < LANES; j++) {
        any |= nan8[j] != 0;
        top = top_l[j] > top ? top_l[j] : top;
    }
    for (; i < width; i++) {
        any |= x[i] != x[i];
        top = x[i] > top ? x[i] : top;
    }
    *nan = any;
    return top;
}

/* The mass of the weights above `pivot`, and per block the same sum (as row_weights'). */
static double mass_above(const float *w, int64_t padded, float pivot, double *block_sums) {
    const f32xL pivot_l = splat(pivot), zero = splat(0.0f);
    double total = 0.0;
    for (int64_t b = 0; b < padded; b += BLOCK) {
        f32xL lanes_sum = zero;
        for (int64_t i = b; i < b + BLOCK; i += LANES) {
            const f32xL v = load(w + i);
            lanes_sum += select_lanes(v > pivot_l, v, zero);
        }
        const double sum = sum_lanes(lanes_sum);
        block_sums[b / BLOCK] = sum;
        total += sum;
    }
    return total;
}

/* The row's weights w[i] = exp((x[i] - top) / temperature) (when top is +inf: 1 on +inf scores, 0 elsewhere), 0
 * past the width up to `padded` (a multiple of BLOCK), and per block of BLOCK weights their sum (mass_above's
 * order: float lanes, then float64 in lane order). Returns the total (the blocks' sums in order, float64). */
static double row_weights(const float *x, int64_t width, int64_t padded, float top, float temperature, float *w,
                          double *block_sums) {
    if (top == INFINITY) {
        for (int64_t i = 0; i < width; i++) {
            w[i] = x[i] == INFINITY ? 1.0f : 0.0f;
        }
        for (int64_t i = width; i < padded; i++) {
            w[i] = 0.0f;
        }
        return mass_above(w, padded, 0.0f, block_sums);
    }
    /* (x - top) * log2(e) / T as one product, unless that factor overflows float32 (a tiny temperature) */
    const float factor = 1.44269504088896341f / temperature;
    const int multiply = isfinite(factor);
    const f32xL top_l = splat(top), factor_l = splat(factor), temperature_l = splat(temperature);
    const f32xL log2e_l = splat(1.44269504088896341f);
    const int64_t whole = multiply ? width / BLOCK * BLOCK : 0; /* blocks read straight from the row */
    double total = 0.0;
    for (int64_t b = 0; b < whole; b += BLOCK) {
        f32xL lanes_sum = splat(0.0f);
        for (int64_t i = b; i < b + BLOCK; i += LANES) {
            const f32xL e = exp2_nonpositive((load(x + i) - top_l) * factor_l);
            memcpy(w + i, &e, sizeof(e));
            lanes_sum += e;
        }
        const double sum = sum_lanes(lanes_sum);
        block_sums[b / BLOCK] = sum;
        total += sum;
    }
    for (int64_t b = whole; b < padded; b += BLOCK) { /* the last partial block (-inf past the row: weight 0) */
        f32xL lanes_sum = splat(0.0f);
        for (int64_t i = b; i < b + BLOCK; i += LANES) {
            f32xL v = splat(-INFINITY);
            for (int64_t j = i; j < width && j < i + LANES; j++) {
                v[j - i] = x[j];
            }
            const f32xL y = multiply ? (v - top_l) * factor_l : (v - top_l) / temperature_l * log2e_l;
            const f32xL e = exp2_nonpositive(y);
            memcpy(w + i, &e, sizeof(e));
            lanes_sum += e;
        }
        const double sum = sum_lanes(lanes_sum);
        block_sums[b / BLOCK] = sum;
        total += sum;
    }
    return total;
}

/* The mass of the weights at least `bound` (the top-k set), summed as mass_above's. */
static double mass_at_least(const float *w, int64_t padded, float bound) {
    const f32xL bound_l = splat(bound), zero = splat(0.0f);
    double total = 0.0;
    for (int64_t b = 0; b < padded; b += BLOCK) {
        f32xL lanes_sum = zero;
        for (int64_t i = b; i < b + BLOCK; i += LANES) {
            const f32xL v = load(w + i);
            lanes_sum += select_lanes(v >= bound_l, v, zero);
        }
        total += sum_lanes(lanes_sum);
    }
    return total;
}

/* The inverse-CDF pick among the weights above `pivot` (>= 0, so never a token of weight 0): the first token whose
 * cumulative weight exceeds target (< the blocks' total). Rounding may leave the cumulative sum short of the
 * target: then the last token above the pivot. -1 when no weight is above it. */
static int64_t pick(const float *w, int64_t padded, float pivot, const double *block_sums, double target) {
    double cumulative = 0.0;
    for (int64_t b = 0; b < padded; b += BLOCK) {
        const double block = block_sums[b / BLOCK];
        if (!(block > 0.0)) {
            continue;
        }
        if (cumulative + block <= target) { /* the draw lies past this block */
            cumulative += block;
            continue;
        }
        for (int64_t i = b; i < b + BLOCK; i++) {
            if (w[i] > pivot) {
                cumulative += (double)w[i];
                if (cumulative > target) {
                    return i;
                }
            }
        }
    }
    for (int64_t i = padded - 1; i >= 0; i--) {
        if (w[i] > pivot) {
            return i;
        }
    }
    return -1;
}

/* The k-th largest of the n weights (1 <= k <= n), by selection on a copy in `scratch` (Hoare's partition). */
static float kth_largest(const float *w, int64_t n, int64_t k, float *scratch) {
    memcpy(scratch, w, (size_t)n * sizeof(float));
    int64_t lo = 0, hi = n - 1, want = k - 1; /* the index `want` of the array sorted in descending order */
    while (lo < hi) {
        float pivot = scratch[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (scratch[i] > pivot) {
                i++;
            }
            while (scratch[j] < pivot) {
                j--;
            }
            if (i <= j) {
                float t = scratch[i];
                scratch[i] = scratch[j];
                scratch[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j) {
            hi = j;
        } else if (want >= i) {
            lo = i;
        } else {
            break; /* between j and i every value equals the pivot */
        }
    }
    return scratch[want];
}

/* One row's token, or its error code (negative: -1 - code). w: `padded` floats; scratch: `width` floats;
 * block_sums: padded / BLOCK. */
static int64_t draw_row(const float *x, int64_t width, int64_t padded, float temperature, int64_t top_k, float top_p,
                        float min_p, uint64_t key, float *w, float *scratch, double *block_sums) {
    int nan = 0;
    const float top = row_max(x, width, &nan);
    if (nan) {
        return -1 - CBRUN_NAN_LOGITS;
    }
    if (top == -INFINITY) {
        return -1 - CBRUN_NOTHING_LEFT;
    }
    if (!(temperature > 0.0f)) {
        return -1 - CBRUN_OUT_OF_VOCAB; /* no distribution (a NaN temperature) */
    }
    double total = row_weights(x, width, padded, top, temperature, w, block_sums);
    if (!(total > 0.0) || !isfinite(total)) {
        return -1 - CBRUN_OUT_OF_VOCAB;
    }
    /* The bounds in weight units: the largest weight is exactly 1, so min_p * max p is min_p's weight. */
    const int top_k_on = top_k > 0 && top_k < width;
    const float kth = top_k_on ? kth_largest(w, width, top_k, scratch) : 0.0f;
    const float floor_w = min_p > kth ? min_p : kth;
    double budget = INFINITY;
    if (top_p < 1.0f) { /* top_p of the top-k set's mass (all of it without one) */
        budget = (double)top_p * (kth > 0.0f ? mass_at_least(w, padded, kth) : total);
    }
    const int filtered = floor_w > 0.0f || top_p < 1.0f;
    float pivot = 0.0f; /* the candidates: every token of positive weight */
    for (uint64_t round = 0; round <= (uint64_t)width; round++) {
        const int64_t token = pick(w, padded, pivot, block_sums, uniform_of(key, round) * total);
        if (token < 0) {
            return -1 - CBRUN_OUT_OF_VOCAB;
        }
        if (!filtered) {
            return token;
        }
        const float chosen = w[token];
        /* the mass above the draw, and its blocks: the next round's candidates when the draw is rejected */
        const double above = mass_above(w, padded, chosen, block_sums);
        if ((chosen >= floor_w && above < budget) || !(above > 0.0)) { /* nothing above: the most likely token */
            return token;
        }
        pivot = chosen;
        total = above;
    }
    return -1 - CBRUN_NOTHING_LEFT; /* not reached: every round leaves at least one token fewer */
}

/* For each i < num_rows: out[i] = the token drawn for logits row rows[i] (row i when rows is NULL), or -1 - its error code (NaN scores:
 * CBRUN_NAN_LOGITS; every score -inf: CBRUN_NOTHING_LEFT; no finite distribution: CBRUN_OUT_OF_VOCAB).
 *
 * logits: float32 rows of `width` contiguous values, `stride` floats apart. temperature, top_k (0 off), top_p (1
 * off), min_p (0 off), seed_hashes (mix64 of the row's stream key, as unsigned 64-bit patterns) and positions (its
 * output position): per row i. Returns 0, or -1 when the scratch memory cannot be allocated. */
int cbrun_sample_rows_f32(const float *logits, int64_t stride, int64_t width, const int64_t *rows, int64_t num_rows,
                          const float *temperature, const int64_t *top_k, const float *top_p, const float *min_p,
                          const uint64_t *seed_hashes, const int64_t *positions, int64_t *out, int num_threads) {
    const int64_t padded = (width + BLOCK - 1) / BLOCK * BLOCK;
    const int64_t num_blocks = padded / BLOCK;
    const int threads = num_threads > 1 ? num_threads : 1;
    /* per thread: the block sums, the weights and the selection's copy of one row */
    size_t per_thread = (size_t)num_blocks * sizeof(double) + (size_t)(padded + width) * sizeof(float);
    per_thread = (per_thread + 63) / 64 * 64;
    char *memory = malloc(per_thread * (size_t)threads);
    if (memory == NULL) {
        return -1;
    }
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t i = 0; i < num_rows; i++) {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        char *mine = memory + per_thread * (size_t)t;
        double *block_sums = (double *)mine;
        float *w = (float *)(mine + (size_t)num_blocks * sizeof(double));
        float *scratch = w + padded;
        out[i] = draw_row(logits + (rows != NULL ? rows[i] : i) * stride, width, padded, temperature[i], top_k[i], top_p[i], min_p[i],
                          mix64(seed_hashes[i] + (uint64_t)positions[i]), w, scratch, block_sums);
    }
    free(memory);
    return 0;
}
