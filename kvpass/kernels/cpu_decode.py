"""Decode attention on the CPU, fused with the gather: a small C kernel built once per machine.

One query token per head attends to the rows of a cache listed per KV head, read in place (no gathered
copy), or to every row. The G query heads of a KV head (HF ``repeat_kv`` order: head ``h`` reads KV
head ``h // G``) share each K and V row, so a row is read once per KV head. Per (batch row, KV head)
the kernel makes two passes: the G scores of every listed row and their maximum, then
``exp(s - max)`` and the weighted sum of the V rows, fp32 throughout. It is the CPU counterpart of
:mod:`kvpass.kernels.sparse_attention`'s Triton kernel (same semantics: a position outside ``[0, S)``,
such as the padding ``-1``, is skipped; duplicates count twice; a row with nothing valid returns 0).

Why C and not torch on CPU: SDPA's flash kernel and matmul-softmax-matmul run one decode query group
at 7-11 GB/s on this project's machines (compute-bound: the products have 1-3 rows), while the
memory reads 25-29 GB/s; a gather first copies every selected row. docs/design.md, "Fused decode
attention on CPU", has the figures.

The library is built once per machine by :mod:`kvpass.kernels.native` (the C compiler Inductor uses,
``-O3 -march=native``); :func:`available` is False where no compiler works or ``KVPASS_NATIVE=0``, and
the callers then keep their torch code.

Files in this module: the C source, :func:`cpu_decode_attention` (checks, launch) and
:func:`cpu_decode_attention_ref` (plain torch, the reference the tests compare with).
"""

from __future__ import annotations

import ctypes
import math
import struct

import torch

from . import native
from .native import VECTOR

__all__ = ["available", "cpu_decode_attention", "cpu_decode_attention_ref"]

# The softmax pieces of the vector path (also in kvpass.kernels.tailorkv's quantised attention); needs
# VECTOR, <float.h> and <string.h>.
SOFTMAX_C = r"""
/* m ? a : b, lane by lane (C has no vector ?:) */
static inline vf sel(vi m, vf a, vf b) {
    vi ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    ia = (m & ia) | (~m & ib);
    memcpy(&a, &ia, sizeof a);
    return a;
}

/* exp(x) for x <= 0, VW at a time (Cephes' expf: x = g + n ln2, |g| <= ln2 / 2, a polynomial in g,
   times 2^n; relative error about 1e-7); below -87 the result is 0. */
static inline vf expv(vf x) {
    const vf lo = (vf){0} - 87.f;
    vi under = x < lo;
    x = sel(under, lo, x);
    vf t = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf);  /* truncates toward 0 */
    n = sel(n > t, n - 1.f, n);  /* floor(x log2 e + 1/2): the nearest integer */
    vf g = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf z = g * g;
    vf y = 1.9875691500e-4f * g + 1.3981999507e-3f;
    y = y * g + 8.3334519073e-3f;
    y = y * g + 4.1665795894e-2f;
    y = y * g + 1.6666665459e-1f;
    y = y * g + 5.0000001201e-1f;
    y = y * z + g + 1.f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf p2;
    memcpy(&p2, &e, sizeof p2);
    y = y * p2;
    return sel(under, (vf){0}, y);
}

/* x[n] = exp(x[n] - m) for n < N, in place; returns their sum (VW partial sums) */
static float exp_sum(float *restrict x, int64_t n, float m) {
    vf acc = (vf){0};
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        vf e = expv(loadv(x + i) - m);
        storev(x + i, e);
        acc += e;
    }
    if (i < n) {
        float tail[VW];
        for (int64_t j = 0; j < VW; j++) tail[j] = i + j < n ? x[i + j] - m : -FLT_MAX;
        vf e = expv(loadv(tail));
        storev(tail, e);
        memcpy(x + i, tail, sizeof(float) * (n - i));
        acc += e;
    }
    return hsumv(acc);
}

/* the largest of n values */
static float max_of(const float *restrict x, int64_t n) {
    float m = -FLT_MAX;
    int64_t i = 0;
    if (n >= VW) {
        vf mv = loadv(x);
        for (i = VW; i + VW <= n; i += VW) {
            vf y = loadv(x + i);
            mv = sel(y > mv, y, mv);
        }
        float t[VW];
        storev(t, mv);
        for (int64_t j = 0; j < VW; j++) m = t[j] > m ? t[j] : m;
    }
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}
"""

