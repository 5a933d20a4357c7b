/* Paged attention for the CPU, float32: reads K/V pages where they lie (no gather), blocked online softmax.
 *
 * The algorithm of kernels/paged_attention.py (FlashAttention-2's online softmax, Dao 2023, over the pages of a
 * block table as in vLLM's paged attention), written for a CPU core: one work item is (request, KV head, tile of
 * up to TILE_Q query rows); it walks the pages its rows need, one page at a time, keeping per query vector a
 * running max, a running sum and an output accumulator. The query heads of a KV head's group share each page, so
 * K and V are read once per tile and never repeated per query head. Work items are spread over OpenMP threads.
 *
 * Layouts (all contiguous, float32 unless said):
 *   query, out:          (T, num_heads, head_dim)
 *   k_cache, v_cache:    (num_pages, page_size, num_kv_heads, head_dim)
 *   block_tables:        (num_requests, bt_stride) int32, page of each logical block (page_offset added)
 *   cu_seqlens_q:        (num_requests + 1,) int32;  seqlens_k: (num_requests,) int32 (this step's tokens included)
 * Query row j of request b sits at position seqlens_k[b] - q_len + j and attends to positions <= its own (and
 * > position - sliding_window when sliding_window > 0). Query head h uses KV head h / (num_heads / num_kv_heads).
 * Built and loaded by kernels/cpu_attention.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_Q 16

typedef struct {
    int32_t request;
    int32_t kv_head;
    int32_t row_start; /* first query row of the tile, relative to the request */
} WorkItem;

/* s[j] = q . k_j for the n_keys (<= 4) keys k_j = k + j * stride: four dot products per pass over q. */
static void dot4(const float *q, const float *k, int64_t stride, int n_keys, int n, float *s) {
    const float *k1 = k + (n_keys > 1 ? stride : 0), *k2 = k + (n_keys > 2 ? 2 * stride : 0);
    const float *k3 = k + (n_keys > 3 ? 3 * stride : 0);
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int i = 0; i < n; i++) {
        s0 += q[i] * k[i];
        s1 += q[i] * k1[i];
        s2 += q[i] * k2[i];
        s3 += q[i] * k3[i];
    }
    const float all[4] = {s0, s1, s2, s3};
    for (int j = 0; j < n_keys; j++) s[j] = all[j];
}

