/* The fused quantization and delta kernels of checkflow's q8/q4/q2 and delta codecs.

   Plain C with no Python headers: checkflow/codec/_build.py compiles it with the system's C
   compiler at first use (into a per-user cache) and checkflow/codec/_native.py loads it with
   ctypes. One pass per block does what takes a dozen torch ops (compare with the snapshot,
   min/max, quantize, pack, update the reconstruction and the snapshot).

   Exactness: the arithmetic mirrors checkflow/codec/_quant_eager.py operation for operation,
   and the build uses -ffp-contract=off and no fast-math, so every float operation is one
   IEEE rounding exactly like the separate torch ops: the reconstruction kept here is
   bit-identical to what the torch path decodes, and the other way round. */

#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { LINEAR = 1, LOG = 2, RAW = 3, LOG16 = 4 };

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
/* c10::BFloat16's round to nearest even (NaN -> 0x7FC0). */
static inline uint16_t f32_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float f32_f32(uint32_t u) { return bits_f32(u); }
/* Float order as signed-int order (finite or inf), so min/max reductions vectorize. */
static inline int32_t sortable(float f) {
    int32_t i = (int32_t)f32_bits(f);
    return i ^ ((i >> 31) & 0x7fffffff);
}
static inline float unsortable(int32_t k) {
    return bits_f32((uint32_t)(k ^ ((k >> 31) & 0x7fffffff)));
}

static void pack(const uint8_t *q, int64_t n, int bits, uint8_t *out) {
    if (bits == 8) { memcpy(out, q, (size_t)n); return; }
    int per = 8 / bits;
    int64_t full = n / per;
    if (bits == 4) {
        for (int64_t i = 0; i < full; i++) out[i] = (uint8_t)(q[2 * i] | (q[2 * i + 1] << 4));
    } else {
        for (int64_t i = 0; i < full; i++)
            out[i] = (uint8_t)(q[4 * i] | (q[4 * i + 1] << 2) | (q[4 * i + 2] << 4)
                               | (q[4 * i + 3] << 6));
    }
    if (full * per < n) {
        uint8_t b = 0;
        for (int64_t k = full * per; k < n; k++) b |= (uint8_t)(q[k] << (bits * (k - full * per)));
        out[full] = b;
    }
}

static void unpack(const uint8_t *in, int64_t n, int bits, uint8_t *q) {
    if (bits == 8) { memcpy(q, in, (size_t)n); return; }
    uint8_t mask = (uint8_t)((1 << bits) - 1);
    int per = 8 / bits;
    int64_t full = n / per;
    /* Byte by byte (not code by code) so the loop vectorizes. */
    if (bits == 4) {
        for (int64_t i = 0; i < full; i++) {
            q[2 * i] = (uint8_t)(in[i] & 15); q[2 * i + 1] = (uint8_t)(in[i] >> 4);
        }
    } else {
        for (int64_t i = 0; i < full; i++) {
            q[4 * i] = (uint8_t)(in[i] & 3); q[4 * i + 1] = (uint8_t)((in[i] >> 2) & 3);
            q[4 * i + 2] = (uint8_t)((in[i] >> 4) & 3); q[4 * i + 3] = (uint8_t)(in[i] >> 6);
        }
    }
    for (int64_t k = full * per; k < n; k++)
        q[k] = (uint8_t)((in[full] >> (bits * (k - full * per))) & mask);
}

/* Exact delta of integers of es bytes: zigzag(new - old), modular, so small moves of a float's
   bits in either direction give leading zero bytes (XOR turns a carry into a run of ones). */
#define ZZ(U, S, W)                                                                          \
    static void zz_enc_##W(const uint8_t *x, const uint8_t *p, uint8_t *o, int64_t n) {     \
        for (int64_t i = 0; i < n; i++) {                                                   \
            U a, b; memcpy(&a, p + i * sizeof(U), sizeof(U));                               \
            memcpy(&b, x + i * sizeof(U), sizeof(U));                                       \
            U d = (U)(b - a);                                                               \
            U z = (U)((U)(d << 1) ^ (U)((S)d >> (W - 1)));                                  \
            memcpy(o + i * sizeof(U), &z, sizeof(U));                                       \
        }                                                                                   \
    }                                                                                       \
    static void zz_dec_##W(uint8_t *o, const uint8_t *in, int64_t n) {                      \
        for (int64_t i = 0; i < n; i++) {                                                   \
            U a, z; memcpy(&a, o + i * sizeof(U), sizeof(U));                               \
            memcpy(&z, in + i * sizeof(U), sizeof(U));                                      \
            U d = (U)((U)(z >> 1) ^ (U)(0 - (U)(z & 1)));                                   \
            a = (U)(a + d);                                                                 \
            memcpy(o + i * sizeof(U), &a, sizeof(U));                                       \
        }                                                                                   \
    }
