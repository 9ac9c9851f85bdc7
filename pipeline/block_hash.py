"""Block hashes: the planner's compact stand-in for token ids (issue 18).

A prompt is cut into blocks of `block_size` tokens, the block the engine's KV cache shares
(only whole blocks are shared, so a plan finer than blocks buys nothing). Each block gets a
63-bit hash chained over the blocks before it and mixed with the block's length, so two prompts
have equal hashes at block k exactly when their first k+1 blocks are equal (up to collisions).
That is 8 bytes per block instead of 4 * block_size bytes of token ids: 1/8 at 16 tokens.

The planner sorts rows by their hash sequences (`sort_with_lcp` over hash symbols, the
sequences possibly living in the dataset's blocks, see `sort_hashes_with_lcp`) and turns the
LCP in blocks into tokens. A collision can only make rows look as if they shared more than they
do; Plan.groups checks the real tokens of every group and shrinks its prefix (`shared_prefix`),
so a collision costs sharing, never a wrong output.

Memory model of the planning driver (checked by bench/plan_bench.py --scale):
  per prompt: row id, length, the sort's order and LCP, ~1.2 tree nodes of 8 int64 each, the
  grouping, the plan order, cost arrays and table: 240-260 bytes at the peak (measured: 0.27 GB
  for 1M prompts, 0.78 GB for 3M, 2.4 GB for 10M; bench/results/plan_bench.json `scale`);
  per sort level: max(max_cells, undecided prompts) hashes, 8 bytes each, a few copies at once;
  per dataset block: its references, offsets and digest (~100 bytes).
So one 24 GiB driver plans ~100M prompts (extrapolated: 23.7 GB). Token ids are
not in it: Plan.groups(r) fetches one replica's (4 bytes a token) when it is asked for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from prefixflow.pipeline.prefix_tree import DEFAULT_BLOCK, Gather, ragged_gather, sort_by_gather
from prefixflow.pipeline.ragged import RaggedTokens

DEFAULT_BLOCK_SIZE = 16  # engine.block_size's default (engine/config.py)
DEFAULT_MAX_CELLS = 1 << 22  # hashes the sort holds per level (32 MiB a copy; it makes a few)
LEADING_WIDTH = 16  # blocks gathered per prompt and step of HashedPrompts.leading's walk
HASH_BITS = 63  # non-negative int64: the sort pads ended sequences with -1

# (flat token ids, start of each block in flat, tokens in each block, block_size) -> one uint64
# per block. Injectable so that a test can force collisions.
BlockHashFn = Callable[[np.ndarray, np.ndarray, np.ndarray, int], np.ndarray]

_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit reaches every output bit."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def hash_token_blocks(flat: np.ndarray, start: np.ndarray, count: np.ndarray, block_size: int) -> np.ndarray:
    """The default block hash: the block's tokens and its length, mixed position by position."""
    acc = _mix(count.astype(np.uint64) * _GOLDEN)
    for j in range(block_size):
        present = j < count
        tok = np.zeros(len(start), dtype=np.uint64)
        tok[present] = flat[start[present] + j].astype(np.uint64) + np.uint64(1)
        acc = _mix(acc ^ (tok * _GOLDEN + np.uint64(j)))
    return acc