_SOURCE = r"""
#include <float.h>
#include <pthread.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
""" + VECTOR + SOFTMAX_C + r"""
/* rows prefetched ahead: listed rows are scattered (clusters, pages), so the hardware cannot guess them.
   Pass 1 asks for each K row twice: into L2 FAR rows ahead, into L1 AHEAD rows ahead. The L2 requests keep
   more misses in flight than L1's fill buffers hold. Measured (30 sites read cold, 8k cache, 1024 listed
   rows of D 64, 1 thread, batch 1 / 8, ms): pages of 16 rows 4.6 -> 3.7 / 34.0 -> 26.0, single rows 6.5 ->
   4.9 / 49.8 -> 32.7, two ranges 3.0 -> 3.2 / 20.6 -> 21.6; 32 to 128 rows ahead read alike. A far
   prefetch only where a run starts or crosses a 4 KB page gained a third as much. */
#define AHEAD 16
#define FAR 48
/* rows of work (listed rows x pairs) below which a call runs on one thread */
#ifdef _OPENMP
#define MIN_ROWS_PER_THREAD 1024  /* torch's warm pool: a parallel region costs microseconds */
#else
#define MIN_ROWS_PER_THREAD 8192  /* a thread started per call costs tens of microseconds */
#endif
/* a pair's rows are split into parts of at least PART_ROWS rows, MAX_PARTS at most, when it has 2 * PART_ROWS:
   the units of work outnumber the threads (SmolLM2 at batch 1 has 3 pairs for 2 threads) */
#define PART_ROWS 512
#define MAX_PARTS 8
#define MAX_THREADS 64
#define MAX_D 256  /* the vector path's head dim; a larger one takes the scalar loops */
static inline void prefetch_row(const float *r, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)r + o, 0, 0);
}
static inline void prefetch_row_l2(const float *r, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)r + o, 0, 2);
}

/* Vector chunks of a V row accumulated at once in pass 2: G * CB accumulators stay in registers (at most
   12 of the machine's 16 or 32), CB a power of two that divides DV */
#define CB_OF(G, DV) ((G) <= 1 && (DV) % 8 == 0 ? 8 : (G) <= 3 && (DV) % 4 == 0 ? 4 : (G) <= 6 && (DV) % 2 == 0 ? 2 : 1)

/* Pass 1 of the vector path: sc[g * N + n] = q_g . k_row + bias (-FLT_MAX for a skipped row, rows[n] < 0),
   the G queries pre-scaled in qs (g-major). Four rows at a time: their sums of one query, each folded to 4
   lanes (fold4), finish in one vector in hsumv's order (a horizontal sum per row and query cost more than
   the products). Inlined with constant G and D (pick_passes below), the loops unroll and the sums stay in
   registers. */
static inline __attribute__((always_inline)) void scores_body(
        const float *restrict qs, const float *restrict k, int64_t ks_s, const float *restrict v, int64_t vs_s,
        const int64_t *restrict rows, int64_t N, const float *restrict bias, int64_t bs_s, float *restrict sc,
        int scattered, int v_ahead, const int64_t G, const int64_t D) {
    const int64_t DV = D / VW;
    for (int64_t n0 = 0; n0 < N; n0 += 4) {
        v4 part[16][4];
        float b4[4];
        for (int64_t r = 0; r < 4; r++) {
            const int64_t n = n0 + r, pos = n < N ? rows[n] : -1, at = pos < 0 ? 0 : pos;  /* row 0 stands in */
            if (scattered && n + FAR < N && rows[n + FAR] >= 0) prefetch_row_l2(k + rows[n + FAR] * ks_s, 4 * D);
            if (scattered && n + AHEAD < N && rows[n + AHEAD] >= 0) {
                prefetch_row(k + rows[n + AHEAD] * ks_s, 4 * D);
                if (v_ahead) prefetch_row_l2(v + rows[n + AHEAD] * vs_s, 4 * D);
            }
            const float *kr = k + at * ks_s;
            vf acc[16];
            vf x = loadv(kr);
            for (int64_t g = 0; g < G; g++) acc[g] = loadv(qs + g * D) * x;
            for (int64_t c = 1; c < DV; c++) {
                x = loadv(kr + VW * c);
                for (int64_t g = 0; g < G; g++) acc[g] += loadv(qs + g * D + VW * c) * x;
            }
            for (int64_t g = 0; g < G; g++) part[g][r] = fold4(acc[g]);
            b4[r] = pos < 0 ? -FLT_MAX : bias ? bias[pos * bs_s] : 0.f;
        }
        v4 bv;
        memcpy(&bv, b4, sizeof bv);
        const int64_t live = N - n0 < 4 ? N - n0 : 4;
        for (int64_t g = 0; g < G; g++) {
            v4 t0 = __builtin_shufflevector(part[g][0], part[g][1], 0, 4, 1, 5)
                  + __builtin_shufflevector(part[g][0], part[g][1], 2, 6, 3, 7);
            v4 t1 = __builtin_shufflevector(part[g][2], part[g][3], 0, 4, 1, 5)
                  + __builtin_shufflevector(part[g][2], part[g][3], 2, 6, 3, 7);
            v4 s4 = __builtin_shufflevector(t0, t1, 0, 1, 4, 5) + __builtin_shufflevector(t0, t1, 2, 3, 6, 7) + bv;
            float o[4];
            memcpy(o, &s4, sizeof o);
            for (int64_t r = 0; r < live; r++) sc[g * N + n0 + r] = b4[r] == -FLT_MAX ? -FLT_MAX : o[r];
        }
    }
}

/* Pass 2 of the vector path: out_g = sum_n sc[g * N + n] v_row / l[g], CB chunks of the row at a time
   over all rows (each pass reads other cache lines of the rows) */
static inline __attribute__((always_inline)) void wsum_body(
        const float *restrict sc, const float *restrict v, int64_t vs_s, const int64_t *restrict rows, int64_t N,
        const float *restrict l, float *restrict out, int64_t os_h, int scattered, const int64_t G,
        const int64_t D) {
    const int64_t DV = D / VW, CB = CB_OF(G, DV);
    for (int64_t c0 = 0; c0 < DV; c0 += CB) {
        vf acc[16 * 8];
        for (int64_t i = 0; i < G * CB; i++) acc[i] = (vf){0};
        for (int64_t n = 0; n < N; n++) {
            int64_t pos = rows[n];
            if (pos < 0) continue;
            if (scattered && n + AHEAD < N && rows[n + AHEAD] >= 0)
                prefetch_row(v + rows[n + AHEAD] * vs_s + VW * c0, 4 * VW * CB);
            const float *vr = v + pos * vs_s + VW * c0;
            for (int64_t j = 0; j < CB; j++) {
                vf x = loadv(vr + VW * j);
                for (int64_t g = 0; g < G; g++) acc[g * CB + j] += sc[g * N + n] * x;
            }
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < CB; j++)
                storev(out + g * os_h + VW * (c0 + j), acc[g * CB + j] * (1.f / l[g]));
    }
}

#define SCORES_ARGS const float *restrict qs, const float *restrict k, int64_t ks_s, const float *restrict v, \
    int64_t vs_s, const int64_t *restrict rows, int64_t N, const float *restrict bias, int64_t bs_s, \
    float *restrict sc, int scattered, int v_ahead, int64_t G, int64_t D
#define WSUM_ARGS const float *restrict sc, const float *restrict v, int64_t vs_s, const int64_t *restrict rows, \
    int64_t N, const float *restrict l, float *restrict out, int64_t os_h, int scattered, int64_t G, int64_t D
typedef void (*scores_fn)(SCORES_ARGS);
typedef void (*wsum_fn)(WSUM_ARGS);
/* one copy of each pass per (G, D) the models use (the loops unrolled), and one for any other */
#define PASSES(GG, DD) \
    static void scores_##GG##_##DD(SCORES_ARGS) { \
        (void)G; (void)D; scores_body(qs, k, ks_s, v, vs_s, rows, N, bias, bs_s, sc, scattered, v_ahead, GG, DD); } \
    static void wsum_##GG##_##DD(WSUM_ARGS) { \
        (void)G; (void)D; wsum_body(sc, v, vs_s, rows, N, l, out, os_h, scattered, GG, DD); }
static void scores_any(SCORES_ARGS) { scores_body(qs, k, ks_s, v, vs_s, rows, N, bias, bs_s, sc, scattered, v_ahead, G, D); }
static void wsum_any(WSUM_ARGS) { wsum_body(sc, v, vs_s, rows, N, l, out, os_h, scattered, G, D); }
#define PASSES_D(DD) PASSES(1, DD) PASSES(2, DD) PASSES(3, DD) PASSES(4, DD) PASSES(5, DD) PASSES(6, DD) \
    PASSES(7, DD) PASSES(8, DD)
PASSES_D(64)
PASSES_D(128)
#define PICK(DD) \
    switch (G) { \
    case 1: *s = scores_1_##DD; *w = wsum_1_##DD; return; case 2: *s = scores_2_##DD; *w = wsum_2_##DD; return; \
    case 3: *s = scores_3_##DD; *w = wsum_3_##DD; return; case 4: *s = scores_4_##DD; *w = wsum_4_##DD; return; \
    case 5: *s = scores_5_##DD; *w = wsum_5_##DD; return; case 6: *s = scores_6_##DD; *w = wsum_6_##DD; return; \
    case 7: *s = scores_7_##DD; *w = wsum_7_##DD; return; case 8: *s = scores_8_##DD; *w = wsum_8_##DD; return; \
    }
static void pick_passes(int64_t G, int64_t D, scores_fn *s, wsum_fn *w) {
    if (D == 64) PICK(64)
    if (D == 128) PICK(128)
    *s = scores_any;
    *w = wsum_any;
}

/* One (batch row, KV head) pair: G queries over N listed rows of k, v, plus bias[pos] when bias is not
   NULL (a bias of -inf skips the row, as a position outside [0, S) is skipped). sc is G*N floats of
   scratch, rows N int64. ml (may be NULL): the softmax's max and sum of each query, ml[g] and ml[16 + g]
   (-FLT_MAX and 0 with no valid row), for a pair split over the sequence (merge_parts). */
static void pair(const float *restrict q, int64_t qs_h, const float *restrict k, int64_t ks_s,
                 const float *restrict v, int64_t vs_s, const int64_t *restrict idx, int64_t is_n,
                 const float *restrict bias, int64_t bs_s, float *restrict out, int64_t os_h,
                 float *restrict sc, int64_t *restrict rows, int64_t G, int64_t S, int64_t N, int64_t D,
                 float scale, float *restrict ml) {
    float m[16], l[16];
    const int vec = (D % VW == 0) && D <= MAX_D;
    float qs[16 * MAX_D];  /* the group's queries, pre-scaled, g-major (vector path) */
    for (int64_t g = 0; g < G; g++) {
        m[g] = -FLT_MAX;
        l[g] = 0.f;
        if (vec) for (int64_t d = 0; d < D; d++) qs[g * D + d] = q[g * qs_h + d] * scale;
    }
    /* the rows to read, -1 for a skipped one; read once here, so that pass 2 need not look again */
    int64_t valid = 0;
    for (int64_t n = 0; n < N; n++) {
        int64_t pos = idx ? idx[n * is_n] : n;
        if (pos < 0 || pos >= S || (bias && bias[pos * bs_s] < -FLT_MAX)) pos = -1;
        rows[n] = pos;
        valid += pos >= 0;
    }
    for (int64_t g = 0; g < G; g++) memset(out + g * os_h, 0, sizeof(float) * D);
    if (ml) for (int64_t g = 0; g < G; g++) { ml[g] = -FLT_MAX; ml[16 + g] = 0.f; }
    if (!valid) return;
    /* listed rows (scattered: the hardware cannot guess them) are prefetched; those whose V rows fit in
       half of a 1 MB L2 also have the V row fetched into L2 in pass 1, so that pass 2 reads it from there */
    const int scattered = idx != 0, v_ahead = idx && N * D * 4 <= (1 << 19);
    if (vec) {
        scores_fn sfn;
        wsum_fn wfn;
        pick_passes(G, D, &sfn, &wfn);
        sfn(qs, k, ks_s, v, vs_s, rows, N, bias, bs_s, sc, scattered, v_ahead, G, D);
        for (int64_t g = 0; g < G; g++) {
            m[g] = max_of(sc + g * N, N);
            l[g] = exp_sum(sc + g * N, N, m[g]);  /* skipped: 0 */
        }
        wfn(sc, v, vs_s, rows, N, l, out, os_h, scattered, G, D);
        if (ml) for (int64_t g = 0; g < G; g++) { ml[g] = m[g]; ml[16 + g] = l[g]; }
        return;
    }
    /* scalar loops: a head dim that is not a multiple of VW lanes (or over MAX_D) */
    for (int64_t n = 0; n < N; n++) {
        int64_t pos = rows[n];
        if (pos < 0) { for (int64_t g = 0; g < G; g++) sc[g * N + n] = -FLT_MAX; continue; }
        const float *kr = k + pos * ks_s;
        const float b = bias ? bias[pos * bs_s] : 0.f;
        for (int64_t g = 0; g < G; g++) {
            double acc = 0.0;  /* one chain of D adds: in double, or large scores lose their last digits */
            for (int64_t d = 0; d < D; d++) acc += (double)q[g * qs_h + d] * kr[d];
            float s = (float)(acc * scale) + b;
            sc[g * N + n] = s;
            if (s > m[g]) m[g] = s;
        }
    }
    for (int64_t g = 0; g < G; g++) l[g] = exp_sum(sc + g * N, N, m[g]);
    for (int64_t n = 0; n < N; n++) {
        int64_t pos = rows[n];
        if (pos < 0) continue;
        const float *vr = v + pos * vs_s;
        for (int64_t g = 0; g < G; g++) {
            float p = sc[g * N + n], *o = out + g * os_h;
            for (int64_t d = 0; d < D; d++) o[d] += p * vr[d];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = 1.f / l[g], *o = out + g * os_h;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
    if (ml) for (int64_t g = 0; g < G; g++) { ml[g] = m[g]; ml[16 + g] = l[g]; }
}

typedef struct {
    const float *q, *k, *v, *bias;
    const int64_t *idx;
    float *out;
    int64_t qs_b, qs_h, ks_b, ks_h, ks_s, vs_b, vs_h, vs_s, is_b, is_h, is_n, bs_b, bs_h, bs_s, os_b, os_h;
    int64_t Hk, G, S, N, D, lo, hi;  /* units [lo, hi): the B * Hk (batch row, KV head) pairs, or parts */
    int64_t parts;  /* 1, or the parts each pair's rows are split into, each written to part */
    float *part;    /* parts: per unit G * D outputs, then the 32 floats of its ml (see pair) */
    float scale;
    int rc;
} job_t;

#define PART_FLOATS(G, D) ((G) * (D) + 32)

static void *run_job(void *arg) {
    job_t *j = (job_t *)arg;
    size_t n = (size_t)(j->N > 0 ? j->N : 1);
    float *sc = (float *)malloc(sizeof(float) * n * (size_t)j->G);
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * n);
    j->rc = (sc && rows) ? 0 : -1;
    for (int64_t u = j->lo; u < j->hi && !j->rc; u++) {
        int64_t p = u / j->parts, c = u % j->parts, b = p / j->Hk, h = p % j->Hk;
        /* part c of the pair: rows [n0, n1) of its list, or of the cache where there is no list */
        int64_t n0 = j->N * c / j->parts, n1 = j->N * (c + 1) / j->parts, sh = j->idx ? 0 : n0;
        float *po = j->parts > 1 ? j->part + u * PART_FLOATS(j->G, j->D) : 0;
        pair(j->q + b * j->qs_b + h * j->G * j->qs_h, j->qs_h, j->k + b * j->ks_b + h * j->ks_h + sh * j->ks_s,
             j->ks_s, j->v + b * j->vs_b + h * j->vs_h + sh * j->vs_s, j->vs_s,
             j->idx ? j->idx + b * j->is_b + h * j->is_h + n0 * j->is_n : 0, j->is_n,
             j->bias ? j->bias + b * j->bs_b + h * j->bs_h + sh * j->bs_s : 0, j->bs_s,
             po ? po : j->out + b * j->os_b + h * j->G * j->os_h, po ? j->D : j->os_h, sc, rows, j->G,
             j->S - sh, n1 - n0, j->D, j->scale, po ? po + j->G * j->D : 0);
    }
    free(sc);
    free(rows);
    return 0;
}

/* The parts of each pair (their softmax max m_c, sum l_c and normalised output o_c) into out:
   sum_c w_c o_c / sum_c w_c, w_c = l_c exp(m_c - max m); 0 where no part had a valid row */
static void merge_parts(const float *part, int64_t parts, float *out, int64_t os_b, int64_t os_h, int64_t pairs,
                        int64_t Hk, int64_t G, int64_t D) {
    const int64_t pf = PART_FLOATS(G, D);
    for (int64_t p = 0; p < pairs; p++) {
        float *o0 = out + (p / Hk) * os_b + (p % Hk) * G * os_h;
        for (int64_t g = 0; g < G; g++) {
            float M = -FLT_MAX, W = 0.f, w[MAX_PARTS], *o = o0 + g * os_h;
            for (int64_t c = 0; c < parts; c++) {
                const float *ml = part + (p * parts + c) * pf + G * D;
                if (ml[16 + g] > 0.f && ml[g] > M) M = ml[g];
            }
            for (int64_t c = 0; c < parts; c++) {
                const float *ml = part + (p * parts + c) * pf + G * D;
                w[c] = ml[16 + g] > 0.f ? ml[16 + g] * expf(ml[g] - M) : 0.f;
                W += w[c];
            }
            memset(o, 0, sizeof(float) * D);
            if (W <= 0.f) continue;
            for (int64_t c = 0; c < parts; c++) {
                if (w[c] <= 0.f) continue;
                const float *oc = part + (p * parts + c) * pf + g * D, f = w[c] / W;
                for (int64_t d = 0; d < D; d++) o[d] += f * oc[d];
            }
        }
    }
}

/* q (B, Hk*G, D) strides (qs_b, qs_h, 1); k, v (B, Hk, S, D) strides (s_b, s_h, s_s, 1);
   idx (B, Hk, N) strides (is_b, is_h, is_n) or NULL (N = S); bias (B, Hk, S) strides (bs_b, bs_h, bs_s)
   or NULL; out (B, Hk*G, D) strides (os_b, os_h, 1). The pairs are split over up to `threads` threads
   (the caller's and threads - 1 started here), a pair's rows in parts of PART_ROWS or more where it has
   many (merged by their softmax sums: merge_parts), so that the threads share the rows evenly where the
   pairs alone do not divide among them (batch 1 of SmolLM2: 3 KV heads, 2 threads). The parts depend on
   N only: a result is the same for every thread count and batch. Returns 0; -1 when
   scratch or a thread cannot be had; -2 for a group over 16. */
int kvpass_decode_attention(const float *q, int64_t qs_b, int64_t qs_h,
                            const float *k, int64_t ks_b, int64_t ks_h, int64_t ks_s,
                            const float *v, int64_t vs_b, int64_t vs_h, int64_t vs_s,
                            const int64_t *idx, int64_t is_b, int64_t is_h, int64_t is_n,
                            const float *bias, int64_t bs_b, int64_t bs_h, int64_t bs_s,
                            float *out, int64_t os_b, int64_t os_h,
                            int64_t B, int64_t Hk, int64_t G, int64_t S, int64_t N, int64_t D, float scale,
                            int64_t threads) {
    if (G > 16) return -2;
    int64_t pairs = B * Hk;
    int64_t t = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (pairs * N < MIN_ROWS_PER_THREAD * 2) t = 1;  /* starting a thread costs more than it saves */
    /* parts of a pair's rows by N alone, so that a result does not depend on the threads or the batch */
    const int64_t parts = N >= 2 * PART_ROWS ? (N / PART_ROWS < MAX_PARTS ? N / PART_ROWS : MAX_PARTS) : 1;
    const int64_t units = pairs * parts;
    if (t > units) t = units;
    float *part = parts > 1 ? (float *)malloc(sizeof(float) * (size_t)(pairs * parts * PART_FLOATS(G, D))) : 0;
    if (parts > 1 && !part) return -1;
    job_t jobs[MAX_THREADS];
    for (int64_t i = 0; i < t; i++) {
        job_t j = {q, k, v, bias, idx, out, qs_b, qs_h, ks_b, ks_h, ks_s, vs_b, vs_h, vs_s, is_b, is_h, is_n,
                   bs_b, bs_h, bs_s, os_b, os_h, Hk, G, S, N, D, units * i / t, units * (i + 1) / t,
                   parts, part, scale, 0};
        jobs[i] = j;
    }
#ifdef _OPENMP
    /* torch's own OpenMP pool (the same libgomp, kvpass.kernels.native): warm threads, and no second
       pool spinning against torch's on the same cores */
    #pragma omp parallel for num_threads(t) schedule(static, 1)
    for (int64_t i = 0; i < t; i++) run_job(&jobs[i]);
#else
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t i = 1; i < t; i++) started[i] = pthread_create(&tid[i], 0, run_job, &jobs[i]) == 0;
    for (int64_t i = 1; i < t; i++)
        if (!started[i]) run_job(&jobs[i]);  /* no thread to be had: do its share here */
    run_job(&jobs[0]);
    for (int64_t i = 1; i < t; i++)
        if (started[i]) pthread_join(tid[i], 0);
#endif
    int rc = 0;
    for (int64_t i = 0; i < t; i++)
        if (jobs[i].rc) rc = jobs[i].rc;
    if (part && !rc) merge_parts(part, parts, out, os_b, os_h, pairs, Hk, G, D);
    free(part);
    return rc;
}
"""

