"""The side stream: error paths on any machine; on a GPU, a dedicated stream that no pooled torch
stream, the current stream or a capture stream aliases, and fork / join that order work eagerly and
inside a CUDA graph."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from expertcache import streams
from expertcache.streams import SideStream, create_nonblocking_stream, load_cudart


def test_missing_cuda_python_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes the import fail
    with pytest.raises(RuntimeError, match="pip install cuda-python") as info:
        load_cudart()
    assert "EXPERTCACHE_MOE_COPY_OVERLAP" in str(info.value)


class FakeCudart:
    """The two calls create_nonblocking_stream makes, returning a chosen error code."""

    class cudaError_t:  # mirrors cuda.bindings.runtime
        cudaSuccess = types.SimpleNamespace(name="cudaSuccess")
        cudaErrorNoDevice = types.SimpleNamespace(name="cudaErrorNoDevice")

    cudaStreamNonBlocking = 1

    def __init__(self, err):
        self.err, self.flags = err, []

    def cudaStreamCreateWithFlags(self, flags):
        self.flags.append(flags)
        return self.err, 0xBEEF


def test_create_checks_the_error_code():
    fake = FakeCudart(FakeCudart.cudaError_t.cudaErrorNoDevice)
    with pytest.raises(RuntimeError, match="cudaErrorNoDevice"):
        create_nonblocking_stream(fake)
    ok = FakeCudart(FakeCudart.cudaError_t.cudaSuccess)
    assert create_nonblocking_stream(ok) == 0xBEEF
    assert ok.flags == [FakeCudart.cudaStreamNonBlocking]


def test_a_cpu_device_is_refused():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        SideStream("cpu")


@pytest.mark.gpu
def test_never_aliases_pooled_current_or_capture_streams():
    side = SideStream()
    pooled = [torch.cuda.Stream() for _ in range(64)]
    assert side.handle == side.stream.cuda_stream
    assert side.handle not in {s.cuda_stream for s in pooled}
    assert side.handle != torch.cuda.current_stream().cuda_stream
    x = torch.zeros(1 << 16, device="cuda")
    y = torch.empty_like(x)
    graph, seen = torch.cuda.CUDAGraph(), {}
    with torch.cuda.graph(graph):
        capture = torch.cuda.current_stream()
        seen["capture"] = capture.cuda_stream
        side.fork(capture)
        with torch.cuda.stream(side.stream):
            y.copy_(x * 2 + 1)
        side.join(capture)
        x.add_(y)
    assert side.handle != seen["capture"]
    assert side.handle not in {s.cuda_stream for s in pooled}
    for _step in range(3):
        graph.replay()
    torch.cuda.synchronize()
    # x: 0 -> 1 -> 4 -> 13 (x += 2x + 1 each replay, the side work ordered before the add)
    assert torch.equal(x, torch.full_like(x, 13.0))
    side.close()


@pytest.mark.gpu
def test_fork_join_order_eager_and_close_once():
    side = SideStream()
    compute = torch.cuda.current_stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(2_000_000)  # the compute stream is busy: an unordered read would see zeros
    x.fill_(3.0)
    side.fork(compute)
    with torch.cuda.stream(side.stream):
        y = x * 2
    y.record_stream(compute)
    side.join(compute)
    z = y + 1
    torch.cuda.synchronize()
    assert torch.equal(z, torch.full_like(x, 7.0))
    assert not side.closed
    side.close()
    side.close()
    assert side.closed and "closed=True" in repr(side)


def test_close_destroys_once(monkeypatch):
    """close() calls cudaStreamDestroy exactly once, also on CPU (the stream itself is faked)."""
    calls = []
    monkeypatch.setattr(streams, "_destroy", lambda cudart, handle: calls.append(handle))
    monkeypatch.setattr(streams, "load_cudart", lambda: object())
    side = SideStream.__new__(SideStream)
    side.handle = 0x1234
    side._finalizer = streams.weakref.finalize(side, streams._destroy_quietly, None, side.handle)
    side.close()
    side.close()
    assert calls == [0x1234] and side.closed
