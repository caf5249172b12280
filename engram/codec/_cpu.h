/* engram.codec._cpu: what the Python glue (_cpu.c) and the kernels (_cpu_kernels.h, compiled once per ISA by
 * _cpu_base.c and _cpu_avx2.c) share: element kinds, tile sizes, views, and the table of entry points. */
#ifndef ENGRAM_CPU_H
#define ENGRAM_CPU_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2 };
enum { TILE = 2048 };  /* elements per tile: 8 KiB of float32 bits, inside L1 */
enum { LANES = 64 };   /* rows per tile when the rows are adjacent in memory (the channel axis) */
_Static_assert(TILE >= 32 * LANES, "a lanes tile holds one group of 32 columns of LANES rows");

typedef struct {
    int fmt;          /* 0 nvfp4, 1 mxfp4 */
    unsigned group;   /* 16 or 32 */
    float ts;         /* nvfp4 tensor scale */
    int round_up;     /* mxfp4 variant */
} GroupSpec;

/* An input: (blocks, rows, cols) elements and their strides in bytes, read as the (blocks * rows, cols) matrix. */
typedef struct {
    const char *base;
    int kind;
    ptrdiff_t item;          /* bytes per element */
    ptrdiff_t n[3], s[3];    /* (blocks, rows, cols) and their strides in bytes */
} View;

/* An output of the same form, written. */
typedef struct {
    char *base;
    int kind;
    ptrdiff_t item;
    ptrdiff_t n[3], s[3];
} OutView;

typedef struct {
    void (*init)(void);
    uint32_t (*amax_bits)(const View *v);  /* max |x| as float32 bits */
    uint32_t (*encode_grouped)(const View *v, const GroupSpec *sp, uint8_t *codes, uint8_t *scales);
    uint32_t (*encode_fp8)(const View *v, float inv, uint8_t *codes);
    void (*decode_grouped)(const uint8_t *codes, const uint8_t *scales, const GroupSpec *sp, const OutView *v);
    void (*decode_fp8)(const uint8_t *codes, float scale, const OutView *v);
} Kernels;

/* The same kernels for two instruction sets: the x86-64 baseline (SSE2), and AVX2 where the compiler can
 * target it (HAVE_AVX2). Both do the same IEEE operations in the same order: the same bits. */
extern const Kernels KERNELS_BASE;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HAVE_AVX2 1
extern const Kernels KERNELS_AVX2;
#endif

#endif
