"""`moe_offload.moefy` / `m2r2 moefy`: a dense SwiGLU model split into an MoE of the same weights.

The experts partition the dense MLP, so with top_k = n_experts the MoE model is the dense model;
the groups are balanced; the routers learn; the offload engine and the simulator run the result
(with its unweighted experts); and the verb keeps the CLI's one-line error contract."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_config

from m2r2_jax.errors import ConfigError
from m2r2_jax.models import checkpoint as MC
from m2r2_jax.models import transformer as T
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.layers import route
from m2r2_jax.moe_offload import moefy as M

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def split():
    cfg = tiny_config("llama")  # d_ff 48
    params = T.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (6, 16)).astype(np.int32)
    moe_cfg, moe_params, record = M.moefy(cfg, params, tokens, n_experts=4, top_k=4, router_steps=40)
    return cfg, params, tokens, moe_cfg, moe_params, record


def test_all_experts_give_the_dense_model_and_fewer_change_it(split):
    cfg, params, tokens, moe_cfg, moe_params, _ = split
    assert (moe_cfg.family, moe_cfg.n_experts, moe_cfg.moe_d_ff, moe_cfg.router_weights) == ("mixtral", 4, 12, "none")
    dense, _ = T.forward(cfg, params, tokens)
    moe, _ = T.forward(moe_cfg, moe_params, tokens)
    np.testing.assert_allclose(np.asarray(moe), np.asarray(dense), atol=1e-5, rtol=1e-5)
    # the same experts weighted by their router probabilities (every other MoE's convention) differ
    weighted, _ = T.forward(moe_cfg.replace(router_weights="softmax"), moe_params, tokens)
    assert np.abs(np.asarray(weighted) - np.asarray(dense)).max() > 1e-3
    fewer, _ = T.forward(moe_cfg.replace(n_experts_per_tok=2), moe_params, tokens)
    assert np.abs(np.asarray(fewer) - np.asarray(dense)).max() > 1e-4


def test_experts_are_equal_groups_that_partition_the_neurons(split):
    cfg, params, _, moe_cfg, moe_params, record = split
    mlp, dense = moe_params["layers"]["mlp"], params["layers"]["mlp"]
    L, d, f = cfg.n_layers, cfg.d_model, cfg.d_ff
    assert mlp["experts_gate"].shape == (L, 4, d, f // 4) and mlp["experts_down"].shape == (L, 4, f // 4, d)
    assert mlp["router"]["kernel"].shape == (L, d, 4)
    for layer in range(L):
        gate = np.asarray(dense["gate_proj"]["kernel"][layer])
        cols = np.concatenate(list(np.asarray(mlp["experts_gate"][layer])), axis=1)  # [d, f], grouped order
        order = [int(np.flatnonzero(np.all(gate == c[:, None], axis=0))[0]) for c in cols.T]
        assert sorted(order) == list(range(f))  # every neuron in exactly one expert
        np.testing.assert_array_equal(np.concatenate(list(np.asarray(mlp["experts_down"][layer]))),
                                      np.asarray(dense["down_proj"]["kernel"][layer])[order])
    # the routers learned: every fit lowered its loss
    assert all(r["router_loss_last"] < r["router_loss_first"] for r in record["layers"])


def test_balanced_kmeans_groups_co_firing_neurons():
    rng = np.random.default_rng(0)
    # 4 planted groups of 6 neurons firing on disjoint token sets, shuffled
    truth = rng.permutation(24).reshape(4, 6)
    acts = np.zeros((200, 24))
    for g, ids in enumerate(truth):
        acts[g * 50:(g + 1) * 50, ids] = rng.random((50, 6)) + 0.5
    feats = acts.T / np.linalg.norm(acts.T, axis=1, keepdims=True)
    groups = M.balanced_kmeans(feats, 4, seed=1)
    assert groups.shape == (4, 6)
    assert {tuple(g) for g in groups} == {tuple(sorted(g)) for g in truth}


def test_fit_router_learns_a_linear_ranking():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32)
    mass = np.exp(x @ rng.normal(size=(8, 5)))  # each group's share grows with a direction of x
    w, first, last = M.fit_router(x, mass, steps=200, lr=5e-2)
    assert w.shape == (8, 5) and last < first
    assert M.topk_recall(x @ w, mass, 2) > 0.8
    assert M.topk_recall(rng.normal(size=(512, 5)), mass, 2) < 0.6  # chance is 0.4


def test_router_weights_switch():
    moe = tiny_config("mixtral")
    logits = np.asarray([[2.0, 0.5, -1.0, 0.0]], np.float32)
    w, idx = route(moe.replace(router_weights="none"), logits)
    assert np.asarray(w).tolist() == [[1.0, 1.0]] and np.asarray(idx).tolist() == [[0, 1]]
    assert abs(float(np.asarray(route(moe, logits)[0]).sum()) - 1.0) < 1e-6  # norm_topk_prob: today's weights
    with pytest.raises(ConfigError, match="router_weights"):
        moe.replace(router_weights="sum").validate()
    with pytest.raises(ConfigError, match="router_weights"):
        tiny_config("llama").replace(router_weights="none").validate()
    # hashed only when not the default: every existing model keeps its fingerprint
    assert "router_weights" not in MC.fingerprint_config_json(moe)
    assert '"router_weights": "none"' in MC.fingerprint_config_json(moe.replace(router_weights="none"))
    assert ModelConfig.from_dict(json.loads(moe.to_json())) == moe
    from m2r2_jax.interop.hf_config import check_exportable

    check_exportable(moe)
    with pytest.raises(ConfigError, match="router_weights='none'"):  # transformers' Mixtral weighs its experts
        check_exportable(moe.replace(router_weights="none"))


@pytest.mark.parametrize("bad,needle", [
    (dict(family="mixtral", n_experts=4, n_experts_per_tok=2, moe_d_ff=24), "already an MoE"),
    (dict(mlp_activation="gelu_tanh"), "SwiGLU"),
])
def test_check_moefy_refuses_bases_it_cannot_split(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        M.check_moefy(tiny_config("llama").replace(**bad), 4, 2)
    with pytest.raises(ConfigError, match="--top_k"):
        M.check_moefy(tiny_config("llama"), 4, 5)
    with pytest.raises(ConfigError, match="divide"):
        M.check_moefy(tiny_config("llama"), 5, 2)


def test_offload_engine_runs_the_split_model_unweighted(split):
    """The engine combines the experts with `route`'s weights (1 each here): its logits are the
    all-resident model's, prefetching and evictions included."""
    from m2r2_jax.moe_offload.engine import OffloadEngine

    _, _, tokens, moe_cfg, moe_params, _ = split
    cfg = moe_cfg.replace(n_experts_per_tok=2)
    prompt = [int(t) for t in tokens[0, :5]]
    eng = OffloadEngine(cfg, moe_params, capacity=2, predictor="next_gate", policy="predictive")
    out, logits = eng.generate(prompt, 4)
    want, _ = T.forward(cfg, moe_params, np.asarray([prompt + out]))
    np.testing.assert_allclose(logits, np.asarray(want[0, len(prompt) - 1:-1]), atol=2e-4, rtol=2e-4)
    assert eng.stats.transfers > 0 and len(eng.routes) == 3


