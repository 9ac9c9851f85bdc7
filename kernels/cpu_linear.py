"""The linear layers' matmul at decode sizes, in C on the CPU (float32): y = x @ W.T for a few rows.

At a decode step every weight is read once for only a handful of rows, so the step is bound by
how fast the weights stream from memory. oneDNN's GEMM on its prepacked weights
(engine/models/layers/linear.py) runs such skinny products at about half that speed: on this
project's CI machine (AMD EPYC, AVX2, 2 threads), SmolLM2-135M's 30 layers of projections took
44 ms at 1 row and 66 ms at 8, against 25 ms to read their weights once. This kernel reads W in
a layout made for it, out-blocks of one vector's width with the input dim outside
([out / JB][in][JB]), so each weight vector is loaded once and multiplied into up to 8 rows'
accumulators (8 vector registers), with no horizontal sums: 33 ms at 1 row, 39 at 8, 54 at 16
(oneDNN 66), even at 32. Above `MAX_ROWS` rows, oneDNN's register-blocked GEMM is the better
one (prefill), so layers keep both copies of their weights (engine/models/layers/linear.py).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from prefixflow.kernels import cpu_build

# Rows up to which `skinny_linear` beats oneDNN (measured at 1, 4, 8, 16, 32: equal at 32).
MAX_ROWS = 16

_SOURCE = r"""
#include <stdint.h>

#define JB %(jb)d
#define MR 8
typedef float vf __attribute__((vector_size(JB * sizeof(float))));
typedef float vfu __attribute__((vector_size(JB * sizeof(float)), aligned(sizeof(float))));

/* y[m][o] = sum_i x[m][i] * W[o][i] for M rows. w: [nb][in][JB], out-block b holding outputs
   b*JB .. b*JB+JB-1 (zero past `out`). x rows xs floats apart, y rows ys. Each thread takes
   whole out-blocks: their weights stream once from memory, then stay in cache for the next
   chunk of MR rows. */
void pf_linear_f32(const float *x, long xs, const float *w, float *y, long ys, int M, int in,
                   int out) {
    int nb = (out + JB - 1) / JB;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < nb; b++) {
        const float *wb = w + (long)b * in * JB;
        int ncol = out - b * JB < JB ? out - b * JB : JB;
        for (int m0 = 0; m0 < M; m0 += MR) {
            int mr = M - m0 < MR ? M - m0 : MR;
            const float *xr = x + (long)m0 * xs;
            vf acc[MR];
            for (int r = 0; r < MR; r++) acc[r] = (vf){0};
            if (mr == MR) {   /* a constant trip count: the row loop unrolls into registers */
                for (int i = 0; i < in; i++) {
                    vf wv = *(const vf *)(wb + (long)i * JB);
                    for (int r = 0; r < MR; r++) acc[r] += wv * xr[(long)r * xs + i];
                }
            } else {
                for (int i = 0; i < in; i++) {
                    vf wv = *(const vf *)(wb + (long)i * JB);
                    for (int r = 0; r < mr; r++) acc[r] += wv * xr[(long)r * xs + i];
                }
            }
            for (int r = 0; r < mr; r++) {
                float *dst = y + (long)(m0 + r) * ys + (long)b * JB;
                if (ncol == JB) *(vfu *)dst = acc[r];
                else for (int c = 0; c < ncol; c++) dst[c] = acc[r][c];
            }
        }
    }
}
"""

_FLAGS = [*cpu_build.NATIVE_FLAGS, "-fno-trapping-math", "-fno-signed-zeros"]


@functools.cache
def _library(width: int) -> ctypes.CDLL | None:
    """The kernel for out-blocks of `width` floats, built on first use; None where no C compiler
    can build it. Callers pass the width of the blocked weight they hold, so the kernel always
    reads the layout the weight was made in."""
    ptr, long_, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    return cpu_build.load(
        "cpu_linear",
        _SOURCE % dict(jb=width),
        _FLAGS,
        {"pf_linear_f32": [ptr, long_, ptr, ptr, long_, int_, int_, int_]},
    )


def build() -> bool:
    """Build the library for this CPU's width, the one blocked_weight lays weights out in, now
    (`prefixflow prepare`; otherwise the first model load does); whether it is there."""
    return _library(cpu_build.vector_floats()) is not None


def blocked_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] as the kernel reads it, [out / JB, in, JB] (zero-padded; JB this
    CPU's vector width); None where the kernel does not run (not a float32 CPU weight, no
    compiler, PREFIXFLOW_CPU_KERNELS=0)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    jb = cpu_build.vector_floats()
    if not cpu_build.enabled() or _library(jb) is None:
        return None
    out, inp = weight.shape
    nb = -(-out // jb)
    padded = weight.detach().new_zeros(nb * jb, inp)
    padded[:out] = weight.detach()
    return padded.view(nb, jb, inp).transpose(1, 2).contiguous()


def supports(x: torch.Tensor, blocked: torch.Tensor | None) -> bool:
    """Whether `skinny_linear` takes x: a float32 CPU matrix of at most MAX_ROWS rows, unit
    stride in its last dim, and a blocked weight of its width."""
    return (
        blocked is not None
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.dtype is torch.float32
        and x.is_cpu
        and x.stride(-1) == 1
        and x.shape[1] == blocked.shape[1]
    )


def skinny_linear(
    x: torch.Tensor, blocked: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, in] @ W.T (+ bias) -> [M, out_features], W given as `blocked_weight(W)`. Callers
    check `supports` first."""
    lib = _library(blocked.shape[2])
    if lib is None:
        raise RuntimeError("skinny_linear: the CPU kernels are not built here; check `supports()` first")
    m, inp = x.shape
    y = torch.empty(m, out_features)
    if m:
        lib.pf_linear_f32(
            x.data_ptr(), x.stride(0), blocked.data_ptr(), y.data_ptr(), out_features, m, inp, out_features
        )
    if bias is not None:
        y += bias
    return y