def block_hashes(
    tokens: RaggedTokens,
    block_size: int = DEFAULT_BLOCK_SIZE,
    hash_fn: BlockHashFn = hash_token_blocks,
    seeds: np.ndarray | None = None,
) -> RaggedTokens:
    """Chained hashes of each prompt's blocks (the last block may be short): a ragged int64
    array with ceil(len / block_size) values per prompt, each in [0, 2**63).

    seeds: [n] a key per prompt that starts its chain (0, the default, for every prompt):
    prompts with other seeds share no hash, whatever their tokens. A row's LoRA adapter is its
    seed (prefixflow/lora.adapter_key), so that the plan never groups rows of two adapters."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} is invalid: use the engine's KV block size (e.g. 16)")
    lens = tokens.lengths
    per_row = -(-lens // block_size)
    offsets = np.r_[0, np.cumsum(per_row)].astype(np.int64)
    row = np.repeat(np.arange(len(lens), dtype=np.int64), per_row)
    k = np.arange(offsets[-1], dtype=np.int64) - offsets[:-1][row]
    start = tokens.offsets[:-1][row] + k * block_size
    own = np.asarray(
        hash_fn(tokens.flat, start, np.minimum(block_size, lens[row] - k * block_size), block_size), dtype=np.uint64
    )
    start_keys = np.zeros(len(lens), np.uint64) if seeds is None else np.asarray(seeds).astype(np.uint64)
    return RaggedTokens(_chain(own, offsets, per_row, start_keys), offsets)


def _chain(own: np.ndarray, offsets: np.ndarray, per_row: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """h[k] = mix(h[k-1], own[k]), h[-1] = the row's seed: equal h[k] stands for equal blocks
    0..k (and equal seeds), not block k alone."""
    out = np.empty(len(own), dtype=np.uint64)
    by_blocks = np.argsort(-per_row, kind="stable")  # rows with block k are a prefix of this
    prev = seeds.copy()
    for k in range(int(per_row.max()) if len(per_row) else 0):
        rows = by_blocks[: np.count_nonzero(per_row > k)]
        idx = offsets[rows] + k
        prev[rows] = _mix(prev[rows] * _GOLDEN ^ own[idx])
        out[idx] = prev[rows]
    chained: np.ndarray = (out >> np.uint64(64 - HASH_BITS)).astype(np.int64)
    return chained


@dataclass(frozen=True, slots=True, eq=False)
class HashedPrompts:
    """The planner's input when the token ids stay where they are (build_plan accepts it).

    lengths: [n] tokens per prompt. gather: its block hashes (see `sort_hashes_with_lcp`).
    fetch_tokens: prompt indices -> their token ids (RaggedTokens, in the order asked); called
        per replica by Plan.groups, never for the whole job at once.
    max_cells: hashes the sort holds per level (None: no bound).
    find_leading: `leading` computed where the hashes are, in one pass (leading_found); None:
        `leading` walks them through `gather`.
    """

    lengths: np.ndarray
    gather: Gather
    block_size: int
    fetch_tokens: Callable[[np.ndarray], RaggedTokens]
    max_cells: int | None = None
    find_leading: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} is invalid: use the engine's KV block size (e.g. 16)")

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def from_tokens(
        cls,
        prompts: Sequence[Sequence[int]] | Any,
        block_size: int = DEFAULT_BLOCK_SIZE,
        hash_fn: BlockHashFn = hash_token_blocks,
        seeds: np.ndarray | None = None,
        keyed: RaggedTokens | None = None,
    ) -> "HashedPrompts":
        """In-memory prompts planned through their hashes (tests, benches, map_batches; seeds:
        see block_hashes). keyed: the prompts as the planner keys them, hashed in their place
        (images by their keys: operators/stages/plan.plan_tokens); the groups get `prompts`."""
        tokens = RaggedTokens.from_sequences(prompts)
        hashes = block_hashes(tokens if keyed is None else keyed, block_size, hash_fn, seeds)

        def fetch(idx: np.ndarray) -> RaggedTokens:
            return RaggedTokens.from_sequences([tokens[int(i)] for i in idx])

        def find_leading(keys: np.ndarray, usable: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return leading_found(hashes, keys, usable)

        return cls(tokens.lengths, ragged_gather(hashes), block_size, fetch, find_leading=find_leading)

    def sort_with_lcp(self) -> tuple[np.ndarray, np.ndarray]:
        return sort_hashes_with_lcp(self.lengths, self.gather, self.block_size, self.max_cells)

    def leading(self, keys: np.ndarray, usable: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """leading_found over these prompts (pipeline/homes.py): by find_leading where given,
        else LEADING_WIDTH blocks at a time through `gather`, asking again only the prompts
        whose every block so far was found."""
        if self.find_leading is not None:
            return self.find_leading(keys, usable)
        n = len(self)
        usable = np.asarray(usable, dtype=np.int64)
        lead, deepest = np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        alive, depth = np.flatnonzero(usable > 0), 0
        step = max(1, (self.max_cells or DEFAULT_MAX_CELLS) // LEADING_WIDTH)
        while len(alive):
            still = []
            for lo in range(0, len(alive), step):
                rows = alive[lo : lo + step]
                got = self.gather(rows, depth, LEADING_WIDTH)
                valid = got >= 0
                chunk = RaggedTokens(got[valid], np.r_[0, np.cumsum(valid.sum(axis=1))].astype(np.int64))
                found, last = leading_found(chunk, keys, np.clip(usable[rows] - depth, 0, LEADING_WIDTH))
                lead[rows] += found
                deepest[rows[found > 0]] = last[found > 0]
                still.append(rows[found == LEADING_WIDTH])
            alive, depth = np.concatenate(still), depth + LEADING_WIDTH
        return lead, deepest


def sort_hashes_with_lcp(
    lengths: np.ndarray, gather: Gather, block_size: int, max_cells: int | None = None, width: int = DEFAULT_BLOCK
) -> tuple[np.ndarray, np.ndarray]:
    """(order, lcp in tokens) of prompts known by their lengths and their block hashes.

    gather(seqs, depth, width) -> int64 [len(seqs), width]: hashes of blocks depth ..
    depth+width-1, -1 past a prompt's last block (see prefix_tree.sort_by_gather). Prompts that
    share k blocks share k * block_size tokens, or all of both when they are equal to the end.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    num_blocks = -(-lengths // block_size)
    order, lcp_blocks = sort_by_gather(num_blocks, gather, width, max_cells)
    if len(order) < 2:
        return order, lcp_blocks
    shorter = np.minimum(lengths[order[:-1]], lengths[order[1:]])
    # Equal last blocks have equal lengths (the hash holds the length), so the shorter prompt
    # ends where they stop agreeing: the min is its length then, k * block_size otherwise.
    return order, np.minimum(lcp_blocks * block_size, shorter)


def leading_found(hashes: RaggedTokens, keys: np.ndarray, usable: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([n] how many of each prompt's first blocks are all in `keys` (sorted), at most usable[i];
    [n] the deepest of them, -1 for none): a prompt's prefix that an index of block hashes
    holds (pipeline/homes.py), the hashes being chained."""
    n = len(hashes)
    flat, offsets = hashes.flat.astype(np.int64, copy=False), hashes.offsets
    if n == 0 or not len(keys) or not len(flat):
        return np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(keys, flat), len(keys) - 1)
    row = np.repeat(np.arange(n), np.diff(offsets))
    pos = np.arange(len(flat)) - offsets[:-1][row]
    stop = ~(keys[at] == flat) | (pos >= np.asarray(usable, dtype=np.int64)[row])
    # Per prompt: the first block not found (or past its usable ones), else its length.
    first_stop = np.where(stop, pos, np.iinfo(np.int64).max)
    lens = np.diff(offsets)
    lead = np.minimum(lens, np.minimum(usable, _row_min(first_stop, offsets)))
    last = np.minimum(offsets[:-1] + np.maximum(lead - 1, 0), len(flat) - 1)
    deepest = np.where(lead > 0, flat[last], -1)
    return lead.astype(np.int64), deepest.astype(np.int64)


def _row_min(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each row's minimum of a flat ragged array (its int64 max for an empty row)."""
    lens = np.diff(offsets)
    out = np.full(len(lens), np.iinfo(np.int64).max, dtype=np.int64)
    has = lens > 0
    if has.any():
        out[has] = np.minimum.reduceat(values, offsets[:-1][has])
    return out


def shared_prefix(claimed: int, prompts: list[np.ndarray], block_size: int) -> int:
    """The prefix a group's members really share, from their tokens: the hashes' claim checked
    (a collision can only have made it too long) and extended into the block where the members
    part (the hashes see whole blocks; an engine that shares a partial block gains the rest)."""
    if claimed == 0 or len(prompts) < 2:
        return claimed
    first = prompts[0]
    common = min(min(len(p) for p in prompts), claimed + block_size - 1)
    for p in prompts[1:]:
        head, ref = p[:common], first[:common]
        if not np.array_equal(head, ref):
            common = int(np.flatnonzero(head != ref)[0])
    return common
