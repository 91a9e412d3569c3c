"""`python -m m2r2_jax.bench.exit_overhead` (docs/RESULTS.md's early-exit table) on a tiny model:
every exit method on both layer loops, side by side with ar, where no token exits; and
`python -m m2r2_jax.bench.exit_sweep`, quality against speed over thresholds."""

import dataclasses
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
    fp = MC.params_fingerprint(cfg, params)
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8).validate(cfg)
    m2r2 = save_m2r2(tmp_path / "m2r2", mcfg, init_m2r2_params(cfg, mcfg, jax.random.key(1)), cfg, fp)
    out = tmp_path / "r" / "exit.json"  # its directory is made before the measurement
    short = ["--n_prompts", "1", "--max_new_tokens", "3", "--repeats", "1", "--loops", "unrolled"]
    report = exit_overhead.main(["--checkpoint", str(base), "--m2r2", str(m2r2), *short, "--out", str(out)])
    assert json.loads(out.read_text()) == report
    names = {f"{m}/unrolled" for m in ("m2r2_exit", "m2r2_exit_state_router", "distance_exit_confidence",
                                       "distance_exit_saturation")}
    assert set(report["methods"]) == names | {"ar"}
    k = mcfg.steps(cfg)
    for name, rec in report["methods"].items():
        assert rec["same_tokens_as_ar"] and rec["tokens_per_s"] > 0 and rec["early_exits"] == [0], name
        # nothing exits: every slow layer runs, and m2r2_exit runs its fast steps on top
        if name.startswith("m2r2"):
            assert rec["layers_per_token"] > cfg.n_layers, name
        else:
            assert rec["layers_per_token"] == pytest.approx(cfg.n_layers), name
    # a checkpoint whose state router can give up: no untrained variant, and at tau 1.0 a token
    # stops after its first fast step (1 of K steps' cost on top of the slow layers)
    give_up = dataclasses.replace(mcfg, router_features="state", router_give_up=True)
    m2r2_g = save_m2r2(tmp_path / "m2r2_g", give_up, init_m2r2_params(cfg, give_up, jax.random.key(1)), cfg, fp)
    rep_g = exit_overhead.main(["--checkpoint", str(base), "--m2r2", str(m2r2_g), *short])
    assert rep_g["m2r2"] == {"router_features": "state", "router_give_up": True}
    assert "m2r2_exit_state_router/unrolled" not in rep_g["methods"]
    full = report["methods"]["m2r2_exit/unrolled"]["layers_per_token"] - cfg.n_layers
    got = rep_g["methods"]["m2r2_exit/unrolled"]
    assert got["same_tokens_as_ar"] and got["layers_per_token"] - cfg.n_layers == pytest.approx(full / k)
    for bad in (["--checkpoint", str(tmp_path / "nope"), "--m2r2", str(m2r2)],
                ["--checkpoint", str(base), "--m2r2", str(m2r2), "--loops", "spiral"],
                ["--checkpoint", str(base), "--m2r2", str(m2r2), "--out", str(tmp_path)]):
        with pytest.raises(SystemExit):
            exit_overhead.main(bad)


def test_exit_sweep_report(tmp_path):
    from m2r2_jax.bench import exit_sweep

    tok = train_sentencepiece(embedded_split("train")[:60000], 400, tmp_path / "tok" / "tokenizer.model")
    cfg = tiny_config("llama", vocab_size=400, n_layers=4, max_seq_len=512)
    params = T.init_params(cfg, jax.random.key(0))
    base = MC.save_model(tmp_path / "base", cfg, params, tokenizer_file=str(tok.path))
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8, router_features="state",
                      router_give_up=True).validate(cfg)
    m2r2 = save_m2r2(tmp_path / "m2r2", mcfg, init_m2r2_params(cfg, mcfg, jax.random.key(1)), cfg,
                     MC.params_fingerprint(cfg, params))
    out = tmp_path / "sweep.json"
    report = exit_sweep.main(["--checkpoint", str(base), "--m2r2", str(m2r2), "--taus", "0.0,1.0",
                              "--methods", "m2r2_exit,m2r2_exit_confirm,distance_exit", "--kv_missing", "deferred",
                              "--n_prompts", "1", "--max_new_tokens", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == report and report["kv_missing"] == "deferred"
    assert report["m2r2"] == {"router_features": "state", "router_give_up": True}
    assert set(report["methods"]) == {"m2r2_exit", "m2r2_exit_confirm", "distance_exit"}
    for name, rows in report["methods"].items():
        assert [r["threshold"] for r in rows] == [0.0, 1.0], name
        low, high = rows
        assert high["rouge_l"] == 1.0 and high["early_exit_fraction"] == 0.0, name  # nothing leaves at 1.0
        assert low["early_exit_fraction"] == 1.0 and low["speedup"] > 0, name  # everything leaves at 0.0
    for bad in (["--taus", "0.5,2"], ["--taus", "x"], ["--methods", "m2r2_exit,nope"], ["--kv_missing", "copy"]):
        with pytest.raises(SystemExit):
            exit_sweep.main(["--checkpoint", str(base), "--m2r2", str(m2r2), *bad])
