"""Decode steps on persistent buffers, padded to a ladder of batch sizes; on CUDA, one captured
graph per size, replayed each step (`EngineConfig.cuda_graphs`).

A decode step (every sequence one new token, every token sampled, no K/V copies) is the same
program step after step; only the values change: token ids, positions, slots, KV lengths, block
tables and, for members of prefix groups, the groups' descriptors. So its inputs live in
buffers allocated once, filled in place, and sized to the next rung of a ladder of batch sizes
(1, 2, 4, 8, then steps of 8 to 64, then of 32): a captured CUDA graph reads the same addresses
at every replay, and a step of S sequences runs the graph of the smallest rung >= S, its extra
rows padding. Steps that are not pure decode, or larger than the top rung, run as before.

Padding rows compute garbage that nobody reads: token 0 at position 0, K/V written nowhere
(slot -1), one key (block 0's first slot, finite: the cache starts zeroed), no prefix group.
Block tables are as wide as max_model_len needs, so any length fits without a new shape; the
prefix groups of a grouped rung are padded to the rung's size with groups of no members (one
key each, never read). A rung has two programs: without prefix groups (the paged decode kernel)
and with them (the prefix-shared kernel); each is a graph of its own.

On a CPU, or on CUDA before a capture, the same buffers run the model eagerly: the path the CPU
tests check against the step built afresh (engine/native/model_runner.py). The capture code
(`capture`) is the only CUDA-only code; `gpu_suite` verified it on an H200 (README), and the
engine a job builds with it, so it is on by default where it can be captured
(`model_runner.GRAPHS_BY_DEFAULT`). Memory: the graphs share one pool, whose peak is a decode
step of the top rung (the model runner keeps that much more out of the KV budget), and write
their logits into one [top rung, vocab] buffer. A step of S rows on rung R reads every block
table as wide as max_model_len: the kernels pick their split-K counts from that width, so short
contexts run the most splits (correct, and cheap beside the launches a graph saves). On a CPU the static
buffers are for testing: no graph, and padding rows computed for nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixflow.engine.models.layers.attention import AttentionMetadata
from prefixflow.engine.native.phases import FORWARD, PREPARE, phase
from prefixflow.engine.native.step_batch import StepBatch

PAD_SLOT = -1  # write_kv_cache skips it
MAX_LADDER_BATCH = 256  # the top rung, whatever the request cap (larger decode steps run eagerly)


def ladder(max_batch: int) -> tuple[int, ...]:
    """Batch sizes that get buffers (and graphs): 1, 2, 4, 8, steps of 8 to 64, steps of 32
    after, up to max_batch (itself the top rung). Padding is under half a rung up to 16 rows,
    under a third up to 24 and beyond 64, under a quarter between."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(96, max_batch + 1, 32)]
    rungs = [s for s in sizes if s < max_batch] + [max_batch]
    return tuple(sorted(set(rungs)))


@dataclass(frozen=True, slots=True)
class Rung:
    """One (batch size, grouped) program: views of the persistent buffers, built once, so that
    every step passes the same tensors (a graph's addresses; the kernels' once-per-step memo,
    kernels/_common.once_per_step, sees their versions change)."""

    size: int
    grouped: bool
    ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    meta: AttentionMetadata


