"""CPU kernels in C for the steps where torch's per-call cost exceeds the arithmetic: decode
attention over the paged cache (with a group's shared prefix) and the K/V cache write. float32
only; callers keep the torch code for everything else. (RMSNorm stays torch's: it rounds like
Hugging Face's bit for bit, which a C reduction would not; tests/cpu/test_kernels_norm_rope.py.)

Why C: at decode sizes (a dozen tokens per step) each torch call costs more than its arithmetic.
The torch reference does a decode step's attention as several calls per layer (gather the own
blocks, PyTorch's flash kernel on them, flash again per group prefix, merge the parts by
log-sum-exp): on peer_bench's decode-heavy workload that was 40% of the native engine's time
against 19% for vLLM's C++ CPU attention (issue 17). `decode_attention_cpu` is one call per
layer and copies nothing: each (sequence, kv head) pair streams its blocks once for all the
query heads that share the kv head (GQA), with an online softmax per block. Work is spread over
torch's OpenMP threads (the library links the libgomp that torch has already loaded, so both
share one thread pool); row loops go parallel only for prefill-sized inputs. (Reading a group's
prefix once for all its members, BatchLLM's layout, in a first pass per (group, kv head) and
then each sequence's own keys was tried: no faster here, as one prefix's blocks stay in L2
between the members that read them; with the keys transposed for 16-wide scores, 60% slower.)

The library is built once per machine with the system C compiler (well under a second) into
$PREFIXFLOW_CACHE/kernels/, keyed by the source, the flags and the CPU's feature flags. Without
a compiler, or with PREFIXFLOW_CPU_KERNELS=0, `available()` is False and callers keep the torch
reference, which the tests also use as the oracle.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from prefixflow.paths import cache_root

log = logging.getLogger(__name__)

MAX_HEAD_DIM = 256
MAX_GQA_GROUP = 16
MAX_BLOCK_SIZE = 256

_SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* glibc declares its vector expf (libmvec) only under -ffast-math; declared here so that the
   exp loop vectorises without it. */
float expf(float) __attribute__((simd("notinbranch")));

#define MAX_D %(max_d)d
#define MAX_G %(max_g)d
#define MAX_BS %(max_bs)d

/* Keys 0..n-1 of the run starting at k/v (consecutive keys `stride` floats apart), for the G
   queries in qs [G][D]: update the running max m, sum l and unnormalised output acc [G][D]. */
static void attend(const float *qs, int G, int D, const float *k, const float *v, long stride,
                   int n, float *m, float *l, float *acc) {
    float s[MAX_BS];
    for (int g = 0; g < G; g++) {
        const float *q = qs + g * D;
        /* separate simple loops, so that each vectorises (the exps through libmvec) */
        for (int j = 0; j < n; j++) {
            const float *kj = k + j * stride;
            float dot = 0.f;
            for (int d = 0; d < D; d++) dot += q[d] * kj[d];
            s[j] = dot;
        }
        float top = m[g];
        for (int j = 0; j < n; j++) top = s[j] > top ? s[j] : top;
        float sum = 0.f;
        for (int j = 0; j < n; j++) {
            s[j] = expf(s[j] - top);
            sum += s[j];
        }
        float corr = expf(m[g] - top);
        float *a = acc + g * D;
        for (int d = 0; d < D; d++) a[d] *= corr;
        for (int j = 0; j < n; j++) {
            const float *vj = v + j * stride;
            float p = s[j];
            for (int d = 0; d < D; d++) a[d] += p * vj[d];
        }
        m[g] = top;
        l[g] = l[g] * corr + sum;
    }
}

/* Every block of a table holding `len` keys. */
static void attend_table(const float *qs, int G, int D, const float *kc, const float *vc,
                         const int32_t *table, int len, int bs, int hkv, int kvh,
                         float *m, float *l, float *acc) {
    long stride = (long)hkv * D;
    for (int j0 = 0; j0 < len; j0 += bs) {
        long off = ((long)table[j0 / bs] * bs * hkv + kvh) * D;
        int n = len - j0 < bs ? len - j0 : bs;
        attend(qs, G, D, kc + off, vc + off, stride, n, m, l, acc);
    }
}

void pf_decode_f32(const float *q, long q_stride_s, long q_stride_h,
                   const float *kc, const float *vc, int bs, int hkv, int D,
                   const int32_t *kv_lens, const int32_t *tables, int t_stride,
                   const int32_t *prefix_of, const int32_t *prefix_lens,
                   const int32_t *prefix_tables, int p_stride,
                   float *out, int S, int hq, float scale) {
    int G = hq / hkv;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int w = 0; w < S * hkv; w++) {
        int s = w / hkv, kvh = w %% hkv;
        float qs[MAX_G * MAX_D], acc[MAX_G * MAX_D], m[MAX_G], l[MAX_G];
        for (int g = 0; g < G; g++) {
            const float *src = q + s * q_stride_s + (long)(kvh * G + g) * q_stride_h;
            for (int d = 0; d < D; d++) qs[g * D + d] = src[d] * scale;
            m[g] = -FLT_MAX;
            l[g] = 0.f;
        }
        memset(acc, 0, sizeof(float) * G * D);
        int p = prefix_of ? prefix_of[s] : -1;
        if (p >= 0)
            attend_table(qs, G, D, kc, vc, prefix_tables + (long)p * p_stride, prefix_lens[p],
                         bs, hkv, kvh, m, l, acc);
        attend_table(qs, G, D, kc, vc, tables + (long)s * t_stride, kv_lens[s], bs, hkv, kvh,
                     m, l, acc);
        for (int g = 0; g < G; g++) {
            float *o = out + ((long)s * hq + kvh * G + g) * D;
            float inv = 1.f / l[g];
            for (int d = 0; d < D; d++) o[d] = acc[g * D + d] * inv;
        }
    }
}

/* K/V rows of T tokens into their cache slots (slot = block * block_size + offset; < 0: skip). */
void pf_write_kv_f32(const float *k, long k_st, long k_sh, const float *v, long v_st, long v_sh,
                     float *kc, float *vc, const int64_t *slots, int T, int hkv, int D) {
    #pragma omp parallel for if (T > 256)
    for (int t = 0; t < T; t++) {
        long slot = slots[t];
        if (slot < 0) continue;
        for (int h = 0; h < hkv; h++) {
            memcpy(kc + (slot * hkv + h) * D, k + t * k_st + h * k_sh, sizeof(float) * D);
            memcpy(vc + (slot * hkv + h) * D, v + t * v_st + h * v_sh, sizeof(float) * D);
        }
    }
}
""" % dict(max_d=MAX_HEAD_DIM, max_g=MAX_GQA_GROUP, max_bs=MAX_BLOCK_SIZE)

