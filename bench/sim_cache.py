"""One replica's KV prefix cache and admission, request by request (numba-compiled for large
runs by sim_dispatch.py; plain Python for small ones).

A replica's KV cache is vLLM's automatic prefix cache: blocks of `block_size` tokens aligned to
the start of the prompt, a block reusable only with all blocks before it (hash chain), hits =
the longest run of the prompt's leading full blocks present, at most (prompt_len - 1) //
block_size blocks (the last token is always computed). Blocks held by running requests cannot be
evicted; a finished request frees its blocks last-first into an LRU queue (its full output blocks
too: hashed but never matched, since the outputs are not in any later prompt; its last partial
block is free at once), and new blocks evict from the queue's head. Blocks are tracked per trie
segment: the blocks that end inside one segment are kept and evicted together, tail first,
which is what the last-first freeing does.

Concurrency: a replica runs at most `max_num_seqs` requests at once and admits the next one in
its queue only when the blocks held by the running ones, the new one's prompt blocks and a 1%
watermark fit (as vLLM and the native engine admit); a request takes its output blocks when
admitted; requests finish in admission order.

Plan replicas run prefixflow's native engine: each group's prefix is computed once as its own KV
owner (hits from the cache of earlier groups, e.g. a shared system prompt), members attend to it
and compute their distinct parts, whose blocks chain from the group's prefix (so a turn that
extends another turn of the same group reuses it through the cache). The prefix stays while any
member runs. A member whose prompt is the prefix computes its last token.
"""

from prefixflow.bench.sim_items import MEMBER, OWNER

# A unit is one trie node's blocks along one chain: id = node (a chain from token 0) or
# num_nodes + node (a MEMBER's chain after its group's prefix). Per (unit, replica) an entry of
# `ent`: its key, cached leading blocks, references by running requests, and its place in the
# replica's LRU queue (PREV == -2: not queued). Entries are found through an open-addressing
# hash table (keys, vals). Per replica (`rep`): queue head and tail, blocks used (held or
# queued), blocks queued, and the ring of running requests (`ring`, FIFO).

KERNELS = (
    "_home",
    "_slot",
    "_unslot",
    "_unqueue",
    "_queue",
    "_new_entry",
    "_allocate",
    "_chain",
    "_lookup",
    "_hold",
    "_drop",
    "_shape",
    "_finish_oldest",
    "_run_item",
)
EMPTY = -1
KEY, CACHED, REF, PREV, NEXT = range(5)
HEAD, TAIL, USED, QUEUED, COUNT, START = range(6)
_GOLD = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed 64-bit multiplier


def _home(key, mask):
    return ((key * _GOLD) >> 24) & mask


def _slot(keys, key):
    """Index of key in the table, or -1 - (the empty slot where it would go)."""
    mask = len(keys) - 1
    h = _home(key, mask)
    while True:
        if keys[h] == key:
            return h
        if keys[h] == EMPTY:
            return -1 - h
        h = (h + 1) & mask


def _unslot(keys, vals, i):
    """Delete slot i (linear probing with backward shift: no tombstones)."""
    mask = len(keys) - 1
    j = i
    while True:
        j = (j + 1) & mask
        if keys[j] == EMPTY:
            break
        home = _home(keys[j], mask)
        if (i <= j and i < home <= j) or (i > j and (home > i or home <= j)):
            continue  # its probe path does not cross i
        keys[i], vals[i] = keys[j], vals[j]
        i = j
    keys[i] = EMPTY


def _unqueue(ent, rep, r, e):
    p, q = ent[e, PREV], ent[e, NEXT]
    if p >= 0:
        ent[p, NEXT] = q
    else:
        rep[r, HEAD] = q
    if q >= 0:
        ent[q, PREV] = p
    else:
        rep[r, TAIL] = p
    ent[e, PREV] = -2
    rep[r, QUEUED] -= ent[e, CACHED]


