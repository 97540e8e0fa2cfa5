/* What our AMX kernels (amx_linear_bf16.c, amx_attention_bf16.c) share: the process's permission to use
 * the tile state and the one tile configuration they run with. Included by each kernel's single source
 * file, after its own check that the build targets AMX; the build's cache key covers this header too
 * (build.py). */
#ifndef SPECPIPE_AMX_H
#define SPECPIPE_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Asks Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), once per process before the first
 * tile instruction: 0, or -1 where it is refused. */
static inline int amx_request(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

struct amx_tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Palette 1, all eight tiles 16 rows x 64 bytes: an A tile is 16 rows x 32 bf16, a B tile 16 pairs x
 * 16 columns x 2 bf16, a C tile 16 x 16 fp32. Per thread, released with _tile_release(). */
static inline void amx_configure_tiles(void) {
    struct amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

#endif
