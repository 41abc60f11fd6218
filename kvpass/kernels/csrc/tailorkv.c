/* tailorkv.c: TailorKV's CPU kernels (kvpass.kernels.tailorkv): a sparse layer's critical channels and
   its decode list by a radix top-k over channel-major keys, its decode append, both with the listed
   attention in one call, and the decode attention over the 1/2-bit quantised cache with the codes unpacked
   in registers. Yao et al. 2025, "TailorKV". */
#include <pthread.h>

#include "kvpass.h"

/* An order-preserving key: a larger float gives a larger key; NaN ranks as `nan_key`, -0 as +0. No
   branches, so that a loop of them vectorises: a negative float's bits are flipped, a positive one's sign
   bit set. */
static inline uint32_t fkey(float s, uint32_t nan_key) {
    uint32_t u;
    memcpy(&u, &s, sizeof u);
    u = s == 0.f ? 0u : u;
    u ^= (uint32_t)((int32_t)u >> 31) | 0x80000000u;
    return s != s ? nan_key : u;
}

/* Bit i of the mask: key x[i] above c (gt), equal to c (eq), in the bucket pre under mask pm (in); 16 keys
   at a time (AVX-512, AVX2, or plain C). */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline uint32_t gt_mask16(const uint32_t *x, uint32_t c) {
    return _mm512_cmpgt_epu32_mask(_mm512_loadu_si512((const void *)x), _mm512_set1_epi32((int)c));
}
static inline uint32_t eq_mask16(const uint32_t *x, uint32_t c) {
    return _mm512_cmpeq_epu32_mask(_mm512_loadu_si512((const void *)x), _mm512_set1_epi32((int)c));
}
static inline uint32_t in_mask16(const uint32_t *x, uint32_t pm, uint32_t pre) {  /* (x & pm) == pre */
    __m512i a = _mm512_and_si512(_mm512_loadu_si512((const void *)x), _mm512_set1_epi32((int)pm));
    return _mm512_cmpeq_epu32_mask(a, _mm512_set1_epi32((int)pre));
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline uint32_t gt_mask8(const uint32_t *x, uint32_t c) {  /* unsigned > as signed > of x ^ 2^31 */
    const __m256i s = _mm256_set1_epi32((int)0x80000000u);
    __m256i a = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)x), s);
    __m256i b = _mm256_xor_si256(_mm256_set1_epi32((int)c), s);
    return (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a, b)));
}
static inline uint32_t eq_mask8(const uint32_t *x, uint32_t c) {
    __m256i a = _mm256_loadu_si256((const __m256i *)x);
    return (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, _mm256_set1_epi32((int)c))));
}
static inline uint32_t in_mask8(const uint32_t *x, uint32_t pm, uint32_t pre) {
    __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)x), _mm256_set1_epi32((int)pm));
    return (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, _mm256_set1_epi32((int)pre))));
}
static inline uint32_t gt_mask16(const uint32_t *x, uint32_t c) { return gt_mask8(x, c) | gt_mask8(x + 8, c) << 8; }
static inline uint32_t in_mask16(const uint32_t *x, uint32_t pm, uint32_t pre) {
    return in_mask8(x, pm, pre) | in_mask8(x + 8, pm, pre) << 8;
}
static inline uint32_t eq_mask16(const uint32_t *x, uint32_t c) { return eq_mask8(x, c) | eq_mask8(x + 8, c) << 8; }
#else
static inline uint32_t gt_mask16(const uint32_t *x, uint32_t c) {
    uint32_t m = 0;
    for (int i = 0; i < 16; i++) m |= (uint32_t)(x[i] > c) << i;
    return m;
}
static inline uint32_t eq_mask16(const uint32_t *x, uint32_t c) {
    uint32_t m = 0;
    for (int i = 0; i < 16; i++) m |= (uint32_t)(x[i] == c) << i;
    return m;
}
static inline uint32_t in_mask16(const uint32_t *x, uint32_t pm, uint32_t pre) {
    uint32_t m = 0;
    for (int i = 0; i < 16; i++) m |= (uint32_t)((x[i] & pm) == pre) << i;
    return m;
}
#endif

/* bfloat16 (the high half of the fp32 bits) to fp32: one value, VW values (one widening load) */
static inline float bf16f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}
static inline vf bf16v(const uint16_t *p) {
#if defined(__AVX512F__) && VW == 16
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#elif defined(__AVX2__) && VW == 8
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    vf x = (vf){0};  /* every lane is set below; the compiler cannot tell */
    for (int i = 0; i < VW; i++) x[i] = bf16f(p[i]);
    return x;
#endif
}

/* The scores sc[t] = sum_c w[c] * kt[cb[c] * ts_d + off + t] of a tile's m candidates, in that order
   (0 + w_0 x_0 + w_1 x_1 + ...: the same sum as one channel row at a time), bf16 or fp32 rows. 4 VW
   candidates at a time in four registers: one register's sum is a chain of C dependent adds. */
static inline __attribute__((always_inline)) void score_tile(const void *kt, const int bf16, const int64_t *cb,
                                                             const float *w, int64_t C, int64_t ts_d, int64_t off,
                                                             int64_t m, float *sc) {
    const uint16_t *kh = (const uint16_t *)kt + off;
    const float *kf = (const float *)kt + off;
    int64_t t = 0;
    for (; t + 4 * VW <= m; t += 4 * VW) {
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t c = 0; c < C; c++) {
            const int64_t r = cb[c] * ts_d + t;
            if (bf16) {
                a0 += w[c] * bf16v(kh + r); a1 += w[c] * bf16v(kh + r + VW);
                a2 += w[c] * bf16v(kh + r + 2 * VW); a3 += w[c] * bf16v(kh + r + 3 * VW);
            } else {
                a0 += w[c] * loadv(kf + r); a1 += w[c] * loadv(kf + r + VW);
                a2 += w[c] * loadv(kf + r + 2 * VW); a3 += w[c] * loadv(kf + r + 3 * VW);
            }
        }
        storev(sc + t, a0); storev(sc + t + VW, a1); storev(sc + t + 2 * VW, a2); storev(sc + t + 3 * VW, a3);
    }
    for (; t + VW <= m; t += VW) {
        vf a = {0};
        for (int64_t c = 0; c < C; c++)
            a += w[c] * (bf16 ? bf16v(kh + cb[c] * ts_d + t) : loadv(kf + cb[c] * ts_d + t));
        storev(sc + t, a);
    }
    for (; t < m; t++) {
        float a = 0.f;
        for (int64_t c = 0; c < C; c++) a += w[c] * (bf16 ? bf16f(kh[cb[c] * ts_d + t]) : kf[cb[c] * ts_d + t]);
        sc[t] = a;
    }
}

/* The cut of the k largest of key[0, n) (1 <= k < n) by a radix select on `lv` levels of width[i] buckets
   (the key's bits from shift[i]): every key above *cut is taken, and the first *eq keys equal to it (in
   position order: ties to the lower position). The first pass counts all n keys (`h0` may hold that count
   already, made while the keys were written); the next ones only the keys of the bucket that holds the
   cut, copied to sub (n). */
