"""C source of the fused quantization kernel (compiled by :mod:`checkflow.codec._native`).

Kept as a Python string so that it ships inside the wheel without package-data rules.
The arithmetic mirrors :mod:`checkflow.codec._quant_eager` operation for operation; it is
compiled with ``-ffp-contract=off`` and without fast-math so that every float operation is
one IEEE rounding, exactly like the separate torch ops, and the reconstruction it keeps is
bit-identical to what the torch path decodes (and the other way round).
"""

import re

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>

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

void unshuffle(const uint8_t *in, uint8_t *out, int64_t n, int64_t es) {
    if (es == 4) {
        const uint8_t *p0 = in, *p1 = in + n, *p2 = in + 2 * n, *p3 = in + 3 * n;
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16)
                         | ((uint32_t)p3[i] << 24);
            memcpy(out + 4 * i, &v, 4);
        }
        return;
    }
    for (int64_t i0 = 0; i0 < n; i0 += 4096) {
        int64_t i1 = i0 + 4096 < n ? i0 + 4096 : n;
        for (int64_t k = 0; k < es; k++) {
            const uint8_t *p = in + k * n;
            for (int64_t i = i0; i < i1; i++) out[i * es + k] = p[i];
        }
    }
}

"""

_TEMPLATE = r"""
/* One block of n elements: returns its kind; writes the new reconstruction nr, meta[2], and
   codes (qb: 8-bit, qw: 16-bit for LOG16). d: scratch of n floats. */
static int quant_NAME(const T *x, const T *r, int64_t n, int levels, int log_space,
                      int64_t max_step, T *nr, int32_t *meta, uint8_t *qb, uint16_t *qw,
                      float *d) {
    T orx = 0; int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        T a = x[i], b = r[i];
        orx |= (T)(a | b);
        finite &= ((a & EXPMASK) != EXPMASK) & ((b & EXPMASK) != EXPMASK);
    }
    if (!finite) return RAW;
    if (log_space && !(orx & SIGN)) {
        /* Bits of non-negative finite values fit int32, so d does; the rest is exact
           integer arithmetic carried in doubles (all values < 2^34), which vectorizes. */
        int32_t lo = INT32_MAX, hi = INT32_MIN;
        for (int64_t i = 0; i < n; i++) {
            int32_t di = (int32_t)x[i] - (int32_t)r[i];
            lo = di < lo ? di : lo; hi = di > hi ? di : hi;
        }
        int64_t span = (int64_t)hi - (int64_t)lo;
        int64_t step = (span + (levels - 1)) / levels;
        int wide = 0;
        if (max_step >= 0 && step > max_step) {
            /* Too coarse (e.g. an entry leaving zero): 16-bit codes, else exact. */
            step = (span + 65534) / 65535;
            if (step > max_step) return RAW;
            wide = 1;
        }
        double safe = step > 0 ? (double)step : 1.0, half = (double)(step > 0 ? step / 2 : 0);
        double dlo = (double)lo, dstep = (double)step;
        for (int64_t i = 0; i < n; i++) {
            double rb = (double)(int32_t)r[i];
            double q = (double)(int32_t)(((double)(int32_t)x[i] - rb - dlo + half) / safe);
            if (wide) qw[i] = (uint16_t)(int32_t)q; else qb[i] = (uint8_t)(int32_t)q;
            double v = rb + (dlo + q * dstep);
            v = v < 0.0 ? 0.0 : v;
            v = v > (double)MAXBITS ? (double)MAXBITS : v;
            nr[i] = (T)(int32_t)v;
        }
        meta[0] = lo; meta[1] = (int32_t)step;
        return wide ? LOG16 : LOG;
    }
    int32_t klo = INT32_MAX, khi = INT32_MIN;
    for (int64_t i = 0; i < n; i++) {
        float di = TOF(x[i]) - TOF(r[i]);
        d[i] = di;
        int32_t k = sortable(di);
        klo = k < klo ? k : klo; khi = k > khi ? k : khi;
    }
    float lo = unsortable(klo), hi = unsortable(khi);
    float scale = (hi - lo) / (float)levels;
    if (!isfinite(lo) || !isfinite(scale)) return RAW;
    float inv = 1.0f / (scale > 0.0f ? scale : 1.0f);
    if (!isfinite(inv)) return RAW;
    float fl = (float)levels;
    for (int64_t i = 0; i < n; i++) {
        float v = (d[i] - lo) * inv + 0.5f;   /* >= 0.5: lo is the minimum of d */
        v = v > fl ? fl : v;
        qb[i] = (uint8_t)(int32_t)v;
    }
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float t = (float)qb[i] * scale;
        t = lo + t;
        T v = FROMF(TOF(r[i]) + t);
        nr[i] = v;
        bad |= (v & EXPMASK) == EXPMASK;
    }
    if (bad) return RAW;
    memcpy(&meta[0], &lo, 4); memcpy(&meta[1], &scale, 4);
    return LINEAR;
}

