/* The elementwise parts of a decoder layer that torch runs as several passes over memory, as one pass
 * each, for CPUs: RMSNorm (fp32, or bf16 in and out with fp32 arithmetic and torch's roundings at the
 * same places, so a bf16 model's numbers are the ones its Hugging Face module gives up to the order
 * of one sum), the residual add before it, the SiLU-gated product of a gated MLP (fp32), and RoPE
 * with the slot store's KV write.
 *
 * Built by pipeline/engine/backends/cpu/fused.py like the other kernels (system C compiler, -O3, the host's
 * vector instructions, OpenMP) and loaded with ctypes, with -ffp-contract=off: no product is fused
 * into a multiply-add, so RoPE's q*cos - q2*sin rounds where torch's ops round and the decoder loop
 * (decoder.py) computes the same numbers as the model's own modules. Portable C with GCC (>= 12)
 * / Clang vector extensions.
 *
 *   rms_norm_*     x, y [rows, dim], w [dim]:  y = w * (x / sqrt(mean(x^2) + eps))
 *                  (Llama/Qwen/Mistral RMSNorm: the mean and the scaling in fp32; in bf16 the scaled x
 *                  is rounded to bf16 before the product with w, which is rounded again)
 *   add_rms_norm_* r, d, y [rows, dim]:  r = r + d (rounded to bf16 in bf16, as torch's add), then
 *                  y = rms_norm(r): a decoder layer's residual add and the next norm in one pass
 *   silu_mul_*     gu [rows, 2 * inter] (gate, then up), y [rows, inter]:  y = silu(gate) * up
 *                  (silu(x) = x / (1 + e^-x)); in bf16 silu(gate) is rounded before the product,
 *                  which is rounded again (torch's two ops). Whether a bf16 MLP takes it is measured
 *                  on the machine (calibrate.py's MLP form).
 *   rope_store_*   the packed new tokens' q, k, v ([tokens, heads * dim] each, any row stride), cos and
 *                  sin [tokens, dim] (the model's rotary embedding at each token's position), the step's
 *                  row table [4, rows] (slot, start, num_new, first packed token): q_out [tokens, heads,
 *                  dim] fp32 = rope(q); the slot store [slots, kv_heads, cap, dim] gets rope(k) and v at
 *                  each token's slot and position. rope(x) = x * cos + rotate_half(x) * sin, with
 *                  rotate_half(x) = (-x[h:], x[:h]) (transformers' apply_rotary_pos_emb); in bf16 each
 *                  product and the sum are rounded to bf16, as torch's bf16 ops do, and q_out holds
 *                  those bf16 values widened. Returns -3 when a row's positions or slot fall outside
 *                  the store.
 * Rows (tokens) are spread over the threads when there are enough of them to pay for it.
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

#ifdef __AVX512F__
static inline __m512 silu_512(__m512 x) {                  /* silu8 in 16 lanes */
    __m512 zero = _mm512_setzero_ps(), ax = _mm512_abs_ps(x);
    __m512 e = exp_nonpositive_512(_mm512_sub_ps(zero, ax));
    __m512 num = _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), x, e);
    return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

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

static inline void norm_row_f32(const float *xr, const float *w, float *yr, int64_t dim, float eps) {
    float s = inv_rms(xr, dim, eps);
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) store8(yr + i, load8(w + i) * (load8(xr + i) * s));
    for (; i < dim; i++) yr[i] = w[i] * (xr[i] * s);
}

/* dim a multiple of 8; where the CPU has AVX-512, 16 lanes as far as they go (its sum of squares: 16 lanes,
 * then the 8-lane tail's, then the lanes in order) */
static inline void norm_row_bf16(const uint16_t *xr, const uint16_t *w, uint16_t *yr, int64_t dim, float eps) {
    float sum = 0.0f;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 acc16 = _mm512_setzero_ps();
    for (; i + 16 <= dim; i += 16) {
        __m512 v = load_bf16_512(xr + i);
        acc16 = _mm512_add_ps(acc16, _mm512_mul_ps(v, v));
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, acc16);
    for (int c = 0; c < 16; c++) sum += lanes[c];
#endif
    v8 acc = splat8(0.0f);
    for (; i < dim; i += 8) {
        v8 v = load8_bf16(xr + i);
        acc += v * v;
    }
    for (int c = 0; c < 8; c++) sum += acc[c];
    float s = 1.0f / sqrtf(sum / (float)dim + eps);
    i = 0;                                               /* hidden.to(bf16), then weight * it */
#ifdef __AVX512F__
    for (__m512 vs = _mm512_set1_ps(s); i + 16 <= dim; i += 16)
        store_bf16_512(yr + i, _mm512_mul_ps(load_bf16_512(w + i), round_bf16_512(_mm512_mul_ps(load_bf16_512(xr + i), vs))));
#endif
    for (; i < dim; i += 8)
        store8_bf16(yr + i, load8_bf16(w + i) * round8_bf16(load8_bf16(xr + i) * s));
}