_MAX_GROUP = 16

# For a selection kernel that attends the list it has just written, in the same call from Python (a call
# costs tens of microseconds at 30 sites a step, run cold between the model's matmuls): its library
# includes LISTED_C and calls attend_listed with the LISTED_SLOTS int64 slots a ListedAttend filled,
# which hold the address of this library's kvpass_decode_attention and the cache, output and scale.
LISTED_SLOTS = 14
LISTED_C = r"""
typedef int (*kvpass_attend_fn)(const float *, int64_t, int64_t, const float *, int64_t, int64_t, int64_t,
                                const float *, int64_t, int64_t, int64_t, const int64_t *, int64_t, int64_t,
                                int64_t, const float *, int64_t, int64_t, int64_t, float *, int64_t, int64_t,
                                int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t);
/* kvpass_decode_attention of q (B, Hk * G, D) over the positions idx (B, Hk, N) (n-stride 1) of the first
   S rows of the cache packed in t: [attention's address, k, its 3 strides, v, its 3 strides, out, its 2
   strides, the scale's double bits, threads] */
static int attend_listed(const int64_t *t, const float *q, int64_t qs_b, int64_t qs_h, const int64_t *idx,
                         int64_t is_b, int64_t is_h, int64_t B, int64_t Hk, int64_t G, int64_t S, int64_t N,
                         int64_t D) {
    double scale;
    memcpy(&scale, t + 12, sizeof scale);
    return ((kvpass_attend_fn)(intptr_t)t[0])(
        q, qs_b, qs_h, (const float *)(intptr_t)t[1], t[2], t[3], t[4], (const float *)(intptr_t)t[5], t[6], t[7],
        t[8], idx, is_b, is_h, 1, NULL, 0, 0, 0, (float *)(intptr_t)t[9], t[10], t[11], B, Hk, G, S, N, D,
        (float)scale, t[13]);
}
"""


