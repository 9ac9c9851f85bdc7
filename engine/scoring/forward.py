"""Hybrid prefilling with suffix KV discarding, for prefill-only requests (PrefillOnly Sec. 4, 5.1).

A scoring request runs through the model in ONE forward pass, layer after layer, and keeps no KV
after it. In each layer:

  pass A (chunked):  input norm, q/k/v projections and rotary, `chunk_size` tokens at a time;
                     q goes into a preallocated [T, Hq*D] buffer, k/v into this layer's KV
                     buffer, right after the group's prefix KV (copied in);
  attention:         every query against all keys up to its position (the whole sequence; the
                     queries are tiled only to bound the causal mask), outputs written back into
                     the q buffer rows (a row's query is dead once its output exists);
  pass B (chunked):  o_proj, residual add, post-attention norm, MLP, residual add, in place on
                     the residual stream.

Sec. 4.2: the non-attention layers are token-wise, so chunking them changes no result, while
their intermediates ([C, 2I] for gate/up) are what dominates the peak; chunking bounds them by
the chunk. Outputs go into preallocated buffers (Sec. 4.3 "output preallocation", "in-place"),
never concatenated. The full-length tensors are the residual stream [T, H], the q/o buffer
[T, Hq*D] and ONE layer's K/V [Hkv, P+T, D], reused by every layer. The last layer only needs
the last query (only the last position reaches the LM head), so its attention and pass B run on
one row. A group's shared prefix is computed once with `keep_kv=True`; its K/V of every layer
([L, Hkv, P, D], `PrefixKV`) is what the group keeps until its last member (Sec. 5.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

import torch
import torch.nn.functional as F

from prefixflow.kernels.rotary import apply_rotary
from prefixflow.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from prefixflow.engine.models.model_args import ModelArgs
from prefixflow.errors import require

MASK_BYTES = 8 << 20
Head = Literal["logits", "last", "sum", "none"]


@dataclass(frozen=True, slots=True)
class PrefixKV:
    """A shared prefix's K and V for every layer. k, v: [L, Hkv, P, D] in the model dtype;
    hidden_sum: the sum of its tokens' final hidden states, kept for mean pooling (embed)."""

    k: torch.Tensor
    v: torch.Tensor
    hidden_sum: torch.Tensor | None = field(default=None, compare=False)  # [H] fp32, mean pooling

    @property
    def length(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@torch.inference_mode()
def hybrid_forward(
    model: LlamaForCausalLM,
    token_ids: torch.Tensor,
    prefix: PrefixKV | None,
    chunk_size: int,
    keep_kv: bool = False,
    head: Head = "logits",
    lengths: Sequence[int] | None = None,
) -> tuple[torch.Tensor | None, PrefixKV | None]:
    """Run `token_ids` (positions P .. P+T-1 after `prefix`, P = prefix.length or 0).

    token_ids: [T >= 1] int64 on the model's device.
    lengths: `token_ids` is several requests packed one after another (Prepacking), each
        `lengths[i]` tokens at positions P .. P+len-1 after the same prefix, attending to the
        prefix and to its own tokens only; the head's answer then has one row per request
        ([S, V] or [S, H]). None: one request.
    keep_kv: return the K/V of prefix + these tokens for every layer (a group's shared prefix).
    head: what to return of the final hidden states (after the model's last norm):
        "logits" the next-token logits after the last token, [V] fp32; "last" the last
        token's hidden state, [H] fp32; "sum" the sum of these tokens' hidden states, [H] fp32
        (mean pooling: the last layer then answers every query, not only the last);
        "none" nothing (a prefix computed for its KV alone).
    """
    a = model.args
    t, p = int(token_ids.shape[0]), prefix.length if prefix is not None else 0
    w = model.lm_head.weight
    kv_shape = (a.num_kv_heads, p + t, a.head_dim)
    store = torch.empty((2, a.num_layers) + kv_shape, dtype=w.dtype, device=w.device) if keep_kv else None
    scratch = None if keep_kv else torch.empty((2,) + kv_shape, dtype=w.dtype, device=w.device)
    r = model.model.embed_tokens(token_ids)  # [T, H] residual
    q_buf = torch.empty(t, a.num_heads * a.head_dim, dtype=r.dtype, device=r.device)
    positions, allowed = _packing(lengths, p, t, r.device)
    for i, layer in enumerate(model.model.decoder_layers()):
        kv = store[:, i] if store is not None else scratch  # [2, Hkv, P+T, D]
        assert kv is not None, "scratch is allocated when keep_kv is False"
        if prefix is not None:
            kv[0, :, :p] = prefix.k[i]
            kv[1, :, :p] = prefix.v[i]
        last = i == a.num_layers - 1
        every = head == "sum" or lengths is not None  # packed: each request's last row is needed
        q_lo = 0 if not last or every else (t if head == "none" else t - 1)  # queries to answer
        _project_qkv(model, layer, r, positions, q_buf, kv, p, chunk_size)
        if q_lo < t:
            _attend(q_buf, kv, p, q_lo, chunk_size, a, layer.self_attn.attn.scale, allowed)
            _mlp_block(layer, r, q_buf, q_lo, chunk_size)
    kept = PrefixKV(store[0], store[1]) if store is not None else None
    if head == "none":
        return None, kept
    ends = np.cumsum(lengths if lengths is not None else [t])
    if head == "sum":
        sums = [_final_norm(model, r[e - n : e], chunk_size).sum(0) for e, n in zip(ends, np.diff(ends, prepend=0))]
        return (torch.stack(sums) if lengths is not None else sums[0]), kept
    h = model.model.norm(r[torch.as_tensor(ends - 1, device=r.device)])  # [S, H]
    out = model.lm_head(h) if head == "logits" else h.float()
    return (out if lengths is not None else out[0]), kept


def _packing(
    lengths: Sequence[int] | None, p: int, t: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Positions of the T tokens, and for packed requests which keys each may attend ([T, P+T]
    bool: the prefix's, and its own request's up to itself); None: one request, causal."""
    if lengths is None:
        return torch.arange(p, p + t, device=device), None
    require(
        sum(lengths) == t and min(lengths) >= 1, "hybrid_forward", "lengths", list(lengths), f"sum to {t}, each >= 1"
    )
    request = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.as_tensor(lengths, device=device)
    )
    starts = torch.as_tensor(np.cumsum([0, *lengths[:-1]]), device=device)
    positions = p + torch.arange(t, device=device) - starts[request]
    own = (request[:, None] == request[None, :]) & (
        torch.arange(t, device=device)[None, :] <= torch.arange(t, device=device)[:, None]
    )
    allowed = torch.cat([torch.ones(t, p, dtype=torch.bool, device=device), own], dim=1)
    return positions, allowed


def _final_norm(model: LlamaForCausalLM, r: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per chunk, the sum over its rows of the final norm of `r`: [T / chunk, H] fp32 (the
    norm of every row at once would be another [T, H])."""
    return torch.stack([model.model.norm(r[lo : lo + chunk]).float().sum(0) for lo in range(0, r.shape[0], chunk)])


def _project_qkv(
    model: LlamaForCausalLM,
    layer: LlamaDecoderLayer,
    r: torch.Tensor,
    positions: torch.Tensor,
    q_buf: torch.Tensor,
    kv: torch.Tensor,
    p: int,
    chunk: int,
) -> None:
    """Pass A: q into q_buf rows, rotated k and v into kv[:, :, p + rows]."""
    attn = layer.self_attn
    t = r.shape[0]
    for lo in range(0, t, chunk):
        hi = min(t, lo + chunk)
        n = hi - lo
        h = layer.input_layernorm(r[lo:hi])  # [n, H]
        q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        cos, sin = model.model.rotary(positions[lo:hi], h.dtype)  # [n, 1, D]
        q, k = attn.normed(q.view(n, attn.num_heads, attn.head_dim), k.view(n, attn.num_kv_heads, attn.head_dim))
        q_buf[lo:hi] = apply_rotary(q, cos, sin).view(n, -1)
        k = apply_rotary(k, cos, sin)  # [n, Hkv, D]
        kv[0, :, p + lo : p + hi] = k.transpose(0, 1)
        kv[1, :, p + lo : p + hi] = v.view(n, attn.num_kv_heads, attn.head_dim).transpose(0, 1)


def attention_tile(num_keys: int, chunk_size: int) -> int:
    """Query rows per SDPA call: SDPA turns the bool mask [rows, keys] into a float one, so
    rows are capped to keep that under MASK_BYTES (and at chunk_size)."""
    return max(16, min(chunk_size, MASK_BYTES // (4 * max(1, num_keys))))


def _attend(
    q_buf: torch.Tensor,
    kv: torch.Tensor,
    p: int,
    q_lo: int,
    chunk: int,
    a: ModelArgs,
    scale: float,
    allowed: torch.Tensor | None = None,
) -> None:
    """Causal attention of query rows q_lo..T-1 (positions p+row) over kv[:, :, :p+row+1];
    outputs overwrite the q rows. SDPA's flash kernels (CPU and CUDA) never materialise the
    scores; only the causal mask of a query tile is materialised. allowed: packed requests'
    mask ([T, P+T], _packing), instead of the causal one."""
    t = q_buf.shape[0]
    tile = attention_tile(p + t, chunk)
    for lo in range(q_lo, t, tile):
        hi = min(t, lo + tile)
        n, kv_len = hi - lo, p + hi
        q = q_buf[lo:hi].view(n, a.num_heads, a.head_dim).transpose(0, 1).unsqueeze(0)
        k = kv[0, :, :kv_len].unsqueeze(0)  # [1, Hkv, L, D]
        v = kv[1, :, :kv_len].unsqueeze(0)
        mask, causal = None, False
        if allowed is not None:
            mask = allowed[lo:hi, :kv_len]
        elif n > 1 and p + lo == 0:
            causal = True  # square: top-left causal is right
        elif n > 1:
            rows = torch.arange(p + lo, p + hi, device=q.device).unsqueeze(1)
            mask = torch.arange(kv_len, device=q.device).unsqueeze(0) <= rows  # [n, L]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )  # [1, Hq, n, D]
        q_buf[lo:hi] = o[0].transpose(0, 1).reshape(n, -1)


def _mlp_block(layer: LlamaDecoderLayer, r: torch.Tensor, o_buf: torch.Tensor, q_lo: int, chunk: int) -> None:
    """Pass B on rows q_lo..T-1: r += o_proj(o); r += mlp(norm(r)), in place."""
    t = r.shape[0]
    for lo in range(q_lo, t, chunk):
        hi = min(t, lo + chunk)
        r[lo:hi] += layer.self_attn.o_proj(o_buf[lo:hi])
        r[lo:hi] += layer.mlp(layer.post_attention_layernorm(r[lo:hi]))


def forward_bytes(
    a: ModelArgs, elem: int, num_tokens: int, prefix_len: int, chunk_size: int, keep_kv: bool = False
) -> int:
    """Predicted peak bytes of `hybrid_forward` beyond the weights (the maximum-input-length
    model; Sec. 3.1 profiles it, we count it): full-length buffers (residual [T, H], q/o
    [T, Hq*D], one layer's K/V or, with keep_kv, every layer's), the group's prefix KV, and one
    chunk's transients (pass B's gate/up [C, 2I] and product dominate) plus the attention tile's
    mask (bool and SDPA's float copy, [tile, P+T])."""
    t, p, c = num_tokens, prefix_len, min(chunk_size, num_tokens)
    kv_token = 2 * a.num_kv_heads * a.head_dim
    full = t * (a.hidden_size + a.num_heads * a.head_dim) + 8 * t // elem  # + token ids
    layer_kv = (p + t) * kv_token * (a.num_layers if keep_kv else 1)
    prefix_kv = p * kv_token * a.num_layers
    qkv = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    chunk_a = c * (a.hidden_size + 2 * qkv)  # norm out, qkv, rotary temps
    chunk_b = c * (2 * a.hidden_size + 4 * a.intermediate_size)  # gate_up, silu, product, out
    mask = 5 * min(c, attention_tile(p + t, chunk_size)) * (p + t)
    return elem * (full + layer_kv + prefix_kv + max(chunk_a, chunk_b)) + mask


def max_input_len(
    a: ModelArgs, elem: int, budget_bytes: int, prefix_len: int, chunk_size: int, max_model_len: int
) -> int:
    """Longest prompt (prefix included) whose `forward_bytes` fits `budget_bytes`; 0 if none."""
    lo, hi = 0, max(0, max_model_len - prefix_len)
    while lo < hi:  # forward_bytes rises with num_tokens
        mid = (lo + hi + 1) // 2
        if forward_bytes(a, elem, mid, prefix_len, chunk_size) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return prefix_len + lo if lo > 0 else 0
