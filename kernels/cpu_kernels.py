"""CPU kernels in C: attention over the paged cache (decode and chunked prefill, with a
group's shared prefix) and the K/V cache write. float32 only; callers keep the torch code for
everything else. (RMSNorm and the rotary embedding, which must round exactly as torch does,
are in kernels/cpu_exact.py, built with stricter flags.)

Why C: the torch reference does a step's attention as several calls per layer (gather each
sequence's blocks and each group's prefix into contiguous copies, PyTorch's flash kernel on
each part, merge the parts by log-sum-exp). At decode sizes each call costs more than its
arithmetic (on peer_bench's decode-heavy workload 40% of the native engine's time against 19%
for vLLM's C++ CPU attention, issue 17), and in prefill steps the copies and merges cost as
much as the flash kernel. `AttentionCall` is one call per layer for every kind of step and
copies nothing from the cache:
- a single query (decode) streams its prefix's and then its own blocks once for all the query
  heads that share its kv head (GQA), with an online softmax per block; four keys' dot products
  at a time and the value sums in registers;
- a chunk of several queries runs in tiles of up to 64 rows (query tokens x heads of one kv
  head) held in the vector lanes: the scores of 8 keys are 8 multiply-adds per head-dim element
  of a row vector of transposed queries by a broadcast key element, the outputs likewise from
  broadcast value elements, and the causal mask and online softmax run lane-wise, so no
  horizontal sum and no transposed key is needed. On peer_bench's two-level prefill steps this
  is 1.5x faster than the torch path, and on four fresh prompts of ~512 tokens faster than
  PyTorch's flash kernel on the packed tokens (cache write included, 11.4 -> 7.9 ms a layer);
- single queries of one group that fill at least half a vector of rows read the group's prefix
  once, as one such tile (BatchLLM's group-shared prefix), then each carries on over its own
  keys as above: peer_bench two_level decode steps 0.63 -> 0.40 ms a layer, decode_heavy
  0.33 -> 0.29 (a tile for the own keys too was 2x slower: they differ per member).
Work is spread over torch's OpenMP threads (the library links the libgomp that torch has
already loaded, so both share one thread pool). A layer's metadata is bound once per step
(`AttentionCall`): each layer is then one C call.

Tried and not kept (issue 17, AMD EPYC with AVX-512, 2 threads): a decode call whose keys come
from memory (every layer's, in a real step) takes about 3x its time from cache, but neither
software prefetch of the next block (or of all of a sequence's blocks) nor work items that take
every kv head of a sequence at once (contiguous blocks) gained more than 10%, and a head-major
block layout read just as slowly; the tiles taking two row blocks per key chunk (half the
broadcast loads) were 5-20% slower.

The library is built once per machine with the system C compiler (well under a second;
kernels/cpu_build.py). Without a compiler, or with PREFIXFLOW_CPU_KERNELS=0, `available()` is
False and callers keep the torch reference, which the tests also use as the oracle.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from prefixflow.kernels import cpu_build

MAX_HEAD_DIM = 256
MAX_GQA_GROUP = 16
MAX_BLOCK_SIZE = 256

_SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D %(max_d)d
#define MAX_G %(max_g)d
#define MAX_BS %(max_bs)d
/* One vector of floats, as wide as the CPU's registers (cpu_build.vector_floats: 16 with
   AVX-512, 8 with AVX, 4 otherwise). vfu: the same, loaded from any float address. */
#define JB %(jb)d
typedef float vf __attribute__((vector_size(JB * sizeof(float))));
typedef float vfu __attribute__((vector_size(JB * sizeof(float)), aligned(sizeof(float))));
typedef int vi __attribute__((vector_size(JB * sizeof(int))));
typedef unsigned vu __attribute__((vector_size(JB * sizeof(unsigned))));

static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* e^x lane-wise for the softmax's x <= 0 (a score minus the running max; larger x is taken as
   0): Cody-Waite reduction to r in [-ln2/2, ln2/2], cephes' degree-5 polynomial for e^r, 2^n
   from the exponent bits; exactly 0 below -87.3 (masked keys). Measured within 3e-7 relative
   of exp as built (libm's expf: 1e-7); libm's vector expf took a third of the chunked-prefill
   time (SmolLM2 shapes: 1.06-1.30x faster with this). n is rounded by conversions, not by
   adding and subtracting a large constant, which the reassociation the flags allow would
   fold away. */
static inline vf vexp(vf x) {
    vi low = x < -87.3f;
    x = vselect(low, (vf){0} - 87.3f, vselect(x > 0.f, (vf){0}, x));
    vf t = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(t, vi);
    n += (vi)(__builtin_convertvector(n, vf) > t);        /* trunc -> floor (true is -1) */
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    vf scale = (vf)((vu)(n + 127) << 23);                  /* n + 127 in 0..127 */
    return vselect(low, (vf){0}, p * scale);
}

static inline float sum_lanes(vf x) {
    float t = 0.f;
    for (int i = 0; i < JB; i++) t += x[i];
    return t;
}

/* s[j] = q . k_j for j < n, k_j = k + j * stride: four keys at a time, each with its own
   vector accumulator (independent chains), reduced across lanes at the end. */
static void dot_rows(const float *q, int D, const float *k, long stride, int n, float *s) {
    int j = 0;
    if (D %% JB == 0) {
        for (; j + 4 <= n; j += 4) {
            const float *k0 = k + j * stride;
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int d = 0; d < D; d += JB) {
                vf qd = *(const vfu *)(q + d);
                a0 += qd * *(const vfu *)(k0 + d);
                a1 += qd * *(const vfu *)(k0 + stride + d);
                a2 += qd * *(const vfu *)(k0 + 2 * stride + d);
                a3 += qd * *(const vfu *)(k0 + 3 * stride + d);
            }
            s[j] = sum_lanes(a0);
            s[j + 1] = sum_lanes(a1);
            s[j + 2] = sum_lanes(a2);
            s[j + 3] = sum_lanes(a3);
        }
    }
    for (; j < n; j++) {
        const float *kj = k + j * stride;
        float dot = 0.f;
        for (int d = 0; d < D; d++) dot += q[d] * kj[d];
        s[j] = dot;
    }
}

/* a[0..D-1] = a * corr + sum_j p[j] * v_j, v_j = v + j * stride: four vectors of a at a time
   in registers, so the n multiply-adds into each are not a chain through memory. */
static void add_weighted_rows(float *a, int D, float corr, const float *p, const float *v,
                              long stride, int n) {
    int d0 = 0;
    for (; d0 + 4 * JB <= D; d0 += 4 * JB) {
        vf o0 = *(vfu *)(a + d0) * corr, o1 = *(vfu *)(a + d0 + JB) * corr,
           o2 = *(vfu *)(a + d0 + 2 * JB) * corr, o3 = *(vfu *)(a + d0 + 3 * JB) * corr;
        for (int j = 0; j < n; j++) {
            const float *vj = v + j * stride + d0;
            o0 += p[j] * *(const vfu *)vj;
            o1 += p[j] * *(const vfu *)(vj + JB);
            o2 += p[j] * *(const vfu *)(vj + 2 * JB);
            o3 += p[j] * *(const vfu *)(vj + 3 * JB);
        }
        *(vfu *)(a + d0) = o0;
        *(vfu *)(a + d0 + JB) = o1;
        *(vfu *)(a + d0 + 2 * JB) = o2;
        *(vfu *)(a + d0 + 3 * JB) = o3;
    }
    for (; d0 + JB <= D; d0 += JB) {
        vf o = *(vfu *)(a + d0) * corr;
        for (int j = 0; j < n; j++) o += p[j] * *(const vfu *)(v + j * stride + d0);
        *(vfu *)(a + d0) = o;
    }
    for (; d0 < D; d0++) {
        float o = a[d0] * corr;
        for (int j = 0; j < n; j++) o += p[j] * v[j * stride + d0];
        a[d0] = o;
    }
}

/* Keys 0..n-1 of the run starting at k/v (consecutive keys `stride` floats apart), for the G
   queries in qs [G][D]: update the running max m, sum l and unnormalised output acc [G][D]. */
static void attend(const float *qs, int G, int D, const float *k, const float *v, long stride,
                   int n, float *m, float *l, float *acc) {
    float s[MAX_BS];
    for (int g = 0; g < G; g++) {
        const float *q = qs + g * D;
        /* separate simple loops, so that each vectorises */
        dot_rows(q, D, k, stride, n, s);
        float top = m[g];
        for (int j = 0; j < n; j++) top = s[j] > top ? s[j] : top;
        int whole = (n + JB - 1) / JB * JB;      /* lanes past n give 0 */
        for (int j = 0; j < whole; j++) s[j] = j < n ? s[j] - top : -FLT_MAX;
        for (int j = 0; j < whole; j += JB) *(vfu *)(s + j) = vexp(*(const vfu *)(s + j));
        float sum = 0.f;
        for (int j = 0; j < n; j++) sum += s[j];
        float corr = vexp((vf){0} + (m[g] - top))[0];
        add_weighted_rows(acc + g * D, D, corr, s, v, stride, n);
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

/* G queries' softmax state (m, l, acc) carried on over a sequence's own `len` keys, then their
   normalised outputs to heads kvh*G .. kvh*G+G-1 of out [hq][D]. */
static void finish_over_own_keys(const float *qs, int G, int D, const float *kc, const float *vc,
                                 const int32_t *table, int len, int bs, int hkv, int kvh,
                                 float *m, float *l, float *acc, float *out) {
    attend_table(qs, G, D, kc, vc, table, len, bs, hkv, kvh, m, l, acc);
    for (int g = 0; g < G; g++) {
        float inv = 1.f / l[g];
        for (int d = 0; d < D; d++) out[(long)(kvh * G + g) * D + d] = acc[g * D + d] * inv;
    }
}

/* One decode query (G heads sharing kv head kvh) of sequence s: its group's prefix, then its
   own keys; the normalised result to out [hq][D]. */
static void decode_query(const float *q, long q_stride_h, const float *kc, const float *vc,
                         int bs, int hkv, int D, int G, int kvh, const int32_t *table, int len,
                         const int32_t *prefix_table, int prefix_len, float *out, float scale) {
    float qs[MAX_G * MAX_D], acc[MAX_G * MAX_D], m[MAX_G], l[MAX_G];
    for (int g = 0; g < G; g++) {
        const float *src = q + (long)(kvh * G + g) * q_stride_h;
        for (int d = 0; d < D; d++) qs[g * D + d] = src[d] * scale;
        m[g] = -FLT_MAX;
        l[g] = 0.f;
    }
    memset(acc, 0, sizeof(float) * G * D);
    if (prefix_table)
        attend_table(qs, G, D, kc, vc, prefix_table, prefix_len, bs, hkv, kvh, m, l, acc);
    finish_over_own_keys(qs, G, D, kc, vc, table, len, bs, hkv, kvh, m, l, acc, out);
}

/* Chunks of several queries: a tile of R rows (query tokens x the G heads of one kv head,
   R a multiple of JB) with the rows in the vector lanes, so that neither product needs a
   horizontal sum or a transposed key: scores of KB keys = KB multiply-adds of a row vector of
   the transposed queries by one broadcast key element each; outputs (kept transposed, [D][R])
   = a multiply-add of each key's broadcast value element by its row vector of probabilities.
   The online softmax runs lane-wise too. */
#define KB 8
#define MAX_R 64

typedef struct {
    int R, D;
    float *qt;            /* [D][R] scaled queries, transposed */
    float *acct;          /* [D][R] unnormalised outputs, transposed */
    float *m, *l;         /* [R] running max and sum */
    int *limit;           /* [R] row r sees the keys with index < limit[r] */
} Tile;

/* Keys first..first+n-1 (n <= KB) at k/v, consecutive keys `stride` floats apart. */
static void tile_keys(Tile *t, const float *k, const float *v, long stride, int n, int first) {
    int R = t->R, D = t->D;
    const float *kp[KB], *vp[KB];
    for (int j = 0; j < KB; j++) {          /* past n: the last key again, masked out below */
        kp[j] = k + (j < n ? j : n - 1) * stride;
        vp[j] = v + (j < n ? j : n - 1) * stride;
    }
    for (int rb = 0; rb < R; rb += JB) {
        vf sc[KB];
        for (int j = 0; j < KB; j++) sc[j] = (vf){0};
        for (int d = 0; d < D; d++) {
            vf qv = *(const vf *)(t->qt + (long)d * R + rb);
            for (int j = 0; j < KB; j++) sc[j] += qv * kp[j][d];
        }
        vi lim = *(const vi *)(t->limit + rb);
        vi seen[KB];
        vf m_old = *(const vf *)(t->m + rb), top = m_old;
        for (int j = 0; j < KB; j++) {
            seen[j] = ((vi){0} + (first + j) < lim) & ((vi){0} + (j < n ? -1 : 0));
            vf cand = vselect(seen[j], sc[j], (vf){0} - FLT_MAX);
            top = vselect(cand > top, cand, top);
        }
        /* exponents of the KB probabilities and of the correction, in one vectorised loop */
        float e[(KB + 1) * JB] __attribute__((aligned(64)));
        for (int j = 0; j < KB; j++)
            *(vf *)(e + j * JB) = vselect(seen[j], sc[j] - top, (vf){0} - FLT_MAX);
        *(vf *)(e + KB * JB) = m_old - top;
        for (int i = 0; i < KB + 1; i++) *(vf *)(e + i * JB) = vexp(*(const vf *)(e + i * JB));
        vf p[KB], sum = (vf){0}, corr = *(const vf *)(e + KB * JB);
        for (int j = 0; j < KB; j++) {
            p[j] = *(const vf *)(e + j * JB);
            sum += p[j];
        }
        *(vf *)(t->m + rb) = top;
        *(vf *)(t->l + rb) = *(const vf *)(t->l + rb) * corr + sum;
        for (int d = 0; d < D; d++) {
            vf *a = (vf *)(t->acct + (long)d * R + rb);
            vf o = *a * corr;
            for (int j = 0; j < KB; j++) o += p[j] * vp[j][d];
            *a = o;
        }
    }
}

/* Keys 0..len-1 of a table, KB at a time. */
static void tile_table(Tile *t, const float *kc, const float *vc, const int32_t *table, int len,
                       int bs, int hkv, int kvh) {
    long stride = (long)hkv * t->D;
    for (int j0 = 0; j0 < len; j0 += bs) {
        long base = (long)table[j0 / bs] * bs;
        int in_block = len - j0 < bs ? len - j0 : bs;
        for (int c = 0; c < in_block; c += KB) {
            long off = ((base + c) * hkv + kvh) * t->D;
            tile_keys(t, kc + off, vc + off, stride, in_block - c < KB ? in_block - c : KB,
                      j0 + c);
        }
    }
}

/* A tile of `rows` rows (R rounded up to a whole vector), nothing seen yet; 0 without memory. */
static int tile_open(Tile *t, int rows, int D) {
    int R = (rows + JB - 1) / JB * JB;
    float *mem = aligned_alloc(64, sizeof(float) * ((size_t)2 * R * D + 2 * R) + sizeof(int) * R);
    if (!mem) return 0;
    t->R = R;
    t->D = D;
    t->qt = mem;
    t->acct = t->qt + (long)R * D;
    t->m = t->acct + (long)R * D;
    t->l = t->m + R;
    t->limit = (int *)(t->l + R);
    memset(t->qt, 0, sizeof(float) * R * D);
    memset(t->acct, 0, sizeof(float) * R * D);
    for (int r = 0; r < R; r++) {
        t->m[r] = -FLT_MAX;
        t->l[r] = 0.f;
    }
    return 1;
}

static void tile_set_query(Tile *t, int r, const float *src, float scale) {
    for (int d = 0; d < t->D; d++) t->qt[(long)d * t->R + r] = src[d] * scale;
}

static void tile_get_output(const Tile *t, int r, float *dst) {
    float inv = 1.f / t->l[r];
    for (int d = 0; d < t->D; d++) dst[d] = t->acct[(long)d * t->R + r] * inv;
}

/* Query tokens i0..i1-1 of a sequence whose own keys before its first query number `cached`. */
static void chunk_tile(const float *q, long q_stride_t, long q_stride_h, const float *kc,
                       const float *vc, int bs, int hkv, int D, int G, int kvh, int i0, int i1,
                       int cached, const int32_t *table, const int32_t *prefix_table,
                       int prefix_len, float *out, int hq, float scale) {
    int rows = (i1 - i0) * G;
    Tile t;
    if (!tile_open(&t, rows, D)) return;  /* cannot happen at these sizes */
    for (int r = 0; r < rows; r++)
        tile_set_query(&t, r, q + (long)(i0 + r / G) * q_stride_t
                              + (long)(kvh * G + r %% G) * q_stride_h, scale);
    for (int r = 0; r < t.R; r++) t.limit[r] = prefix_len;
    if (prefix_table) tile_table(&t, kc, vc, prefix_table, prefix_len, bs, hkv, kvh);
    for (int r = 0; r < t.R; r++) t.limit[r] = r < rows ? cached + i0 + r / G + 1 : 0;
    tile_table(&t, kc, vc, table, cached + i1, bs, hkv, kvh);
    for (int r = 0; r < rows; r++)
        tile_get_output(&t, r, out + ((long)(i0 + r / G) * hq + kvh * G + r %% G) * D);
    free(t.qt);
}

/* The single queries of sequences s0..s0+count-1, which share one prefix: the prefix's keys
   once for all of them as one tile of count x G rows (BatchLLM's group-shared prefix), then
   each sequence's own keys as a decode query that carries on from its rows' softmax state. */
static void group_decode_tile(const float *q, long q_stride_t, long q_stride_h, const float *kc,
                              const float *vc, int bs, int hkv, int D, int G, int kvh,
                              const int32_t *cu, int s0, int count, const int32_t *kv_lens,
                              const int32_t *tables, int t_stride, const int32_t *prefix_table,
                              int prefix_len, float *out, int hq, float scale) {
    int rows = count * G;
    Tile t;
    if (!tile_open(&t, rows, D)) return;  /* cannot happen at these sizes */
    for (int r = 0; r < rows; r++) {
        int s = s0 + r / G;
        tile_set_query(&t, r, q + (long)(cu ? cu[s] : s) * q_stride_t
                              + (long)(kvh * G + r %% G) * q_stride_h, scale);
    }
    for (int r = 0; r < t.R; r++) t.limit[r] = prefix_len;
    tile_table(&t, kc, vc, prefix_table, prefix_len, bs, hkv, kvh);
    float qs[MAX_G * MAX_D], acc[MAX_G * MAX_D], m[MAX_G], l[MAX_G];
    for (int i = 0; i < count; i++) {
        int s = s0 + i, row = cu ? cu[s] : s;
        for (int g = 0; g < G; g++) {
            int r = i * G + g;
            for (int d = 0; d < D; d++) {
                qs[g * D + d] = t.qt[(long)d * t.R + r];
                acc[g * D + d] = t.acct[(long)d * t.R + r];
            }
            m[g] = t.m[r];
            l[g] = t.l[r];
        }
        finish_over_own_keys(qs, G, D, kc, vc, tables + (long)s * t_stride, kv_lens[s], bs, hkv,
                             kvh, m, l, acc, out + (long)row * hq * D);
    }
    free(t.qt);
}

/* Attention of S sequences over the paged cache: sequence s owns query tokens cu[s]..cu[s+1]-1
   (cu NULL: one each), the last of its kv_lens[s] own keys; query i of it sees its group's
   prefix (prefix_of[s] >= 0) and its own keys up to its own position. out: [T][hq][D]. */
void pf_attention_f32(const float *q, long q_stride_t, long q_stride_h,
                      const float *kc, const float *vc, int bs, int hkv, int D,
                      const int32_t *cu, const int32_t *kv_lens, const int32_t *tables,
                      int t_stride, const int32_t *prefix_of, const int32_t *prefix_lens,
                      const int32_t *prefix_tables, int p_stride,
                      float *out, int S, int hq, float scale) {
    int G = hq / hkv, per_tile = MAX_R / G > 0 ? MAX_R / G : 1;
    /* Single queries of one group, as many as fill one vector of rows, share a tile when
       they fill at least half of it (fewer: each streams the prefix alone, which costs less
       than the empty lanes). */
    int per_group_tile = JB / G, min_group_tile = (JB / 2 + G - 1) / G;
    /* Work items (first sequence, then: first query of a chunk's tile, or -count for a group
       tile of single queries). */
    int n = 0;
    for (int s = 0; s < S; s++) {
        int q_len = cu ? cu[s + 1] - cu[s] : 1;
        n += q_len <= 1 ? 1 : (q_len + per_tile - 1) / per_tile;
    }
    int32_t *items = malloc(sizeof(int32_t) * 2 * (n > 0 ? n : 1));
    if (!items) return;
    n = 0;
    for (int s = 0; s < S;) {
        int q_len = cu ? cu[s + 1] - cu[s] : 1, p = prefix_of ? prefix_of[s] : -1, count = 0;
        if (q_len == 1 && p >= 0 && per_group_tile >= 2)
            while (s + count < S && count < per_group_tile && prefix_of[s + count] == p
                   && (cu ? cu[s + count + 1] - cu[s + count] : 1) == 1)
                count++;
        if (count >= 2 && count >= min_group_tile) {
            items[2 * n] = s;
            items[2 * n + 1] = -count;
            n++;
            s += count;
            continue;
        }
        for (int i0 = 0; i0 < q_len; i0 += per_tile, n++) {
            items[2 * n] = s;
            items[2 * n + 1] = i0;
        }
        s++;
    }
    #pragma omp parallel for schedule(dynamic, 1)
    for (int w = 0; w < n * hkv; w++) {
        int s = items[2 * (w / hkv)], i0 = items[2 * (w / hkv) + 1], kvh = w %% hkv;
        int first = cu ? cu[s] : s, q_len = cu ? cu[s + 1] - cu[s] : 1;
        int p = prefix_of ? prefix_of[s] : -1;
        const int32_t *pt = p >= 0 ? prefix_tables + (long)p * p_stride : NULL;
        int p_len = p >= 0 ? prefix_lens[p] : 0;
        const int32_t *table = tables + (long)s * t_stride;
        if (i0 < 0) {
            group_decode_tile(q, q_stride_t, q_stride_h, kc, vc, bs, hkv, D, G, kvh, cu, s, -i0,
                              kv_lens, tables, t_stride, pt, p_len, out, hq, scale);
        } else if (q_len == 1) {
            decode_query(q + (long)first * q_stride_t, q_stride_h, kc, vc, bs, hkv, D, G, kvh,
                         table, kv_lens[s], pt, p_len, out + (long)first * hq * D, scale);
        } else {
            int i1 = i0 + per_tile < q_len ? i0 + per_tile : q_len;
            chunk_tile(q + (long)first * q_stride_t, q_stride_t, q_stride_h, kc, vc, bs, hkv, D,
                       G, kvh, i0, i1, kv_lens[s] - q_len, table, pt, p_len,
                       out + (long)first * hq * D, hq, scale);
        }
    }
    free(items);
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
"""

