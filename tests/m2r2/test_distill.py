"""Distillation end to end on a tiny base: frozen base, M2R2 checkpoints tied to their base,
resume, alignment analysis and the CLI's one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_config

from m2r2_jax.data.corpus import embedded_split
from m2r2_jax.data.tokenizer import train_sentencepiece
from m2r2_jax.errors import CheckpointError, ConfigError
from m2r2_jax.m2r2 import analysis
from m2r2_jax.m2r2.checkpoint import load_m2r2, save_m2r2
from m2r2_jax.m2r2.distill import distill, distill_config, heldout_batches
from m2r2_jax.models import checkpoint as MC
from m2r2_jax.models import transformer as T


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    tok = train_sentencepiece(embedded_split("train")[:60000], 400, root / "tok" / "tokenizer.model")
    cfg = tiny_config("llama", vocab_size=400, n_layers=6, max_seq_len=64)
    params = T.init_params(cfg, jax.random.key(0))
    MC.save_model(root / "base", cfg, params, tokenizer_file=str(tok.path))
    return root, cfg, params, tok


def _cfg(base_dir, **train):
    cfg = distill_config()
    cfg.base_checkpoint = str(base_dir)
    cfg.m2r2.update(dict(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8))
    for sec, steps in (("train", 4), ("router_train", 2)):
        cfg[sec].update(dict(steps=steps, batch_size=2, warmup_steps=1, checkpoint_every=2, progress=False,
                             async_checkpointing=False, data_parallel=False))
    cfg.data.update(dict(source="embedded", seq_len=16, max_documents=0))
    cfg.train.update(train)
    return cfg


def test_distill_keeps_base_and_writes_tied_checkpoint(tiny_base):
    root, cfg, params, _ = tiny_base
    summary = distill(_cfg(root / "base"), root / "run")
    assert summary["stream"]["step"] == 4 and summary["router"]["step"] == 2
    assert summary["base_fingerprint"] == summary["base_fingerprint_after"]
    # the base on disk and in memory are bit-identical to what was saved
    _, reloaded = MC.load_model(root / "base")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reloaded)))
    fp = MC.params_fingerprint(cfg, params)
    mcfg, mp = load_m2r2(root / "run" / "m2r2", cfg, fp)
    assert mcfg.branch_layer == 1 and set(mp) >= {"adapters", "rates", "router"}
    # training moved the adapters away from their zero init
    assert max(float(np.abs(a["B"]).max()) for a in mp["adapters"].values()) > 0
    # rerunning resumes from the finished stage checkpoints: nothing retrains, same result
    again = distill(_cfg(root / "base"), root / "run")
    assert again["stream"]["step"] == 4 and "first_loss" not in again["stream"]
    _, mp2 = load_m2r2(root / "run" / "m2r2", cfg, fp)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(mp), jax.tree.leaves(mp2)))


def test_fields_added_to_the_model_config_keep_older_checkpoints_valid(tiny_base, tmp_path):
    """A checkpoint written when ModelConfig had only its first fields (the shipped SmolLM2
    parameters, say) still loads: such fields are hashed and compared only where they differ from
    their defaults."""
    from m2r2_jax.m2r2 import checkpoint as M2C
    from m2r2_jax.m2r2.config import M2R2Config
    from m2r2_jax.m2r2.fast_stream import init_m2r2_params

    root, cfg, params, _ = tiny_base
    first_fields = {k: v for k, v in cfg.to_dict().items() if k in MC.FINGERPRINT_FIELDS}
    assert MC.fingerprint_config_json(cfg) == json.dumps(first_fields, indent=2, sort_keys=True)
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8)
    fp = MC.params_fingerprint(cfg, params)
    save_m2r2(tmp_path / "m", mcfg, init_m2r2_params(cfg, mcfg, jax.random.key(0)), cfg, fp)
    base_file = tmp_path / "m" / M2C.BASE_FILE
    meta = json.loads(base_file.read_text())
    base_file.write_text(json.dumps({**meta, "config": first_fields}))  # as an older version wrote it
    assert load_m2r2(tmp_path / "m", cfg, fp)[0] == mcfg
    base_file.write_text(json.dumps({**meta, "config": {**first_fields, "n_layers": 99}}))
    with pytest.raises(CheckpointError, match="different base architecture"):
        load_m2r2(tmp_path / "m", cfg, fp)


def test_m2r2_checkpoint_refuses_another_base(tiny_base, tmp_path):
    root, cfg, params, _ = tiny_base
    from m2r2_jax.m2r2.config import M2R2Config
    from m2r2_jax.m2r2.fast_stream import init_m2r2_params

    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8)
    mp = init_m2r2_params(cfg, mcfg, jax.random.key(0))
    fp = MC.params_fingerprint(cfg, params)
    save_m2r2(tmp_path / "m", mcfg, mp, cfg, fp)
    other_weights = T.init_params(cfg, jax.random.key(1))
    with pytest.raises(CheckpointError, match="belongs to another base"):
        load_m2r2(tmp_path / "m", cfg, MC.params_fingerprint(cfg, other_weights))
    with pytest.raises(CheckpointError, match="different base architecture"):
        load_m2r2(tmp_path / "m", cfg.replace(n_layers=8), fp)
    with pytest.raises(CheckpointError, match="not an M2R2 checkpoint"):
        load_m2r2(tmp_path, cfg, fp)


def test_distill_config_errors(tiny_base, tmp_path):
    root, *_ = tiny_base
    bad = _cfg(root / "base")
    bad.m2r2.branch_layer = 6
    with pytest.raises(ConfigError, match="m2r2.branch_layer=6"):
        distill(bad, tmp_path / "a")
    with pytest.raises(CheckpointError, match="does not exist"):
        distill(_cfg(tmp_path / "nope"), tmp_path / "b")
    bad = _cfg(root / "base")
    bad.data.seq_len = 128
    with pytest.raises(ConfigError, match="max_seq_len"):
        distill(bad, tmp_path / "c")
    bad = _cfg(root / "base")
    bad.loss.lambda_routing = 1.0  # the tiny base is dense: no routing to distil
    with pytest.raises(ConfigError, match="lambda_routing=1.0 is invalid: the base is a dense"):
        distill(bad, tmp_path / "d")


def test_alignment_record_and_plot(tiny_base, tmp_path):
    root, cfg, params, tok = tiny_base
    from m2r2_jax.m2r2.config import M2R2Config
    from m2r2_jax.m2r2.fast_stream import init_m2r2_params

    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8)
    mp = init_m2r2_params(cfg, mcfg, jax.random.key(0))
    batches = heldout_batches(tok, 16, 2, 2, embedded_split("heldout"))
    rec = analysis.alignment(cfg, mcfg, params, mp, batches)
    assert len(rec["slow_agreement"]) == 6 and len(rec["fast_agreement"]) == mcfg.steps(cfg)
    assert rec["slow_agreement"][-1] == 1.0 and abs(rec["slow_cosine"][-1] - 1.0) < 1e-4
    assert rec["fast_cost"] == sorted(rec["fast_cost"]) and rec["fast_cost"][0] > 1
    assert rec["tokens"] == 2 * 2 * 16
    analysis.plot_alignment(rec, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 10_000
    # interpolation of the slow curve at equal compute
    assert analysis.slow_agreement_at(rec, 6.0) == 1.0
    assert analysis.slow_agreement_at(rec, 0.0) == 0.0


def _m2r2(*args):
    exe = str(Path(sys.executable).with_name("m2r2"))
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def test_cli_align_and_errors(tiny_base, tmp_path):
    root, *_ = tiny_base
    r = _m2r2("align", f"--checkpoint={root / 'base'}", f"--out={tmp_path / 'al'}", "--seq_len=16",
              "--batch_size=2", "--max_batches=1")
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "al" / "alignment.json").read_text())
    assert rec["fresh_m2r2_params"] is True and (tmp_path / "al" / "alignment.png").is_file()
    r = _m2r2("distill", "--config=configs/m2r2/tiny_dense.py", f"--workdir={tmp_path / 'd'}",
              f"--config.base_checkpoint={root / 'base'}")
    assert r.returncode == 2 and "max_seq_len" in r.stderr  # the config's seq_len 128 > the base's 64
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _m2r2("align", f"--checkpoint={tmp_path / 'missing'}", f"--out={tmp_path / 'x'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "missing" in r.stderr


def test_teacher_cache_trains_like_the_uncached_run(tiny_base, tmp_path):
    """teacher_cache=True runs the base once over the packed data set; the steps see the same
    batches and the same loss as without the cache."""
    root, cfg, params, _ = tiny_base
    runs = {}
    for cached in (False, True):
        c = _cfg(root / "base")
        text = tmp_path / "small.txt"  # a small, finite data set: a few dozen examples
        text.write_text(embedded_split("train")[:3000])
        c.data.update(dict(source="text", paths=(str(text),)))
        c.teacher_cache = cached
        c.loss.kl_fraction = 0.5
        runs[cached] = distill(c, tmp_path / f"run_{cached}")
    assert runs[True]["teacher_cache"]["examples"] > 2 and "teacher_cache" not in runs[False]
    for stage in ("stream", "router"):
        assert runs[True][stage]["first_loss"] == pytest.approx(runs[False][stage]["first_loss"], rel=1e-5)
        assert runs[True][stage]["last_loss"] == pytest.approx(runs[False][stage]["last_loss"], rel=1e-4)
    bad = _cfg(root / "base")
    with bad.ignore_type():
        bad.teacher_cache = "yes"
    with pytest.raises(ConfigError, match="teacher_cache"):
        distill(bad, tmp_path / "bad")


def test_draft_vocab_distillation(tiny_base, tmp_path, monkeypatch):
    """config draft_vocab: the stream stage's loss gets that subset as its head (the loss itself is
    pinned in test_fast_stream.py), the router stage the full vocabulary, and the summary names the
    file; a missing file, or the joint schedule, is refused before training."""
    from m2r2_jax.decoding import draft_vocab as DV
    from m2r2_jax.m2r2 import losses as L

    root, cfg, *_ = tiny_base
    ids = np.arange(0, cfg.vocab_size, 3)
    path = tmp_path / "dv.json"
    DV.save(path, ids, cfg.vocab_size, "test", np.ones(cfg.vocab_size, np.int64))
    seen = {}
    real = L.distill_loss

    def spy(*args, deciders=True, vocab=None, **kw):
        seen[deciders] = None if vocab is None else (vocab["ids"].shape, vocab["kernel"].shape)  # traced
        return real(*args, deciders=deciders, vocab=vocab, **kw)

    monkeypatch.setattr(L, "distill_loss", spy)
    c = _cfg(root / "base")
    c.draft_vocab = str(path)
    sub = distill(c, tmp_path / "sub")
    assert seen[False] == ((ids.size,), (cfg.d_model, ids.size))  # the stream stage: the subset
    assert seen[True] is None  # the router stage: the full vocabulary
    assert sub["draft_vocab"] == {"file": str(path), "size": ids.size}
    assert np.isfinite(sub["stream"]["last_loss"]) and "router_acc" in sub["router"]
    bad = _cfg(root / "base")
    bad.draft_vocab = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="missing.json does not exist"):
        distill(bad, tmp_path / "bad1")
    bad.draft_vocab = str(path)
    bad.schedule = "joint"
    with pytest.raises(ConfigError, match="draft_vocab is for schedule='two_stage'"):
        distill(bad, tmp_path / "bad2")


def test_router_stage_on_a_trained_stream_with_a_router_that_gives_up(tiny_base, tmp_path):
    """schedule="router" + init_m2r2: the stream of an existing checkpoint stays bit-identical and
    a router of another shape (state features, a give-up output) is trained on it; a checkpoint with
    another stream, or the schedule without a checkpoint, is refused in one line."""
    from m2r2_jax.m2r2.config import M2R2Config
    from m2r2_jax.m2r2.fast_stream import init_m2r2_params

    root, cfg, params, _ = tiny_base
    fp = MC.params_fingerprint(cfg, params)
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4, router_dim=8, router_hidden=8)
    trained = init_m2r2_params(cfg, mcfg, jax.random.key(3))
    trained["adapters"] = jax.tree.map(lambda a: a + 0.01, trained["adapters"])  # not a fresh init
    save_m2r2(tmp_path / "logits_router", mcfg, trained, cfg, fp)
    c = _cfg(root / "base")
    c.schedule = "router"
    c.init_m2r2 = str(tmp_path / "logits_router")
    c.m2r2.update(dict(router_features="state", router_give_up=True))
    summary = distill(c, tmp_path / "run")
    assert "stream" not in summary and summary["router"]["step"] == 2 and "later_acc" in summary["router"]
    got_cfg, got = load_m2r2(tmp_path / "run" / "m2r2", cfg, fp)
    assert (got_cfg.router_features, got_cfg.router_give_up) == ("state", True)
    for key in ("adapters", "rates", "exit_norm"):
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trained[key]), jax.tree.leaves(got[key])))
    assert "later_out" in got["router"] and got["router"]["mlp_in"]["kernel"].shape[0] == 8 + 8 + 1
    c.schedule = "router"
    c.init_m2r2 = ""
    with pytest.raises(ConfigError, match="schedule='router' trains the deciders on a trained stream"):
        distill(c, tmp_path / "bad1")
    c.init_m2r2 = str(tmp_path / "logits_router")
    c.m2r2.rate = 3
    with pytest.raises(ConfigError, match="another fast stream than this config: m2r2.rate=2 there, 3 here"):
        distill(c, tmp_path / "bad2")


def test_later_labels_mark_steps_with_a_safe_step_after_them():
    from m2r2_jax.m2r2.losses import later_labels

    rng = np.random.default_rng(0)
    labels = (rng.random((6, 3, 5)) < 0.3).astype(np.float32)
    want = np.stack([labels[i + 1:].max(axis=0) for i in range(5)])
    np.testing.assert_array_equal(np.asarray(later_labels(labels)), want)
