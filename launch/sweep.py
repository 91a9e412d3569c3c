#!/usr/bin/env python3
"""Expand an ml_collections sweep into runs and start them locally or through the launchers.

    python launch/sweep.py configs/sweeps/tiny_rate_rank.py --dry-run --set fixed.base_checkpoint=DIR
    python launch/sweep.py SWEEP.py --launcher local [--parallel 2]
    python launch/sweep.py SWEEP.py --launcher tpu      # launch/tpu_vm.sh run ..., one run after another
    python launch/sweep.py SWEEP.py --launcher slurm    # one sbatch launch/slurm_gpu.sbatch job per run
    python launch/sweep.py SWEEP.py --set fixed.base_checkpoint=DIR --set axes.m2r2.rate=[3,7]

A sweep file's `get_config()` returns: name, verb (an `m2r2` verb that takes --config and
--workdir: pretrain or distill), config (its config file), root (parent of the run workdirs),
fixed (nested sections of values for every run), axes (nested sections of value lists; the runs
are their product) and flags (extra verb flags). Before anything starts, every run's config is built with its
overrides and validated like the verb would, so a bad value fails the whole sweep up front, naming
the run and the field. `ROOT/NAME/sweep.json` lists every run: its overrides, workdir and command.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERBS = ("pretrain", "distill")
LAUNCHERS = ("local", "tpu", "slurm")


class SweepError(Exception):
    pass


def load_py_config(path):
    """`get_config()` of a config or sweep file; its own errors become one SweepError line."""
    from m2r2_jax.errors import M2R2Error
    from m2r2_jax.training.config import load_config_file

    try:
        return load_config_file(path)
    except M2R2Error as e:
        raise SweepError(str(e)) from None
    except Exception as e:  # the user's file
        raise SweepError(f"cannot load {path}: {type(e).__name__}: {e}") from None


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def flatten(section, prefix: str = "") -> dict:
    """Nested sections -> {"m2r2.rate": value}; lists are values, not sections."""
    out = {}
    for key, value in (section.items() if section is not None else ()):
        name = f"{prefix}{key}"
        if hasattr(value, "items"):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def apply_sets(sweep, sets) -> dict:
    """The sweep as plain data, with `--set fixed.FIELD=VALUE` / `--set axes.FIELD=[...]` /
    `--set root=DIR` applied (values parsed as JSON where they parse)."""
    plain = {k: sweep[k] for k in ("name", "verb", "config", "root") if k in sweep}
    plain["fixed"] = flatten(sweep.get("fixed"))
    plain["axes"] = flatten(sweep.get("axes"))
    plain["flags"] = list(sweep.get("flags", []) or [])
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq:
            raise SweepError(f"--set {item!r} is invalid: expected KEY=VALUE")
        head, _, field = key.partition(".")
        value = _parse_value(value)
        if head in ("fixed", "axes") and field:
            plain[head][field] = value
        elif head in ("name", "root", "config", "verb") and not field:
            plain[head] = value
        else:
            raise SweepError(f"--set {item!r} is invalid: expected fixed.FIELD, axes.FIELD, name, root, config or verb")
    return plain


def _run_name(combo: dict) -> str:
    return "_".join(f"{k.split('.')[-1]}{v}" for k, v in combo.items()) or "run"


def expand(sweep) -> list:
    """One dict per run: name, overrides (fixed + this combination), workdir, argv."""
    for field in ("name", "verb", "config", "root"):
        if field not in sweep:
            raise SweepError(f"the sweep has no field {field!r}")
    if sweep["verb"] not in VERBS:
        raise SweepError(f"verb={sweep['verb']!r} is invalid: expected one of {', '.join(VERBS)}")
    axes = sweep["axes"]
    for field, values in axes.items():
        if not isinstance(values, (list, tuple)) or not values:
            raise SweepError(f"axis {field!r} is invalid: expected a non-empty list of values")
    fixed = sweep["fixed"]
    runs = []
    for values in itertools.product(*axes.values()):
        combo = dict(zip(axes, values))
        overrides = {**fixed, **combo}
        name = _run_name(combo)
        workdir = str(Path(sweep["root"]) / sweep["name"] / name)
        argv = ["m2r2", sweep["verb"], f"--config={sweep['config']}"]
        argv += [f"--config.{k}={_flag_value(v)}" for k, v in overrides.items()]
        argv += ["--workdir", workdir] + sweep["flags"]
        runs.append({"name": name, "overrides": overrides, "workdir": workdir, "argv": argv})
    return runs


def _flag_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_flag_value(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return str(v)


def validate(sweep, runs) -> None:
    """Build every run's config with its overrides and validate it as the verb would."""
    from m2r2_jax.errors import M2R2Error

    if sweep["verb"] == "distill" and not sweep["fixed"].get("base_checkpoint"):
        raise SweepError("fixed.base_checkpoint is empty: distillation needs the base model directory "
                         "(--set fixed.base_checkpoint=DIR)")
    for run in runs:
        cfg = load_py_config(sweep["config"])
        try:
            for field, value in run["overrides"].items():
                _assign(cfg, field, value)
            if sweep["verb"] == "distill":
                from m2r2_jax.m2r2.distill import validate_distill

                validate_distill(cfg, _base_config(cfg.base_checkpoint))
            else:
                from m2r2_jax.training.config import validate_config

                validate_config(cfg)
        except (M2R2Error, KeyError, AttributeError, TypeError, ValueError) as e:
            raise SweepError(f"run {run['name']}: {e}") from None


