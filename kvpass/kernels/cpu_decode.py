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

import torch

from .native import VECTOR16

__all__ = ["available", "cpu_decode_attention", "cpu_decode_attention_ref"]

_SOURCE = r"""
#include <float.h>
#include <pthread.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
""" + VECTOR16 + r"""
static inline void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }
typedef int32_t i16 __attribute__((vector_size(64)));

/* m ? a : b, lane by lane (C has no vector ?:) */
static inline v16 sel(i16 m, v16 a, v16 b) {
    i16 ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    ia = (m & ia) | (~m & ib);
    memcpy(&a, &ia, sizeof a);
    return a;
}

/* exp(x) for x <= 0, 16 at a time (Cephes' expf: x = g + n ln2, |g| <= ln2 / 2, a polynomial in g,
   times 2^n; relative error about 1e-7); below -87 the result is 0. */
static inline v16 exp16(v16 x) {
    const v16 lo = (v16){0} - 87.f;
    i16 under = x < lo;
    x = sel(under, lo, x);
    v16 t = x * 1.44269504088896341f + 0.5f;
    v16 n = __builtin_convertvector(__builtin_convertvector(t, i16), v16);  /* truncates toward 0 */
    n = sel(n > t, n - 1.f, n);  /* floor(x log2 e + 1/2): the nearest integer */
    v16 g = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 z = g * g;
    v16 y = 1.9875691500e-4f * g + 1.3981999507e-3f;
    y = y * g + 8.3334519073e-3f;
    y = y * g + 4.1665795894e-2f;
    y = y * g + 1.6666665459e-1f;
    y = y * g + 5.0000001201e-1f;
    y = y * z + g + 1.f;
    i16 e = (__builtin_convertvector(n, i16) + 127) << 23;
    v16 p2;
    memcpy(&p2, &e, sizeof p2);
    y = y * p2;
    return sel(under, (v16){0}, y);
}

/* exp of n values <= 0, in place */
static void exp_inplace(float *restrict x, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store16(x + i, exp16(load16(x + i)));
    if (i < n) {
        float tail[16] = {0};
        memcpy(tail, x + i, sizeof(float) * (n - i));
        store16(tail, exp16(load16(tail)));
        memcpy(x + i, tail, sizeof(float) * (n - i));
    }
}

/* rows prefetched ahead: listed rows are scattered (clusters, pages), so the hardware cannot guess them */
#define AHEAD 16
/* rows of work (listed rows x pairs) below which a call runs on one thread */
#ifdef _OPENMP
#define MIN_ROWS_PER_THREAD 1024  /* torch's warm pool: a parallel region costs microseconds */
#else
#define MIN_ROWS_PER_THREAD 8192  /* a thread started per call costs tens of microseconds */
#endif
static inline void prefetch_row(const float *r, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)r + o, 0, 0);
}
static inline void prefetch_row_l2(const float *r, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)r + o, 0, 2);
}

/* One (batch row, KV head) pair: G queries over N listed rows of k, v, plus bias[pos] when bias is not
   NULL (a bias of -inf skips the row, as a position outside [0, S) is skipped). sc is G*N floats of
   scratch, rows N int64. */
static void pair(const float *restrict q, int64_t qs_h, const float *restrict k, int64_t ks_s,
                 const float *restrict v, int64_t vs_s, const int64_t *restrict idx, int64_t is_n,
                 const float *restrict bias, int64_t bs_s, float *restrict out, int64_t os_h,
                 float *restrict sc, int64_t *restrict rows, int64_t G, int64_t S, int64_t N, int64_t D,
                 float scale) {
    float m[16], l[16];
    const int64_t DV = D / 16, vec = (D % 16 == 0) && D <= 256;
    v16 qv[16][16];  /* the group's queries, pre-scaled, when D is a multiple of 16 (<= 256) */
    for (int64_t g = 0; g < G; g++) {
        m[g] = -FLT_MAX;
        l[g] = 0.f;
        if (vec) for (int64_t c = 0; c < DV; c++) qv[g][c] = load16(q + g * qs_h + 16 * c) * scale;
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
    if (!valid) return;
    /* listed rows whose V rows fit in half of a 1 MB L2: pass 1 also prefetches the V row into L2, so that
       pass 2 reads it from there (two rows in flight per row scored; the hardware cannot guess either) */
    const int v_ahead = idx && N * D * 4 <= (1 << 19);
    /* pass 1: scores, laid out g-major (sc[g * N + n]) so that the exp runs over one array */
    for (int64_t n = 0; n < N; n++) {
        int64_t pos = rows[n];
        if (pos < 0) { for (int64_t g = 0; g < G; g++) sc[g * N + n] = -FLT_MAX; continue; }
        if (n + AHEAD < N && rows[n + AHEAD] >= 0) {
            prefetch_row(k + rows[n + AHEAD] * ks_s, 4 * D);
            if (v_ahead) prefetch_row_l2(v + rows[n + AHEAD] * vs_s, 4 * D);
        }
        const float *kr = k + pos * ks_s;
        const float b = bias ? bias[pos * bs_s] : 0.f;
        for (int64_t g = 0; g < G; g++) {
            float s;
            if (vec) {
                v16 acc = qv[g][0] * load16(kr);
                for (int64_t c = 1; c < DV; c++) acc += qv[g][c] * load16(kr + 16 * c);
                s = hsum16(acc);
            } else {
                s = 0.f;
                for (int64_t d = 0; d < D; d++) s += q[g * qs_h + d] * kr[d];
                s *= scale;
            }
            s += b;
            sc[g * N + n] = s;
            if (s > m[g]) m[g] = s;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *s = sc + g * N, t = 0.f;
        for (int64_t n = 0; n < N; n++) s[n] -= m[g];
        exp_inplace(s, N);  /* skipped rows: exp(-FLT_MAX - m) = 0 */
        for (int64_t n = 0; n < N; n++) t += s[n];
        l[g] = t;
    }
    /* pass 2: the weighted sum of the V rows, each row read once for the group */
    if (vec) {
        v16 acc[16][16];
        for (int64_t g = 0; g < G; g++) for (int64_t c = 0; c < DV; c++) acc[g][c] = (v16){0};
        for (int64_t n = 0; n < N; n++) {
            int64_t pos = rows[n];
            if (pos < 0) continue;
            if (n + AHEAD < N && rows[n + AHEAD] >= 0) prefetch_row(v + rows[n + AHEAD] * vs_s, 4 * D);
            const float *vr = v + pos * vs_s;
            for (int64_t c = 0; c < DV; c++) {
                v16 x = load16(vr + 16 * c);
                for (int64_t g = 0; g < G; g++) acc[g][c] += sc[g * N + n] * x;
            }
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < DV; c++) store16(out + g * os_h + 16 * c, acc[g][c] * (1.f / l[g]));
        return;
    }
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
}

typedef struct {
    const float *q, *k, *v, *bias;
    const int64_t *idx;
    float *out;
    int64_t qs_b, qs_h, ks_b, ks_h, ks_s, vs_b, vs_h, vs_s, is_b, is_h, is_n, bs_b, bs_h, bs_s, os_b, os_h;
    int64_t Hk, G, S, N, D, lo, hi;  /* pairs [lo, hi) of the B * Hk (batch row, KV head) pairs */
    float scale;
    int rc;
} job_t;

static void *run_job(void *arg) {
    job_t *j = (job_t *)arg;
    size_t n = (size_t)(j->N > 0 ? j->N : 1);
    float *sc = (float *)malloc(sizeof(float) * n * (size_t)j->G);
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * n);
    j->rc = (sc && rows) ? 0 : -1;
    for (int64_t p = j->lo; p < j->hi && !j->rc; p++) {
        int64_t b = p / j->Hk, h = p % j->Hk;
        pair(j->q + b * j->qs_b + h * j->G * j->qs_h, j->qs_h, j->k + b * j->ks_b + h * j->ks_h, j->ks_s,
             j->v + b * j->vs_b + h * j->vs_h, j->vs_s,
             j->idx ? j->idx + b * j->is_b + h * j->is_h : 0, j->is_n,
             j->bias ? j->bias + b * j->bs_b + h * j->bs_h : 0, j->bs_s,
             j->out + b * j->os_b + h * j->G * j->os_h,
             j->os_h, sc, rows, j->G, j->S, j->N, j->D, j->scale);
    }
    free(sc);
    free(rows);
    return 0;
}

#define MAX_THREADS 64
/* q (B, Hk*G, D) strides (qs_b, qs_h, 1); k, v (B, Hk, S, D) strides (s_b, s_h, s_s, 1);
   idx (B, Hk, N) strides (is_b, is_h, is_n) or NULL (N = S); bias (B, Hk, S) strides (bs_b, bs_h, bs_s)
   or NULL; out (B, Hk*G, D) strides (os_b, os_h, 1). The pairs are split over up to `threads` threads
   (the caller's and threads - 1 started here). Returns 0; -1 when scratch or a thread cannot be had;
   -2 for a group over 16. */
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
    if (t > pairs) t = pairs;
    if (pairs * N < MIN_ROWS_PER_THREAD * 2) t = 1;  /* starting a thread costs more than it saves */
    job_t jobs[MAX_THREADS];
    for (int64_t i = 0; i < t; i++) {
        job_t j = {q, k, v, bias, idx, out, qs_b, qs_h, ks_b, ks_h, ks_s, vs_b, vs_h, vs_s, is_b, is_h, is_n,
                   bs_b, bs_h, bs_s, os_b, os_h, Hk, G, S, N, D, pairs * i / t, pairs * (i + 1) / t,
                   scale, 0};
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
    return rc;
}
"""

