/* cpu_decode.c: decode attention on the CPU, fused with the gather (kvpass.kernels.cpu_decode).

   One query token per head attends to the rows of a cache listed per KV head, read in place, or to every
   row; the G query heads of a KV head share each K and V row. Two passes per (batch row, KV head): the
   scores and their maximum, then exp(s - max) and the weighted sum of the V rows, fp32 throughout. The
   selection kernels (clusterkv.c, quest.c, tailorkv.c) call kvpass_decode_attention through the address
   in their kvpass_listed_args (kvpass.h). */
#include <pthread.h>

#include "kvpass.h"

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
static int decode_attention(const float *q, int64_t qs_b, int64_t qs_h,
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

/* kvpass_decode_args: decode_attention's arguments in one struct (kvpass.h); a selection kernel calls this
   through the address in its kvpass_listed_args */
int kvpass_decode_attention(const kvpass_decode_args *a) {
    return decode_attention(a->q, a->qs_b, a->qs_h, a->k, a->ks_b, a->ks_h, a->ks_s, a->v, a->vs_b, a->vs_h, a->vs_s,
                            a->idx, a->is_b, a->is_h, a->is_n, a->bias, a->bs_b, a->bs_h, a->bs_s, a->out, a->os_b,
                            a->os_h, a->B, a->Hk, a->G, a->S, a->N, a->D, a->scale, a->threads);
}