ZZ(uint8_t, int8_t, 8)
ZZ(uint16_t, int16_t, 16)
ZZ(uint32_t, int32_t, 32)
ZZ(uint64_t, int64_t, 64)

static void zz_enc(const uint8_t *x, const uint8_t *p, uint8_t *o, int64_t n, int64_t es) {
    switch (es) {
    case 1: zz_enc_8(x, p, o, n); break;
    case 2: zz_enc_16(x, p, o, n); break;
    case 4: zz_enc_32(x, p, o, n); break;
    default: zz_enc_64(x, p, o, n); break;
    }
}

static void zz_dec(uint8_t *o, const uint8_t *in, int64_t n, int64_t es) {
    switch (es) {
    case 1: zz_dec_8(o, in, n); break;
    case 2: zz_dec_16(o, in, n); break;
    case 4: zz_dec_32(o, in, n); break;
    default: zz_dec_64(o, in, n); break;
    }
}

/* Exact delta: zigzag differences of the changed blocks, back to back; prev takes x. */
int d_encode(const uint8_t *x, uint8_t *prev, int64_t es, int64_t offset, int64_t nrows,
             int64_t row_stride, int64_t nblocks, int64_t blen, uint8_t *changed,
             uint8_t *xor_out, int64_t *pos) {
    int64_t p = pos[0], nbytes = blen * es;
    for (int64_t row = 0; row < nrows; row++) {
        for (int64_t j = 0; j < nblocks; j++) {
            int64_t off = (offset + row * row_stride + j * blen) * es;
            const uint8_t *xp = x + off; uint8_t *pp = prev + off;
            if (memcmp(xp, pp, (size_t)nbytes) == 0) { changed[row * nblocks + j] = 0; continue; }
            changed[row * nblocks + j] = 1;
            uint8_t *o = xor_out + p;
            zz_enc(xp, pp, o, blen, es);
            memcpy(pp, xp, (size_t)nbytes);
            p += nbytes;
        }
    }
    pos[0] = p;
    return 0;
}

/* Adds the stored differences to the changed blocks of out (a copy of the base). */
int d_decode(uint8_t *out, int64_t es, int64_t offset, int64_t nrows, int64_t row_stride,
             int64_t nblocks, int64_t blen, const uint8_t *changed, const uint8_t *xor_in,
             int64_t *pos, int64_t limit) {
    int64_t p = pos[0], nbytes = blen * es;
    for (int64_t row = 0; row < nrows; row++) {
        for (int64_t j = 0; j < nblocks; j++) {
            if (!changed[row * nblocks + j]) continue;
            if (p + nbytes > limit) return -2;
            uint8_t *o = out + (offset + row * row_stride + j * blen) * es;
            const uint8_t *xp = xor_in + p;
            zz_dec(o, xp, blen, es);
            p += nbytes;
        }
    }
    pos[0] = p;
    return 0;
}

/* Byte shuffle (blosc): byte k of every element together. Tiles keep both sides cached. */
void shuffle(const uint8_t *in, uint8_t *out, int64_t n, int64_t es) {
    if (es == 4) {
        uint8_t *o0 = out, *o1 = out + n, *o2 = out + 2 * n, *o3 = out + 3 * n;
        for (int64_t i = 0; i < n; i++) {
            uint32_t v; memcpy(&v, in + 4 * i, 4);
            o0[i] = (uint8_t)v; o1[i] = (uint8_t)(v >> 8);
            o2[i] = (uint8_t)(v >> 16); o3[i] = (uint8_t)(v >> 24);
        }
        return;
    }
    for (int64_t i0 = 0; i0 < n; i0 += 4096) {
        int64_t i1 = i0 + 4096 < n ? i0 + 4096 : n;
        for (int64_t k = 0; k < es; k++) {
            uint8_t *o = out + k * n;
            for (int64_t i = i0; i < i1; i++) o[i] = in[i * es + k];
        }
    }
}

