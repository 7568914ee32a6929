"""The atlas: the paper's skills side by side, each as no Canon against Canon-ABCD under NoPE and RoPE, drawn from
committed runs (Part 4.1, Fig. 7 and Results 2-5 read across tasks).

    python -m canonlm.train.atlas --out docs/figures/atlas.png depth=docs/results/mini_depth:2,1 \\
        copy=docs/results/mini_copy breadth=- manipulation=- structure=- capacity=-

A panel is ``skill=<folder of runs>[:K1,K2][@KEY=VALUE]`` (``:K1,K2``: Depo's hop counts, as ``--k`` of
``canonlm.train.report``: the cell is acc@K1; ``@KEY=VALUE``: only the runs whose config has that value, for a sweep
with a third axis, e.g. Capo's ``@task.N=1000``) or ``skill=-`` (no runs yet: a grey panel that names the skill's
preset). Skills: :data:`SKILLS`. Each
cell is the best run of its (Canon set, positions) over the learning rates and seeds it holds -- the rules of
``canonlm.train.report`` (:func:`canonlm.train.cells.tables`, rows ``canon.set``, columns ``pos.type``), so a number
here is the number the report prints for those runs. The PNG embeds the numbers it draws (tEXt chunk
``canonlm-atlas``, JSON), so ``scripts/docs_tables.py --check`` can tell a picture that no longer matches its runs.

Errors: ``ValueError`` for an unknown skill, a malformed panel, a folder without finished runs, or runs that do not
form one (Canon set x positions) table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from canonlm.train.cells import BEST_OF, load_runs, tables, value
from canonlm.train.figures import ATLAS_COL_NAMES, ATLAS_COLS, ATLAS_ROW_NAMES, ATLAS_ROWS, atlas as draw_atlas

#: skill -> (task, its mini preset), in the atlas's order (the paper's Fig. 7: depth, breadth, manipulation,
#: structure, capacity; full copy, Fig. 5, last and optional).
SKILLS: dict[str, tuple[str, str]] = {
    "depth": ("Depo", "mini/depth"),
    "breadth": ("Brevo", "mini/breadth"),
    "manipulation": ("Mano", "mini/manipulation"),
    "structure": ("Lano", "mini/structure"),
    "capacity": ("Capo", "mini/capacity"),
    "copy": ("full copy", "mini/copy"),
}
KEY = "canonlm-atlas"  # the PNG tEXt key of the embedded numbers


def parse_panel(spec: str) -> tuple[str, str | None, tuple[int, int] | None, tuple[str, str] | None]:
    """``"skill=folder[:K1,K2][@KEY=VALUE]"`` or ``"skill=-"`` -> (skill, folder or None, (K1, K2) or None,
    (KEY, VALUE) or None). ValueError."""
    skill, sep, rest = spec.partition("=")
    if not sep or skill not in SKILLS:
        raise ValueError(
            f"panel {spec!r}: allowed: <skill>=<folder>[:K1,K2][@KEY=VALUE] or <skill>=-, skill one of "
            f"{', '.join(SKILLS)}"
        )
    if rest == "-":
        return skill, None, None, None
    rest, at, cond = rest.partition("@")
    where = None
    if at:
        key, eq, val = cond.partition("=")
        if not eq or not key or not val:
            raise ValueError(f"panel {spec!r}: @{cond} must be KEY=VALUE, e.g. @task.N=1000")
        where = (key, val)
    folder, _, k = rest.partition(":")
    ks = None
    if k:
        try:
            ks = tuple(int(x) for x in k.split(","))
        except ValueError:
            ks = ()
        if len(ks) != 2 or min(ks) < 1:
            raise ValueError(f"panel {spec!r}: :{k} must be two positive hop counts, e.g. :2,1")
    return skill, folder, ks, where


def panel(
    skill: str, folder: Path | None, ks: tuple[int, int] | None = None, where: tuple[str, str] | None = None
) -> dict[str, Any]:
    """One panel: ``skill``, ``task``, ``preset``, ``metric``, ``bits``, ``cells`` ({canon label: {pos label: value
    in % (bits per parameter for Capo) or None}}; None without runs), ``protocol`` (budget, learning rates and seeds
    the cells are the best of, and ``where``'s KEY=VALUE; None without runs) and ``runs`` (finished runs). ``where``:
    (KEY, VALUE) keeps the runs whose config value of KEY prints as VALUE. ValueError (see the module docstring)."""
    task, preset = SKILLS[skill]
    if folder is None:
        return {
            "skill": skill,
            "task": task,
            "preset": preset,
            "metric": "not run yet",
            "bits": False,
            "cells": None,
            "protocol": None,
            "runs": 0,
        }
    runs = load_runs(folder)
    if where is not None:
        kept = [r for r in runs if str(value(r, where[0])) == where[1]]
        if not kept:
            seen = sorted({str(value(r, where[0])) for r in runs})
            raise ValueError(f"{skill}: no run below {folder} has {where[0]}={where[1]} (they have: {', '.join(seen)})")
        runs = kept
    if ks is not None:
        for r in runs:
            r["report_k"] = ks
    ts = tables(runs, "canon.set", "pos.type", BEST_OF)
    if not ts:
        raise ValueError(f"{skill}: no finished run below {folder}")
    if len(ts) > 1:
        titles = "; ".join(t["title"] for t in ts)
        raise ValueError(
            f"{skill}: the runs below {folder} form {len(ts)} settings ({titles}), not one (Canon set x "
            "positions) table"
        )
    t = ts[0]
    kinds = {e["kind"] for row in t["cells"].values() for e in row.values()}
    kind = kinds.pop() if len(kinds) == 1 else "mixed"
    bits = kind == "bits per parameter"
    first = kind.split(" / ")[0].replace(" (%)", "") + ("" if bits else " (%)")
    cells: dict[str, dict[str, float | None]] = {}
    for r in ATLAS_ROWS:
        for c in ATLAS_COLS:
            e = t["cells"].get(r, {}).get(c)
            v = None if e is None or e["acc"][0] != e["acc"][0] else float(e["acc"][0]) * (1 if bits else 100)
            cells.setdefault(r, {})[c] = None if v is None else round(v, 4 if bits else 1)
    n = sum(e["runs"] for row in t["cells"].values() for e in row.values())
    return {
        "skill": skill,
        "task": task,
        "preset": preset,
        "metric": first,
        "bits": bits,
        "cells": cells,
        "protocol": f"{skill}{'' if where is None else f' ({where[0]}={where[1]})'}: {t['protocol']['text']}",
        "runs": n,
    }


def build(specs: list[str], root: Path) -> tuple[bytes, dict[str, Any], str, dict[str, Any]]:
    """(png bytes, data, markdown, info) of the atlas of ``specs`` (folders relative to ``root``). ``data``: the
    panels (what the PNG embeds); the markdown holds the picture's link placeholder ``{png}``, its caption and a
    table of every number drawn; ``info``: :func:`canonlm.train.figures.atlas`'s (cells with probe pixels)."""
    panels = []
    for spec in specs:
        skill, folder, ks, where = parse_panel(spec)
        panels.append(panel(skill, None if folder is None else root / folder, ks, where))
    done = [p for p in panels if p["cells"] is not None]
    missing = [p["skill"] for p in panels if p["cells"] is None]
    caption = (
        "Each cell: the best run of its (Canon set, positions) on the test split. "
        + " ".join(p["protocol"] + "." for p in done)
        + (f" Not run yet: {', '.join(missing)}." if missing else "")
    )
    data = {
        "panels": [{k: p[k] for k in ("skill", "task", "preset", "metric", "bits", "cells", "runs")} for p in panels],
        "caption": caption,
    }
    png, info = draw_atlas(
        panels,
        title="canonlm atlas: what Canon-ABCD adds to each skill (CPU scale)",
        caption=caption,
        text={KEY: json.dumps(data, sort_keys=True)},
    )
    head = (
        "| skill | task (preset) | metric | "
        + " | ".join(f"{ATLAS_ROW_NAMES[r]}, {ATLAS_COL_NAMES[c]}" for c in ATLAS_COLS for r in ATLAS_ROWS)
        + " |"
    )
    lines = ["![canonlm atlas]({png})", "", caption, "", head, "|" + "---|" * (3 + len(ATLAS_ROWS) * len(ATLAS_COLS))]
    for p in panels:
        vals = [
            "-"
            if p["cells"] is None
            else (
                "n/a"
                if p["cells"][r][c] is None
                else (f"{p['cells'][r][c]:#.3g}" if p["bits"] else f"{p['cells'][r][c]:.1f}")
            )
            for c in ATLAS_COLS
            for r in ATLAS_ROWS
        ]
        planned = ", planned" if p["cells"] is None else ""
        lines.append(
            f"| {p['skill']} | {p['task']} (`experiment={p['preset']}`{planned}) | {p['metric']} | "
            + " | ".join(vals)
            + " |"
        )
    return png, data, "\n".join(lines) + "\n", info


def embedded(path: Path) -> dict[str, Any] | None:
    """The numbers a PNG written by :func:`build` embeds, or None (no file, not a PNG, no ``canonlm-atlas`` chunk)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            raw = im.text.get(KEY) if hasattr(im, "text") else None
    except (OSError, ValueError):
        return None
    return None if raw is None else json.loads(raw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m canonlm.train.atlas", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("panels", nargs="+", metavar="skill=folder[:K1,K2][@KEY=VALUE]")
    ap.add_argument(
        "--out", type=Path, required=True, help="the PNG to write (an existing file is replaced only with --force)"
    )
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    if args.out.exists() and not args.force:
        print(f"atlas: error: {args.out} exists; --force replaces it", file=sys.stderr)
        return 2
    try:
        png, _, md, _ = build(args.panels, Path.cwd())
    except ValueError as e:
        print(f"atlas: error: {e}", file=sys.stderr)
        return 2
    from canonlm.utils.io import atomic_write_bytes

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out, png)
    print(md.replace("{png}", str(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