int rms_norm_f32(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) norm_row_f32(x + r * dim, w, y + r * dim, dim, eps);
    return 0;
}

int rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t dim, float eps,
                  int num_threads) {
    if (dim % 8 != 0) return -2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) norm_row_bf16(x + r * dim, w, y + r * dim, dim, eps);
    return 0;
}

int add_rms_norm_f32(float *res, const float *d, const float *w, float *y, int64_t rows, int64_t dim, float eps,
                     int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        float *rr = res + r * dim;
        const float *dr = d + r * dim;
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) store8(rr + i, load8(rr + i) + load8(dr + i));
        for (; i < dim; i++) rr[i] = rr[i] + dr[i];
        norm_row_f32(rr, w, y + r * dim, dim, eps);
    }
    return 0;
}

int add_rms_norm_bf16(uint16_t *res, const uint16_t *d, const uint16_t *w, uint16_t *y, int64_t rows, int64_t dim,
                      float eps, int num_threads) {
    if (dim % 8 != 0) return -2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *rr = res + r * dim;
        const uint16_t *dr = d + r * dim;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= dim; i += 16) store_bf16_512(rr + i, _mm512_add_ps(load_bf16_512(rr + i), load_bf16_512(dr + i)));
#endif
        for (; i < dim; i += 8) store8_bf16(rr + i, load8_bf16(rr + i) + load8_bf16(dr + i));
        norm_row_bf16(rr, w, y + r * dim, dim, eps);
    }
    return 0;
}

int silu_mul_f32(const float *gu, float *y, int64_t rows, int64_t inter, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *yr = y + r * inter;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= inter; i += 16)
            _mm512_storeu_ps(yr + i, _mm512_mul_ps(silu_512(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
#endif
        for (; i + 8 <= inter; i += 8) store8(yr + i, silu8(load8(g + i)) * load8(u + i));
        for (; i < inter; i++) yr[i] = silu1(g[i]) * u[i];
    }
    return 0;
}

/* bf16: y = round(round(silu(gate)) * up), torch's two ops' roundings (inter a multiple of 8). */
int silu_mul_bf16(const uint16_t *gu, uint16_t *y, int64_t rows, int64_t inter, int num_threads) {
    if (inter % 8 != 0) return -2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= MIN_PARALLEL)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * inter, *u = g + inter;
        uint16_t *yr = y + r * inter;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= inter; i += 16)
            store_bf16_512(yr + i, _mm512_mul_ps(round_bf16_512(silu_512(load_bf16_512(g + i))), load_bf16_512(u + i)));
#endif
        for (; i < inter; i += 8)
            store8_bf16(yr + i, round8_bf16(silu8(load8_bf16(g + i))) * load8_bf16(u + i));
    }
    return 0;
}

/* One head's rope: out = x * c + rotate_half(x) * s, h = dim / 2 (out never aliases x). */
static inline void rope_head_f32(const float *x, const float *c, const float *s, float *out, int64_t dim) {
    int64_t h = dim / 2, i = 0;
    for (; i + 8 <= h; i += 8) {
        v8 a = load8(x + i), b = load8(x + h + i);
        store8(out + i, a * load8(c + i) - b * load8(s + i));
        store8(out + h + i, b * load8(c + h + i) + a * load8(s + h + i));
    }
    for (; i < h; i++) {
        float a = x[i], b = x[h + i];
        out[i] = a * c[i] - b * s[i];
        out[h + i] = b * c[h + i] + a * s[h + i];
    }
}

/* The same in bf16 (h a multiple of 8): each product rounded, then their sum; the result widened. */
static inline void rope_head_bf16(const uint16_t *x, const uint16_t *c, const uint16_t *s, float *out, int64_t dim) {
    int64_t h = dim / 2;
    for (int64_t i = 0; i < h; i += 8) {
        v8 a = load8_bf16(x + i), b = load8_bf16(x + h + i);
        store8(out + i, round8_bf16(round8_bf16(a * load8_bf16(c + i)) - round8_bf16(b * load8_bf16(s + i))));
        store8(out + h + i, round8_bf16(round8_bf16(b * load8_bf16(c + h + i))
                                        + round8_bf16(a * load8_bf16(s + h + i))));
    }
}