_MAX_GROUP = 16


_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64,
             _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64]


def _load():
    """The kernel's ctypes function (:func:`kvpass.kernels.native.function`), or None."""
    from kvpass.kernels import native

    return native.function("decode_attention", _SOURCE, "kvpass_decode_attention", _ARGTYPES)


def available() -> bool:
    """Whether the C kernel is built and loaded (a compiler was found, ``KVPASS_NATIVE`` is not 0)."""
    return _load() is not None


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`cpu_decode_attention` serves these operands (plain fp32 CPU tensors whose last dim
    is contiguous, a query group of at most 16, v's head dim equal to k's). A tensor subclass is never
    served: the kernel reads memory directly, past any ``__torch_function__`` (a kvpass cache stub must
    reach torch code, which refuses it loudly)."""
    return (
        type(q) is type(k) is type(v) is torch.Tensor
        and q.device.type == k.device.type == v.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.float32
        and q.dim() == 3 and k.dim() == 4 and v.dim() == 4
        and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0 and q.shape[1] // k.shape[1] <= _MAX_GROUP
        and v.shape[:3] == k.shape[:3] and v.shape[3] == k.shape[3] == q.shape[2]
        and q.stride(2) == 1 and k.stride(3) == 1 and v.stride(3) == 1
        and available()
    )


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
    fn = _load()
    if fn is None or not supports(q, k, v):
        raise ValueError(
            "kvpass: cpu_decode_attention needs fp32 CPU q (B, H_q, D), k, v (B, H_kv, S, D) with a "
            "contiguous last dim and the C kernel built (kvpass.kernels.cpu_decode.available()); got "
            f"q {tuple(q.shape)} {q.dtype} {q.device}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, H_q, D = q.shape
    _, H_kv, S, _ = k.shape
    G = H_q // H_kv
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
    rc = fn(q.data_ptr(), q.stride(0), q.stride(1),
            k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
            v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
            iptr, *istr, bptr, *bstr,
            out.data_ptr(), out.stride(0), out.stride(1),
            B, H_kv, G, S, N, D, float(scale), torch.get_num_threads() if threads is None else int(threads))
    if rc != 0:
        raise MemoryError(f"kvpass: cpu_decode_attention could not allocate its scratch (rc={rc})")
    return out


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
