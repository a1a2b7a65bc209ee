"""Amounts written for people: as many digits as the amount needs, never a cost shown as zero.

Contract (pure): `usd(x)` writes dollars with two decimals from one dollar up and three significant
digits below, at least two decimals (0.4 -> "0.40", 0.00001624 -> "0.0000162", 0 -> "0"), never in scientific notation:
a cheap plan's cost per iteration read `0.0000 USD/it` with four fixed decimals. `sig(x)` writes any
other amount with three significant digits the same way. `clip(text, n)` shortens text to at most
`n` characters at a word boundary, ending in "...", instead of cutting a word in two.
"""

from __future__ import annotations

import math


def sig(x: float, digits: int = 3) -> str:
    """`x` with `digits` significant digits in plain notation (no exponent)."""
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def usd(x: float) -> str:
    """Dollars as precise as they need to be (see the module's contract)."""
    if abs(x) >= 1 or x == 0:
        return f"{x:,.2f}" if x else "0"
    text = sig(x)
    whole, _, decimals = text.partition(".")
    return f"{whole}.{decimals.rstrip('0').ljust(2, '0')}"


def clip(text: str, n: int) -> str:
    """`text` in at most `n` characters, cut at a space with "..." when it is longer."""
    text = " ".join(text.split())
    if len(text) <= n:
        return text
    cut = text[: max(0, n - 3)]
    space = cut.rfind(" ")
    return (cut[:space] if space > n // 2 else cut).rstrip(" ,;:") + "..."
