/* kvpass.h: what the CPU kernels (the .c files beside this one) share.

   Each .c file is compiled alone into its own library by kvpass.kernels.native (-O3 -march=native,
   IEEE arithmetic, -Wall -Wextra clean) and loaded with ctypes. Here: the fp32 vector helpers, the
   softmax pieces, the listed-rows attention a selection kernel runs after writing its list, and every
   argument struct an entry point takes. Each struct is mirrored field by field by a ctypes.Structure in
   the kernel's Python file (its C name in `c_name`); tests/test_native.py compares their layouts. Pointers
   are held as void pointers on the Python side. A step object (ClusterStep, QuestStep, CpuStep) fills its
   struct once and sets only the fields a decode step changes; other calls make one per call (one struct
   passes faster than its thirty-odd ctypes arguments, each converted on its own). */
#ifndef KVPASS_H
#define KVPASS_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- fp32 vectors of the machine's width (GCC/Clang vector extensions) for the kernels' sums: C does
   not reorder a float sum by itself, so a dot product vectorises only when written in lanes ---- */

/* VW float lanes, the machine's own vector width: a vector wider than the hardware's is emulated
   through the stack (a 16-lane vector on an AVX2 core ran the decode attention at 100 ns a row) */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef float v4 __attribute__((vector_size(16)));
