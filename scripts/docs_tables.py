"""The result tables of README.md and docs/results.md, generated from the runs committed under ``docs/results/``.

    python scripts/docs_tables.py                  # rewrite every generated block from docs/results/
    python scripts/docs_tables.py --check          # exit 1 and show the difference when a block is stale
    python scripts/docs_tables.py --collect <sweep or run dirs...> --into docs/results/<name>

A generated block is the text between two HTML comments in a markdown file (invisible when rendered)::

    <!-- table: runs docs/results/depth_search --keys task.N,model.size,canon.set,optim.lr,seed --k 1,2 -->
    ...generated, never edited by hand...
    <!-- /table -->

Three kinds:

* ``report <folder> [--rows KEY] [--cols KEY] [--k K1,K2] [--best-of KEYS]``: the table ``python -m
  canonlm.train.report`` prints for the runs in ``<folder>`` (one per setting, each cell the best of its
  ``--best-of`` runs, the budget and protocol line under it), in a code block.
* ``runs <folder> --keys K1,K2,... [--k K1,K2,...]``: a markdown table with one line per run: the config values of
  ``--keys`` (as ``hparams.json`` holds them), the steps, the training time (``results.json`` ``train_time_s``), and
  the test accuracy in percent at each hop count of ``--k`` (Depo ``by_group``), else the run's headline: the
  generation accuracy (Brevo, Lano), bits per parameter (Capo) or the overall answer accuracy; for Lano also the
  KL divergence to the grammar's exact next-symbol law, beside that of a model uniform over the vocabulary.

* ``atlas <png> <skill>=<folder>[:K1,K2][@KEY=VALUE] ...`` (``<skill>=-`` for a skill not run yet): the atlas figure of
  :mod:`canonlm.train.atlas` (the skills side by side, no Canon against Canon-ABCD under NoPE and RoPE): the picture
  (written to ``<png>``, relative to the repository root, as the README links it), its caption and a table of every
  number it draws. ``--check`` also fails when the PNG is missing or the numbers it embeds differ from the runs.

``--collect`` copies each finished run's ``results.json`` and ``hparams.json`` (small: a few KB) into
``<into>/<run name>/``, without the keys that only say where the run's files were (``paths``, ``logger``,
``trainer.default_root_dir``, ``callbacks.checkpoint.dirpath``); a run already there is refused, nothing is
overwritten. The tables are computed with the report's own rules (:mod:`canonlm.train.cells`), so a number in the
docs is the number the report prints for the committed runs.

Exit codes: 0 done (``--check``: every block up to date); 1 ``--check`` found a stale block; 2 bad arguments (an
unknown block kind, a folder without runs, an existing run in ``--into``), one message, nothing written.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FILES = ("README.md", "docs/results.md")
BLOCK = re.compile(r"(<!-- table: (?P<spec>.*?) -->\n)(?P<body>.*?)(<!-- /table -->)", flags=re.S)
# keys that only say where a run's files were: left out of the committed hparams.json
WHERE = ("paths", "logger", "trainer.default_root_dir", "callbacks.checkpoint.dirpath")


# figures rendered by ``atlas`` blocks in this process: {path: (png bytes, the numbers it embeds)}
FIGURES: dict[Path, tuple[bytes, dict[str, Any]]] = {}


class Usage(Exception):
    """A bad block spec or argument; the message names it."""


def _drop(cfg: dict[str, Any], dotted: str) -> None:
    *path, last = dotted.split(".")
    node = cfg
    for part in path:
        node = node.get(part)
        if not isinstance(node, dict):
            return
    node.pop(last, None)


def collect(sources: list[Path], into: Path) -> list[Path]:
    """Copy the finished runs below ``sources`` (``results.json``, ``hparams.json`` and ``metrics.jsonl``) into
    ``into/<run name>/``;
    returns the new folders. Raises :class:`Usage` (no finished run, a run name already in ``into``, or two runs
    with one name) before anything is written."""
    from canonlm.train.cells import load_runs

    runs = [r for src in sources for r in load_runs(src)]
    if not runs:
        raise Usage(f"no finished run (results.json) below {', '.join(map(str, sources))}")
    names = [Path(r["dir"]).name for r in runs]
    dup = sorted({n for n in names if names.count(n) > 1})
    clash = sorted(n for n in names if (into / n).exists())
    if dup or clash:
        what = "run names repeat: " + ", ".join(dup) if dup else "already holds " + ", ".join(clash)
        raise Usage(f"--into {into}: {what}; nothing written")
    made = []
    for r, name in zip(runs, names):
        src = Path(r["dir"])
        dst = into / name
        dst.mkdir(parents=True)
        shutil.copyfile(src / "results.json", dst / "results.json")
        hp = src / "hparams.json"
        if hp.is_file():
            cfg = json.loads(hp.read_text())
            for key in WHERE:
                _drop(cfg, key)
            (dst / "hparams.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
        if (src / "metrics.jsonl").is_file():  # the logged series: learning curves, throughput
            shutil.copyfile(src / "metrics.jsonl", dst / "metrics.jsonl")
        made.append(dst)
    return made


def _report_block(args: list[str]) -> str:
    from canonlm.train import report

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = report.main(args)
    if code != 0:
        raise Usage(f"report {' '.join(args)} exited with {code}")
    text = out.getvalue().rstrip("\n")
    return f"```\n{text}\n```\n"


def _pct(x: Any) -> str:
    return "n/a" if not isinstance(x, (int, float)) or x != x else f"{100 * x:.1f}"


def _runs_block(folder: Path, keys: list[str], ks: list[int]) -> str:
    from canonlm.train.cells import label, load_runs, natural_key, value

    runs = sorted(load_runs(folder), key=lambda r: natural_key(Path(r["dir"]).name))
    if not runs:
        raise Usage(f"runs {folder}: no finished run")

    def split_of(r: dict[str, Any]) -> dict[str, Any]:  # the test split's results, else the validation split's
        return r.get("test") or r.get("val") or {}

    kl = any("kl" in (split_of(r).get("generate") or {}) for r in runs)  # Lano: KL beside generation accuracy
    capo = all("bits_per_param" in (split_of(r).get("task_metrics") or {}) for r in runs)  # Capo: bits/param, bits
    head = [
        "run",
        *keys,
        "steps",
        "train s",
        *([f"acc@{k} %" for k in ks] or ["bits / param (bits)" if capo else "acc %"]),
    ]
    head += ["KL (uniform model)"] if kl else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        split = split_of(r)
        by = split.get("by_group") or {}
        if ks:
            accs = [_pct((by.get(str(k)) or {}).get("acc")) for k in ks]
        elif "bits_per_param" in (split.get("task_metrics") or {}):
            m = split["task_metrics"]
            accs = [
                f"{m['bits_per_param']:.4g} ({m['bits']:,.0f})" if capo else f"{m['bits_per_param']:.4g} bits/param"
            ]
        else:  # the run's own headline: generation accuracy (Brevo, Lano), else the answer accuracy
            accs = [_pct((split.get("generate") or split.get("overall") or {}).get("acc"))]
        t = r.get("train_time_s")
        cells = [
            Path(r["dir"]).name,
            *(label(k, value(r, k)) for k in keys),
            str(r.get("steps", "n/a")),
            f"{t:.0f}" if isinstance(t, (int, float)) else "n/a",
            *accs,
        ]
        if kl:
            g = split.get("generate") or {}
            cells.append(f"{g['kl']:.3g} ({g['kl_uniform']:.3g})" if isinstance(g.get("kl"), (int, float)) else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render(spec: str, root: Path | None = None) -> str:
    """The body of the block whose spec is ``spec`` (module docstring), its folders relative to ``root`` (default:
    the repository). Raises :class:`Usage`."""
    root = ROOT if root is None else root
    words = shlex.split(spec)
    if not words or words[0] not in ("report", "runs", "atlas") or len(words) < 2:
        raise Usage(
            f"block spec {spec!r}: allowed: 'report <folder> [report options]', 'runs <folder> --keys ...' "
            "or 'atlas <png> <skill>=<folder>[:K1,K2] ...'"
        )
    if words[0] == "atlas":
        from canonlm.train.atlas import build

        try:
            png, data, md, _ = build(words[2:], root)
        except ValueError as e:
            raise Usage(f"block spec {spec!r}: {e}") from None
        FIGURES[root / words[1]] = (png, data)
        return md.replace("{png}", words[1])
    folder = root / words[1]
    if not folder.is_dir():
        raise Usage(f"block spec {spec!r}: {words[1]} is not a folder")
    if words[0] == "report":
        return _report_block([str(folder), *words[2:]]).replace(str(folder), words[1])
    ap = argparse.ArgumentParser(prog="runs", add_help=False)
    ap.add_argument("--keys", default="")
    ap.add_argument("--k", default="")
    try:
        a = ap.parse_args(words[2:])
        ks = [int(k) for k in a.k.split(",") if k]
    except (SystemExit, ValueError):
        raise Usage(f"block spec {spec!r}: allowed options: --keys K1,K2,... --k 1,2,...") from None
    return _runs_block(folder, [k for k in a.keys.split(",") if k], ks)


def regenerate(text: str, root: Path | None = None) -> str:
    """``text`` with every generated block's body rendered again."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("spec"), root) + m.group(4), text)


