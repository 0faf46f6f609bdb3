import numpy as np

from specrl.drafters.ngram import fill_tree, lookup, ngram_tree
from specrl.tree import tree_shape


def arr(*xs):
    return np.array(xs, dtype=np.int64)


def test_lookup_prefers_longest_then_most_recent():
    # suffix (7, 8) occurs earlier followed by 1 2 3 ; 8 alone occurs followed by 5
    seq = arr(7, 8, 1, 2, 3, 9, 8, 5, 6, 7, 8)
    found = lookup(seq, k=3, max_ngram=3, min_ngram=1, max_continuations=4)
    assert found.match_len == 2 and found.num_matches == 1
    assert found.continuations[0].tolist() == [1, 2, 3]
    # the 1-gram matches come after, most recent first: 8 @6 -> 5 6 7, 8 @1 -> 1 2 3 (duplicate)
    assert [c.tolist() for c in found.continuations] == [[1, 2, 3], [5, 6, 7]]


def test_lookup_no_match_and_short_inputs():
    assert lookup(arr(1, 2, 3), k=4).continuations == []
    assert lookup(arr(1), k=4).match_len == 0
    assert lookup(arr(4, 4), k=0).continuations == []


def test_continuation_truncated_at_sequence_end():
    found = lookup(arr(5, 6, 5), k=4, max_ngram=1)
    assert found.continuations[0].tolist() == [6, 5]


def test_fill_tree_maps_trie_to_rank_paths():
    shape = tree_shape(3, 3)
    idx = shape.index()
    tokens, present = fill_tree([arr(1, 2, 3), arr(1, 4), arr(9)], shape)
    assert tokens[idx[(0,)]] == 1 and tokens[idx[(1,)]] == 9
    assert tokens[idx[(0, 0)]] == 2 and tokens[idx[(0, 1)]] == 4 and tokens[idx[(0, 0, 0)]] == 3
    assert not present[idx[(2,)]] and not present[idx[(1, 0)]]
    # siblings are distinct tokens
    for _node, kids in enumerate(shape.children):
        toks = [tokens[c] for c in kids if present[c]]
        assert len(toks) == len(set(toks))


def test_ngram_tree_sets_root_and_chain_uses_first_match():
    seq = arr(1, 2, 3, 4, 1, 2, 3, 5, 1, 2)
    tokens, present, match_len, count = ngram_tree(seq, tree_shape(2, 1))
    assert tokens[0] == 2 and present.all()
    assert tokens[1:].tolist() == [3, 5]  # most recent match of (1, 2) is followed by 3 5
    assert match_len == 2 and count == 2


def test_tree_sizes_equal_ngram_tree_for_every_action():
    """One shared suffix scan gives every action's tree size, match statistics and the 1-token
    prediction exactly as separate ngram_tree / lookup calls do (small vocabularies: many ties)."""
    import numpy as np

    from specrl.drafters.ngram import lookup, ngram_tree, tree_sizes
    from specrl.replay import action_table
    from specrl.tree import tree_shape

    shapes = [tree_shape(k, w) if k else None for k, w in action_table([0, 1, 2, 3, 4, 6, 8], [1, 2, 3, 4])]
    rng = np.random.default_rng(0)
    for _ in range(150):
        seq = rng.integers(0, int(rng.integers(2, 20)), size=int(rng.integers(1, 200)))
        sizes, ml, nm, pred = tree_sizes(seq, shapes)
        first = lookup(seq, 1, max_continuations=1)
        assert pred == (int(first.continuations[0][0]) if first.continuations else -1)
        for a, shape in enumerate(shapes):
            if shape is None:
                assert sizes[a] == 1
                continue
            _, present, m2, n2 = ngram_tree(seq, shape)
            assert (sizes[a], ml, nm) == (present.sum(), m2, n2)
