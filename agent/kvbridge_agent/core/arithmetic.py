"""Checked integer arithmetic: division that never truncates silently."""

from __future__ import annotations

from .errors import SpecError


def exact_div(numerator: int, denominator: int, *, what: str, field: str = "") -> int:
    """``numerator / denominator`` when it is exact, else a typed ``NOT_DIVISIBLE`` error."""
    if denominator <= 0:
        raise SpecError(f"{what}: divisor must be positive, got {denominator}", field=field, code="NOT_DIVISIBLE")
    quotient, remainder = divmod(numerator, denominator)
    if remainder:
        raise SpecError(f"{what}: {numerator} is not a multiple of {denominator}", field=field, code="NOT_DIVISIBLE")
    return quotient


def ceil_div(numerator: int, denominator: int) -> int:
    """Smallest integer ``q`` with ``q * denominator >= numerator`` (non-negative inputs)."""
    if denominator <= 0:
        raise SpecError(f"ceil_div: divisor must be positive, got {denominator}", code="NOT_DIVISIBLE")
    return -(-numerator // denominator)


def divides_either_way(a: int, b: int) -> bool:
    """True when one of two positive integers divides the other."""
    return a % b == 0 or b % a == 0
