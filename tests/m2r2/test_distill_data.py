"""Distillation data from the base's own answers: held-out split, answers equal to plain greedy
decoding, stop token left to the data pipeline, benchmark sets refused."""

import json

import jax
import pytest
from conftest import tiny_config

from m2r2_jax.data.corpus import embedded_split
from m2r2_jax.data.tokenizer import train_sentencepiece
from m2r2_jax.decoding import api
from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2 import distill_data as DD
from m2r2_jax.models import transformer as T


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("dd")
    tok = train_sentencepiece(embedded_split("train")[:40000], 400, root / "tokenizer.model")
    cfg = tiny_config("llama", vocab_size=400, n_layers=2, max_seq_len=512)
    return cfg, T.init_params(cfg, jax.random.key(0)), tok


def test_split_keeps_the_tail_out():
    train, held = DD.split_prompts([str(i) for i in range(20)], 0.1, max_prompts=5)
    assert train == ["0", "1", "2", "3", "4"] and held == ["18", "19"]
    with pytest.raises(ConfigError, match="heldout_fraction"):
        DD.split_prompts(["a"], 1.0)


def test_rows_are_the_bases_greedy_answers(base, tmp_path):
    cfg, params, tok = base
    rows, held = DD.make_distill_data(cfg, params, tok, ["self_instruct"], max_new_tokens=12, heldout_fraction=0.5,
                                      max_prompts=5, batch_size=4, progress=False)
    assert len(rows) == 5 and len(held) == 126 and all(r["set"] == "self_instruct" for r in rows)
    from m2r2_jax.bench.prompts import load_prompt_set

    texts = load_prompt_set("self_instruct")[:5]
    ref = api.generate("ar", cfg, params, [tok.encode(t) for t in texts], max_new_tokens=12, eos_ids=tok.eos_ids,
                       batch_size=1)
    for row, text, r in zip(rows, texts, ref):
        want = r.tokens[:-1] if r.tokens and r.tokens[-1] in tok.eos_ids else r.tokens
        assert row["text"] == text + tok.decode(want) and row["answer_tokens"] == len(want)
    assert held[0]["prompt"] == load_prompt_set("self_instruct")[126]
    json.dumps(rows)  # JSON-serialisable as written


def test_benchmark_sets_are_refused(base):
    cfg, params, tok = base
    with pytest.raises(ConfigError, match="benchmark"):
        DD.make_distill_data(cfg, params, tok, ["koala", "spec_bench"], progress=False)
