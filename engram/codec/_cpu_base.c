/* engram.codec._cpu's kernels for the baseline instruction set (SSE2 on x86-64). */
#define KERNELS KERNELS_BASE
#include "_cpu_kernels.h"