static void radix_cut(const uint32_t *key, int64_t n, int64_t k, uint32_t *sub, const uint32_t *h0, int levels,
                      const int *shift, const uint32_t *width, uint32_t *cut, int64_t *eq) {
    uint32_t hist[2048], prefix = 0, pmask = 0;
    const uint32_t *x = key;
    int64_t need = k, m = n;
    for (int lv = 0; lv < levels; lv++) {
        uint32_t bm = width[lv] - 1;
        if (lv == 0 && h0) {
            memcpy(hist, h0, sizeof(uint32_t) * width[0]);
        } else if (width[lv] <= 256) {
            /* four histograms, summed: keys that share a bucket (most of them, at the top bits of scores of
               one magnitude) would otherwise wait on each other's increment */
            uint32_t h4[4][256];
            memset(h4, 0, sizeof h4);
            int64_t t = 0;
            for (; t + 4 <= m; t += 4) {
                h4[0][(x[t] >> shift[lv]) & bm]++;
                h4[1][(x[t + 1] >> shift[lv]) & bm]++;
                h4[2][(x[t + 2] >> shift[lv]) & bm]++;
                h4[3][(x[t + 3] >> shift[lv]) & bm]++;
            }
            for (; t < m; t++) h4[0][(x[t] >> shift[lv]) & bm]++;
            for (uint32_t i = 0; i < width[lv]; i++) hist[i] = (h4[0][i] + h4[1][i]) + (h4[2][i] + h4[3][i]);
        } else {
            memset(hist, 0, sizeof(uint32_t) * width[lv]);
            for (int64_t t = 0; t < m; t++) hist[(x[t] >> shift[lv]) & bm]++;
        }
        int64_t b = (int64_t)width[lv] - 1, above = 0;
        while (above + hist[b] < need) above += hist[b--];
        need -= above;
        prefix |= (uint32_t)b << shift[lv];
        pmask |= bm << shift[lv];
        if ((int64_t)hist[b] == need) { *cut = prefix; *eq = INT64_MAX; return; } /* the whole bucket */
        int64_t j = 0, t = 0;
        for (; t + 16 <= m; t += 16)  /* in place when x is sub: j <= t */
            for (uint32_t e = in_mask16(x + t, pmask, prefix); e; e &= e - 1) sub[j++] = x[t + __builtin_ctz(e)];
        for (; t < m; t++) { sub[j] = x[t]; j += (x[t] & pmask) == prefix; }
        x = sub;
        m = j;
    }
    *cut = prefix;
    *eq = need;
}

/* radix_cut on 11/11/10 bits: an L1-sized first histogram for many keys */
static void top_cut(const uint32_t *key, int64_t n, int64_t k, uint32_t *sub, const uint32_t *h0,
                    uint32_t *cut, int64_t *eq) {
    static const int shift[3] = {21, 10, 0};
    static const uint32_t width[3] = {2048, 2048, 1024};
    radix_cut(key, n, k, sub, h0, 3, shift, width, cut, eq);
}

/* radix_cut on 8/8/8/8 bits: for a few keys, where clearing and scanning 2048 buckets a level would cost
   more than counting them */
static void top_cut_small(const uint32_t *key, int64_t n, int64_t k, uint32_t *sub, uint32_t *cut, int64_t *eq) {
    static const int shift[4] = {24, 16, 8, 0};
    static const uint32_t width[4] = {256, 256, 256, 256};
    radix_cut(key, n, k, sub, NULL, 4, shift, width, cut, eq);
}

/* Writes at o the positions first + t of the k largest keys of key[0, n) (ties to the lower t) in
   position order, all n when k >= n; returns how many. sub: n scratch; h0: key[0, n)'s histogram of
   the top 11 bits, or NULL. The pass that lists them has no data-dependent branch but its end. */
static int64_t take_top(const uint32_t *key, int64_t n, int64_t k, uint32_t *sub, const uint32_t *h0, int64_t *o,
                        int64_t first) {
    int64_t j = 0;
    if (k >= n) {
        for (int64_t t = 0; t < n; t++) o[j++] = first + t;
        return j;
    }
    if (k <= 0) return 0;
    uint32_t cut;
    int64_t eq;
    top_cut(key, n, k, sub, h0, &cut, &eq);
    /* a cut that is the bucket's low end takes every key >= it; an exact one the first eq equal. Sixteen
       keys at a time: a mask of those taken, then one store per taken key (about k, not n). */
    int64_t t = 0;
    for (; t + 16 <= n && j < k; t += 16) {
        uint32_t m = gt_mask16(key + t, cut);
        if (eq > 0) {
            uint32_t e = eq_mask16(key + t, cut);
            while (e && __builtin_popcount(e) > eq) e &= ~(0x80000000u >> __builtin_clz(e));  /* the first eq */
            eq -= __builtin_popcount(e);
            m |= e;
        }
        while (m) {
            o[j++] = first + t + __builtin_ctz(m);
            m &= m - 1;
        }
    }
    for (; t < n && j < k; t++) {
        uint32_t x = key[t];
        if (x > cut || (x == cut && eq-- > 0)) o[j++] = first + t;
    }
    return j;
}

/* The keys key[t] >= thr (unsigned) of key[0, n) packed in order to ck, their positions t to cp; returns
   how many. No branch on the keys: a vector of them is compared, its kept lanes moved to the front (AVX-512's
   compress, AVX2's permute by a table of the 256 masks) and stored whole, the count moving on by the
   number kept; a store writes at most up to ck[t + lanes], inside [0, n) since the count is never past t. */
