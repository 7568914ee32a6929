"""Capo's lists and template pools: reading and validating ``capo_assets/`` (one job: the raw material of bioS).

canonlm ships its own lists (``src/canonlm/data/tasks/capo_assets/``; how they were made: its README), of the same
sizes as the official release's ``data-synthetic-pretrain/Capo-bioS-bioR/fields/`` files (facebookresearch/PhysicsLM4:
``first_name.txt`` 400, ``middle_name.txt`` 400, ``last_name.txt`` 1000, ``city.txt`` 200, ``university.txt`` 300,
``field.txt`` 100, ``company.txt`` 263 employers with their headquarters city) and 50 own templates per attribute
(Part 3.3 §2: bioS; the release's pools hold 46-52). Every value and template obeys the pre-token rule of
:mod:`canonlm.data.tasks.capo.fragments`, checked here when the assets are loaded.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parents[1] / "capo_assets"
ATTRIBUTES = ("birth_date", "birth_city", "university", "major", "employer", "work_city")
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
PRONOUNS = ("He", "She")  # gender 0, 1
MAX_TEMPLATES = 50  # templates shipped per attribute
_VALUE_RE = re.compile(r"^[A-Za-z0-9]+(?:(?: |-| & |, )[A-Za-z0-9]+)*$")
_NAME_RE = re.compile(r"^[A-Z][a-z]+$")


def _check_value(kind: str, v: str) -> str:
    if not _VALUE_RE.match(v):
        raise ValueError(
            f"capo asset {kind}: value {v!r} breaks the pre-token rule (letters/digits, single "
            "spaces, internal '-', ' & ' or ', ' only; starts and ends with a letter or digit)"
        )
    return v


def parse_template(t: str) -> tuple[str, str]:
    """Split a template ``"{S}<prefix> {V}<suffix>"`` into (prefix, suffix) fragments.

    The subject slot ``{S}`` must open the template; ``{V}`` (the value, which carries its own leading space) must
    occur once, preceded by a space. The prefix starts with a space and ends with a non-space; the suffix is empty or
    starts with a space or punctuation; the template ends with ``.``, has no double spaces, no digits next to the
    value and no other braces. Raises ValueError naming the template otherwise.
    """
    ok = (
        t.startswith("{S}")
        and t.count("{S}") == 1
        and t.count("{V}") == 1
        and " {V}" in t
        and t.endswith(".")
        and "  " not in t
        and t.count("{") == 2
        and t.count("}") == 2
    )
    if ok:
        i = t.index(" {V}")
        pre, suf = t[3:i], t[i + 4 :]
        ok = (
            len(pre) >= 2
            and pre[0] == " "
            and not pre[1].isspace()
            and not pre[-1].isspace()
            and (suf == "" or suf[0] == " " or not suf[0].isalnum())
            and not (suf[:1] == " " and suf[1:2] == " ")
            and not suf.endswith(" ")
            and "{" not in pre + suf
        )
    if not ok:
        raise ValueError(f"capo template {t!r} is malformed; expected '{{S}} words {{V}}<punctuation or words>.'")
    return pre, suf


@lru_cache(maxsize=1)
def load_assets() -> dict[str, Any]:
    """canonlm's own Capo lists and template pools (``capo_assets/``), validated.

    Returns dict: ``first_names``, ``middle_names``, ``last_names``, ``birth_cities``, ``universities``, ``majors``,
    ``employers``, ``hq_cities`` (lists of str; ``hq_cities[e]`` = headquarters city of ``employers[e]``),
    ``templates`` (dict attribute -> list of str), ``digest`` (sha256 hex of all asset files).
    Raises ValueError for a malformed value/template or duplicated entries (a packaging bug).
    """
    h = hashlib.sha256()
    out: dict[str, Any] = {}
    for name in ("first_names", "middle_names", "last_names", "birth_cities", "universities", "majors"):
        text = (ASSETS / f"{name}.txt").read_text()
        h.update(name.encode() + b"\0" + text.encode())
        lines = [ln for ln in text.split("\n") if ln]
        if len(set(lines)) != len(lines):
            raise ValueError(f"capo asset {name}: duplicated lines")
        rule = _NAME_RE if name.endswith("_names") else _VALUE_RE
        for v in lines:
            if not rule.match(v):
                raise ValueError(f"capo asset {name}: value {v!r} breaks the pre-token rule")
        out[name] = lines
    text = (ASSETS / "employers.tsv").read_text()
    h.update(b"employers\0" + text.encode())
    rows = [ln.split("\t") for ln in text.split("\n") if ln]
    if any(len(r) != 2 for r in rows) or len({r[0] for r in rows}) != len(rows):
        raise ValueError("capo asset employers.tsv: expected distinct 'employer<TAB>city' lines")
    out["employers"] = [_check_value("employers", r[0]) for r in rows]
    out["hq_cities"] = [_check_value("hq_cities", r[1]) for r in rows]
    text = (ASSETS / "templates.json").read_text()
    h.update(b"templates\0" + text.encode())
    tj = json.loads(text)
    out["templates"] = {}
    for a in ATTRIBUTES:
        pool = tj[a]
        if len(pool) < MAX_TEMPLATES or len(set(pool)) != len(pool):
            raise ValueError(f"capo templates: {a} needs {MAX_TEMPLATES} distinct templates, has {len(set(pool))}")
        for t in pool:
            parse_template(t)
        out["templates"][a] = list(pool)
    out["digest"] = h.hexdigest()
    return out