class ListedAttend:
    """Packs :func:`decode_step`'s operands into a selection kernel's ``LISTED_SLOTS`` slots for its
    ``attend_listed``; one per selection step object, so that the attention's address and the scale's bits
    are made once, not at every step."""

    def __init__(self) -> None:
        fn = _load()
        self.address = None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value
        self._scale: tuple[float, int] | None = None  # the last scale and its double's bits

    def pack(self, slots, at: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
             scale: float) -> torch.Tensor | None:
        """Fill ``slots[at : at + LISTED_SLOTS]`` (a ctypes int64 array) and return the ``(B, H_q, 1, D)``
        output ``attend_listed`` will write; None, writing nothing, where :func:`decode_step` would not
        serve ``q (B, H_q, 1, D)``, ``k, v (B, H_kv, S >= length, D)``."""
        if not (self.address is not None and q.dim() == 4 and q.shape[2] == 1 and _serves(q, k, v)
                and 0 <= length <= k.shape[2]):
            return None
        sc = self._scale
        if sc is None or sc[0] != scale:
            sc = self._scale = (scale, struct.unpack("<q", struct.pack("<d", float(scale)))[0])
        out = q.new_empty(q.shape)
        ks, vs, os_ = k.stride(), v.stride(), out.stride()
        slots[at : at + LISTED_SLOTS] = (self.address, k.data_ptr(), ks[0], ks[1], ks[2], v.data_ptr(), vs[0],
                                         vs[1], vs[2], out.data_ptr(), os_[0], os_[1], sc[1],
                                         torch.get_num_threads())
        return out