#if defined(__AVX2__) && !defined(__AVX512F__)
static const uint8_t LEFTPACK[256][8] = {
    {0,0,0,0,0,0,0,0}, {0,0,0,0,0,0,0,0}, {1,0,0,0,0,0,0,0}, {0,1,0,0,0,0,0,0}, {2,0,0,0,0,0,0,0},
    {0,2,0,0,0,0,0,0}, {1,2,0,0,0,0,0,0}, {0,1,2,0,0,0,0,0}, {3,0,0,0,0,0,0,0}, {0,3,0,0,0,0,0,0},
    {1,3,0,0,0,0,0,0}, {0,1,3,0,0,0,0,0}, {2,3,0,0,0,0,0,0}, {0,2,3,0,0,0,0,0}, {1,2,3,0,0,0,0,0},
    {0,1,2,3,0,0,0,0}, {4,0,0,0,0,0,0,0}, {0,4,0,0,0,0,0,0}, {1,4,0,0,0,0,0,0}, {0,1,4,0,0,0,0,0},
    {2,4,0,0,0,0,0,0}, {0,2,4,0,0,0,0,0}, {1,2,4,0,0,0,0,0}, {0,1,2,4,0,0,0,0}, {3,4,0,0,0,0,0,0},
    {0,3,4,0,0,0,0,0}, {1,3,4,0,0,0,0,0}, {0,1,3,4,0,0,0,0}, {2,3,4,0,0,0,0,0}, {0,2,3,4,0,0,0,0},
    {1,2,3,4,0,0,0,0}, {0,1,2,3,4,0,0,0}, {5,0,0,0,0,0,0,0}, {0,5,0,0,0,0,0,0}, {1,5,0,0,0,0,0,0},
    {0,1,5,0,0,0,0,0}, {2,5,0,0,0,0,0,0}, {0,2,5,0,0,0,0,0}, {1,2,5,0,0,0,0,0}, {0,1,2,5,0,0,0,0},
    {3,5,0,0,0,0,0,0}, {0,3,5,0,0,0,0,0}, {1,3,5,0,0,0,0,0}, {0,1,3,5,0,0,0,0}, {2,3,5,0,0,0,0,0},
    {0,2,3,5,0,0,0,0}, {1,2,3,5,0,0,0,0}, {0,1,2,3,5,0,0,0}, {4,5,0,0,0,0,0,0}, {0,4,5,0,0,0,0,0},
    {1,4,5,0,0,0,0,0}, {0,1,4,5,0,0,0,0}, {2,4,5,0,0,0,0,0}, {0,2,4,5,0,0,0,0}, {1,2,4,5,0,0,0,0},
    {0,1,2,4,5,0,0,0}, {3,4,5,0,0,0,0,0}, {0,3,4,5,0,0,0,0}, {1,3,4,5,0,0,0,0}, {0,1,3,4,5,0,0,0},
    {2,3,4,5,0,0,0,0}, {0,2,3,4,5,0,0,0}, {1,2,3,4,5,0,0,0}, {0,1,2,3,4,5,0,0}, {6,0,0,0,0,0,0,0},
    {0,6,0,0,0,0,0,0}, {1,6,0,0,0,0,0,0}, {0,1,6,0,0,0,0,0}, {2,6,0,0,0,0,0,0}, {0,2,6,0,0,0,0,0},
    {1,2,6,0,0,0,0,0}, {0,1,2,6,0,0,0,0}, {3,6,0,0,0,0,0,0}, {0,3,6,0,0,0,0,0}, {1,3,6,0,0,0,0,0},
    {0,1,3,6,0,0,0,0}, {2,3,6,0,0,0,0,0}, {0,2,3,6,0,0,0,0}, {1,2,3,6,0,0,0,0}, {0,1,2,3,6,0,0,0},
    {4,6,0,0,0,0,0,0}, {0,4,6,0,0,0,0,0}, {1,4,6,0,0,0,0,0}, {0,1,4,6,0,0,0,0}, {2,4,6,0,0,0,0,0},
    {0,2,4,6,0,0,0,0}, {1,2,4,6,0,0,0,0}, {0,1,2,4,6,0,0,0}, {3,4,6,0,0,0,0,0}, {0,3,4,6,0,0,0,0},
    {1,3,4,6,0,0,0,0}, {0,1,3,4,6,0,0,0}, {2,3,4,6,0,0,0,0}, {0,2,3,4,6,0,0,0}, {1,2,3,4,6,0,0,0},
    {0,1,2,3,4,6,0,0}, {5,6,0,0,0,0,0,0}, {0,5,6,0,0,0,0,0}, {1,5,6,0,0,0,0,0}, {0,1,5,6,0,0,0,0},
    {2,5,6,0,0,0,0,0}, {0,2,5,6,0,0,0,0}, {1,2,5,6,0,0,0,0}, {0,1,2,5,6,0,0,0}, {3,5,6,0,0,0,0,0},
    {0,3,5,6,0,0,0,0}, {1,3,5,6,0,0,0,0}, {0,1,3,5,6,0,0,0}, {2,3,5,6,0,0,0,0}, {0,2,3,5,6,0,0,0},
    {1,2,3,5,6,0,0,0}, {0,1,2,3,5,6,0,0}, {4,5,6,0,0,0,0,0}, {0,4,5,6,0,0,0,0}, {1,4,5,6,0,0,0,0},
    {0,1,4,5,6,0,0,0}, {2,4,5,6,0,0,0,0}, {0,2,4,5,6,0,0,0}, {1,2,4,5,6,0,0,0}, {0,1,2,4,5,6,0,0},
    {3,4,5,6,0,0,0,0}, {0,3,4,5,6,0,0,0}, {1,3,4,5,6,0,0,0}, {0,1,3,4,5,6,0,0}, {2,3,4,5,6,0,0,0},
    {0,2,3,4,5,6,0,0}, {1,2,3,4,5,6,0,0}, {0,1,2,3,4,5,6,0}, {7,0,0,0,0,0,0,0}, {0,7,0,0,0,0,0,0},
    {1,7,0,0,0,0,0,0}, {0,1,7,0,0,0,0,0}, {2,7,0,0,0,0,0,0}, {0,2,7,0,0,0,0,0}, {1,2,7,0,0,0,0,0},
    {0,1,2,7,0,0,0,0}, {3,7,0,0,0,0,0,0}, {0,3,7,0,0,0,0,0}, {1,3,7,0,0,0,0,0}, {0,1,3,7,0,0,0,0},
    {2,3,7,0,0,0,0,0}, {0,2,3,7,0,0,0,0}, {1,2,3,7,0,0,0,0}, {0,1,2,3,7,0,0,0}, {4,7,0,0,0,0,0,0},
    {0,4,7,0,0,0,0,0}, {1,4,7,0,0,0,0,0}, {0,1,4,7,0,0,0,0}, {2,4,7,0,0,0,0,0}, {0,2,4,7,0,0,0,0},
    {1,2,4,7,0,0,0,0}, {0,1,2,4,7,0,0,0}, {3,4,7,0,0,0,0,0}, {0,3,4,7,0,0,0,0}, {1,3,4,7,0,0,0,0},
    {0,1,3,4,7,0,0,0}, {2,3,4,7,0,0,0,0}, {0,2,3,4,7,0,0,0}, {1,2,3,4,7,0,0,0}, {0,1,2,3,4,7,0,0},
    {5,7,0,0,0,0,0,0}, {0,5,7,0,0,0,0,0}, {1,5,7,0,0,0,0,0}, {0,1,5,7,0,0,0,0}, {2,5,7,0,0,0,0,0},
    {0,2,5,7,0,0,0,0}, {1,2,5,7,0,0,0,0}, {0,1,2,5,7,0,0,0}, {3,5,7,0,0,0,0,0}, {0,3,5,7,0,0,0,0},
    {1,3,5,7,0,0,0,0}, {0,1,3,5,7,0,0,0}, {2,3,5,7,0,0,0,0}, {0,2,3,5,7,0,0,0}, {1,2,3,5,7,0,0,0},
    {0,1,2,3,5,7,0,0}, {4,5,7,0,0,0,0,0}, {0,4,5,7,0,0,0,0}, {1,4,5,7,0,0,0,0}, {0,1,4,5,7,0,0,0},
    {2,4,5,7,0,0,0,0}, {0,2,4,5,7,0,0,0}, {1,2,4,5,7,0,0,0}, {0,1,2,4,5,7,0,0}, {3,4,5,7,0,0,0,0},
    {0,3,4,5,7,0,0,0}, {1,3,4,5,7,0,0,0}, {0,1,3,4,5,7,0,0}, {2,3,4,5,7,0,0,0}, {0,2,3,4,5,7,0,0},
    {1,2,3,4,5,7,0,0}, {0,1,2,3,4,5,7,0}, {6,7,0,0,0,0,0,0}, {0,6,7,0,0,0,0,0}, {1,6,7,0,0,0,0,0},
    {0,1,6,7,0,0,0,0}, {2,6,7,0,0,0,0,0}, {0,2,6,7,0,0,0,0}, {1,2,6,7,0,0,0,0}, {0,1,2,6,7,0,0,0},
    {3,6,7,0,0,0,0,0}, {0,3,6,7,0,0,0,0}, {1,3,6,7,0,0,0,0}, {0,1,3,6,7,0,0,0}, {2,3,6,7,0,0,0,0},
    {0,2,3,6,7,0,0,0}, {1,2,3,6,7,0,0,0}, {0,1,2,3,6,7,0,0}, {4,6,7,0,0,0,0,0}, {0,4,6,7,0,0,0,0},
    {1,4,6,7,0,0,0,0}, {0,1,4,6,7,0,0,0}, {2,4,6,7,0,0,0,0}, {0,2,4,6,7,0,0,0}, {1,2,4,6,7,0,0,0},
    {0,1,2,4,6,7,0,0}, {3,4,6,7,0,0,0,0}, {0,3,4,6,7,0,0,0}, {1,3,4,6,7,0,0,0}, {0,1,3,4,6,7,0,0},
    {2,3,4,6,7,0,0,0}, {0,2,3,4,6,7,0,0}, {1,2,3,4,6,7,0,0}, {0,1,2,3,4,6,7,0}, {5,6,7,0,0,0,0,0},
    {0,5,6,7,0,0,0,0}, {1,5,6,7,0,0,0,0}, {0,1,5,6,7,0,0,0}, {2,5,6,7,0,0,0,0}, {0,2,5,6,7,0,0,0},
    {1,2,5,6,7,0,0,0}, {0,1,2,5,6,7,0,0}, {3,5,6,7,0,0,0,0}, {0,3,5,6,7,0,0,0}, {1,3,5,6,7,0,0,0},
    {0,1,3,5,6,7,0,0}, {2,3,5,6,7,0,0,0}, {0,2,3,5,6,7,0,0}, {1,2,3,5,6,7,0,0}, {0,1,2,3,5,6,7,0},
    {4,5,6,7,0,0,0,0}, {0,4,5,6,7,0,0,0}, {1,4,5,6,7,0,0,0}, {0,1,4,5,6,7,0,0}, {2,4,5,6,7,0,0,0},
    {0,2,4,5,6,7,0,0}, {1,2,4,5,6,7,0,0}, {0,1,2,4,5,6,7,0}, {3,4,5,6,7,0,0,0}, {0,3,4,5,6,7,0,0},
    {1,3,4,5,6,7,0,0}, {0,1,3,4,5,6,7,0}, {2,3,4,5,6,7,0,0}, {0,2,3,4,5,6,7,0}, {1,2,3,4,5,6,7,0},
    {0,1,2,3,4,5,6,7}
};
#endif
static int64_t keep_at_least(const uint32_t *key, int64_t n, uint32_t thr, uint32_t *ck, uint32_t *cp) {
    int64_t m = 0, t = 0;
#if defined(__AVX512F__)
    const __m512i th = _mm512_set1_epi32((int)thr), step = _mm512_set1_epi32(16);
    __m512i pos = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; t + 16 <= n; t += 16) {
        const __m512i v = _mm512_loadu_si512((const void *)(key + t));
        const __mmask16 mk = _mm512_cmpge_epu32_mask(v, th);
        /* compressed in a register, then stored whole: AMD's Zen 4 runs the compress-to-memory form as
           microcode (about 3x slower for the whole selection, measured) */
        _mm512_storeu_si512((void *)(ck + m), _mm512_maskz_compress_epi32(mk, v));
        _mm512_storeu_si512((void *)(cp + m), _mm512_maskz_compress_epi32(mk, pos));
        m += __builtin_popcount((unsigned)mk);
        pos = _mm512_add_epi32(pos, step);
    }
