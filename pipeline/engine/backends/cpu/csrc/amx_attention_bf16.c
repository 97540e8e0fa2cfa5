/* Attention of rows of several new tokens over a bf16 slot store by AMX tiles (CPUs with amx_bf16: Intel
 * Xeon from Sapphire Rapids): prompt chunks and verify rows, where slot_attention.c's vector loops are
 * bound by their arithmetic. Which rows come here is measured (attention.py's RowAttention, calibrate.py);
 * one-token decoding rows stay there.
 *
 * Built and loaded like the other kernels (build.py, attention.py); on a CPU without AMX the build fails
 * with the #error below and the runner does not offer the kernel.
 *
 * Layouts (all contiguous, row-major), as slot_attention.c's but queries and output in bf16:
 *   q, out       [num_tokens, heads, dim]          bf16, packed new tokens, row after row
 *   k_store/v    [num_slots, kv_heads, cap, dim]   bf16, the slot store
 *   rows         [4, num_rows] int64               slot, start, num_new, first packed token of each row
 *   bits         [num_tokens] int64 or NULL        token trees: the row's inputs each token sees
 * Row r's token i sits at position start + i and sees keys 0 .. start + i of its slot; with bits, of the
 * keys start .. start + 62 only those whose bit (key - start) is set (-1: all), as in slot_attention.c.
 * Only the rows of the table are written in out.
 *
 * A task is (row, block of at most QBLOCK of its tokens, KV head), as in slot_attention.c. Its queries
 * j = token * groups + head-in-group go in tiles of 16 (a verify-like row of 5 tokens x 3 heads is one
 * tile). Per task, once: the keys 0 .. m - 1 it reads laid out as B tiles of 16 keys x 16 dimension
 * pairs (a 16 x 16 transpose of 32-bit pairs), the values as B tiles of 16 key pairs x 16 dimensions
 * (two rows interleaved), keys past m zero. Per query tile:
 *   S = Q K^T      TDPBF16PS: bf16 products exact, fp32 sums (in the unit's order)
 *   P = e^(S * scale - max)   per query over its own keys (softmax_numerators, vmath.h), rounded to
 *                  bf16 for the second product; the sum it divides by is the fp32 one
 *   out = (P V) / sum   fp32 sums, rounded once to bf16
 * So the output differs from the fp32 softmax of slot_attention.c by P's rounding (relative 2^-9 per
 * weight, about 1e-3 of the output), as flash attention in bf16 does; attention.py's self-check holds
 * it to a reference that rounds P alike. Returns 0; -1 where scratch memory ran out; -2 where dim is
 * not a multiple of 32 or over 256.
 */
#if !defined(__AMX_BF16__) || !defined(__AMX_TILE__) || !defined(__AVX512BF16__)
#error "needs AMX-BF16 (the amx_bf16 and amx_tile CPU flags) and AVX512-BF16: not in this CPU's -march=native"
#else                         /* the rest only where it compiles: the error above is the build's only message */
#include <stdlib.h>

#include "amx.h"
#include "vmath.h"

#define QBLOCK 64                                         /* tokens of one row per task, at most */
#define TILE 512                                          /* uint16 in one tile: 16 rows x 64 bytes */

typedef uint32_t w16 __attribute__((vector_size(64)));   /* 16 32-bit words: one tile row */
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint16_t h32 __attribute__((vector_size(64)));

int amx_attention_enable(void) { return amx_request(); }

/* In-place transpose of 16 x 16 32-bit words in four rounds: round B swaps the off-diagonal B x B blocks
 * of every 2B x 2B block, so row i (bit B clear) takes row i + B's columns c (bit B clear) at c + B, and
 * row i + B takes row i's columns c + B at c. */
#define SWAP_BLOCKS(B, LO, HI)                                                                         \
    for (int i = 0; i < 16; i++) {                                                                     \
        if (i & B) continue;                                                                           \
        w16 a = r[i], b = r[i + B];                                                                    \
        r[i] = __builtin_shufflevector(a, b, LO);                                                      \
        r[i + B] = __builtin_shufflevector(a, b, HI);                                                  \
    }
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static void transpose16(w16 r[16]) {
    SWAP_BLOCKS(8, LO8, HI8)
    SWAP_BLOCKS(4, LO4, HI4)
    SWAP_BLOCKS(2, LO2, HI2)
    SWAP_BLOCKS(1, LO1, HI1)
}

