/* y = x W^T + b for CPUs, fp32, with W stored once in 16-output panels.
 *
 * Built by pipeline/engine/backends/cpu/build.py like slot_attention.c (system C compiler, -O3, the host's
 * vector instructions, OpenMP) and loaded with ctypes. Portable C with GCC (>= 12) / Clang vector
 * extensions: no intrinsics.
 *
 * Layouts (contiguous, row-major):
 *   x        [M, K]                 the tokens of one forward, packed
 *   panels   [ceil(N / 16), K, 16]  W [N, K] regrouped: panel p holds outputs 16p .. 16p + 15, one
 *                                   16-wide vector per input index k (outputs past N are zero)
 *   bias     [N] or NULL
 *   y        [M, N]
 *
 * One kernel for every M. A tile is (up to 6 rows of x) x (one panel): per k it loads the panel's
 * two 8-wide vectors once and does one multiply-add per row with x[m, k] broadcast, so the 12
 * accumulators stay in registers. With one row (batch-1 decoding) that is a stream over the weight
 * with nothing else in the way, and the panels are read in address order: this is what a
 * memory-bound decoding step needs (oneDNN's packed M=1 path moved ~16 GB/s here, this ~25-60).
 * With many rows it is the classic register-blocked GEMM: tasks of (up to MC rows) x (one panel),
 * K in chunks of KC so a panel's chunk (32 KB) is reused from L1 by every tile of the task.
 *
 * Prefetch. A multi-row tile is too busy for the out-of-order window to keep enough weight lines in
 * flight, and after a chunk's first tile the memory system idles while the others compute from L1.
 * So a chunk's first tile prefetches AHEAD lines (8 KB) ahead of what it reads, and its second
 * tile prefetches the whole next chunk (the next panel's first, across panels: a thread's panels
 * are consecutive in memory). One line per k, 64 bytes, is exactly one k of a panel. Measured on
 * SmolLM2's 211 weights (2 threads, AVX-512 box): 4 rows 19.0 -> 12.7 ms, 8 rows 27.7 -> 18.7, 12
 * rows 30.5 -> 19.6, 20 rows 43.7 -> 31.5, 48 rows 77 -> 65; 1-3 rows unchanged. The one-row
 * stream prefetches too: ROW_AHEAD lines (4 KB) ahead into L1 and ROW_FAR lines (32 KB) ahead into
 * L2, so each call's short streams (a layer's weights are 0.6-3.5 MB) keep enough lines in flight
 * from their first bytes; SmolLM2's linears at one row, Intel Xeon with AMX, 2 threads: 22.5 -> 17.8
 * ms (bf16's twin: 16.6 -> 11.0; on the AMD AVX-512 box a one-row prefetch into L1 alone
 * measured no gain, and this pair is not measured there). Outputs are bitwise the same
 * (no arithmetic moves). A prefetch past the end of the weights is harmless: prefetches never fault.
 */
#include <stdint.h>
#include <string.h>

#include "vmath.h"


enum { NR = 16, MR = 6, KC = 512, MC = 96, AHEAD = 128, ROW_AHEAD = 64, ROW_FAR = 512 };

/* rows x (16 outputs) += x[rows, 0:kc] panel[0:kc]; `first`: start from the bias (or zero) instead of y.
 * nvalid < 16 only in the last panel, where y has fewer columns than the panel. With rows > 1 and
 * `pf`, line k of pf is prefetched (into L2) at step k. */
