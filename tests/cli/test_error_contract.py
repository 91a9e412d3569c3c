"""The error contract of every `m2r2` verb, as a table: a bad input (missing or unknown flag, a
checkpoint that is absent, a file, empty or corrupt, a bad config value, a bad prompts or data
file, an output path that cannot be created, positional junk) gives exit status 2, exactly one
stderr line `m2r2: error: ...` naming the problem, no traceback, and no output left behind. A bad
config value is caught before any model weights or data are read.

The cases of one verb run in one process (`verb_worker.py`: the verb's `main` under the same
`run_verb` as `m2r2 VERB`, with file descriptor 2 captured per case), so JAX starts and the tiny
models compile once per verb rather than once per case; the first case of every verb (and the
dispatcher's) also runs as a real `m2r2` process. Each parametrized test checks its own result."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cli_helpers import REPO, build_fixtures, contract_violations, run_in_workers, run_many

from m2r2_jax.cli.main import VERBS  # noqa: E402  (no JAX import: the verbs are imported lazily)

# (id, arguments, words the error line must contain, xfail reason or None). In arguments, {name}
# is a fixture path from cli_helpers.build_fixtures; {out} is a fresh path per case that must
# still not exist afterwards.
CASES = [
    # convert
    ("convert-no-hf", "convert --out {out}", ["--hf", "--gguf"], None),
    ("convert-hf-missing", "convert --hf {missing} --out {out}", ["does_not_exist"], None),
    ("convert-hf-is-file", "convert --hf {file} --out {out}", ["a_file", "not a directory"], None),
    ("convert-hf-empty", "convert --hf {empty_dir} --out {out}", ["config.json"], None),
    ("convert-config-garbage", "convert --hf {hf_garbage} --out {out}", ["config.json", "JSON"], None),
    ("convert-remote-code", "convert --hf {hf_remote} --out {out}", ["remote code"], None),
    ("convert-no-weights", "convert --hf {hf_no_weights} --out {out}", ["safetensors"], None),
    ("convert-out-in-file", "convert --hf {hf} --out {file}/ckpt", ["a_file"], None),
    ("convert-bad-dtype", "convert --hf {hf} --out {out} --dtype float64", ["--dtype", "float64"], None),
    ("convert-out-exists", "convert --hf {hf} --out {empty_dir}", ["already exists"], None),
    ("convert-positional", "convert --hf {hf} --out {out} junk", ["junk"], None),
    ("convert-hf-and-gguf", "convert --hf {hf} --gguf {file} --out {out}", ["exactly one of"], None),
    ("convert-gguf-missing", "convert --gguf {missing}.gguf --out {out}", ["does_not_exist.gguf"], None),
    ("convert-gguf-garbage", "convert --gguf {file} --out {out}", ["a_file", "GGUF"], None),
    ("convert-gguf-is-dir", "convert --gguf {empty_dir} --out {out}", ["empty_dir"], None),
    # fetch (`m2r2 fetch NAME` is `--name NAME`; nothing here reaches a registry)
    ("fetch-unknown-name", "fetch --name gpt-17 --out {out}", ["gpt-17", "smollm2-135m-instruct"], None),
    ("fetch-no-out", "fetch --name smollm2-135m-instruct", ["--out"], None),
    ("fetch-no-name", "fetch --out {out}", ["--list"], None),
    ("fetch-out-in-file", "fetch --name smollm2-135m-instruct --out {file}/m", ["a_file"], None),
    ("fetch-list-and-out", "fetch --list --out {out}", ["--list", "--out"], None),
    # export
    ("export-ckpt-missing", "export --checkpoint {missing} --out {out}", ["model_config.json"], None),
    ("export-ckpt-is-file", "export --checkpoint {file} --out {out}", ["a_file"], None),
    ("export-config-garbage", "export --checkpoint {garbage_config} --out {out}", ["model_config.json"], None),
    ("export-params-corrupt", "export --checkpoint {corrupt_params} --out {out}", ["corrupt_params"], None),
    ("export-shard-size-text", "export --checkpoint {base} --out {out} --max_shard_size abc", ["abc"], None),
    ("export-shard-size-negative", "export --checkpoint {base} --out {out} --max_shard_size -5", ["-5"], None),
    ("export-unknown-flag", "export --checkpoint {base} --out {out} --shards 3", ["shards"], None),
    # logits
    ("logits-no-tokens", "logits --checkpoint {base} --out {out}.npy", ["--tokens"], None),
    ("logits-ckpt-empty", "logits --checkpoint {empty_dir} --tokens {tokens} --out {out}.npy", ["model_config.json"], None),
    ("logits-config-array", "logits --checkpoint {array_config} --tokens {tokens} --out {out}.npy",
     ["model_config.json"], None),
    ("logits-config-invalid", "logits --checkpoint {invalid_config} --tokens {tokens} --out {out}.npy",
     ["n_layers=-3"], None),
    ("logits-no-params", "logits --checkpoint {no_params} --tokens {tokens} --out {out}.npy", ["params"], None),
    ("logits-params-corrupt", "logits --checkpoint {corrupt_params} --tokens {tokens} --out {out}.npy",
     ["corrupt_params"], None),
    ("logits-tokens-junk", "logits --checkpoint {base} --tokens {tokens_junk} --out {out}.npy", ["tokens_junk.npy"], None),
    ("logits-tokens-oov", "logits --checkpoint {base} --tokens {tokens_oov} --out {out}.npy", ["384", "vocabulary"], None),
    ("logits-out-in-file", "logits --checkpoint {base} --tokens {tokens} --out {file}/x.npy", ["a_file"], None),
    ("logits-out-is-dir", "logits --checkpoint {base} --tokens {tokens} --out {empty_dir}", ["empty_dir", "directory"], None),
    # pretrain
    ("pretrain-no-workdir", "pretrain --config={pretrain_cfg}", ["workdir"], None),
    ("pretrain-config-missing", "pretrain --config={missing}.py --workdir={out}", ["does_not_exist.py"], None),
    ("pretrain-config-syntax", "pretrain --config={syntax_error_cfg} --workdir={out}", ["syntax_error_cfg.py"], None),
    ("pretrain-steps-negative", "pretrain --config={pretrain_cfg} --workdir={out} --config.train.steps=-1",
     ["train.steps"], None),
    ("pretrain-unknown-field", "pretrain --config={pretrain_cfg} --workdir={out} --config.nonexistent=1",
     ["nonexistent"], None),
    ("pretrain-tokenizer-missing", "pretrain --config={pretrain_cfg} --workdir={out} --config.data.tokenizer={missing}",
     ["does_not_exist"], None),
    ("pretrain-workdir-in-file", "pretrain --config={pretrain_cfg} --workdir={file}/w", ["a_file"], None),
    # a bad config value fails before any data is read (here: a file that does not exist)
    ("pretrain-validated-before-data", "pretrain --config={pretrain_cfg} --workdir={out} --config.data.source=jsonl "
     "--config.data.paths=('{missing}.jsonl',) --config.train.learning_rate=-1", ["train.learning_rate"], None),
    # sample
    ("sample-no-checkpoint", "sample --prompt x", ["--checkpoint"], None),
    ("sample-ckpt-missing", "sample --checkpoint {missing} --prompt x", ["not a model checkpoint"], None),
    ("sample-no-tokenizer", "sample --checkpoint {notok} --prompt x", ["tokenizer"], None),
    ("sample-temperature-nan", "sample --checkpoint {base} --prompt x --temperature nan", ["temperature"], None),
    ("sample-negative-tokens", "sample --checkpoint {base} --prompt x --max-new-tokens -1", ["max_new_tokens"], None),
    ("sample-too-many-tokens", "sample --checkpoint {base} --prompt x --max-new-tokens 1000", ["max_seq_len"], None),
    ("sample-huge-seed", "sample --checkpoint {base} --prompt x --seed 100000000000000000000000", ["--seed"], None),
    ("sample-positional", "sample --checkpoint {base} ROMEO", ["ROMEO"], None),
    # distill-data
    ("distill-data-no-checkpoint", "distill-data --out {out}", ["--checkpoint"], None),
    ("distill-data-benchmark", "distill-data --checkpoint {base} --out {out} --prompts koala,mt_bench",
     ["mt_bench", "benchmark"], None),
    ("distill-data-ckpt-missing", "distill-data --checkpoint {missing} --out {out}", ["does_not_exist"], None),
    ("distill-data-no-tokenizer", "distill-data --checkpoint {notok} --out {out}", ["tokenizer"], None),
    ("distill-data-bad-set", "distill-data --checkpoint {base} --out {out} --prompts nosuchset", ["nosuchset"], None),
    ("distill-data-zero-tokens", "distill-data --checkpoint {base} --out {out} --max_new_tokens 0",
     ["max_new_tokens"], None),
    # distill
    ("distill-no-config", "distill --workdir={out}", ["config"], None),
    ("distill-base-missing", "distill --config={distill_cfg} --workdir={out} --config.base_checkpoint={missing}",
     ["does_not_exist"], None),
    ("distill-branch-too-deep", "distill --config={distill_cfg} --workdir={out} --config.m2r2.branch_layer=9",
     ["branch_layer"], None),
    ("distill-rank-zero", "distill --config={distill_cfg} --workdir={out} --config.m2r2.lora_rank=0", ["lora_rank"], None),
    ("distill-rate-zero", "distill --config={distill_cfg} --workdir={out} --config.m2r2.rate=0", ["rate"], None),
    # the whole config is validated before the base's weights (corrupt here) or any data are read
    ("distill-validated-before-weights", "distill --config={distill_cfg} --workdir={out} "
     "--config.base_checkpoint={corrupt_params} --config.data.source=jsonl --config.data.paths=('{missing}.jsonl',) "
     "--config.train.steps=-1", ["train.steps"], None),
    # align
    ("align-no-out", "align --checkpoint {base}", ["--out"], None),
    ("align-m2r2-base-garbage", "align --checkpoint {base} --m2r2 {m2r2_garbage_base} --out {out} --seq_len 16", ["base.json"],
     None),
    ("align-m2r2-config-garbage", "align --checkpoint {base} --m2r2 {m2r2_garbage_config} --out {out} --seq_len 16",
     ["m2r2_config.json"], None),
    ("align-m2r2-other-base", "align --checkpoint {base} --m2r2 {m2r2_other} --out {out} --seq_len 16", ["another base"], None),
    ("align-data-not-utf8", "align --checkpoint {base} --data {data_not_utf8} --out {out} --seq_len 16", ["UTF-8"], None),
    ("align-data-empty", "align --checkpoint {base} --data {data_empty} --out {out} --seq_len 16", ["empty"], None),
    ("align-data-wrong-field", "align --checkpoint {base} --data {data_jsonl_wrong_field} --out {out} --seq_len 16",
     ["'text'"], None),
    ("align-data-missing", "align --checkpoint {base} --data {missing} --out {out} --seq_len 16", ["does_not_exist"], None),
    ("align-seq-len-too-long", "align --checkpoint {base} --out {out} --seq_len 1000", ["seq_len"], None),
    ("align-seq-len-one", "align --checkpoint {base} --out {out} --seq_len 1", ["seq_len"], None),
    ("align-out-in-file", "align --checkpoint {base} --out {file}/a --seq_len 16 --max_batches 1 --batch_size 1",
     ["a_file"], None),
    # generate
    ("generate-no-prompts", "generate --checkpoint {base} --out {out}.jsonl", ["--prompts"], None),
    ("generate-prompts-missing", "generate --checkpoint {base} --prompts {missing} --out {out}.jsonl",
     ["does_not_exist"], None),
    ("generate-prompts-not-jsonl", "generate --checkpoint {base} --prompts {prompts_not_jsonl} --out {out}.jsonl",
     ["prompts_not_jsonl.jsonl:1"], None),
    ("generate-prompts-empty", "generate --checkpoint {base} --prompts {prompts_empty} --out {out}.jsonl",
     ["no prompts"], None),
    ("generate-prompts-blank", "generate --checkpoint {base} --prompts {prompts_blank} --out {out}.jsonl",
     ["no prompts"], None),
    ("generate-empty-prompt", "generate --checkpoint {base} --prompts {prompts_empty_prompt} --out {out}.jsonl",
     ["empty"], None),
    ("generate-prompt-oov", "generate --checkpoint {base} --prompts {prompts_oov} --out {out}.jsonl", ["vocabulary"], None),
    ("generate-prompt-negative", "generate --checkpoint {base} --prompts {prompts_negative} --out {out}.jsonl",
     ["vocabulary"], None),
    ("generate-prompt-too-long", "generate --checkpoint {base} --prompts {prompts_too_long} --out {out}.jsonl",
     ["too long"], None),
    ("generate-prompts-not-utf8", "generate --checkpoint {base} --prompts {prompts_not_utf8} --out {out}.jsonl "
     "--max-new-tokens 2", ["UTF-8"], None),
    ("generate-unknown-method", "generate --checkpoint {base} --prompts {prompts} --out {out}.jsonl --method beam",
     ["--method"], None),
    ("generate-negative-tokens", "generate --checkpoint {base} --prompts {prompts} --out {out}.jsonl "
     "--max-new-tokens -3", ["max-new-tokens"], None),
    ("generate-huge-seed", "generate --checkpoint {base} --prompts {prompts} --out {out}.jsonl --max-new-tokens 2 "
     "--seed 100000000000000000000000", ["--seed"], None),
    ("generate-two-model-no-draft", "generate --checkpoint {base} --prompts {prompts} --out {out}.jsonl "
     "--method two_model", ["draft"], None),
    ("generate-top-p-nan", "generate --checkpoint {base} --prompts {prompts} --out {out}.jsonl --top_p nan",
     ["top_p"], None),
    ("generate-temperature-inf", "generate --checkpoint {base} --prompts {prompts} --out {out}.jsonl "
     "--max-new-tokens 2 --temperature inf", ["temperature"], None),
    ("generate-m2r2-base-garbage", "generate --checkpoint {base} --prompts {prompts} --out {out}.jsonl "
     "--max-new-tokens 2 --method m2r2_spec --m2r2 {m2r2_garbage_base}", ["base.json"], None),
    ("generate-fingerprint-garbage", "generate --checkpoint {garbage_fingerprint} --prompts {prompts} "
     "--out {out}.jsonl --max-new-tokens 2 --method m2r2_spec --m2r2 {m2r2}", ["fingerprint.json"], None),
    ("generate-layer-loop-unknown", "generate --checkpoint {base} --prompts {prompts} --out {out}.jsonl "
     "--layer_loop spiral", ["--layer_loop"], None),
    ("generate-out-in-file", "generate --checkpoint {base} --prompts {prompts} --out {file}/g.jsonl "
     "--max-new-tokens 2", ["a_file"], None),
    ("generate-draft-vocab-missing", "generate --checkpoint {base} --prompts {prompts} --out {out}.jsonl "
     "--method m2r2_spec --draft-vocab {missing}", ["does_not_exist"], None),
    ("generate-draft-vocab-with-ar", "generate --checkpoint {base} --prompts {prompts} --out {out}.jsonl "
     "--draft-vocab {file}", ["--draft-vocab", "m2r2_spec"], None),
    # bench
    ("bench-no-checkpoint", "bench --out {out}", ["--checkpoint"], None),
    ("bench-unrolled-sharded", "bench --checkpoint {base} --out {out} --layer_loop unrolled --mesh data=1",
     ["layer_loop=unrolled", "plan"], None),
    ("bench-unknown-set", "bench --checkpoint {base} --prompts nonexistent_set --out {out}", ["nonexistent_set"], None),
    ("bench-tokens-string", "bench --checkpoint {base} --prompts {prompts_tokens_string} --out {out}",
     ["prompts_tokens_string.jsonl", "tokens"], None),
    ("bench-tokens-floats", "bench --checkpoint {base} --prompts {prompts_tokens_floats} --out {out}",
     ["prompts_tokens_floats.jsonl", "tokens"], None),
    ("bench-prompts-not-utf8", "bench --checkpoint {base} --prompts {prompts_not_utf8} --out {out}", ["UTF-8"], None),
    ("bench-batch-sizes-text", "bench --checkpoint {base} --prompts {prompts} --out {out} --batch_sizes 1,x",
     ["batch_sizes"], None),
    ("bench-batch-sizes-zero", "bench --checkpoint {base} --prompts {prompts} --out {out} --batch_sizes 0",
     ["batch_sizes"], None),
    ("bench-too-many-tokens", "bench --checkpoint {base} --prompts {prompts} --out {out} --max_new_tokens 1000",
     ["max_new_tokens"], None),
    ("bench-m2r2-base-garbage", "bench --checkpoint {base} --prompts {prompts} --out {out} --max_new_tokens 2 "
     "--m2r2 {m2r2_garbage_base}", ["base.json"], None),
    ("bench-draft-vocab", "bench --checkpoint {base} --prompts {prompts} --out {out} --max_new_tokens 2 "
     "--draft_checkpoint {moe}", ["vocabulary"], None),
    ("bench-prompt-oov", "bench --checkpoint {base} --prompts {prompts_oov} --out {out} --max_new_tokens 2",
     ["vocabulary"], None),
    ("bench-draft-vocab-file-garbage", "bench --checkpoint {base} --prompts {prompts} --out {out} --max_new_tokens 2 "
     "--draft_vocab {file}", ["a_file", "JSON"], None),
    # draft-vocab
    ("draft-vocab-no-size", "draft-vocab --checkpoint {base} --out {out}.json", ["--size"], None),
    ("draft-vocab-size-too-big", "draft-vocab --checkpoint {base} --size 100000 --out {out}.json",
     ["--size=100000", "vocabulary"], None),
    ("draft-vocab-no-tokenizer", "draft-vocab --checkpoint {notok} --size 8 --out {out}.json", ["tokenizer"], None),
    ("draft-vocab-corpus-missing", "draft-vocab --checkpoint {base} --size 8 --corpus {missing} --out {out}.json",
     ["does_not_exist"], None),
    ("draft-vocab-corpus-not-utf8", "draft-vocab --checkpoint {base} --size 8 --corpus {data_not_utf8} "
     "--out {out}.json", ["UTF-8"], None),
    ("draft-vocab-corpus-empty", "draft-vocab --checkpoint {base} --size 8 --corpus {data_empty} --out {out}.json",
     ["no tokens"], None),
    ("draft-vocab-out-in-file", "draft-vocab --checkpoint {base} --size 8 --out {file}/v.json", ["a_file"], None),
    # moe-bench
    ("moe-bench-dense-base", "moe-bench --checkpoint {base} --prompts {prompts} --out {out}", ["MoE"], None),
    ("moe-bench-not-utf8", "moe-bench --checkpoint {moe} --prompts {prompts_not_utf8} --out {out}", ["UTF-8"], None),
    ("moe-bench-prompt-oov", "moe-bench --checkpoint {moe} --prompts {prompts_oov} --out {out}", ["vocabulary"], None),
    ("moe-bench-prompt-too-long", "moe-bench --checkpoint {moe} --prompts {prompts_too_long} --out {out} "
     "--max_new_tokens 2", ["max_seq_len"], None),
    ("moe-bench-unknown-shape", "moe-bench --checkpoint {moe} --prompts {prompts} --out {out} --shapes nope",
     ["nope"], None),
    ("moe-bench-unknown-platform", "moe-bench --checkpoint {moe} --prompts {prompts} --out {out} --platforms nope",
     ["nope"], None),
    ("moe-bench-capacity", "moe-bench --checkpoint {moe} --prompts {prompts} --out {out} --capacity 10000",
     ["capacity"], None),
    ("moe-bench-branch-layer", "moe-bench --checkpoint {moe} --prompts {prompts} --out {out} --branch_layer 99",
     ["branch_layer"], None),
    ("moe-bench-negative-rate", "moe-bench --checkpoint {moe} --prompts {prompts} --out {out} --rate -3", ["rate"], None),
    ("moe-bench-m2r2-other-arch", "moe-bench --checkpoint {moe} --prompts {prompts} --out {out} --m2r2 {m2r2}",
     ["different base"], None),
    ("moe-bench-m2r2-base-garbage", "moe-bench --checkpoint {moe} --prompts {prompts} --out {out} "
     "--m2r2 {m2r2_garbage_base}", ["base.json"], None),
    ("moe-bench-text-no-tokenizer", "moe-bench --checkpoint {moe} --prompts {prompts_text} --out {out}",
     ["tokenizer"], None),
    # moefy (every case fails before a weight is read)
    ("moefy-no-out", "moefy --checkpoint {base}", ["--out"], None),
    ("moefy-moe-base", "moefy --checkpoint {moe} --out {out}", ["already an MoE"], None),
    ("moefy-k-above-e", "moefy --checkpoint {base} --out {out} --experts 4 --top_k 5", ["--top_k=5"], None),
    ("moefy-e-not-dividing", "moefy --checkpoint {base} --out {out} --experts 7", ["--experts=7"], None),
    ("moefy-data-missing", "moefy --checkpoint {base} --out {out} --seq_len 16 --data {missing}.jsonl",
     ["does_not_exist.jsonl"], None),
    # demo (every case fails before any training starts)
    ("demo-budget", "demo --budget huge --out {out}", ["--budget"], None),
    ("demo-out-in-file", "demo --out {file}/demo --budget tiny", ["a_file"], None),
    ("demo-positional", "demo junk --out {out}", ["junk"], None),
    ("demo-bool-value", "demo --out {out} --skip_moe=maybe", ["skip_moe"], None),
    ("demo-dense-steps-zero", "demo --model tiny --out {out} --budget tiny --dense_steps 0", ["--dense_steps",
                                                                                             "positive"], None),
    ("demo-model-unknown", "demo --model gpt5 --out {out}", ["--model='gpt5'", "smollm2-135m-instruct"], None),
    ("demo-dense-steps-pretrained", "demo --out {out} --dense_steps 5", ["--dense_steps", "--model tiny"], None),
    ("demo-distill-steps-no-distill", "demo --out {out} --distill_steps 5", ["--distill_steps needs --distill"], None),
    ("demo-distill-tiny", "demo --model tiny --distill --out {out}", ["--distill", "pretrained"], None),
    ("demo-distill-steps-text", "demo --out {out} --distill_steps many", ["distill_steps"], None),
    # aot-check (the sharding verb)
    ("aot-check-no-model", "aot-check --out {out}.json", ["--model"], None),
    ("aot-check-memory-text", "aot-check --model={repo}/configs/models/tiny_dense.py --device_memory abc "
     "--out {out}.json", ["abc"], None),
    ("aot-check-mesh-junk", "aot-check --model={repo}/configs/models/tiny_dense.py --mesh bogus --out {out}.json",
     ["--mesh", "bogus"], None),
    ("aot-check-mesh-too-big", "aot-check --model={repo}/configs/models/tiny_dense.py --mesh fsdp=3 --program train "
     "--batch_size 1 --seq_len 8 --out {out}.json", ["fsdp=3", "devices"], None),
    ("aot-check-platform-mesh-open", "aot-check --model={repo}/configs/models/tiny_dense.py --platform tpu "
     "--mesh data=-1 --out {out}.json", ["--platform needs a --mesh", "--devices"], None),
    ("aot-check-platform-unknown", "aot-check --model={repo}/configs/models/tiny_dense.py --platform ipu "
     "--out {out}.json", ["--platform", "ipu"], None),
    ("aot-check-m2r2-config-validated", "aot-check --model={repo}/configs/models/tiny_dense.py "
     "--m2r2={repo}/configs/m2r2/tiny_dense.py --m2r2.loss.temperature=-1 --out {out}.json",
     ["loss.temperature"], None),
    ("aot-check-devices-alone", "aot-check --model={repo}/configs/models/tiny_dense.py --devices 4 "
     "--out {out}.json", ["--devices is only for --platform"], None),
    # the dispatcher
    ("unknown-verb", "frobnicate --out {out}", ["frobnicate"], None),
]


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return build_fixtures(tmp_path_factory.mktemp("contract"))


def _values(fx):
    return {"repo": str(REPO), **{k: str(v) for k, v in fx.items()}}


def _argv(fx, case_id, template):
    values = _values(fx)
    values["out"] = str(fx["root"] / "outputs" / case_id)
    return template.format(**values).split()


# Every verb's cases run in its worker (the worker drops the `--config.a.b` override flags that
# ml_collections registers while parsing a case before the next case registers its own).
IN_PROCESS = set(VERBS)


@pytest.fixture(scope="module")
def results(fx):
    """Every case of the table, run once: per verb in a worker, plus each verb's first case as a
    real `m2r2` process."""
    (fx["root"] / "outputs").mkdir()
    before = _tree(fx["root"])
    by_verb, first, real = {}, {}, []
    for cid, tpl, _, _ in CASES:
        verb = tpl.split()[0]
        if verb in IN_PROCESS:
            by_verb.setdefault(verb, []).append(cid)
            first.setdefault(verb, cid)
        else:
            real.append(cid)
    done = run_in_workers({v: [_argv(fx, cid, _template(cid))[1:] for cid in ids] for v, ids in by_verb.items()})
    runs = {}
    for verb, ids in by_verb.items():
        for cid, res in zip(ids, done[verb]):
            runs[cid] = SimpleNamespace(returncode=res["code"], stderr=res["stderr"] + (res["traceback"] or ""))
    real += list(first.values())
    real_runs = dict(zip(real, run_many([_argv(fx, cid, _template(cid)) for cid in real], workers=2)))
    return {"runs": runs, "real": real_runs, "before": before, "after": _tree(fx["root"])}


def _template(case_id):
    return next(tpl for cid, tpl, _, _ in CASES if cid == case_id)


def _tree(root):
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_every_verb_has_cases():
    covered = {c[1].split()[0] for c in CASES}
    assert set(VERBS) <= covered, set(VERBS) - covered
    for verb in VERBS:
        assert sum(c[1].split()[0] == verb for c in CASES) >= 4, verb


@pytest.mark.parametrize("case_id, template, needles", [
    pytest.param(cid, tpl, needles, id=cid,
                 marks=[pytest.mark.xfail(strict=True, reason=why)] if why else [])
    for cid, tpl, needles, why in CASES])
def test_bad_input_gives_one_line_and_exit_2(results, fx, case_id, template, needles):
    needles = [n.format(**_values(fx)) for n in needles]
    ran = [how for how in ("runs", "real") if case_id in results[how]]
    assert ran, case_id
    for how in ran:
        r = results[how][case_id]
        problems = contract_violations(r.returncode, r.stderr, needles)
        assert not problems, f"{how}: {' '.join(_argv(fx, case_id, template))}: {problems}\nstderr:\n{r.stderr[-3000:]}"
    # nothing written: neither the output path nor anything else under the fixtures
    out = fx["root"] / "outputs"
    assert not [p for p in out.iterdir() if p.name.split(".")[0] == case_id], f"{case_id} left output behind"


def test_no_output_or_temporary_file_left_anywhere(results):
    known = {f"outputs/{cid}" for cid, _, _, why in CASES if why}  # the xfail cases may write
    new = {p for p in results["after"] - results["before"] if not any(p.split(".")[0].startswith(k) for k in known)}
    assert not new, f"bad-input runs left files behind: {sorted(new)[:20]}"


def test_sample_decodes_ids_beyond_the_tokenizer(fx):
    """A model vocabulary padded past the tokenizer's pieces (common after conversion) can sample
    ids with no text; `m2r2 sample` shows them as U+FFFD instead of crashing in the decoder."""
    from cli_helpers import run_m2r2

    r = run_m2r2(["sample", "--checkpoint", fx["padded"], "--prompt", "ROMEO", "--max-new-tokens", "60",
                  "--temperature", "100", "--seed", "1"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stdout.startswith("ROMEO") and "\ufffd" in r.stdout
