"""TreeLayout: accepted inputs and every validation error."""

import numpy as np
import pytest
import torch

from deft import TreeLayout


def test_accepts_lists_numpy_and_tensors():
    ref = TreeLayout([-1, 0], [0, 3, 5], [4, 1, 0, 2, 3], [1])
    for conv in (np.asarray, torch.tensor, lambda x: torch.tensor(x, dtype=torch.int32)):
        lay = TreeLayout(conv([-1, 0]), conv([0, 3, 5]), conv([4, 1, 0, 2, 3]), conv([1]))
        for name in ("parents", "node_kv_indptr", "kv_indices", "query_nodes", "query_kv_lens"):
            np.testing.assert_array_equal(getattr(lay, name), getattr(ref, name))
    assert ref.query_kv_lens.tolist() == [2]  # default: the whole node
    assert ref.num_nodes == 2 and ref.num_tokens == 5 and ref.num_queries == 1


def test_arrays_are_read_only():
    lay = TreeLayout([-1], [0, 2], [0, 1], [0])
    with pytest.raises(ValueError):
        lay.kv_indices[0] = 5


def test_empty_layout_is_valid():
    lay = TreeLayout([], [0], [], [])
    assert lay.num_nodes == 0 and lay.num_queries == 0


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(parents=[-1, 2, 1]), ValueError, r"node [12] is its own ancestor \(a cycle\)"),
        (dict(parents=[0]), ValueError, "node 0 is its own ancestor"),
        (dict(parents=[-1, 0, 3, 4, 2]), ValueError, "its own ancestor"),
        (dict(parents=[-1, 5]), ValueError, r"parents\[1\]: expected -1 \(root\) or a node index in \[0, 2\), got 5"),
        (dict(parents=[-2, 0]), ValueError, r"parents\[0\]"),
        (dict(query_nodes=[0, 7]), ValueError, r"query_nodes\[1\]: expected a node index in \[0, 2\), got 7"),
        (dict(query_nodes=[-1]), ValueError, r"query_nodes\[0\]"),
        (dict(query_kv_lens=[4]), ValueError, r"query_kv_lens\[0\]: expected 0..3 \(length of node 1\), got 4"),
        (dict(query_kv_lens=[-1]), ValueError, r"query_kv_lens\[0\]"),
        (dict(query_kv_lens=[1, 2]), ValueError, r"query_kv_lens: expected shape \(1,\)"),
        (dict(kv_indices=[0, 1, -3, 4, 5]), ValueError, r"kv_indices\[2\]: expected a slot >= 0, got -3"),
        (dict(node_kv_indptr=[0, 2]), ValueError, r"node_kv_indptr: expected length num_nodes \+ 1 = 3, got 2"),
        (dict(node_kv_indptr=[1, 2, 5]), ValueError, r"node_kv_indptr\[0\]: expected 0"),
        (dict(node_kv_indptr=[0, 3, 2]), ValueError, r"node_kv_indptr\[2\]: expected >= node_kv_indptr\[1\] = 3"),
        (dict(node_kv_indptr=[0, 2, 4]), ValueError, r"node_kv_indptr\[-1\]: expected len\(kv_indices\) = 5"),
        (dict(parents=[-1.0, 0.0]), TypeError, "parents: expected integers"),
        (dict(kv_indices=torch.zeros(5)), TypeError, "kv_indices: expected an integer tensor"),
        (dict(query_nodes=[[1]]), ValueError, r"query_nodes: expected a 1-D sequence"),
        (dict(parents=[True, False]), TypeError, "parents: expected integers"),
    ],
)
def test_validation_errors(kwargs, exc, message):
    args = dict(parents=[-1, 0], node_kv_indptr=[0, 2, 5], kv_indices=[0, 1, 2, 3, 4], query_nodes=[1])
    args.update(kwargs)
    with pytest.raises(exc, match=message):
        TreeLayout(**args)


def test_from_node_lengths():
    lay = TreeLayout.from_node_lengths([-1, 0, 0], [3, 0, 2], [1, 2], [0, 1])
    assert lay.node_kv_indptr.tolist() == [0, 3, 3, 5]
    assert lay.kv_indices.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"node_lens\[1\]: expected a length >= 0, got -1"):
        TreeLayout.from_node_lengths([-1, 0], [3, -1], [0])


def test_long_chain_is_not_a_cycle():
    n = 5000
    lay = TreeLayout.from_node_lengths(np.arange(-1, n - 1), np.ones(n, np.int64), [n - 1])
    assert lay.num_nodes == n