/* The keys [0, m_pad) of one head as B tiles for S = Q K^T: tile (kb, c) row i, column k = the pair of
 * dimensions 32c + 2i, + 1 of key 16 kb + k; keys from m on are zero. */
static void key_tiles(uint16_t *kt, const uint16_t *K, int64_t m, int64_t m_pad, int64_t dim) {
    int64_t chunks = dim / 32;
    for (int64_t kb = 0; kb < m_pad / 16; kb++)
        for (int64_t c = 0; c < chunks; c++) {
            w16 r[16];
            for (int k = 0; k < 16; k++) {
                int64_t key = kb * 16 + k;
                if (key < m) memcpy(&r[k], K + key * dim + c * 32, sizeof r[k]);
                else r[k] = (w16){0};
            }
            transpose16(r);
            memcpy(kt + (kb * chunks + c) * TILE, r, sizeof r);
        }
}

/* The values [0, m_pad) of one head as B tiles for P V: tile (vb, c) row p, column d = values 32 vb + 2p
 * and + 1 of dimension 16c + d; keys from m on are zero. */
static void value_tiles(uint16_t *vt, const uint16_t *V, int64_t m, int64_t m_pad, int64_t dim) {
    int64_t chunks = dim / 16;
    for (int64_t vb = 0; vb < m_pad / 32; vb++)
        for (int64_t c = 0; c < chunks; c++) {
            uint16_t *tile = vt + (vb * chunks + c) * TILE;
            for (int p = 0; p < 16; p++) {
                int64_t key = vb * 32 + 2 * p;
                h16 a = {0}, b = {0};
                if (key < m) memcpy(&a, V + key * dim + c * 16, sizeof a);
                if (key + 1 < m) memcpy(&b, V + (key + 1) * dim + c * 16, sizeof b);
                h32 pair = __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
                memcpy(tile + p * 32, &pair, sizeof pair);
            }
        }
}

/* BODY(C, B) for up to four C tiles at a time (tile numbers are literals in the instructions, hence the
 * unrolling): S's key blocks or the output's 16-dimension chunks. A is in tile 4; B alternates between
 * tiles 5 and 6. */
#define FOR_C(COUNT, BODY)                                                                             \
    do {                                                                                               \
        BODY(0, 5)                                                                                     \
        if ((COUNT) > 1) { BODY(1, 6) }                                                                \
        if ((COUNT) > 2) { BODY(2, 5) }                                                                \
        if ((COUNT) > 3) { BODY(3, 6) }                                                                \
    } while (0)
#define ZERO(C, B) _tile_zero(C);
#define SCORES(C, B) _tile_loadd(B, kt + ((kb + C) * kchunks + c) * TILE, 64); _tile_dpbf16ps(C, 4, B);
#define STORE_SCORES(C, B) _tile_stored(C, s + (kb + C) * 16, m_pad * sizeof(float));
#define VALUES(C, B) _tile_loadd(B, vt + (vb * vchunks + c0 + C) * TILE, 64); _tile_dpbf16ps(C, 4, B);
#define STORE_OUT(C, B) _tile_stored(C, o + C * 256, 16 * sizeof(float));

/* Which of the 16 keys l .. l + 15 a token of a tree row sees: all below `base` (the row's start) and from
 * base + 63 on, and of base .. base + 62 those whose bit (key - base) of `bits` is set (-1: all). */
static inline __mmask16 seen(int64_t l, int64_t base, uint64_t bits) {
    int64_t d = l - base;
    if (d <= -16 || d >= 63) return 0xffff;
    bits |= 1ull << 63;
    uint64_t w = d >= 0 ? bits >> d : (bits << -d) | ((1ull << -d) - 1);
    if (d > 48) w |= ~0ull << (64 - d);
    return (__mmask16)w;
}

/* One query's softmax numerators e^(s * scale - max) over the keys [0, mq) it sees (bits: a tree row's
 * token, as `seen`; NULL: all), rounded to bf16 into p, zeros for the rest up to mt32 (a multiple of
 * 32); returns their fp32 sum (1 where mq is 0: a padding row). scale > 0, so the scaled maximum is
 * the maximum scaled. */
