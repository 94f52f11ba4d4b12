"""Counted nouns for messages and reports: a count, digits grouped, and its noun in the number it takes.

    counted(1, "layer") -> "1 layer";  counted(30, "layer") -> "30 layers";
    counted(23040, "access", "accesses") -> "23,040 accesses"
"""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, singular for exactly 1 and `plural` (default noun + "s") otherwise."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
