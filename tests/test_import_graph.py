"""The package's modules form no import cycle, counting the imports inside functions too: a cycle
hidden behind a lazy import still couples two modules both ways (bench/gamma.py and
bench/speculative.py once did). Reads files only."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_files() -> dict:
    mods = {}
    for base, prefix in ((ROOT / "m2r2_jax", ("m2r2_jax",)), (ROOT / "kernels", ("m2r2_jax", "kernels"))):
        for p in base.rglob("*.py"):
            parts = prefix + p.relative_to(base).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def import_graph() -> dict:
    """{module: modules of the package it imports anywhere in its file}."""
    mods = _module_files()
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("m2r2_jax"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    graph[m].add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods)
        graph[m] = {t for t in graph[m] if t in mods and t != m}
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert "m2r2_jax.bench.speculative" in graph["m2r2_jax.bench.gamma_tuning"]
    assert cycles(graph) == []