/* Element i of 4-byte (2-byte) items from byte i of each plane: the scalar form, for the
   ends that the vector loop leaves and for CPUs without SSE2. */
static inline void join4(const uint8_t *const *p, uint8_t *out, int64_t i) {
    uint32_t v = (uint32_t)p[0][i] | ((uint32_t)p[1][i] << 8) | ((uint32_t)p[2][i] << 16)
                 | ((uint32_t)p[3][i] << 24);
    memcpy(out + 4 * i, &v, 4);
}
static inline void join2(const uint8_t *const *p, uint8_t *out, int64_t i) {
    uint16_t v = (uint16_t)(p[0][i] | (p[1][i] << 8));
    memcpy(out + 2 * i, &v, 2);
}

/* With stream set, outputs this large are written with non-temporal stores: a restore's
   chunk going into a live tensor is not read back soon, so skipping the cache's
   read-for-ownership nearly halves the time (benchmarks/restore_phases.py: 26 vs 46 ms for
   288 MiB of fp32 on one core). Into
   fresh memory they are slower (each page fault has just brought the page into cache). */
#define STREAM_BYTES (1 << 20)

#if defined(__SSE2__)
static void join4_sse2(const uint8_t *const *p, uint8_t *out, int64_t n, int stream) {
    stream = stream && 4 * n >= STREAM_BYTES;
    int64_t k = 0;
    if (stream)
        while (k < n && ((uintptr_t)(out + 4 * k) & 15)) join4(p, out, k++);
    for (; k + 16 <= n; k += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(p[0] + k));
        __m128i b = _mm_loadu_si128((const __m128i *)(p[1] + k));
        __m128i c = _mm_loadu_si128((const __m128i *)(p[2] + k));
        __m128i d = _mm_loadu_si128((const __m128i *)(p[3] + k));
        __m128i ab0 = _mm_unpacklo_epi8(a, b), ab1 = _mm_unpackhi_epi8(a, b);
        __m128i cd0 = _mm_unpacklo_epi8(c, d), cd1 = _mm_unpackhi_epi8(c, d);
        __m128i r[4] = {_mm_unpacklo_epi16(ab0, cd0), _mm_unpackhi_epi16(ab0, cd0),
                        _mm_unpacklo_epi16(ab1, cd1), _mm_unpackhi_epi16(ab1, cd1)};
        __m128i *o = (__m128i *)(out + 4 * k);
        for (int j = 0; j < 4; j++) {
            if (stream) _mm_stream_si128(o + j, r[j]);
            else _mm_storeu_si128(o + j, r[j]);
        }
    }
    if (stream) _mm_sfence();
    for (; k < n; k++) join4(p, out, k);
}

static void join2_sse2(const uint8_t *const *p, uint8_t *out, int64_t n, int stream) {
    stream = stream && 2 * n >= STREAM_BYTES;
    int64_t k = 0;
    if (stream)
        while (k < n && ((uintptr_t)(out + 2 * k) & 15)) join2(p, out, k++);
    for (; k + 16 <= n; k += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(p[0] + k));
        __m128i b = _mm_loadu_si128((const __m128i *)(p[1] + k));
        __m128i r[2] = {_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b)};
        __m128i *o = (__m128i *)(out + 2 * k);
        for (int j = 0; j < 2; j++) {
            if (stream) _mm_stream_si128(o + j, r[j]);
            else _mm_storeu_si128(o + j, r[j]);
        }
    }
    if (stream) _mm_sfence();
    for (; k < n; k++) join2(p, out, k);
}
#endif

/* Un-shuffle from es planes of n bytes each that may lie anywhere (raw planes in a mapped
   file, a decompressed one in its own buffer), so no plane is first copied next to the others. */
void unshuffle_planes(const uint8_t *const *planes, uint8_t *out, int64_t n, int64_t es,
                      int stream) {
    if (es == 4) {
#if defined(__SSE2__)
        join4_sse2(planes, out, n, stream);
#else
        (void)stream;
        for (int64_t i = 0; i < n; i++) join4(planes, out, i);
#endif
        return;
    }
    if (es == 2) {
#if defined(__SSE2__)
        join2_sse2(planes, out, n, stream);
#else
        (void)stream;
        for (int64_t i = 0; i < n; i++) join2(planes, out, i);
#endif
        return;
    }
    for (int64_t i0 = 0; i0 < n; i0 += 4096) {
        int64_t i1 = i0 + 4096 < n ? i0 + 4096 : n;
        for (int64_t k = 0; k < es; k++) {
            const uint8_t *p = planes[k];
            for (int64_t i = i0; i < i1; i++) out[i * es + k] = p[i];
        }
    }
}

