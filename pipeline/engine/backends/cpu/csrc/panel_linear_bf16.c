/* y = x W^T + b for CPUs with bf16 dot-product instructions (AVX512-BF16), bf16 in and out.
 *
 * The bf16 twin of panel_linear.c, built and loaded the same way (pipeline/engine/backends/cpu/build.py,
 * linear.py). It exists where `models.dtype: auto` picks bf16 on a CPU (avx512_bf16, which AMX
 * CPUs have too): without it such a CPU ran bf16 through oneDNN's packed linears. Unlike the fp32
 * kernel it needs intrinsics: VDPBF16PS (two bf16 products summed into each fp32 lane) has no
 * portable spelling. On a CPU without it the build fails with the #error below, and the runner keeps
 * oneDNN's bf16 linears (cpu_linear.unavailable says why).
 *
 * Layouts (contiguous, row-major):
 *   x        [M, K]                          bf16, the tokens of one forward, packed
 *   panels   [ceil(N / 16), ceil(K / 2), 16, 2]  W [N, K] regrouped: panel p, pair j holds, for each of
 *                                            outputs 16p .. 16p + 15, (W[n, 2j], W[n, 2j + 1]): one
 *                                            512-bit vector per input pair (zeros past N and K)
 *   bias     [N] bf16 or NULL
 *   y        [M, N] bf16
 * Products are exact in fp32 and summed in fp32 (16 accumulators per tile row); y is rounded to
 * bf16 once, to nearest even, as torch's bf16 linear does.
 *
 * A tile is (up to MR rows of x) x (one panel): per input pair it loads the panel's vector once and
 * does one VDPBF16PS per row with that row's pair broadcast. One row is a stream over the weight (4
 * accumulators over consecutive pairs hide the instruction's latency); many rows are register-
 * blocked, tasks of (up to MC rows) x (one panel) re-reading the panel from cache for each tile.
 * As in panel_linear.c, a task's first tile prefetches AHEAD pairs (8 KB) ahead of what it reads and
 * its second tile the whole next panel: measured on SmolLM2's weights, 8 rows 12.4 -> 8.6 ms, 12
 * rows 18.0 -> 12.1, 20 rows 22.7 -> 17.2, 48 rows 42.9 -> 37.2. The one-row stream prefetches
 * ROW_AHEAD pairs (4 KB) ahead into L1 and ROW_FAR pairs (32 KB) ahead into L2, as panel_linear.c's
 * does: SmolLM2's linears at one row on an Intel Xeon with AMX, 2 threads, 16.6 -> 11.0 ms (24 GB/s
 * of the ~27 the two cores read). Bitwise the same.
 */
#if !defined(__AVX512BF16__) || !defined(__AVX512F__)
#error "needs AVX512-BF16 (the avx512_bf16 CPU flag): not in this CPU's -march=native"
#else                         /* the rest only where it compiles: the error above is the build's only message */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { NR = 16, MR = 12, MC = 96, AHEAD = 128, ROW_AHEAD = 64, ROW_FAR = 512 };

