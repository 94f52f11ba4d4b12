"""The traces `expertcache sim` replays: files a user names, or the embedded default.

    PATH.npz                          --sim.trace.load_trace-->            Trace
    PATH.jsonl | FreeToken directory  --sim.jsonl / sim.importers (model from
                                        the name when the meta has none)--> Trace
    no path                           --sim/data/gemma4-decode.npz-->     Trace (DEFAULT_TRACE)

The embedded default is a real decode trace of gemma-4-26B-A4B (Apache-2.0; attribution in
sim/data/README.md and in its meta), so the policy the simulator recommends out of the box is one real
routing supports. It touches about half of its keys, hence its own slot fractions (DEFAULT_TRACE_FRACS).
Errors are TraceError naming the path (and field) and the fix.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from sim.errors import TraceError
from sim.importers import import_freetoken_dir
from sim.jsonl import import_jsonl
from sim.trace import Trace, load_trace

DEFAULT_TRACE = "gemma4-decode.npz"  # in sim/data
DEFAULT_TRACE_LABEL = f"{DEFAULT_TRACE} (embedded default, sim/data)"
DEFAULT_TRACE_FRACS = "0.1,0.2,0.3"  # of its L*E keys: 384, 768 and 1152 slots


def default_trace() -> Trace:
    """The embedded default trace, read from the installed package's sim/data."""
    with resources.as_file(resources.files("sim") / "data" / DEFAULT_TRACE) as path:
        if not path.is_file():
            raise TraceError(f"{path}: the embedded default trace is missing from this install: "
                             f"reinstall expertcache, or name a trace file")
        return load_trace(path)


def load_any(path: str) -> Trace:
    """A trace from an .npz file, a .jsonl file or a FreeToken-style directory.

    Raises TraceError naming the path (and field) and the fix.
    """
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file or directory: check the path (a trace is an .npz "
                         f"file, a .jsonl file or a FreeToken-style directory)")
    if p.is_dir():  # the model name defaults to the folder's or file's when the meta has none
        return import_freetoken_dir(p, default_model=p.resolve().name)
    if p.suffix.lower() == ".jsonl":
        return import_jsonl(p, default_model=p.stem)
    try:
        return load_trace(p)
    except TraceError as exc:
        if p.suffix.lower() == ".npz":
            raise
        raise TraceError(f"{exc}; a JSON-lines trace must be named *.jsonl") from None
