"""Llama-family decoder (Llama, Mistral, Qwen2) over flat token batches with a paged KV cache.

The three architectures differ only in configuration: Qwen2 adds q/k/v biases, Mistral may
declare a sliding window (we support it only when it covers the whole context), Llama 3.1 uses
"llama3" rope scaling. Weights keep Hugging Face's names except two fused projections:
`qkv_proj` = [q; k; v] and `mlp.gate_up_proj` = [gate; up], stacked on the output dim
(`load_weight` copies HF tensors into the right slice).
"""

from __future__ import annotations

import torch
from torch import nn

from prefixflow.engine.models.layers.attention import AttentionMetadata, PagedAttention
from prefixflow.engine.models.layers.embedding import LMHead
from prefixflow.engine.models.layers.linear import Linear
from prefixflow.engine.models.layers.mlp import SiluMLP
from prefixflow.engine.models.layers.norm import RMSNorm
from prefixflow.engine.models.layers.rotary import RotaryEmbedding
from prefixflow.engine.models.model_args import ModelArgs
from prefixflow.kernels import cpu_exact
from prefixflow.kernels.rotary import apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.num_heads, self.num_kv_heads = args.num_heads, args.num_kv_heads
        self.head_dim = args.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=False)
        self.attn = PagedAttention(args.num_heads, args.num_kv_heads, args.head_dim)
        if args.qk_norm:  # Qwen3: each query and key head normalized before rotary
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.qk_norm = args.qk_norm

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        queries: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """x: [T, H] -> [T, H]; with `queries` (the last layer's view) every row's K/V is
        written and only the rows queries.rows are answered: -> [N, H]."""
        t, hqk = x.shape[0], self.num_heads + self.num_kv_heads
        heads = self.qkv_proj(x).view(t, hqk + self.num_kv_heads, self.head_dim)
        # q and k rotate in one call: their heads are adjacent in each row of qkv.
        qk, v = heads[:, :hqk], heads[:, hqk:]
        if self.qk_norm:  # a new contiguous tensor: the rotary then works in place on it
            qk = torch.cat(self.normed(qk[:, : self.num_heads], qk[:, self.num_heads :]), dim=1)
        if cpu_exact.supports_rotary(qk, cos, sin):
            cpu_exact.rotary_(qk, cos, sin)  # in place, one C call (v stays a view)
        else:
            qk = apply_rotary(qk, cos, sin)  # [T, Hq+Hkv, D]; v stays a view (the kernels take strides)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, Hq|Hkv, D]
        if queries is not None:
            q = q[queries.rows]  # [N, Hq, D]
        o = self.attn(q, k, v, meta, queries)  # [T|N, Hq, D]
        out: torch.Tensor = self.o_proj(o.reshape(o.shape[0], self.q_size))  # [T|N, H]
        return out

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] through Qwen3's per-head norms (as they are for the other
        models). Every forward path (this one, engine/scoring/forward.py) calls it."""
        if not self.qk_norm:
            return q, k
        d = self.head_dim
        return self.q_norm(q.reshape(-1, d)).view(q.shape), self.k_norm(k.reshape(-1, d)).view(k.shape)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args)
        self.mlp = SiluMLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        queries: AttentionMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Pre-norm block; `residual` carries the stream, x the last sublayer's output. With
        # `queries` (the last layer), rows other than queries.rows stop after their K/V.
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta, queries)
        if queries is not None:
            residual = residual[queries.rows]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        # Built on the meta device (loader.py): an uninitialised weight, since the random init
        # there goes through torch's Python refs, whose first use imports torch._dynamo (2.6 s
        # of a 5 s SmolLM2 load on a CPU); the checkpoint's weights replace it anyway.
        self.embed_tokens = nn.Embedding(
            args.vocab_size, args.hidden_size, _weight=torch.empty(args.vocab_size, args.hidden_size)
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = RotaryEmbedding(args.head_dim, max_positions, args.rope)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """`layers` as what they are (an nn.ModuleList gives them back as plain Modules)."""
        layers = [layer for layer in self.layers if isinstance(layer, LlamaDecoderLayer)]
        assert len(layers) == len(self.layers), "LlamaModel.layers holds only LlamaDecoderLayers"
        return layers


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta, logits_indices [N]) -> logits [N, V] fp32."""

    # HF weight name suffix -> (our parameter suffix, index of the slice in the fused tensor)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args, max_positions)
        # A base model has no LM head: the embedding stands in for it (never asked for logits:
        # the engines that would ask refuse such a model, require_lm_head).
        tied = self.model.embed_tokens if args.tie_word_embeddings or not args.has_lm_head else None
        self.lm_head = LMHead(args.hidden_size, args.vocab_size, tied)
        # A sequence classifier's head (transformers' `score`): label logits of the last token.
        self.score = nn.Linear(args.hidden_size, len(args.labels), bias=False) if args.labels else None

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them (again after
        `to_empty()`, which gives every module fresh parameters)."""
        if self.args.tie_word_embeddings or not self.args.has_lm_head:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.decoder_layers()]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64; logits_indices: [N] int64 rows of the last layer's
        output (the step's rows, or meta.last_layer's) whose next-token logits are wanted.
        Returns [N, V] fp32."""
        x = self.model.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.model.rotary(positions, x.dtype)
        residual: torch.Tensor | None = None
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, meta, meta.last_layer if i == last else None)
        if residual is None:
            raise ValueError("the model has no decoder layers (ModelArgs.num_layers is 0)")
        # Only the sampled rows go through the last residual add, the final norm and the head.
        x, _ = self.model.norm(x[logits_indices], residual[logits_indices])  # [N, H]
        logits: torch.Tensor = self.lm_head(x)  # [N, V] fp32
        return logits

    def slice_of(self, hf_name: str) -> tuple[str, slice | None]:
        """Our parameter name and row slice for a Hugging Face weight name."""
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in self.packed_modules:
            fused, index = self.packed_modules[parts[-2]]
            sizes = self._fused_sizes(fused)
            start = sum(sizes[:index])
            return ".".join(parts[:-2] + [fused, parts[-1]]), slice(start, start + sizes[index])
        return hf_name, None

    def _fused_sizes(self, fused: str) -> list[int]:
        a = self.args
        if fused == "qkv_proj":
            kv = a.num_kv_heads * a.head_dim
            return [a.num_heads * a.head_dim, kv, kv]
        return [a.intermediate_size, a.intermediate_size]
