"""Token embedding and the language-model head (logits only for the rows that are sampled)."""

from __future__ import annotations

import torch
from torch import nn

from prefixflow.engine.models.layers.linear import linear, packed_for_cpu


class LMHead(nn.Module):
    """logits = hidden @ weight.T in fp32. `weight` is the embedding's when tied.

    Only the hidden states of sampled positions reach this layer (one per chunk that samples),
    never the whole step: for a 2k-token prefill chunk that is 1 row instead of 2048.
    """

    def __init__(self, hidden_size: int, vocab_size: int, tied_embedding: nn.Embedding | None = None) -> None:
        super().__init__()
        if tied_embedding is not None:
            self.weight = tied_embedding.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    packed: torch.Tensor | None = None

    def prepack_for_cpu(self) -> bool:
        """A oneDNN copy of the weight (engine/models/layers/linear.py). The dense weight stays: the
        embedding may share it, and the score task reads rows of it. Costs vocab x hidden
        floats (113 MB for SmolLM2) and reads them faster at decode sizes."""
        self.packed = packed_for_cpu(self.weight)
        return self.packed is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] (model dtype) -> [N, V] fp32
        return linear(hidden, self.weight, self.packed).float()
