/* The elementwise parts of a decoder layer that torch runs as several passes over memory, as one pass
 * each, for CPUs: RMSNorm (fp32, or bf16 in and out with fp32 arithmetic and torch's roundings at the
 * same places, so a bf16 model's numbers are the ones its Hugging Face module gives up to the order
 * of one sum) and the SiLU-gated product of a gated MLP (fp32).
 *
 * Built by pipeline/engine/cpu_fused.py like the other kernels (system C compiler, -O3, the host's
 * vector instructions, OpenMP) and loaded with ctypes. Portable C with GCC (>= 12) / Clang vector
 * extensions.
 *
 *   rms_norm_*   x, y [rows, dim], w [dim]:  y = w * (x / sqrt(mean(x^2) + eps))
 *                (Llama/Qwen/Mistral RMSNorm: the mean and the scaling in fp32; in bf16 the scaled x
 *                is rounded to bf16 before the product with w, which is rounded again)
 *   silu_mul_f32 gu [rows, 2 * inter] (gate, then up), y [rows, inter]:  y = silu(gate) * up
 *                (silu(x) = x / (1 + e^-x)). fp32 only: a bf16 version (widen, silu, round, multiply,
 *                round) measured 2.7 ms on [2048 x 2 * 1536] here against torch's 1.85 for its two
 *                passes, so bf16 MLPs keep their modules (cpu_fused.py).
 * Rows are spread over the threads when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vmath.h"

enum { MIN_PARALLEL = 1 << 15 };         /* elements: below this, one thread (a decoding step's rows) */

static inline v8 silu8(v8 x) {
    /* e = e^-|x| <= 1, never overflows: x / (1 + e^-x) for x >= 0, x e^x / (1 + e^x) below */
    v8 ax = select8(x < 0, -x, x);
    v8 e = exp8_nonpositive(-ax);
    v8 num = select8(x < 0, x * e, x);
    return num / (1.0f + e);
}

static inline float silu1(float x) {
    v8 v = splat8(x);
    return silu8(v)[0];
}

/* The rows' mean squares, in fp32: eight lanes, then the lanes in order, then the tail. */
static inline float inv_rms(const float *x, int64_t dim, float eps) {
    v8 acc = splat8(0.0f);
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        v8 v = load8(x + i);
        acc += v * v;
    }
    float sum = 0.0f;
    for (int c = 0; c < 8; c++) sum += acc[c];
    for (; i < dim; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)dim + eps);
}

int rms_norm_f32(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        float s = inv_rms(xr, dim, eps);
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) store8(yr + i, load8(w + i) * (load8(xr + i) * s));
        for (; i < dim; i++) yr[i] = w[i] * (xr[i] * s);
    }
    return 0;
}

int rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t dim, float eps,
                  int num_threads) {
    if (dim % 8 != 0) return -2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *yr = y + r * dim;
        v8 acc = splat8(0.0f);
        for (int64_t i = 0; i < dim; i += 8) {
            v8 v = load8_bf16(xr + i);
            acc += v * v;
        }
        float sum = 0.0f;
        for (int c = 0; c < 8; c++) sum += acc[c];
        float s = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i += 8)                 /* hidden.to(bf16), then weight * it */
            store8_bf16(yr + i, load8_bf16(w + i) * round8_bf16(load8_bf16(xr + i) * s));
    }
    return 0;
}

int silu_mul_f32(const float *gu, float *y, int64_t rows, int64_t inter, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *yr = y + r * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) store8(yr + i, silu8(load8(g + i)) * load8(u + i));
        for (; i < inter; i++) yr[i] = silu1(g[i]) * u[i];
    }
    return 0;
}