# Not -ffast-math: linking a shared library with it runs crtfastmath's constructor, which sets
# flush-to-zero for the whole process (every later float op loses subnormals; hypothesis caught
# it). The subset below lets the compiler reorder float sums, which is what vectorising the dot
# products needs; the kernel never forms an infinity or NaN (the running max starts at -FLT_MAX).
# On x86, 512-bit vectors where the CPU has them (GCC picks 256 by default even then): decode
# steps of peer_bench's shapes took 21-27% less time in the kernel (Sapphire Rapids, 2 threads).
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math", "-fopenmp", "-shared", "-fPIC",
          *(["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else [])]


def enabled() -> bool:
    return os.environ.get("PREFIXFLOW_CPU_KERNELS", "1") != "0"


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where no C compiler can build it."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        log.info("no C compiler: the CPU kernels run as torch code")
        return None
    key = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, platform.machine(), _cpu_flags()])
                         .encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"cpu_kernels_{key}.so"
    try:
        if not path.exists():
            _compile(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("could not build the CPU kernels (%s); using the torch code", e)
        return None
    ptr, long_, int_, float_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    signatures = {
        "pf_decode_f32": [ptr, long_, long_, ptr, ptr, int_, int_, int_, ptr, ptr, int_, ptr, ptr,
                          ptr, int_, ptr, int_, int_, float_],
        "pf_write_kv_f32": [ptr, long_, long_, ptr, long_, long_, ptr, ptr, ptr, int_, int_, int_],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def _compile(cc: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / "cpu_kernels.c", Path(tmp) / "cpu_kernels.so"
        src.write_text(_SOURCE)
        subprocess.run([cc, *_FLAGS, str(src), "-o", str(lib), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(lib, path)  # atomic: processes building at once each install a whole file


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native code is only valid on CPUs that have them)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def available(*tensors: torch.Tensor) -> bool:
    """The library is built and every tensor is a float32 CPU one with unit stride in its
    last dim (what each kernel reads)."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1
                for t in tensors)
            and enabled() and _library() is not None)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `decode_attention_cpu` takes these tensors (else use the reference)."""
    _, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    return (k_cache.is_contiguous() and d <= MAX_HEAD_DIM and bs <= MAX_BLOCK_SIZE
            and hq // hkv <= MAX_GQA_GROUP and available(q, k_cache))


def write_kv_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] float32 (unit stride in D) into contiguous caches [blocks,
    block_size, Hkv, D] at slots [T] int64 (contiguous; < 0 skipped, the rest checked by the
    caller to be inside the cache)."""
    t, hkv, d = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots.is_contiguous()
    _library().pf_write_kv_f32(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
                               v.stride(0), v.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                               slots.data_ptr(), t, hkv, d)


def check_tables(num_blocks: int, block_size: int, kv_lens: list[int], block_tables: torch.Tensor,
                 prefix_lens: list[int] = (), prefix_block_tables: torch.Tensor | None = None
                 ) -> None:
    """ValueError unless every key the kernel will read is inside the cache (host values)."""
    tables = [(block_tables, kv_lens)]
    if prefix_block_tables is not None:
        tables.append((prefix_block_tables, list(prefix_lens)))
    for table, lens in tables:
        for row, n in zip(table.tolist(), lens):
            used = row[:-(-n // block_size)]
            if n < 0 or len(used) * block_size < n or any(b < 0 or b >= num_blocks for b in used):
                raise ValueError(f"a block table row {row[:8]}... does not hold {n} keys in a "
                                 f"cache of {num_blocks} blocks")


def decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         kv_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                         out: torch.Tensor, prefix_of: torch.Tensor | None = None,
                         prefix_lens: torch.Tensor | None = None,
                         prefix_block_tables: torch.Tensor | None = None) -> torch.Tensor:
    """out[s] = softmax(q[s] . keys) . values over sequence s's keys: the prefix_lens[p] keys
    of prefix_block_tables[p] when p = prefix_of[s] >= 0, then its own kv_lens[s] keys.

    q: [S, Hq, D] float32 (unit stride in D); k_cache, v_cache: [blocks, block_size, Hkv, D]
    float32, contiguous; kv_lens [S], block_tables [S, W], prefix_of [S], prefix_lens [G],
    prefix_block_tables [G, W'] int32, contiguous; out: [S, Hq, D] float32, unit stride in D.
    Callers check `supports` first, and the values once per step (`check_tables`): the C code
    trusts them.
    """
    if not out.is_contiguous():
        return out.copy_(decode_attention_cpu(q, k_cache, v_cache, kv_lens, block_tables, scale,
                                              torch.empty(out.shape), prefix_of, prefix_lens,
                                              prefix_block_tables))
    s, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    assert block_tables.is_contiguous() and kv_lens.is_contiguous()
    p_ptr = pl_ptr = pt_ptr = None
    p_stride = 0
    if prefix_of is not None:
        assert prefix_lens is not None and prefix_block_tables is not None
        assert prefix_of.is_contiguous() and prefix_block_tables.is_contiguous()
        p_ptr, pl_ptr = prefix_of.data_ptr(), prefix_lens.data_ptr()
        pt_ptr, p_stride = prefix_block_tables.data_ptr(), prefix_block_tables.stride(0)
    lib = _library()
    assert lib is not None
    lib.pf_decode_f32(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(),
                      v_cache.data_ptr(), bs, hkv, d, kv_lens.data_ptr(), block_tables.data_ptr(),
                      block_tables.stride(0), p_ptr, pl_ptr, pt_ptr, p_stride, out.data_ptr(), s,
                      hq, scale)
    return out
