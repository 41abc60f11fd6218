/* clusterkv.c: ClusterKV's CPU selection (kvpass.kernels.clusterkv): the clusters ranked by a query,
   their tokens listed up to a budget, and a decode step's whole list (sinks, clusters, recent tokens),
   optionally attended in the same call. Liu et al. 2024, "ClusterKV". */
#include "kvpass.h"

typedef struct { float s; int64_t c; } rank_t;

/* x ranks before y: descending score, ties to the lower cluster index (torch.sort(descending=True,
   stable=True)); scores here are never NaN (filtered where they are made) */
static inline int before(const rank_t *x, const rank_t *y) { return x->s > y->s || (x->s == y->s && x->c < y->c); }

/* A binary heap with the best cluster on top: a step recalls a dozen clusters of hundreds, so popping
   them in rank order (O(C) to build, O(log C) a pop) replaces sorting them all (qsort's O(C log C)
   calls through a function pointer were most of a step's selection at 32k tokens). */
static void sift_down(rank_t *h, int64_t n, int64_t i) {
    rank_t v = h[i];
    for (;;) {
        int64_t l = 2 * i + 1;
        if (l >= n) break;
        int64_t m = (l + 1 < n && before(&h[l + 1], &h[l])) ? l + 1 : l;
        if (!before(&h[m], &v)) break;
        h[i] = h[m];
        i = m;
    }
    h[i] = v;
}
static void heapify(rank_t *h, int64_t n) { for (int64_t i = n / 2 - 1; i >= 0; i--) sift_down(h, n, i); }
static rank_t pop_best(rank_t *h, int64_t *n) {
    rank_t top = h[0];
    h[0] = h[--*n];
    sift_down(h, *n, 0);
    return top;
}

/* select_clusters_ref in one pass per (b, h): the eligible clusters (score > -inf, size > 0) ranked,
   their members emitted from order[offsets[c] ...] until budget slots are filled, -1 after. */
static int select_clusters(const float *scores, int64_t ss_b, int64_t ss_h, int64_t ss_c,
                           const int64_t *sizes, int64_t zs_b, int64_t zs_h, int64_t zs_c,
                           const int64_t *offsets, int64_t fs_b, int64_t fs_h, int64_t fs_c,
                           const int64_t *order, int64_t rs_b, int64_t rs_h, int64_t rs_n,
                           int64_t *out, int64_t xs_b, int64_t xs_h, int64_t xs_j,
                           int64_t B, int64_t H, int64_t C, int64_t N, int64_t budget) {
    rank_t *r = (rank_t *)malloc(sizeof(rank_t) * (size_t)(C > 0 ? C : 1));
    if (!r) return -1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const float *sc = scores + b * ss_b + h * ss_h;
            const int64_t *sz = sizes + b * zs_b + h * zs_h, *off = offsets + b * fs_b + h * fs_h;
            const int64_t *ord = order + b * rs_b + h * rs_h;
            int64_t *o = out + b * xs_b + h * xs_h, n = 0, j = 0;
            for (int64_t c = 0; c < C; c++) {
                float s = sc[c * ss_c];
                if (s > -INFINITY && sz[c * zs_c] > 0) { r[n].s = s; r[n].c = c; n++; }
            }
            heapify(r, n);
            while (n > 0 && j < budget) {
                int64_t c = pop_best(r, &n).c, z = sz[c * zs_c], first = off[c * fs_c];
                for (int64_t t = 0; t < z && j < budget; t++, j++) {
                    int64_t src = first + t;
                    o[j * xs_j] = (src >= 0 && src < N) ? ord[src * rs_n] : -1;
                }
            }
            for (; j < budget; j++) o[j * xs_j] = -1;
        }
    free(r);
    return 0;
}

/* A ClusterKV decode step's whole list per (b, h), cluster_select_torch in one pass: row b starts at
   f = first[b] (0 without first); a row whose own length L - f fits `cover` (>= 0) lists all of
   [f, L); the others list their sinks f + [0, n_sinks), then the best whole clusters by q . mu
   (gqa: the query group's sum, or the max of its members' scores) in cluster_budget slots (the last
   trimmed, -1 after), then the recent tokens [L - n_recent, L). -1 fills the list to W. */
