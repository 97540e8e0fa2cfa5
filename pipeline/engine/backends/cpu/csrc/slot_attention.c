/* Attention over the slot KV store for CPUs: each row reads its own keys only. fp32 arithmetic;
 * the store is fp32 (slot_attention_f32) or bf16 (slot_attention_bf16kv: keys and values widened
 * to fp32 as they are loaded, exactly, so a bf16 model's store is read at half the bytes).
 *
 * Built by pipeline/engine/backends/cpu/attention.py with the system C compiler (-O3, the host's vector
 * instructions, OpenMP) the first time a runner needs it, and loaded with ctypes. Portable C with
 * GCC (>= 12) / Clang vector extensions, so the same source builds for AVX2, AVX-512 and NEON; on
 * CPUs with AVX512_BF16 a bf16 store's tasks of few queries take their own path with intrinsics
 * (ATTEND_DP below).
 *
 * Layouts (all contiguous, row-major):
 *   q, out       [num_tokens, heads, dim]          fp32, packed new tokens, row after row
 *   k_store/v    [num_slots, kv_heads, cap, dim]   fp32 or bf16, the slot store (kv_cache.SlotKVCache)
 *   rows         [4, num_rows] int64               slot, start, num_new, first packed token of each row
 *   bits         [num_tokens] int64 or NULL        token trees: the row's inputs each token sees
 * Row r's token i sits at position start + i and sees keys 0 .. start + i of its slot; with bits,
 * of the keys start .. start + 62 only those whose bit (key - start) is set (a token tree's root,
 * the token's ancestors and itself; -1: all, a causal row). The query
 * heads sharing a KV head (heads = kv_heads * groups) are one task's queries: the task (row, kv
 * head) streams that head's keys and values once for all of them.
 *
 * Per task: scores = q K^T (eight keys at a time, a transpose-reduce instead of one horizontal sum
 * per key), a softmax with an exponential written as vector code (2^k times a degree-6
 * polynomial, relative error ~1e-7), then out = p V, for QB queries at a time (below) so each key
 * and value vector is loaded and widened once per QB queries. A task with many queries over a bf16
 * store (a verify step's tokens, a prompt chunk) widens its keys and values to fp32 once instead
 * (run, below). Returns 0, or -1 when scratch memory ran out.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vmath.h"

/* Lane i of the result: the sum of the lanes of a[i]. */
#define PAIRS(x, y) (__builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) \
                     + __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15))
#define QUADS(x, y) (__builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) \
                     + __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15))
#define HALVES(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) \
                      + __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15))
static inline v8 reduce8(const v8 a[8]) {
    v8 b0 = PAIRS(a[0], a[1]), b1 = PAIRS(a[2], a[3]), b2 = PAIRS(a[4], a[5]), b3 = PAIRS(a[6], a[7]);
    return HALVES(QUADS(b0, b1), QUADS(b2, b3));
}

/* Queries attended together (QB): each key or value vector loaded (and, from a bf16 store, widened)
 * once serves QB queries. Their score accumulators (QB x 8 keys) and output accumulators (QB x 8
 * vectors) must stay in registers: QB 3 where the ISA has 32 vector registers (AVX-512, Arm), else 1
 * (AVX2's 16: one query at a time, as before). The arithmetic per query is the same either way. */
#if defined(__AVX512F__) || defined(__aarch64__)
#define QB 3
#else
#define QB 1
#endif

/* A block's scores (QB queries, `stride` apart in s) -> softmax numerators: a tree row's inputs a query
 * must not see left out, inv[i] = 1 / query i's sum, and the scores past a query's own m_i (up to the
 * block's longest m) zeroed, so p V adds exact zeros there. */
