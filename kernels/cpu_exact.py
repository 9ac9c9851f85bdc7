"""The decoder layer's elementwise work on the CPU in C, rounded exactly as torch rounds it.

At decode sizes a layer's elementwise ops cost more in dispatch than in arithmetic: torch's
RMSNorm is seven ops (pow, sum, div, add, rsqrt, mul, mul) and the rotary embedding five, each a
few microseconds on a [6, 576] tensor, 61 norms and 30 rotaries a SmolLM2 step (issue 17). Here
each is one call:

- `add_rms_norm`: the residual add and RMSNorm. The sum of squares follows torch's own order
  for a float row sum (its vectorised inner reduction: four interleaved vector accumulators,
  cascaded every 16 vectors, then the leftover vectors, then the lanes one by one; the vector
  width is found by the self-check), so the result is bit-identical to `F.rms_norm` and
  Hugging Face's RMSNorm;
- `rotary_`: the rotate-half rotary embedding in place, x1*c - x2*s and x2*c + x1*s with each
  product rounded before the sum, as torch computes it.

The library is compiled without contraction into fused multiply-adds and without reassociation
(unlike kernels/cpu_kernels.py), and each op checks itself against torch once per width (the
hidden size, the head dim) before it is used (`_norm_lanes`, `rotary_is_exact`; on fewer rows
than split over threads, which changes no row's result): where a torch build sums in another
order (another vector width, another torch release), callers keep the torch code.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from prefixflow.kernels import cpu_build
from prefixflow.kernels.rotary import apply_rotary_ref

log = logging.getLogger(__name__)

# Rows at which the C loops split over threads (below, one thread: the fork costs more).
PARALLEL_ROWS = 64

_SOURCE = r"""
#include <math.h>
#include <stdint.h>

static int ceil_log2(long x) {
    if (x <= 2) return 1;
    int bits = 0;
    for (unsigned long v = (unsigned long)(x - 1); v; v >>= 1) bits++;
    return bits;
}

/* acc[l] += p[l]^2, each square rounded first (torch squares into a tensor, then sums). */
static inline void add_squares(float *acc, const float *p, int L) {
    for (int l = 0; l < L; l++) {
        float sq = p[l] * p[l];
        acc[l] += sq;
    }
}

/* sum of x[i]^2 over a row of n floats in the order of torch's float sum over a contiguous
   dim with L-lane vectors (ATen's vectorized_inner_sum -> row_sum -> multi_row_sum): vectors
   are read as rows of 4 (one accumulator per column), the accumulators cascade through 4 levels
   every 2^p rows (p = max(4, ceil_log2(rows) / 4)), the leftover vectors go into the first
   column, the columns into the first, then a scalar starting at 0 takes the leftover elements
   and the lanes in order. */
static float torch_sum_squares(const float *x, int n, int L) {
    float acc[4][4][16] = {{{0}}};  /* [level][column][lane] */
    long nv = n / L, rows = nv / 4;
    int p = ceil_log2(rows) / 4;
    if (p < 4) p = 4;
    long step = 1L << p, mask = step - 1, i = 0;
    while (i + step <= rows) {
        for (long j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++) add_squares(acc[0][k], x + (4 * i + k) * L, L);
        for (int lev = 1; lev < 4; lev++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < L; l++) {
                    acc[lev][k][l] += acc[lev - 1][k][l];
                    acc[lev - 1][k][l] = 0.f;
                }
            if (i & (mask << (lev * p))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < 4; k++) add_squares(acc[0][k], x + (4 * i + k) * L, L);
    for (int lev = 1; lev < 4; lev++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < L; l++) acc[0][k][l] += acc[lev][k][l];
    for (long v = rows * 4; v < nv; v++) add_squares(acc[0][0], x + v * L, L);
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < L; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.f;
    for (long e = nv * L; e < n; e++) {
        float sq = x[e] * x[e];
        total += sq;
    }
    for (int l = 0; l < L; l++) total += acc[0][0][l];
    return total;
}

/* out[t] = w * (h * 1/sqrt(mean(h^2) + eps)), h = x[t] + residual[t] written back to residual
   (residual NULL: h = x[t]). x, residual, out: [T][H] rows `stride` floats apart. */
void pf_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out, int T,
                         int H, long stride, float eps, int lanes) {
    #pragma omp parallel for if (T >= %(parallel_rows)d)
    for (int t = 0; t < T; t++) {
        const float *h = x + t * stride;
        if (residual) {
            float *r = residual + t * stride;
            for (int i = 0; i < H; i++) r[i] = h[i] + r[i];
            h = r;
        }
        float mean = torch_sum_squares(h, H, lanes) / (float)H;
        float inv = 1.f / sqrtf(mean + eps);
        float *o = out + t * stride;
        for (int i = 0; i < H; i++) {
            float y = h[i] * inv;
            o[i] = w[i] * y;
        }
    }
}

/* Rotate-half rotary embedding in place: heads h < nheads of row t, x + t*row_stride + h*D,
   with cos/sin rows t (cs_stride floats apart). */
