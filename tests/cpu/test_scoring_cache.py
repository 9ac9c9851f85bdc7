"""The scorer's prefix KV cache: pinned until the group's last member, kept after it while the
budget has room (a later unit of the group finds it), LRU eviction by bytes, unpinned first."""

from __future__ import annotations

import pytest
import torch

from prefixflow.engine.scoring.cache import PrefixCache
from prefixflow.engine.scoring.forward import PrefixKV


def kv(tokens: int) -> PrefixKV:
    # [L=2, Hkv=1, P, D=4] fp32: 2 * 2 * 4 * 4 = 64 bytes per token (K and V)
    return PrefixKV(torch.zeros(2, 1, tokens, 4), torch.zeros(2, 1, tokens, 4))


def test_prefix_is_unpinned_when_the_last_member_finishes_and_evicted_first():
    cache = PrefixCache(capacity_bytes=1500)
    cache.expect("g", 3)
    assert cache.put("g", kv(10)) and cache.used_bytes == 640
    for _ in range(2):
        cache.finished("g")
        assert cache.pinned("g")
    cache.finished("g")
    assert "g" in cache and not cache.pinned("g")  # kept: a later unit of the group finds it
    cache.expect("h", 1)
    cache.put("h", kv(10))
    assert cache.get("g") is not None  # "g" is now the most recently used, but unpinned
    cache.expect("i", 1)
    cache.put("i", kv(10))  # 3 x 640 > 1500: the unpinned "g" goes, not the LRU "h"
    assert "g" not in cache and "h" in cache and "i" in cache and cache.num_evictions == 1


def test_lru_eviction_and_prefixes_larger_than_the_budget():
    cache = PrefixCache(capacity_bytes=1500)
    for g in ("a", "b"):
        cache.expect(g, 2)
        cache.put(g, kv(10))
    assert cache.get("a") is not None  # "a" becomes the most recently used
    cache.expect("c", 2)
    cache.put("c", kv(10))  # 3 x 640 > 1500: evicts "b", the LRU
    assert "a" in cache and "c" in cache and "b" not in cache
    assert cache.num_evictions == 1 and cache.used_bytes == 1280
    assert not cache.put("d", kv(100))  # 6400 bytes alone exceed the budget
    assert "d" not in cache and len(cache) == 2


def test_negative_budget_is_rejected():
    with pytest.raises(ValueError, match="capacity_bytes=-1"):
        PrefixCache(-1)