def stale_figures() -> list[Path]:
    """The figures of :data:`FIGURES` whose file is missing or embeds other numbers than its runs give now."""
    from canonlm.train.atlas import embedded

    return [path for path, (_, data) in FIGURES.items() if embedded(path) != json.loads(json.dumps(data))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is stale")
    ap.add_argument("--collect", nargs="+", type=Path, metavar="DIR", help="sweep or run folders to copy runs from")
    ap.add_argument("--into", type=Path, help="with --collect: docs/results/<name>")
    ap.add_argument(
        "--files", nargs="+", default=list(FILES), help="markdown files to regenerate (default: %(default)s)"
    )
    args = ap.parse_args(argv)
    FIGURES.clear()
    try:
        if args.collect:
            if args.into is None:
                raise Usage("--collect needs --into docs/results/<name>")
            for d in collect(args.collect, args.into):
                print(d)
            return 0
        stale = []
        new_texts = {}
        for name in args.files:
            path = ROOT / name if not Path(name).is_absolute() else Path(name)
            old = path.read_text()
            new = regenerate(old)
            if new != old:
                stale.append(path)
                new_texts[path] = new
                if args.check:
                    sys.stdout.writelines(
                        difflib.unified_diff(
                            old.splitlines(True), new.splitlines(True), str(path), f"{path} (regenerated)"
                        )
                    )
    except Usage as e:
        print(f"docs_tables: error: {e}", file=sys.stderr)
        return 2
    figures = stale_figures()
    if args.check:
        stale += figures
        if stale:
            print(
                f"docs_tables: stale: {', '.join(map(str, stale))} (run python scripts/docs_tables.py)", file=sys.stderr
            )
        return 1 if stale else 0
    from canonlm.utils.io import atomic_write_bytes

    for path in figures:
        atomic_write_bytes(path, FIGURES[path][0])
        print(f"drew {path}")
    for path, new in new_texts.items():
        path.write_text(new)
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
