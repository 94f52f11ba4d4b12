"""The simulator's exception for a malformed trace, below every module that reads or checks one.

    sim.archive (reads the arrays of a file) ─┐
    sim.trace (checks the format and meta)   ─┼─ raise TraceError: message names the field (or file) and the fix
    sim.importers, sim.jsonl, sim.replay     ─┘
TraceWarning: a trace that loads, but not whole (sim.jsonl drops tokens missing from a layer).
"""

from __future__ import annotations


class TraceError(ValueError):
    """A malformed trace file or Trace; the message names the field (or file) and the fix."""


class TraceWarning(UserWarning):
    """A trace that loads but not whole (tokens an importer dropped); the message names what and why."""
