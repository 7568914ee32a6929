/*
 * canonlm native CPU kernel for the Canon op: residual causal depthwise 1-D convolution.
 *
 * Math (paper eq. 4.1), per batch row b, time t, channel c:
 *     z[t,c] = bias[c] + sum_{i=0}^{K-1} w[i,c] * x[t-K+1+i, c]       (x[t<0] = initial state, or 0)
 *     y[t,c] = (residual ? x[t,c] : 0) + (act ? silu(z) : z)
 * Backward, with g[t,c] = dy[t,c] * (act ? silu'(z[t,c]) : 1):
 *     dx[t,c]  = (residual ? dy[t,c] : 0) + sum_i w[i,c] * g[t+K-1-i, c]  (g[t>=T] = 0)
 *     dw[i,c]  = sum_{b,t} g[t,c] * x[t-K+1+i, c],   dbias[c] = sum_{b,t} g[t,c]
 *     dinit[j,c] (time j-(K-1) < 0) = sum_i w[i,c] * g[j-(K-1)+K-1-i, c]  over g indices >= 0.
 *
 * Layout: x, y, dy, dx are channel-last (B, T, C), contiguous, float32 or bfloat16 (is_bf16=1; raw uint16 bits,
 * converted with bit shifts, accumulation always in float32, round-to-nearest-even on store). The weight is passed
 * transposed as wT (K, C) float32, the bias as (C,) float32 or NULL, the initial state as (B, K-1, C) float32 or NULL
 * (row j holds the input at time j-(K-1)). dw (K, C), dbias (C,) and dinit (B, K-1, C) are float32 outputs.
 *
 * Each byte of x / dy is read from memory once: work is split into units (batch row, time block, channel tile).
 * For K <= CANON_KVEC (impl 0) a unit walks time per 16-channel vector with the last K inputs / K g rows, weights
 * and dw sums held in registers (GCC/Clang vector extensions; K specialised at compile time). Otherwise (impl 1 or
 * larger K) rows stream through a K-row ring buffer. OpenMP threads take units; each thread keeps its own
 * dw/dbias partial sums, reduced at the end. Compiled on first use by canonlm.ops.canon._native
 * (cc -O3 -march=native -fopenmp -shared -fPIC); no torch headers.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define CANON_ABI 4
#define CANON_KMAX 64
#define CANON_MIN_PARALLEL 32768

typedef int64_t i64;

int canon_abi(void) { return CANON_ABI; }
int canon_kmax(void) { return CANON_KMAX; }
int canon_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static inline float bf2f(uint16_t v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

static inline uint16_t f2bf(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    uint32_t u = c.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                             /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* exp(v) for float without a libm call (so loops over it vectorise): 2^k * p(r), k = round(v / ln2) by the
 * 1.5 * 2^23 trick, r = v - k ln2 (Cody-Waite split) in [-ln2/2, ln2/2], degree-6 Taylor polynomial (relative
 * error ~2e-7). Input clamped to [-87, 88] so 2^k stays a normal float. */
#define EXP_LO (-87.0f)
#define EXP_HI 88.0f
#define EXP_MAGIC 12582912.0f /* 1.5 * 2^23 */
static inline float fast_expf(float v) {
    v = v < EXP_LO ? EXP_LO : v;
    v = v > EXP_HI ? EXP_HI : v;
    const float kf = (v * 1.44269504088896341f + EXP_MAGIC) - EXP_MAGIC;
    float r = v - kf * 0.693145751953125f;
    r = r - kf * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } s;
    s.u = (uint32_t)((int32_t)kf + 127) << 23;
    return p * s.f;
}

static inline float sigmoidf_(float z) { return 1.0f / (1.0f + fast_expf(-z)); }

typedef struct {
    const void *x;      /* (B, T, C) */
    const void *dy;     /* (B, T, C) (bwd) */
    void *out;          /* y (fwd) or dx (bwd), (B, T, C) */
    const float *wT;    /* (K, C) */
    const float *bias;  /* (C,) or NULL */
    const float *init;  /* (B, K-1, C) or NULL */
    float *dinit;       /* (B, K-1, C) or NULL (bwd) */
    i64 B, T, C, K;
    int bf16, residual, act;
} canon_args;

