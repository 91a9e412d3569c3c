"""Static checks of every Python file the project ships or runs: pyflakes finds names used but
never defined (a crash waiting on a code path no test reaches), imports and variables left unused."""

from pathlib import Path

from pyflakes import api as pyflakes_api
from pyflakes.reporter import Reporter

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("m2r2_jax", "kernels", "configs", "launch", "colab", "tests")


def test_pyflakes_finds_nothing():
    class Collect(Reporter):
        def __init__(self):
            self.lines = []

        def unexpectedError(self, filename, msg):
            self.lines.append(f"{filename}: {msg}")

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.lines.append(f"{filename}:{lineno}: {msg}")

        def flake(self, message):
            self.lines.append(str(message))

    report = Collect()
    files = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))
    assert len(files) > 100
    for path in files:
        pyflakes_api.checkPath(str(path), report)
    assert not report.lines, "\n".join(report.lines)