def _queue(ent, rep, r, e):
    """Append to the tail of the LRU queue (evicted last)."""
    ent[e, PREV], ent[e, NEXT] = rep[r, TAIL], -1
    if rep[r, TAIL] >= 0:
        ent[rep[r, TAIL], NEXT] = e
    else:
        rep[r, HEAD] = e
    rep[r, TAIL] = e
    rep[r, QUEUED] += ent[e, CACHED]


def _new_entry(ent, pool, key, cached):
    pool[0] -= 1
    e = pool[pool[0] + 1]
    ent[e, KEY], ent[e, CACHED], ent[e, REF], ent[e, PREV], ent[e, NEXT] = key, cached, 0, -2, -2
    return e


def _allocate(ent, rep, keys, vals, pool, r, need, cap):
    """Take `need` blocks on replica r, evicting from the LRU head (each unit's tail blocks
    first) while they do not fit. Running requests' blocks are never evicted: when those alone
    fill the cache the replica over-commits (counted by the caller's admission rule)."""
    while rep[r, USED] + need > cap and rep[r, HEAD] >= 0:
        e = rep[r, HEAD]
        k = min(ent[e, CACHED], rep[r, USED] + need - cap)
        ent[e, CACHED] -= k
        rep[r, USED] -= k
        rep[r, QUEUED] -= k
        if ent[e, CACHED] == 0:
            _unqueue(ent, rep, r, e)
            if ent[e, KEY] >= 0:
                _unslot(keys, vals, _slot(keys, ent[e, KEY]))
            pool[pool[0] + 1] = e
            pool[0] += 1
    rep[r, USED] += need


def _chain(kind, node, anchor, parent, depth, num_nodes, bs, units, blocks):
    """Units of an item root first into units/blocks; returns (count, pinned-only count).
    A MEMBER's group prefix (the path from its anchor up) comes first and is only held; the
    rest counts for hits. Filled from the deepest unit up (no reversal copy)."""
    k, counted, below, v = 0, 0, kind == MEMBER, node
    while v > 0:
        below = below and v != anchor
        counted += below
        k += 1
        v = parent[v]
    if kind != MEMBER:
        counted = k
    base = depth[anchor] if kind == MEMBER else 0
    j, v = k - 1, node
    while v > 0:
        p = parent[v]
        if kind == MEMBER and j >= k - counted:
            units[j], blocks[j] = num_nodes + v, (depth[v] - base) // bs - (depth[p] - base) // bs
        else:
            units[j], blocks[j] = v, depth[v] // bs - depth[p] // bs
        j -= 1
        v = p
    return k, k - counted


def _lookup(ent, keys, vals, r, R, units, blocks, k, first, cap_hit):
    """Hit blocks (the longest run of leading cached blocks, at most cap_hit) and how many of
    them sit in the LRU queue (taking those uses free blocks)."""
    hit, queued = 0, 0
    for j in range(first, k):
        if blocks[j] == 0:
            continue
        s = _slot(keys, units[j] * R + r)
        if s < 0:
            break
        e = vals[s]
        c = min(ent[e, CACHED], cap_hit - hit)
        hit += c
        if ent[e, PREV] != -2:
            queued += c
        if c < blocks[j]:
            break
    return hit, queued


def _hold(ent, rep, keys, vals, pool, r, R, units, blocks, k, extra, cap):
    """Reference every unit of the chain (out of the queue), then compute what is missing
    (allocating, which may evict) and take `extra` private blocks."""
    for j in range(k):
        if blocks[j] == 0:
            continue
        key = units[j] * R + r
        s = _slot(keys, key)
        if s < 0:
            e = _new_entry(ent, pool, key, 0)
            keys[-1 - s], vals[-1 - s] = key, e
        else:
            e = vals[s]
            if ent[e, PREV] != -2:
                _unqueue(ent, rep, r, e)
        ent[e, REF] += 1
    for j in range(k):
        if blocks[j] == 0:
            continue
        e = vals[_slot(keys, units[j] * R + r)]
        missing = blocks[j] - ent[e, CACHED]
        if missing > 0:
            _allocate(ent, rep, keys, vals, pool, r, missing, cap)
            ent[e, CACHED] = blocks[j]
    _allocate(ent, rep, keys, vals, pool, r, extra, cap)


