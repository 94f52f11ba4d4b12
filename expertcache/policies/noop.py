"""Fast verbs shared by policies that have nothing to do at a step of the contract."""

from numba import njit


@njit(cache=True)
def no_evicted(kst, sst, gst, prm, clk, key, slot, score):  # noqa: ARG001
    return None


@njit(cache=True)
def no_refresh(kst, sst, gst, prm, fprm, clk, logit_idx, logit_val, k, changed, buf):  # noqa: ARG001
    return 0


@njit(cache=True)
def zero_offsets(prm, clk, off):  # noqa: ARG001
    """For policies whose score only changes when the slot is touched: order = score."""
    off[:] = 0
    return 0