/* Pointer to the float32 row of x at time j (>= -(K-1)), channels [c0, c0+n). bf16 rows must have been loaded. */
static inline const float *x_row(const canon_args *a, i64 b, i64 j, i64 c0, const float *ring, i64 n,
                                 const float *zeros) {
    if (j < 0) {
        if (a->init == NULL) return zeros;
        return a->init + (b * (a->K - 1) + (j + a->K - 1)) * a->C + c0;
    }
    if (!a->bf16) return (const float *)a->x + (b * a->T + j) * a->C + c0;
    return ring + (j % a->K) * n;
}

/* bf16 only: convert row j of x (j >= 0) into its ring slot. */
static inline void x_load(const canon_args *a, i64 b, i64 j, i64 c0, float *ring, i64 n) {
    if (!a->bf16 || j < 0) return;
    const uint16_t *src = (const uint16_t *)a->x + (b * a->T + j) * a->C + c0;
    float *restrict dst = ring + (j % a->K) * n;
    for (i64 c = 0; c < n; c++) dst[c] = bf2f(src[c]);
}

/* acc[c] = bias + sum_i w[i] * rows[i]  over n channels. */
static inline void conv_row(const canon_args *a, i64 c0, i64 n, const float *const *rows, const float *zeros,
                            float *restrict acc) {
    const i64 K = a->K, C = a->C;
    if (a->bias) memcpy(acc, a->bias + c0, (size_t)n * sizeof(float));
    else memset(acc, 0, (size_t)n * sizeof(float));
    i64 i = 0;
    for (; i + 1 < K; i += 2) { /* two taps per pass: fewer passes over acc */
        const float *restrict w0 = a->wT + i * C + c0, *restrict w1 = a->wT + (i + 1) * C + c0;
        const float *restrict r0 = rows[i], *restrict r1 = rows[i + 1];
        if (r0 == zeros && r1 == zeros) continue;
        for (i64 c = 0; c < n; c++) acc[c] += w0[c] * r0[c] + w1[c] * r1[c];
    }
    if (i < K) {
        const float *restrict w0 = a->wT + i * C + c0;
        const float *restrict r0 = rows[i];
        if (r0 != zeros)
            for (i64 c = 0; c < n; c++) acc[c] += w0[c] * r0[c];
    }
}

static void fwd_unit(const canon_args *a, i64 b, i64 t0, i64 t1, i64 c0, i64 n, float *ring, float *acc,
                     const float *zeros) {
    const i64 K = a->K, C = a->C, T = a->T;
    const float *rows[CANON_KMAX];
    for (i64 j = (t0 - K + 1 > 0 ? t0 - K + 1 : 0); j < t0; j++) x_load(a, b, j, c0, ring, n);
    for (i64 t = t0; t < t1; t++) {
        x_load(a, b, t, c0, ring, n);
        for (i64 i = 0; i < K; i++) rows[i] = x_row(a, b, t - K + 1 + i, c0, ring, n, zeros);
        conv_row(a, c0, n, rows, zeros, acc);
        if (a->act)
            for (i64 c = 0; c < n; c++) acc[c] = acc[c] * sigmoidf_(acc[c]);
        const float *restrict xr = rows[K - 1];
        const i64 off = (b * T + t) * C + c0;
        if (a->bf16) {
            uint16_t *restrict y = (uint16_t *)a->out + off;
            if (a->residual) for (i64 c = 0; c < n; c++) y[c] = f2bf(acc[c] + xr[c]);
            else for (i64 c = 0; c < n; c++) y[c] = f2bf(acc[c]);
        } else {
            float *restrict y = (float *)a->out + off;
            if (a->residual) for (i64 c = 0; c < n; c++) y[c] = acc[c] + xr[c];
            else memcpy(y, acc, (size_t)n * sizeof(float));
        }
    }
}

