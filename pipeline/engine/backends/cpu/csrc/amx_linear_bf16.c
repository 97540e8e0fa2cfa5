/* y = x W^T + b by AMX tiles (CPUs with amx_bf16: Intel Xeon from Sapphire Rapids), bf16 in and out,
 * over the same pair panels as panel_linear_bf16.c: one copy of each weight serves both kernels.
 *
 * Built and loaded like the other kernels (pipeline/engine/backends/cpu/build.py, linear.py); on a CPU
 * without AMX the build fails with the #error below and the plan does not offer the kernel.
 *
 * Layouts (contiguous, row-major):
 *   x        [M, K]                            bf16; K a multiple of 32 (one A tile's width)
 *   panels   [ceil(N / 16), K / 2, 16, 2]      panel_linear_bf16.c's pair panels. Sixteen consecutive
 *                                              pairs of a panel (1 KB) are exactly one AMX B tile:
 *                                              row r = pair j + r, its 16 outputs x 2 inputs
 *   bias     [N] bf16 or NULL
 *   y        [M, N] bf16
 * An A tile is 16 rows of x x 32 inputs, read in place (stride K); C tiles are 16 rows x 16 outputs in
 * fp32. TDPBF16PS multiplies bf16 pairs exactly and accumulates in fp32, like VDPBF16PS; the products
 * of one tile step are summed in the unit's own order (and denormal inputs read as zero), so y agrees
 * with the panel kernel's to fp32 rounding before its one rounding to bf16, not bitwise. The bias is
 * added in fp32 before that rounding, as the panel kernel's.
 *
 * Work: tasks of (up to MB = 64 rows: four C tiles) x (one panel), consecutive tasks sharing a row
 * block as in the panel kernels; per 32 inputs a task loads the panel's B tile once and one A tile per
 * 16 rows, so each weight byte is read from memory once per 64 rows. Rows past M in the last tile read
 * a zeroed copy of x's tail and are not written. Each thread configures its tiles (palette 1: 8 tiles
 * of 16 rows x 64 bytes) in the parallel region and releases them at its end. The process must be
 * allowed the tile state once (Linux: arch_prctl ARCH_REQ_XCOMP_PERM): amx_enable.
 *
 * Where it wins (measured by the plan, backends/cpu/calibrate.py): SmolLM2's linears in bf16 on an
 * Intel Xeon with AMX, 2 threads, ms per pass over all of them, this kernel / oneDNN's packed linear:
 * 8 rows 11.6 / 14.5, 16 rows 12.0 / 15.8, 32 rows 14.9 / 17.2, 64 rows 27.6 / 20.5: past 32 rows it
 * falls behind (A tiles packed contiguously, or 2 x 2 blocks of C tiles, measured no better), and the
 * plan keeps oneDNN there.
 * Returns 0; -2 where K is not a multiple of 32; -1 where scratch memory ran out.
 */
#if !defined(__AMX_BF16__) || !defined(__AMX_TILE__) || !defined(__AVX512BF16__)
#error "needs AMX-BF16 (the amx_bf16 and amx_tile CPU flags) and AVX512-BF16: not in this CPU's -march=native"
#else                         /* the rest only where it compiles: the error above is the build's only message */
#include <stdlib.h>

#include "amx.h"

enum { NR = 16, TM = 16, TK = 32, MB = 64 };

int amx_enable(void) { return amx_request(); }

/* One task's K / 32 steps, two at a time: C tile r (rows 16r.. of the task) += A (rows of x) x B (16
 * pairs of the panel). B alternates between tiles 5 and 7 by step and A between 4 and 6 by row tile,
 * so a load never waits for the product just issued to finish reading its tile (tiles are not renamed). */