_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64,
             _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64]


def _load():
    """The kernel's ctypes function (:func:`kvpass.kernels.native.function`), or None."""
    return native.function("decode_attention", _SOURCE, "kvpass_decode_attention", _ARGTYPES)


def available() -> bool:
    """Whether the C kernel is built and loaded (a compiler was found, ``KVPASS_NATIVE`` is not 0)."""
    return _load() is not None


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`cpu_decode_attention` serves these operands (plain fp32 CPU tensors whose last dim
    is contiguous, a query group of at most 16, v's head dim equal to k's). A tensor subclass is never
    served: the kernel reads memory directly, past any ``__torch_function__`` (a kvpass cache stub must
    reach torch code, which refuses it loudly)."""
    return q.dim() == 3 and _serves(q, k, v)


def _serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """:func:`supports` but for q's dimensions: B and H_q are its first two, D its last. Runs at every site
    of every decode step, hence ``is_cpu`` and one read of each shape (a ``.device`` costs a microsecond)."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and q.is_cpu and k.is_cpu and v.is_cpu
            and q.dtype == torch.float32 and k.dtype == torch.float32 and v.dtype == torch.float32
            and k.dim() == 4 and v.dim() == 4 and q.stride(-1) == 1 and k.stride(3) == 1 and v.stride(3) == 1):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    h = ks[1]
    return (h > 0 and qs[1] % h == 0 and qs[1] // h <= _MAX_GROUP and vs[0] == ks[0] and vs[1] == h
            and vs[2] == ks[2] and vs[3] == ks[3] == qs[-1] and _load() is not None)


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, idx: torch.Tensor | None,
                scale: float, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """A runtime decode step's attention, ``(B, H_q, 1, D)``, or None where the kernel does not serve the
    operands (the caller takes its torch path). ``q (B, H_q, 1, D)`` as the attention op receives it;
    ``k, v (B, H_kv, S', D)`` with ``S' >= length``, of which positions ``[0, length)`` are attended (a
    store's buffers, read in place: no sliced view per step); ``idx (B, H_kv, N)`` int64 lists the
    positions (None: all); ``bias (B, H_kv, S'')`` fp32 with ``S'' >= length`` is added to the scores
    (CentroidKV's log degree, kept beside its buffers). :func:`cpu_decode_attention` without the views it
    would need (each costs microseconds, at 30 sites a step)."""
    if not (q.dim() == 4 and q.shape[2] == 1 and _serves(q, k, v) and 0 <= length <= k.shape[2]):
        return None
    if bias is not None:
        bs = bias.shape
        if not (type(bias) is torch.Tensor and bias.is_cpu and bias.dtype == torch.float32 and bias.dim() == 3
                and bs[0] == k.shape[0] and bs[1] == k.shape[1] and bs[2] >= length):
            return None
        bstr, bptr = bias.stride(), bias.data_ptr()
    else:
        bstr, bptr = (0, 0, 0), None
    qs = q.shape
    b, h_q, d = qs[0], qs[1], qs[3]
    h_kv = k.shape[1]
    out = q.new_empty(qs)
    if idx is not None:
        if not (idx.dtype == torch.int64 and idx.dim() == 3 and idx.shape[0] == b and idx.shape[1] == h_kv):
            return None
        n, istr, iptr = idx.shape[2], idx.stride(), idx.data_ptr()
    else:
        n, istr, iptr = length, (0, 0, 0), None
    if b * h_q == 0:
        return out
    return _launch(q, k, v, length, n, iptr, istr, bptr, bstr, out, scale, torch.get_num_threads())


