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


def random_queries(cache: TreeKVCache, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """Up to 20 queries on live nodes (repeats allowed), each with a valid length."""
    live = cache.live_nodes
    size = int(rng.integers(0, 20)) if live else 0
    nodes = [live[int(i)] for i in rng.integers(max(len(live), 1), size=size)]
    return nodes, [int(rng.integers(cache.num_tokens(n) + 1)) for n in nodes]


def test_layout_of_matches_layout_on_random_trees():
    """``layout_of``'s column checks give ``layout``'s arrays, for Python and numpy ids."""
    rng = np.random.default_rng(11)
    cache = TreeKVCache(num_pages=24, page_size=3)
    for _ in range(40):
        random_ops(cache, rng, 5)
        nodes, lens = random_queries(cache, rng)
        want = cache.layout(list(zip(nodes, lens)))
        for got in (cache.layout_of(nodes, lens), cache.layout_of(np.array(nodes, np.int64), lens),
                    cache.layout_of(nodes, np.array(lens, np.int64))):
            for name in ("parents", "node_kv_indptr", "kv_indices", "query_nodes", "query_kv_lens"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def test_layout_of_rejects_what_layout_rejects():
    cache = TreeKVCache(num_pages=8, page_size=4)
    root = cache.add_root(5)
    kid, gone = cache.fork(root, 2)
    cache.append(kid, 2)
    cache.prune(gone)
    lens = np.array([1, 1])
    for bad, why in ((gone, "pruned"), (99, "never created"), (True, "never created"),
                     (1.0, "never created"), ("1", "never created")):
        with pytest.raises(ValueError, match=rf"nodes\[1\]: expected a live node id, got .*\({why}\)"):
            cache.layout_of([root, bad], lens)
        with pytest.raises(ValueError, match=r"queries\[1\]: expected a live node id"):
            cache.layout([(root, 1), (bad, 1)])
    with pytest.raises(ValueError, match=r"kv_lens\[1\]: expected query_kv_len in \[0, 2\] "
                                         r"\(tokens of node 1\), got 3"):
        cache.layout_of([root, kid], [5, 3])
    with pytest.raises(ValueError, match=r"kv_lens\[0\]: expected query_kv_len in \[0, 5\].*got -1"):
        cache.layout_of([root, kid], [-1, 0])
    with pytest.raises(ValueError, match=r"kv_lens: expected shape \(2,\) like nodes, got \(1,\)"):
        cache.layout_of([root, kid], [1])
    with pytest.raises(TypeError, match="kv_lens: expected integers"):
        cache.layout_of([root], [1.0])
    frozen = np.array([5])
    cache.layout_of([root], frozen)
    assert frozen.flags.writeable  # the caller's lengths are copied, not frozen


def test_node_tree_matches_the_constructor():
    """``Node.tree`` sets every attribute as ``Node(...)`` plus linking to the parent would."""
    rng = np.random.default_rng(5)
    for _ in range(50):
        m = int(rng.integers(0, 12))
        parents = [int(rng.integers(-1, i)) for i in range(m)]
        slots = [np.arange(int(rng.integers(0, 3)), dtype=np.int64) for _ in range(m)]
        pages = [[int(p)] for p in rng.integers(0, 9, m)]
        tops = [Node(0, None, np.arange(4, dtype=np.int64)) for _ in range(2)]
        got = Node.tree(tops[0], 7, parents, slots, [list(p) for p in pages])
        want = []
        for i, p in enumerate(parents):
            par = tops[1] if p < 0 else want[p]
            want.append(Node(7 + i, par, slots[i], list(pages[i])))
            par.children[7 + i] = want[-1]
        for top, nodes in zip(tops, (got, want)):
            nodes.insert(0, top)
        for a, b in zip(got, want):
            assert ((a.parent.id if a.parent else None), a.id, list(a.children), a.n, a.pages,
                    a.group_page, a.dense, a.start) == \
                ((b.parent.id if b.parent else None), b.id, list(b.children), b.n, b.pages,
                 b.group_page, b.dense, b.start)
            assert a.slots is a.buf and a.slots.tolist() == b.slots.tolist()


def test_releasing_many_nodes_at_once_matches_the_loop(monkeypatch):
    """Prunes of more than ``_FEW`` nodes clear live flags with numpy: with every prune on
    that path, and with none, the same random operations leave the same state."""
    from deft.cache import slots

    final = []
    for few in (0, 10**9):
        monkeypatch.setattr(slots, "_FEW", few)
        cache = TreeKVCache(num_pages=24, page_size=3)
        random_ops(cache, np.random.default_rng(2), 300)
        final.append(snapshot(cache))
    assert final[0] == final[1]


@pytest.mark.parametrize("page_size", [1, 4])
def test_pruning_many_nodes_at_once_matches_pruning_them_in_turn(page_size):
    """``prune_many`` against ``prune`` of each node still live, in order, on twin caches
    grown alike: nodes listed twice, nested in another's subtree or above it, with and
    without releasing unused ancestors, with kept ones. The same ids removed in the same
    order, the same nodes, slots, layout node order, page users, free pages (as a set: one
    pass frees them in another order), used pages' fill pointers and live slots."""
    for seed in range(60):
        caches = [TreeKVCache(num_pages=64, page_size=page_size) for _ in range(2)]
        for c in caches:
            random_ops(c, np.random.default_rng(seed), 60)
        rng = np.random.default_rng(1000 + seed)
        live = caches[0].live_nodes
        if not live:
            continue
        nodes = rng.choice(live, int(rng.integers(1, min(len(live), 10) + 1))).tolist()
        release = bool(rng.integers(2))
        keep = rng.choice(live, int(rng.integers(0, 3))).tolist()
        removed = caches[0].prune_many(nodes, release, keep)
        gone = []
        for n in nodes:
            if caches[1].is_live(n):
                gone += caches[1].prune(n, release, [k for k in keep if caches[1].is_live(k)])
        assert removed == gone
        (a_nodes, a_refs, a_free, a_fill, a_live), (b_nodes, b_refs, b_free, b_fill, b_live) = \
            (snapshot(c) for c in caches)
        assert a_nodes == b_nodes and a_refs == b_refs and a_live == b_live
        assert caches[0].layout_nodes().tolist() == caches[1].layout_nodes().tolist()
        assert sorted(a_free) == sorted(b_free)
        used = np.array(a_refs) > 0  # (a free page's fill pointer is set when it is taken)
        np.testing.assert_array_equal(np.array(a_fill)[used], np.array(b_fill)[used])
        check_state(caches[0])
        with pytest.raises(ValueError, match=r"nodes\[0\]: expected a live node id"):
            caches[0].prune_many([removed[0]])


@pytest.mark.parametrize("page_size", [1, 4])
def test_one_token_each_matches_appending_in_turn(page_size):
    """``append_each`` against ``append(node, 1)`` of each node in turn, on twin caches grown
    alike, some leaves listed twice and some expecting tokens: the same slots, the same
    state (nodes, page users, free list, fill pointers, live slots, layout order), and
    each node's length and position after its slot."""
    for seed in range(60):
        caches = [TreeKVCache(num_pages=64, page_size=page_size) for _ in range(2)]
        for c in caches:
            random_ops(c, np.random.default_rng(seed), 60)
        rng = np.random.default_rng(2000 + seed)
        leaves = [n for n in caches[0].live_nodes if not caches[0].children(n)]
        if not leaves:
            continue
        nodes = rng.choice(leaves, int(rng.integers(1, 17))).tolist()
        if caches[0].num_free_pages < len(nodes):  # each slot may need a fresh page
            continue
        for n in set(nodes):
            if rng.integers(4) == 0:
                for c in caches:
                    c.expect(n, c.num_tokens(n) + 8)
        slots, lens, positions = caches[0].append_each(nodes)
        want = [int(caches[1].append(n, 1)[0]) for n in nodes]
        assert slots.tolist() == want
        for i, n in enumerate(nodes):  # the tokens each node had once it got its slot
            later = nodes[i + 1:].count(n)
            assert lens[i] == caches[1].num_tokens(n) - later
            assert positions[i] == caches[1].position(n) - later - 1
        assert snapshot(caches[0]) == snapshot(caches[1])
        assert caches[0].layout_nodes().tolist() == caches[1].layout_nodes().tolist()
        check_state(caches[0])
    cache = TreeKVCache(num_pages=8, page_size=page_size)
    root = cache.add_root(3)
    kids = cache.fork(root, 2)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"nodes\[1\]: expected a node without live children"):
        cache.append_each([kids[0], root])
    with pytest.raises(ValueError, match=r"nodes\[0\]: expected a live node id"):
        cache.append_each([99, kids[0]])
    assert snapshot(cache) == before