static void dequant_log_NAME(const T *r, T *o, int64_t n, const int32_t *meta,
                             const uint8_t *qb, const uint16_t *qw) {
    double dlo = (double)meta[0], dstep = (double)meta[1];
    for (int64_t i = 0; i < n; i++) {
        double q = qw ? (double)qw[i] : (double)qb[i];
        double v = (double)(int32_t)r[i] + (dlo + q * dstep);
        v = v < 0.0 ? 0.0 : v;
        v = v > (double)MAXBITS ? (double)MAXBITS : v;
        o[i] = (T)(int32_t)v;
    }
}

static void dequant_linear_NAME(const T *r, T *o, int64_t n, const int32_t *meta,
                                const uint8_t *qb) {
    float lo, scale;
    memcpy(&lo, &meta[0], 4); memcpy(&scale, &meta[1], 4);
    for (int64_t i = 0; i < n; i++) {
        float t = (float)qb[i] * scale;
        t = lo + t;
        o[i] = FROMF(TOF(r[i]) + t);
    }
}

/* Encode one region of blocks; counts (in/out): [changed blocks, quantized blocks, code
   bytes]. codes must hold 2 * blen bytes per block when max_step >= 0 (LOG16). */
int q_encode_NAME(const T *xv, T *snap, T *recon, int64_t offset, int64_t nrows,
                  int64_t row_stride, int64_t nblocks, int64_t blen, int bits,
                  int log_space, int64_t max_step, uint8_t *changed, uint8_t *kinds,
                  int32_t *meta, uint8_t *codes, int64_t *counts) {
    int levels = (1 << bits) - 1;
    int64_t per_block = (blen * bits + 7) / 8;
    float *d = malloc(sizeof(float) * (size_t)blen);
    T *nr = malloc(sizeof(T) * (size_t)blen);
    uint8_t *qb = malloc((size_t)blen);
    uint16_t *qw = malloc(sizeof(uint16_t) * (size_t)blen);
    if (!d || !nr || !qb || !qw) { free(d); free(nr); free(qb); free(qw); return -1; }
    int64_t nch = counts[0], nq = counts[1], cb = counts[2];
    for (int64_t row = 0; row < nrows; row++) {
        for (int64_t j = 0; j < nblocks; j++) {
            int64_t b = row * nblocks + j;
            int64_t off = offset + row * row_stride + j * blen;
            const T *xp = xv + off; T *sp = snap + off; T *rp = recon + off;
            if (memcmp(xp, sp, sizeof(T) * (size_t)blen) == 0) { changed[b] = 0; continue; }
            changed[b] = 1;
            int kind = quant_NAME(xp, rp, blen, levels, log_space, max_step, nr,
                                  meta + 2 * nq, qb, qw, d);
            if (kind == RAW) {
                memcpy(rp, xp, sizeof(T) * (size_t)blen);
            } else {
                memcpy(rp, nr, sizeof(T) * (size_t)blen);
                if (kind == LOG16) {
                    memcpy(codes + cb, qw, 2 * (size_t)blen);  /* little-endian hosts */
                    cb += 2 * blen;
                } else {
                    pack(qb, blen, bits, codes + cb);
                    cb += per_block;
                }
                nq++;
            }
            memcpy(sp, xp, sizeof(T) * (size_t)blen);
            kinds[nch++] = (uint8_t)kind;
        }
    }
    counts[0] = nch; counts[1] = nq; counts[2] = cb;
    free(d); free(nr); free(qb); free(qw);
    return 0;
}