static float softmax_row(const float *s, uint16_t *p, int64_t mq, int64_t mt32, float scale,
                         const int64_t *bits, int64_t base) {
    if (mq == 0) {
        memset(p, 0, sizeof(uint16_t) * mt32);
        return 1.0f;
    }
    __m512 mx = _mm512_set1_ps(-FLT_MAX);
    for (int64_t l = 0; l < mq; l += 16) {
        __mmask16 valid = l + 16 <= mq ? 0xffff : (__mmask16)((1u << (mq - l)) - 1);
        if (bits != NULL) valid &= seen(l, base, (uint64_t)*bits);
        mx = _mm512_mask_max_ps(mx, valid, mx, _mm512_loadu_ps(s + l));
    }
    __m512 scaled_max = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale), sum = _mm512_setzero_ps();
    __m512 vscale = _mm512_set1_ps(scale);
    int64_t l = 0;
    for (; l < mq; l += 16) {
        __mmask16 valid = l + 16 <= mq ? 0xffff : (__mmask16)((1u << (mq - l)) - 1);
        if (bits != NULL) valid &= seen(l, base, (uint64_t)*bits);
        __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive_512(_mm512_fmsub_ps(_mm512_loadu_ps(s + l), vscale,
                                                                                 scaled_max)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + l), (__m256i)_mm512_cvtneps_pbh(e));
    }
    memset(p + l, 0, sizeof(uint16_t) * (mt32 - l));
    return _mm512_reduce_add_ps(sum);
}

/* The calling thread's scratch, at least `bytes`: kept between calls and grown as needed (fresh memory
 * for every task cost its page faults each time), so a thread holds as much as its longest row needed. */
static void *scratch(size_t bytes) {
    static __thread void *held = NULL;
    static __thread size_t size = 0;
    if (bytes > size) {
        free(held);
        size = (bytes + 4095) & ~(size_t)4095;
        held = aligned_alloc(64, size);
        if (held == NULL) size = 0;
    }
    return held;
}

/* One task: n tokens at positions p0.. of a row, one KV head; q/out at the first token's first query
 * head of the group, tok_stride = heads * dim elements. */
static int attend(const uint16_t *q, const uint16_t *K, const uint16_t *V, uint16_t *out, int64_t tok_stride,
                  int64_t n, int64_t p0, int64_t groups, float scale, int64_t dim, const int64_t *bits, int64_t base) {
    int64_t m = p0 + n, m_pad = (m + 31) & ~(int64_t)31, nq = n * groups;
    size_t tiles = (size_t)m_pad * dim, scores = (size_t)16 * m_pad;
    float *s = scratch(sizeof(float) * (scores + 16 * 16 * 4) + sizeof(uint16_t) * (2 * tiles + scores + 16 * dim));
    if (s == NULL) return -1;
    float *o = s + scores;
    uint16_t *kt = (uint16_t *)(o + 16 * 16 * 4), *vt = kt + tiles, *p = vt + tiles, *qt = p + scores;
    key_tiles(kt, K, m, m_pad, dim);
    value_tiles(vt, V, m, m_pad, dim);
    int64_t kchunks = dim / 32, vchunks = dim / 16;
    for (int64_t j0 = 0; j0 < nq; j0 += 16) {
        int rows = nq - j0 < 16 ? (int)(nq - j0) : 16;
        int64_t mq[16];
        for (int i = 0; i < 16; i++) {                    /* the tile's queries in bf16; rows past nq zero */
            int64_t j = j0 + i;
            if (i < rows) memcpy(qt + i * dim, q + (j / groups) * tok_stride + (j % groups) * dim, sizeof(uint16_t) * dim);
            else memset(qt + i * dim, 0, sizeof(uint16_t) * dim);
            mq[i] = p0 + (j0 + (i < rows ? i : rows - 1)) / groups + 1;
        }
        int64_t mt = mq[rows - 1], mt16 = (mt + 15) / 16, mt32 = (mt + 31) & ~(int64_t)31;
        for (int64_t kb = 0; kb < mt16; kb += 4) {        /* S = Q K^T, four key blocks at a time */
            int count = mt16 - kb < 4 ? (int)(mt16 - kb) : 4;
            FOR_C(count, ZERO);
            for (int64_t c = 0; c < kchunks; c++) {
                _tile_loadd(4, qt + c * 32, dim * sizeof(uint16_t));
                FOR_C(count, SCORES);
            }
            FOR_C(count, STORE_SCORES);
        }
        float inv[16];
        for (int i = 0; i < 16; i++)                      /* P: each query's own keys, then zeros to mt32 */
            inv[i] = 1.0f / softmax_row(s + i * m_pad, p + i * m_pad, i < rows ? mq[i] : 0, mt32, scale,
                                        bits ? bits + (j0 + i) / groups : NULL, base);
        for (int64_t c0 = 0; c0 < vchunks; c0 += 4) {     /* out = P V, four 16-dimension chunks at a time */
            int count = vchunks - c0 < 4 ? (int)(vchunks - c0) : 4;
            FOR_C(count, ZERO);
            for (int64_t vb = 0; vb < mt32 / 32; vb++) {
                _tile_loadd(4, p + vb * 32, m_pad * sizeof(uint16_t));
                FOR_C(count, VALUES);
            }
            FOR_C(count, STORE_OUT);
            for (int i = 0; i < rows; i++) {
                int64_t j = j0 + i;
                uint16_t *oj = out + (j / groups) * tok_stride + (j % groups) * dim + c0 * 16;
                for (int c = 0; c < count; c++)
                    for (int h = 0; h < 16; h += 8) store8_bf16(oj + c * 16 + h, load8(o + c * 256 + i * 16 + h) * inv[i]);
            }
        }
    }
    return 0;
}

