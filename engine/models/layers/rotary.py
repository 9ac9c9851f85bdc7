"""Rotary position embeddings (RoPE) with the scalings of the supported checkpoints.

Frequencies follow Hugging Face's `modeling_rope_utils` exactly (same fp32 operations), so the
engine's logits match transformers': "default", "linear" (positions divided by `factor`) and
"llama3" (Llama 3.1's frequency-dependent scaling). The cos/sin table is computed once for all
positions up to `max_positions` and indexed by each token's position; the rotation itself,
`apply_rotary`, is kernels/rotary.py's (Triton on CUDA; the CPU C kernel checks itself against
its torch version).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from prefixflow.engine.models.model_args import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies, as HF computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    band = rope.high_freq_factor - rope.low_freq_factor
    smooth = (old_len / wavelen - rope.low_freq_factor) / band
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds `cos_sin`: [max_positions, 2, head_dim] fp32 (a non-persistent buffer).

    Models built on the meta device call `reset_cache()` after `to_empty()` (which also restores
    fp32 after a cast of the whole model to another dtype).
    """

    cos_sin: torch.Tensor  # the buffer, registered in __init__

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = rope
        self.register_buffer("cos_sin", torch.empty(max_positions, 2, head_dim), persistent=False)
        self.reset_cache()

    @torch.no_grad()
    def reset_cache(self) -> None:
        if self.cos_sin.is_meta:
            return
        inv_freq = inverse_frequencies(self.head_dim, self.rope)  # [D/2]
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        table = torch.stack([emb.cos(), emb.sin()], dim=1)  # [P, 2, D]
        # Re-assigned, not copied: the table stays fp32 whatever dtype the model was cast to.
        self.cos_sin = table.to(self.cos_sin.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, 1, D] in `dtype` (broadcast over heads)."""
        cs = self.cos_sin[positions].to(dtype)  # [T, 2, D]
        return cs[:, 0:1], cs[:, 1:2]