/* Write into out the base src with a delta applied, one region. counts (in/out): [kinds
   pos, meta pos, code byte pos, raw element pos]; limits: their sizes. -2: data too short. */
int q_decode_NAME(const T *src, T *out, int64_t offset, int64_t nrows,
                  int64_t row_stride, int64_t nblocks, int64_t blen, int bits,
                  const uint8_t *changed, const uint8_t *kinds, const int32_t *meta,
                  const uint8_t *codes, const T *raw, int64_t *counts,
                  const int64_t *limits) {
    int64_t per_block = (blen * bits + 7) / 8;
    uint8_t *qb = malloc((size_t)blen);
    uint16_t *qw = malloc(sizeof(uint16_t) * (size_t)blen);
    if (!qb || !qw) { free(qb); free(qw); return -1; }
    int rc = 0;
    int64_t kp = counts[0], mp = counts[1], cp = counts[2], rp = counts[3];
    for (int64_t row = 0; row < nrows && rc == 0; row++) {
        for (int64_t j = 0; j < nblocks; j++) {
            int64_t off = offset + row * row_stride + j * blen;
            T *op = out + off; const T *bp = src + off;
            if (!changed[row * nblocks + j]) {
                memcpy(op, bp, sizeof(T) * (size_t)blen); continue;
            }
            if (kp >= limits[0]) { rc = -2; break; }
            int kind = kinds[kp++];
            int64_t nbytes = kind == LOG16 ? 2 * blen : per_block;
            if (kind == RAW) {
                if (rp + blen > limits[3]) { rc = -2; break; }
                memcpy(op, raw + rp, sizeof(T) * (size_t)blen); rp += blen;
                continue;
            }
            if (kind < LINEAR || kind > LOG16) { rc = -3; break; }
            if (mp + 1 > limits[1] || cp + nbytes > limits[2]) { rc = -2; break; }
            if (kind == LOG16) {
                memcpy(qw, codes + cp, 2 * (size_t)blen);
                dequant_log_NAME(bp, op, blen, meta + 2 * mp, qb, qw);
            } else {
                unpack(codes + cp, blen, bits, qb);
                if (kind == LOG) dequant_log_NAME(bp, op, blen, meta + 2 * mp, qb, NULL);
                else dequant_linear_NAME(bp, op, blen, meta + 2 * mp, qb);
            }
            mp++; cp += nbytes;
        }
    }
    counts[0] = kp; counts[1] = mp; counts[2] = cp; counts[3] = rp;
    free(qb); free(qw);
    return rc;
}
"""

_TYPES = {
    # name: (storage type, exponent mask, sign bit, max finite bits, bits->float, float->bits)
    "f32": ("uint32_t", "0x7f800000u", "0x80000000u", "0x7F7FFFFFu", "f32_f32", "f32_bits"),
    "bf16": ("uint16_t", "0x7F80u", "0x8000u", "0x7F7Fu", "bf16_f32", "f32_bf16"),
    "f16": ("uint16_t", "0x7C00u", "0x8000u", "0x7BFFu", "f16_f32", "f32_f16"),
}

_F16 = r"""
/* IEEE half through the compiler's _Float16 (round to nearest even, like c10::Half). Only
   built where the compiler has the type; without it float16 chunks use the torch path. */
#ifdef __FLT16_MAX__
static inline float f16_f32(uint16_t h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
static inline uint16_t f32_f16(float f) {
    _Float16 v = (_Float16)f; uint16_t h; memcpy(&h, &v, 2); return h;
}
"""


def _instantiate(name: str) -> str:
    storage, expmask, sign, maxbits, tof, fromf = _TYPES[name]
    text = _TEMPLATE
    for token, value in (
        ("NAME", name),
        ("EXPMASK", expmask),
        ("SIGN", sign),
        ("MAXBITS", maxbits),
        ("TOF", tof),
        ("FROMF", fromf),
    ):
        text = text.replace(token, value)
    return re.sub(r"\bT\b", storage, text)


SOURCE = (
    SOURCE + _instantiate("f32") + _instantiate("bf16") + _F16 + _instantiate("f16") + "#endif\n"
)