/* One backward unit. xring, gring: K*n; zbuf: n; dwu: K*n (+ n for dbias), zeroed by the caller. */
static void bwd_unit(const canon_args *a, i64 b, i64 t0, i64 t1, i64 c0, i64 n, float *xring, float *gring,
                     float *zbuf, float *dwu, float *dbu, const float *zeros) {
    const i64 K = a->K, C = a->C, T = a->T;
    const float *rows[CANON_KMAX];
    const float *gp[CANON_KMAX]; /* gp[j % K] = g row j, for the last K computed j */
    const i64 emit_start = (t0 == 0 && a->dinit) ? -(K - 1) : t0;
    for (i64 j = (t0 - K + 1 > 0 ? t0 - K + 1 : 0); j < t0; j++) x_load(a, b, j, c0, xring, n);
    for (i64 tp = t0; tp < t1 + K - 1; tp++) {
        const i64 slot = tp % K;
        if (tp < T) {
            const i64 off = (b * T + tp) * C + c0;
            x_load(a, b, tp, c0, xring, n);
            for (i64 i = 0; i < K; i++) rows[i] = x_row(a, b, tp - K + 1 + i, c0, xring, n, zeros);
            float *restrict g = gring + slot * n;
            const float *gt;
            if (a->act) {
                conv_row(a, c0, n, rows, zeros, zbuf);
                if (a->bf16) {
                    const uint16_t *restrict dy = (const uint16_t *)a->dy + off;
                    for (i64 c = 0; c < n; c++) {
                        float z = zbuf[c], s = sigmoidf_(z);
                        g[c] = bf2f(dy[c]) * s * (1.0f + z * (1.0f - s));
                    }
                } else {
                    const float *restrict dy = (const float *)a->dy + off;
                    for (i64 c = 0; c < n; c++) {
                        float z = zbuf[c], s = sigmoidf_(z);
                        g[c] = dy[c] * s * (1.0f + z * (1.0f - s));
                    }
                }
                gt = g;
            } else if (a->bf16) {
                const uint16_t *restrict dy = (const uint16_t *)a->dy + off;
                for (i64 c = 0; c < n; c++) g[c] = bf2f(dy[c]);
                gt = g;
            } else {
                gt = (const float *)a->dy + off;
            }
            gp[slot] = gt;
            if (tp < t1) { /* this unit owns g row tp: accumulate dw, dbias */
                i64 i = 0;
                for (; i + 1 < K; i += 2) {
                    const float *restrict r0 = rows[i], *restrict r1 = rows[i + 1];
                    if (r0 == zeros && r1 == zeros) continue;
                    float *restrict d0 = dwu + i * n, *restrict d1 = dwu + (i + 1) * n;
                    const float *restrict gg = gt;
                    for (i64 c = 0; c < n; c++) { d0[c] += gg[c] * r0[c]; d1[c] += gg[c] * r1[c]; }
                }
                if (i < K && rows[i] != zeros) {
                    const float *restrict r0 = rows[i], *restrict gg = gt;
                    float *restrict d0 = dwu + i * n;
                    for (i64 c = 0; c < n; c++) d0[c] += gg[c] * r0[c];
                }
                if (dbu) {
                    const float *restrict gg = gt;
                    for (i64 c = 0; c < n; c++) dbu[c] += gg[c];
                }
            }
        } else {
            gp[slot] = zeros;
        }
        const i64 t = tp - K + 1; /* emit dx (or dinit) row t: needs g rows t .. tp */
        if (t < emit_start) continue;
        float *restrict acc = zbuf;
        if (t >= 0 && a->residual) {
            const i64 off = (b * T + t) * C + c0;
            if (a->bf16) {
                const uint16_t *restrict dy = (const uint16_t *)a->dy + off;
                for (i64 c = 0; c < n; c++) acc[c] = bf2f(dy[c]);
            } else {
                memcpy(acc, (const float *)a->dy + off, (size_t)n * sizeof(float));
            }
        } else {
            memset(acc, 0, (size_t)n * sizeof(float));
        }
        /* tap i multiplies g[t + K-1-i] */
        const float *gr[CANON_KMAX];
        for (i64 i = 0; i < K; i++) {
            i64 j = t + K - 1 - i;
            gr[i] = j < 0 ? zeros : gp[j % K];
        }
        i64 i = 0;
        for (; i + 1 < K; i += 2) {
            if (gr[i] == zeros && gr[i + 1] == zeros) continue;
            const float *restrict w0 = a->wT + i * C + c0, *restrict w1 = a->wT + (i + 1) * C + c0;
            const float *restrict g0 = gr[i], *restrict g1 = gr[i + 1];
            for (i64 c = 0; c < n; c++) acc[c] += w0[c] * g0[c] + w1[c] * g1[c];
        }
        if (i < K && gr[i] != zeros) {
            const float *restrict w0 = a->wT + i * C + c0, *restrict g0 = gr[i];
            for (i64 c = 0; c < n; c++) acc[c] += w0[c] * g0[c];
        }
        if (t < 0) {
            memcpy(a->dinit + (b * (K - 1) + (t + K - 1)) * C + c0, acc, (size_t)n * sizeof(float));
        } else if (a->bf16) {
            uint16_t *restrict dx = (uint16_t *)a->out + (b * T + t) * C + c0;
            for (i64 c = 0; c < n; c++) dx[c] = f2bf(acc[c]);
        } else {
            memcpy((float *)a->out + (b * T + t) * C + c0, acc, (size_t)n * sizeof(float));
        }
    }
}