static inline vf loadv(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline void storev(float *p, vf x) { memcpy(p, &x, sizeof x); }
/* the VW lanes of x summed down to 4 (lane i + lane i + 4 + ...), then to one */
static inline v4 fold4(vf x) {
#if VW == 16
    typedef float v8 __attribute__((vector_size(32)));
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    return __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif VW == 8
    return __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
#else
    return x;
#endif
}
static inline float hsumv(vf x) {
    v4 b = fold4(x);
    return (b[0] + b[2]) + (b[1] + b[3]);
}
/* sum of r[d] * m[d] over n values: VW lanes at a time (n % VW == 0), else one at a time (a scalar sum
   is one chain of n dependent adds: the compiler may not reorder float additions) */
static inline float dot(const float *r, const float *m, int64_t n) {
    if (n % VW == 0) {
        vf acc = loadv(r) * loadv(m);
        for (int64_t d = VW; d < n; d += VW) acc += loadv(r + d) * loadv(m + d);
        return hsumv(acc);
    }
    float acc = 0.f;
    for (int64_t d = 0; d < n; d++) acc += r[d] * m[d];
    return acc;
}
/* dot with four chains of adds where n % (4 VW) == 0 (another order of the sum): one chain waits on each
   add's latency, four keep the vector unit busy; the rows still read in order, which the hardware
   prefetcher follows (four rows side by side, read cold, it did not) */
static inline float dot_wide(const float *r, const float *m, int64_t n) {
    if (n % (4 * VW) != 0) return dot(r, m, n);
    vf a0 = loadv(r) * loadv(m), a1 = loadv(r + VW) * loadv(m + VW), a2 = loadv(r + 2 * VW) * loadv(m + 2 * VW),
       a3 = loadv(r + 3 * VW) * loadv(m + 3 * VW);
    for (int64_t d = 4 * VW; d < n; d += 4 * VW) {
        a0 += loadv(r + d) * loadv(m + d);
        a1 += loadv(r + d + VW) * loadv(m + d + VW);
        a2 += loadv(r + d + 2 * VW) * loadv(m + d + 2 * VW);
        a3 += loadv(r + d + 3 * VW) * loadv(m + d + 3 * VW);
    }
    return hsumv((a0 + a1) + (a2 + a3));
}

/* ---- the softmax pieces of the vector path (cpu_decode.c, tailorkv.c) ---- */

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
static inline float exp_sum(float *restrict x, int64_t n, float m) {
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
static inline float max_of(const float *restrict x, int64_t n) {
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

/* ---- the decode attention over listed rows (cpu_decode.c), as a selection kernel calls it ---- */

/* kvpass_decode_attention's arguments: q (B, Hk*G, D) strides (qs_b, qs_h, 1); k, v (B, Hk, S, D); idx
   (B, Hk, N) or NULL; bias (B, Hk, S) or NULL; out (B, Hk*G, D): see cpu_decode.c */
typedef struct {
    const float *q; int64_t qs_b, qs_h;
    const float *k; int64_t ks_b, ks_h, ks_s;
    const float *v; int64_t vs_b, vs_h, vs_s;
    const int64_t *idx; int64_t is_b, is_h, is_n;
    const float *bias; int64_t bs_b, bs_h, bs_s;
    float *out; int64_t os_b, os_h;
    int64_t B, Hk, G, S, N, D;
    float scale;
    int64_t threads;
} kvpass_decode_args;
int kvpass_decode_attention(const kvpass_decode_args *a);
typedef __typeof__(kvpass_decode_attention) *kvpass_attend_fn;

/* For a selection kernel that attends the list it has just written, in the same call from Python (a call
   costs tens of microseconds at 30 sites a step, run cold between the model's matmuls): the cache, the
   output and the scale of that attention, and the address of kvpass_decode_attention in the decode
   library (each selection library is its own file: it calls the attention through this pointer).
   Filled by kvpass.kernels.cpu_decode.ListedAttend. */
typedef struct {
    kvpass_attend_fn attend;
    const float *k; int64_t ks_b, ks_h, ks_s;
    const float *v; int64_t vs_b, vs_h, vs_s;
    float *out; int64_t os_b, os_h;
    float scale;
    int64_t threads;
} kvpass_listed_args;

/* kvpass_decode_attention of q (B, Hk * G, D) over the positions idx (B, Hk, N) (n-stride 1) of the first
   S rows of t's cache */
static inline int attend_listed(const kvpass_listed_args *t, const float *q, int64_t qs_b, int64_t qs_h,
                                const int64_t *idx, int64_t is_b, int64_t is_h, int64_t B, int64_t Hk, int64_t G,
                                int64_t S, int64_t N, int64_t D) {
    const kvpass_decode_args a = {q, qs_b, qs_h, t->k, t->ks_b, t->ks_h, t->ks_s, t->v, t->vs_b, t->vs_h, t->vs_s,
                                  idx, is_b, is_h, 1, NULL, 0, 0, 0, t->out, t->os_b, t->os_h, B, Hk, G, S, N, D,
                                  t->scale, t->threads};
    return t->attend(&a);
}

/* ---- ClusterKV (clusterkv.c): a decode step's list, and that list attended ---- */

/* kvpass_select_clusters' arguments: scores (B, H, C); sizes (B, H, C); offsets (B, H, C + 1); order
   (B, H, N); out (B, H, budget) */
typedef struct {
    const float *scores; int64_t ss_b, ss_h, ss_c;
    const int64_t *sizes; int64_t zs_b, zs_h, zs_c;
    const int64_t *offsets; int64_t fs_b, fs_h, fs_c;
    const int64_t *order; int64_t rs_b, rs_h, rs_n;
    int64_t *out; int64_t xs_b, xs_h, xs_j;
    int64_t B, H, C, N, budget;
} kvpass_select_clusters_args;

/* kvpass_cluster_select's arguments: q (B, H*G, D); cent (B, H, C, D); sizes (B, H, C); offsets
   (B, H, C + 1); order (B, H, N); first (B) or NULL; out (B, H, W) (last strides 1 where none is given) */
typedef struct {
    const float *q; int64_t qs_b, qs_h;
    const float *cent; int64_t cs_b, cs_h, cs_c;
    const int64_t *sizes; int64_t zs_b, zs_h, zs_c;
    const int64_t *offsets; int64_t fs_b, fs_h, fs_c;
    const int64_t *order; int64_t rs_b, rs_h, rs_n;
    const int64_t *first; int64_t ft_b;
    int64_t *out; int64_t xs_b, xs_h;
    int64_t B, H, G, D, C, N, L, n_sinks, cluster_budget, n_recent, cover, W, gqa_max;
} kvpass_cluster_args;

/* kvpass_cluster_step's: the selection, then the attention over its list (the first L rows) */
typedef struct {
    kvpass_cluster_args select;
    kvpass_listed_args attend;
} kvpass_cluster_step_args;

/* ---- Quest (quest.c): a decode step's pages, and their tokens attended ---- */

/* kvpass_quest_select's arguments: q (B, H*G, D); knew (B, H, D) or NULL; meta (B, H, P_cap, 2D) fp16;
   first (B) or NULL; pages (B, H, W + 1); idx (B, H, (W + 1) * page) or NULL */
typedef struct {
    const float *q; int64_t qs_b, qs_h;
    const float *knew; int64_t ks_b, ks_h;
    _Float16 *meta; int64_t ms_b, ms_h, ms_p;
    const int64_t *first; int64_t fs_b;
    int64_t *pages; int64_t ps_b, ps_h, ps_n;
    int64_t *idx; int64_t is_b, is_h;
    int64_t B, H, G, D, L, page, budget, n, W, gqa_max, threads;
} kvpass_quest_args;

/* kvpass_quest_step's: the selection, then the attention over the positions it listed (the first L rows) */
typedef struct {
    kvpass_quest_args select;
    kvpass_listed_args attend;
} kvpass_quest_step_args;

/* ---- TailorKV (tailorkv.c): a sparse layer's list, its append, and both with the attention ---- */

/* kvpass_quant_attention's arguments: q (B, H*G, D); kp (B, H, S/pk, D) uint8, ks/kz (B, H, S/gk, D) fp16;
   vp (B, H, S, D/pv) uint8, vs/vz (B, H, S, D/gv) fp16; kr/vr (B, H, R, D) fp32; out (B, H*G, D) */
typedef struct {
    const float *q; int64_t qs_b, qs_h;
    const uint8_t *kp; int64_t kp_b, kp_h, kp_s;
    const uint16_t *ks, *kz; int64_t km_b, km_h, km_s;
    const uint8_t *vp; int64_t vp_b, vp_h, vp_s;
    const uint16_t *vs, *vz; int64_t vm_b, vm_h, vm_s;
    const float *kr; int64_t kr_b, kr_h, kr_s;
    const float *vr; int64_t vr_b, vr_h, vr_s;
    float *out; int64_t os_b, os_h;
    int64_t B, H, G, S, R, D, bk, bv, gk, gv;
    float scale;
    int64_t threads;
} kvpass_quant_args;

/* kvpass_tailor_select's arguments: q (B, H*G, D); kT (B, H, D, S) fp32 or bf16 (kt_bf16); ch (B, H, C) or
   NULL (picked from qc (B, H*G, D) and kabs (B, H, D), written to ch_out (B, H, C) unless NULL); first (B)
   or NULL; out (B, H, width); cos (1) float64 or NULL */
typedef struct {
    const float *q; int64_t qs_b, qs_h;
    const void *kT; int64_t kt_bf16, ts_b, ts_h, ts_d;
    const int64_t *ch; int64_t cs_b, cs_h;
    const int64_t *first;
    int64_t *out; int64_t os_b, os_h;
    int64_t B, H, G, C, D, n_s, mid_end, k, n_r, threads;
    const float *qc; int64_t qc_b, qc_h;
    const float *kabs; int64_t a_b, a_h;
    int64_t *ch_out; int64_t co_b, co_h;
    double *cos;
} kvpass_tailor_select_args;

/* kvpass_tailor_append's arguments: kn, vn (B, H, T, D) (element strides kn_d, vn_d) into k, v (B, H, cap, D)
   at [at, at + T), kT (B, H, D, cap) and kabs (B, H, D) */
typedef struct {
    const float *kn; int64_t kn_b, kn_h, kn_t;
    const float *vn; int64_t vn_b, vn_h, vn_t;
    float *k; int64_t k_b, k_h, k_s;
    float *v; int64_t v_b, v_h, v_s;
    void *kt; int64_t kt_bf16, t_b, t_h, t_d;
    float *kabs; int64_t a_b, a_h;
    int64_t B, H, T, D, at, kn_d, vn_d;
} kvpass_tailor_append_args;

/* kvpass_tailor_step's: the selection, the append of the step's token, then the attention over the list
   (select.out: (B, H, N) positions) in the first S rows of k, v */
typedef struct {
    kvpass_tailor_select_args select;
    kvpass_tailor_append_args append;
    kvpass_listed_args attend;
    int64_t S, N;
} kvpass_tailor_step_args;

#endif /* KVPASS_H */
