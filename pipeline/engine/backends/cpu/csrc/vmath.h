/* Vector helpers shared by our C kernels (slot_attention.c, amx_attention_bf16.c, fused_ops.c, panel_linear.c): portable GCC (>= 12) /
 * Clang vector extensions, eight fp32 lanes. Included by each kernel's single source file; the
 * build's cache key covers this header too (build.py). */
#ifndef SPECPIPE_VMATH_H
#define SPECPIPE_VMATH_H

#include <float.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
typedef uint32_t u8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
/* A broadcast. Not `v8 a = {0}; a += s`: that costs an add per broadcast (0 + s is not s for s = -0). */
static inline v8 splat8(float s) { return (v8){s, s, s, s, s, s, s, s}; }
static inline v8 select8(i8 mask, v8 a, v8 b) { return (v8)(((i8)a & mask) | ((i8)b & ~mask)); }

/* Eight bf16 -> fp32: a bf16 is the upper half of the fp32 with the same value. */
static inline v8 load8_bf16(const uint16_t *p) {
    h8 h;
    memcpy(&h, p, sizeof h);
    return (v8)(__builtin_convertvector(h, u8) << 16);
}

/* Eight fp32 rounded to bf16 precision, to nearest even (as torch's .to(bfloat16)), still as fp32
 * (the low 16 bits zero); NaN stays NaN (quiet). */
static inline v8 round8_bf16(v8 v) {
    u8 u = (u8)v;
    u8 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    u8 quiet = (u | 0x00400000u) & 0xffff0000u;
    return (v8)select8(v == v, (v8)rounded, (v8)quiet);
}

/* Eight fp32 -> bf16, rounded to nearest even; NaN stays NaN. */
static inline void store8_bf16(uint16_t *p, v8 v) {
    h8 h = __builtin_convertvector((u8)round8_bf16(v) >> 16, h8);
    memcpy(p, &h, sizeof h);
}

/* e^v for v <= 0, lanes below -87 taken as -87 (e^-87 ~ 1.6e-38, the smallest normal): 2^k times a
 * degree-6 polynomial in the remainder, relative error ~1e-7. */
static inline v8 exp8_nonpositive(v8 v) {
    const v8 lo = splat8(-87.0f);
    v = select8(v > lo, v, lo);
    v8 t = v * 1.44269504088896341f - 0.5f;               /* v <= 0: trunc(t) = round(v log2 e) */
    i8 k = __builtin_convertvector(t, i8);
    v8 kf = __builtin_convertvector(k, v8);
    v8 r = v - kf * 0.693145751953125f - kf * 1.428606765330187045e-06f;   /* ln 2, split */
    v8 p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f
           + r * (0.0083333338f + r * 0.0013888889f)))));
    return p * (v8)((k + 127) << 23);
}

/* x[0, m) <- e^(x - max x[0, m)); returns their sum. x has room for m rounded up to 8 (scratch). */
static inline float softmax_numerators(float *x, int64_t m) {
    int64_t n8 = (m + 7) & ~(int64_t)7;
    /* The padding lanes must never be the maximum: with -87 there (exp8_nonpositive's floor), a row
     * whose every score is below -87 (real models have such heads) took -87 as its max and lost
     * its softmax. */
    for (int64_t i = m; i < n8; i++) x[i] = -FLT_MAX;
    v8 mxv = load8(x);
    for (int64_t i = 8; i < n8; i += 8) {
        v8 v = load8(x + i);
        mxv = select8(v > mxv, v, mxv);
    }
    float mx = mxv[0];
    for (int i = 1; i < 8; i++) mx = mxv[i] > mx ? mxv[i] : mx;
    v8 sum = {0};
    for (int64_t i = 0; i < n8; i += 8) {
        v8 e = exp8_nonpositive(load8(x + i) - mx);
        store8(x + i, e);
        if (i + 8 <= m) sum += e;
        else for (int64_t j = i; j < m; j++) sum[0] += e[j - i];
    }
    float total = 0;
    for (int i = 0; i < 8; i++) total += sum[i];
    return total;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* The same in 16 lanes where the CPU has AVX-512. */
static inline __m512 load_bf16_512(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 round_bf16_512(__m512 v) {
    __m512i u = _mm512_castps_si512(v), high = _mm512_set1_epi32((int)0xffff0000u);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), high);
    __m512i quiet = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x00400000)), high);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet));
}

static inline void store_bf16_512(uint16_t *p, __m512 v) {
    __m512i h = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_512(v)), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(h));
}

/* exp8_nonpositive's reduction and polynomial, 2^k by scalef. */
static inline __m512 exp_nonpositive_512(__m512 v) {
    v = _mm512_max_ps(v, _mm512_set1_ps(-87.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), v);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(0.0013888889f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.0083333338f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.041666668f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.16666667f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}
#endif

#endif
