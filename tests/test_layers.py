"""The layers of ``src/canonlm``: every import (module level and inside functions, absolute and relative) stays
within what the README's "Layout" table lets its part import, and every part on disk has a row there.

The rule is written once, as that table; this test reads it, so the documentation and the check cannot disagree.
``python tests/test_layers.py`` prints the layer picture: each part, what it may import and what it imports.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "canonlm"
README = ROOT / "README.md"


def _part(name: str) -> str:
    """``ops/`` / ``errors.py`` / ``ops`` -> ``ops`` / ``errors`` (a table cell or a path under src/canonlm)."""
    return name.strip().strip("`").removesuffix("/").removesuffix(".py")


def layout_table(text: str | None = None) -> dict[str, set[str]]:
    """{part: parts it may import} from the README's "Layout" section (the table whose header starts with
    ``| Part |``). ``nothing`` is the empty set."""
    text = README.read_text() if text is None else text
    section = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert section, "README.md has no '## Layout' section"
    rows = [ln for ln in section.group(1).splitlines() if ln.startswith("|")]
    assert rows and rows[0].replace(" ", "").startswith("|Part|"), "the Layout section has no '| Part |' table"
    table: dict[str, set[str]] = {}
    for ln in rows[2:]:  # header, separator
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        assert len(cells) == 3, f"Layout table row with {len(cells)} cells (expected Part | Job | May import): {ln}"
        may = set() if cells[2] == "nothing" else {_part(c) for c in cells[2].split(",")}
        table[_part(cells[0])] = may
    return table


def parts_on_disk() -> set[str]:
    """The top-level modules and packages of src/canonlm (``__init__`` is the package's own module)."""
    return {
        p.stem if p.is_file() else p.name
        for p in PKG.iterdir()
        if (p.is_file() and p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").is_file())
    }


def _imports(path: Path, pkg: Path = PKG) -> list[tuple[int, str, str]]:
    """(line, imported canonlm module, source text) of every import in ``path`` (a module under ``pkg``), at any
    depth of the syntax tree; relative imports are resolved against the module's package. ``from canonlm import x``
    imports ``canonlm.x``."""
    rel = path.relative_to(pkg.parent).with_suffix("").parts  # ("canonlm", "ops", "canon", "__init__")
    package = list(rel[:-1])  # the package a relative import starts from (a package's __init__: itself)
    text = path.read_text()
    out = []
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        src = " ".join(" ".join(lines[node.lineno - 1 : node.end_lineno]).split())
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, src) for a in node.names if a.name.split(".")[0] == "canonlm"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "canonlm":
                continue
            if mod == "canonlm":  # from canonlm import errors
                out += [(node.lineno, f"canonlm.{a.name}", src) for a in node.names]
            else:
                out.append((node.lineno, mod, src))
    return out


def import_graph() -> dict[str, dict[str, list[str]]]:
    """{part: {imported part: ["file:line: import ...", ...]}} over every module of src/canonlm."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG)
        part = _part(rel.parts[0])
        for line, mod, src in _imports(f):
            target = mod.split(".")[1] if "." in mod else ""
            if target and target != part:
                graph[part][target].append(f"src/canonlm/{rel.as_posix()}:{line}: {src}  [{mod}]")
    return graph


def test_every_part_has_a_row_and_every_row_a_part():
    table, disk = layout_table(), parts_on_disk()
    new = sorted(disk - set(table))
    assert not new, (
        f"src/canonlm has {', '.join(new)} but README.md's Layout table has no row for it: add one "
        "(its job and what it may import)"
    )
    gone = sorted(set(table) - disk)
    assert not gone, f"README.md's Layout table lists {', '.join(gone)}, which src/canonlm does not have"
    unknown = sorted({m for may in table.values() for m in may} - set(table))
    assert not unknown, f"the Layout table's 'May import' column names parts without a row: {unknown}"


def test_the_table_is_layered():
    """No two parts may import each other, directly or through others (the table is a partial order)."""
    table = layout_table()

    def reach(start: str) -> set[str]:
        seen, todo = set(), list(table[start])
        while todo:
            p = todo.pop()
            if p not in seen:
                seen.add(p)
                todo += table.get(p, ())
        return seen

    cycles = sorted(p for p in table if p in reach(p))
    assert not cycles, f"the Layout table lets these parts import themselves through others: {cycles}"


def test_no_module_imports_a_part_its_row_does_not_allow():
    table, graph = layout_table(), import_graph()
    bad = []
    for part, targets in sorted(graph.items()):
        for target, where in sorted(targets.items()):
            if target in table.get(part, set()):
                continue
            for w in where:
                bad.append(
                    f"{w}\n    -> {part} may not import {target} (README.md, Layout: {part} may import "
                    f"{', '.join(sorted(table.get(part, set()))) or 'nothing'})"
                )
    assert not bad, "imports that break the layers:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "snippet, expected",
    [
        ("from canonlm.arch.config import ModelConfig\n", "canonlm.arch.config"),
        ("def f():\n    from canonlm.train.run import run\n", "canonlm.train.run"),  # function-local
        ("import canonlm.hf.io as h\n", "canonlm.hf.io"),
        ("from canonlm import eval\n", "canonlm.eval"),
        ("from ...train import run\n", "canonlm.train"),  # relative, from ops/canon/x.py
        ("from .. import attention\n", "canonlm.ops"),
        ("from . import _native\n", "canonlm.ops.canon"),
        (
            "if True:\n    try:\n        import canonlm.data.tasks\n    except ImportError:\n        pass\n",
            "canonlm.data.tasks",
        ),
    ],
)
def test_the_parser_sees_every_form_of_import(tmp_path, snippet, expected):
    """The reader above against hand-written modules: each form of import resolves to the module Python would
    import (relative ones from ``canonlm/ops/canon/x.py``)."""
    pkg = tmp_path / "canonlm"
    f = pkg / "ops" / "canon" / "x.py"
    f.parent.mkdir(parents=True)
    f.write_text(snippet)
    assert [m for _, m, _ in _imports(f, pkg)] == [expected]


def test_the_table_reader_on_a_small_table():
    text = (
        "# x\n## Layout\nprose\n\n| Part | Job | May import |\n|---|---|---|\n| `errors.py` | e | nothing |\n"
        "| `ops/` | o | `errors` |\n| `arch/` | a | `errors`, `ops` |\n\n## Next\n| Part | Job | May import |\n"
    )
    assert layout_table(text) == {"errors": set(), "ops": {"errors"}, "arch": {"errors", "ops"}}


if __name__ == "__main__":  # the layer picture, from the table and the imports found
    table, graph = layout_table(), import_graph()
    order = list(table)
    for part, may in table.items():
        uses = sorted(graph.get(part, {}), key=lambda p: order.index(p) if p in order else len(order))
        print(
            f"{part}: may import {', '.join(sorted(may, key=order.index)) or 'nothing'}; "
            f"imports {', '.join(uses) or 'nothing'}"
        )