# Not -ffast-math: linking a shared library with it runs crtfastmath's constructor, which sets
# flush-to-zero for the whole process (every later float op loses subnormals; hypothesis caught
# it). The subset below lets the compiler reorder float sums, which is what vectorising the dot
# products needs; the kernel never forms an infinity or NaN (the running max starts at -FLT_MAX).
_FLAGS = [*cpu_build.NATIVE_FLAGS, "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math"]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use in this CPU's vector width; None where no C
    compiler can build it."""
    ptr, long_, int_, float_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    sizes = dict(max_d=MAX_HEAD_DIM, max_g=MAX_GQA_GROUP, max_bs=MAX_BLOCK_SIZE, jb=cpu_build.vector_floats())
    return cpu_build.load(
        "cpu_kernels",
        _SOURCE % sizes,
        _FLAGS,
        {
            "pf_attention_f32": [
                ptr,
                long_,
                long_,
                ptr,
                ptr,
                int_,
                int_,
                int_,
                ptr,
                ptr,
                ptr,
                int_,
                ptr,
                ptr,
                ptr,
                int_,
                ptr,
                int_,
                int_,
                float_,
            ],
            "pf_write_kv_f32": [ptr, long_, long_, ptr, long_, long_, ptr, ptr, ptr, int_, int_, int_],
        },
    )


def build() -> bool:
    """Build the library now (`prefixflow prepare`; otherwise the first attention call does);
    whether it is there."""
    return _library() is not None


def available(*tensors: torch.Tensor) -> bool:
    """The library is built and every tensor is a float32 CPU one with unit stride in its
    last dim (what each kernel reads)."""
    for t in tensors:  # a loop, not all(generator): every layer of every step asks
        if t.dtype is not torch.float32 or not t.is_cpu or t.stride(-1) != 1:
            return False
    return cpu_build.enabled() and _library() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `AttentionCall` takes these tensors (else use the reference)."""
    _, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    return (
        k_cache.is_contiguous()
        and d <= MAX_HEAD_DIM
        and bs <= MAX_BLOCK_SIZE
        and hq // hkv <= MAX_GQA_GROUP
        and available(q, k_cache)
    )