/* ------------------------------------------------------------------------------------------------------------
 * Register-window path (K <= CANON_KVEC): for each 16-channel vector, walk time keeping the last K inputs, the last
 * K g rows, the weights and the dw/dbias sums in registers. Memory traffic is exactly: read x (and dy), write y
 * (or dx); nothing else leaves the registers. K is a compile-time constant in each specialisation.
 * ------------------------------------------------------------------------------------------------------------ */
#define CANON_KVEC 4
#define VW 16
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE vf vload_f32(const float *p, i64 n) {
    vf v = {0};
    memcpy(&v, p, (size_t)(n == VW ? VW : n) * sizeof(float));
    return v;
}

ALWAYS_INLINE vf vload_bf16(const uint16_t *p, i64 n) {
    vh h = {0};
    memcpy(&h, p, (size_t)(n == VW ? VW : n) * sizeof(uint16_t));
    vu u = __builtin_convertvector(h, vu) << 16;
    return (vf)u;
}

ALWAYS_INLINE vf vload(const canon_args *a, const void *base, i64 off, i64 n) {
    return a->bf16 ? vload_bf16((const uint16_t *)base + off, n) : vload_f32((const float *)base + off, n);
}

ALWAYS_INLINE void vstore(const canon_args *a, void *base, i64 off, vf v, i64 n) {
    if (a->bf16) {
        vu u = (vu)v;
        vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u); /* all-ones lanes where NaN */
        vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        r = (r & ~nan) | (((u >> 16) | 0x40u) & nan);
        vh h = __builtin_convertvector(r, vh);
        memcpy((uint16_t *)base + off, &h, (size_t)(n == VW ? VW : n) * sizeof(uint16_t));
    } else {
        memcpy((float *)base + off, &v, (size_t)(n == VW ? VW : n) * sizeof(float));
    }
}

typedef int32_t vi __attribute__((vector_size(64)));

ALWAYS_INLINE vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); } /* m ? a : b */

/* vector twin of fast_expf (same operations, lane by lane) */
ALWAYS_INLINE vf vexp(vf v) {
    const vf lo = (vf){0} + EXP_LO, hi = (vf){0} + EXP_HI;
    v = vsel(v < lo, lo, v);
    v = vsel(v > hi, hi, v);
    const vf kf = (v * 1.44269504088896341f + EXP_MAGIC) - EXP_MAGIC;
    vf r = v - kf * 0.693145751953125f;
    r = r - kf * 1.428606765330187e-06f;
    vf p = (vf){0} + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vu e = (vu)(__builtin_convertvector(kf, vi) + 127) << 23;
    return p * (vf)e;
}

ALWAYS_INLINE vf vsigmoid(vf z) { return 1.0f / (1.0f + vexp(-z)); }

ALWAYS_INLINE vf vsilu(vf z) { return z * vsigmoid(z); }

