"""Fuzzing the CLI: random argument lists for every verb, built from the verb's real flags with
random values (empty strings, huge, negative, NaN and unparsable numbers, unicode, paths to
garbage files and checkpoints), each with at least one sure problem. Whatever the mix, the run
ends with exit status 2 and one `m2r2: error:` line, never a traceback.

The cases of one verb run in one process (`verb_worker.py`), seeded: M2R2_FUZZ_SEED and
M2R2_FUZZ_CASES (per verb) change the draw; a failure prints the argv to replay it with `m2r2`."""

from __future__ import annotations

import json
import os

import pytest

from cli_helpers import build_fixtures, contract_violations, run_in_workers
from m2r2_jax.cli.main import VERBS

SEED = os.environ.get("M2R2_FUZZ_SEED", "10")
PER_VERB = int(os.environ.get("M2R2_FUZZ_CASES", "3"))
# config-flag verbs register their --config.* overrides once per process (see test_error_contract)
FUZZED = sorted(set(VERBS) - {"pretrain", "distill", "aot-check"})


@pytest.fixture(scope="module")
def fuzz_results(tmp_path_factory):
    fx = build_fixtures(tmp_path_factory.mktemp("fuzz"))
    index = fx["root"] / "fixtures.json"
    index.write_text(json.dumps({k: str(v) for k, v in fx.items()}))
    return run_in_workers({verb: ("fuzz", SEED, PER_VERB, index) for verb in FUZZED})


@pytest.mark.parametrize("verb", FUZZED)
def test_random_arguments_never_give_a_traceback(fuzz_results, verb):
    results = fuzz_results[verb]
    assert len(results) == PER_VERB
    bad = []
    for r in results:
        problems = contract_violations(r["code"], r["stderr"] + (r["traceback"] or ""))
        if problems:
            bad.append(f"m2r2 {verb} {' '.join(map(repr, r['argv']))}: {problems}\n{(r['traceback'] or r['stderr'])[-1500:]}")
    assert not bad, f"seed {SEED}:\n" + "\n\n".join(bad)