#elif defined(__AVX2__)
    const __m256i sb = _mm256_set1_epi32((int)0x80000000u), th = _mm256_set1_epi32((int)(thr ^ 0x80000000u)),
                  step = _mm256_set1_epi32(8);
    __m256i pos = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (; t + 8 <= n; t += 8) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(key + t));
        /* unsigned v >= thr: not (thr > v) as signed, both with the top bit flipped */
        const __m256i below = _mm256_cmpgt_epi32(th, _mm256_xor_si256(v, sb));
        const unsigned mk = ~(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(below)) & 0xffu;
        const __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)LEFTPACK[mk]));
        _mm256_storeu_si256((__m256i *)(ck + m), _mm256_permutevar8x32_epi32(v, perm));
        _mm256_storeu_si256((__m256i *)(cp + m), _mm256_permutevar8x32_epi32(pos, perm));
        m += __builtin_popcount(mk);
        pos = _mm256_add_epi32(pos, step);
    }
#endif
    for (; t < n; t++) {
        ck[m] = key[t];
        cp[m] = (uint32_t)t;
        m += key[t] >= thr;
    }
    return m;
}

/* take_top for a few of many keys (2 k <= n): a threshold from 512 keys at a stride (the r-th largest of
   them, r a little above 512 k / n so that about 3 sd more than k keys pass it), then one vector pass keeps
   the keys at or above it with their positions (keep_at_least), and the exact radix select runs on those
   alone: the k largest of all n are among them whenever at least k passed. Returns how many it wrote, or -1
   where fewer than k passed (the caller runs take_top). scratch: 3 n. */
static int64_t take_top_sampled(const uint32_t *key, int64_t n, int64_t k, uint32_t *scratch, int64_t *o,
                                int64_t first) {
    enum { NS = 512 };
    uint32_t smp[NS], tmp[NS], thr;
    const double p = (double)k / (double)n;
    const int64_t r = (int64_t)ceil(NS * p + 3.0 * sqrt(NS * p * (1.0 - p))) + 2;
    int64_t eq;
    if (k <= 0 || 2 * k > n || r >= NS) return -1;
    for (int64_t i = 0; i < NS; i++) smp[i] = key[i * n / NS];
    top_cut_small(smp, NS, r, tmp, &thr, &eq);
    if (thr == 0) return -1;  /* every key passes */
    uint32_t *ck = scratch, *cp = scratch + n, *sub = scratch + 2 * n;
    const int64_t m = keep_at_least(key, n, thr, ck, cp);
    if (m < k) return -1;
    uint32_t cut = 0;
    eq = INT64_MAX;
    if (m > k) top_cut_small(ck, m, k, sub, &cut, &eq);
    /* no data-dependent branch (about a third of the keys are dropped, at random): every key writes a slot
       below k, and the count moves on where it is taken */
    int64_t j = 0;
    for (int64_t i = 0; i < m && j < k; i++) {
        const uint32_t x = ck[i];
        const int64_t e = x == cut, take = (x > cut) | (e & (eq > 0));
        eq -= e & take;
        o[j] = first + cp[i];
        j += take;
    }
    return j;
}

/* One (b, h) pair's critical channels: s_i = sum_g |q_{g,i}| * kabs_i, the n best (ties to the lower
   channel, NaN first as torch.sort ranks it) in ascending channel order at o. key: 2 D scratch. */
static void pair_channels(const float *qg, int64_t qs_h, const float *ka, int64_t G, int64_t D, int64_t n,
                          uint32_t *key, int64_t *o) {
    for (int64_t i = 0; i < D; i++) {
        float s = 0.f;
        for (int64_t g = 0; g < G; g++) s += fabsf(qg[g * qs_h + i]) * ka[i];
        key[i] = fkey(s, 0xFFFFFFFFu);
    }
    take_top(key, D, n, key + D, NULL, o, 0);
}

/* sum over rows of cos(a_r, b_r), rows (B, H) of D floats: torch's cosine_similarity (eps 1e-8). */
static double cos_sum(const float *a, int64_t as_b, int64_t as_h, const float *b, int64_t bs_b, int64_t bs_h,
                      int64_t B, int64_t H, int64_t D) {
    double total = 0.0;
    for (int64_t i = 0; i < B; i++)
        for (int64_t h = 0; h < H; h++) {
            const float *x = a + i * as_b + h * as_h, *y = b + i * bs_b + h * bs_h;
            double xy = 0.0, xx = 0.0, yy = 0.0;
            for (int64_t d = 0; d < D; d++) { xy += (double)x[d] * y[d]; xx += (double)x[d] * x[d]; yy += (double)y[d] * y[d]; }
            double den = sqrt(xx * yy);
            total += xy / (den > 1e-8 ? den : 1e-8);
        }
    return total;
}

/* One (b, h) pair's list, for a row whose first real position is f (0 without padding): the sinks
   [f, f + n_s), then the top k of the candidates [f + n_s, mid_end) by sum_j qs_j * kT[ch_j, t] (qs: the
   query group's sum; NaN as -inf; ties to the lower position) in position order (all candidates when they
   are at most k), then [mid_end, mid_end + n_r), then -1 up to `width` (a row with fewer candidates than
   the batch's widest). key (4 n) is scratch. The scores are made TILE candidates at a time (score_tile:
   the C channel rows read side by side, the tile's sums in L1) and turned into keys; a few of many
   (take_top_sampled) are cut from a sample's threshold, else the keys are counted for the first level of
   the radix select in the same pass. Returns -2 for a channel outside [0, D), -3 for a first position
   past the candidates. */
