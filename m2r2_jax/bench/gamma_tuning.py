"""Measuring each speculative method's best draft length (the procedure: `bench/gamma.py`).

    records = tune_gammas(("m2r2_spec", "distance_spec"), cfg, params, calibration_prompts, ...)
"""

from __future__ import annotations

from typing import Sequence

from m2r2_jax.bench import speculative as S
from m2r2_jax.bench.gamma import DEFAULT_CANDIDATES, choose, parse_candidates
from m2r2_jax.decoding import api
from m2r2_jax.errors import ConfigError


def tune_gammas(methods: Sequence[str], cfg, base_params, prompts: Sequence[Sequence[int]], *,
                max_new_tokens: int, candidates: Sequence[int] = DEFAULT_CANDIDATES, temperature: float = 0.0,
                top_p: float = 1.0, m2r2=None, draft=None, plan=None, repeats: int = 5, bar: str = "",
                layer_loop: str = "auto",
                draft_vocab=None) -> dict:
    """Choose the draft length of every speculative method in `methods` (see the module
    docstring): acceptance at the largest candidate on `prompts`, then one round of every
    (method, candidate) and one plain step timed side by side in one `in_graph_seconds` call, so
    every prediction divides by the same measured ar step. Fixed draft length, batch 1. With
    `bar`, progress bars of that name; `draft_vocab` as in `speculative.compare_methods`.
    Returns {method: `choose`'s record + "acceptance_by_position", "t_ar_step", ...}."""
    from tqdm.auto import tqdm

    cands = parse_candidates(candidates, "gamma candidates")
    if not prompts:
        raise ConfigError("gamma tuning needs at least one calibration prompt")
    width = max(len(p) for p in prompts)

    def build(m, g=1):
        return api.build_engine(m, cfg, base_params, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, gamma=g, m2r2=m2r2, draft=draft, plan=plan, layer_loop=layer_loop,
                                **S.vocab_option(m, draft_vocab))

    components = {("ar", 0): S.round_component(build("ar"), prompts[0], width)}
    acceptance = {}
    for m in tqdm(methods, desc=f"{bar}: acceptance", disable=not bar, leave=False):
        engines = {g: build(m, g) for g in cands}
        results = api.run_engine(engines[cands[-1]], prompts, batch_size=1, width=width, fixed_batch=True)
        acceptance[m] = S.acceptance_by_position(results, cands[-1])
        components.update({(m, g): S.round_component(e, prompts[0], width) for g, e in engines.items()})
    timed = S.in_graph_seconds(components, repeats, bar=f"{bar}: round costs" if bar else "")
    t_ar = timed[("ar", 0)]["seconds"]
    return {m: {**choose(acceptance[m], t_ar, {g: timed[(m, g)]["seconds"] for g in cands}),
                "acceptance_by_position": acceptance[m], "t_ar_step": t_ar, "calibration_prompts": len(prompts),
                "temperature": float(temperature)}
            for m in methods}
