"""Expert-parallel ownership (expertcache.ranks): on fresh random routing, the ranks' local ids partition the
valid entries exactly and map back to the global ids; one rank is the identity; bad arguments are named."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from expertcache.ranks import global_id, local_experts, local_id, owner, rank_ids, rank_keys


@st.composite
def routing(draw):
    """(ids int32 [C, rows, k] of global ids with -1 padding, num_experts, ranks <= num_experts), from a
    fresh numpy generator each example."""
    num_experts = draw(st.integers(1, 300))
    ranks = draw(st.integers(1, min(num_experts, 9)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    shape = tuple(int(v) for v in rng.integers(1, 7, size=3))
    ids = rng.integers(0, num_experts, size=shape).astype(np.int32)
    ids[rng.random(shape) < 0.2] = -1
    return ids, num_experts, ranks


@given(routing())
def test_the_ranks_partition_the_valid_entries_and_map_back(case):
    ids, num_experts, ranks = case
    seen = np.zeros(ids.shape, dtype=np.int64)
    back = np.full(ids.shape, -1, dtype=np.int64)
    for rank in range(ranks):
        mine = rank_ids(ids, ranks, rank)
        assert mine.shape == ids.shape and mine.dtype == ids.dtype
        owned = mine >= 0
        assert (mine[~owned] == -1).all()
        assert (mine[owned] < local_experts(num_experts, ranks, rank)).all()
        assert (ids[owned] % ranks == rank).all()
        seen += owned
        back[owned] = mine[owned].astype(np.int64) * ranks + rank  # local * N + rank
        assert (global_id(mine[owned], ranks, rank) == ids[owned]).all()
    assert (seen == (ids >= 0)).all()  # every valid entry in exactly one rank, padding in none
    assert (back == ids).all()


@given(st.integers(1, 500), st.data())
def test_local_expert_counts_are_the_owned_ids_and_sum_to_all(num_experts, data):
    ranks = data.draw(st.integers(1, num_experts))
    counts = [local_experts(num_experts, ranks, r) for r in range(ranks)]
    every = np.arange(num_experts)
    assert counts == [int((every % ranks == r).sum()) for r in range(ranks)]
    assert sum(counts) == num_experts and max(counts) - min(counts) <= 1
    assert counts == [-(-(num_experts - r) // ranks) for r in range(ranks)]


def test_owner_and_local_id_of_scalars_and_arrays():
    assert owner(13, 4) == 1 and local_id(13, 4) == 3 and global_id(3, 4, 1) == 13
    experts = np.array([0, 5, 6, 11])
    assert owner(experts, 3).tolist() == [0, 2, 0, 2]
    assert local_id(experts, 3).tolist() == [0, 1, 2, 3]
    assert global_id(local_id(experts, 3), 3, 2).tolist() == [2, 5, 8, 11]  # rank 2's ids at those locals


@given(routing())
def test_one_rank_is_the_identity(case):
    ids, num_experts, _ = case
    assert np.array_equal(rank_ids(ids, 1, 0), ids)
    assert local_experts(num_experts, 1, 0) == num_experts


@pytest.mark.parametrize("call, name", [
    (lambda: rank_ids(np.zeros(3, np.int32), 0, 0), "ranks must"),
    (lambda: rank_ids(np.zeros(3, np.int32), True, 0), "ranks must"),
    (lambda: rank_ids(np.zeros(3, np.int32), 2.0, 0), "ranks must"),
    (lambda: rank_ids(np.zeros(3, np.int32), 2, 2), "rank must"),
    (lambda: rank_ids(np.zeros(3, np.int32), 2, -1), "rank must"),
    (lambda: rank_ids(np.array([0, -2], np.int32), 2, 0), "ids"),
    (lambda: rank_ids(np.array([0.0, 1.0]), 2, 0), "ids"),
    (lambda: local_experts(4, 5, 0), "ranks must be <= num_experts"),
    (lambda: local_experts(0, 1, 0), "num_experts"),
    (lambda: local_experts(8, 2, 2), "rank must"),
    (lambda: owner(-1, 2), "expert"),
    (lambda: owner(3, 0), "ranks must"),
    (lambda: local_id(np.array([1, -1]), 2), "expert"),
    (lambda: global_id(-1, 2, 0), "local"),
    (lambda: global_id(1, 2, 3), "rank must"),
])
def test_bad_arguments_are_refused_by_name(call, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        call()


@given(st.integers(1, 6), st.integers(1, 40), st.data())
def test_rank_keys_are_every_owned_key_once_in_local_order(layers, num_experts, data):
    ranks = data.draw(st.integers(1, num_experts))
    keys = [rank_keys(layers, num_experts, ranks, r) for r in range(ranks)]
    assert np.array_equal(np.sort(np.concatenate(keys)), np.arange(layers * num_experts))
    for r, k in enumerate(keys):
        e_r = local_experts(num_experts, ranks, r)
        local = np.arange(layers * e_r)
        assert np.array_equal(k, (local // e_r) * num_experts + global_id(local % e_r, ranks, r))


def test_rank_keys_refuses_bad_layers():
    with pytest.raises(ValueError, match="num_layers"):
        rank_keys(0, 8, 2, 0)
