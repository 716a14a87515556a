/* The quantization kernel for one float storage type, included once per type by quant.c.

   Not a standalone header: the including file defines, before each inclusion,
     T        the storage type (uint32_t for float32, uint16_t for bfloat16/float16)
     NAME(f)  f with the type's suffix (q_encode -> q_encode_f32), the exported names
     EXPMASK  exponent bits, SIGN the sign bit, MAXBITS the largest finite value's bits
     TOF      bits -> float,  FROMF  float -> bits (rounding like torch's cast)
   The arithmetic mirrors checkflow/codec/_quant_eager.py operation for operation. */

/* One block of n elements: returns its kind; writes the new reconstruction nr, meta[2], and
   codes (qb: 8-bit, qw: 16-bit for LOG16). d: scratch of n floats. */
static int NAME(quant)(const T *x, const T *r, int64_t n, int levels, int log_space,
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

static void NAME(dequant_log)(const T *r, T *o, int64_t n, const int32_t *meta,
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

static void NAME(dequant_linear)(const T *r, T *o, int64_t n, const int32_t *meta,
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
int NAME(q_encode)(const T *xv, T *snap, T *recon, int64_t offset, int64_t nrows,
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
            int kind = NAME(quant)(xp, rp, blen, levels, log_space, max_step, nr,
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
int NAME(q_decode)(const T *src, T *out, int64_t offset, int64_t nrows,
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
                NAME(dequant_log)(bp, op, blen, meta + 2 * mp, qb, qw);
            } else {
                unpack(codes + cp, blen, bits, qb);
                if (kind == LOG) NAME(dequant_log)(bp, op, blen, meta + 2 * mp, qb, NULL);
                else NAME(dequant_linear)(bp, op, blen, meta + 2 * mp, qb);
            }
            mp++; cp += nbytes;
        }
    }
    counts[0] = kp; counts[1] = mp; counts[2] = cp; counts[3] = rp;
    free(qb); free(qw);
    return rc;
}