/* g = dy * silu'(z) = dy * s * (1 + z (1 - s)), s = sigmoid(z) */
ALWAYS_INLINE vf vsilu_grad(vf z, vf dy) {
    const vf s = vsigmoid(z);
    return dy * s * (1.0f + z * (1.0f - s));
}

/* history input at time j < 0 for channels [c, c+n) */
ALWAYS_INLINE vf vhist(const canon_args *a, i64 b, i64 j, i64 c, i64 n) {
    if (a->init == NULL) return (vf){0};
    return vload_f32(a->init + (b * (a->K - 1) + (j + a->K - 1)) * a->C + c, n);
}

/* Time is processed in sub-blocks of SUBBLOCK rows (all 16-channel vectors of a sub-block, then the next one), so
 * the working set of a sub-block stays in L2. While a sub-block is processed, the next one is prefetched
 * sequentially, one cache line per time step and tensor. */
static i64 g_subblock = 32;
void canon_set_subblock(i64 r) { g_subblock = r > 0 ? r : 32; }

typedef struct {
    const char *r0, *r1; /* regions read next (x, dy) */
    char *w0;            /* region written next (y or dx) */
    i64 bytes, line;
} pf_t;

ALWAYS_INLINE void pf_step(pf_t *p) {
    const i64 o = p->line * 64;
    if (o < p->bytes) {
        if (p->r0) __builtin_prefetch(p->r0 + o, 0, 3);
        if (p->r1) __builtin_prefetch(p->r1 + o, 0, 3);
        if (p->w0) __builtin_prefetch(p->w0 + o, 1, 3);
    }
    p->line++;
}

ALWAYS_INLINE void fwd_vec(const canon_args *a, i64 b, i64 t0, i64 t1, i64 c, i64 n, pf_t *pf, const int KK) {
    const i64 C = a->C, T = a->T;
    vf w[CANON_KVEC], xw[CANON_KVEC];
    for (int i = 0; i < KK; i++) w[i] = vload_f32(a->wT + i * C + c, n);
    const vf bias = a->bias ? vload_f32(a->bias + c, n) : (vf){0};
    for (int i = 0; i < KK - 1; i++) {
        const i64 j = t0 - KK + 1 + i;
        xw[i] = j < 0 ? vhist(a, b, j, c, n) : vload(a, a->x, (b * T + j) * C + c, n);
    }
    for (i64 t = t0; t < t1; t++) {
        const i64 off = (b * T + t) * C + c;
        pf_step(pf);
        xw[KK - 1] = vload(a, a->x, off, n);
        vf acc = bias;
        for (int i = 0; i < KK; i++) acc += w[i] * xw[i];
        if (a->act) acc = vsilu(acc);
        if (a->residual) acc += xw[KK - 1];
        vstore(a, a->out, off, acc, n);
        for (int i = 0; i < KK - 1; i++) xw[i] = xw[i + 1];
    }
}

