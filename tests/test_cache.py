"""Tree KV cache: allocator, tree operations, layouts, and a stateful model check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from deft import TreeAttention, TreeLayout
from deft.cache import CacheFullError, KVPool, PageAllocator, TreeKVCache
from deft.cache.pages import RUN_PAGES
from deft.ops.reference import reference_attention


# ------------------------------------------------------------------ helpers


def copying(pool: KVPool):
    """An ``on_copy`` that applies the rows a commit moves to ``pool`` at once."""
    return lambda src, dst: pool.copy_slots(torch.as_tensor(src), torch.as_tensor(dst))


def snapshot(cache: TreeKVCache) -> tuple:
    """Everything observable about the cache (plus its fill pointers and live-slot map)."""
    nodes = {
        n: (cache.parent(n), cache.slots(n).tolist(), cache.children(n)) for n in cache.live_nodes
    }
    return (
        nodes,
        cache.allocator.refcounts.tolist(),
        cache.allocator.free_pages().tolist(),
        cache._fill.tolist(),  # white-box: a changed fill pointer would change later slots
        cache._live.tolist(),
    )


def expected_refcounts(cache: TreeKVCache) -> np.ndarray:
    """Users per page computed from the live nodes' slots alone."""
    refs = np.zeros(cache.num_pages, np.int64)
    for n in cache.live_nodes:
        refs[np.unique(cache.slots(n) // cache.page_size)] += 1
    return refs


def check_pages(cache: TreeKVCache) -> None:
    refs = cache.allocator.refcounts
    np.testing.assert_array_equal(refs, expected_refcounts(cache))
    free = cache.allocator.free_pages()
    assert len(set(free.tolist())) == free.size, "a page is on the free list twice"
    assert (refs[free] == 0).all(), "a free page has users"
    assert free.size + int((refs > 0).sum()) == cache.num_pages, "pages leaked"
    owned = np.concatenate([cache.slots(n) for n in cache.live_nodes] or [np.zeros(0, np.int64)])
    assert np.unique(owned).size == owned.size, "a slot belongs to two live nodes"
    # White-box: each used page's fill pointer sits just past its last live slot, so the
    # slots it hands out next are free.
    last = np.full(cache.num_pages, -1)
    np.maximum.at(last, owned // cache.page_size, owned % cache.page_size)
    used = refs > 0
    np.testing.assert_array_equal(cache._fill[used], last[used] + 1)


def write_values(pool: KVPool, slots: np.ndarray, values: np.ndarray) -> None:
    """Store ``values`` as K and ``-values`` as V at ``slots`` (every layer, head and dim)."""
    shape = (len(slots), pool.num_kv_heads, pool.head_dim)
    k = torch.as_tensor(values, dtype=torch.float32)[:, None, None].expand(shape)
    for layer in range(pool.num_layers):
        pool.write(layer, torch.as_tensor(slots), k, -k)


def read_values(pool: KVPool, slots: np.ndarray) -> np.ndarray:
    flat_k = pool.k[0].view(-1, pool.num_kv_heads, pool.head_dim)
    flat_v = pool.v[0].view(-1, pool.num_kv_heads, pool.head_dim)
    idx = torch.as_tensor(np.array(slots), dtype=torch.long)
    np.testing.assert_array_equal(flat_k[idx][:, 0, 0].numpy(), -flat_v[idx][:, 0, 0].numpy())
    return flat_k[idx][:, 0, 0].numpy()


# ---------------------------------------------------------------- allocator


def test_allocator_counts_users_and_frees_at_zero():
    a = PageAllocator(4)
    p = a.alloc(3)
    assert p.tolist() == [0, 1, 2] and a.num_free == 1 and a.num_used == 3
    a.incref(np.array([1, 1]))
    assert a.refcounts.tolist() == [1, 3, 1, 0]
    assert a.decref(np.array([0, 1, 1])).tolist() == [0]
    assert a.refcounts.tolist() == [0, 1, 1, 0] and a.num_free == 2
    assert sorted(a.alloc(2).tolist()) == [0, 3]  # freed pages are reused


def test_a_take_of_run_pages_gets_the_smallest_run_that_holds_it():
    assert RUN_PAGES == 4
    a = PageAllocator(32)
    a.alloc(32)
    a.decref(np.array([3, 4, 5, 10, 11, 12, 13, 20, 25]))  # runs of 3 and 4, two singles
    a.decref(np.array([30]))  # on top of the free list: 30, 3, 4, 5, 10, ...
    assert a.alloc(4).tolist() == [10, 11, 12, 13]  # the top 4 are no run: the run that fits
    assert a.alloc(2).tolist() == [30, 3]  # small takes pop the list's top
    assert a.alloc(4).tolist() == [4, 5, 20, 25]  # no run of 4 left: popped, skipping 10-13
    assert a.free_pages().tolist() == [] and a.num_free == 0
    a = PageAllocator(16)
    a.alloc(16)
    a.decref(np.array([2, 3, 4, 5]))
    a.decref(np.array([10, 11, 12, 13, 14, 15]))
    assert a.alloc(4).tolist() == [10, 11, 12, 13]  # a run on top is popped, not scanned for
    a = PageAllocator(24)
    a.alloc(24)
    a.decref(np.array([20, 21, 22, 23]))
    a.decref(np.array([0, 2]))
    assert a.alloc(4).tolist() == [20, 21, 22, 23]  # its entries stay on the list, skipped
    a.decref(np.array([20, 21, 22, 23]))  # listed twice now
    a.decref(np.array([8, 9, 10, 11, 12, 13]))
    assert a.alloc(4).tolist() == [8, 9, 10, 11]  # the top's run, though 20-23 fits better
    assert sorted(a.free_pages().tolist()) == [0, 2, 12, 13, 20, 21, 22, 23] and a.num_free == 8


def test_allocator_keeps_its_free_pages_exact_under_random_takes_and_releases():
    rng = np.random.default_rng(0)
    a, free, held = PageAllocator(64), set(range(64)), []
    for _ in range(3000):
        if held and (rng.random() < 0.5 or not free):
            pages = held.pop(int(rng.integers(len(held))))
            assert sorted(a.decref(np.array(pages)).tolist()) == sorted(pages)
            free.update(pages)
        else:
            n = int(rng.integers(1, min(len(free), 12) + 1))
            pages = a.take(n)
            assert len(set(pages)) == n and set(pages) <= free
            if n >= RUN_PAGES:
                frees = np.zeros(66, bool)
                frees[[p + 1 for p in free]] = True
                runs = [len(r) for r in "".join("1" if f else "0" for f in frees).split("0")]
                if max(runs) >= n:
                    assert pages == list(range(pages[0], pages[0] + n))
            free.difference_update(pages)
            held.append(pages)
        listed = a.free_pages().tolist()
        assert len(listed) == len(set(listed)) and set(listed) == free and a.num_free == len(free)
        assert (a.refcounts == 0).sum() == len(free)
        assert len(a._free) <= 2 * a.num_free + 64  # white-box: stale entries are dropped


def test_an_owner_takes_a_run_for_what_it_expects_and_claims_the_rest():
    a = PageAllocator(32)
    assert a.take(2, owner=1, extent=8) == [0, 1]  # pages 2-7 claimed for owner 1
    assert a.take(2, owner=2, extent=8) == [8, 9]  # passes owner 1's claim by
    assert a.take(1) == [16]  # so does a plain take (popped: claimed entries skipped)
    assert a.num_claimed == 12 and a.num_free == 27
    assert a.take(3, after=1, owner=1, extent=6) == [2, 3, 4]  # its run goes on
    assert a.take(1, after=9, owner=2) == [10]
    assert a.num_claimed == 8 and sorted(a.free_pages().tolist()) == [
        p for p in range(32) if p not in (0, 1, 2, 3, 4, 8, 9, 10, 16)]
    assert a.take(2, after=20, owner=1) == [5, 6]  # not after its claim: given up, listed
    assert a.num_claimed == 5
    a.release_claim(2)
    assert a.num_claimed == 0 and a.take(4) == [11, 12, 13, 14]  # listed again, a run on top
    b = PageAllocator(8)
    assert b.take(1, owner=1, extent=6) == [0] and b._claims == {1: (1, 6)}
    assert b.take(3) == [5, 6, 7] and b._claims == {1: (1, 5)}  # two unclaimed: its end goes
    assert b.take(1, after=0, owner=1, extent=5) == [1]  # the rest is still its own
    c = PageAllocator(8)
    c.run_pages = 9  # every take pops: no owner runs or claims either
    assert c.take(1, owner=1, extent=6) == [0] and c.num_claimed == 0
    d = PageAllocator(16)
    d.alloc(16)
    d.decref(np.array([1, 2, 3, 4, 5, 9, 10, 11, 12]))  # runs of 5 and 4: none holds 10
    assert d.take(2, owner=1, extent=10) == [1, 2] and d._claims == {1: (3, 6)}  # the longest
    assert d.take(2, owner=2, extent=10) == [9, 10] and d._claims[2] == (11, 13)
    assert d.take(1, owner=3, extent=10) == [5]  # none unclaimed: the oldest claim's end goes
    assert d._claims == {1: (3, 5), 2: (11, 13)}
    assert sorted(d.take(3)) == [3, 4, 12] and d._claims == {2: (11, 12)}  # oldest first
    assert d.take(1, after=10, owner=2) == [11] and d.num_claimed == 0


def test_a_failed_subtree_keeps_the_parents_expectation_and_claim():
    c = TreeKVCache(num_pages=8, page_size=1)
    r = c.add_root(0)
    c.expect(r, 6)
    c.append(r, 2)  # pages 0-1; pages 2-5 claimed for r
    c.add_root(2)  # pages 6-7
    before = (c._nodes[r].expect, dict(c.allocator._claims), list(c.allocator._free))
    with pytest.raises(CacheFullError):
        c.add_subtree(r, [-1] * 5, 1)  # 5 pages, 4 free
    assert (c._nodes[r].expect, dict(c.allocator._claims), list(c.allocator._free)) == before
    nodes, slots = c.add_subtree(r, [-1] * 4, 1)  # fits: r settles, the drafts follow it
    assert slots.tolist() == [2, 3, 4, 5] and c.allocator.num_claimed == 0
    check_pages(c)


def test_a_run_search_that_cannot_succeed_reads_no_counts_until_pages_come_free():
    a = PageAllocator(16)
    a.alloc(16)
    a.decref(np.array([1, 2, 5, 6, 9]))  # free runs of 2, 2 and 1
    assert a._run(4) is None and a._run(4, shortest=3) is None
    counts, a._refcount = a._refcount, None  # white-box: reading the counts now fails
    assert a._run(3) is None and a._run(8, shortest=3) is None
    assert a.take(1, owner=1, extent=8) == [1]  # an owner finds no run: popped, no scan
    a._refcount = counts
    a.decref(np.array([3, 4]))  # pages come free: the next search looks again
    assert a._run(4) == [2, 3, 4, 5]


def test_allocator_keeps_claims_exact_under_random_owned_takes_and_releases():
    rng = np.random.default_rng(1)
    a, free = PageAllocator(96), set(range(96))
    held: dict[int, list[int]] = {}  # owner (or a plain take's negative key) -> its pages
    for step in range(3000):
        r = rng.random()
        if held and (r < 0.3 or not free):
            key = list(held)[int(rng.integers(len(held)))]
            pages = held.pop(key)
            a.decref(np.array(pages))
            a.release_claim(key)
            free.update(pages)
        elif r < 0.4 and held:
            a.release_claim(list(held)[int(rng.integers(len(held)))])
        else:
            n = int(rng.integers(1, min(len(free), 6) + 1))
            key = int(rng.integers(8)) if rng.random() < 0.7 else -1 - step
            mine = held.get(key, [])
            after = mine[-1] if mine else -1
            pages = a.take(n, after, key if key >= 0 else -1, n + int(rng.integers(0, 12)))
            assert len(set(pages)) == n and set(pages) <= free
            claim = a._claims.get(key)  # white-box: a claim starts right after its owner's pages
            assert claim is None or claim[0] == pages[-1] + 1
            free.difference_update(pages)
            held[key] = mine + pages
        listed = a.free_pages().tolist()
        assert len(listed) == len(set(listed)) and set(listed) == free and a.num_free == len(free)
        claimed = [p for lo, hi in a._claims.values() for p in range(lo, hi)]
        assert len(claimed) == len(set(claimed)) == a.num_claimed and set(claimed) <= free
        assert len(a._free) <= 2 * a.num_free + 64


def test_expected_nodes_fill_runs_of_their_own_when_appends_interleave():
    cache = TreeKVCache(64, 16)
    roots = [cache.add_root() for _ in range(4)]
    cache.expect(roots[0], 200)
    cache.expect(roots[1], 100)
    for _ in range(7):  # prompts fed 16 tokens at a time in turns, then decode tokens
        for r in roots:
            cache.append(r, 16)
    for r in roots[:2]:
        assert (np.diff(cache.slots(r)) == 1).all(), "an expected node's slots are one run"
    for r in roots[2:]:
        assert not (np.diff(cache.slots(r)) == 1).all()  # the plain ones' interleave
    assert cache.allocator._claims == {roots[0]: (7, 13)}  # roots[1] filled its 7 pages
    kids = cache.fork(roots[0], 2)
    assert cache.allocator.num_claimed == 0  # a node with children grows no more
    cache.expect(kids[0], 100)
    cache.append(kids[0], 1)
    cache.append(kids[1], 1)  # not into the expected child's page: into a fresh one
    cache.append(kids[0], 99)
    assert (np.diff(cache.slots(kids[0])) == 1).all()
    cache.prune(kids[0])
    assert cache.allocator.num_claimed == 0
    check_pages(cache)
    with pytest.raises(ValueError, match="without live children"):
        cache.expect(roots[0], 10)


def test_allocator_errors_change_nothing():
    a = PageAllocator(3)
    a.alloc(2)
    with pytest.raises(CacheFullError, match="needed 2 free pages, 1 free") as err:
        a.alloc(2)
    assert isinstance(err.value, RuntimeError) and (err.value.needed, err.value.free) == (2, 1)
    with pytest.raises(ValueError, match="double free"):
        a.decref(np.array([0, 0]))
    with pytest.raises(ValueError, match="free page 2"):
        a.incref(np.array([0, 2]))
    with pytest.raises(ValueError, match=r"pages: expected page ids in \[0, 3\), got 7"):
        a.decref(np.array([7]))
    with pytest.raises(ValueError, match="n: expected an integer >= 0, got -1"):
        a.alloc(-1)
    assert a.refcounts.tolist() == [1, 1, 0] and a.num_free == 1
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)


def test_a_double_free_of_slots_changes_nothing():
    """Releasing a node's slots twice in one call raises before any slot is marked free."""
    cache = TreeKVCache(8, 16)
    root = cache.add_root(20)
    nd = cache._nodes[root]
    slots = cache._slot_alloc
    with pytest.raises(ValueError, match="double free"):
        slots.release([nd, nd], [])
    assert slots.live[nd.slots].all() and cache.allocator.num_free == 6
    check_pages(cache)


def test_parked_pages_are_counted_as_users_come_and_go():
    a = PageAllocator(4)
    a.alloc(3)
    a.incref(np.array([1, 2]))  # users [1, 2, 2, 0]
    a.park([0, 1])
    assert a.num_parked == 1  # page 0 (its one user parked); page 1 has another user
    a.park([1])
    assert a.num_parked == 2
    a.incref(np.array([0]))  # an unparked user joins page 0
    assert a.num_parked == 1
    a.decref(np.array([0]))
    assert a.num_parked == 2
    a.decref(np.array([2]))
    a.park([2])
    assert a.num_parked == 3
    a.share_many(np.array([2, 2, 1]))
    assert a.num_parked == 1
    a.drop([2, 2, 1])
    assert a.num_parked == 3
    a.unpark([0, 1, 1, 2])
    assert a.num_parked == 0 and a.decref(np.array([0, 1, 1, 2])).tolist() == [0, 1, 2]
    assert a.num_free == 4


def test_a_parked_node_shares_its_page_with_a_child_until_the_child_goes():
    c = TreeKVCache(8, 4)
    root = c.add_root(6)
    c.allocator.park([0, 1])
    assert c.allocator.num_parked == 2
    (kid,) = c.fork(root, 1)
    assert c.append(kid, 1).tolist() == [6] and c.allocator.num_parked == 1  # page 1 is shared now
    c.add_subtree(kid, [-1, -1])  # drafts in the same page
    assert c.allocator.num_parked == 1
    c.prune(kid)
    assert c.allocator.num_parked == 2 and c.allocator.num_used == 2


def test_parking_errors_change_nothing():
    a = PageAllocator(3)
    a.alloc(2)
    a.park([0])
    with pytest.raises(ValueError, match="page 0 has 1 users, 1 of them parked, got 1 more to park"):
        a.park([1, 0])
    with pytest.raises(ValueError, match="page 1 has 0 parked users, got 1 to unpark"):
        a.unpark([0, 1])
    with pytest.raises(ValueError, match=r"page 0 has 1 users, 1 of them parked, got 1 releases \(unpark"):
        a.decref(np.array([1, 0]))
    with pytest.raises(ValueError, match=r"pages: expected page ids in \[0, 3\), got 3"):
        a.park([3])
    assert a.refcounts.tolist() == [1, 1, 0] and a.num_parked == 1
    a.unpark([0])
    assert a.num_parked == 0


# --------------------------------------------------------------- tree basics


def test_root_fork_append_share_partial_page_without_copy():
    c = TreeKVCache(num_pages=10, page_size=4)
    r = c.add_root(6)
    assert c.slots(r).tolist() == [0, 1, 2, 3, 4, 5] and c.num_free_pages == 8
    a, b = c.fork(r, 2)
    assert c.children(r) == [a, b] and c.parent(a) == r and c.parent(r) == -1
    assert c.num_tokens(a) == 0 and c.slots(a).size == 0
    # The first child continues in the root's half-filled page 1; the spill opens page 2,
    # which its sibling then shares.
    assert c.append(a, 3).tolist() == [6, 7, 8]
    assert c.append(b, 2).tolist() == [9, 10]
    assert c.allocator.refcounts[:3].tolist() == [1, 2, 2]
    assert c.path_slots(b).tolist() == [0, 1, 2, 3, 4, 5, 9, 10]
    assert c.append(a, 0).size == 0
    check_pages(c)


def test_page_size_one_and_empty_root():
    c = TreeKVCache(num_pages=5, page_size=1)
    e = c.add_root(0)
    assert c.slots(e).size == 0 and c.num_free_pages == 5
    (x,) = c.fork(e, 1)
    assert c.append(x, 3).tolist() == [0, 1, 2]
    check_pages(c)


def test_prune_frees_exactly_unused_pages_and_reuses_dead_tail_slots():
    c = TreeKVCache(num_pages=8, page_size=4)
    r = c.add_root(5)  # pages 0, 1 (page 1 holds one token)
    a, b = c.fork(r, 2)
    c.append(a, 2)  # slots 5, 6 in page 1
    c.append(b, 5)  # slot 7 in page 1, then page 2
    assert c.prune(a) == [a]
    assert c.allocator.refcounts[:3].tolist() == [1, 2, 1] and c.num_free_pages == 5
    assert c.prune(b) == [b]
    # Page 2 is free again and page 1 is rewound to just after the root's last token.
    assert c.num_free_pages == 6 and c.append(r, 1).tolist() == [5]
    check_pages(c)


def test_group_page_of_pruned_children_is_not_reused():
    c = TreeKVCache(num_pages=4, page_size=4)
    r = c.add_root(4)  # page 0 full
    (a,) = c.fork(r, 1)
    c.append(a, 1)  # page 1 opens as the group page of r's children
    c.prune(a)  # page 1 is free again ...
    other = c.add_root(1)  # ... and now belongs to another request
    assert c.slots(other).tolist() == [4]
    (b,) = c.fork(r, 1)
    assert c.append(b, 1).tolist() == [8]  # a fresh page, not other's page 1
    check_pages(c)


def test_group_page_freed_below_a_surviving_child_is_skipped():
    c = TreeKVCache(num_pages=3, page_size=4)
    r = c.add_root(4)  # page 0 full
    (_, g), _ = c.add_subtree(r, [-1, 0], [0, 1])  # g opens page 1 for r's subtree
    c.prune(g)  # page 1 is freed; r's middle child survives
    (d,) = c.fork(r, 1)
    assert c.append(d, 1).tolist() == [4]  # page 1 allocated afresh, not taken while free
    check_pages(c)


def test_prune_release_unused_ancestors_stops_at_shared_or_kept_nodes():
    c = TreeKVCache(num_pages=16, page_size=2)
    r = c.add_root(3)
    (mid,) = c.fork(r, 1)
    c.append(mid, 2)
    x, y = c.fork(mid, 2)
    c.append(x, 1)
    c.append(y, 1)
    assert c.prune(x, release_unused_ancestors=True) == [x]  # mid still has y
    assert c.prune(y, release_unused_ancestors=True, keep=[r]) == [y, mid]
    assert c.live_nodes == [r]
    (z,) = c.fork(r, 1)
    assert c.prune(z, release_unused_ancestors=True) == [z, r]
    assert c.live_nodes == [] and c.num_free_pages == 16
    check_pages(c)


def test_split_shares_the_boundary_page():
    c = TreeKVCache(num_pages=8, page_size=4)
    r = c.add_root(10)
    (leaf,) = c.fork(r, 1)
    c.append(leaf, 1)
    head = c.split(r, 6)
    assert c.slots(head).tolist() == [0, 1, 2, 3, 4, 5]
    assert c.slots(r).tolist() == [6, 7, 8, 9]
    assert c.parent(r) == head and c.parent(head) == -1 and c.children(head) == [r]
    assert c.path_slots(leaf).tolist() == list(range(11))
    assert c.allocator.refcounts[1] == 2  # page 1 holds tokens of both parts
    check_pages(c)
    c.prune(r)
    assert c.allocator.refcounts[1] == 1
    c.prune(head)
    assert c.num_free_pages == 8


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="on_copy: expected a callable or None, got object"):
        TreeKVCache(4, 4, on_copy=object())
    with pytest.raises(ValueError, match="page_size: expected a positive integer, got 0"):
        TreeKVCache(4, 0)
    c = TreeKVCache(num_pages=8, page_size=4)
    r = c.add_root(3)
    (a,) = c.fork(r, 1)
    c.prune(a)
    with pytest.raises(ValueError, match=rf"node: expected a live node id, got {a} \(pruned\)"):
        c.append(a)
    with pytest.raises(ValueError, match=r"expected a live node id, got 99 \(never created\)"):
        c.slots(99)
    with pytest.raises(ValueError, match="node: expected a live node id, got True"):
        c.fork(True, 1)
    with pytest.raises(ValueError, match="n: expected an integer >= 1, got 0"):
        c.fork(r, 0)
    with pytest.raises(ValueError, match="num_tokens: expected an integer >= 0, got -2"):
        c.append(r, -2)
    with pytest.raises(ValueError, match="num_tokens: expected an integer >= 0, got -1"):
        c.add_root(-1)
    c.fork(r, 1)
    with pytest.raises(ValueError, match=f"node: expected a node without live children.* {r}"):
        c.append(r)
    with pytest.raises(ValueError, match=r"at: expected an integer in \[1, 2\]"):
        c.split(r, 3)
    with pytest.raises(ValueError, match=r"parents\[1\]: expected -1 .* got 1"):
        c.add_subtree(r, [-1, 1])
    with pytest.raises(ValueError, match=r"num_tokens\[0\]: expected an integer >= 0, got -1"):
        c.add_subtree(r, [-1], [-1])
    with pytest.raises(ValueError, match=r"queries\[1\]: expected query_kv_len in \[0, 3\]"):
        c.layout([r, (r, 4)])
    with pytest.raises(ValueError, match=r"queries\[0\]: expected a live node id"):
        c.layout([a])
    with pytest.raises(ValueError, match=r"keep: expected a live node id"):
        c.prune(r, release_unused_ancestors=True, keep=[a])


def test_cache_full_changes_nothing_and_retry_after_prune_works():
    c = TreeKVCache(num_pages=4, page_size=4)
    r = c.add_root(9)  # 3 pages, 3 free slots in page 2
    a, b = c.fork(r, 2)
    c.append(a, 2)
    before = snapshot(c)
    for op in (
        lambda: c.append(b, 7),  # 1 slot left in page 2, then 2 pages needed
        lambda: c.add_root(5),
        lambda: c.add_subtree(b, [-1, 0], [3, 5]),
    ):
        with pytest.raises(CacheFullError, match="needed 2 free pages, 1 free"):
            op()
        assert snapshot(c) == before
    c.prune(a)
    assert c.append(b, 7).size == 7
    check_pages(c)


# --------------------------------------------------------- speculative drafts


def test_add_subtree_packs_drafts_and_commit_copies_only_misplaced_rows():
    pool = KVPool(num_layers=2, num_pages=16, page_size=4, num_kv_heads=1, head_dim=2)
    c = TreeKVCache(16, 4, on_copy=copying(pool))
    r = c.add_root(6)
    write_values(pool, c.slots(r), np.arange(6) + 1.0)
    # Draft tree under the leaf r: 0 -> 1 -> 2, and 0 -> 3, and 4 (all one token each).
    ids, slots = c.add_subtree(r, [-1, 0, 1, 0, -1])
    assert slots.tolist() == [6, 7, 8, 9, 10]  # packed right after the leaf's tokens
    assert c.allocator.refcounts[:3].tolist() == [1, 3, 3]
    write_values(pool, slots, np.array([10.0, 11, 12, 13, 14]))
    layout = c.layout(ids)
    assert layout.num_nodes == 6 and layout.query_kv_lens.tolist() == [1] * 5
    # Accept 0 -> 3: draft 0 is in place (slot 6), draft 3 moves from slot 9 to slot 7.
    src, dst = c.commit_path(r, [ids[0], ids[3]])
    assert (src.tolist(), dst.tolist()) == ([9], [7])
    assert c.live_nodes == [r] and c.slots(r).tolist() == list(range(8))
    for layer in range(2):
        got = pool.k[layer].view(-1)[:16].view(-1, 2)[:8, 0]
        assert got.tolist() == [1, 2, 3, 4, 5, 6, 10, 13]
    check_pages(c)
    assert c.num_free_pages == 14 and c._fill[1] == 4  # page 2 freed, page 1 rewound then refilled
    assert c.commit_path(r, [])[0].size == 0  # nothing to keep: a no-op


def test_commit_path_validates_chain_and_space():
    c = TreeKVCache(num_pages=3, page_size=2)
    r = c.add_root(2)  # page 0 full
    ids, _ = c.add_subtree(r, [-1, 0, 1, -1])  # pages 1, 2
    bad = rf"path\[1\]: expected a child of node {ids[0]}, got node {ids[3]}"
    with pytest.raises(ValueError, match=bad):
        c.commit_path(r, [ids[0], ids[3]])
    with pytest.raises(ValueError, match=r"path\[0\]: expected a child of node"):
        c.commit_path(ids[0], [ids[2]])
    before = snapshot(c)
    with pytest.raises(ValueError, match="leaf"):
        c.commit_path(99, [])
    assert snapshot(c) == before
    src, dst = c.commit_path(r, ids[:3])  # 3 tokens into freed pages; no pool: caller copies
    assert src.tolist() == [] and dst.tolist() == [] and c.num_tokens(r) == 5


def test_commit_path_cache_full_changes_nothing():
    c = TreeKVCache(num_pages=3, page_size=4)
    r = c.add_root(4)  # page 0
    a, b = c.fork(r, 2)
    c.append(b, 1)  # slot 4: page 1 becomes the group page of r's children
    ids, _ = c.add_subtree(b, [-1], [2])  # slots 5, 6 after b's token
    c.append(a, 1)  # slot 7: page 1 is full, and a keeps it alive
    c.add_root(4)  # page 2: no page is free
    # The 2 accepted tokens no longer fit in page 1 once the draft goes (slot 7 is live).
    before = snapshot(c)
    with pytest.raises(CacheFullError, match="needed 1 free pages, 0 free"):
        c.commit_path(b, ids)
    assert snapshot(c) == before
    c.prune(a)
    assert c.commit_path(b, ids)[0].size == 0  # fits in place once a is gone


# ------------------------------------------------------------------- layout


def test_layout_matches_nodes_and_keeps_query_order():
    c = TreeKVCache(num_pages=32, page_size=4)
    r = c.add_root(7)
    a, b = c.fork(r, 2)
    c.append(a, 5)
    c.append(b, 2)
    (d,) = c.fork(a, 1)
    c.append(d, 3)
    c.prune(b)  # forces a swap in the dense order
    layout = c.layout([(d, 1), a, (r, 0)])
    ids = c.layout_nodes().tolist()
    assert sorted(ids) == sorted(c.live_nodes)
    for j, n in enumerate(ids):
        lo, hi = layout.node_kv_indptr[j], layout.node_kv_indptr[j + 1]
        assert layout.kv_indices[lo:hi].tolist() == c.slots(n).tolist()
        p = layout.parents[j]
        assert (ids[p] if p >= 0 else -1) == c.parent(n)
    assert [ids[q] for q in layout.query_nodes] == [d, a, r]
    assert layout.query_kv_lens.tolist() == [1, 5, 0]


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_layout_through_tree_attention_matches_reference(page_size):
    gen = torch.Generator().manual_seed(page_size)
    h_q, h_kv, dim = 4, 2, 16
    pool = KVPool(1, 128, page_size, h_kv, dim)
    c = TreeKVCache(128, page_size, on_copy=copying(pool))
    r = c.add_root(37)
    beams = c.fork(r, 3)
    for i, n in enumerate(beams):
        c.append(n, 5 + 4 * i)
    (x, y) = c.fork(beams[1], 2)
    c.append(x, 2)
    drafts, _ = c.add_subtree(y, [-1, 0, 0, 1, -1])
    c.prune(beams[0])
    c.split(beams[2], 3)
    for layer_pool in (pool.k[0], pool.v[0]):  # every slot, used or not, gets random K/V
        layer_pool.copy_(torch.randn(layer_pool.shape, generator=gen))
    queries = [beams[2], x, (y, 0), *drafts, (r, 20)]
    layout = c.layout(queries)
    q = torch.randn(len(queries), h_q, dim, generator=gen)
    attn = TreeAttention(h_q, h_kv, dim, backend="torch", device="cpu", block_kv=8)
    attn.plan(layout)
    out, lse = attn.run(q, pool.k[0], pool.v[0], return_lse=True)
    flat_k, flat_v = (t.view(-1, h_kv, dim) for t in (pool.k[0], pool.v[0]))
    ref_o, ref_lse = reference_attention(q, flat_k, flat_v, layout, attn.sm_scale)
    torch.testing.assert_close(out, ref_o.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------- stateful model check


class CacheModel(RuleBasedStateMachine):
    """Random add/fork/append/expect/add_subtree/split/prune/commit sequences against a plain
    model.

    The model keeps each live node's parent and the unique values written into its
    tokens' K/V; after every step the cache must agree on structure, page counts,
    layouts and the K/V every live node reads back. Nodes are parked and unparked at random
    as the server's prefix cache does (unparked before they split or go), and the
    allocator's counts of pages in use and parked pages must equal a recount.
    """

    @initialize(page_size=st.sampled_from([1, 2, 3, 4, 16]), num_pages=st.integers(3, 40))
    def setup(self, page_size, num_pages):
        self.pool = KVPool(1, num_pages, page_size, 1, 1)
        self.cache = TreeKVCache(num_pages, page_size, on_copy=copying(self.pool))
        self.parent: dict[int, int] = {}
        self.values: dict[int, list[float]] = {}
        self.next_value = 1.0
        self.parked: dict[int, list[int]] = {}  # node -> the pages parked for it

    def fill(self, node: int, slots: np.ndarray) -> None:
        vals = self.next_value + np.arange(len(slots))
        self.next_value += len(slots)
        write_values(self.pool, slots, vals)
        self.values[node] = self.values.get(node, []) + vals.tolist()

    def attempt(self, op):
        """Run ``op``; on CacheFullError the cache must be exactly as before."""
        before = snapshot(self.cache)
        try:
            return op()
        except CacheFullError:
            assert snapshot(self.cache) == before
            return None

    def children_of(self, node: int) -> list[int]:
        return [n for n, p in self.parent.items() if p == node]

    def subtree(self, node: int) -> list[int]:
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(self.children_of(n))
        return out

    def drop(self, nodes) -> None:
        for n in nodes:
            del self.parent[n], self.values[n]

    def unpark(self, nodes) -> None:
        for n in nodes:
            if n in self.parked:
                self.cache.allocator.unpark(self.parked.pop(n))

    @rule(k=st.integers(0, 40))
    def add_root(self, k):
        node = self.attempt(lambda: self.cache.add_root(k))
        if node is not None:
            self.parent[node] = -1
            self.values[node] = []
            self.fill(node, self.cache.slots(node))

    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data, n):
        if not self.parent:
            return
        node = data.draw(st.sampled_from(sorted(self.parent)))
        for child in self.cache.fork(node, n):
            self.parent[child], self.values[child] = node, []

    @rule(data=st.data(), k=st.integers(0, 20))
    def append(self, data, k):
        leaves = sorted(n for n in self.parent if not self.children_of(n))
        if not leaves:
            return
        node = data.draw(st.sampled_from(leaves))
        slots = self.attempt(lambda: self.cache.append(node, k))
        if slots is not None:
            self.fill(node, slots)

    @rule(data=st.data(), pages=st.sampled_from([0, 4, 6, 8]),
          ks=st.lists(st.integers(0, 20), max_size=3))
    def expect_and_append(self, data, pages, ks):
        """A leaf is expected to grow by ``pages`` pages (0: no expectation), then grows by
        ``ks`` tokens, one append each."""
        leaves = sorted(n for n in self.parent if not self.children_of(n))
        if not leaves:
            return
        node = data.draw(st.sampled_from(leaves))
        more = pages * self.cache.page_size
        self.cache.expect(node, self.cache.num_tokens(node) + more if more else 0)
        for k in ks:
            slots = self.attempt(lambda k=k: self.cache.append(node, k))
            if slots is not None:
                self.fill(node, slots)

    @rule(data=st.data(), m=st.integers(1, 12))
    def add_subtree(self, data, m):
        if not self.parent:
            return
        node = data.draw(st.sampled_from(sorted(self.parent)))
        parents = [data.draw(st.integers(-1, i - 1)) for i in range(m)]
        lens = data.draw(st.lists(st.integers(0, 3), min_size=m, max_size=m))
        got = self.attempt(lambda: self.cache.add_subtree(node, parents, lens))
        if got is None:
            return
        ids, slots = got
        assert np.concatenate([self.cache.slots(i) for i in ids]).tolist() == slots.tolist()
        for i, nid in enumerate(ids):
            self.parent[nid] = node if parents[i] < 0 else ids[parents[i]]
            self.values[nid] = []
            self.fill(nid, self.cache.slots(nid))

    @rule(data=st.data())
    def split(self, data):
        big = sorted(n for n, v in self.values.items() if len(v) >= 2)
        if not big:
            return
        node = data.draw(st.sampled_from(big))
        at = data.draw(st.integers(1, len(self.values[node]) - 1))
        self.unpark([node])
        head = self.cache.split(node, at)
        self.parent[head], self.parent[node] = self.parent[node], head
        self.values[head], self.values[node] = self.values[node][:at], self.values[node][at:]

    @rule(data=st.data(), release=st.booleans())
    def prune(self, data, release):
        if not self.parent:
            return
        node = data.draw(st.sampled_from(sorted(self.parent)))
        keep = data.draw(st.lists(st.sampled_from(sorted(self.parent)), max_size=2))
        expect = self.subtree(node)
        cur = node
        while release and self.parent[cur] >= 0:
            up = self.parent[cur]
            if len(self.children_of(up)) != 1 or up in keep:
                break
            expect.append(up)
            cur = up
        self.unpark(expect)
        removed = self.cache.prune(node, release_unused_ancestors=release, keep=keep)
        assert sorted(removed) == sorted(expect)
        self.drop(expect)

    @rule(data=st.data())
    def commit(self, data):
        inner = sorted(n for n in self.parent if self.children_of(n))
        if not inner:
            return
        leaf = data.draw(st.sampled_from(inner))
        path, cur = [], leaf
        while self.children_of(cur) and data.draw(st.booleans()):
            cur = data.draw(st.sampled_from(sorted(self.children_of(cur))))
            path.append(cur)
        drafts = [n for c in self.children_of(leaf) for n in self.subtree(c)]
        held = {n: self.parked[n] for n in drafts if n in self.parked}
        self.unpark(drafts)
        moved = self.attempt(lambda: self.cache.commit_path(leaf, path))
        if moved is None:
            for n, pages in held.items():  # as it was
                self.cache.allocator.park(pages)
                self.parked[n] = pages
            return
        self.values[leaf] += [v for n in path for v in self.values[n]]
        self.drop([n for c in self.children_of(leaf) for n in self.subtree(c)])

    @rule(data=st.data())
    def park(self, data):
        idle = sorted(set(self.parent) - set(self.parked))
        if not idle:
            return
        for node in data.draw(st.lists(st.sampled_from(idle), min_size=1, unique=True)):
            pages = np.unique(self.cache.slots(node) // self.cache.page_size).tolist()
            self.cache.allocator.park(pages)
            self.parked[node] = pages

    @rule(data=st.data())
    def unpark_one(self, data):
        if self.parked:
            self.unpark([data.draw(st.sampled_from(sorted(self.parked)))])

    @invariant()
    def allocator_counts_agree(self):
        if not hasattr(self, "cache"):
            return
        users = self.cache.allocator.refcounts
        parked = np.zeros_like(users)
        for pages in self.parked.values():
            parked[pages] += 1
        assert self.cache.allocator.num_used == int(np.count_nonzero(users))
        assert self.cache.allocator.num_parked == int(np.count_nonzero((users > 0) & (users == parked)))
        # White-box: claims are free pages right after a live, childless owner's last page.
        claims = self.cache.allocator._claims
        assert self.cache.allocator.num_claimed == sum(hi - lo for lo, hi in claims.values())
        ps = self.cache.page_size
        for owner, (lo, hi) in claims.items():
            assert owner in self.parent and not self.children_of(owner)
            assert (users[lo:hi] == 0).all() and int(self.cache.slots(owner)[-1]) // ps == lo - 1

    @invariant()
    def structure_and_pages_agree(self):
        if not hasattr(self, "cache"):
            return
        c = self.cache
        assert sorted(c.live_nodes) == sorted(self.parent)
        for n, p in self.parent.items():
            assert c.parent(n) == p
            assert sorted(c.children(n)) == sorted(self.children_of(n))
            assert c.num_tokens(n) == len(self.values[n])
        check_pages(c)

    @invariant()
    def kv_of_live_nodes_never_changes(self):
        if not hasattr(self, "cache"):
            return
        for n in self.parent:
            expect, cur = [], n
            while cur >= 0:
                expect = self.values[cur] + expect
                cur = self.parent[cur]
            assert read_values(self.pool, self.cache.path_slots(n)).tolist() == expect
            assert self.cache.position(n) == len(expect)  # kept, never walked

    @invariant()
    def layout_matches_model(self):
        if not hasattr(self, "cache"):
            return
        nodes = sorted(self.parent)
        layout = self.cache.layout(nodes)
        assert isinstance(layout, TreeLayout)
        ids = self.cache.layout_nodes().tolist()
        assert sorted(ids) == nodes
        index = {n: j for j, n in enumerate(ids)}
        for j, n in enumerate(ids):
            p = self.parent[n]
            assert layout.parents[j] == (index[p] if p >= 0 else -1)
            lo, hi = layout.node_kv_indptr[j], layout.node_kv_indptr[j + 1]
            got = read_values(self.pool, layout.kv_indices[lo:hi]).tolist()
            assert got == self.values[n]
        assert [ids[q] for q in layout.query_nodes] == nodes
        assert layout.query_kv_lens.tolist() == [len(self.values[n]) for n in nodes]


CacheModel.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_cache_model = CacheModel.TestCase