def write_kv_cpu(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k, v: [T, Hkv, D] float32 (unit stride in D) into contiguous caches [blocks,
    block_size, Hkv, D] at slots [T] int64 (contiguous; < 0 skipped, the rest checked by the
    caller to be inside the cache)."""
    t, hkv, d = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots.is_contiguous()
    lib = _library()
    if lib is None:
        raise RuntimeError("write_kv_cpu: the CPU kernels are not built here; check `available()` first")
    lib.pf_write_kv_f32(
        k.data_ptr(),
        k.stride(0),
        k.stride(1),
        v.data_ptr(),
        v.stride(0),
        v.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        t,
        hkv,
        d,
    )


def check_tables(
    num_blocks: int,
    block_size: int,
    kv_lens: list[int],
    block_tables: torch.Tensor,
    prefix_lens: Sequence[int] = (),
    prefix_block_tables: torch.Tensor | None = None,
) -> None:
    """ValueError unless every key the kernel will read is inside the cache (host values)."""
    tables = [(block_tables, kv_lens)]
    if prefix_block_tables is not None:
        tables.append((prefix_block_tables, list(prefix_lens)))
    for table, lens in tables:
        for row, n in zip(table.tolist(), lens):
            used = row[: -(-n // block_size)]
            if n < 0 or len(used) * block_size < n or any(b < 0 or b >= num_blocks for b in used):
                raise ValueError(
                    f"a block table row {row[:8]}... does not hold {n} keys in a cache of {num_blocks} blocks"
                )


class AttentionCall:
    """The C attention with one step's metadata bound: its pointers and sizes are read once,
    then each layer's call is one C call (at decode sizes the per-call Python of a layer cost
    as much as the kernel: SmolLM2, 30 layers a step). Holds the metadata tensors, so the
    pointers stay valid while it lives.

    Query i of sequence s attends, in one softmax, to the prefix_lens[p] keys of
    prefix_block_tables[p] when p = prefix_of[s] >= 0, then causally to its own keys: the
    first kv_lens[s] - q_len + i + 1 of them (its q_len queries are its last q_len keys).
    Sequence s owns query rows cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1 (None: one row each, a
    decode step). kv_lens [S], block_tables [S, W], prefix_of [S], prefix_lens [G],
    prefix_block_tables [G, W'], cu_seqlens_q [S + 1]: int32, contiguous. Callers check
    `supports` first, and the values once per step (`check_tables`): the C code trusts them.
    """

    __slots__ = ("_tensors", "_meta", "_num_seqs")

    def __init__(
        self,
        kv_lens: torch.Tensor,
        block_tables: torch.Tensor,
        prefix_of: torch.Tensor | None = None,
        prefix_lens: torch.Tensor | None = None,
        prefix_block_tables: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
    ) -> None:
        assert block_tables.is_contiguous() and kv_lens.is_contiguous()
        p_ptr = pl_ptr = pt_ptr = cu_ptr = None
        p_stride = 0
        if prefix_of is not None:
            assert prefix_lens is not None and prefix_block_tables is not None
            assert prefix_of.is_contiguous() and prefix_block_tables.is_contiguous()
            p_ptr, pl_ptr = prefix_of.data_ptr(), prefix_lens.data_ptr()
            pt_ptr, p_stride = prefix_block_tables.data_ptr(), prefix_block_tables.stride(0)
        if cu_seqlens_q is not None:
            assert cu_seqlens_q.is_contiguous()
            cu_ptr = cu_seqlens_q.data_ptr()
        self._tensors = (kv_lens, block_tables, prefix_of, prefix_lens, prefix_block_tables, cu_seqlens_q)
        self._meta = (
            cu_ptr,
            kv_lens.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            p_ptr,
            pl_ptr,
            pt_ptr,
            p_stride,
        )
        self._num_seqs = kv_lens.shape[0]

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, out: torch.Tensor
    ) -> torch.Tensor:
        """q, out: [T, Hq, D] float32 (unit stride in D), the queries of the S sequences
        concatenated; k_cache, v_cache: [blocks, block_size, Hkv, D] float32, contiguous."""
        if not out.is_contiguous():
            return out.copy_(self(q, k_cache, v_cache, scale, torch.empty(out.shape)))
        _, hq, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        lib = _library()
        if lib is None:
            raise RuntimeError("AttentionCall: the CPU kernels are not built here; check `supports()` first")
        lib.pf_attention_f32(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            bs,
            hkv,
            d,
            *self._meta,
            out.data_ptr(),
            self._num_seqs,
            hq,
            scale,
        )
        return out