def _drop(ent, rep, keys, vals, pool, r, R, units, blocks, k, hashed, partial):
    """A request finishes: its blocks go to the LRU queue last-first (its hashed output blocks,
    then its units deepest first, each once nothing references it); the partial block is free."""
    rep[r, USED] -= partial
    if hashed > 0:
        _queue(ent, rep, r, _new_entry(ent, pool, -1, hashed))
    for j in range(k - 1, -1, -1):
        if blocks[j] == 0:
            continue
        e = vals[_slot(keys, units[j] * R + r)]
        ent[e, REF] -= 1
        if ent[e, REF] == 0:
            _queue(ent, rep, r, e)


def _shape(kind, node, anchor, out_len, depth, bs):
    """(prompt_len p, cached-start base, tokens the chain covers, hit cap in blocks, hashed
    private blocks, partial blocks) of an item."""
    p = depth[node]
    if kind == OWNER:
        return p, 0, p, p // bs, 0, 0
    base = depth[anchor] if kind == MEMBER else 0
    own = max(p - base, 1)  # a member whose prompt is the prefix recomputes its last token
    if kind == MEMBER and p == base:
        base = p - 1
    kv = own + max(out_len, 1) - 1  # the last output token is never fed back
    hashed = max(kv // bs - own // bs, 0)
    partial = -(-kv // bs) - kv // bs
    return p, base, own, (own - 1) // bs, hashed, partial


def _finish_oldest(st, r, R, W, kind, node, anchor, outs, parent, depth, num_nodes, bs, units, blocks):
    ent, rep, keys, vals, pool, ring = st
    j = ring[r, rep[r, START]]
    rep[r, START] = (rep[r, START] + 1) % W
    rep[r, COUNT] -= 1
    _, _, _, _, hashed, partial = _shape(kind[j], node[j], anchor[j], outs[j], depth, bs)
    k, _ = _chain(kind[j], node[j], anchor[j], parent, depth, num_nodes, bs, units, blocks)
    _drop(ent, rep, keys, vals, pool, r, R, units, blocks, k, hashed, partial)


def _run_item(st, i, r, R, W, cap, kind, node, anchor, outs, parent, depth, num_nodes, bs, buf):
    """Admit item i on replica r (finishing the oldest running requests while the cap on
    requests or the memory says so); returns its cached start (tokens not computed)."""
    ent, rep, keys, vals, pool, ring = st
    units, blocks, units2, blocks2 = buf
    p, base, own, cap_hit, hashed, partial = _shape(kind[i], node[i], anchor[i], outs[i], depth, bs)
    k, first = _chain(kind[i], node[i], anchor[i], parent, depth, num_nodes, bs, units, blocks)
    hit, queued = _lookup(ent, keys, vals, r, R, units, blocks, k, first, cap_hit)
    if kind[i] != OWNER:
        while True:
            need = -(-own // bs) - hit + queued
            watermark = max(1, cap // 100) if rep[r, COUNT] > 0 else 0
            held = rep[r, USED] - rep[r, QUEUED]
            if rep[r, COUNT] < W and (rep[r, COUNT] == 0 or held + need + watermark <= cap):
                break
            _finish_oldest(st, r, R, W, kind, node, anchor, outs, parent, depth, num_nodes, bs, units2, blocks2)
            hit, queued = _lookup(ent, keys, vals, r, R, units, blocks, k, first, cap_hit)
    _hold(ent, rep, keys, vals, pool, r, R, units, blocks, k, hashed + partial, cap)
    if kind[i] == OWNER:  # its members hold the prefix from now on
        _drop(ent, rep, keys, vals, pool, r, R, units, blocks, k, 0, 0)
    else:
        ring[r, (rep[r, START] + rep[r, COUNT]) % W] = i
        rep[r, COUNT] += 1
    return base + hit * bs