int amx_attention_bf16(const uint16_t *q, const uint16_t *k_store, const uint16_t *v_store, uint16_t *out,
                       const int64_t *rows, const int64_t *bits, int64_t num_rows, int64_t kv_heads, int64_t groups, int64_t cap,
                       int64_t dim, float scale, int num_threads) {
    if (dim % 32 != 0 || dim > 256) return -2;
    const int64_t *slot = rows, *start = rows + num_rows, *num_new = rows + 2 * num_rows,
                  *first = rows + 3 * num_rows;
    int64_t heads = kv_heads * groups;
    /* Tasks as slot_attention.c's: blocks of at most QBLOCK tokens, smaller until there are about four
       tasks per thread. block_end[r]: blocks of rows 0..r. */
    int64_t total = 0;
    for (int64_t r = 0; r < num_rows; r++) total += num_new[r];
    int64_t tasks_wanted = 4 * (int64_t)(num_threads > 0 ? num_threads : 1);
    int64_t qblock = (total * kv_heads + tasks_wanted - 1) / tasks_wanted;
    qblock = qblock < 1 ? 1 : qblock > QBLOCK ? QBLOCK : qblock;
    int64_t *block_end = malloc(sizeof(int64_t) * (num_rows ? num_rows : 1));
    if (block_end == NULL) return -1;
    for (int64_t r = 0, blocks = 0; r < num_rows; r++) block_end[r] = blocks += (num_new[r] + qblock - 1) / qblock;
    int64_t num_tasks = num_rows ? block_end[num_rows - 1] * kv_heads : 0;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        amx_configure_tiles();
        #pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < num_tasks; task++) {
            int64_t b = task / kv_heads, h = task % kv_heads, r = 0, hi = num_rows - 1;
            while (r < hi) {                              /* the first row with block_end[r] > b */
                int64_t mid = (r + hi) / 2;
                if (block_end[mid] > b) hi = mid; else r = mid + 1;
            }
            int64_t t0 = (b - (r ? block_end[r - 1] : 0)) * qblock;
            int64_t n = num_new[r] - t0 < qblock ? num_new[r] - t0 : qblock;
            int64_t kv = (slot[r] * kv_heads + h) * cap * dim, qo = ((first[r] + t0) * heads + h * groups) * dim;
            if (attend(q + qo, k_store + kv, v_store + kv, out + qo, heads * dim, n, start[r] + t0, groups,
                       scale, dim, bits ? bits + first[r] + t0 : NULL, start[r]) != 0)
                failed = 1;
        }
        _tile_release();
    }
    free(block_end);
    return failed ? -1 : 0;
}
#endif