/* A byte plane of few distinct values (a float's exponent byte) as 4-bit codes, two per
   byte (low nibble first): code[v] is v's code, 15 marks an escape, whose position and value
   are listed apart. Returns the number of escapes, or -1 once there are more than max_esc
   (the plane is then not worth coding this way). */
int64_t nib4_pack(const uint8_t *plane, int64_t n, const uint8_t *code, uint8_t *packed,
                  uint32_t *esc_pos, uint8_t *esc_val, int64_t max_esc) {
    int64_t e = 0;
    for (int64_t i = 0; i < n; i += 2) {
        uint8_t lo = code[plane[i]], hi = i + 1 < n ? code[plane[i + 1]] : 0;
        if (lo == 15) {
            if (e >= max_esc) return -1;
            esc_pos[e] = (uint32_t)i; esc_val[e++] = plane[i];
        }
        if (hi == 15 && i + 1 < n) {
            if (e >= max_esc) return -1;
            esc_pos[e] = (uint32_t)(i + 1); esc_val[e++] = plane[i + 1];
        }
        packed[i >> 1] = (uint8_t)(lo | (hi << 4));
    }
    return e;
}

/* The inverse: value[c] for each code (value[15] is written where an escape goes; the
   caller puts the escaped values back). One 256-entry table of byte pairs. */
void nib4_unpack(const uint8_t *packed, int64_t n, const uint8_t *value, uint8_t *plane) {
    uint16_t pair[256];
    for (int b = 0; b < 256; b++) pair[b] = (uint16_t)(value[b & 15] | (value[b >> 4] << 8));
    int64_t half = n >> 1;
    for (int64_t j = 0; j < half; j++) memcpy(plane + 2 * j, &pair[packed[j]], 2);
    if (n & 1) plane[n - 1] = value[packed[half] & 15];
}

void unshuffle(const uint8_t *in, uint8_t *out, int64_t n, int64_t es) {
    const uint8_t *planes[16];  /* torch's widest element (complex128) is 16 bytes */
    if (es <= 16) {
        for (int64_t k = 0; k < es; k++) planes[k] = in + k * n;
        unshuffle_planes(planes, out, n, es, 0);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t k = 0; k < es; k++) out[i * es + k] = in[k * n + i];
}

/* One instantiation of quant_dtype.h per float type (a template, done by the preprocessor). */
#define CF_CAT_(a, b) a##b
#define CF_CAT(a, b) CF_CAT_(a, b)
#define NAME(f) CF_CAT(f, SUFFIX)

#define SUFFIX _f32
#define T uint32_t
#define EXPMASK 0x7f800000u
#define SIGN 0x80000000u
#define MAXBITS 0x7F7FFFFFu
#define TOF f32_f32
#define FROMF f32_bits
#include "quant_dtype.h"
#undef SUFFIX
#undef T
#undef EXPMASK
#undef SIGN
#undef MAXBITS
#undef TOF
#undef FROMF

#define SUFFIX _bf16
#define T uint16_t
#define EXPMASK 0x7F80u
#define SIGN 0x8000u
#define MAXBITS 0x7F7Fu
#define TOF bf16_f32
#define FROMF f32_bf16
#include "quant_dtype.h"
#undef SUFFIX
#undef T
#undef EXPMASK
#undef SIGN
#undef MAXBITS
#undef TOF
#undef FROMF

/* IEEE half through the compiler's _Float16 (round to nearest even, like c10::Half). Only
   built where the compiler has the type; without it float16 chunks use the torch path. */
#ifdef __FLT16_MAX__
static inline float f16_f32(uint16_t h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
static inline uint16_t f32_f16(float f) {
    _Float16 v = (_Float16)f; uint16_t h; memcpy(&h, &v, 2); return h;
}
#define SUFFIX _f16
#define T uint16_t
#define EXPMASK 0x7C00u
#define SIGN 0x8000u
#define MAXBITS 0x7BFFu
#define TOF f16_f32
#define FROMF f32_f16
#include "quant_dtype.h"
#endif