#define TILE 512
static int select_pair(const float *qg, int64_t qs_h, const void *kt, int64_t kt_bf16, int64_t ts_d,
                       const int64_t *cb, int64_t *o, uint32_t *key, int64_t G, int64_t C, int64_t D, int64_t f,
                       int64_t n_s, int64_t mid_end, int64_t k, int64_t n_r, int64_t width) {
    int64_t lo = f + n_s, n = mid_end - lo, j = 0;
    if (f < 0 || n < 0) return -3;
    for (int64_t t = 0; t < n_s; t++) o[j++] = f + t;
    uint32_t h0[2048];
    const int sampled = k > 0 && n >= 2048 && 2 * k <= n;  /* a few of many: take_top_sampled */
    if (n > k && k > 0) {
        for (int64_t c = 0; c < C; c++)
            if (cb[c] < 0 || cb[c] >= D) return -2;
        if (!sampled) memset(h0, 0, sizeof h0);  /* counted while the keys are made */
        const uint32_t neg = fkey(-INFINITY, 0);
        float sc[TILE], w[256];
        for (int64_t c = 0; c < C; c++) {
            w[c] = 0.f;
            for (int64_t g = 0; g < G; g++) w[c] += qg[g * qs_h + cb[c]];
        }
        for (int64_t t0 = 0; t0 < n; t0 += TILE) {
            const int64_t m = n - t0 < TILE ? n - t0 : TILE;
            if (kt_bf16) score_tile(kt, 1, cb, w, C, ts_d, lo + t0, m, sc);
            else score_tile(kt, 0, cb, w, C, ts_d, lo + t0, m, sc);
            uint32_t *kk = key + t0;
            for (int64_t t = 0; t < m; t++) kk[t] = fkey(sc[t], neg);  /* NaN as -inf */
            if (!sampled)
                for (int64_t t = 0; t < m; t++) h0[kk[t] >> 21]++;
        }
    }
    int64_t got = sampled ? take_top_sampled(key, n, k, key + n, o + j, lo) : -1;
    if (got < 0)  /* every candidate when they are at most k */
        got = take_top(key, n, k, key + n, sampled ? NULL : h0, o + j, lo);
    j += got;
    for (int64_t t = 0; t < n_r; t++) o[j++] = mid_end + t;
    while (j < width) o[j++] = -1;
    return 0;
}

typedef struct {
    const float *q, *qc, *kabs;
    const void *kT;
    const int64_t *ch, *first;
    int64_t *out, *ch_out;
    int64_t kt_bf16, qs_b, qs_h, ts_b, ts_h, ts_d, cs_b, cs_h, os_b, os_h, H, G, C, D, n_s, mid_end, k, n_r, width, lo, hi;
    int64_t qc_b, qc_h, a_b, a_h, co_b, co_h;
    int rc;
} select_job;

static int run_select(void *arg) {
    select_job *j = (select_job *)arg;
    int64_t n = j->mid_end - j->n_s;
    size_t m = (size_t)(n > 0 ? n : 1);
    uint32_t *key = (uint32_t *)malloc(sizeof(uint32_t) * 4 * m);
    j->rc = key ? 0 : -1;
    for (int64_t p = j->lo; p < j->hi && !j->rc; p++) {
        int64_t b = p / j->H, h = p % j->H;
        const int64_t off = b * j->ts_b + h * j->ts_h;
        const void *kt = j->kt_bf16 ? (const void *)((const uint16_t *)j->kT + off)
                                    : (const void *)((const float *)j->kT + off);
        int64_t chs[256];
        uint32_t ck[512];
        const int64_t *cb = chs;
        if (j->ch) {
            cb = j->ch + b * j->cs_b + h * j->cs_h;
        } else {  /* this pair's channels from qc and kabs (the prefetch's pick, made here) */
            pair_channels(j->qc + b * j->qc_b + h * j->G * j->qc_h, j->qc_h, j->kabs + b * j->a_b + h * j->a_h,
                          j->G, j->D, j->C, ck, chs);
            if (j->ch_out) memcpy(j->ch_out + b * j->co_b + h * j->co_h, chs, sizeof(int64_t) * (size_t)j->C);
        }
        j->rc = select_pair(j->q + b * j->qs_b + h * j->G * j->qs_h, j->qs_h, kt, j->kt_bf16, j->ts_d, cb, j->out + b * j->os_b + h * j->os_h,
                            key, j->G, j->C, j->D, j->first ? j->first[b] : 0, j->n_s, j->mid_end, j->k,
                            j->n_r, j->width);
    }
    free(key);
    return j->rc;
}

#define MAX_THREADS 64
typedef int (*job_fn)(void *);
#ifndef _OPENMP
typedef struct { job_fn fn; void *job; int rc; } thread_arg;
static void *thread_main(void *arg) {
    thread_arg *a = (thread_arg *)arg;
    a->rc = a->fn(a->job);
    return 0;
}
#endif
/* fn on each of t jobs, `size` bytes apart from `jobs`: on torch's OpenMP pool where the library is built
   with it (kvpass.kernels.native: warm threads, no second pool spinning against torch's), else on t - 1
   threads started here and the caller's; returns the first nonzero result, 0 when all are 0 */
static int run_jobs(job_fn fn, void *jobs, size_t size, int64_t t) {
    int rc[MAX_THREADS] = {0};
#ifdef _OPENMP
    #pragma omp parallel for num_threads(t) schedule(static, 1)
    for (int64_t i = 0; i < t; i++) rc[i] = fn((char *)jobs + i * size);
#else
    pthread_t tid[MAX_THREADS];
    thread_arg arg[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t i = 1; i < t; i++) {
        arg[i] = (thread_arg){fn, (char *)jobs + i * size, 0};
        started[i] = pthread_create(&tid[i], 0, thread_main, &arg[i]) == 0;
    }
    for (int64_t i = 1; i < t; i++)
        if (!started[i]) arg[i].rc = fn(arg[i].job);  /* no thread to be had: its share here */
    rc[0] = fn(jobs);
    for (int64_t i = 1; i < t; i++) {
        if (started[i]) pthread_join(tid[i], 0);
        rc[i] = arg[i].rc;
    }
#endif
    for (int64_t i = 0; i < t; i++)
        if (rc[i]) return rc[i];
    return 0;
}
/* kT (B, H, D, S) channel-major, fp32, or bfloat16 with kt_bf16 (strides in elements), ch (B, H, C), first (B) or NULL: each row's first real position (a
   left-padded batch), out (B, H, n_s + min(k, mid_end - n_s) + n_r); the pairs split over up to `threads`
   threads when each gets at least 4k candidates (16k where each call starts its own threads).
   ch NULL: each pair's C channels are picked here from qc (B, H * G, D) and kabs (B, H, D) (the prefetch's
   critical channels, D <= 256), and written to ch_out (B, H, C) unless it is NULL. cos not NULL: adds the
   mean over the B * H * G rows of cos(qc, q) to *cos (the estimate's similarity, one serial pass).
   Returns 0, -1 (no memory), -2 (a channel outside [0, D)), -3 (a first position past mid_end - n_s),
   -4 (more than 256 channels, or channels to pick with D > 256). */
static int tailor_select(const float *q, int64_t qs_b, int64_t qs_h,
                         const void *kT, int64_t kt_bf16, int64_t ts_b, int64_t ts_h, int64_t ts_d,
                         const int64_t *ch, int64_t cs_b, int64_t cs_h, const int64_t *first,
                         int64_t *out, int64_t os_b, int64_t os_h,
                         int64_t B, int64_t H, int64_t G, int64_t C, int64_t D,
                         int64_t n_s, int64_t mid_end, int64_t k, int64_t n_r, int64_t threads,
                         const float *qc, int64_t qc_b, int64_t qc_h, const float *kabs, int64_t a_b, int64_t a_h,
                         int64_t *ch_out, int64_t co_b, int64_t co_h, double *cos) {
    int64_t pairs = B * H, n = mid_end - n_s;
    if (C > 256 || (!ch && (D > 256 || C > D))) return -4;
    if (cos && B * H * G > 0) *cos += cos_sum(qc, qc_b, qc_h, q, qs_b, qs_h, B, H * G, D) / (double)(B * H * G);
    int64_t t = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (t > pairs) t = pairs;
#ifdef _OPENMP
    if (n <= k || pairs * n < 4096 * t) t = 1;  /* torch's warm pool: a parallel region costs microseconds */
#else
    if (n <= k || pairs * n < 16384 * t) t = 1;  /* starting a thread costs more than it saves */
#endif
    int64_t width = n_s + (n < k ? (n > 0 ? n : 0) : k) + n_r;
    select_job jobs[MAX_THREADS];
    for (int64_t i = 0; i < t; i++) {
        select_job j = {q, qc, kabs, kT, ch, first, out, ch_out, kt_bf16, qs_b, qs_h, ts_b, ts_h, ts_d, cs_b, cs_h,
                        os_b, os_h, H, G, C, D, n_s, mid_end, k, n_r, width, pairs * i / t, pairs * (i + 1) / t,
                        qc_b, qc_h, a_b, a_h, co_b, co_h, 0};
        jobs[i] = j;
    }
    return run_jobs(run_select, jobs, sizeof jobs[0], t);
}

