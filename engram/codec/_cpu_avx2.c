/* engram.codec._cpu's kernels for AVX2 (no FMA: -ffp-contract=off and no "fma" target keep every product
 * rounded on its own, as in the baseline copy), picked at import on CPUs that have it. */
#include "_cpu.h"
#ifdef HAVE_AVX2
#pragma GCC target("avx2")
#define KERNELS KERNELS_AVX2
#include "_cpu_kernels.h"
#else
typedef int engram_cpu_avx2_unused;  /* an empty translation unit is not ISO C */
#endif