static inline __m512 bf16_to_f32(const uint16_t *p) {       /* 16 bf16 -> 16 fp32, exactly */
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512bh pair_of(const uint16_t *x, int64_t j, int64_t k) {   /* (x[2j], x[2j+1]) x 16 */
    uint32_t pair;
    if (2 * j + 1 < k) memcpy(&pair, x + 2 * j, sizeof pair);
    else pair = x[2 * j];                                   /* odd K: the last pair's second is 0 */
    return (__m512bh)_mm512_set1_epi32((int)pair);
}

static inline __attribute__((always_inline)) void tile(const int rows, const uint16_t *x, int64_t ldx, int64_t k,
                                                       const uint16_t *panel, uint16_t *y, int64_t ldy,
                                                       int nvalid, const uint16_t *bias, const uint16_t *pf) {
    int64_t kp = (k + 1) / 2;
    uint16_t edge[NR];
    __m512 init = _mm512_setzero_ps(), c[MR];
    if (bias != NULL) {
        memset(edge, 0, sizeof edge);
        memcpy(edge, bias, nvalid * sizeof(uint16_t));
        init = bf16_to_f32(edge);
    }
    for (int m = 0; m < rows; m++) c[m] = init;
    if (rows == 1) {
        __m512 d0 = _mm512_setzero_ps(), d1 = d0, d2 = d0;
        int64_t j = 0;
        for (; j + 3 < kp; j += 4) {
            const uint16_t *w = panel + j * 2 * NR;
            for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(w + (ROW_AHEAD + l) * 2 * NR), _MM_HINT_T0);
            for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(w + (ROW_FAR + l) * 2 * NR), _MM_HINT_T1);
            c[0] = _mm512_dpbf16_ps(c[0], pair_of(x, j, k), (__m512bh)_mm512_loadu_si512(w));
            d0 = _mm512_dpbf16_ps(d0, pair_of(x, j + 1, k), (__m512bh)_mm512_loadu_si512(w + 2 * NR));
            d1 = _mm512_dpbf16_ps(d1, pair_of(x, j + 2, k), (__m512bh)_mm512_loadu_si512(w + 4 * NR));
            d2 = _mm512_dpbf16_ps(d2, pair_of(x, j + 3, k), (__m512bh)_mm512_loadu_si512(w + 6 * NR));
        }
        for (; j < kp; j++)
            c[0] = _mm512_dpbf16_ps(c[0], pair_of(x, j, k), (__m512bh)_mm512_loadu_si512(panel + j * 2 * NR));
        c[0] = _mm512_add_ps(c[0], _mm512_add_ps(d0, _mm512_add_ps(d1, d2)));
    } else {
        for (int64_t j = 0; j < kp; j++) {
            if (pf != NULL) _mm_prefetch((const char *)(pf + j * 2 * NR), _MM_HINT_T1);   /* one line per pair */
            __m512bh b = (__m512bh)_mm512_loadu_si512(panel + j * 2 * NR);
            for (int m = 0; m < rows; m++) c[m] = _mm512_dpbf16_ps(c[m], pair_of(x + m * ldx, j, k), b);
        }
    }
    for (int m = 0; m < rows; m++) {
        __m256i out = (__m256i)_mm512_cvtneps_pbh(c[m]);
        if (nvalid == NR) {
            _mm256_storeu_si256((__m256i *)(y + m * ldy), out);
        } else {
            _mm256_storeu_si256((__m256i *)edge, out);
            memcpy(y + m * ldy, edge, nvalid * sizeof(uint16_t));
        }
    }
}

/* One specialised copy of `tile` per row count, so its loops over rows unroll into registers. */
static void tile_rows(int rows, const uint16_t *x, int64_t ldx, int64_t k, const uint16_t *panel, uint16_t *y,
                      int64_t ldy, int nvalid, const uint16_t *bias, const uint16_t *pf) {
    switch (rows) {
    case 1: tile(1, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    case 2: tile(2, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    case 3: tile(3, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    case 4: tile(4, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    case 5: tile(5, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    case 6: tile(6, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    case 7: tile(7, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    case 8: tile(8, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    case 9: tile(9, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    case 10: tile(10, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    case 11: tile(11, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    default: tile(MR, x, ldx, k, panel, y, ldy, nvalid, bias, pf); break;
    }
}

int panel_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *panels, const uint16_t *bias,
                      uint16_t *y, int64_t N, int num_threads) {
    int64_t num_panels = (N + NR - 1) / NR, panel_size = (K + 1) / 2 * 2 * NR;
    int64_t row_blocks = (M + MC - 1) / MC;
    int64_t tasks = num_panels * row_blocks;
    /* Consecutive tasks share a row block, so a thread's rows of x stay in its L2 across panels. */
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t block = t / num_panels, p = t % num_panels;
        int64_t m0 = block * MC, m1 = m0 + MC < M ? m0 + MC : M;
        int nvalid = (int)(N - p * NR < NR ? N - p * NR : NR);
        const uint16_t *b = bias ? bias + p * NR : NULL;
        for (int64_t m = m0; m < m1; m += MR) {
            int rows = (int)(m1 - m < MR ? m1 - m : MR);
            const uint16_t *panel = panels + p * panel_size;
            const uint16_t *pf = m == m0 ? panel + AHEAD * 2 * NR           /* ahead in the stream */
                               : m == m0 + MR ? panel + panel_size : NULL;  /* the next panel */
            tile_rows(rows, x + m * K, K, K, panel, y + m * N + p * NR, N, nvalid, b, pf);
        }
    }
    return 0;
}
#endif
