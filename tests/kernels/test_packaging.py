"""kernels/ installs as m2r2_jax.kernels only: never importable as a bare top-level `kernels`, and
pyproject's explicit package list (needed for that mapping) names every package folder."""

import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    assert cfg["package-dir"]["m2r2_jax.kernels"] == "kernels"
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "m2r2_jax").rglob("__init__.py")}
    found |= {"m2r2_jax." + ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kernels").rglob("__init__.py")}
    missing = sorted(found - listed)
    assert not missing, f"add these packages to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_installed_import_path(tmp_path):
    # A bare `kernels` may exist as another distribution (Hugging Face's, a dependency of recent
    # transformers); what must never happen is that it is this repository's kernels/ folder.
    ours = str(ROOT / "kernels")
    code = ("import importlib.util as u, m2r2_jax.kernels as k\n"
            "s = u.find_spec('kernels')\n"
            "where = [] if s is None else [s.origin or ''] + list(s.submodule_search_locations or [])\n"
            f"assert not any(w.startswith({ours!r}) for w in where), 'bare kernels importable'\n"
            "print(k.residual_rate_update.__module__)")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "m2r2_jax.kernels.residual_rate.op"
