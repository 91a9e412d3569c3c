"""Sweep: M2R2 rate x LoRA rank x branch layer on the embedded tiny dense base.

    python launch/sweep.py configs/sweeps/tiny_rate_rank.py --dry-run --set fixed.base_checkpoint=DIR
    python launch/sweep.py configs/sweeps/tiny_rate_rank.py --launcher local --set fixed.base_checkpoint=DIR

Every combination of `axes` becomes one run of `verb` with `--config=<config>` plus one
`--config.<field>=<value>` per axis and per `fixed` entry (nested sections name the field:
axes.m2r2.rate -> --config.m2r2.rate), in its own workdir under `root/name`.
"""

import ml_collections


def get_config():
    s = ml_collections.ConfigDict()
    s.name = "tiny_rate_rank"
    s.verb = "distill"
    s.config = "configs/m2r2/tiny_dense.py"
    s.root = "runs/sweeps"
    s.fixed = {"train": {"steps": 200}, "router_train": {"steps": 60}, "base_checkpoint": ""}
    s.axes = {"m2r2": {"rate": [3, 5, 7], "lora_rank": [8, 16], "branch_layer": [2, 4]}}
    s.flags = []  # extra verb flags, e.g. ["--mesh", "fsdp=-1"]
    return s
