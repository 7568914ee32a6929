"""The self-contained modeling code of a ``canonlm``-format export: canonlm's own modules, copied at export time into
flat files that transformers' remote-code loader imports with torch and transformers only (no canonlm installed).

:func:`bundle_sources` starts from the two files ``config.json``'s ``auto_map`` names
(:mod:`canonlm.hf.remote.configuration_canonlm`, :mod:`canonlm.hf.remote.modeling_canonlm`), follows every canonlm
import they make -- at module level and inside functions, absolute and relative -- through the model (``arch/``), the
errors and the sequence ops (``ops/``: the pure-PyTorch paths, and the wrappers of fla / Dao's causal-conv1d /
mamba-ssm / flash-attn, which import those libraries only when called on CUDA), and returns the source of each module,
unchanged but for its canonlm imports:

* module ``canonlm.a.b`` becomes the file ``canonlm_a_b.py`` (a package's ``__init__`` too; the two ``auto_map``
  files keep their names); ``from canonlm.a.b import x`` becomes ``from .canonlm_a_b import x``, an imported module
  ``from canonlm.ops import gla as g`` becomes ``from . import canonlm_ops_gla as g``; relative imports inside
  canonlm's packages are resolved the same way;
* :mod:`canonlm.ops.canon._native` (the native CPU Canon kernel: C source compiled on first use) is replaced by
  :mod:`canonlm.hf.remote.native_stub`, so the export's Canon layers run the pure-PyTorch path on the CPU;
* an import of a library other than torch, transformers and the standard library (``flash_attn``, ...) that is not
  already inside a ``try`` block is wrapped in ``try: ... except ImportError: raise`` -- the same behaviour, but
  transformers' ``check_imports`` (``dynamic_module_utils.get_imports``, 4.51 and 5.x) skips imports inside ``try``
  blocks, so an optional kernel library is never demanded from the user;
* every file ends with ``CANONLM_SOURCE = "<module>"``, and ``modeling_canonlm.py`` ends with one ``from .<file>
  import CANONLM_SOURCE`` line per file. transformers copies into its module cache the files a local modeling file
  imports with ``from .<name> import`` (``get_relative_imports``; 4.51 only those of the modeling file itself, 5.x
  recursively), so naming each file there brings all of them.

Each file starts with a comment naming its source module and the canonlm version. Raises :class:`BundleError` (at
export time, before anything is written) when a canonlm import cannot be rewritten (``import canonlm.x`` without
``as``, an import sharing its line with other code) or two modules would share a file name.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import canonlm

PKG = Path(canonlm.__file__).resolve().parent
ROOTS = ("canonlm.hf.remote.configuration_canonlm", "canonlm.hf.remote.modeling_canonlm")
KEEP_NAMES = {
    "canonlm.hf.remote.configuration_canonlm": "configuration_canonlm",
    "canonlm.hf.remote.modeling_canonlm": "modeling_canonlm",
}
STUBS = {"canonlm.ops.canon._native": "canonlm.hf.remote.native_stub"}
MAIN = "canonlm.hf.remote.modeling_canonlm"
#: what an export needs besides the standard library
REQUIRED = frozenset({"torch", "transformers"})
SOURCE_NAME = "CANONLM_SOURCE"


class BundleError(RuntimeError):
    """A canonlm module cannot be bundled (see the module docstring)."""


def _path(module: str) -> tuple[Path, bool] | None:
    """``(source file, is a package)`` of a canonlm module, or None when no such module exists."""
    rel = Path(*module.split(".")[1:])
    if (PKG / rel / "__init__.py").is_file():
        return PKG / rel / "__init__.py", True
    if (PKG / rel).with_suffix(".py").is_file() and module != "canonlm":
        return (PKG / rel).with_suffix(".py"), False
    return None


def _is_module(name: str) -> bool:
    return name in STUBS or _path(name) is not None


def file_stem(module: str) -> str:
    """The flat file name (without ``.py``) of a bundled module (``canonlm.ops.gla._fla`` ->
    ``canonlm_ops_gla__fla``)."""
    return KEEP_NAMES.get(module, module.replace(".", "_"))


def _absolute(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module name an ``ImportFrom`` names (relative imports resolved against ``module``'s package)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_pkg else module.split(".")[:-1]
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _alias(a: ast.alias) -> str:
    return a.name if a.asname is None else f"{a.name} as {a.asname}"


def _rewrite_import(module: str, is_pkg: bool, node: ast.stmt) -> tuple[list[str], list[str]] | None:
    """``(replacement statements, canonlm modules needed)`` for an import of canonlm code, None for any other."""
    if isinstance(node, ast.Import):
        if not any(a.name.split(".")[0] == "canonlm" for a in node.names):
            return None
        stmts, deps = [], []
        for a in node.names:
            if a.name.split(".")[0] != "canonlm" or a.asname is None or not _is_module(a.name):
                raise BundleError(
                    f"{module}: `import {_alias(a)}` cannot be bundled (write `from canonlm.x import "
                    "y` or `import canonlm.x as y`)"
                )
            stmts.append(f"from . import {file_stem(a.name)} as {a.asname}")
            deps.append(a.name)
        return stmts, deps
    target = _absolute(module, is_pkg, node)
    if target.split(".")[0] != "canonlm":
        return None
    stmts, deps, attrs = [], [], []
    for a in node.names:
        sub = f"{target}.{a.name}"
        if a.name != "*" and _is_module(sub):  # an imported module: `from . import <file> as <name>`
            stmts.append(f"from . import {file_stem(sub)} as {a.asname or a.name}")
            deps.append(sub)
        else:  # a name defined in module `target`
            attrs.append(_alias(a))
    if attrs:
        if not _is_module(target):
            raise BundleError(f"{module}: imports {', '.join(attrs)} from {target}, which is not a canonlm module")
        stmts.insert(0, f"from .{file_stem(target)} import {', '.join(attrs)}")
        deps.insert(0, target)
    return stmts, deps


def _optional_imports(tree: ast.AST) -> list[ast.stmt]:
    """Imports of libraries beyond :data:`REQUIRED` and the standard library that transformers' ``get_imports``
    would see: outside any ``try`` block (relative imports and canonlm are not libraries)."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Try):
            return
        if isinstance(node, ast.Import):
            tops = {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops = {node.module.split(".")[0]}
        else:
            tops = set()
        if tops - REQUIRED - set(sys.stdlib_module_names) - {"canonlm"}:
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _rewrite(
    module: str, source: str, is_pkg: bool, origin: str, stands_in: str | None = None
) -> tuple[str, list[str]]:
    """``(bundled text of one module, canonlm modules it needs)``; ``stands_in``: the module a stub replaces."""
    tree = ast.parse(source, filename=origin)
    lines = source.splitlines()
    edits: list[tuple[int, int, list[str]]] = []  # (first line, last line (1-based, inclusive), new lines)
    deps: list[str] = []

    def span(node: ast.stmt) -> tuple[int, int, str]:
        first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
        indent = first[: node.col_offset]
        tail = last[node.end_col_offset :].strip()
        if indent.strip() or (tail and not tail.startswith("#")):
            raise BundleError(
                f"{origin}:{node.lineno}: an import that shares its line with other code cannot be "
                "bundled; put it on a line of its own"
            )
        return node.lineno, node.end_lineno, indent

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            got = _rewrite_import(module, is_pkg, node)
            if got is not None:
                stmts, needed = got
                first, last, indent = span(node)
                edits.append((first, last, [indent + s for s in stmts]))
                deps += needed
    for node in _optional_imports(tree):
        first, last, indent = span(node)
        body = ["    " + ln for ln in lines[first - 1 : last]]
        edits.append(
            (
                first,
                last,
                [
                    indent + "try:  # optional library: transformers' check_imports skips try blocks",
                    *body,
                    indent + "except ImportError:",
                    indent + "    raise",
                ],
            )
        )
    for first, last, new in sorted(edits, reverse=True):
        lines[first - 1 : last] = new
    version = getattr(canonlm, "__version__", "?")
    what = f"{module}, standing in for {stands_in}" if stands_in else module
    head = [
        f"# Bundled by canonlm {version} (python -m canonlm.export) from {what}: canonlm's own code, its",
        "# canonlm imports made relative to this folder (canonlm.hf.remote.bundle). Re-export to update; do not",
        "# edit.",
    ]
    text = "\n".join(head + lines) + f"\n\n{SOURCE_NAME} = {(stands_in or module)!r}\n"
    return text, deps


def bundle_sources() -> dict[str, str]:
    """``{file name: text}`` of every file the modeling code of an export needs (module docstring), in a stable
    order (the two ``auto_map`` files first). Raises BundleError."""
    done: dict[str, str] = {}
    todo = list(ROOTS)
    while todo:
        mod = todo.pop(0)
        if mod in done:
            continue
        src_mod = STUBS.get(mod, mod)
        found = _path(src_mod)
        if found is None:
            raise BundleError(f"{mod}: no such canonlm module")
        path, is_pkg = found
        text, deps = _rewrite(
            src_mod,
            path.read_text(encoding="utf-8"),
            is_pkg,
            str(path.relative_to(PKG.parent)),
            stands_in=mod if src_mod != mod else None,
        )
        done[mod] = text
        todo += [d for d in deps if d not in done and d not in todo]
    stems: dict[str, str] = {}
    for mod in done:
        other = stems.setdefault(file_stem(mod), mod)
        if other != mod:
            raise BundleError(f"modules {other} and {mod} would share the file {file_stem(mod)}.py")
    rest = [m for m in done if m not in ROOTS]
    manifest = [
        "",
        "# Every file of this bundle, imported by name: transformers copies into its module cache the",
        "# files a local modeling file imports as `from .<file> import ...` (4.51: only those this file",
        "# names).",
    ]
    manifest += [
        f"from .{file_stem(m)} import {SOURCE_NAME} as _bundled_{i}  # noqa: E402"
        for i, m in enumerate(ROOTS[:1] + tuple(rest))
    ]
    manifest += ["BUNDLED = (", *(f"    _bundled_{i}," for i in range(1 + len(rest))), ")"]
    done[MAIN] += "\n".join(manifest) + "\n"
    return {f"{file_stem(m)}.py": done[m] for m in (*ROOTS, *rest)}
