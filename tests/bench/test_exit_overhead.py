"""`python -m m2r2_jax.bench.exit_overhead` (docs/RESULTS.md's early-exit table) on a tiny model:
every exit method on both layer loops, side by side with ar, where no token exits."""

import json

import jax
import pytest

from conftest import tiny_config
from m2r2_jax.data.corpus import embedded_split
from m2r2_jax.data.tokenizer import train_sentencepiece
from m2r2_jax.m2r2.checkpoint import save_m2r2
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.m2r2.fast_stream import init_m2r2_params
from m2r2_jax.models import checkpoint as MC
from m2r2_jax.models import transformer as T


def test_exit_overhead_report(tmp_path):
    from m2r2_jax.bench import exit_overhead

    tok = train_sentencepiece(embedded_split("train")[:60000], 400, tmp_path / "tok" / "tokenizer.model")
    cfg = tiny_config("llama", vocab_size=400, n_layers=4, max_seq_len=512)
    params = T.init_params(cfg, jax.random.key(0))
    base = MC.save_model(tmp_path / "base", cfg, params, tokenizer_file=str(tok.path))
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8).validate(cfg)
    m2r2 = save_m2r2(tmp_path / "m2r2", mcfg, init_m2r2_params(cfg, mcfg, jax.random.key(1)), cfg,
                     MC.params_fingerprint(cfg, params))
    out = tmp_path / "r" / "exit.json"  # its directory is made before the measurement
    report = exit_overhead.main(["--checkpoint", str(base), "--m2r2", str(m2r2), "--n_prompts", "1",
                                 "--max_new_tokens", "3", "--repeats", "1", "--loops", "unrolled", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    names = {f"{m}/unrolled" for m in ("m2r2_exit", "m2r2_exit_state_router", "distance_exit_confidence",
                                       "distance_exit_saturation")}
    assert set(report["methods"]) == names | {"ar"}
    for name, rec in report["methods"].items():
        assert rec["same_tokens_as_ar"] and rec["tokens_per_s"] > 0 and rec["early_exits"] == [0], name
        # nothing exits: every slow layer runs, and m2r2_exit runs its fast steps on top
        if name.startswith("m2r2"):
            assert rec["layers_per_token"] > cfg.n_layers, name
        else:
            assert rec["layers_per_token"] == pytest.approx(cfg.n_layers), name
    for bad in (["--checkpoint", str(tmp_path / "nope"), "--m2r2", str(m2r2)],
                ["--checkpoint", str(base), "--m2r2", str(m2r2), "--loops", "spiral"],
                ["--checkpoint", str(base), "--m2r2", str(m2r2), "--out", str(tmp_path)]):
        with pytest.raises(SystemExit):
            exit_overhead.main(bad)