/* dw (KK*VW floats at dwv) and db (VW floats) are accumulated (+=). */
ALWAYS_INLINE void bwd_vec(const canon_args *a, i64 b, i64 t0, i64 t1, i64 c, i64 n, float *dwv, float *dbv,
                           pf_t *pf, const int KK) {
    const i64 C = a->C, T = a->T;
    vf w[CANON_KVEC], xw[CANON_KVEC], gw[CANON_KVEC], dw[CANON_KVEC];
    for (int i = 0; i < KK; i++) {
        w[i] = vload_f32(a->wT + i * C + c, n);
        dw[i] = (vf){0};
        gw[i] = (vf){0};
        xw[i] = (vf){0};
    }
    vf db = {0};
    const vf bias = a->bias ? vload_f32(a->bias + c, n) : (vf){0};
    for (int i = 0; i < KK - 1; i++) {
        const i64 j = t0 - KK + 1 + i;
        xw[i] = j < 0 ? vhist(a, b, j, c, n) : vload(a, a->x, (b * T + j) * C + c, n);
    }
    const i64 emit_start = (t0 == 0 && a->dinit) ? -(KK - 1) : t0;
    for (i64 tp = t0; tp < t1 + KK - 1; tp++) {
        vf g = {0};
        pf_step(pf);
        if (tp < T) {
            const i64 off = (b * T + tp) * C + c;
            xw[KK - 1] = vload(a, a->x, off, n);
            const vf dy = vload(a, a->dy, off, n);
            if (a->act) {
                vf z = bias;
                for (int i = 0; i < KK; i++) z += w[i] * xw[i];
                g = vsilu_grad(z, dy);
            } else {
                g = dy;
            }
            if (tp < t1) {
                for (int i = 0; i < KK; i++) dw[i] += g * xw[i];
                db += g;
            }
        }
        gw[KK - 1] = g;
        const i64 t = tp - KK + 1;
        if (t >= emit_start) {
            vf acc = {0};
            for (int i = 0; i < KK; i++) acc += w[i] * gw[KK - 1 - i];
            if (t < 0) {
                memcpy(a->dinit + (b * (KK - 1) + (t + KK - 1)) * C + c, &acc,
                       (size_t)(n == VW ? VW : n) * sizeof(float));
            } else {
                const i64 off = (b * T + t) * C + c;
                if (a->residual) acc += a->act ? vload(a, a->dy, off, n) : gw[0]; /* no act: g_t == dy_t */
                vstore(a, a->out, off, acc, n);
            }
        }
        for (int i = 0; i < KK - 1; i++) {
            xw[i] = xw[i + 1];
            gw[i] = gw[i + 1];
        }
    }
    for (int i = 0; i < KK; i++) {
        float tmp[VW];
        memcpy(tmp, &dw[i], sizeof tmp);
        for (i64 l = 0; l < n; l++) dwv[i * VW + l] += tmp[l];
    }
    float tmp[VW];
    memcpy(tmp, &db, sizeof tmp);
    for (i64 l = 0; l < n; l++) dbv[l] += tmp[l];
}

#define KSWITCH(CALL)                                                                                          \
    switch (a->K) {                                                                                            \
    case 1: CALL(1); break;                                                                                    \
    case 2: CALL(2); break;                                                                                    \
    case 3: CALL(3); break;                                                                                    \
    default: CALL(4); break;                                                                                   \
    }

static pf_t next_region(const canon_args *a, i64 b, i64 e, i64 t1, int is_bwd) {
    const i64 es = a->bf16 ? 2 : 4, R = g_subblock;
    const i64 e2 = e + R < t1 ? e + R : t1;
    pf_t p = {NULL, NULL, NULL, 0, 0};
    if (e >= e2) return p;
    const i64 off = (b * a->T + e) * a->C * es;
    p.r0 = (const char *)a->x + off;
    p.r1 = is_bwd ? (const char *)a->dy + off : NULL;
    p.w0 = (char *)a->out + off;
    p.bytes = (e2 - e) * a->C * es;
    return p;
}

/* Full 16-channel vectors of [c0, c0+n) on the register-window kernel; the remaining n % 16 channels go to the
 * row kernel (fwd_unit / bwd_unit), whose scratch buffers the caller passes. */
static void fwd_unit_vec(const canon_args *a, i64 b, i64 t0, i64 t1, i64 c0, i64 n, float *ring, float *acc,
                         const float *zeros) {
    const i64 nv = n / VW * VW;
    for (i64 s = t0; s < t1 && nv > 0; s += g_subblock) {
        const i64 e = s + g_subblock < t1 ? s + g_subblock : t1;
        pf_t pf = next_region(a, b, e, t1, 0);
        for (i64 c = c0; c < c0 + nv; c += VW) {
#define FWD_CALL(KK) fwd_vec(a, b, s, e, c, VW, &pf, KK)
            KSWITCH(FWD_CALL)
#undef FWD_CALL
        }
    }
    if (nv < n) fwd_unit(a, b, t0, t1, c0 + nv, n - nv, ring, acc, zeros);
}