def _base_config(directory):
    """The base model's config when its checkpoint exists (then base-dependent M2R2 values, e.g.
    branch_layer < n_layers, are checked too), else None."""
    if not directory or not Path(directory).is_dir():
        return None
    from m2r2_jax.models.checkpoint import load_config

    return load_config(directory)


def _assign(cfg, field: str, value) -> None:
    *parents, leaf = field.split(".")
    node = cfg
    for p in parents:
        if p not in node:
            raise KeyError(f"config has no field {field!r}")
        node = node[p]
    if leaf not in node:
        raise KeyError(f"config has no field {field!r}")
    node[leaf] = tuple(value) if isinstance(node[leaf], tuple) and isinstance(value, list) else value


def launcher_command(launcher: str, argv: list) -> list:
    if launcher == "local":  # this interpreter's m2r2, whether or not its venv is on PATH
        return [sys.executable, "-m", "m2r2_jax.cli.main", *argv[1:]]
    if launcher == "tpu":
        return ["bash", str(HERE / "tpu_vm.sh"), "run", shlex.join(argv)]
    return ["sbatch", str(HERE / "slurm_gpu.sbatch"), *argv]


def write_manifest(sweep, runs, launcher) -> Path:
    out = Path(sweep["root"]) / sweep["name"]
    out.mkdir(parents=True, exist_ok=True)
    from m2r2_jax.atomic import write_text_atomic

    manifest = {**{k: sweep[k] for k in ("name", "verb", "config")}, "launcher": launcher,
                "runs": [{**r, "command": launcher_command(launcher, r["argv"])} for r in runs]}
    return write_text_atomic(out / "sweep.json", json.dumps(manifest, indent=2, default=str))


def start(runs, launcher: str, parallel: int) -> int:
    """Run (local) or submit every run; returns how many failed."""
    def one(run):
        cmd = launcher_command(launcher, run["argv"])
        print(f"[sweep] {run['name']}: {shlex.join(cmd)}", flush=True)
        try:
            return subprocess.run(cmd).returncode
        except FileNotFoundError:
            print(f"sweep: error: {cmd[0]} not found (is the launcher installed on this machine?)", file=sys.stderr)
            return 127

    if launcher == "local" and parallel > 1:
        with ThreadPoolExecutor(parallel) as pool:
            codes = list(pool.map(one, runs))
    else:
        codes = [one(r) for r in runs]
    failed = [r["name"] for r, c in zip(runs, codes) if c != 0]
    if failed:
        print(f"[sweep] {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return len(failed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", help="sweep file (get_config())")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="local")
    ap.add_argument("--parallel", type=int, default=1, help="local: runs at once")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a sweep field")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the commands; start nothing")
    args = ap.parse_args(argv)
    try:
        if args.parallel < 1:
            raise SweepError(f"--parallel={args.parallel} is invalid: expected a positive integer")
        sweep = apply_sets(load_py_config(args.sweep), args.set)
        runs = expand(sweep)
        validate(sweep, runs)
    except SweepError as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:  # local runs print as the m2r2 command they are
        for r in runs:
            print(shlex.join(r["argv"] if args.launcher == "local" else launcher_command(args.launcher, r["argv"])))
        return 0
    manifest = write_manifest(sweep, runs, args.launcher)
    print(f"[sweep] {len(runs)} runs; manifest {manifest}", flush=True)
    return 1 if start(runs, args.launcher, args.parallel) else 0


if __name__ == "__main__":
    sys.exit(main())
