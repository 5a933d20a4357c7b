/* Dequantizing quantized linear weights on the CPU, for cbrun/kernels/cpu_dequant.py.
 *
 * Both functions write rows [row_start, row_start + rows) of the real weight as float32, row-major, one rounding
 * per value (the bits of the PyTorch references in cbrun/engine/model/quantization.py and int4.py):
 *
 *   fp8 block:  out[i][j] = lut[q[i][j]] * scale[i / bo][j / bi]          (lut: the 256 float8_e4m3fn values)
 *   int4 group: out[i][j] = (float)(code(i, j) - zero[i][j / g]) * scale[i][j / g],
 *               code(i, j) = (packed[i][j / 8] >> 4 * (j % 8)) & 15
 *
 * Rows run in parallel (OpenMP); no fused multiply-adds (one product per value).
 */
#include <stdint.h>

void cbrun_fp8_block_dequant(const uint8_t *q, const float *scale, const float *lut, float *out, int64_t row_start,
                             int64_t rows, int64_t cols, int64_t bo, int64_t bi, int64_t scale_cols, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = row_start + r;
        const uint8_t *qi = q + i * cols;
        const float *si = scale + (i / bo) * scale_cols;
        float *oi = out + r * cols;
        for (int64_t b = 0; b * bi < cols; b++) {
            const float s = si[b];
            const int64_t end = (b + 1) * bi < cols ? (b + 1) * bi : cols;
            for (int64_t j = b * bi; j < end; j++) oi[j] = lut[qi[j]] * s;
        }
    }
}

void cbrun_int4_dequant(const int32_t *packed, const uint8_t *zeros, const float *scales, float *out,
                        int64_t row_start, int64_t rows, int64_t cols, int64_t words, int64_t groups,
                        int64_t group_size, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = row_start + r;
        const uint32_t *pi = (const uint32_t *)packed + i * words;
        const uint8_t *zi = zeros + i * groups;
        const float *si = scales + i * groups;
        float *oi = out + r * cols;
        for (int64_t g = 0; g < groups; g++) {
            const float s = si[g];
            const int32_t z = zi[g];
            const int64_t end = (g + 1) * group_size < cols ? (g + 1) * group_size : cols;
            int64_t j = g * group_size;
            if ((j & 7) == 0) { /* whole words: eight codes from one load */
                for (; j + 8 <= end; j += 8) {
                    const uint32_t u = pi[j >> 3];
                    for (int k = 0; k < 8; k++) oi[j + k] = (float)((int32_t)((u >> (4 * k)) & 15u) - z) * s;
                }
            }
            for (; j < end; j++) {
                const int32_t code = (int32_t)((pi[j >> 3] >> (4 * (j & 7))) & 15u);
                oi[j] = (float)(code - z) * s;
            }
        }
    }
}
