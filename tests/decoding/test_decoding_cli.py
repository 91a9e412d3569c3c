"""`m2r2 generate` end to end, and the one-line errors for bad input (library and CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import cpu_xla_flags
from decoding_helpers import model, random_m2r2
from m2r2_jax.decoding import api
from m2r2_jax.errors import CheckpointError, ConfigError, DataError
from m2r2_jax.m2r2.checkpoint import save_m2r2
from m2r2_jax.models.checkpoint import params_fingerprint, save_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [1, 2, 3]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    cfg, params = model("llama")
    save_model(d / "base", cfg, params)
    other_cfg, other = model("llama", seed=9)
    mcfg = api.default_m2r2_config(other_cfg)
    save_m2r2(d / "m2r2_other", mcfg, random_m2r2(other_cfg, mcfg, 0), other_cfg,
              params_fingerprint(other_cfg, other))
    (d / "prompts.jsonl").write_text("".join(json.dumps({"tokens": p}) + "\n" for p in PROMPTS))
    return d


def m2r2_cli(*args):
    # one device, as a user's process sees, and the suite's fast compiles (compiling is most of a run)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(1, old_emitters=True))
    return subprocess.run([sys.executable, "-m", "m2r2_jax.cli.main", "generate", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_cli_m2r2_spec_with_fresh_params_reproduces_greedy_ar(ckpts):
    out = ckpts / "out.jsonl"
    r = m2r2_cli("--checkpoint", str(ckpts / "base"), "--method", "m2r2_spec", "--prompts", str(ckpts / "prompts.jsonl"),
                 "--max-new-tokens", "6", "--temperature", "0", "--seed", "0", "--batch-size", "2", "--gamma", "3",
                 "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cfg, params = model("llama")
    ref = api.generate("ar", cfg, params, PROMPTS, max_new_tokens=6, batch_size=3)
    assert [row["tokens"] for row in rows] == [x.tokens for x in ref]
    assert all(row["accepted"] and row["text"] is None for row in rows)
    assert rows[0]["tokens"] == rows[2]["tokens"]  # greedy: a repeated prompt repeats


def test_cli_include_prompt_rows_are_what_moe_bench_teacher_forces(ckpts):
    from m2r2_jax.data.prompt_files import row_split_points

    out = ckpts / "with_prompt.jsonl"
    r = m2r2_cli("--checkpoint", str(ckpts / "base"), "--method", "ar", "--prompts", str(ckpts / "prompts.jsonl"),
                 "--max-new-tokens", "5", "--include_prompt", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cfg, params = model("llama")
    ref = api.generate("ar", cfg, params, PROMPTS, max_new_tokens=5, batch_size=3)
    assert [row["tokens"] for row in rows] == [list(p) + x.tokens for p, x in zip(PROMPTS, ref)]
    assert [row["prompt_len"] for row in rows] == [len(p) for p in PROMPTS]
    assert row_split_points(out, len(rows)) == [len(p) for p in PROMPTS]


@pytest.mark.parametrize("extra,needle", [
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--m2r2", "{d}/m2r2_other"], "another base model"),
    (["--prompts", "{d}/bad.jsonl"], "outside the vocabulary"),
])
def test_cli_bad_input_is_one_line_and_exit_2(ckpts, extra, needle):
    (ckpts / "bad.jsonl").write_text(json.dumps({"tokens": [1, 2]}) + "\n" + json.dumps({"tokens": [1, 999]}) + "\n")
    args = {"--checkpoint": str(ckpts / "base"), "--method": "m2r2_spec", "--prompts": str(ckpts / "prompts.jsonl"),
            "--max-new-tokens": "4", "--out": str(ckpts / "never.jsonl")}
    for k, v in zip(extra[::2], extra[1::2]):
        args[k] = v.format(d=ckpts)
    r = m2r2_cli(*[x for kv in args.items() for x in kv])
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("m2r2: error:") and needle in lines[0], r.stderr
    assert not (ckpts / "never.jsonl").exists()


@pytest.mark.parametrize("prompts,kw,err", [
    ([[]], {}, DataError),
    ([[1, 61]], {}, DataError),
    ([[-1]], {}, DataError),
    ([[1] * 60], {"max_new_tokens": 8}, DataError),  # the context is 64
    ([[1]], {"max_new_tokens": 0}, ConfigError),
    ([[1]], {"method": "two_model"}, ConfigError),
    ([[1]], {"gamma": 0, "method": "distance_spec"}, ConfigError),
    ([[1]], {"temperature": -1.0}, ConfigError),
    ([[1]], {"method": "beam"}, ConfigError),
])
def test_library_rejects_bad_input_with_a_named_error(prompts, kw, err):
    cfg, params = model("llama")
    kw = dict({"method": "ar", "max_new_tokens": 4}, **kw)
    with pytest.raises(err) as e:
        api.generate(kw.pop("method"), cfg, params, prompts, **kw)
    assert "\n" not in str(e.value)


def test_m2r2_checkpoint_of_another_base_is_refused(ckpts):
    from m2r2_jax.m2r2.checkpoint import load_m2r2

    cfg, params = model("llama")
    with pytest.raises(CheckpointError, match="another base"):
        load_m2r2(ckpts / "m2r2_other", cfg, params_fingerprint(cfg, params))


def test_cli_draft_vocab_then_generate_with_it_reproduces_greedy_ar(tmp_path):
    """`m2r2 draft-vocab` counts the embedded corpus with the checkpoint's tokenizer; generating
    with that subset gives ar's greedy tokens, for m2r2_spec and distance_spec."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cli"))
    from cli_helpers import VOCAB, run_m2r2, train_tokenizer

    from m2r2_jax.decoding import draft_vocab as DV

    tok = train_tokenizer(tmp_path / "tokenizer.model")
    cfg, params = model("llama", vocab_size=VOCAB)
    base = save_model(tmp_path / "base", cfg, params, tokenizer_file=str(tok))
    vocab_file = tmp_path / "vocab" / "v.json"
    r = run_m2r2(["draft-vocab", f"--checkpoint={base}", "--size=64", f"--out={vocab_file}"])
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(vocab_file.read_text())
    assert rec["size"] == 64 and rec["vocab_size"] == VOCAB and rec["source"] == "embedded"
    assert 0.3 < rec["coverage"] < 1.0 and "of the" in r.stdout
    # a JSONL corpus (`m2r2 distill-data` rows) counts its rows' "text" fields: as the same text would
    from m2r2_jax.data.corpus import embedded_split

    texts = [embedded_split("train")[:3000], embedded_split("train")[3000:5000]]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": t, "answer_tokens": 1}) + "\n" for t in texts))
    (tmp_path / "rows.txt").write_text("\n".join(texts))
    got = {}
    for name in ("rows.jsonl", "rows.txt"):
        r = run_m2r2(["draft-vocab", f"--checkpoint={base}", "--size=64", f"--corpus={tmp_path / name}",
                      f"--out={tmp_path / name}.vocab"])
        assert r.returncode == 0, r.stderr[-2000:]
        got[name] = json.loads((tmp_path / f"{name}.vocab").read_text())
    assert got["rows.jsonl"]["ids"] == got["rows.txt"]["ids"]
    assert got["rows.jsonl"]["counted_tokens"] == got["rows.txt"]["counted_tokens"]
    ids = DV.load(vocab_file, VOCAB)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in PROMPTS))
    ref = [x.tokens for x in api.generate("ar", cfg, params, PROMPTS, max_new_tokens=6, batch_size=3)]
    for method in ("m2r2_spec", "distance_spec"):
        out = tmp_path / f"{method}.jsonl"
        r = m2r2_cli("--checkpoint", str(base), "--method", method, "--prompts", str(prompts), "--max-new-tokens", "6",
                     "--batch-size", "3", "--draft-vocab", str(vocab_file), "--out", str(out))
        assert r.returncode == 0, r.stderr[-2000:]
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [row["tokens"] for row in rows] == ref
    assert len(ids) == 64