class StaticDecode:
    """Persistent decode buffers for a model, its KV cache geometry and a ladder.

    forward(ids, positions, meta, logits_indices) -> logits is the model's call;
    max_blocks: block table width (ceil(max_model_len / block_size)).
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor],
        max_batch: int,
        max_blocks: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.sizes = ladder(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        self.device = device
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # what the graphs write: [top rung, vocab] fp32
        self.capture_s = 0.0
        self.steps_run = 0  # decode steps run on the buffers, and how many of them replayed a graph
        self.graph_replays = 0
        b, i64, i32 = self.max_batch, torch.int64, torch.int32
        with torch.inference_mode(False):  # normal tensors: their versions count the fills
            self.ids = torch.zeros(b, dtype=i64, device=device)
            self.positions = torch.zeros(b, dtype=i64, device=device)
            self.slots = torch.full((b,), PAD_SLOT, dtype=i64, device=device)
            self.rows = torch.arange(b, dtype=i64, device=device)  # logits_indices: every row
            self.cu = torch.arange(b + 1, dtype=i32, device=device)  # one query per sequence
            self.kv_lens = torch.ones(b, dtype=i32, device=device)
            self.tables = torch.zeros(b, max_blocks, dtype=i32, device=device)
            self.prefix_lens = torch.ones(b, dtype=i32, device=device)
            self.prefix_tables = torch.zeros(b, max_blocks, dtype=i32, device=device)
            self.ranges = torch.zeros(b + 1, dtype=i32, device=device)
            self.rungs = {(s, g): self._rung(s, g) for s in self.sizes for g in (False, True)}

    def _rung(self, size: int, grouped: bool) -> Rung:
        groups = size if grouped else 0
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            cu_seqlens_q=self.cu[: size + 1],
            kv_lens=self.kv_lens[:size],
            block_tables=self.tables[:size],
            prefix_lens=self.prefix_lens[:groups],
            prefix_block_tables=self.prefix_tables[:groups],
            prefix_seq_ranges=self.ranges[: groups + 1],
            is_prefill_only=False,
            is_decode_only=not grouped,
        )
        return Rung(size, grouped, self.ids[:size], self.positions[:size], self.rows[:size], meta)

    def rung_for(self, batch: StepBatch) -> Rung | None:
        """The rung a step runs on, or None when it is no pure decode step (one token and one
        sample per sequence) of at most the top rung's size. A step's K/V copies are made by
        the runner before either path. Block tables wider than max_blocks never occur (they
        cover at most max_model_len) but are refused the same way."""
        s = batch.num_seqs
        is_decode = batch.num_tokens == s == batch.num_sampled and batch.last is None
        if not is_decode or s > self.max_batch or max(batch.max_blocks, batch.max_prefix_blocks) > self.max_blocks:
            return None
        size = next(r for r in self.sizes if r >= s)
        return self.rungs[(size, batch.num_prefixes > 0)]

    def run(self, batch: StepBatch, rung: Rung) -> torch.Tensor:
        """The step's logits [S, V] fp32 in the batch's sampled order (a copy: the graph's
        output is overwritten by the next replay)."""
        with phase(PREPARE):
            self._fill(batch, rung)
            order = torch.from_numpy(batch.int64_buffer[3 * batch.num_tokens :]).to(self.device, non_blocking=True)
        self.steps_run += 1
        with phase(FORWARD):
            graph = self.graphs.get((rung.size, rung.grouped))
            if graph is None:
                logits = self.forward(rung.ids, rung.positions, rung.meta, rung.logits_indices)
            else:
                assert self.logits is not None, "capture() sets the graphs' logits buffer"
                graph.replay()
                self.graph_replays += 1
                logits = self.logits[: rung.size]
            return logits.index_select(0, order)

    def _fill(self, batch: StepBatch, rung: Rung) -> None:
        """Copy the step's arrays into the rung's buffers; pad the rows and groups past the step's."""
        s, g, b = batch.num_seqs, batch.num_prefixes, rung.size
        host64 = torch.from_numpy(batch.int64_buffer[: 3 * s].reshape(3, s))
        ids, positions, slots = host64.to(self.ids.device, non_blocking=True)
        self.ids[:s].copy_(ids)
        self.positions[:s].copy_(positions)
        self.slots[:s].copy_(slots)
        w, pw = batch.max_blocks, batch.max_prefix_blocks
        # cu_seqlens_q is skipped: one query per sequence, the static arange
        _, kv_lens, tables, p_lens, p_tables, ranges = torch.from_numpy(batch.int32_buffer).split(
            [s + 1, s, s * w, g, g * pw, g + 1]
        )
        self.kv_lens[:s].copy_(kv_lens, non_blocking=True)
        self.tables[:s, :w].copy_(tables.view(s, w), non_blocking=True)
        if rung.grouped:
            self.prefix_lens[:g].copy_(p_lens, non_blocking=True)
            self.prefix_tables[:g, :pw].copy_(p_tables.view(g, pw), non_blocking=True)
            self.ranges[: g + 1].copy_(ranges, non_blocking=True)
        self._pad(s, g if rung.grouped else b, b)  # an ungrouped rung reads no group

    def capture(self) -> None:
        """CUDA only: one graph per rung, largest first, in one memory pool (a graph's
        intermediates are freed when its capture ends, so the next reuses them), each after a
        warm-up run that compiles its kernels; each copies its logits into `self.logits`."""
        start = time.perf_counter()
        with torch.cuda.device(self.device):
            pool = torch.cuda.graph_pool_handle()
            for size, grouped in sorted(self.rungs, reverse=True):
                self.ranges[0].zero_()
                self._pad(0, 0, size)  # every row and group a padding one
                rung = self.rungs[(size, grouped)]
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    warm = self.forward(rung.ids, rung.positions, rung.meta, rung.logits_indices)
                torch.cuda.current_stream().wait_stream(side)
                if self.logits is None:  # the top rung comes first
                    self.logits = torch.empty(self.max_batch, warm.shape[1], dtype=warm.dtype, device=self.device)
                del warm
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[:size].copy_(self.forward(rung.ids, rung.positions, rung.meta, rung.logits_indices))
                self.graphs[(size, grouped)] = graph
            torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start

    def _pad(self, rows: int, groups: int, size: int) -> None:
        """Rows `rows`.. and prefix groups `groups`.. of a rung of `size` made padding: token 0
        at position 0, no K/V written, one key (block 0's first slot); groups of one key and no
        member (their ranges all end where group `groups` starts, already set)."""
        if size > rows:
            self.ids[rows:size].zero_()
            self.positions[rows:size].zero_()
            self.slots[rows:size].fill_(PAD_SLOT)
            self.kv_lens[rows:size].fill_(1)
            self.tables[rows:size, 0].zero_()
        if size > groups:
            self.prefix_lens[groups:size].fill_(1)
            self.prefix_tables[groups:size, 0].zero_()
            self.ranges[groups + 1 : size + 1].copy_(self.ranges[groups].expand(size - groups))