static inline __attribute__((always_inline)) void tile(const int rows, const float *x, int64_t ldx,
                                                       const float *panel, int64_t kc, float *y, int64_t ldy,
                                                       int nvalid, const float *bias, int first,
                                                       const float *pf) {
    v8 c[MR][2];
    float edge[NR];
    for (int m = 0; m < rows; m++) {
        const float *from = first ? bias : y + m * ldy;
        if (from == NULL) {
            c[m][0] = c[m][1] = splat8(0.0f);
        } else if (nvalid == NR) {
            c[m][0] = load8(from);
            c[m][1] = load8(from + 8);
        } else {
            memset(edge, 0, sizeof edge);
            memcpy(edge, from, nvalid * sizeof(float));
            c[m][0] = load8(edge);
            c[m][1] = load8(edge + 8);
        }
    }
    if (rows == 1) {          /* a stream: two k per iteration, so four accumulators hide FMA latency */
        v8 d0 = splat8(0.0f), d1 = splat8(0.0f);
        int64_t k = 0;
        for (; k + 1 < kc; k += 2) {
            for (int l = 0; l < 2; l++) __builtin_prefetch(panel + (k + ROW_AHEAD + l) * NR, 0, 3);
            for (int l = 0; l < 2; l++) __builtin_prefetch(panel + (k + ROW_FAR + l) * NR, 0, 2);
            v8 a0 = splat8(x[k]), a1 = splat8(x[k + 1]);
            c[0][0] += a0 * load8(panel + k * NR);
            c[0][1] += a0 * load8(panel + k * NR + 8);
            d0 += a1 * load8(panel + k * NR + NR);
            d1 += a1 * load8(panel + k * NR + NR + 8);
        }
        if (k < kc) {
            v8 a0 = splat8(x[k]);
            c[0][0] += a0 * load8(panel + k * NR);
            c[0][1] += a0 * load8(panel + k * NR + 8);
        }
        c[0][0] += d0;
        c[0][1] += d1;
    } else {
        for (int64_t k = 0; k < kc; k++) {
            if (pf != NULL) __builtin_prefetch(pf + k * NR, 0, 2);
            v8 b0 = load8(panel + k * NR), b1 = load8(panel + k * NR + 8);
            for (int m = 0; m < rows; m++) {
                v8 a = splat8(x[m * ldx + k]);
                c[m][0] += a * b0;
                c[m][1] += a * b1;
            }
        }
    }
    for (int m = 0; m < rows; m++) {
        if (nvalid == NR) {
            store8(y + m * ldy, c[m][0]);
            store8(y + m * ldy + 8, c[m][1]);
        } else {
            store8(edge, c[m][0]);
            store8(edge + 8, c[m][1]);
            memcpy(y + m * ldy, edge, nvalid * sizeof(float));
        }
    }
}

/* One specialised copy of `tile` per row count, so its loops over rows unroll into registers. */
static void tile_rows(int rows, const float *x, int64_t ldx, const float *panel, int64_t kc, float *y,
                      int64_t ldy, int nvalid, const float *bias, int first, const float *pf) {
    switch (rows) {
    case 1: tile(1, x, ldx, panel, kc, y, ldy, nvalid, bias, first, pf); break;
    case 2: tile(2, x, ldx, panel, kc, y, ldy, nvalid, bias, first, pf); break;
    case 3: tile(3, x, ldx, panel, kc, y, ldy, nvalid, bias, first, pf); break;
    case 4: tile(4, x, ldx, panel, kc, y, ldy, nvalid, bias, first, pf); break;
    case 5: tile(5, x, ldx, panel, kc, y, ldy, nvalid, bias, first, pf); break;
    default: tile(MR, x, ldx, panel, kc, y, ldy, nvalid, bias, first, pf); break;
    }
}

int panel_linear_f32(const float *x, int64_t M, int64_t K, const float *panels, const float *bias,
                     float *y, int64_t N, int num_threads) {
    int64_t num_panels = (N + NR - 1) / NR;
    int64_t kc_max = M <= MR ? K : KC;        /* one tile per panel: nothing to reuse from L1, no chunks */
    int64_t row_blocks = (M + MC - 1) / MC;
    int64_t tasks = num_panels * row_blocks;
    /* Consecutive tasks share a row block, so a thread's rows of x stay in its L2 across panels. */
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t block = t / num_panels, p = t % num_panels;
        int64_t m0 = block * MC, m1 = m0 + MC < M ? m0 + MC : M;
        int nvalid = (int)(N - p * NR < NR ? N - p * NR : NR);
        const float *panel = panels + p * K * NR;
        const float *b = bias ? bias + p * NR : NULL;
        for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
            int64_t kc = K - k0 < kc_max ? K - k0 : kc_max;
            for (int64_t m = m0; m < m1; m += MR) {
                int rows = (int)(m1 - m < MR ? m1 - m : MR);
                const float *pf = m == m0 ? panel + (k0 + AHEAD) * NR             /* ahead in the stream */
                                : m == m0 + MR ? panel + (k0 + kc) * NR : NULL;   /* the next chunk */
                tile_rows(rows, x + m * K + k0, K, panel + k0 * NR, kc, y + m * N + p * NR, N, nvalid, b, k0 == 0, pf);
            }
        }
    }
    return 0;
}
