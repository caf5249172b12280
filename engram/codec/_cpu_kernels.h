/* The kernels of engram.codec._cpu, included once per instruction set (_cpu_base.c, _cpu_avx2.c) with KERNELS
 * defined to that file's table name. Everything here is static: each copy is compiled for its own ISA.
 * The rules they follow are in _cpu.c's header. */
#include "_cpu.h"

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---- element conversions ------------------------------------------------------------------------ */

static inline uint32_t f16_to_f32_bits(uint32_t h) {
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t normal = ((h & 0x7FFFu) << 13) + 0x38000000u;          /* re-bias 15 -> 127 */
    uint32_t special = 0x7F800000u | (m << 13);                      /* Inf / NaN */
    uint32_t sub = f2u((float)m * 0x1p-24f);                         /* exact: a normal float32 */
    uint32_t r = e == 0 ? sub : (e == 31 ? special : normal);
    return sign | r;
}

static inline uint32_t widen(const char *p, int kind) {
    if (kind == KIND_BF16) { uint16_t h; memcpy(&h, p, 2); return (uint32_t)h << 16; }
    if (kind == KIND_F16) { uint16_t h; memcpy(&h, p, 2); return f16_to_f32_bits(h); }
    uint32_t u; memcpy(&u, p, 4); return u;
}

/* float32 -> bf16 bits, round to nearest even (NaN: 0x7FC0, as c10::BFloat16). */
static inline uint16_t to_bf16(uint32_t u) {
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
}

/* float32 -> fp16 bits, round to nearest even, overflow to Inf, fp16 subnormals by one float add whose ulp
 * is the fp16 subnormal step (2^-24). NaN: 0x7E00 with the sign. */