/* The row of packed token t: rows' first tokens ascend (the row table's fourth line). */
static inline int64_t row_of(const int64_t *first, int64_t num_rows, int64_t t) {
    int64_t lo = 0, hi = num_rows - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static int rows_fit(const int64_t *rows, int64_t num_rows, int64_t num_slots, int64_t cap) {
    for (int64_t r = 0; r < num_rows; r++) {
        int64_t slot = rows[r], start = rows[num_rows + r], n = rows[2 * num_rows + r];
        if (slot < 0 || slot >= num_slots || start < 0 || n < 0 || start + n > cap) return 0;
    }
    return 1;
}

#define ROPE_STORE(NAME, T, HEAD, STORE_K)                                                                  \
static int NAME(const T *q, int64_t q_stride, const T *k, int64_t k_stride, const T *v, int64_t v_stride,          \
         const T *cos, const T *sin, const int64_t *rows, int64_t num_rows, int64_t num_tokens,             \
         int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_slots, int64_t cap,                      \
         float *q_out, T *k_store, T *v_store, int num_threads) {                                           \
    if (!rows_fit(rows, num_rows, num_slots, cap)) return -3;                                               \
    const int64_t *slot = rows, *start = rows + num_rows, *first = rows + 3 * num_rows;                     \
    const int64_t work = (heads + kv_heads) * dim;                                                          \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * work >= MIN_PARALLEL)") \
    for (int64_t t = 0; t < num_tokens; t++) {                                                              \
        int64_t r = row_of(first, num_rows, t);                                                             \
        int64_t pos = start[r] + (t - first[r]);                                                            \
        const T *c = cos + t * dim, *s = sin + t * dim;                                                     \
        for (int64_t hd = 0; hd < heads; hd++)                                                              \
            HEAD(q + t * q_stride + hd * dim, c, s, q_out + (t * heads + hd) * dim, dim);                   \
        for (int64_t kh = 0; kh < kv_heads; kh++) {                                                         \
            int64_t at = ((slot[r] * kv_heads + kh) * cap + pos) * dim;                                     \
            STORE_K(k + t * k_stride + kh * dim, c, s, k_store + at, dim);                                  \
            memcpy(v_store + at, v + t * v_stride + kh * dim, (size_t)dim * sizeof(T));                     \
        }                                                                                                   \
    }                                                                                                       \
    return 0;                                                                                               \
}

static inline void rope_key_f32(const float *x, const float *c, const float *s, float *out, int64_t dim) {
    rope_head_f32(x, c, s, out, dim);
}

/* rope(k) into the bf16 store: computed as for q, then narrowed (exactly: the values are bf16's). */
static inline void rope_key_bf16(const uint16_t *x, const uint16_t *c, const uint16_t *s, uint16_t *out,
                                 int64_t dim) {
    float tmp[512];
    rope_head_bf16(x, c, s, tmp, dim);
    for (int64_t i = 0; i < dim; i += 8) store8_bf16(out + i, load8(tmp + i));
}

ROPE_STORE(rope_store_f32_rows, float, rope_head_f32, rope_key_f32)
ROPE_STORE(rope_store_bf16_rows, uint16_t, rope_head_bf16, rope_key_bf16)

/* fp32: even head sizes. */
int rope_store_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                   int64_t v_stride, const float *cos, const float *sin, const int64_t *rows, int64_t num_rows,
                   int64_t num_tokens, int64_t heads, int64_t kv_heads, int64_t dim, int64_t num_slots, int64_t cap,
                   float *q_out, float *k_store, float *v_store, int num_threads) {
    if (dim % 2 != 0) return -2;
    return rope_store_f32_rows(q, q_stride, k, k_stride, v, v_stride, cos, sin, rows, num_rows, num_tokens,
                               heads, kv_heads, dim, num_slots, cap, q_out, k_store, v_store, num_threads);
}

/* bf16: head sizes a multiple of 16 up to 512 (the key's scratch row). */
int rope_store_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                    int64_t v_stride, const uint16_t *cos, const uint16_t *sin, const int64_t *rows,
                    int64_t num_rows, int64_t num_tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                    int64_t num_slots, int64_t cap, float *q_out, uint16_t *k_store, uint16_t *v_store,
                    int num_threads) {
    if (dim % 16 != 0 || dim > 512) return -2;
    return rope_store_bf16_rows(q, q_stride, k, k_stride, v, v_stride, cos, sin, rows, num_rows, num_tokens,
                                heads, kv_heads, dim, num_slots, cap, q_out, k_store, v_store, num_threads);
}