# --------------------------------------------------------------------------------------------
# The verb, in one child process (JAX starts once): a good run, then the bad inputs
# --------------------------------------------------------------------------------------------
DRIVER = textwrap.dedent("""
    import contextlib, io, json, sys
    from m2r2_jax.cli.common import run_verb
    from m2r2_jax.cli import moefy
    from absl import app, flags
    results = []
    for argv in json.loads(sys.argv[1]):
        flags.FLAGS.unparse_flags()  # each case from the defaults; absl runs one app per process unless reset
        app._register_and_parse_flags_with_usage.done = False
        app._run_init.done = False
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                run_verb(moefy.main, ["m2r2 moefy"] + argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        results.append({"code": code, "stderr": err.getvalue()})
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def verb_runs(tmp_path_factory):
    from m2r2_jax.data.corpus import embedded_split
    from m2r2_jax.data.tokenizer import train_sentencepiece

    root = tmp_path_factory.mktemp("moefy_verb")
    tok = root / "tok.model"
    train_sentencepiece(embedded_split("heldout")[:20000], 384, tok)
    cfg = tiny_config("llama", vocab_size=384)
    MC.save_model(root / "dense", cfg, T.init_params(cfg, jax.random.key(0)), tokenizer_file=str(tok))
    moe_cfg = tiny_config("mixtral", vocab_size=384)
    MC.save_model(root / "moe", moe_cfg, T.init_params(moe_cfg, jax.random.key(0)), tokenizer_file=str(tok))
    common = ["--seq_len=16", "--max_sequences=6", "--router_steps=20", "--cluster_tokens=64"]
    cases = {
        "good": [f"--checkpoint={root / 'dense'}", f"--out={root / 'out'}", "--experts=4", "--top_k=2", *common],
        "k-above-e": [f"--checkpoint={root / 'dense'}", f"--out={root / 'bad1'}", "--experts=4", "--top_k=5"],
        "e-not-dividing": [f"--checkpoint={root / 'dense'}", f"--out={root / 'bad2'}", "--experts=5"],
        "moe-base": [f"--checkpoint={root / 'moe'}", f"--out={root / 'bad3'}", "--experts=4"],
        "no-data": [f"--checkpoint={root / 'dense'}", f"--out={root / 'bad4'}", f"--data={root / 'nope.jsonl'}", "--seq_len=16"],
        "out-exists": [f"--checkpoint={root / 'dense'}", f"--out={root / 'moe'}", "--experts=4", "--seq_len=16"],
    }
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(list(cases.values()))], capture_output=True,
                       text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return root, dict(zip(cases, json.loads(r.stdout.strip().splitlines()[-1])))


def test_verb_writes_a_loadable_moe_checkpoint(verb_runs):
    root, runs = verb_runs
    assert runs["good"]["code"] == 0, runs["good"]["stderr"]
    cfg, params = MC.load_model(root / "out")
    assert (cfg.family, cfg.n_experts, cfg.n_experts_per_tok, cfg.router_weights) == ("mixtral", 4, 2, "none")
    assert MC.tokenizer_path(root / "out").name == "tok.model"
    record = json.loads((root / "out" / "moefy.json").read_text())
    assert len(record["layers"]) == cfg.n_layers and 0 <= record["router_recall"] <= 1
    assert record["quality"]["perplexity_moe"] > 0 and 0 <= record["quality"]["top1_agreement"] <= 1
    assert MC.load_fingerprint(root / "out") == MC.params_fingerprint(cfg, params)


@pytest.mark.parametrize("case,needle", [("k-above-e", "--top_k=5"), ("e-not-dividing", "--experts=5"),
                                         ("moe-base", "already an MoE"), ("no-data", "nope.jsonl"),
                                         ("out-exists", "already exists")])
def test_verb_bad_input_is_one_line_and_exit_2(verb_runs, case, needle):
    root, runs = verb_runs
    r = runs[case]
    lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
    assert r["code"] == 2 and len(lines) == 1 and lines[0].startswith("m2r2: error: "), r
    assert needle in lines[0] and "Traceback" not in r["stderr"]
    assert not list(root.glob("bad*"))  # nothing left behind