static void block_softmax(float *s, int64_t stride, const int64_t *mq, int64_t m, int64_t nq, const int64_t *bits,
                          int64_t j0, int64_t groups, int64_t base, float *inv) {
    for (int i = 0; i < QB; i++) {
        float *si = s + i * stride;
        uint64_t hidden = bits ? ~(uint64_t)bits[(j0 + (i < nq ? i : nq - 1)) / groups] : 0;
        for (int64_t l = base; hidden && l < mq[i] && l - base < 63; l++)
            if ((hidden >> (l - base)) & 1) si[l] = -FLT_MAX;
        inv[i] = 1.0f / softmax_numerators(si, mq[i]);
        for (int64_t l = base; hidden && l < mq[i] && l - base < 63; l++)
            if ((hidden >> (l - base)) & 1) si[l] = 0.0f;   /* exactly 0 in p V (the sum: ~1e-38) */
        for (int64_t l = mq[i]; l < m; l++) si[l] = 0.0f;
    }
}

/* One task: n tokens of a row at positions p0.. (the row's keys up to p0 + n - 1 hold this step's
 * values), `groups` query heads each, one KV head. q/out point at the first token's first head of
 * the group; tok_stride = heads * dim. s: scratch, QB * (p0 + n + 8) floats (the scores of QB queries).
 * Queries j = token * groups + head go in blocks of QB; query j sees m_j = p0 + j / groups + 1 keys.
 * A block computes scores up to its last (longest) query's m, keeps each query's own m in its
 * softmax and zeroes the scores past it, so p V adds exact zeros there. Each query's scores come
 * out bitwise as if it were alone (eight keys at a time, then its last m % 8 one by one), so a
 * token's output does not depend on the other tokens of its step.
 * DIM: a multiple of 8, at most 8 * MAX_CHUNKS; a constant for the common head sizes (the loops
 * unroll), the argument `dim` otherwise. */
