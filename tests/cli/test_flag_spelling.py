"""Every verb takes its flags spelled with hyphens or underscores (`--draft-vocab` or
`--draft_vocab`); values are never touched."""

import subprocess
import sys
from pathlib import Path

from m2r2_jax.cli.main import underscored_flag

M2R2 = str(Path(sys.executable).with_name("m2r2"))


def test_flag_names_are_underscored_and_values_kept():
    assert underscored_flag("--draft-vocab=my-file.json") == "--draft_vocab=my-file.json"
    assert underscored_flag("--max-new-tokens") == "--max_new_tokens"
    assert underscored_flag("--nostop-at-eos") == "--nostop_at_eos"
    assert underscored_flag("--config.m2r2.lora-rank=4") == "--config.m2r2.lora_rank=4"
    for untouched in ("-5", "my-file.json", "--", "-x", "--out"):
        assert underscored_flag(untouched) == untouched


def test_a_hyphenated_flag_reaches_the_verb(tmp_path):
    r = subprocess.run([M2R2, "bench", "--checkpoint", tmp_path / "missing", "--n-prompts", "2", "--draft-vocab",
                        tmp_path / "v.json", "--out", tmp_path / "o"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Unknown command line flag" not in r.stderr and "missing" in r.stderr, r.stderr
