"""M2R2 parameters the project ships, one folder per base model (named as `m2r2 fetch` names it).

Each folder is an ordinary M2R2 checkpoint in the portable form (`m2r2.checkpoint.export_portable`:
params.safetensors in float16, m2r2_config.json, base.json with the fingerprint of the base they
were trained on) plus:

    recipe.json       how they were made: the commands, the recipe config, the time on the CPU
                      that ran them, the distillation summary, the draft length the demo uses
    draft_vocab.json  the token subset the draft head scores (`m2r2 draft-vocab` format), counted
                      on the distillation data (never on a benchmark set)

They load like any M2R2 checkpoint (`m2r2 bench --m2r2 m2r2_jax/pretrained/NAME`), and only onto
the base whose fingerprint base.json records: `m2r2 demo --distill` trains them anew.
"""

from __future__ import annotations

from pathlib import Path

from m2r2_jax.errors import ConfigError
from m2r2_jax.json_files import read_json_object

ROOT = Path(__file__).resolve().parent
RECIPE_FILE = "recipe.json"
DRAFT_VOCAB_FILE = "draft_vocab.json"


def shipped() -> list:
    """Names of the base models with shipped M2R2 parameters."""
    return sorted(p.name for p in ROOT.iterdir() if (p / RECIPE_FILE).is_file())


def pretrained_dir(name: str) -> Path:
    """The shipped M2R2 checkpoint for base `name`; one line naming the shipped ones otherwise."""
    d = ROOT / name
    if not (d / RECIPE_FILE).is_file():
        known = ", ".join(shipped()) or "none"
        raise ConfigError(f"no shipped M2R2 parameters for {name!r} (shipped: {known}); "
                          "`m2r2 demo --distill` trains them")
    return d


def recipe(name: str) -> dict:
    return read_json_object(pretrained_dir(name) / RECIPE_FILE)


def write_shipped(dst, m2r2_dir, base_dir, recipe_record: dict, draft_vocab_file, overwrite: bool = False) -> Path:
    """Write the shipped form of a distilled M2R2 checkpoint into `dst` (a folder like those
    under m2r2_jax/pretrained/): the portable checkpoint, the draft vocabulary and recipe.json
    (`recipe_record` plus the base fingerprint). `m2r2 demo --distill` writes one under OUT/shipped/."""
    import json
    import shutil

    from m2r2_jax.atomic import atomic_directory
    from m2r2_jax.m2r2.checkpoint import export_portable
    from m2r2_jax.models.checkpoint import load_config, load_fingerprint

    base_cfg, fp = load_config(base_dir), load_fingerprint(base_dir)
    with atomic_directory(dst, overwrite) as tmp:  # all of it or nothing
        ckpt = export_portable(m2r2_dir, tmp / "checkpoint", base_cfg, fp)
        for f in ckpt.iterdir():
            f.rename(tmp / f.name)
        ckpt.rmdir()
        shutil.copyfile(draft_vocab_file, tmp / DRAFT_VOCAB_FILE)
        (tmp / RECIPE_FILE).write_text(json.dumps({**recipe_record, "base_fingerprint": fp}, indent=2) + "\n")
    return Path(dst).absolute()
