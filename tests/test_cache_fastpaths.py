"""The cache's fast paths against its general ones and against state recomputed from scratch.

Decode steps take shortcuts: one-token appends and prunes of a node or two in Python ints,
a draft tree of one-token nodes split without the general per-node bounds, a just-added
draft tree cut off the end of the dense node list at once. Long random sequences of the
operations beam search and speculative decoding issue check every shortcut's result.
"""

from __future__ import annotations

import numpy as np
import pytest

from deft import TreeLayout
from deft.cache import CacheFullError, TreeKVCache
from deft.cache.node import DenseNodes, Node

from test_cache import check_pages, snapshot


def check_state(cache: TreeKVCache) -> None:
    """Refcounts, free list and fill pointers (``check_pages``), live flags, each node's
    page list and the layout's dense columns, all recomputed from the live nodes."""
    check_pages(cache)
    ids = cache.layout_nodes().tolist()
    index = {n: j for j, n in enumerate(ids)}
    layout = cache.layout(ids)
    assert layout.parents.tolist() == [index.get(cache.parent(n), -1) for n in ids]
    assert layout.node_lens.tolist() == [cache.num_tokens(n) for n in ids]
    assert layout.kv_indices.tolist() == [s for n in ids for s in cache.slots(n).tolist()]
    # The cache's layouts skip TreeLayout's checks (trusted_layout): they must pass them.
    TreeLayout(layout.parents, layout.node_kv_indptr, layout.kv_indices, layout.query_nodes,
               layout.query_kv_lens)
    owned = [cache.slots(n) for n in cache.live_nodes]
    live = np.zeros(cache.num_pages * cache.page_size, bool)
    live[np.concatenate(owned or [np.zeros(0, np.int64)])] = True
    np.testing.assert_array_equal(cache._live, live)
    for nd in cache._nodes.values():
        pages = sorted(set((nd.slots // cache.page_size).tolist()))
        assert sorted(nd.pages) == pages, f"node {nd.id} lists pages {nd.pages}, holds {pages}"


def random_ops(cache: TreeKVCache, rng: np.random.Generator, steps: int) -> None:
    """Beam-like and draft-like operations on ``cache``, checking the state after each."""
    leaves: list[int] = []
    for _ in range(steps):
        op = rng.choice(["root", "grow", "fork", "prune", "drafts", "commit"],
                        p=[0.05, 0.35, 0.2, 0.2, 0.1, 0.1])
        try:
            if op == "root" or not leaves:
                leaves.append(cache.add_root(int(rng.integers(0, 3 * cache.page_size))))
            elif op == "grow":
                cache.append(leaves[rng.integers(len(leaves))], int(rng.choice([1, 1, 1, 2, 5])))
            elif op == "fork":
                i = int(rng.integers(len(leaves)))
                leaves[i:i + 1] = cache.fork(leaves[i], int(rng.integers(1, 4)))
            elif op == "prune":
                leaf = leaves.pop(int(rng.integers(len(leaves))))
                cache.prune(leaf, release_unused_ancestors=bool(rng.integers(2)),
                            keep=[x for x in leaves[:1] if rng.integers(2)])
                leaves = [x for x in leaves if cache.is_live(x)]
            else:
                leaf = leaves[rng.integers(len(leaves))]
                m = int(rng.integers(1, 12))
                parents = [int(rng.integers(-1, i)) for i in range(m)]
                ids, _ = cache.add_subtree(leaf, parents, 1 if rng.integers(2) else
                                           rng.integers(0, 3, m).tolist())
                if op == "commit":
                    path, cur = [], leaf
                    while cache.children(cur) and rng.integers(3):
                        cur = cache.children(cur)[rng.integers(len(cache.children(cur)))]
                        path.append(cur)
                    cache.commit_path(leaf, path)
                else:  # the first draft's subtree (the tail of the nodes when it is all), then the rest
                    for top in [ids[0]] + cache.children(leaf):
                        if cache.is_live(top):
                            cache.prune(top)
        except CacheFullError:
            if leaves:
                cache.prune(leaves.pop(0), release_unused_ancestors=True)
                leaves = [x for x in leaves if cache.is_live(x)]
        check_state(cache)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_random_decode_and_draft_steps_keep_the_state_exact(page_size):
    rng = np.random.default_rng(page_size)
    random_ops(TreeKVCache(num_pages=24, page_size=page_size), rng, 400)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_one_token_drafts_match_the_general_split(page_size):
    """``add_subtree`` with one token per node takes a shortcut; a trailing empty node sends
    the same tree down the general path, which must hand out the same slots and pages."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        caches = [TreeKVCache(num_pages=24, page_size=page_size) for _ in range(2)]
        history = [(int(rng.integers(0, 9)), int(rng.integers(0, 3)))]
        m = int(rng.integers(1, 10))
        parents = [int(rng.integers(-1, i)) for i in range(m)]
        got = []
        for cache, extra in zip(caches, ([], [0])):
            root = cache.add_root(history[0][0])
            leaf = cache.fork(root, 1)[0] if history[0][1] else root
            cache.append(leaf, history[0][1])
            ids, slots = cache.add_subtree(leaf, parents + [-1] * len(extra), [1] * m + extra)
            got.append(([cache.slots(i).tolist() for i in ids[:m]], slots.tolist()))
            check_state(cache)
        assert got[0] == got[1]
        fast, general = (snapshot(c) for c in caches)
        assert fast[1:] == general[1:]  # refcounts, free list, fill pointers, live flags


def test_cutting_a_tail_of_dense_nodes_matches_removing_them_one_by_one():
    rng = np.random.default_rng(3)
    for _ in range(100):
        columns = []
        m = int(rng.integers(1, 12))
        parents = [int(rng.integers(-1, i)) for i in range(m)]
        lead = int(rng.integers(1, 4))
        for tail_only in (True, False):
            dense, nodes = DenseNodes(), []
            for i in range(lead + m):  # a chain of ``lead`` nodes, then the tree under it
                if i < lead:
                    p = nodes[i - 1] if i else None
                else:
                    p = nodes[lead - 1 if parents[i - lead] < 0 else lead + parents[i - lead]]
                nd = Node(i, p, np.arange(i, dtype=np.int64))
                if p is not None:
                    p.children[nd.id] = nd
                nodes.append(nd)
                dense.add_all([nd])
            doomed = [nodes[lead + i] for i in range(m - 1, -1, -1)]  # children first
            for nd in doomed:
                if nd.parent is not None:
                    del nd.parent.children[nd.id]
            if tail_only:
                dense.remove_all(doomed)
            else:
                for nd in doomed:
                    dense.remove(nd)
            columns.append((dense.ids().tolist(), [a.tolist() for a in dense.arrays()]))
        assert columns[0] == columns[1]