static int cluster_select(const float *q, int64_t qs_b, int64_t qs_h,
                         const float *cent, int64_t cs_b, int64_t cs_h, int64_t cs_c,
                         const int64_t *sizes, int64_t zs_b, int64_t zs_h, int64_t zs_c,
                         const int64_t *offsets, int64_t fs_b, int64_t fs_h, int64_t fs_c,
                         const int64_t *order, int64_t rs_b, int64_t rs_h, int64_t rs_n,
                         const int64_t *first, int64_t ft_b,
                         int64_t *out, int64_t xs_b, int64_t xs_h,
                         int64_t B, int64_t H, int64_t G, int64_t D, int64_t C, int64_t N, int64_t L,
                         int64_t n_sinks, int64_t cluster_budget, int64_t n_recent, int64_t cover, int64_t W,
                         int64_t gqa_max) {
    rank_t *r = (rank_t *)malloc(sizeof(rank_t) * (size_t)(C > 0 ? C : 1));
    float *qq = (float *)malloc(sizeof(float) * (size_t)(G * D > 0 ? G * D : 1));
    if (!r || !qq) { free(r); free(qq); return -1; }
    for (int64_t b = 0; b < B; b++) {
        int64_t f = first ? first[b * ft_b] : 0;
        for (int64_t h = 0; h < H; h++) {
            int64_t *o = out + b * xs_b + h * xs_h, j = 0;
            if (cover >= 0 && L - f <= cover) {
                for (; j < W; j++) o[j] = f + j < L ? f + j : -1;
                continue;
            }
            for (int64_t t = 0; t < n_sinks && j < W; t++) o[j++] = f + t;
            int64_t end = j + cluster_budget;
            if (end > W) end = W;
            if (cluster_budget > 0 && C > 0) {
                int64_t rows = gqa_max ? G : 1;
                const float *qg = q + b * qs_b + h * G * qs_h;
                for (int64_t d = 0; d < D * rows; d++) qq[d] = 0.f;
                for (int64_t g = 0; g < G; g++)
                    for (int64_t d = 0; d < D; d++) qq[(gqa_max ? g : 0) * D + d] += qg[g * qs_h + d];
                const float *ce = cent + b * cs_b + h * cs_h;
                const int64_t *sz = sizes + b * zs_b + h * zs_h, *off = offsets + b * fs_b + h * fs_h;
                const int64_t *ord = order + b * rs_b + h * rs_h;
                int64_t n = 0;
                for (int64_t c = 0; c < C; c++) {
                    if (sz[c * zs_c] <= 0) continue;
                    const float *m = ce + c * cs_c;
                    float best = 0.f;
                    for (int64_t g = 0; g < rows; g++) {
                        float acc = dot(qq + g * D, m, D);  /* in lanes: hundreds of clusters at 32k */
                        if (g == 0 || acc > best) best = acc;
                    }
                    if (best > -INFINITY) { r[n].s = best; r[n].c = c; n++; }
                }
                heapify(r, n);
                while (n > 0 && j < end) {
                    int64_t c = pop_best(r, &n).c, z = sz[c * zs_c], at = off[c * fs_c];
                    for (int64_t t = 0; t < z && j < end; t++, j++) {
                        int64_t src = at + t;
                        o[j] = (src >= 0 && src < N) ? ord[src * rs_n] : -1;
                    }
                }
            }
            for (; j < end; j++) o[j] = -1;
            for (int64_t t = 0; t < n_recent && j < W; t++) o[j++] = L - n_recent + t;
            for (; j < W; j++) o[j] = -1;
        }
    }
    free(r);
    free(qq);
    return 0;
}

/* kvpass_select_clusters_args: select_clusters' arguments in one struct (kvpass.h) */
int kvpass_select_clusters(const kvpass_select_clusters_args *a) {
    return select_clusters(a->scores, a->ss_b, a->ss_h, a->ss_c, a->sizes, a->zs_b, a->zs_h, a->zs_c, a->offsets,
                           a->fs_b, a->fs_h, a->fs_c, a->order, a->rs_b, a->rs_h, a->rs_n, a->out, a->xs_b, a->xs_h,
                           a->xs_j, a->B, a->H, a->C, a->N, a->budget);
}

/* kvpass_cluster_args: cluster_select's arguments in one struct (kvpass.h), filled once by
   kvpass.kernels.clusterkv.ClusterStep: a ctypes call converts each argument it passes (about 0.2 us each),
   and a decode step changes only a few of them */
int kvpass_cluster_select(const kvpass_cluster_args *a) {
    return cluster_select(a->q, a->qs_b, a->qs_h, a->cent, a->cs_b, a->cs_h, a->cs_c, a->sizes, a->zs_b, a->zs_h,
                          a->zs_c, a->offsets, a->fs_b, a->fs_h, a->fs_c, a->order, a->rs_b, a->rs_h, a->rs_n,
                          a->first, a->ft_b, a->out, a->xs_b, a->xs_h, a->B, a->H, a->G, a->D, a->C, a->N, a->L,
                          a->n_sinks, a->cluster_budget, a->n_recent, a->cover, a->W, a->gqa_max);
}

/* kvpass_cluster_select, then the decode attention over the list it wrote (cpu_decode.c) */
int kvpass_cluster_step(const kvpass_cluster_step_args *a) {
    const kvpass_cluster_args *s = &a->select;
    int rc = kvpass_cluster_select(s);
    if (rc) return rc;
    return attend_listed(&a->attend, s->q, s->qs_b, s->qs_h, s->out, s->xs_b, s->xs_h, s->B, s->H, s->G, s->L, s->W,
                         s->D);
}