/* fp16 -> fp32 (GCC's _Float16 on x86-64) */
static inline float h2f(const uint16_t *p) { _Float16 h; memcpy(&h, p, sizeof h); return (float)h; }

/* One (b, h) pair of quant_decode_attention's operands, at the pair's first element */
typedef struct {
    const float *q; int64_t qs_h;
    const uint8_t *kp; int64_t kp_s;
    const uint16_t *ks, *kz; int64_t km_s;
    const uint8_t *vp; int64_t vp_s;
    const uint16_t *vs, *vz; int64_t vm_s;
    const float *kr; int64_t kr_s;
    const float *vr; int64_t vr_s;
    float *out; int64_t os_h;
} qpair;

/* One (b, h) pair of quant_decode_attention in scalar loops (quant_pair_body where it cannot serve): G queries
   over S quantised tokens (keys per channel in groups of gk tokens, values per token in groups of gv channels;
   bk/bv bits wide) and R full-precision ones. sc: G * (S + R) floats of scratch. */
static void quant_pair_scalar(const qpair *a, float *sc, const float (*lut)[8], int64_t G, int64_t S, int64_t R,
                              int64_t D, int64_t bk, int64_t bv, int64_t gk, int64_t gv, float scale) {
    const int64_t pk = 8 / bk, pv = 8 / bv, N = S + R;
    const uint32_t mk = (1u << bk) - 1;
    float w[16][256], base[16], m[16], l[16], sv[256], zv[256], code[256], row[256];
    for (int64_t g = 0; g < G; g++) m[g] = -INFINITY;
    for (int64_t j = 0; j < S / gk; j++) {
        const uint16_t *s16 = a->ks + j * a->km_s, *z16 = a->kz + j * a->km_s;
        for (int64_t d = 0; d < D; d++) { sv[d] = h2f(s16 + d); zv[d] = h2f(z16 + d); }
        for (int64_t g = 0; g < G; g++) {
            const float *qg = a->q + g * a->qs_h;
            float b = 0.f;
            for (int64_t d = 0; d < D; d++) { b += qg[d] * zv[d]; w[g][d] = qg[d] * sv[d]; }
            base[g] = b;
        }
        for (int64_t t = j * gk; t < (j + 1) * gk; t++) {
            const uint8_t *byte = a->kp + (t / pk) * a->kp_s;
            const int sh = (int)((t % pk) * bk);
            for (int64_t d = 0; d < D; d++) code[d] = (float)((byte[d] >> sh) & mk);
            for (int64_t g = 0; g < G; g++) {
                float x = (base[g] + dot(w[g], code, D)) * scale;
                sc[g * N + t] = x;
                if (x > m[g]) m[g] = x;
            }
        }
    }
    for (int64_t t = 0; t < R; t++) {
        const float *kr = a->kr + t * a->kr_s;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = a->q + g * a->qs_h;
            float x = 0.f;
            for (int64_t d = 0; d < D; d++) x += qg[d] * kr[d];
            x *= scale;
            sc[g * N + S + t] = x;
            if (x > m[g]) m[g] = x;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float tot = 0.f, *p = sc + g * N;
        for (int64_t t = 0; t < N; t++) { p[t] = expf(p[t] - m[g]); tot += p[t]; }
        l[g] = tot;
    }
    float acc[16][256];
    for (int64_t g = 0; g < G; g++) for (int64_t d = 0; d < D; d++) acc[g][d] = 0.f;
    for (int64_t t = 0; t < S; t++) {
        const uint8_t *byte = a->vp + t * a->vp_s;
        const uint16_t *s16 = a->vs + t * a->vm_s, *z16 = a->vz + t * a->vm_s;
        for (int64_t i = 0; i < D / pv; i++) memcpy(code + i * pv, lut[byte[i]], sizeof(float) * (size_t)pv);
        for (int64_t c = 0; c < D / gv; c++) {
            float sc_ = h2f(s16 + c), z = h2f(z16 + c);
            for (int64_t d = c * gv; d < (c + 1) * gv; d++) row[d] = z + code[d] * sc_;
        }
        for (int64_t g = 0; g < G; g++) {
            float p = sc[g * N + t];
            for (int64_t d = 0; d < D; d++) acc[g][d] += p * row[d];
        }
    }
    for (int64_t t = 0; t < R; t++) {
        const float *vr = a->vr + t * a->vr_s;
        for (int64_t g = 0; g < G; g++) {
            float p = sc[g * N + S + t];
            for (int64_t d = 0; d < D; d++) acc[g][d] += p * vr[d];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = 1.f / l[g], *o = a->out + g * a->os_h;
        for (int64_t d = 0; d < D; d++) o[d] = acc[g][d] * inv;
    }
}

typedef uint32_t vu __attribute__((vector_size(4 * VW)));
typedef uint8_t vb __attribute__((vector_size(VW)));
typedef uint16_t vh __attribute__((vector_size(2 * VW)));
typedef _Float16 vhf __attribute__((vector_size(2 * VW)));

/* VW fp16 values as floats */
static inline vf halves(const uint16_t *p) {
    vhf x;
    memcpy(&x, p, sizeof x);
    return __builtin_convertvector(x, vf);
}

/* VW key codes of one token: channels [c0, c0 + VW) of a packed key row (a byte a channel), shifted by sh */
static inline vf key_codes(const uint8_t *row, int sh, uint32_t mask) {
    vb x;
    memcpy(&x, row, sizeof x);
    vh y = __builtin_convertvector(x, vh);  /* via 16 bits: GCC 12 widens bytes to 32 bits a lane at a time */
    return __builtin_convertvector((__builtin_convertvector(y, vu) >> (uint32_t)sh) & mask, vf);
}

/* VW value codes of one token: lane j is (x >> j * bits) & mask, x the chunk's VW * bits bits */
static inline vf value_codes(uint32_t x, uint32_t mask, vu lanes) {
    return __builtin_convertvector(((vu){0} + x) >> lanes & mask, vf);
}

/* One (b, h) pair of quant_decode_attention: G queries over S quantised tokens (keys per channel in groups
   of gk tokens, values per token in groups of gv channels; bits_k/bits_v wide) and R full-precision ones.
   A key is zero + code * scale, so q . k = q . zero + (q * scale) . code per key group: the codes are
   unpacked in registers, never written out, VW channels at a time, and four tokens' sums are folded
   together (a horizontal sum per token and query cost more than its products). sc: G * (S + R) floats of
   scratch. */
static inline __attribute__((always_inline)) void quant_pair_body(
        const qpair *a, float *sc, int64_t G, int64_t S, int64_t R, int64_t D, int64_t bk, int64_t bv, int64_t gk,
        int64_t gv, float scale) {
    const int64_t N = S + R, DV = D / VW, pk_shift = bk == 1 ? 3 : 2;  /* 8 / bk tokens a key byte */
    const uint32_t mk = (1u << bk) - 1, mv = (1u << bv) - 1;
    float w[16 * 256], base[16], m[16], l[16];
    for (int64_t j = 0; j < S / gk; j++) {  /* pass 1: scores of the quantised keys, group by group */
        const uint16_t *s16 = a->ks + j * a->km_s, *z16 = a->kz + j * a->km_s;
        for (int64_t g = 0; g < G; g++) {  /* w = q * scale * s and base = q . z * scale, a group's own */
            const float *qg = a->q + g * a->qs_h;
            vf b = (vf){0};
            for (int64_t c = 0; c < DV; c++) {
                vf qv = loadv(qg + VW * c);
                storev(w + g * D + VW * c, qv * halves(s16 + VW * c) * scale);
                b += qv * halves(z16 + VW * c);
            }
            base[g] = hsumv(b) * scale;
        }
        for (int64_t t0 = j * gk; t0 < (j + 1) * gk; t0 += 4) {
            v4 part[16][4];
            for (int64_t r = 0; r < 4; r++) {
                const int64_t t = t0 + r;
                const uint8_t *row = a->kp + (t >> pk_shift) * a->kp_s;
                const int sh = (int)((t & ((1 << pk_shift) - 1)) * bk);
                vf acc[16];
                vf x = key_codes(row, sh, mk);
                for (int64_t g = 0; g < G; g++) acc[g] = loadv(w + g * D) * x;
                for (int64_t c = 1; c < DV; c++) {
                    x = key_codes(row + VW * c, sh, mk);
                    for (int64_t g = 0; g < G; g++) acc[g] += loadv(w + g * D + VW * c) * x;
                }
                for (int64_t g = 0; g < G; g++) part[g][r] = fold4(acc[g]);
            }
            for (int64_t g = 0; g < G; g++) {
                v4 u0 = __builtin_shufflevector(part[g][0], part[g][1], 0, 4, 1, 5)
                      + __builtin_shufflevector(part[g][0], part[g][1], 2, 6, 3, 7);
                v4 u1 = __builtin_shufflevector(part[g][2], part[g][3], 0, 4, 1, 5)
                      + __builtin_shufflevector(part[g][2], part[g][3], 2, 6, 3, 7);
                v4 s4 = __builtin_shufflevector(u0, u1, 0, 1, 4, 5) + __builtin_shufflevector(u0, u1, 2, 3, 6, 7)
                      + base[g];
                memcpy(sc + g * N + t0, &s4, sizeof s4);
            }
        }
    }
    for (int64_t t = 0; t < R; t++) {  /* the residual's full-precision keys */
        const float *kr = a->kr + t * a->kr_s;
        for (int64_t g = 0; g < G; g++) sc[g * N + S + t] = dot(a->q + g * a->qs_h, kr, D) * scale;
    }
    for (int64_t g = 0; g < G; g++) {
        m[g] = max_of(sc + g * N, N);
        l[g] = exp_sum(sc + g * N, N, m[g]);
    }
    vf acc[16 * (256 / VW)];  /* G <= 16 queries, D <= 256 channels */
    for (int64_t i = 0; i < G * DV; i++) acc[i] = (vf){0};
    vu lanes;
    for (int64_t i = 0; i < VW; i++) lanes[i] = (uint32_t)(i * bv);
    const int64_t cw = VW * bv;  /* a chunk's bits */
    for (int64_t t = 0; t < S; t++) {  /* pass 2: values rebuilt a token at a time, in registers */
        const uint8_t *row = a->vp + t * a->vp_s;
        const uint16_t *s16 = a->vs + t * a->vm_s, *z16 = a->vz + t * a->vm_s;
        vf s[256 / VW], z[256 / VW];
        if (gv % VW == 0) {
            for (int64_t c = 0; c < DV; c++) { s[c] = (vf){0} + h2f(s16 + c * VW / gv); z[c] = (vf){0} + h2f(z16 + c * VW / gv); }
        } else {
            for (int64_t c = 0; c < DV; c++)
                for (int64_t i = 0; i < VW; i++) { s[c][i] = h2f(s16 + (c * VW + i) / gv); z[c][i] = h2f(z16 + (c * VW + i) / gv); }
        }
        for (int64_t c = 0; c < DV; c++) {
            uint32_t x;  /* the chunk's bits: 16 or 32, whole bytes */
            if (cw == 16) { uint16_t u; memcpy(&u, row + c * 2, 2); x = u; }
            else memcpy(&x, row + c * 4, 4);
            vf v = z[c] + value_codes(x, mv, lanes) * s[c];
            for (int64_t g = 0; g < G; g++) acc[g * DV + c] += sc[g * N + t] * v;
        }
    }
    for (int64_t t = 0; t < R; t++) {
        const float *vr = a->vr + t * a->vr_s;
        for (int64_t c = 0; c < DV; c++) {
            vf x = loadv(vr + VW * c);
            for (int64_t g = 0; g < G; g++) acc[g * DV + c] += sc[g * N + S + t] * x;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = 1.f / l[g];
        for (int64_t c = 0; c < DV; c++) storev(a->out + g * a->os_h + VW * c, acc[g * DV + c] * inv);
    }
}

static void quant_pair_3_64(const qpair *a, float *sc, int64_t G, int64_t S, int64_t R, int64_t D, int64_t bk,
                            int64_t bv, int64_t gk, int64_t gv, float scale) {
    (void)G; (void)D;
    quant_pair_body(a, sc, 3, S, R, 64, bk, bv, gk, gv, scale);
}
static void quant_pair_any(const qpair *a, float *sc, int64_t G, int64_t S, int64_t R, int64_t D, int64_t bk,
                           int64_t bv, int64_t gk, int64_t gv, float scale) {
    quant_pair_body(a, sc, G, S, R, D, bk, bv, gk, gv, scale);
}

typedef struct {
    const float *q; int64_t qs_b, qs_h;
    const uint8_t *kp; int64_t kp_b, kp_h, kp_s;
    const uint16_t *ks, *kz; int64_t km_b, km_h, km_s;
    const uint8_t *vp; int64_t vp_b, vp_h, vp_s;
    const uint16_t *vs, *vz; int64_t vm_b, vm_h, vm_s;
    const float *kr; int64_t kr_b, kr_h, kr_s;
    const float *vr; int64_t vr_b, vr_h, vr_s;
    float *out; int64_t os_b, os_h;
    int64_t H, G, S, R, D, bk, bv, gk, gv, lo, hi;
    const float (*lut)[8];
    float scale;
    int rc;
} qjob;

static int run_quant(void *arg) {
    qjob *j = (qjob *)arg;
    float *sc = (float *)malloc(sizeof(float) * (size_t)(j->G * (j->S + j->R) > 0 ? j->G * (j->S + j->R) : 1));
    j->rc = sc ? 0 : -1;
    /* the vector path: whole vectors of channels, key groups of whole 4-token blocks, and a value chunk's codes
       in 16 or 32 bits */
    const int vec = j->D % VW == 0 && j->gk % 4 == 0 && (VW * j->bv == 16 || VW * j->bv == 32);
    for (int64_t p = j->lo; p < j->hi && !j->rc; p++) {
        const int64_t b = p / j->H, h = p % j->H;
        qpair a = {j->q + b * j->qs_b + h * j->G * j->qs_h, j->qs_h,
                   j->kp + b * j->kp_b + h * j->kp_h, j->kp_s,
                   j->ks + b * j->km_b + h * j->km_h, j->kz + b * j->km_b + h * j->km_h, j->km_s,
                   j->vp + b * j->vp_b + h * j->vp_h, j->vp_s,
                   j->vs + b * j->vm_b + h * j->vm_h, j->vz + b * j->vm_b + h * j->vm_h, j->vm_s,
                   j->kr + b * j->kr_b + h * j->kr_h, j->kr_s,
                   j->vr + b * j->vr_b + h * j->vr_h, j->vr_s,
                   j->out + b * j->os_b + h * j->G * j->os_h, j->os_h};
        if (!vec) quant_pair_scalar(&a, sc, j->lut, j->G, j->S, j->R, j->D, j->bk, j->bv, j->gk, j->gv, j->scale);
        else if (j->G == 3 && j->D == 64) quant_pair_3_64(&a, sc, 3, j->S, j->R, 64, j->bk, j->bv, j->gk, j->gv, j->scale);
        else quant_pair_any(&a, sc, j->G, j->S, j->R, j->D, j->bk, j->bv, j->gk, j->gv, j->scale);
    }
    free(sc);
    return j->rc;
}

/* quant_decode_attention on CPU: q (B, H*G, D); kp (B, H, S/pk, D) uint8, ks/kz (B, H, S/gk, D) fp16;
   vp (B, H, S, D/pv) uint8, vs/vz (B, H, S, D/gv) fp16; kr/vr (B, H, R, D) fp32; out (B, H*G, D).
   Strides (b, h, row) per operand, last dims contiguous. The (b, h) pairs are split over up to `threads`
   threads. Returns 0, -1 (no memory), -2 (G > 16 or D > 256). */
static int quant_attention(const float *q, int64_t qs_b, int64_t qs_h,
                           const uint8_t *kp, int64_t kp_b, int64_t kp_h, int64_t kp_s,
                           const uint16_t *ks, const uint16_t *kz, int64_t km_b, int64_t km_h, int64_t km_s,
                           const uint8_t *vp, int64_t vp_b, int64_t vp_h, int64_t vp_s,
                           const uint16_t *vs, const uint16_t *vz, int64_t vm_b, int64_t vm_h, int64_t vm_s,
                           const float *kr, int64_t kr_b, int64_t kr_h, int64_t kr_s,
                           const float *vr, int64_t vr_b, int64_t vr_h, int64_t vr_s,
                           float *out, int64_t os_b, int64_t os_h,
                           int64_t B, int64_t H, int64_t G, int64_t S, int64_t R, int64_t D,
                           int64_t bk, int64_t bv, int64_t gk, int64_t gv, float scale, int64_t threads) {
    if (G > 16 || D > 256) return -2;
    float lut[256][8];  /* the codes of a value byte, as floats (the scalar loops) */
    for (int64_t x = 0; x < 256; x++)
        for (int64_t i = 0; i < 8 / bv; i++) lut[x][i] = (float)((x >> (i * bv)) & ((1 << bv) - 1));
    const int64_t pairs = B * H;
    int64_t t = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (t > pairs) t = pairs;
#ifdef _OPENMP
    if (pairs * (S + R) < 4096 * t) t = 1;  /* torch's warm pool: a parallel region costs microseconds */
#else
    if (pairs * (S + R) < 16384 * t) t = 1;  /* starting a thread costs more than it saves */
#endif
    qjob jobs[MAX_THREADS];
    for (int64_t i = 0; i < t; i++) {
        qjob j = {q, qs_b, qs_h, kp, kp_b, kp_h, kp_s, ks, kz, km_b, km_h, km_s, vp, vp_b, vp_h, vp_s,
                  vs, vz, vm_b, vm_h, vm_s, kr, kr_b, kr_h, kr_s, vr, vr_b, vr_h, vr_s, out, os_b, os_h,
                  H, G, S, R, D, bk, bv, gk, gv, pairs * i / t, pairs * (i + 1) / t,
                  (const float (*)[8])lut, scale, 0};
        jobs[i] = j;
    }
    return run_jobs(run_quant, jobs, sizeof jobs[0], t);
}

/* kvpass_quant_args: quant_attention's arguments in one struct (kvpass.h) */
int kvpass_quant_attention(const kvpass_quant_args *a) {
    return quant_attention(a->q, a->qs_b, a->qs_h, a->kp, a->kp_b, a->kp_h, a->kp_s, a->ks, a->kz, a->km_b, a->km_h,
                           a->km_s, a->vp, a->vp_b, a->vp_h, a->vp_s, a->vs, a->vz, a->vm_b, a->vm_h, a->vm_s, a->kr,
                           a->kr_b, a->kr_h, a->kr_s, a->vr, a->vr_b, a->vr_h, a->vr_s, a->out, a->os_b, a->os_h, a->B,
                           a->H, a->G, a->S, a->R, a->D, a->bk, a->bv, a->gk, a->gv, a->scale, a->threads);
}

/* fp32 -> bfloat16 bits, rounded to nearest even (torch's conversion); NaN -> a quiet NaN */
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* A sparse layer's decode append in one call instead of five ops: the T new rows of kn, vn (B, H, T, D)
   into k, v (B, H, cap, D) at [at, at + T), the keys into the channel-major kt (B, H, D, cap; bfloat16
   when kt_bf16, else fp32) and kabs (B, H, D) = max(kabs, |kn|) over the new rows (NaN spreads, as
   torch.maximum). kn_d, vn_d: the new rows' element strides (a batched step's weight-major linear gives
   V, and K where no RoPE copied it, transposed: read in place, not copied first). */
static int tailor_append(const float *kn, int64_t kn_b, int64_t kn_h, int64_t kn_t,
                         const float *vn, int64_t vn_b, int64_t vn_h, int64_t vn_t,
                         float *k, int64_t k_b, int64_t k_h, int64_t k_s,
                         float *v, int64_t v_b, int64_t v_h, int64_t v_s,
                         void *kt, int64_t kt_bf16, int64_t t_b, int64_t t_h, int64_t t_d,
                         float *kabs, int64_t a_b, int64_t a_h,
                         int64_t B, int64_t H, int64_t T, int64_t D, int64_t at, int64_t kn_d, int64_t vn_d) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            float *ka = kabs + b * a_b + h * a_h;
            for (int64_t t = 0; t < T; t++) {
                const float *kr = kn + b * kn_b + h * kn_h + t * kn_t, *vr = vn + b * vn_b + h * vn_h + t * vn_t;
                float *kd = k + b * k_b + h * k_h + (at + t) * k_s, *vd = v + b * v_b + h * v_h + (at + t) * v_s;
                if (vn_d == 1) memcpy(vd, vr, sizeof(float) * D);
                else for (int64_t d = 0; d < D; d++) vd[d] = vr[d * vn_d];
                for (int64_t d = 0; d < D; d++) {
                    const float kx = kr[d * kn_d];
                    const int64_t o = b * t_b + h * t_h + d * t_d + at + t;
                    kd[d] = kx;
                    if (kt_bf16) ((uint16_t *)kt)[o] = f2bf(kx);
                    else ((float *)kt)[o] = kx;
                    const float x = fabsf(kx), m = ka[d];
                    ka[d] = (x != x || m != m) ? NAN : (x > m ? x : m);
                }
            }
        }
    return 0;
}

