"""Choosing the draft length (gamma) of a speculative method from measurements.

The best gamma depends on the drafter (how far ahead it stays right) and on the hardware (what one
more draft token and one more verified position cost): on an accelerator a wider verification is
nearly free and long drafts pay; on a small CPU every verified position is real work. So gamma is
measured, not guessed:

1. *acceptance*: decode calibration prompts once with gamma = G (the largest candidate) and take
   a_k = P(draft position k accepted), k = 1..G. Drafts at positions 1..g do not depend on how many
   more follow, so the expected tokens a round commits with any g <= G is E(g) = 1 + a_1 + ... + a_g.
2. *cost*: time one whole round (draft, verify, acceptance, commit as compiled) at every candidate
   gamma, and one plain decoding step, in compiled loops side by side (`speculative.in_graph_seconds`).
3. *choice*: the candidate with the largest predicted speedup E(g) * t_ar / t_round(g).

The calibration prompts should not be the prompts the method is then benchmarked on (the demo and
`m2r2 bench --gamma auto` take separate ones), or the choice would be fitted to the benchmark.

This module is the arithmetic and the parsing; the measuring is `bench/gamma_tuning.py`.
"""

from __future__ import annotations

from typing import Mapping, Sequence, Union

import numpy as np

from m2r2_jax.errors import ConfigError

DEFAULT_CANDIDATES = (1, 2, 3, 4, 6, 8)


def expected_tokens(acceptance: Sequence[float], g: int) -> float:
    """Expected tokens one round commits with draft length g (accepted drafts + the target's own
    token), from per-position acceptance measured with a draft length >= g."""
    if g > len(acceptance):
        raise ValueError(f"gamma {g} is beyond the {len(acceptance)} measured draft positions")
    return 1.0 + float(np.sum(acceptance[:g]))


def choose(acceptance: Sequence[float], t_ar: float, t_round: Mapping[int, float]) -> dict:
    """The candidate with the largest predicted speedup E(g) * t_ar / t_round(g) (ties: the shorter
    draft). Returns {"gamma", "candidates", "expected_tokens", "t_round", "predicted_speedup"}."""
    cands = sorted(t_round)
    exp = [expected_tokens(acceptance, g) for g in cands]
    pred = [e * t_ar / t_round[g] for e, g in zip(exp, cands)]
    best = cands[int(np.argmax(pred))]  # argmax keeps the first (shortest) of equal values
    return {"gamma": best, "candidates": cands, "expected_tokens": exp,
            "t_round": [t_round[g] for g in cands], "predicted_speedup": pred}


def parse_gamma(text: str, methods: Sequence[str]) -> Union[int, str, dict]:
    """A gamma setting from the command line: "4" (every method), "auto" (tune each method), or
    "m2r2_spec=8,distance_spec=2" (per method; methods left out use 4)."""
    text = str(text).strip()
    if text == "auto":
        return "auto"
    if "=" not in text:
        g = _positive_int(text)
        if g is None:
            raise ConfigError(f"--gamma={text!r} is invalid: expected a positive integer, 'auto' or METHOD=N,...")
        return g
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in methods:
            raise ConfigError(f"--gamma={text!r} is invalid: {name!r} is not one of {', '.join(methods)}")
        out[name] = _positive_int(value)
        if out[name] is None:
            raise ConfigError(f"--gamma={text!r} is invalid: {name}'s draft length must be a positive integer")
    return out


def _positive_int(text: str):
    """int(text) when that is a positive integer, else None."""
    try:
        v = int(text)
    except ValueError:
        return None
    return v if v >= 1 else None


def parse_candidates(values: Sequence, what: str = "--gamma_candidates") -> tuple:
    """Sorted distinct positive draft lengths from `values` (ints or their strings)."""
    try:
        cands = tuple(sorted({int(v) for v in values}))
    except ValueError:
        cands = ()
    if not cands or cands[0] < 1:
        raise ConfigError(f"{what}={','.join(map(str, values))} is invalid: expected positive integers")
    return cands


def resolve_gammas(gamma, methods: Sequence[str], tune, default: int = 4) -> tuple:
    """Per-method draft lengths from a `parse_gamma` value. `tune(spec_methods)` is called when
    gamma is "auto" and returns `gamma_tuning.tune_gammas`' records.
    Returns ({method: gamma}, {method: tuning record} (empty unless "auto"))."""
    spec_methods = [m for m in methods if m != "ar"]
    if gamma == "auto":
        records = tune(spec_methods)
        return {m: records[m]["gamma"] for m in spec_methods}, records
    if isinstance(gamma, Mapping):
        return {m: int(gamma.get(m, default)) for m in spec_methods}, {}
    return {m: int(gamma) for m in spec_methods}, {}


def gamma_of(gamma: Union[int, Mapping], method: str, default: int = 4) -> int:
    return int(gamma.get(method, default)) if isinstance(gamma, Mapping) else int(gamma)


def format_choice(method: str, rec: dict, digits: int = 2) -> str:
    """One line: "m2r2_spec: gamma 6 (predicted 1.52x; g=1 1.10x, g=2 ...)"."""
    parts = ", ".join(f"g={g} {p:.{digits}f}x" for g, p in zip(rec["candidates"], rec["predicted_speedup"]))
    best = rec["predicted_speedup"][rec["candidates"].index(rec["gamma"])]
    return f"{method}: gamma {rec['gamma']} (predicted {best:.{digits}f}x; {parts})"
