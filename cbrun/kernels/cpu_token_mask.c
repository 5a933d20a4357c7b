/* Structured outputs on the CPU: the argmax of logit rows under xgrammar's packed token bitmask.
 *
 * The bitmask layout is xgrammar's (allocate_token_bitmask): bit j of int32 word i allows token 32 * i + j. The
 * masked argmax reads the packed words as they are and the allowed logits only; nothing is written to the logits,
 * so a step pays one read of its constrained rows instead of a masked copy of them and a second pass for the
 * maximum (what xgrammar's apply_token_bitmask_inplace followed by torch.max costs).
 *
 * Built by cbrun/kernels/c_build.py (-O3 -march=native -fopenmp) and called through ctypes by cbrun/kernels/token_mask.py.
 */
#include <math.h>
#include <stdint.h>

#define CBRUN_NOTHING_ALLOWED (-1)
#define CBRUN_NAN_ALLOWED (-2)

/* The first index of the largest allowed logit of one row, CBRUN_NOTHING_ALLOWED when no allowed logit is above
 * -inf, or CBRUN_NAN_ALLOWED when an allowed logit is NaN. "First" matches torch.argmax on the masked row. */
static int64_t row_masked_argmax(const float *row, const int32_t *words, int64_t width) {
    float best = -INFINITY;
    int64_t best_index = CBRUN_NOTHING_ALLOWED;
    int64_t num_words = (width + 31) / 32;
    for (int64_t w = 0; w < num_words; w++) {
        uint32_t bits = (uint32_t)words[w];
        int64_t base = w * 32;
        int64_t left = width - base;
        if (left < 32) {
            bits &= (1u << left) - 1u; /* tokens past the logits' width do not exist */
        }
        if (bits == 0) {
            continue;
        }
        const float *x = row + base;
        if (bits == 0xFFFFFFFFu) {
            /* A fully allowed word (most words in free text): one branch-free pass, then a scan only when the
             * word holds a new maximum. */
            float top = -INFINITY;
            int nan = 0;
            for (int j = 0; j < 32; j++) {
                float v = x[j];
                nan |= v != v;
                top = v > top ? v : top;
            }
            if (nan) {
                return CBRUN_NAN_ALLOWED;
            }
            if (top > best) {
                int j = 0;
                while (x[j] != top) {
                    j++;
                }
                best = top;
                best_index = base + j;
            }
            continue;
        }
        while (bits) {
            int j = __builtin_ctz(bits);
            bits &= bits - 1u;
            float v = x[j];
            if (v != v) {
                return CBRUN_NAN_ALLOWED;
            }
            if (v > best) {
                best = v;
                best_index = base + j;
            }
        }
    }
    return best_index;
}

/* For each i < num_rows: out[i] = the masked argmax of logits row rows[i] under bitmask row mask_rows[i].
 *
 * logits: float32 rows of `width` contiguous values, `logits_stride` floats apart.
 * bitmask: int32 rows of `num_words` words, `mask_stride` words apart; tokens at or past 32 * num_words are
 * disallowed. Returns 0; out holds a token id, CBRUN_NOTHING_ALLOWED or CBRUN_NAN_ALLOWED per row. */
int cbrun_masked_argmax_f32(const float *logits, int64_t logits_stride, int64_t width, const int32_t *bitmask,
                            int64_t mask_stride, int64_t num_words, const int64_t *rows, const int64_t *mask_rows,
                            int64_t num_rows, int64_t *out, int num_threads) {
    int64_t readable = width < 32 * num_words ? width : 32 * num_words;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_rows; i++) {
        out[i] = row_masked_argmax(logits + rows[i] * logits_stride, bitmask + mask_rows[i] * mask_stride, readable);
    }
    return 0;
}

/* For each i < num_rows: logits row rows[i] gets -inf at every token bitmask row mask_rows[i] does not allow
 * (tokens at or past 32 * num_words included), in place. The same floats as xgrammar's
 * apply_token_bitmask_inplace; a fully allowed word (most of a free-text row) is skipped without touching the row. */
int cbrun_apply_token_bitmask_f32(float *logits, int64_t logits_stride, int64_t width, const int32_t *bitmask,
                                  int64_t mask_stride, int64_t num_words, const int64_t *rows,
                                  const int64_t *mask_rows, int64_t num_rows, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * logits_stride;
        const int32_t *words = bitmask + mask_rows[i] * mask_stride;
        for (int64_t base = 0; base < width; base += 32) {
            int64_t w = base / 32;
            uint32_t bits = w < num_words ? (uint32_t)words[w] : 0u;
            int64_t count = width - base < 32 ? width - base : 32;
            if (bits == 0xFFFFFFFFu) {
                continue;
            }
            for (int64_t j = 0; j < count; j++) {
                if (!((bits >> j) & 1u)) {
                    row[base + j] = -INFINITY;
                }
            }
        }
    }
    return 0;
}
