"""Units, byte sizes and the parsing of human sizes ("7B", "80GB", "24GiB").

Every constant here is a definition, not a tuning knob: tuning knobs with sources
live next to the formula that uses them.
"""

from __future__ import annotations

import re

from zeroshard.policies import ConfigError, Precision

__all__ = [
    "GB", "GIB", "BYTES_PER_ELEMENT", "INT8_BYTES", "INT4_BYTES", "FP32_BYTES",
    "bytes_of", "human_bytes", "parse_count", "parse_bytes",
]

GB = 10**9  # the ZeRO paper's and DeepSpeed docs' "GB" in prose is decimal
GIB = 2**30  # GPUs are sized in GiB ("80GB" A100 = 81920 MiB); tables print GiB

FP32_BYTES = 4
INT8_BYTES = 1
INT4_BYTES = 0.5
BYTES_PER_ELEMENT: dict[Precision, int] = {Precision.FP32: 4, Precision.BF16: 2, Precision.FP16: 2}


def bytes_of(precision: Precision | str) -> int:
    return BYTES_PER_ELEMENT[Precision(precision)]


_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_SUFFIX = {
    "": 1, "B": 1,
    "K": 10**3, "KB": 10**3, "KIB": 2**10,
    "M": 10**6, "MB": 10**6, "MIB": 2**20,
    "G": 10**9, "GB": 10**9, "GIB": 2**30,
    "T": 10**12, "TB": 10**12, "TIB": 2**40,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def human_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit that keeps the number at 1 or more ("512 B",
    "6.37 MiB", "10.8 GiB"), three significant digits: a 6K-parameter model's states do not
    print as 0.0 MB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _split(text: str, what: str) -> tuple[float, str]:
    text = str(text).strip()
    if text.startswith("-"):
        raise ConfigError(f"{what} must not be negative, got {text!r}")
    m = _NUMBER.match(text)
    if not m:
        raise ConfigError(f"cannot read {what} {text!r}: expected a number with an optional suffix")
    return float(m.group(1)), m.group(2).upper()


def parse_count(text: str | int | float, what: str = "parameter count") -> int:
    """'7B' -> 7_000_000_000; suffixes K, M, B (or G), T are powers of 1000."""
    if isinstance(text, (int, float)):
        if text < 0:
            raise ConfigError(f"{what} must not be negative, got {text}")
        return int(text)
    value, suffix = _split(text, what)
    if suffix not in _COUNT_SUFFIX:
        raise ConfigError(f"unknown suffix {suffix!r} in {what} {text!r}; use K, M, B or T")
    n = int(round(value * _COUNT_SUFFIX[suffix]))
    if n <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return n


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """'80GB' -> 80e9, '80GiB' -> 80*2**30; a bare number is in GiB (as GPUs are sold)."""
    if isinstance(text, (int, float)):
        if text < 0:
            raise ConfigError(f"{what} must not be negative, got {text}")
        return int(text)
    value, suffix = _split(text, what)
    if suffix == "":
        return int(round(value * GIB))
    if suffix not in _BYTE_SUFFIX:
        raise ConfigError(f"unknown unit {suffix!r} in {what} {text!r}; use GB, GiB, TB, TiB, ...")
    return int(round(value * _BYTE_SUFFIX[suffix]))
