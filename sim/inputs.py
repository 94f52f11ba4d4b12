"""The traces `expertcache sim` replays: files a user names, the embedded default, or a preset's.

    PATH.npz                          --sim.trace.load_trace-->            Trace
    PATH.jsonl | FreeToken directory  --sim.jsonl / sim.importers (model from
                                        the name when the meta has none)--> Trace
    no path                           --sim/data/gemma4-decode.npz-->     Trace (DEFAULT_TRACE)
    --preset NAME [--tokens N] [--seed S]  --synthetic_config-->  SyntheticConfig (sim.synthetic.generate)

The embedded default is a real decode trace of gemma-4-26B-A4B (Apache-2.0; attribution in
sim/data/README.md and in its meta), so the policy the simulator recommends out of the box is one real
routing supports. It touches about half of its keys, hence its own slot fractions (DEFAULT_TRACE_FRACS).
Errors are TraceError naming the path (and field) and the fix, ValueError naming the preset's flag.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from sim.errors import TraceError
from sim.importers import import_freetoken_dir
from sim.jsonl import import_jsonl
from sim.synthetic import PRESETS, SyntheticConfig, preset
from sim.trace import Trace, load_trace

DEFAULT_TRACE = "gemma4-decode.npz"  # in sim/data
DEFAULT_TRACE_LABEL = f"{DEFAULT_TRACE} (embedded default, sim/data)"
DEFAULT_TRACE_FRACS = "0.1,0.2,0.3"  # of its L*E keys: 384, 768 and 1152 slots
# --tokens bound: routed entries N x L x B x k of a synthetic trace. Generating one holds about
# 36 bytes an entry (ids, float64 logits and their softmax, weights), so ~1.2 GB at the bound;
# the qwen3-next preset (480 entries a token) reaches it at ~70,000 tokens, 35x its default.
MAX_SYNTH_ENTRIES = 2**25


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


def synthetic_config(name: str, tokens: int | None, seed: int | None) -> SyntheticConfig:
    """The config of `--preset name` at --tokens / --seed (None: the preset's length, seed 0).

    Raises ValueError naming --preset for an unknown name and --tokens for a trace over MAX_SYNTH_ENTRIES.
    """
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} is unknown: choose from {', '.join(sorted(PRESETS))}")
    overrides: dict = {"seed": seed or 0}
    if tokens is not None:
        overrides["num_tokens"] = tokens
    cfg = preset(name, **overrides)
    per_token = cfg.num_layers * cfg.batch * (cfg.logit_width if cfg.with_logits else cfg.top_k)
    if cfg.num_tokens * per_token > MAX_SYNTH_ENTRIES:
        raise ValueError(f"--tokens {cfg.num_tokens}: the {name} trace would hold {cfg.num_tokens} x "
                         f"{per_token} = {cfg.num_tokens * per_token} routed entries, over the limit of "
                         f"{MAX_SYNTH_ENTRIES} (about 1.2 GB to generate): give --tokens <= "
                         f"{MAX_SYNTH_ENTRIES // per_token}")
    return cfg
