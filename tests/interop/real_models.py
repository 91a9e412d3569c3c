"""What the tests of the real pretrained models share: the GGUF from the fetch cache (filled by
`m2r2 fetch NAME` or the demo; the suite downloads nothing, so without it those tests skip), its
converted checkpoint (one per test module) and transformers' model and tokenizer of the same file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from m2r2_jax.interop.fetch import default_cache_dir, model_source

M2R2 = str(Path(sys.executable).with_name("m2r2"))  # the installed CLI, run as a user would


def fetched(name: str):
    """(source, cached GGUF path, skip mark) of the fetchable model `name`."""
    source = model_source(name)
    cached = default_cache_dir() / source.name / source.filename
    mark = pytest.mark.skipif(not cached.is_file(), reason=f"the real model is not in the fetch cache ({cached}); "
                              f"`m2r2 fetch {name} --out DIR` puts it there")
    return source, cached, mark


def converted_checkpoint(cached: Path):
    """A module-scoped fixture: `cached` converted to a checkpoint in a temporary directory."""

    @pytest.fixture(scope="module")
    def ckpt(tmp_path_factory):
        from m2r2_jax.interop.convert import convert_gguf

        return convert_gguf(cached, tmp_path_factory.mktemp("real") / "ckpt")

    return ckpt


def transformers_reference(cached: Path):
    """(torch, tokenizer, model): transformers' float32 model and tokenizer of the GGUF file
    `cached` (the test skips without torch or transformers)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(cached.parent, gguf_file=cached.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(cached.parent, gguf_file=cached.name,
                                                              dtype=torch.float32).eval()
    return torch, tok, model