/* The arguments of tailor_select and tailor_append in one struct each (kvpass.h), filled once by
   kvpass.kernels.tailorkv.CpuStep: a ctypes call converts each argument it passes (about 0.2 us each), and a
   layer's step sets only the few that change. */
int kvpass_tailor_select(const kvpass_tailor_select_args *a) {
    return tailor_select(a->q, a->qs_b, a->qs_h, a->kT, a->kt_bf16, a->ts_b, a->ts_h, a->ts_d, a->ch, a->cs_b,
                         a->cs_h, a->first, a->out, a->os_b, a->os_h, a->B, a->H, a->G, a->C, a->D, a->n_s,
                         a->mid_end, a->k, a->n_r, a->threads, a->qc, a->qc_b, a->qc_h, a->kabs, a->a_b, a->a_h,
                         a->ch_out, a->co_b, a->co_h, a->cos);
}
int kvpass_tailor_append(const kvpass_tailor_append_args *a) {
    return tailor_append(a->kn, a->kn_b, a->kn_h, a->kn_t, a->vn, a->vn_b, a->vn_h, a->vn_t, a->k, a->k_b, a->k_h,
                         a->k_s, a->v, a->v_b, a->v_h, a->v_s, a->kt, a->kt_bf16, a->t_b, a->t_h, a->t_d, a->kabs,
                         a->a_b, a->a_h, a->B, a->H, a->T, a->D, a->at, a->kn_d, a->vn_d);
}

/* A sparse layer's whole CPU decode step in one call (three from Python cost tens of microseconds a site,
   at 30 sites a step): the selection, the append of the step's token (its key is one of the recent tokens
   the list ends with, never a candidate, so the channels and candidates are those of separate calls), then
   the decode attention over the list (select.out: (B, H, N) positions) in the first S rows of k, v
   (cpu_decode.c). Returns the selection's codes, or -1 where the attention's scratch cannot be had. */
int kvpass_tailor_step(const kvpass_tailor_step_args *a) {
    const kvpass_tailor_select_args *s = &a->select;
    int rc = kvpass_tailor_select(s);
    if (rc) return rc;
    kvpass_tailor_append(&a->append);
    return attend_listed(&a->attend, s->q, s->qs_b, s->qs_h, s->out, s->os_b, s->os_h, s->B, s->H, s->G, a->S, a->N,
                         s->D) ? -1 : 0;
}