static inline uint16_t to_f16(uint32_t u) {
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    uint32_t normal = (a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13;
    normal = normal < 0x7C00u ? normal : 0x7C00u;
    uint32_t sub = f2u(u2f(a) + 0.5f) - 0x3F000000u;
    uint32_t r = a < 0x38800000u ? sub : normal;
    r = a > 0x7F800000u ? 0x7E00u : r;
    return (uint16_t)(sign | r);
}

/* ---- format primitives (fp4_reference: e2m1_round, e4m3_code, e4m3_value, e8m0_value) ------------- */

/* E2M1 magnitude code of q >= 0: nearest, ties to even, saturating at 6 (what the reference's threshold
 * comparisons compute, in fewer operations). Below 1 the values are the multiples of 0.5: adding 2^22, whose
 * ulp is 0.5, rounds q by the FPU's nearest-even. From 1 up E2M1 is a float with one mantissa bit: round the
 * float32 mantissa to bit 22 (a carry moves into the exponent), re-bias 1.0 to code 2, saturate at code 7. */
static inline uint32_t e2m1_code(float q) {
    uint32_t b = f2u(q);
    uint32_t small = f2u(q + 4194304.0f) - 0x4A800000u;
    uint32_t big = ((b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22) - 252u;
    big = big < 7u ? big : 7u;
    return b < 0x3F800000u ? small : big;
}

/* E2M1 value bits of a 4-bit code: 0, 0.5, then exponent 127 + (m >> 1) - 1 with mantissa bit m & 1. */
static inline uint32_t e2m1_bits(uint32_t n) {
    uint32_t m = n & 7u;
    uint32_t big = ((126u + (m >> 1)) << 23) | ((m & 1u) << 22);
    uint32_t v = m < 2u ? (m ? 0x3F000000u : 0u) : big;
    return v | ((n & 8u) << 28);
}

/* E4M3 code of s in [0, 448], nearest even. Subnormals: round(s * 2^9) by adding 2^14, whose ulp is 2^-9. */
static inline uint32_t e4m3_code(float s) {
    uint32_t b = f2u(s);
    uint32_t normal = ((b + 0x7FFFFu + ((b >> 20) & 1u)) >> 20) - (120u << 3);
    uint32_t sub = f2u(s + 16384.0f) - 0x46800000u;
    return b < 0x3C800000u ? sub : normal;  /* s < 2^-6 */
}

/* float32 value of E4M3 magnitude codes 0..126. */
static inline float e4m3_value(uint32_t c) {
    float sub = (float)c * 0x1p-9f;
    float normal = u2f((((c >> 3) + 120u) << 23) | ((c & 7u) << 20));
    return c < 8u ? sub : normal;
}

static float E4M3_TABLE[256];  /* every byte, sign and NaN included (0x7F / 0xFF), as torch's fp8 view */
static uint64_t E2M1_PAIRS[256];  /* a code byte's two E2M1 values as float32 bits: low nibble's in the low half */

static void init_tables(void) {
    for (uint32_t c = 0; c < 256; c++) {
        uint32_t mag = c & 0x7Fu;
        uint32_t bits = mag == 0x7Fu ? 0x7FC00000u : f2u(e4m3_value(mag));
        E4M3_TABLE[c] = u2f(bits | ((c & 0x80u) << 24));
        E2M1_PAIRS[c] = (uint64_t)e2m1_bits(c & 15u) | ((uint64_t)e2m1_bits(c >> 4) << 32);
    }
}

/* ---- the scale step of each format, over n groups (vectorized across groups) ----------------------- */

static void nvfp4_scales(const uint32_t *amax, size_t n, float ts, uint8_t *scales, float *inv) {
    for (size_t g = 0; g < n; g++) {
        float a = u2f(amax[g]);
        float raw = (a / 6.0f) / ts;                       /* torchao's order, IEEE divisions */
        raw = raw < 448.0f ? raw : 448.0f;
        uint32_t c = e4m3_code(raw);
        c = c < 1u ? 1u : c;                               /* a nonzero group never gets scale 0 */
        c = amax[g] ? c : 0u;
        scales[g] = (uint8_t)c;
        float s = e4m3_value(c) * ts;
        inv[g] = 1.0f / (s > 0.0f ? s : 1.0f);             /* once per group, IEEE division */
    }
}

static void mxfp4_scales(const uint32_t *amax, size_t n, int round_up, uint8_t *scales, float *inv) {
    for (size_t g = 0; g < n; g++) {
        int32_t c = (int32_t)(amax[g] >> 23) - 2;          /* biased exponent of amax, minus 2 */
        c += round_up ? (int32_t)((amax[g] & 0x7FFFFFu) > 0x400000u) : 0;
        c = c < 0 ? 0 : (c > 254 ? 254 : c);
        scales[g] = (uint8_t)c;
        inv[g] = u2f((uint32_t)(254 - c) << 23);           /* 2^(127 - c): exactly 1/scale */
    }
}

/* ---- encoders ------------------------------------------------------------------------------------- */

/* n groups of float32 bits laid out group after group: tile[g * G + k]. Writes G/2 code bytes and one
 * scale per group, contiguous. Returns the OR of "some element is NaN/Inf". */
static inline __attribute__((always_inline)) uint32_t
encode_rows_g(const uint32_t *tile, size_t n, const GroupSpec *sp, unsigned G, uint8_t *codes, uint8_t *scales) {
    uint32_t amax[TILE / 16];
    float inv[TILE / 16];
    uint8_t c4[TILE];
    uint32_t bad = 0;
    for (size_t g = 0; g < n; g++) {
        uint32_t m = 0;
        for (unsigned k = 0; k < G; k++) {
            uint32_t a = tile[g * G + k] & 0x7FFFFFFFu;
            m = a > m ? a : m;
        }
        amax[g] = m;
        bad |= m >= 0x7F800000u;
    }
    if (sp->fmt == 0) nvfp4_scales(amax, n, sp->ts, scales, inv);
    else mxfp4_scales(amax, n, sp->round_up, scales, inv);
    for (size_t g = 0; g < n; g++) {
        float s = inv[g];
        for (unsigned k = 0; k < G; k++) {
            uint32_t e = tile[g * G + k];
            uint32_t code = e2m1_code(u2f(e & 0x7FFFFFFFu) * s) | ((e >> 31) << 3);
            c4[g * G + k] = (uint8_t)code;
        }
    }
    for (size_t i = 0; i < n * G / 2; i++) codes[i] = (uint8_t)(c4[2 * i] | (c4[2 * i + 1] << 4));
    return bad;
}

static uint32_t encode_rows(const uint32_t *tile, size_t n, const GroupSpec *sp, uint8_t *codes, uint8_t *scales) {
    return sp->group == 16 ? encode_rows_g(tile, n, sp, 16, codes, scales)
                           : encode_rows_g(tile, n, sp, 32, codes, scales);
}

/* nl groups laid out element-major, one group per lane: tile[k * LANES + i] is element k of group i (rows
 * adjacent in memory: K's channel axis). Codes come out as codes[j * LANES + i] (byte j of group i). */
static inline __attribute__((always_inline)) uint32_t
encode_lanes_g(const uint32_t *tile, size_t nl, const GroupSpec *sp, unsigned G, uint8_t *codes, uint8_t *scales) {
    uint32_t amax[LANES];
    float inv[LANES];
    uint8_t c4[32 * LANES];
    uint32_t bad = 0;
    for (size_t i = 0; i < LANES; i++) amax[i] = 0;
    for (unsigned k = 0; k < G; k++)
        for (size_t i = 0; i < LANES; i++) {
            uint32_t a = tile[k * LANES + i] & 0x7FFFFFFFu;
            amax[i] = a > amax[i] ? a : amax[i];
        }
    for (size_t i = 0; i < nl; i++) bad |= amax[i] >= 0x7F800000u;
    if (sp->fmt == 0) nvfp4_scales(amax, LANES, sp->ts, scales, inv);
    else mxfp4_scales(amax, LANES, sp->round_up, scales, inv);
    for (unsigned k = 0; k < G; k++)
        for (size_t i = 0; i < LANES; i++) {
            uint32_t e = tile[k * LANES + i];
            c4[k * LANES + i] = (uint8_t)(e2m1_code(u2f(e & 0x7FFFFFFFu) * inv[i]) | ((e >> 31) << 3));
        }
    for (unsigned j = 0; j < G / 2; j++)
        for (size_t i = 0; i < LANES; i++)
            codes[j * LANES + i] = (uint8_t)(c4[2 * j * LANES + i] | (c4[(2 * j + 1) * LANES + i] << 4));
    return bad;
}

static uint32_t encode_lanes(const uint32_t *tile, size_t nl, const GroupSpec *sp, uint8_t *codes, uint8_t *scales) {
    return sp->group == 16 ? encode_lanes_g(tile, nl, sp, 16, codes, scales)
                           : encode_lanes_g(tile, nl, sp, 32, codes, scales);
}

/* FP8: per element, |x| times the tensor's reciprocal scale, clamped to 448, E4M3 code, sign in bit 7. */
static uint32_t fp8_encode_n(const uint32_t *tile, size_t n, float inv, uint8_t *codes) {
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t e = tile[i], a = e & 0x7FFFFFFFu;
        bad |= a + 0x00800000u;  /* bit 31 set exactly when a >= 0x7F800000: NaN or Inf */
        float q = u2f(a) * inv;
        q = q < 448.0f ? q : 448.0f;
        codes[i] = (uint8_t)(e4m3_code(q) | ((e >> 31) << 7));
    }
    return bad >> 31;
}

/* ---- strided input views ----------------------------------------------------------------------------- */


/* cnt elements starting at p, stride st bytes, widened to float32 bits; the stride-1 cases vectorize. */
static void load(uint32_t *dst, const char *p, ptrdiff_t st, size_t cnt, int kind) {
    if (kind == KIND_BF16 && st == 2) {
        const uint16_t *h = (const uint16_t *)(const void *)p;
        for (size_t i = 0; i < cnt; i++) dst[i] = (uint32_t)h[i] << 16;
    } else if (kind == KIND_F16 && st == 2) {
        const uint16_t *h = (const uint16_t *)(const void *)p;
        for (size_t i = 0; i < cnt; i++) dst[i] = f16_to_f32_bits(h[i]);
    } else if (kind == KIND_F32 && st == 4) {
        memcpy(dst, p, cnt * 4);
    } else {
        for (size_t i = 0; i < cnt; i++) dst[i] = widen(p + (ptrdiff_t)i * st, kind);
    }
}

/* The rows of a view are adjacent in memory (stride one element) and its columns are not: K's channel axis,
 * a transposed view. Such inputs are read a tile of LANES rows by one group of columns at a time. */
static int lanes_layout(const View *v) {
    return v->n[1] > 1 && v->s[1] == v->item && v->s[2] != v->item;
}

/* A grouped format over a view; codes (rows, cols_p/2) and scales (rows, cols_p/G), row-major. */
static uint32_t encode_grouped(const View *v, const GroupSpec *sp, uint8_t *codes, uint8_t *scales) {
    const ptrdiff_t R = v->n[1], C = v->n[2], G = sp->group;
    const ptrdiff_t cp = (C + G - 1) / G * G, code_row = cp / 2, scale_row = cp / G;
    uint32_t tile[TILE];
    uint32_t bad = 0;
    for (ptrdiff_t b = 0; b < v->n[0]; b++) {
        const char *blk = v->base + b * v->s[0];
        ptrdiff_t row0 = b * R;
        if (lanes_layout(v)) {
            uint8_t ct[16 * LANES], st[LANES];
            /* column groups outer: the G columns' runs of rows are read front to back, G streams at once */
            for (ptrdiff_t cg = 0; cg < scale_row; cg++) {
                for (ptrdiff_t r0 = 0; r0 < R; r0 += LANES) {
                    ptrdiff_t nl = R - r0 < LANES ? R - r0 : LANES;
                    if (nl < LANES) memset(tile, 0, sizeof tile);
                    for (ptrdiff_t k = 0; k < G; k++) {
                        ptrdiff_t c = cg * G + k;
                        if (c < C) load(tile + k * LANES, blk + r0 * v->s[1] + c * v->s[2], v->item, (size_t)nl,
                                        v->kind);
                        else memset(tile + k * LANES, 0, (size_t)nl * 4);
                    }
                    bad |= encode_lanes(tile, (size_t)nl, sp, ct, st);
                    for (ptrdiff_t i = 0; i < nl; i++) {
                        uint8_t *dst = codes + (row0 + r0 + i) * code_row + cg * G / 2;
                        for (ptrdiff_t j = 0; j < G / 2; j++) dst[j] = ct[j * LANES + i];
                        scales[(row0 + r0 + i) * scale_row + cg] = st[i];
                    }
                }
            }
        } else if (C == cp && v->s[2] == v->item && v->s[1] == C * v->item) {
            /* rows packed end to end and no padding: one flat run of groups */
            ptrdiff_t total = R * C;
            for (ptrdiff_t e0 = 0; e0 < total; e0 += TILE) {
                ptrdiff_t cnt = total - e0 < TILE ? total - e0 : TILE;
                load(tile, blk + e0 * v->item, v->item, (size_t)cnt, v->kind);
                bad |= encode_rows(tile, (size_t)(cnt / G), sp, codes + (row0 * C + e0) / 2,
                                   scales + (row0 * C + e0) / G);
            }
        } else {
            for (ptrdiff_t r = 0; r < R; r++) {
                const char *row = blk + r * v->s[1];
                for (ptrdiff_t c0 = 0; c0 < cp; c0 += TILE) {
                    ptrdiff_t cnt = cp - c0 < TILE ? cp - c0 : TILE;
                    ptrdiff_t real = C - c0 < cnt ? C - c0 : cnt;
                    load(tile, row + c0 * v->s[2], v->s[2], (size_t)real, v->kind);
                    memset(tile + real, 0, (size_t)(cnt - real) * 4);  /* padding: +0.0 */
                    bad |= encode_rows(tile, (size_t)(cnt / G), sp, codes + (row0 + r) * code_row + c0 / 2,
                                       scales + (row0 + r) * scale_row + c0 / G);
                }
            }
        }
    }
    return bad;
}

static uint32_t encode_fp8(const View *v, float inv, uint8_t *codes) {
    const ptrdiff_t R = v->n[1], C = v->n[2];
    uint32_t tile[TILE];
    uint8_t ct[TILE];
    uint32_t bad = 0;
    for (ptrdiff_t b = 0; b < v->n[0]; b++) {
        const char *blk = v->base + b * v->s[0];
        uint8_t *out = codes + b * R * C;
        if (lanes_layout(v)) {
            for (ptrdiff_t c0 = 0; c0 < C; c0 += 16) {
                ptrdiff_t nc = C - c0 < 16 ? C - c0 : 16;
                for (ptrdiff_t r0 = 0; r0 < R; r0 += LANES) {
                    ptrdiff_t nl = R - r0 < LANES ? R - r0 : LANES;
                    for (ptrdiff_t k = 0; k < nc; k++)
                        load(tile + k * nl, blk + r0 * v->s[1] + (c0 + k) * v->s[2], v->item, (size_t)nl, v->kind);
                    bad |= fp8_encode_n(tile, (size_t)(nc * nl), inv, ct);
                    for (ptrdiff_t k = 0; k < nc; k++)
                        for (ptrdiff_t i = 0; i < nl; i++) out[(r0 + i) * C + c0 + k] = ct[k * nl + i];
                }
            }
        } else if (v->s[2] == v->item && v->s[1] == C * v->item) {
            ptrdiff_t total = R * C;
            for (ptrdiff_t e0 = 0; e0 < total; e0 += TILE) {
                ptrdiff_t cnt = total - e0 < TILE ? total - e0 : TILE;
                load(tile, blk + e0 * v->item, v->item, (size_t)cnt, v->kind);
                bad |= fp8_encode_n(tile, (size_t)cnt, inv, out + e0);
            }
        } else {
            for (ptrdiff_t r = 0; r < R; r++)
                for (ptrdiff_t c0 = 0; c0 < C; c0 += TILE) {
                    ptrdiff_t cnt = C - c0 < TILE ? C - c0 : TILE;
                    load(tile, blk + r * v->s[1] + c0 * v->s[2], v->s[2], (size_t)cnt, v->kind);
                    bad |= fp8_encode_n(tile, (size_t)cnt, inv, out + r * C + c0);
                }
        }
    }
    return bad;
}

/* max |x| as float32 bits over a view, in memory order where it can (the max does not care). */
static uint32_t amax_bits(const View *v) {
    ptrdiff_t inner = 2, outer = 1;
    if (lanes_layout(v)) inner = 1, outer = 2;
    uint32_t m = 0;
    for (ptrdiff_t b = 0; b < v->n[0]; b++)
        for (ptrdiff_t o = 0; o < v->n[outer]; o++) {
            const char *p = v->base + b * v->s[0] + o * v->s[outer];
            ptrdiff_t n = v->n[inner], st = v->s[inner];
            if (v->kind != KIND_F32 && st == 2) {
                /* 16-bit magnitudes order like their values (Inf/NaN above all): max over int16 bits */
                const uint16_t *h = (const uint16_t *)(const void *)p;
                uint16_t hm = 0;
                for (ptrdiff_t i = 0; i < n; i++) {
                    uint16_t a = h[i] & 0x7FFFu;
                    hm = a > hm ? a : hm;
                }
                uint32_t w = v->kind == KIND_BF16 ? (uint32_t)hm << 16 : f16_to_f32_bits(hm);
                m = w > m ? w : m;
            } else if (v->kind == KIND_F32 && st == 4) {
                const uint32_t *u = (const uint32_t *)(const void *)p;
                for (ptrdiff_t i = 0; i < n; i++) {
                    uint32_t a = u[i] & 0x7FFFFFFFu;
                    m = a > m ? a : m;
                }
            } else {
                for (ptrdiff_t i = 0; i < n; i++) {
                    uint32_t a = widen(p + i * st, v->kind) & 0x7FFFFFFFu;
                    m = a > m ? a : m;
                }
            }
        }
    return m;
}

/* ---- decoders ------------------------------------------------------------------------------------- */


/* cnt float32 values to dst (stride st bytes) in the output's dtype; the stride-1 cases vectorize. */
static void store(char *dst, ptrdiff_t st, const float *val, size_t cnt, int kind) {
    const uint32_t *u = (const uint32_t *)(const void *)val;
    if (kind == KIND_BF16 && st == 2) {
        uint16_t *h = (uint16_t *)(void *)dst;
        for (size_t i = 0; i < cnt; i++) h[i] = to_bf16(u[i]);
    } else if (kind == KIND_F16 && st == 2) {
        uint16_t *h = (uint16_t *)(void *)dst;
        for (size_t i = 0; i < cnt; i++) h[i] = to_f16(u[i]);
    } else if (kind == KIND_F32 && st == 4) {
        memcpy(dst, val, cnt * 4);
    } else {
        for (size_t i = 0; i < cnt; i++) {
            char *p = dst + (ptrdiff_t)i * st;
            if (kind == KIND_F32) memcpy(p, u + i, 4);
            else { uint16_t h = kind == KIND_BF16 ? to_bf16(u[i]) : to_f16(u[i]); memcpy(p, &h, 2); }
        }
    }
}

/* E8M0: 2^(c - 127); code 0 is 2^-127, a float32 subnormal (and 255 is Inf, as the reference's bits give). */
static inline float e8m0_value(uint32_t c) { return u2f(c ? c << 23 : 0x00400000u); }

static inline float group_scale(const GroupSpec *sp, uint8_t sc) {
    return sp->fmt == 0 ? E4M3_TABLE[sc] : e8m0_value(sc);
}

/* n groups, codes group after group (G/2 bytes each) -> val[g * G + k]. NVFP4 (e2m1 * e4m3) * ts, MXFP4
 * e2m1 * 2^(c - 127): the reference's products in its order. A code byte becomes its two E2M1 values by one
 * 8-byte load from a 256-entry table; the products then vectorize across a group. */
static inline __attribute__((always_inline)) void
decode_rows_g(const uint8_t *codes, const uint8_t *scales, size_t n, const GroupSpec *sp, unsigned G, float *val) {
    for (size_t i = 0; i < n * G / 2; i++) memcpy(val + 2 * i, &E2M1_PAIRS[codes[i]], 8);
    if (sp->fmt == 0) {
        float ts = sp->ts;
        for (size_t g = 0; g < n; g++) {
            float s = E4M3_TABLE[scales[g]];
            for (unsigned k = 0; k < G; k++) val[g * G + k] = (val[g * G + k] * s) * ts;
        }
    } else {
        for (size_t g = 0; g < n; g++) {
            float s = e8m0_value(scales[g]);
            for (unsigned k = 0; k < G; k++) val[g * G + k] = val[g * G + k] * s;
        }
    }
}

static void decode_rows(const uint8_t *codes, const uint8_t *scales, size_t n, const GroupSpec *sp, float *val) {
    if (sp->group == 16) decode_rows_g(codes, scales, n, sp, 16, val);
    else decode_rows_g(codes, scales, n, sp, 32, val);
}

/* One group per lane: codes[j * LANES + i] is byte j of group i -> val[k * LANES + i]. */
static inline __attribute__((always_inline)) void
decode_lanes_g(const uint8_t *codes, const uint8_t *scales, const GroupSpec *sp, unsigned G, float *val) {
    float s[LANES];
    for (size_t i = 0; i < LANES; i++) s[i] = group_scale(sp, scales[i]);
    if (sp->fmt == 0) {
        float ts = sp->ts;
        for (unsigned j = 0; j < G / 2; j++)
            for (size_t i = 0; i < LANES; i++) {
                uint32_t byte = codes[j * LANES + i];
                val[2 * j * LANES + i] = (u2f(e2m1_bits(byte & 15u)) * s[i]) * ts;
                val[(2 * j + 1) * LANES + i] = (u2f(e2m1_bits(byte >> 4)) * s[i]) * ts;
            }
    } else {
        for (unsigned j = 0; j < G / 2; j++)
            for (size_t i = 0; i < LANES; i++) {
                uint32_t byte = codes[j * LANES + i];
                val[2 * j * LANES + i] = u2f(e2m1_bits(byte & 15u)) * s[i];
                val[(2 * j + 1) * LANES + i] = u2f(e2m1_bits(byte >> 4)) * s[i];
            }
    }
}

static void decode_lanes(const uint8_t *codes, const uint8_t *scales, const GroupSpec *sp, float *val) {
    if (sp->group == 16) decode_lanes_g(codes, scales, sp, 16, val);
    else decode_lanes_g(codes, scales, sp, 32, val);
}

static int out_lanes_layout(const OutView *v) {
    return v->n[1] > 1 && v->s[1] == v->item && v->s[2] != v->item;
}

static void decode_grouped(const uint8_t *codes, const uint8_t *scales, const GroupSpec *sp, const OutView *v) {
    const ptrdiff_t R = v->n[1], C = v->n[2], G = sp->group;
    const ptrdiff_t cp = (C + G - 1) / G * G, code_row = cp / 2, scale_row = cp / G;
    float val[TILE];
    for (ptrdiff_t b = 0; b < v->n[0]; b++) {
        char *blk = v->base + b * v->s[0];
        ptrdiff_t row0 = b * R;
        if (out_lanes_layout(v)) {
            uint8_t ct[16 * LANES], st[LANES];
            memset(ct, 0, sizeof ct);
            memset(st, 0, sizeof st);
            for (ptrdiff_t cg = 0; cg < scale_row; cg++) {
                for (ptrdiff_t r0 = 0; r0 < R; r0 += LANES) {
                    ptrdiff_t nl = R - r0 < LANES ? R - r0 : LANES;
                    for (ptrdiff_t i = 0; i < nl; i++) {
                        const uint8_t *src = codes + (row0 + r0 + i) * code_row + cg * G / 2;
                        for (ptrdiff_t j = 0; j < G / 2; j++) ct[j * LANES + i] = src[j];
                        st[i] = scales[(row0 + r0 + i) * scale_row + cg];
                    }
                    decode_lanes(ct, st, sp, val);
                    ptrdiff_t nk = C - cg * G < G ? C - cg * G : G;
                    for (ptrdiff_t k = 0; k < nk; k++)
                        store(blk + r0 * v->s[1] + (cg * G + k) * v->s[2], v->item, val + k * LANES, (size_t)nl,
                              v->kind);
                }
            }
        } else if (C == cp && v->s[2] == v->item && v->s[1] == C * v->item) {
            ptrdiff_t total = R * C;
            for (ptrdiff_t e0 = 0; e0 < total; e0 += TILE) {
                ptrdiff_t cnt = total - e0 < TILE ? total - e0 : TILE;
                decode_rows(codes + (row0 * C + e0) / 2, scales + (row0 * C + e0) / G, (size_t)(cnt / G), sp, val);
                store(blk + e0 * v->item, v->item, val, (size_t)cnt, v->kind);
            }
        } else {
            for (ptrdiff_t r = 0; r < R; r++)
                for (ptrdiff_t c0 = 0; c0 < cp; c0 += TILE) {
                    ptrdiff_t cnt = cp - c0 < TILE ? cp - c0 : TILE;
                    ptrdiff_t real = C - c0 < cnt ? C - c0 : cnt;  /* the padding is not written */
                    decode_rows(codes + (row0 + r) * code_row + c0 / 2, scales + (row0 + r) * scale_row + c0 / G,
                                (size_t)(cnt / G), sp, val);
                    store(blk + r * v->s[1] + c0 * v->s[2], v->s[2], val, (size_t)real, v->kind);
                }
        }
    }
}

/* FP8: 256 possible codes, so the output values are a table built once per call with the reference's
 * arithmetic (code value * scale, then the cast); each element is one lookup. */
static void decode_fp8(const uint8_t *codes, float scale, const OutView *v) {
    const ptrdiff_t R = v->n[1], C = v->n[2];
    uint32_t t32[256];
    uint16_t t16[256];
    for (int c = 0; c < 256; c++) {
        t32[c] = f2u(E4M3_TABLE[c] * scale);
        t16[c] = v->kind == KIND_BF16 ? to_bf16(t32[c]) : to_f16(t32[c]);
    }
    for (ptrdiff_t b = 0; b < v->n[0]; b++) {
        char *blk = v->base + b * v->s[0];
        const uint8_t *in = codes + b * R * C;
        int lanes = out_lanes_layout(v);
        ptrdiff_t outer_n = lanes ? C : R, inner_n = lanes ? R : C;
        ptrdiff_t outer_s = lanes ? v->s[2] : v->s[1], inner_s = lanes ? v->s[1] : v->s[2];
        ptrdiff_t in_outer = lanes ? 1 : C, in_inner = lanes ? C : 1;
        for (ptrdiff_t o = 0; o < outer_n; o++) {
            char *dst = blk + o * outer_s;
            const uint8_t *src = in + o * in_outer;
            if (v->kind == KIND_F32 && inner_s == 4) {
                uint32_t *d = (uint32_t *)(void *)dst;
                for (ptrdiff_t i = 0; i < inner_n; i++) d[i] = t32[src[i * in_inner]];
            } else if (v->kind != KIND_F32 && inner_s == 2) {
                uint16_t *d = (uint16_t *)(void *)dst;
                for (ptrdiff_t i = 0; i < inner_n; i++) d[i] = t16[src[i * in_inner]];
            } else {
                for (ptrdiff_t i = 0; i < inner_n; i++) {
                    uint8_t c = src[i * in_inner];
                    if (v->kind == KIND_F32) memcpy(dst + i * inner_s, t32 + c, 4);
                    else memcpy(dst + i * inner_s, t16 + c, 2);
                }
            }
        }
    }
}

const Kernels KERNELS = {init_tables, amax_bits, encode_grouped, encode_fp8, decode_grouped, decode_fp8};
