"""Parsing of the rates and durations the bench accepts on its command line.

Rates use ``tc``'s decimal bit units (``100mbit`` is 100,000,000 bit/s) because they are
handed to ``tc`` unchanged in meaning. ``bps`` is refused on purpose: ``tc`` reads it as
*bytes* per second while most people mean bits, and a silent factor of eight would make every
figure wrong.
"""

import re

__all__ = ["RATE_FORM", "format_bytes", "format_rate", "parse_duration", "parse_rate"]

RATE_FORM = "a number and a unit in bits per second, e.g. 50mbit, 100mbit, 1gbit, 2.5gbit"
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


def parse_rate(text: str) -> int:
    """Return the rate in bit/s for ``text`` such as ``"100mbit"`` or ``"1Gbit/s"``.

    Raises:
        ValueError: the text is not a positive number followed by a bit unit.
    """
    match = re.fullmatch(_NUMBER + r"\s*([a-z]+)(?:/s)?", text.strip().lower())
    unit = match.group(2) if match else None
    if not match or unit not in _RATE_UNITS:
        hint = (
            " ('bps' is ambiguous: tc reads it as bytes/s; write bits, e.g. 100mbit for "
            "100 Mbit/s, or 800mbit for 100 MByte/s)"
            if unit and "bps" in unit
            else ""
        )
        raise ValueError(f"bad rate {text!r}: use {RATE_FORM}{hint}.")
    bits = float(match.group(1)) * _RATE_UNITS[unit]
    if bits < 10**5:
        raise ValueError(f"rate {text!r} is below 100kbit, too slow to benchmark; use {RATE_FORM}.")
    return round(bits)


def parse_duration(text: str) -> float:
    """Return seconds for ``text`` such as ``"5ms"``, ``"250us"`` or ``"0.1s"``.

    Raises:
        ValueError: the text is not a non-negative number followed by us, ms or s.
    """
    match = re.fullmatch(_NUMBER + r"\s*(us|ms|s)", text.strip().lower())
    if not match:
        raise ValueError(f"bad duration {text!r}: use a number and a unit, e.g. 5ms, 250us, 0.1s.")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def format_rate(bits_per_s: float | None) -> str:
    """``100000000`` -> ``"100mbit"``; ``None`` (no limit) -> ``"loopback"``."""
    if bits_per_s is None:
        return "loopback"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scale = _RATE_UNITS[unit]
        shown = float(f"{bits_per_s / scale:.3g}")  # 999.6 mbit shows as 1000: said as 1gbit
        if shown >= 1:
            return f"{shown:g}{unit}"
    return f"{bits_per_s:.3g}bit"


def format_bytes(n: float | None) -> str:
    """Human-readable byte count with binary prefixes."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