def _launch(q, k, v, S, N, iptr, istr, bptr, bstr, out, scale, threads) -> torch.Tensor:
    """The C call on checked operands: q's and out's first two dims are (B, H_q), their last D."""
    ks, vs, qs, os_ = k.stride(), v.stride(), q.stride(), out.stride()
    rc = _load()(q.data_ptr(), qs[0], qs[1], k.data_ptr(), ks[0], ks[1], ks[2], v.data_ptr(), vs[0], vs[1], vs[2],
                 iptr, *istr, bptr, *bstr, out.data_ptr(), os_[0], os_[1],
                 q.shape[0], k.shape[1], q.shape[1] // k.shape[1], S, N, q.shape[-1], float(scale), threads)
    if rc != 0:
        raise MemoryError(f"kvpass: cpu_decode_attention could not allocate its scratch (rc={rc})")
    return out


def cpu_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor | None = None,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Decode attention of ``q (B, H_q, D)`` over ``k, v (B, H_kv, S, D)`` (any strides but a
    contiguous last dim), at the positions ``idx (B, H_kv, N)`` (int64; outside ``[0, S)`` skipped;
    duplicates count twice) or at every position (``idx`` None), with an additive fp32 ``bias
    (B, H_kv, S)`` on the scores (``-inf`` skips a position; CentroidKV's ``log degree``, padding).
    fp32 CPU only (:func:`supports`). The (batch row, KV head) pairs are split over ``threads``
    (default ``torch.get_num_threads()``) when there is enough work. Returns ``(B, H_q, D)``, into
    ``out`` when given (its last dim contiguous); a row with nothing valid is 0."""
    if not supports(q, k, v):  # supports() also asks for the built kernel
        raise ValueError(
            "kvpass: cpu_decode_attention needs fp32 CPU q (B, H_q, D), k, v (B, H_kv, S, D) with a "
            "contiguous last dim and the C kernel built (kvpass.kernels.cpu_decode.available()); got "
            f"q {tuple(q.shape)} {q.dtype} {q.device}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, H_q, D = q.shape
    _, H_kv, S, _ = k.shape
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if out is None:
        out = q.new_empty((B, H_q, D))
    elif tuple(out.shape) != (B, H_q, D) or out.dtype != torch.float32 or out.stride(2) != 1:
        raise ValueError(f"kvpass: cpu_decode_attention needs out fp32 ({B}, {H_q}, {D}) with a contiguous "
                         f"last dim, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if idx is not None:
        if idx.dtype != torch.int64 or idx.dim() != 3 or tuple(idx.shape[:2]) != (B, H_kv):
            raise ValueError(f"kvpass: cpu_decode_attention needs idx int64 (B={B}, H_kv={H_kv}, N), got "
                             f"{tuple(idx.shape)} {idx.dtype}")
        N, istr, iptr = idx.shape[2], idx.stride(), idx.data_ptr()
    else:
        N, istr, iptr = S, (0, 0, 0), None
    if bias is not None:
        if bias.dtype != torch.float32 or tuple(bias.shape) != (B, H_kv, S) or bias.device.type != "cpu":
            raise ValueError(f"kvpass: cpu_decode_attention needs bias fp32 CPU (B={B}, H_kv={H_kv}, S={S}), "
                             f"got {tuple(bias.shape)} {bias.dtype} {bias.device}")
        bstr, bptr = bias.stride(), bias.data_ptr()
    else:
        bstr, bptr = (0, 0, 0), None
    if B * H_q == 0:
        return out
    return _launch(q, k, v, S, N, iptr, istr, bptr, bstr, out, scale,
                   torch.get_num_threads() if threads is None else int(threads))


def cpu_decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor | None = None,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch :func:`cpu_decode_attention` in float64 (gather, masked softmax, weighted sum); shapes
    as there."""
    B, H_q, D = q.shape
    _, H_kv, S, _ = k.shape
    G = H_q // H_kv
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    qg = q.reshape(B, H_kv, G, D).double()
    if idx is None:
        idx = torch.arange(S).expand(B, H_kv, S)
    if idx.shape[2] == 0:
        return q.new_zeros((B, H_q, D))
    valid = (idx >= 0) & (idx < S)
    pos = torch.where(valid, idx, 0)
    ks = torch.gather(k.double(), 2, pos[..., None].expand(-1, -1, -1, D))
    vs = torch.gather(v.double(), 2, pos[..., None].expand(-1, -1, -1, D))
    s = (qg @ ks.transpose(-1, -2)) * scale  # (B, H_kv, G, N)
    if bias is not None:
        b = torch.gather(bias.double(), 2, pos)
        valid = valid & (b > float("-inf"))
        s = s + torch.where(valid, b, 0.0)[:, :, None, :]
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    p = (s - m).exp()
    den = p.sum(-1, keepdim=True)
    out = (p @ vs) / torch.where(den > 0, den, 1.0)
    return out.reshape(B, H_q, D).to(q.dtype)