#define STEP(R, BT, J)                                                                                 \
    do {                                                                                               \
        _tile_loadd(BT, panel + (J) * TK * NR, 64);                                                    \
        _tile_loadd(4, a[0] + (J) * TK, lda); _tile_dpbf16ps(0, 4, BT);                                \
        if (R > 1) { _tile_loadd(6, a[1] + (J) * TK, lda); _tile_dpbf16ps(1, 6, BT); }                 \
        if (R > 2) { _tile_loadd(4, a[2] + (J) * TK, lda); _tile_dpbf16ps(2, 4, BT); }                 \
        if (R > 3) { _tile_loadd(6, a[3] + (J) * TK, lda); _tile_dpbf16ps(3, 6, BT); }                 \
    } while (0)
#define STEPS(R)                                                                                       \
    {                                                                                                  \
        int64_t j = 0;                                                                                 \
        for (; j + 1 < steps; j += 2) { STEP(R, 5, j); STEP(R, 7, j + 1); }                            \
        if (j < steps) STEP(R, 5, j);                                                                  \
    }

static void store_tile(const float *c, int rows, uint16_t *y, int64_t ldy, int nvalid, const uint16_t *bias) {
    __m512 b = _mm512_setzero_ps();
    if (bias != NULL) {
        uint16_t edge[NR] = {0};
        memcpy(edge, bias, nvalid * sizeof(uint16_t));
        b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)edge)), 16));
    }
    for (int r = 0; r < rows; r++) {
        __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * NR), b));
        if (nvalid == NR) {
            _mm256_storeu_si256((__m256i *)(y + r * ldy), out);
        } else {
            uint16_t edge[NR];
            _mm256_storeu_si256((__m256i *)edge, out);
            memcpy(y + r * ldy, edge, nvalid * sizeof(uint16_t));
        }
    }
}

int amx_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *panels, const uint16_t *bias,
                    uint16_t *y, int64_t N, int num_threads) {
    if (K % TK != 0) return -2;
    int64_t steps = K / TK, num_panels = (N + NR - 1) / NR, panel_size = K / 2 * 2 * NR;
    int64_t full = M / TM * TM;                            /* rows read in place; the rest from `tail` */
    uint16_t *tail = NULL;
    if (full < M) {
        tail = calloc((size_t)TM * K, sizeof(uint16_t));
        if (tail == NULL) return -1;
        memcpy(tail, x + full * K, (size_t)(M - full) * K * sizeof(uint16_t));
    }
    /* Tasks: (up to MB rows: four C tiles) x (one panel); consecutive tasks share a row block, as in
       the panel kernels, so each weight byte is read from memory once per MB rows. */
    int64_t row_blocks = (M + MB - 1) / MB, tasks = num_panels * row_blocks;
    #pragma omp parallel num_threads(num_threads)
    {
        amx_configure_tiles();
        float c[4][TM * NR];
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t p = t % num_panels, m0 = t / num_panels * MB;
            int64_t m1 = m0 + MB < M ? m0 + MB : M;
            int R = (int)((m1 - m0 + TM - 1) / TM);
            const uint16_t *panel = panels + p * panel_size, *a[4];
            for (int r = 0; r < R; r++)       /* rows in place where 16 whole rows remain, else the tail */
                a[r] = m0 + (r + 1) * TM <= M ? x + (m0 + r * TM) * K : tail;
            int64_t lda = K * sizeof(uint16_t);
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            switch (R) {
            case 1: STEPS(1) break;
            case 2: STEPS(2) break;
            case 3: STEPS(3) break;
            default: STEPS(4) break;
            }
            _tile_stored(0, c[0], NR * sizeof(float));
            if (R > 1) _tile_stored(1, c[1], NR * sizeof(float));
            if (R > 2) _tile_stored(2, c[2], NR * sizeof(float));
            if (R > 3) _tile_stored(3, c[3], NR * sizeof(float));
            int nvalid = (int)(N - p * NR < NR ? N - p * NR : NR);
            for (int r = 0; r < R; r++) {
                int64_t r0 = m0 + (int64_t)r * TM;
                store_tile(c[r], (int)(M - r0 < TM ? M - r0 : TM), y + r0 * N + p * NR, N, nvalid,
                           bias ? bias + p * NR : NULL);
            }
        }
        _tile_release();
    }
    free(tail);
    return 0;
}
#endif