/* dw_t (K, C) and db_t (C) accumulate (+=); dwu, dbu, xring, gring, zbuf, zeros: row-kernel scratch. */
static void bwd_unit_vec(const canon_args *a, i64 b, i64 t0, i64 t1, i64 c0, i64 n, float *dw_t, float *db_t,
                         float *xring, float *gring, float *zbuf, float *dwu, float *dbu, const float *zeros) {
    const i64 nv = n / VW * VW;
    for (i64 s = t0; s < t1 && nv > 0; s += g_subblock) {
        const i64 e = s + g_subblock < t1 ? s + g_subblock : t1;
        pf_t pf = next_region(a, b, e, t1, 1);
        for (i64 c = c0; c < c0 + nv; c += VW) {
            float dwv[CANON_KVEC * VW] = {0}, dbv[VW] = {0};
#define BWD_CALL(KK) bwd_vec(a, b, s, e, c, VW, dwv, dbv, &pf, KK)
            KSWITCH(BWD_CALL)
#undef BWD_CALL
            for (i64 i = 0; i < a->K; i++)
                for (i64 l = 0; l < VW; l++) dw_t[i * a->C + c + l] += dwv[i * VW + l];
            for (i64 l = 0; l < VW; l++) db_t[c + l] += dbv[l];
        }
    }
    if (nv < n) {
        const i64 m = n - nv;
        memset(dwu, 0, (size_t)(a->K * m) * sizeof(float));
        memset(dbu, 0, (size_t)m * sizeof(float));
        bwd_unit(a, b, t0, t1, c0 + nv, m, xring, gring, zbuf, dwu, dbu, zeros);
        for (i64 i = 0; i < a->K; i++)
            for (i64 l = 0; l < m; l++) dw_t[i * a->C + c0 + nv + l] += dwu[i * m + l];
        for (i64 l = 0; l < m; l++) db_t[c0 + nv + l] += dbu[l];
    }
}

/* Threads and work split shared by canon_fwd and canon_bwd: units (b, time block, channel tile), at least ~4 per
   thread when T allows (blocks >= 64 rows). Tiny inputs run on one thread (a parallel region costs more than it
   saves). Returns the thread count; writes the split and the number of units. */
static int plan(const canon_args *a, int nthreads, i64 ctile, i64 *n_tb, i64 *tb_len, i64 *n_ct, i64 *ct_len,
                i64 *units) {
    int nth = nthreads > 0 ? nthreads : 1;
    if (a->B * a->T * a->C < CANON_MIN_PARALLEL) nth = 1;
    i64 ct = ctile > 0 && ctile < a->C ? ctile : a->C;
    *ct_len = ct;
    *n_ct = (a->C + ct - 1) / ct;
    i64 ntb = 1;
    while (a->B * ntb * (*n_ct) < 4 * (i64)nth && a->T / (ntb * 2) >= 64) ntb *= 2;
    *n_tb = ntb;
    *tb_len = (a->T + ntb - 1) / ntb;
    *units = a->B * ntb * (*n_ct);
    return nth;
}

/* Forward. Returns 0 on success, 1 on allocation failure, 2 on bad sizes. */
int canon_fwd(const void *x, void *y, const float *wT, const float *bias, const float *init, i64 B, i64 T, i64 C,
              i64 K, int bf16, int residual, int act, int nthreads, i64 ctile, int impl) {
    const int vec = impl == 0 && K <= CANON_KVEC;
    if (K < 1 || K > CANON_KMAX || B < 0 || T < 0 || C < 0) return 2;
    if (B == 0 || T == 0 || C == 0) return 0;
    canon_args a = {x, NULL, y, wT, bias, init, NULL, B, T, C, K, bf16, residual, act};
    i64 n_tb, tb_len, n_ct, ct_len, units;
    const int nth = plan(&a, nthreads, ctile, &n_tb, &tb_len, &n_ct, &ct_len, &units);
    int err = 0;
#pragma omp parallel num_threads(nth) if (nth > 1 && units > 1)
    {
        float *buf = (float *)calloc((size_t)((K + 2) * ct_len), sizeof(float));
        if (!buf) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp for schedule(static)
        for (i64 u = 0; u < units; u++) {
            if (!buf) continue;
            const i64 b = u / (n_tb * n_ct), r = u % (n_tb * n_ct), tb = r / n_ct, ci = r % n_ct;
            const i64 t0 = tb * tb_len, t1 = t0 + tb_len < T ? t0 + tb_len : T;
            const i64 c0 = ci * ct_len, n = c0 + ct_len < C ? ct_len : C - c0;
            if (t0 >= t1) continue;
            /* buf: zeros | acc | ring */
            if (vec) fwd_unit_vec(&a, b, t0, t1, c0, n, buf + 2 * ct_len, buf + ct_len, buf);
            else fwd_unit(&a, b, t0, t1, c0, n, buf + 2 * ct_len, buf + ct_len, buf);
        }
        free(buf);
    }
    return err;
}

