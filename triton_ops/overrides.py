"""Launch overrides: force a launch rule one way, to compare its variants on a GPU.

Every launch decision has a rule (in ``fused_moe``, ``fused_experts``, ``pdl``, ``shrink_reduce``) that picks
the variant measured to win. An override replaces the rule's answer, for A/B runs (``benchmarks/ab_env.py
--env NAME=VALUE``, every rule at once: ``benchmarks/ab_rules.py``) and for tests that reach a variant the
rule would not pick on their shapes. Overrides live in one process-wide dict, :data:`LAUNCH_OVERRIDES` (name
-> value, both strings; unset = the rule decides); the names and their values are :data:`CHOICES`. Layers
cache their launch plans per token count: set overrides before the first call, or clear
``layer.launch_cache``.

Nothing here reads the environment: the few environment variables the library reads are listed in
docs/architecture.md ("Environment variables").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

__all__ = ["CHOICES", "LAUNCH_OVERRIDES", "applied", "count", "parse", "switch", "value"]

_SWITCH = ("0", "1")
_COUNT = None  # a non-negative integer

# name -> the values it takes (None: a count). What each forces is in the docstring of the rule that
# reads it (grep the name).
CHOICES: dict[str, tuple[str, ...] | None] = {
    "decode_direct": _SWITCH,
    "decode_down_partials": _COUNT,
    "down_prefetch": _SWITCH,
    "even_k": _SWITCH,
    "expand_whole_rows": _SWITCH,
    "fp8_dependent_decode": _SWITCH,
    "fp8_lora_tiles": ("auto", "bf16", "fp8"),
    "fp8_tile_scale": _SWITCH,
    "fused_sum": _SWITCH,
    "lora_by_adapter": _SWITCH,
    "lora_chunk_r": ("16", "32", "64"),
    "lora_defer": _SWITCH,
    "lora_ext": ("0", "1", "gemm1", "gemm2"),
    "lora_ext_slots": _COUNT,
    "lora_ext_stages": _COUNT,
    "lora_prefetch": _SWITCH,
    "lora_reduce_splits": _SWITCH,
    "moe_chunk_tokens": _COUNT,
    "one_row_lora": _SWITCH,
    "one_split_shrink": _SWITCH,
    "one_token_shrink_fit": _SWITCH,
    "prefill_shrink_overlap": _SWITCH,
    "shrink_overlap": _SWITCH,
    "slot_program_shrink": _SWITCH,
    "sparse_align": _SWITCH,
    "swap_ab": _SWITCH,
}

LAUNCH_OVERRIDES: dict[str, str] = {}


def _expected(name: str) -> str:
    choices = CHOICES[name]
    if choices is None:
        return "a non-negative integer"
    return ", ".join(choices[:-1]) + " or " + choices[-1]


def _check(name: str, forced: str) -> str:
    if name not in CHOICES:
        raise ValueError(f"unknown launch override {name!r}; known: {', '.join(sorted(CHOICES))}")
    choices = CHOICES[name]
    if forced and (not forced.isdigit() if choices is None else forced not in choices):
        raise ValueError(f"launch override {name} must be {_expected(name)}, got {forced!r}")
    return forced


def value(name: str) -> str:
    """The forced value of ``name`` ("" when the rule decides); ValueError for a value it does not take."""
    return _check(name, LAUNCH_OVERRIDES.get(name, ""))


def switch(name: str, default: bool) -> bool:
    """An on/off override: "1" on, "0" off, unset ``default`` (the rule's answer)."""
    forced = value(name)
    return default if forced == "" else forced == "1"


def count(name: str) -> int | None:
    """A count override, or None when the rule decides."""
    forced = value(name)
    return int(forced) if forced else None


def parse(assignments: Sequence[str]) -> dict[str, str]:
    """``NAME=VALUE`` strings (a benchmark's command line) as overrides, each checked."""
    parsed = {}
    for item in assignments:
        name, sep, forced = item.partition("=")
        if not sep or not forced:
            raise ValueError(f"a launch override is NAME=VALUE, got {item!r}")
        parsed[name] = _check(name, forced)
    return parsed


@contextlib.contextmanager
def applied(overrides: Mapping[str, str]) -> Iterator[None]:
    """``overrides`` in effect inside the block, the previous ones after it."""
    checked = {name: _check(name, forced) for name, forced in overrides.items()}
    before = dict(LAUNCH_OVERRIDES)
    LAUNCH_OVERRIDES.update(checked)
    try:
        yield
    finally:
        LAUNCH_OVERRIDES.clear()
        LAUNCH_OVERRIDES.update(before)
