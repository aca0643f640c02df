"""Integer helpers for host code on the launch path.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton constexpr functions: every host call goes through
Triton's wrapper that unwraps constexpr arguments, several µs each, and a layer call makes dozens. These
are the same functions in plain Python, for the wrappers and planners (kernels use ``tl.cdiv``).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1; 0 for 0 (as ``triton.next_power_of_2``)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()