#define MAX_CHUNKS 32
#define OUT_CHUNKS 8                                      /* output vectors per query per pass over V */
#define QBLOCK 32                                         /* tokens of one row per task, at most */
#define ATTEND(NAME, DIM, KV, LOADKV)                                                                  \
static void NAME(const float *q, const void *Kv, const void *Vv, float *out, int64_t tok_stride,      \
                 int64_t n, int64_t p0, int64_t groups, float scale, float *s, int64_t dim,           \
                 const int64_t *bits, int64_t base) {                                                 \
    const KV *K = Kv, *V = Vv;                                                                         \
    (void)dim;                                                                                         \
    int64_t stride = p0 + n + 8;                          /* one query's scores in s */                \
    for (int64_t j0 = 0; j0 < n * groups; j0 += QB) {                                                  \
        int64_t nq = n * groups - j0 < QB ? n * groups - j0 : QB;                                      \
        const float *qp[QB];                                                                           \
        int64_t mq[QB];                                                                                \
        for (int i = 0; i < QB; i++) {                    /* past nq: repeat the last query, unused */ \
            int64_t j = j0 + (i < nq ? i : nq - 1);                                                    \
            qp[i] = q + (j / groups) * tok_stride + (j % groups) * DIM;                                \
            mq[i] = p0 + j / groups + 1;                                                               \
        }                                                                                              \
        int64_t m = mq[QB - 1], m8 = m & ~(int64_t)7;     /* the block's longest */                    \
        for (int64_t l = 0; l < m8; l += 8) {                                                          \
            v8 acc[QB][8] = {{0}};                                                                     \
            for (int64_t d = 0; d < DIM; d += 8) {                                                     \
                v8 qv[QB];                                                                             \
                for (int i = 0; i < QB; i++) qv[i] = load8(qp[i] + d);                                 \
                for (int k = 0; k < 8; k++) {                                                          \
                    v8 kv = LOADKV(K + (l + k) * DIM + d);                                             \
                    for (int i = 0; i < QB; i++) acc[i][k] += qv[i] * kv;                              \
                }                                                                                      \
            }                                                                                          \
            for (int i = 0; i < QB; i++)                                                               \
                if (l + 8 <= mq[i]) store8(s + i * stride + l, reduce8(acc[i]) * scale);               \
        }                                                                                              \
        for (int i = 0; i < QB; i++) {   /* each query's last m % 8 keys one at a time, as alone */   \
            for (int64_t l = mq[i] & ~(int64_t)7; l < mq[i]; l++) {                                    \
                v8 acc = {0};                                                                          \
                for (int64_t d = 0; d < DIM; d += 8) acc += load8(qp[i] + d) * LOADKV(K + l * DIM + d); \
                float t = 0;                                                                           \
                for (int c = 0; c < 8; c++) t += acc[c];                                               \
                s[i * stride + l] = t * scale;                                                         \
            }                                                                                          \
        }                                                                                              \
        float inv[QB];                                                                                 \
        block_softmax(s, stride, mq, m, nq, bits, j0, groups, base, inv);                              \
        for (int c0 = 0; c0 < DIM / 8; c0 += OUT_CHUNKS) {                                             \
            int nc = DIM / 8 - c0 < OUT_CHUNKS ? DIM / 8 - c0 : OUT_CHUNKS;                            \
            v8 o[QB][OUT_CHUNKS] = {{0}};                                                              \
            for (int64_t l = 0; l < m; l++) {                                                          \
                for (int c = 0; c < nc; c++) {                                                         \
                    v8 vv = LOADKV(V + l * DIM + (c0 + c) * 8);                                        \
                    for (int i = 0; i < QB; i++) o[i][c] += s[i * stride + l] * vv;                    \
                }                                                                                      \
            }                                                                                          \
            for (int i = 0; i < nq; i++) {                                                             \
                int64_t j = j0 + i;                                                                    \
                float *oj = out + (j / groups) * tok_stride + (j % groups) * DIM + c0 * 8;             \
                for (int c = 0; c < nc; c++) store8(oj + c * 8, o[i][c] * inv[i]);                     \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
}
ATTEND(attend_64, 64, float, load8)
ATTEND(attend_128, 128, float, load8)
ATTEND(attend_any, dim, float, load8)
ATTEND(attend_64_bf16, 64, uint16_t, load8_bf16)
ATTEND(attend_128_bf16, 128, uint16_t, load8_bf16)
ATTEND(attend_any_bf16, dim, uint16_t, load8_bf16)

/* Tasks of few queries (a decoding step's rows, a batch-1 path's blocks) over bf16 stores on CPUs with
 * AVX512_BF16 (Intel from Cooper Lake and Sapphire Rapids, AMD from Zen 4): the scores by VDPBF16PS,
 * a dot product of bf16 pairs accumulated in fp32, read straight from the store (no widening): 32 key
 * elements per instruction against 8 widened ones above, the next keys and values prefetched. Such
 * tasks wait on memory (each key is used by at most 2 * QB queries), and this path streams a 64-row
 * decoding step's store 1.6x faster here; tasks of many queries are compute-bound and take ATTEND
 * over keys widened once, which is faster there (bench/RESULTS.md, "CPU kernels"). A product of two
 * bf16 is exact in fp32, so each step is an fp32 fused multiply-add, as in ATTEND, in another order:
 * a token's output here and in a many-query task agree to fp32 rounding, not bitwise. The queries
 * are split into bf16 parts, q = hi + mid + lo to fp32 precision: a bf16 model's queries are bf16
 * values (mid and lo zero, skipped when every query of a block is), an fp32 query loses nothing.
 * p V in sixteen fp32 lanes. The arithmetic of one query does not depend on the others of its
 * block, as in ATTEND. DIM: a multiple of 32. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define DP_BF16 1
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16x __attribute__((vector_size(64)));
static inline v16 load16_bf16(const uint16_t *p) {
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline v16 splat16(float s) { return (v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
static inline v8 fold16(v16 a) {                          /* lane i: a[i] + a[i + 8] */
    return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}
static inline __m512bh load32_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline __m512 dp32(__m512 acc, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(acc, a, b); }

#define MAX_DIM_DP 256
#define QPARTS 3                                          /* hi, mid, lo */
/* One query's parts: dst[part * MAX_DIM_DP + d] bf16. Returns 1 when the query is a bf16 value (mid = lo = 0). */
static int split_query(const float *q, uint16_t *dst, int64_t dim) {
    i8 inexact = {0};
    for (int64_t d = 0; d < dim; d += 8) {
        v8 r = load8(q + d);
        for (int part = 0; part < QPARTS; part++) {
            v8 h = round8_bf16(r);
            store8_bf16(dst + part * MAX_DIM_DP + d, h);
            r = r - h;
            if (part == 0) inexact |= r != 0.0f;
        }
    }
    for (int c = 0; c < 8; c++) if (inexact[c]) return 0;
    return 1;
}

/* The scores of a block's QB queries (their first PARTS bf16 parts) into s, as ATTEND's. */
#define SCORES_DP(PARTS, DIM)                                                                          \
        for (int64_t l = 0; l < m8; l += 8) {                                                          \
            for (int64_t b = 0; first_pass && b < 8 * DIM * 2; b += 64)  /* keys AHEAD on, from memory */ \
            {   _mm_prefetch((const char *)(K + (l + AHEAD) * DIM) + b, _MM_HINT_T0);                  \
                _mm_prefetch((const char *)(V + l * DIM) + b, _MM_HINT_T1); }  /* values: into L2 */   \
            __m512 acc[QB][8];                                                                         \
            for (int i = 0; i < QB; i++) for (int k = 0; k < 8; k++) acc[i][k] = _mm512_setzero_ps();  \
            for (int k = 0; k < 8; k++) {                                                              \
                for (int64_t d = 0; d < DIM; d += 32) {                                                \
                    __m512bh kv = load32_bh(K + (l + k) * DIM + d);                                    \
                    for (int part = 0; part < PARTS; part++)                                           \
                        for (int i = 0; i < QB; i++)                                                   \
                            acc[i][k] = dp32(acc[i][k], load32_bh(&qs[i][part][d]), kv);               \
                }                                                                                      \
            }                                                                                          \
            for (int i = 0; i < QB; i++) {                                                             \
                if (l + 8 > mq[i]) continue;                                                           \
                v8 a[8];                                                                               \
                for (int k = 0; k < 8; k++) a[k] = fold16((v16)acc[i][k]);                             \
                store8(s + i * stride + l, reduce8(a) * scale);                                        \
            }                                                                                          \
        }                                                                                              \
        for (int i = 0; i < QB; i++) {   /* each query's last m % 8 keys one at a time, as alone */   \
            for (int64_t l = mq[i] & ~(int64_t)7; l < mq[i]; l++) {                                    \
                __m512 acc = _mm512_setzero_ps();                                                      \
                for (int64_t d = 0; d < DIM; d += 32)                                                  \
                    for (int part = 0; part < PARTS; part++)                                           \
                        acc = dp32(acc, load32_bh(&qs[i][part][d]), load32_bh(K + l * DIM + d));      \
                v8 a = fold16((v16)acc);                                                               \
                float t = 0;                                                                           \
                for (int c = 0; c < 8; c++) t += a[c];                                                 \
                s[i * stride + l] = t * scale;                                                         \
            }                                                                                          \
        }

#define AHEAD 32                                          /* keys / values prefetched ahead */
#define OUT16 8                                           /* 16-lane output vectors per query per pass */
#define ATTEND_DP(NAME, DIM)                                                                           \
static void NAME(const float *q, const void *Kv, const void *Vv, float *out, int64_t tok_stride,      \
                 int64_t n, int64_t p0, int64_t groups, float scale, float *s, int64_t dim,           \
                 const int64_t *bits, int64_t base) {                                                 \
    const uint16_t *K = Kv;                                                                            \
    const uint16_t *V = Vv;                                                                            \
    (void)dim;                                                                                         \
    int64_t stride = p0 + n + 8;                                                                       \
    uint16_t qs[QB][QPARTS][MAX_DIM_DP] __attribute__((aligned(64)));                                  \
    for (int64_t j0 = 0; j0 < n * groups; j0 += QB) {                                                  \
        int64_t nq = n * groups - j0 < QB ? n * groups - j0 : QB;                                      \
        int64_t mq[QB];                                                                                \
        int parts = 1;                                                                                 \
        for (int i = 0; i < QB; i++) {                                                                 \
            int64_t j = j0 + (i < nq ? i : nq - 1);                                                    \
            if (!split_query(q + (j / groups) * tok_stride + (j % groups) * DIM, &qs[i][0][0], DIM))   \
                parts = QPARTS;                                                                        \
            mq[i] = p0 + j / groups + 1;                                                               \
        }                                                                                              \
        int64_t m = mq[QB - 1], m8 = m & ~(int64_t)7;                                                  \
        int first_pass = j0 == 0;                   /* later passes find the keys and values in cache */ \
        if (parts == 1) { SCORES_DP(1, DIM) } else { SCORES_DP(QPARTS, DIM) }                          \
        float inv[QB];                                                                                 \
        block_softmax(s, stride, mq, m, nq, bits, j0, groups, base, inv);                              \
        for (int c0 = 0; c0 < DIM / 16; c0 += OUT16) {                                                 \
            int nc = DIM / 16 - c0 < OUT16 ? DIM / 16 - c0 : OUT16;                                    \
            v16 o[QB][OUT16] = {{0}};                                                                  \
            for (int64_t l = 0; l < m; l++) {                                                          \
                for (int64_t b = 0; first_pass && b < DIM * 2; b += 64)                              \
                    _mm_prefetch((const char *)(V + (l + AHEAD) * DIM) + b, _MM_HINT_T0);              \
                v16 p[QB];                                                                             \
                for (int i = 0; i < QB; i++) p[i] = splat16(s[i * stride + l]);                        \
                for (int c = 0; c < nc; c++) {                                                         \
                    v16 vv = load16_bf16(V + l * DIM + (c0 + c) * 16);                                       \
                    for (int i = 0; i < QB; i++) o[i][c] += p[i] * vv;                                 \
                }                                                                                      \
            }                                                                                          \
            for (int i = 0; i < nq; i++) {                                                             \
                int64_t j = j0 + i;                                                                    \
                float *oj = out + (j / groups) * tok_stride + (j % groups) * DIM + c0 * 16;            \
                v16 w = splat16(inv[i]);                                                               \
                for (int c = 0; c < nc; c++) { v16 r = o[i][c] * w; memcpy(oj + c * 16, &r, sizeof r); } \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
}
ATTEND_DP(attend_dp_64, 64)
ATTEND_DP(attend_dp_128, 128)
ATTEND_DP(attend_dp_any, dim)
#endif

typedef void (*attend_fn)(const float *, const void *, const void *, float *, int64_t, int64_t, int64_t,
                          int64_t, float, float *, int64_t, const int64_t *, int64_t);

/* keys and values [0, m) of one head widened from bf16 to fp32 (exactly), into dst. */
static void widen(float *dst, const uint16_t *src, int64_t count) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) store8(dst + i, load8_bf16(src + i));
    for (; i < count; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

static int run(const float *q, const char *k_store, const char *v_store, int64_t elem_size, float *out,
               const int64_t *rows, const int64_t *bits, int64_t num_rows, int64_t kv_heads, int64_t groups,
               int64_t cap, int64_t dim, float scale, int num_threads) {
    if (dim % 8 != 0 || dim > 8 * MAX_CHUNKS) return -2;
    const int64_t *slot = rows, *start = rows + num_rows, *num_new = rows + 2 * num_rows,
                  *first = rows + 3 * num_rows;
    int64_t heads = kv_heads * groups;
    /* Tasks: (row, block of at most `qblock` of its tokens, KV head), so a long prompt's row spreads
       over the threads too. A step of few rows with several tokens each (a verify step at batch 1: 17
       tree tokens, 3 KV heads, 2 threads) would leave threads idle with blocks of QBLOCK, so the blocks
       shrink until there are about four tasks per thread; a token's output does not depend on its
       block (ATTEND above). block_end[r]: blocks of rows 0..r. */
    int64_t total = 0;
    for (int64_t r = 0; r < num_rows; r++) total += num_new[r];
    int64_t tasks_wanted = 4 * (int64_t)(num_threads > 0 ? num_threads : 1);
    int64_t qblock = (total * kv_heads + tasks_wanted - 1) / tasks_wanted;
    qblock = qblock < 1 ? 1 : qblock > QBLOCK ? QBLOCK : qblock;
    int64_t *block_end = malloc(sizeof(int64_t) * num_rows);
    if (block_end == NULL) return -1;
    for (int64_t r = 0, blocks = 0; r < num_rows; r++) block_end[r] = blocks += (num_new[r] + qblock - 1) / qblock;
    int64_t num_tasks = num_rows ? block_end[num_rows - 1] * kv_heads : 0;
    int failed = 0;
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t task = 0; task < num_tasks; task++) {
        int64_t b = task / kv_heads, h = task % kv_heads, r = 0, hi = num_rows - 1;
        while (r < hi) {                                  /* the first row with block_end[r] > b */
            int64_t mid = (r + hi) / 2;
            if (block_end[mid] > b) hi = mid; else r = mid + 1;
        }
        int64_t b0 = b - (r ? block_end[r - 1] : 0), t0 = b0 * qblock;           /* first token of the block */
        int64_t n = num_new[r] - t0 < qblock ? num_new[r] - t0 : qblock;
        int64_t m = start[r] + t0 + n;                    /* keys the block's last token sees, at most */
        /* A bf16 store's keys and values are widened once per task where the task's queries take more
           than two passes over them (QB queries a pass): the passes then read fp32, the same numbers. */
        int widened = elem_size == 2 && n * groups > 2 * QB;
        float *s = malloc(sizeof(float) * (QB * (m + 8) + (widened ? 2 * m * dim : 0)));
        if (s == NULL) { failed = 1; continue; }
        int64_t kv = (slot[r] * kv_heads + h) * cap * dim, qo = ((first[r] + t0) * heads + h * groups) * dim;
        const void *k = k_store + kv * elem_size, *v = v_store + kv * elem_size;
        attend_fn attend;
#ifdef DP_BF16
        if (elem_size == 2 && !widened && dim % 32 == 0 && dim <= MAX_DIM_DP) {   /* few queries: ATTEND_DP */
            attend = dim == 64 ? attend_dp_64 : dim == 128 ? attend_dp_128 : attend_dp_any;
            attend(q + qo, k, v, out + qo, heads * dim, n, start[r] + t0, groups, scale, s, dim,
                   bits ? bits + first[r] + t0 : NULL, start[r]);
            free(s);
            continue;
        }
#endif
        if (widened) {
            float *k32 = s + QB * (m + 8), *v32 = k32 + m * dim;
            widen(k32, k, m * dim);
            widen(v32, v, m * dim);
            k = k32;
            v = v32;
        }
        if (elem_size == 4 || widened) attend = dim == 64 ? attend_64 : dim == 128 ? attend_128 : attend_any;
        else attend = dim == 64 ? attend_64_bf16 : dim == 128 ? attend_128_bf16 : attend_any_bf16;
        attend(q + qo, k, v, out + qo, heads * dim, n, start[r] + t0, groups, scale, s, dim,
               bits ? bits + first[r] + t0 : NULL, start[r]);
        free(s);
    }
    free(block_end);
    return failed ? -1 : 0;
}

int slot_attention_f32(const float *q, const float *k_store, const float *v_store, float *out,
                       const int64_t *rows, const int64_t *bits, int64_t num_rows, int64_t kv_heads,
                       int64_t groups, int64_t cap, int64_t dim, float scale, int num_threads) {
    return run(q, (const char *)k_store, (const char *)v_store, sizeof(float), out, rows, bits, num_rows, kv_heads,
               groups, cap, dim, scale, num_threads);
}

int slot_attention_bf16kv(const float *q, const uint16_t *k_store, const uint16_t *v_store, float *out,
                          const int64_t *rows, const int64_t *bits, int64_t num_rows, int64_t kv_heads,
                          int64_t groups, int64_t cap, int64_t dim, float scale, int num_threads) {
    return run(q, (const char *)k_store, (const char *)v_store, sizeof(uint16_t), out, rows, bits, num_rows, kv_heads,
               groups, cap, dim, scale, num_threads);
}
