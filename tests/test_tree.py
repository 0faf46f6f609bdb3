import numpy as np
import pytest

from specrl.errors import ConfigError
from specrl.tree import TreeShape, tree_shape


@pytest.mark.parametrize("k", range(0, 9))
@pytest.mark.parametrize("w", range(1, 5))
def test_shape_family_sizes_and_closure(k, w):
    s = tree_shape(k, w)
    assert s.num_nodes == k * w
    assert s.max_depth == k
    paths = set(s.paths)
    for p in s.paths[1:]:
        assert p[:-1] in paths  # parent present
        assert p[-1] == 0 or p[:-1] + (p[-1] - 1,) in paths  # lower-ranked sibling present
    assert all(tuple([0] * d) in paths for d in range(k + 1))  # always contains the chain
    # breadth-first numbering: parents precede children, depths non-decreasing
    assert (s.parent[1:] < np.arange(1, len(s.paths))).all()
    assert (np.diff(s.depth) >= 0).all()
    # nodes per depth: one entry per depth 1..k, each at least the chain node, summing to k * w
    assert len(s.level_sizes) == k and sum(s.level_sizes) == k * w
    assert all(n == len(s.level(d)) >= 1 for d, n in enumerate(s.level_sizes, start=1))


def test_chain_is_width_one():
    s = tree_shape(4, 1)
    assert s.paths == ((), (0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    assert s.children[0] == (1,)


def test_ancestor_matrix():
    s = tree_shape(3, 3)
    idx = s.index()
    i = idx[(1, 0)]
    assert s.ancestors[i, idx[()]] and s.ancestors[i, idx[(1,)]] and s.ancestors[i, i]
    assert not s.ancestors[i, idx[(0,)]]


def test_from_paths_rejects_gaps():
    with pytest.raises(ConfigError, match="lower-ranked sibling"):
        TreeShape.from_paths([(1,)])
    with pytest.raises(ConfigError, match="no parent"):
        TreeShape.from_paths([(0, 0)])


@pytest.mark.parametrize("k,w", [(-1, 1), (17, 1), (2, 0), (2, 9), (2.5, 1)])
def test_action_out_of_range(k, w):
    with pytest.raises(ConfigError, match="Allowed"):
        tree_shape(k, w)
