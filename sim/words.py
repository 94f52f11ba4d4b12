"""Counted nouns for the simulator's messages: a count and its noun in the number it takes.

    counted(1, "layer") -> "1 layer";  counted(30, "layer") -> "30 layers";
    counted(2, "access", "accesses") -> "2 accesses"
"""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, singular for exactly 1 and `plural` (default noun + "s") otherwise."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
