"""Expert-parallel ownership: which of N ranks (GPUs of one host) holds a routed expert, and under which id.

    global expert e in [0, E)  ->  rank  = e % N      (owner)
                                   local = e // N     (the id rank keeps it under)
    e = local * N + rank                              (global_id)
    ids [..] (global, -1 = padding)  --rank_ids(ids, N, r)-->  [..] local ids where r owns them, -1 elsewhere

Each rank keeps its own slot pool, policy and link over its `local_experts(E, N, r)` experts (E / N
rounded up for the low ranks, down for the high ones); the engine and the simulator (sim.ranks) both
map routing through this module, so their ranks agree.

Why modulo rather than contiguous blocks: consecutive ids go to consecutive ranks, so a token's k
experts spread over the ranks (each computes and copies about k / N of them) unless the router favours
ids of one residue class; with blocks, a token whose experts cluster in one range of ids makes that
block's rank the slowest of the layer while the others wait. Every rank owns as many experts as any
other, +-1.

numpy only: no torch, so the simulator imports it without a GPU.
"""

from __future__ import annotations

import numpy as np


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_ranks(ranks: int, num_experts: int | None = None) -> None:
    """Raise ValueError naming `ranks` unless it is an int >= 1 (and <= num_experts when given: a rank
    that owns no expert has nothing to cache), or naming `num_experts` unless it is an int >= 1."""
    if not _is_int(ranks) or ranks < 1:
        raise ValueError(f"ranks must be an integer >= 1, got {ranks!r}")
    if num_experts is None:
        return
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be an integer >= 1, got {num_experts!r}")
    if ranks > num_experts:
        raise ValueError(f"ranks must be <= num_experts ({num_experts}): with {ranks} ranks some own no "
                         f"expert, got ranks={ranks}")


def _check_rank(ranks: int, rank: int) -> None:
    """Raise ValueError naming `ranks` or `rank` unless 0 <= rank < ranks."""
    check_ranks(ranks)
    if not _is_int(rank) or not 0 <= rank < ranks:
        raise ValueError(f"rank must be an integer in [0, {ranks}) (ranks={ranks}), got {rank!r}")


def _expert_array(name: str, ids, lowest: int) -> np.ndarray:
    """`ids` as an integer array, every entry >= lowest; raises ValueError naming `name`."""
    a = np.asarray(ids)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.size and a.min() < lowest:
        raise ValueError(f"{name} holds {int(a.min())}: expert ids are >= 0"
                         + (" (-1 pads)" if lowest == -1 else ""))
    return a


def owner(expert, ranks: int):
    """The rank that owns global expert id(s) `expert` (an int or an integer array, ids >= 0): expert % ranks,
    of the same form. Raises ValueError naming `expert` or `ranks`."""
    check_ranks(ranks)
    a = _expert_array("expert", expert, 0)
    return a % ranks if a.ndim else int(a) % ranks


def local_id(expert, ranks: int):
    """The id global expert(s) `expert` (ids >= 0) have on their owning rank: expert // ranks. Raises
    ValueError naming `expert` or `ranks`."""
    check_ranks(ranks)
    a = _expert_array("expert", expert, 0)
    return a // ranks if a.ndim else int(a) // ranks


def global_id(local, ranks: int, rank: int):
    """The global id of local expert id(s) `local` (>= 0) of `rank`: local * ranks + rank. Raises ValueError
    naming `local`, `ranks` or `rank`."""
    _check_rank(ranks, rank)
    a = _expert_array("local", local, 0)
    return a * ranks + rank if a.ndim else int(a) * ranks + rank


def local_experts(num_experts: int, ranks: int, rank: int) -> int:
    """How many of `num_experts` experts `rank` owns: ceil((num_experts - rank) / ranks), the ids
    rank, rank + ranks, ... below num_experts. Raises ValueError naming the bad argument (ranks must be
    <= num_experts)."""
    check_ranks(ranks, num_experts)
    _check_rank(ranks, rank)
    return (num_experts - rank + ranks - 1) // ranks


def rank_ids(ids, ranks: int, rank: int) -> np.ndarray:
    """Routing as `rank` sees it: ids, an integer array of global expert ids (-1 = padding) of any shape,
    -> an array of the same shape and dtype holding local ids (id // ranks) where `rank` owns the expert
    and -1 everywhere else (padding and the other ranks' experts). The ranks' outputs partition the valid
    entries: each one is non-negative in exactly one of them. O(ids.size). Raises ValueError naming `ids`
    (a non-integer array, an id below -1), `ranks` or `rank`."""
    _check_rank(ranks, rank)
    a = _expert_array("ids", ids, -1)
    mine = (a >= 0) & (a % ranks == rank)
    return np.where(mine, a // ranks, -1).astype(a.dtype, copy=False)


def rank_keys(num_layers: int, num_experts: int, ranks: int, rank: int) -> np.ndarray:
    """The global keys (layer * num_experts + expert) of the experts `rank` owns, in its local key order
    (layer * local_experts + local id): int64 [num_layers * local_experts(num_experts, ranks, rank)], the
    rows of the whole model's HostStore that the rank's store holds. Raises ValueError naming the bad
    argument."""
    if not _is_int(num_layers) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
    local = np.arange(local_experts(num_experts, ranks, rank), dtype=np.int64)
    layers = np.arange(num_layers, dtype=np.int64)[:, None]
    return (layers * num_experts + local[None, :] * ranks + rank).reshape(-1)
