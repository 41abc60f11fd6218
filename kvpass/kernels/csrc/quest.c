/* quest.c: Quest's CPU page choice (kvpass.kernels.quest): the query group's bound of each page, the
   top pages, their token positions, the step's key merged into its page first, and optionally the
   attention over those positions in the same call. Tang et al. 2024, "Quest". */
#include "kvpass.h"
/* pages the bound loop asks for ahead of its use: the hardware prefetcher alone kept the reads of the
   bounds about 15 % slower a call (B 1 and 8 at 8k, 1 and 2 threads, one process A/B: 116 -> 100 us a
   site at batch 1, 1 thread); 4 to 24 pages ahead and a prefetch into every cache level read the same */
#define PF 8

/* fp16 bounds (the rows of `meta`), read VW at a time as fp32 lanes */
typedef _Float16 half;
#if VW == 16
#include <immintrin.h>
static inline vf loadh(const half *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif VW == 8 && defined(__F16C__)
#include <immintrin.h>
static inline vf loadh(const half *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline vf loadh(const half *p) { vf x; for (int i = 0; i < VW; i++) x[i] = (float)p[i]; return x; }
#endif
/* sum of r[d] * m[d], m fp16: two chains of adds where n % (2 VW) == 0, else one at a time */
static inline float dot_half(const float *r, const half *m, int64_t n) {
    if (n % (2 * VW) != 0) {
        float acc = 0.f;
        for (int64_t d = 0; d < n; d++) acc += r[d] * (float)m[d];
        return acc;
    }
    vf a0 = loadv(r) * loadh(m), a1 = loadv(r + VW) * loadh(m + VW);
    for (int64_t d = 2 * VW; d < n; d += 2 * VW) {
        a0 += loadv(r + d) * loadh(m + d);
        a1 += loadv(r + d + VW) * loadh(m + d + VW);
    }
    return hsumv(a0 + a1);
}
/* the next fp16 toward +inf (up) or -inf: what torch.nextafter gives */
static inline half half_step(half h, int up) {
    uint16_t u;
    memcpy(&u, &h, 2);
    if ((u & 0x7fff) == 0) u = up ? 0x0001 : 0x8001;
    else if (u & 0x8000) u = up ? u - 1 : u + 1;
    else u = up ? u + 1 : u - 1;
    memcpy(&h, &u, 2);
    return h;
}
/* x in fp16 rounded up (a page's max) or down (its min), as kvpass.kernels.quest.quest_bounds does */
static inline half half_up(float x) { half h = (half)x; return (float)h < x ? half_step(h, 1) : h; }
static inline half half_down(float x) { half h = (half)x; return (float)h > x ? half_step(h, 0) : h; }

/* The k-th largest (1 <= k <= n) of x[0, n), reordering x: a quickselect whose rounds split the keys
   three ways (above the pivot, equal to it, below: ties settle in one round), the median of three as pivot; past SELECT_ROUNDS rounds (inputs made to defeat the
   pivot) the rest is sorted. */
#ifndef SELECT_ROUNDS  /* a test builds the library with fewer (-DSELECT_ROUNDS=n) */
#define SELECT_ROUNDS 64
#endif
static int desc_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}
static float kth_largest(float *restrict x, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n, want = k - 1;
    for (int round = 0;; round++) {
        if (round == SELECT_ROUNDS) {
            qsort(x + lo, (size_t)(hi - lo), sizeof(float), desc_float);
            return x[want];
        }
        if (hi - lo == 1) return x[lo];
        float a = x[lo], b = x[lo + (hi - lo) / 2], c = x[hi - 1];
        float piv = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        /* branch-free partitions (a swap at every key, the bound moved by the comparison): the keys above
           piv to [lo, lt), then those equal to it to [lt, eq) */
        int64_t lt = lo;
        for (int64_t i = lo; i < hi; i++) {
            float v = x[i];
            x[i] = x[lt];
            x[lt] = v;
            lt += v > piv;
        }
        if (want < lt) { hi = lt; continue; }
        int64_t eq = lt;
        for (int64_t i = lt; i < hi; i++) {
            float v = x[i];
            x[i] = x[eq];
            x[eq] = v;
            eq += v == piv;
        }
        if (want < eq) return piv;
        lo = eq;
    }
}

/* One (b, kv head) pair: the top k of its P pages (rows: 1 query bound, or G with gqa_max; ties to the
   lower page) written to o (stride ps_n, W + 1 slots) in ascending order, the newest page after them,
   then -1; its token positions to x when x is not NULL. Every bound is scored first (no branch on the
   ranking in that loop), then the k-th best found (kth_largest) and the pages above it taken in one pass
   without branches. A heap of the best so far, updated page by page, cost a third of the call (8k, 30
   sites' bounds, one process A/B, us a site: batch 1 62 -> 40 at 1 thread, 49 -> 29 at 2; batch 8 433 ->
   297 at 1). qq (2 D G), sc and tmp (P) are scratch. */
static inline __attribute__((always_inline)) void quest_pair(
        const float *restrict qg, int64_t qs_h, const half *restrict mp, int64_t ms_p, int64_t *restrict o,
        int64_t ps_n, int64_t *restrict x, int64_t f, int64_t L, int64_t page, int64_t P, int64_t k, int64_t W,
        int64_t G, int64_t D, int64_t gqa_max, float *restrict qq, float *restrict sc, float *restrict tmp) {
    int64_t rows = gqa_max ? G : 1;
    for (int64_t d = 0; d < 2 * D * rows; d++) qq[d] = 0.f;
    for (int64_t g = 0; g < G; g++) {
        float *r = qq + (gqa_max ? g : 0) * 2 * D;
        for (int64_t d = 0; d < D; d++) {
            float v = qg[g * qs_h + d];
            r[d] += v > 0.f ? v : 0.f;
            r[D + d] += v < 0.f ? v : 0.f;
        }
    }
    int64_t j = 0;
    if (k >= P) {
        for (int64_t p = 0; p < P; p++) o[(j++) * ps_n] = p;
    } else if (k > 0) {
        for (int64_t p = 0; p < P; p++) {
            const half *m = mp + p * ms_p;
            if (p + PF < P) for (int64_t c = 0; c < 2 * D; c += 32) __builtin_prefetch(m + PF * ms_p + c, 0, 0);
            float best = 0.f;
            for (int64_t g = 0; g < rows; g++) {
                float acc = dot_half(qq + g * 2 * D, m, 2 * D);  /* 2D halves: 128 for SmolLM2 */
                acc = acc != acc ? __builtin_inff() : acc;  /* 0 * inf: a bound past fp16's range, unknown */
                best = (g == 0 || acc > best) ? acc : best;
            }
            sc[p] = best;
        }
        memcpy(tmp, sc, sizeof(float) * (size_t)P);
        float cut = kth_largest(tmp, P, k);
        int64_t eq = k;  /* of the pages equal to the cut, the first k - (pages above it) */
        for (int64_t p = 0; p < P; p++) eq -= sc[p] > cut;
        for (int64_t p = 0; p < P; p++) {  /* a store at every page, j moved where it is taken: no branch */
            int64_t at = sc[p] == cut, take = ((sc[p] > cut) | (at & (eq > 0))) & (j < k);  /* j < k: o's bound */
            eq -= at & take;
            o[j * ps_n] = p;
            j += take;
        }
    }
    if (P >= 0) o[(j++) * ps_n] = P;
    for (; j <= W; j++) o[j * ps_n] = -1;
    if (x) {
        for (j = 0; j <= W; j++) {
            int64_t pg = o[j * ps_n];
            for (int64_t t = 0; t < page; t++) {
                int64_t pos = f + pg * page + t;
                x[j * page + t] = (pg >= 0 && pos < L) ? pos : -1;
            }
        }
    }
}

/* The arguments of kvpass_quest_select, for its pairs [lo, hi) */
typedef struct {
    const float *q, *knew;
    half *meta;
    const int64_t *first;
    int64_t *pages, *idx;
    int64_t qs_b, qs_h, ks_b, ks_h, ms_b, ms_h, ms_p, fs_b, ps_b, ps_h, ps_n, is_b, is_h, H, G, D, L, page, budget, n,
        W, gqa_max;
} quest_args;

static int quest_pairs(const quest_args *a, int64_t lo, int64_t hi) {
    const int64_t pmax = (a->L + a->page - 1) / a->page;
    float *qq = (float *)malloc(sizeof(float) * (size_t)(2 * a->D * a->G));
    float *sc = (float *)malloc(sizeof(float) * (size_t)(2 * (pmax > 0 ? pmax : 1)));
    int rc = (qq && sc) ? 0 : -1;
    for (int64_t pr = lo; pr < hi && !rc; pr++) {
        int64_t b = pr / a->H, h = pr % a->H;
        int64_t f = a->first ? a->first[b * a->fs_b] : 0;
        int64_t nb = a->L - f;
        int64_t P = nb > 0 ? (nb + a->page - 1) / a->page - 1 : -1;
        int64_t k = nb <= a->budget ? P : (a->n < P ? a->n : P);
        if (k > a->W) k = a->W;
        if (k < 0) k = 0;
        if (a->knew && P >= 0) {
            /* the step's key (position L - 1) joins its page, the newest (P): a steady step's metadata update */
            const float *kn = a->knew + b * a->ks_b + h * a->ks_h;
            half *m = a->meta + b * a->ms_b + h * a->ms_h + P * a->ms_p;
            for (int64_t d = 0; d < a->D; d++) {
                half hi = half_up(kn[d]), lo = half_down(kn[d]);
                if (hi > m[d]) m[d] = hi;
                if (lo < m[a->D + d]) m[a->D + d] = lo;
            }
        }
        quest_pair(a->q + b * a->qs_b + h * a->G * a->qs_h, a->qs_h, a->meta + b * a->ms_b + h * a->ms_h, a->ms_p,
                   a->pages + b * a->ps_b + h * a->ps_h, a->ps_n, a->idx ? a->idx + b * a->is_b + h * a->is_h : NULL,
                   f, a->L, a->page, P, k, a->W, a->G, a->D, a->gqa_max, qq, sc, sc + pmax);
    }
    free(qq);
    free(sc);
    return rc;
}

#define MAX_THREADS 64
/* Per (b, kv head) of a decode step at length L: the row's pages start at its first real position f
   (first[b * fs_b], 0 without `first`), so the row has nb = L - f tokens in ceil(nb / page) pages, the
   last one (the newest) always taken. The Quest bound of the P = pages - 1 others for the query group,
   the top k of them (ties to the lower page): k = P where the row fits in `budget` (nb <= budget: every
   page, as the row alone attends all of it), else min(n, P). Written to `pages` (W + 1 slots): the top
   k in ascending page order, then the newest, then -1. `idx` (may be NULL, last stride 1): the token
   positions of those pages in the cache, f + page * page_size + t, -1 past L or for a -1 page. meta rows
   are [max | min] (2D fp16, rounded outward) in the row's own pages; gqa_max: the group's bound is the
   max of its queries' bounds, else their sum. The pairs split over up to `threads` threads of torch's
   OpenMP pool (kvpass.kernels.native) when each gets at least 64k bounds (128 KB) to read; one thread
   without OpenMP. knew (may be NULL, last stride 1): the step's key (B, H, D) fp32 at position L - 1,
   merged into its row's newest page first (max rounded up, min down), so that a steady decode step
   updates the metadata here rather than in ops of its own. Returns 0, or -1 when scratch cannot be had. */
static int quest_select(const float *q, int64_t qs_b, int64_t qs_h,
                     const float *knew, int64_t ks_b, int64_t ks_h,
                     half *meta, int64_t ms_b, int64_t ms_h, int64_t ms_p,
                     const int64_t *first, int64_t fs_b,
                     int64_t *pages, int64_t ps_b, int64_t ps_h, int64_t ps_n,
                     int64_t *idx, int64_t is_b, int64_t is_h,
                     int64_t B, int64_t H, int64_t G, int64_t D,
                     int64_t L, int64_t page, int64_t budget, int64_t n, int64_t W, int64_t gqa_max,
                     int64_t threads) {
    const quest_args a = {q, knew, meta, first, pages, idx, qs_b, qs_h, ks_b, ks_h, ms_b, ms_h, ms_p, fs_b, ps_b,
                          ps_h, ps_n, is_b, is_h, H, G, D, L, page, budget, n, W, gqa_max};
    const int64_t pmax = (L + page - 1) / page, pairs = B * H;
    int64_t t = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (t > pairs) t = pairs;
    if (pairs * pmax * 2 * D < 65536 * t) t = 1;  /* 128 KB of fp16 bounds a thread: split at 8k, batch 1 */
#ifdef _OPENMP
    if (t > 1) {
        int rc = 0;
        #pragma omp parallel for num_threads(t) schedule(static, 1) reduction(|:rc)
        for (int64_t i = 0; i < t; i++) rc |= quest_pairs(&a, pairs * i / t, pairs * (i + 1) / t);
        return rc ? -1 : 0;
    }
#endif
    return quest_pairs(&a, 0, pairs);
}

/* kvpass_quest_args: quest_select's arguments in one struct (kvpass.h), filled once by
   kvpass.kernels.quest.QuestStep: a ctypes call converts each argument it passes (about 0.2 us each), and a
   decode step changes only a few of them */
int kvpass_quest_select(const kvpass_quest_args *a) {
    return quest_select(a->q, a->qs_b, a->qs_h, a->knew, a->ks_b, a->ks_h, a->meta, a->ms_b, a->ms_h, a->ms_p,
                        a->first, a->fs_b, a->pages, a->ps_b, a->ps_h, a->ps_n, a->idx, a->is_b, a->is_h, a->B,
                        a->H, a->G, a->D, a->L, a->page, a->budget, a->n, a->W, a->gqa_max, a->threads);
}

/* kvpass_quest_select, then the decode attention over the positions it listed (cpu_decode.c) */
int kvpass_quest_step(const kvpass_quest_step_args *a) {
    const kvpass_quest_args *s = &a->select;
    int rc = kvpass_quest_select(s);
    if (rc) return rc;
    return attend_listed(&a->attend, s->q, s->qs_b, s->qs_h, s->idx, s->is_b, s->is_h, s->B, s->H, s->G, s->L,
                         (s->W + 1) * s->page, s->D);
}