void pf_rotary_f32(float *x, long row_stride, int T, int nheads, int D, const float *cos,
                   const float *sin, long cs_stride) {
    int half = D / 2;
    #pragma omp parallel for if (T >= %(parallel_rows)d)
    for (int t = 0; t < T; t++) {
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int h = 0; h < nheads; h++) {
            float *p = x + t * row_stride + (long)h * D;
            for (int i = 0; i < half; i++) {
                float a = p[i], b = p[i + half];
                float ac = a * c[i], bs = b * s[i], bc = b * c[i + half], as = a * s[i + half];
                p[i] = ac - bs;
                p[i + half] = bc + as;
            }
        }
    }
}
""" % dict(parallel_rows=PARALLEL_ROWS)

# No -ffast-math subset here: no contraction into FMAs, no reassociation, no reciprocals.
_FLAGS = [*cpu_build.NATIVE_FLAGS, "-ffp-contract=off"]

# Vector widths (floats) torch's float sum may run with; the self-check finds the one it uses
# (torch 2.13 on an AVX-512 CPU sums with 8 lanes).
_LANES = (8, 16, 4)


@functools.cache
def _library() -> ctypes.CDLL | None:
    ptr, long_, int_, float_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    return cpu_build.load(
        "cpu_exact",
        _SOURCE,
        _FLAGS,
        {
            "pf_add_rms_norm_f32": [ptr, ptr, ptr, ptr, int_, int_, long_, float_, int_],
            "pf_rotary_f32": [ptr, long_, int_, int_, int_, ptr, ptr, long_],
        },
    )


def build() -> bool:
    """Build the library now (`prefixflow prepare`; otherwise the first norm or rotary call
    does); whether it is there."""
    return _library() is not None


def _is_f32_cpu(t: torch.Tensor) -> bool:
    return t.dtype is torch.float32 and t.is_cpu


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, lanes: int | None = None
) -> torch.Tensor:
    """RMSNorm of x (+ residual, written into `residual`) in C: [T, H] float32 contiguous rows,
    residual alike; weight [H]. Returns a new [T, H]. Check `supports_norm`."""
    t, h = x.shape
    out = torch.empty(t, h, dtype=torch.float32)
    lib = _library()
    if lib is None:
        raise RuntimeError("add_rms_norm: the CPU kernels are not built here; check `supports_norm()` first")
    lib.pf_add_rms_norm_f32(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        t,
        h,
        x.stride(0),
        eps,
        lanes or _norm_lanes(h),
    )
    return out


def supports_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether `add_rms_norm` takes these tensors (else use torch). Cheap: every norm of every
    step asks."""
    return (
        _is_f32_cpu(x)
        and x.dim() == 2
        and x.is_contiguous()
        and cpu_build.enabled()
        and (residual is None or (residual.shape == x.shape and residual.is_contiguous() and _is_f32_cpu(residual)))
        and _is_f32_cpu(weight)
        and weight.shape == x.shape[1:]
        and weight.is_contiguous()
        and _norm_lanes(x.shape[1]) is not None
    )


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding in place in C: x [T, H, D] float32 with unit stride in D and heads D
    apart (rows any stride); cos, sin [T, 1, D] rows alike. Returns x. Check `supports_rotary`."""
    t, heads, d = x.shape
    lib = _library()
    if lib is None:
        raise RuntimeError("rotary_: the CPU kernels are not built here; check `supports_rotary()` first")
    lib.pf_rotary_f32(x.data_ptr(), x.stride(0), t, heads, d, cos.data_ptr(), sin.data_ptr(), cos.stride(0))
    return x


def supports_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary_` takes these tensors (else use torch)."""
    t, _, d = x.shape if x.dim() == 3 else (0, 0, 0)
    return (
        _is_f32_cpu(x)
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == d
        and cos.shape == sin.shape == (t, 1, d)
        and cos.stride() == sin.stride()
        and cos.stride(-1) == 1
        and _is_f32_cpu(cos)
        and _is_f32_cpu(sin)
        and cpu_build.enabled()
        and rotary_is_exact(d)
    )


@functools.cache
def _norm_lanes(hidden: int) -> int | None:
    """The vector width with which `add_rms_norm` equals torch's RMSNorm bit for bit on random
    rows of this width (None: none does)."""
    # Up to torch's grain size a row is summed by one thread; past it torch may split a row.
    if not 16 <= hidden <= 32768 or not cpu_build.enabled() or _library() is None:
        return None
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(33, hidden, generator=gen) * torch.logspace(-3, 3, 33)[:, None]
    residual = torch.randn(33, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    want_residual = x + residual
    want = F.rms_norm(want_residual, (hidden,), weight, 1e-6)
    for lanes in _LANES:
        r = residual.clone()
        if (
            torch.equal(add_rms_norm(x, r, weight, 1e-6, lanes), want)
            and torch.equal(r, want_residual)
            and torch.equal(add_rms_norm(x[:1], None, weight, 1e-6, lanes), F.rms_norm(x[:1], (hidden,), weight, 1e-6))
        ):
            return lanes
    log.info("C RMSNorm rounds unlike this torch build at hidden %d: torch's is used", hidden)
    return None


@functools.cache
def rotary_is_exact(head_dim: int) -> bool:
    """`rotary_` equals the torch rotary (kernels/rotary.apply_rotary_ref) bit for bit."""
    if head_dim % 2 or not cpu_build.enabled() or _library() is None:
        return False
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(9, 5, head_dim, generator=gen)
    cs = torch.randn(9, 2, head_dim, generator=gen)
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    want = apply_rotary_ref(x, cos, sin)
    exact = torch.equal(rotary_(x.clone(), cos, sin), want)
    if not exact:
        log.info("C rotary rounds unlike torch at head_dim %d: torch's is used", head_dim)
    return exact
