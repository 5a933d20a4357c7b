/* Dequantizing quantized linear weights on the CPU, for cbrun/kernels/cpu_dequant.py.
 *
 * Each function writes rows [row_start, row_start + rows) of the real weight as float32, row-major, one rounding
 * per value (the bits of the PyTorch references in cbrun/engine/model/layers/quantization/fp8.py and int4.py, and
 * cbrun/kernels/quantized_reference.py for MXFP4):
 *
 *   fp8 block:  out[i][j] = lut[q[i][j]] * scale[i / bo][j / bi]          (lut: the 256 float8_e4m3fn values)
 *   int4 group: out[i][j] = (float)(code(i, j) - zero[i][j / g]) * scale[i][j / g],
 *               code(i, j) = (packed[i][j / 8] >> 4 * (j % 8)) & 15
 *   mxfp4:      out[i][j] = ldexp(e2m1(code(i, j)), scale[i][j / 32] - 127),
 *               code(i, j) = (blocks[i][j / 2] >> 4 * (j % 2)) & 15, computed as the exact product
 *               (2 * e2m1) * 2^(scale - 128) (both factors exact floats, the result ldexp's; see cbrun_mxfp4_dequant)
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

/* 2 * the FP4 E2M1 value of each code (integers, exact): sign bit 3, exponent bits 2..1, mantissa bit 0. */
static const float E2M1_TWICE[16] = {0.f, 1.f, 2.f, 3.f, 4.f, 6.f, 8.f, 12.f, -0.f, -1.f, -2.f, -3.f, -4.f, -6.f, -8.f, -12.f};

/* 2^(s - 128) as a float, exactly, for the E8M0 code s in 0..255: normal for s >= 2, subnormal below. */
static float pow2_e8m0_half(int32_t s) {
    union {
        uint32_t u;
        float f;
    } v;
    v.u = s >= 2 ? (uint32_t)(s - 1) << 23 : 1u << (21 + s);
    return v.f;
}

void cbrun_mxfp4_dequant(const uint8_t *blocks, const uint8_t *scales, float *out, int64_t row_start, int64_t rows,
                         int64_t cols, int num_threads) {
    /* ldexp(v, s - 127) == (2v) * 2^(s - 128): 2v is an integer of at most 12 and 2^(s - 128) a float (2^-128 is
     * subnormal), so the product is exact unless it overflows, where ldexp overflows too (ldexp(0.5, 128) = 2^127
     * stays finite both ways, which 0.5 * 2^128 would not). */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = row_start + r;
        const uint8_t *bi = blocks + i * (cols / 2);
        const uint8_t *si = scales + i * (cols / 32);
        float *oi = out + r * cols;
        for (int64_t g = 0; g < cols / 32; g++) {
            const float p = pow2_e8m0_half(si[g]);
            for (int64_t j = 0; j < 16; j++) {
                const uint8_t byte = bi[g * 16 + j];
                oi[g * 32 + 2 * j] = E2M1_TWICE[byte & 15] * p;
                oi[g * 32 + 2 * j + 1] = E2M1_TWICE[byte >> 4] * p;
            }
        }
    }
}
