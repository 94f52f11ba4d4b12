"""The decode side stream: a dedicated CUDA stream and the two events that fork and join it.

    compute stream: ──hidden ready──●fork_event─────── router, ensure, miss copy, routed GEMM ──wait──► combine
                                    │                                                          ▲
    side stream:                    └─wait──► shared-expert gate, shared expert ──●join_event──┘

`SideStream` owns a stream made with cuda-python's `cudaStreamCreateWithFlags(cudaStreamNonBlocking)`
and wrapped in `torch.cuda.ExternalStream`. It is never one of torch's pooled streams
(`torch.cuda.Stream()` hands out a round-robin pool of 32 per priority, which can return the stream a
graph is being captured on, or the compute stream, and silently serialise the side work). The fork and
join events are created and recorded once at construction, outside any capture, so `fork` and `join`
only record and wait: inside `torch.cuda.graph(...)` they become graph edges. The object depends on
nothing but the device, so it survives slot-pool rebuilds and graph re-captures.

cuda-python (`cuda.bindings`) is imported only when a side stream is built.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

INSTALL_HINT = ("pip install cuda-python (the 'gpu' extra), or turn the copy overlap off "
                "(EXPERTCACHE_MOE_COPY_OVERLAP=0 / MoEConfig.copy_overlap=False)")


def load_cudart():
    """cuda-python's runtime module. Raises RuntimeError naming the fix when it is missing."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as exc:
        raise RuntimeError(f"the side stream needs cuda-python's cuda.bindings ({exc}): {INSTALL_HINT}") from None
    return cudart


def _check(cudart, err, call: str) -> None:
    """Raise RuntimeError naming the CUDA error of `call` unless it is cudaSuccess."""
    if err != cudart.cudaError_t.cudaSuccess:
        name = getattr(err, "name", str(err))
        raise RuntimeError(f"{call} failed with {name}; the side stream cannot be used: {INSTALL_HINT}")


def create_nonblocking_stream(cudart) -> int:
    """A new cudaStreamNonBlocking stream on the current device; returns its handle as an int.

    Raises RuntimeError naming the CUDA error code when the call fails.
    """
    err, handle = cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking)
    _check(cudart, err, "cudaStreamCreateWithFlags(cudaStreamNonBlocking)")
    return int(handle)


def _destroy(cudart, handle: int) -> None:
    """cudaStreamDestroy(handle); queued work still completes (CUDA defers the release)."""
    (err,) = cudart.cudaStreamDestroy(cudart.cudaStream_t(handle))
    _check(cudart, err, "cudaStreamDestroy")


class SideStream:
    """A dedicated non-blocking CUDA stream with a fork and a join event.

    device: the CUDA device ("cuda" = the current one, "cuda:N"). Build it outside graph capture.
    Attributes: `stream` (torch.cuda.ExternalStream), `handle` (the cudaStream_t as an int),
    `fork_event`, `join_event` (torch.cuda.Event, recorded once at construction).
    Raises RuntimeError without CUDA, without cuda-python, or when the stream cannot be created.
    """

    def __init__(self, device: str | torch.device = "cuda") -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"a side stream needs a CUDA device, got {device} "
                               f"(cuda available: {torch.cuda.is_available()}): {INSTALL_HINT}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("build the SideStream before capturing a CUDA graph: its events must be "
                               "created and first recorded outside capture")
        cudart = load_cudart()
        self.device = device
        with torch.cuda.device(device):
            torch.cuda.init()  # the primary context must be current before cuda-python's call
            self.handle = create_nonblocking_stream(cudart)
            self.stream = torch.cuda.ExternalStream(self.handle, device=device)
            self.fork_event = torch.cuda.Event()
            self.join_event = torch.cuda.Event()
            compute = torch.cuda.current_stream(device)
            self.fork(compute)  # the first records happen here, outside any capture
            self.join(compute)
        self._finalizer = weakref.finalize(self, _destroy_quietly, cudart, self.handle)

    def fork(self, compute: torch.cuda.Stream) -> None:
        """Side work queued after this waits for everything queued on `compute` so far."""
        self.fork_event.record(compute)
        self.stream.wait_event(self.fork_event)

    def join(self, compute: torch.cuda.Stream) -> None:
        """Work queued on `compute` after this waits for everything queued on the side stream."""
        self.join_event.record(self.stream)
        compute.wait_event(self.join_event)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Destroy the stream (once; later calls do nothing). Raises RuntimeError on a CUDA error."""
        if self._finalizer.alive:
            self._finalizer.detach()
            _destroy(load_cudart(), self.handle)

    def __repr__(self) -> str:
        return f"SideStream(device={self.device}, handle={self.handle:#x}, closed={self.closed})"


def _destroy_quietly(cudart, handle: int) -> None:
    """Garbage-collection path: at interpreter exit the context may already be gone."""
    with contextlib.suppress(Exception):  # nothing useful can be done at teardown
        _destroy(cudart, handle)