/* a += sum_j p[j] * v_j for the n_keys (<= 4) rows v_j = v + j * stride (missing rows weigh 0). */
static void axpy4(float *a, const float *p, const float *v, int64_t stride, int n_keys, int n) {
    const float p0 = p[0], p1 = n_keys > 1 ? p[1] : 0.f, p2 = n_keys > 2 ? p[2] : 0.f, p3 = n_keys > 3 ? p[3] : 0.f;
    const float *v1 = v + (n_keys > 1 ? stride : 0), *v2 = v + (n_keys > 2 ? 2 * stride : 0);
    const float *v3 = v + (n_keys > 3 ? 3 * stride : 0);
#pragma omp simd
    for (int d = 0; d < n; d++) a[d] += p0 * v[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
}

static void attend_tile(const float *query, const float *k_cache, const float *v_cache, const int32_t *table,
                        int32_t page_offset, int32_t q_start, int32_t q_len, int32_t seqlen_k, int32_t row_start,
                        int32_t kv_head, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                        int32_t page_size, float scale, float softcap, int32_t sliding_window, float *out,
                        float *scratch) {
    const int group = num_heads / num_kv_heads;
    const int rows = q_len - row_start < TILE_Q ? q_len - row_start : TILE_Q;
    const int nvec = rows * group;
    float *acc = scratch;                              /* (nvec, head_dim) */
    float *m = acc + (size_t)nvec * head_dim;          /* (nvec,) running max */
    float *l = m + nvec;                               /* (nvec,) running sum */
    float *s = l + nvec;                               /* (page_size,) scores of one page */
    memset(acc, 0, sizeof(float) * (size_t)nvec * head_dim);
    for (int i = 0; i < nvec; i++) { m[i] = -INFINITY; l[i] = 0.f; }
    const int first_pos = seqlen_k - q_len + row_start;     /* position of the tile's first row */
    const int last_pos = first_pos + rows - 1;
    int lo = 0;
    if (sliding_window > 0 && first_pos - sliding_window + 1 > 0) lo = first_pos - sliding_window + 1;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    for (int page_start = lo - lo % page_size; page_start <= last_pos; page_start += page_size) {
        const int64_t page = (int64_t)table[page_start / page_size] + page_offset;
        const float *k_page = k_cache + page * page_size * token_stride + (int64_t)kv_head * head_dim;
        const float *v_page = v_cache + page * page_size * token_stride + (int64_t)kv_head * head_dim;
        if (page_start + page_size <= last_pos) {  /* the next page's rows are scattered: fetch them early */
            const int64_t next = (int64_t)table[page_start / page_size + 1] + page_offset;
            const float *k_next = k_cache + next * page_size * token_stride + (int64_t)kv_head * head_dim;
            const float *v_next = v_cache + next * page_size * token_stride + (int64_t)kv_head * head_dim;
            for (int t = 0; t < page_size; t++)
                for (int d = 0; d < head_dim; d += 16) {
                    __builtin_prefetch(k_next + t * token_stride + d);
                    __builtin_prefetch(v_next + t * token_stride + d);
                }
        }
        for (int r = 0; r < rows; r++) {
            const int pos = first_pos + r;
            int t_lo = page_start, t_hi = page_start + page_size - 1;  /* keys of this page the row sees */
            if (t_hi > pos) t_hi = pos;
            if (sliding_window > 0 && t_lo < pos - sliding_window + 1) t_lo = pos - sliding_window + 1;
            if (t_lo > t_hi) continue;
            for (int g = 0; g < group; g++) {
                const int vec = r * group + g;
                const float *q = query + ((int64_t)(q_start + row_start + r) * num_heads
                                          + (int64_t)kv_head * group + g) * head_dim;
                const int n_keys = t_hi - t_lo + 1;
                for (int j = 0; j < n_keys; j += 4)
                    dot4(q, k_page + (t_lo + j - page_start) * token_stride, token_stride,
                         n_keys - j < 4 ? n_keys - j : 4, head_dim, s + j);
                float page_max = -INFINITY;
                for (int j = 0; j < n_keys; j++) {
                    float x = s[j] * scale;
                    if (softcap > 0.f) x = softcap * tanhf(x / softcap);
                    s[j] = x;
                    if (x > page_max) page_max = x;
                }
                float *a = acc + (size_t)vec * head_dim;
                if (page_max > m[vec]) {  /* rescale what was summed under the old max */
                    const float correction = expf(m[vec] - page_max);
                    l[vec] *= correction;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) a[d] *= correction;
                    m[vec] = page_max;
                }
                float sum = 0.f;
                for (int j = 0; j < n_keys; j++) {
                    s[j] = expf(s[j] - m[vec]);
                    sum += s[j];
                }
                for (int j = 0; j < n_keys; j += 4)
                    axpy4(a, s + j, v_page + (t_lo + j - page_start) * token_stride, token_stride,
                          n_keys - j < 4 ? n_keys - j : 4, head_dim);
                l[vec] += sum;
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < group; g++) {
            const int vec = r * group + g;
            float *o = out + ((int64_t)(q_start + row_start + r) * num_heads + (int64_t)kv_head * group + g) * head_dim;
            const float inv = 1.f / l[vec];
            const float *a = acc + (size_t)vec * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) o[d] = a[d] * inv;
        }
    }
}

/* Returns 0, or -1 when scratch memory could not be allocated. Rows of requests with no query rows, and rows past
 * cu_seqlens_q[num_requests], are not written. */
int cbrun_paged_attention_f32(const float *query, const float *k_cache, const float *v_cache,
                              const int32_t *block_tables, int64_t bt_stride, int32_t page_offset,
                              const int32_t *cu_seqlens_q, const int32_t *seqlens_k, int32_t num_requests,
                              int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t page_size,
                              float scale, float softcap, int32_t sliding_window, float *out, int32_t num_threads) {
    int64_t num_items = 0;
    for (int b = 0; b < num_requests; b++) {
        const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
        num_items += (int64_t)((q_len + TILE_Q - 1) / TILE_Q) * num_kv_heads;
    }
    if (num_items == 0) return 0;
    WorkItem *items = malloc(sizeof(WorkItem) * (size_t)num_items);
    if (!items) return -1;
    int64_t n = 0;
    for (int b = 0; b < num_requests; b++) {
        const int q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
        for (int row = 0; row < q_len; row += TILE_Q)
            for (int h = 0; h < num_kv_heads; h++) items[n++] = (WorkItem){b, h, row};
    }
    const int group = num_heads / num_kv_heads;
    const size_t scratch_floats = (size_t)TILE_Q * group * (head_dim + 2) + page_size + 4;
    int failed = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < num_items; i++) {
            if (!scratch) continue;
            const WorkItem it = items[i];
            const int32_t b = it.request;
            attend_tile(query, k_cache, v_cache, block_tables + (int64_t)b * bt_stride, page_offset,
                        cu_seqlens_q[b], cu_seqlens_q[b + 1] - cu_seqlens_q[b], seqlens_k[b], it.row_start,
                        it.kv_head, num_heads, num_kv_heads, head_dim, page_size, scale, softcap, sliding_window,
                        out, scratch);
        }
        free(scratch);
    }
    free(items);
    return failed ? -1 : 0;
}