/* Backward. dw (K, C) and dbias (C, or NULL) are overwritten; dinit (B, K-1, C) is written when non-NULL. */
int canon_bwd(const void *x, const void *dy, void *dx, const float *wT, const float *bias, const float *init,
              float *dw, float *dbias, float *dinit, i64 B, i64 T, i64 C, i64 K, int bf16, int residual, int act,
              int nthreads, i64 ctile, int impl) {
    const int vec = impl == 0 && K <= CANON_KVEC;
    if (K < 1 || K > CANON_KMAX || B < 0 || T < 0 || C < 0) return 2;
    memset(dw, 0, (size_t)(K * C) * sizeof(float));
    if (dbias) memset(dbias, 0, (size_t)C * sizeof(float));
    if (dinit && K > 1) memset(dinit, 0, (size_t)(B * (K - 1) * C) * sizeof(float));
    if (B == 0 || T == 0 || C == 0) return 0;
    canon_args a = {x, dy, dx, wT, bias, init, (K > 1 ? dinit : NULL), B, T, C, K, bf16, residual, act};
    i64 n_tb, tb_len, n_ct, ct_len, units;
    const int nth = plan(&a, nthreads, ctile, &n_tb, &tb_len, &n_ct, &ct_len, &units);
    int err = 0;
#pragma omp parallel num_threads(nth) if (nth > 1 && units > 1)
    {
        /* per thread: zeros (n) | zbuf (n) | xring (K n) | gring (K n) | dwu (K n) | dbu (n) | dw_t (K C) | db_t (C) */
        const size_t scratch = (size_t)((3 * K + 3) * ct_len), acc_sz = (size_t)((K + 1) * C);
        float *buf = (float *)calloc(scratch + acc_sz, sizeof(float));
        if (!buf) {
#pragma omp atomic write
            err = 1;
        }
        float *zeros = buf, *zbuf = buf + ct_len, *xring = buf + 2 * ct_len, *gring = xring + K * ct_len;
        float *dwu = gring + K * ct_len, *dbu = dwu + K * ct_len, *dw_t = buf + scratch, *db_t = dw_t + K * C;
#pragma omp for schedule(static)
        for (i64 u = 0; u < units; u++) {
            if (!buf) continue;
            const i64 b = u / (n_tb * n_ct), r = u % (n_tb * n_ct), tb = r / n_ct, ci = r % n_ct;
            const i64 t0 = tb * tb_len, t1 = t0 + tb_len < T ? t0 + tb_len : T;
            const i64 c0 = ci * ct_len, n = c0 + ct_len < C ? ct_len : C - c0;
            if (t0 >= t1) continue;
            if (vec) {
                bwd_unit_vec(&a, b, t0, t1, c0, n, dw_t, db_t, xring, gring, zbuf, dwu, dbu, zeros);
                continue;
            }
            memset(dwu, 0, (size_t)(K * n) * sizeof(float));
            memset(dbu, 0, (size_t)n * sizeof(float));
            bwd_unit(&a, b, t0, t1, c0, n, xring, gring, zbuf, dwu, dbu, zeros);
            for (i64 i = 0; i < K; i++) {
                float *restrict d = dw_t + i * C + c0;
                const float *restrict s = dwu + i * n;
                for (i64 c = 0; c < n; c++) d[c] += s[c];
            }
            for (i64 c = 0; c < n; c++) db_t[c0 + c] += dbu[c];
        }
        if (buf) {
#pragma omp critical(canon_bwd_reduce)
            {
                for (i64 k = 0; k < K * C; k++) dw[k] += dw_t[k];
                if (dbias)
                    for (i64 c = 0; c < C; c++) dbias[c] += db_t[c];
            }
        }
        free(buf);
    }
    return err;
}
