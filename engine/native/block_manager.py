"""Paged KV blocks with reference counts and a hashed block cache (torch-free).

Every `KVOwner` (a request or a group's shared prefix) has a block table for its own KV.
A group's prefix blocks are one owner's table that members only reference through
`SharedPrefix`: the scheduler holds and frees them with the group (BatchLLM Sec. 3.3.1).

Second-level reuse (BatchLLM Sec. 3.2, last paragraph; vLLM's automatic prefix caching): a
full, computed block gets a hash of (parent block's hash, its tokens), the chain starting at
the owner's `hash_seed` (the chain's hash of the prompt before its own KV: every owner's blocks
line up with its prompt's blocks, engine/native/sequence.py). A freed block keeps its hash and
stays findable until the space is needed; free blocks are handed out least recently freed
first, and blocks without a hash before any cached block, so the cache is evicted LRU only when
free blocks run out.

Usage: `lookup` (pure) -> `can_allocate(cost)` -> `take_cached` + `allocate`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from prefixflow.engine.native.sequence import KVOwner, block_hash
from prefixflow.errors import require


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        require(
            num_blocks >= 1,
            "BlockManager",
            "num_blocks",
            num_blocks,
            "the KV cache needs at least one block; raise EngineConfig.kv_cache_bytes",
        )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in hand-out order: uncached ones at the front, cached ones appended when
        # freed (least recently freed first = LRU eviction).
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.ahead: set[int] = set()  # hashed by the step being scheduled, not yet computed
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, possibly evicting a cached one)."""
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, owner: KVOwner, num_tokens: int) -> int:
        """Fresh blocks `owner` needs to hold num_computed_tokens + num_tokens own tokens."""
        return max(0, self.blocks_for(owner.num_computed_tokens + num_tokens) - len(owner.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_ids)

    # ---- prefix cache -------------------------------------------------------------------------

    def lookup(self, owner: KVOwner, max_blocks: int) -> list[int]:
        """Cached blocks holding owner's first own blocks (at most max_blocks); mutates nothing."""
        if not self.enable_prefix_cache:
            return []
        found: list[int] = []
        parent = owner.hash_seed
        bs = self.block_size
        for i in range(max_blocks):
            tokens = tuple(owner.own_token_ids(i * bs, (i + 1) * bs))
            if len(tokens) < bs:
                break
            h = block_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_hash != parent:
                break  # a hash collision: treat as a miss
            found.append(block_id)
            parent = h
        return found

    def num_reclaimed(self, block_ids: list[int]) -> int:
        """How many of these cached blocks are free now (taking them uses free blocks)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def take_cached(self, owner: KVOwner, block_ids: list[int]) -> None:
        """Give an owner with an empty table the cached blocks found by `lookup`."""
        assert not owner.block_table and owner.num_computed_tokens == 0
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_ids[block_id]
            block.ref_count += 1
            assert block.hash is not None, "take_cached() of a block that `lookup` did not find"
            owner.block_table.append(block_id)
            owner.block_hashes.append(block.hash)
        owner.num_computed_tokens = len(block_ids) * self.block_size

    def reset_cache(self) -> None:
        """Forget every cached block (only while no owner holds blocks)."""
        assert self.num_used_blocks == 0, "reset_cache() while blocks are in use"
        for block in self.blocks:
            block.hash, block.parent_hash, block.token_ids = None, None, ()
        self.cached.clear()

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self, owner: KVOwner, num_tokens: int) -> None:
        """Append fresh blocks so the owner's table covers num_computed + num_tokens tokens."""
        need = self.num_new_blocks(owner, num_tokens)
        assert need <= len(self.free_ids), "allocate() without can_allocate()"
        for _ in range(need):
            block_id, _ = self.free_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict: the cached content is overwritten
                self._unhash(block)
                self.num_evictions += 1
            block.ref_count = 1
            owner.block_table.append(block_id)

    def free(self, owner: KVOwner) -> None:
        """Drop the owner's references; its KV must be recomputed if it runs again."""
        # Last blocks first, so that a chain's tail is evicted before its head.
        for block_id in reversed(owner.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_ids[block_id] = None  # cached: last in line (LRU)
                if block.hash is None:
                    self.free_ids.move_to_end(block_id, last=False)  # nothing cached: use first
        owner.block_table.clear()
        owner.block_hashes.clear()
        owner.num_computed_tokens = 0

    def commit(self, owner: KVOwner, num_computed_tokens: int) -> None:
        """Record newly computed tokens; hash the blocks that became full."""
        owner.num_computed_tokens = num_computed_tokens
        self._hash_full_blocks(owner, num_computed_tokens)

    def hash_ahead(self, owner: KVOwner, num_tokens: int) -> None:
        """Hash the blocks that this step's `num_tokens` own tokens of `owner` will fill,
        before the step computes them, so that an owner scheduled later in the same step
        finds them (two groups whose prefixes start with one system prompt, admitted
        together). That is safe because every layer writes the step's K/V before any of its
        attention reads, as in vLLM, which caches a block when it is scheduled. A step that
        fails calls `forget_ahead`."""
        self._hash_full_blocks(owner, owner.num_computed_tokens + num_tokens, ahead=True)

    def commit_ahead(self) -> None:
        """The step ran: the blocks it hashed ahead hold their KV now."""
        self.ahead.clear()

    def forget_ahead(self) -> None:
        """Un-hash the blocks hashed ahead by a step that did not run (their KV was never
        written); the owners holding them are aborted with the step."""
        for block_id in self.ahead:
            self._unhash(self.blocks[block_id])
        self.ahead.clear()

    def _unhash(self, block: Block) -> None:
        """Forget a block's cached content (the cache entry too, when it points to this one)."""
        if block.hash is not None and self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]
        block.hash, block.parent_hash, block.token_ids = None, None, ()

    def _hash_full_blocks(self, owner: KVOwner, num_tokens: int, ahead: bool = False) -> None:
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        for i in range(len(owner.block_hashes), num_tokens // bs):
            parent = owner.block_hashes[i - 1] if i > 0 else owner.hash_seed
            tokens = tuple(owner.own_token_ids(i * bs, (i + 1) * bs))
            h = block_hash(parent, tokens)
            block = self.blocks[owner.block_table[i]]
            if block.hash is None:
                block.hash, block.parent_hash, block.token_ids = h, parent, tokens
                if self.cached.setdefault(h, block.block_id) == block.block_id and ahead:
                    self.ahead.add(block.block_id)
            owner.block_hashes.append(h)
