"""See what a model is trained on: decoded samples with their answers and loss masks.

    python -m canonlm.data.preview task=<name> n=<count> [split=train|val|test] [seed=<int>] [jsonl=<path>]
                                   [packed=true] [task.<key>=<value> ...]

``task`` is a config of ``conf/task/`` (``depo1``, ``brevo1_cpu``, ``lano``, ...) or a registry name
(:data:`canonlm.data.tasks.TASKS`, then the task's built-in defaults); ``task.<key>=<value>`` overrides one key
(values parsed as YAML). Each sample is printed three ways:

* ``text``: the task's own decoding (``task.decode``);
* ``loss``: every token, loss targets marked with ``*`` (the token is predicted from the previous position);
* ``answers``: the scored spans (metric group and decoded tokens), then the per-instance metadata.

``packed=true`` prints the first n packed windows of the split instead (what the trainer sees, with the
window's loss mask), which is also what tasks with their own stream (``text``) show. ``jsonl=<path>`` also writes one
JSON object per sample (tokens, loss_mask, answer_id, group, text, meta); an existing file is never overwritten.
Bad arguments exit with one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from canonlm.errors import ConfigError
from canonlm.utils.io import atomic_write_text

_KEYS = ("task", "n", "split", "seed", "jsonl", "packed")


def _conf_dir() -> Path | None:
    """conf/ of the source tree (editable install), ``$CANONLM_CONF``, or ./conf."""
    cands = [os.environ.get("CANONLM_CONF"), Path(__file__).resolve().parents[3] / "conf", Path.cwd() / "conf"]
    for c in cands:
        if c and (Path(c) / "task").is_dir():
            return Path(c)
    return None


def load_task_config(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``task`` node of ``conf/task/<name>.yaml`` (its ``defaults`` list resolved) with ``overrides`` applied, or
    ``{"name": name, **overrides}`` for a registry name without a config file.

    Raises ConfigError("task", name, ...) if neither exists."""
    from omegaconf import OmegaConf

    from canonlm.data.tasks import TASKS

    conf = _conf_dir()
    path = conf / "task" / f"{name}.yaml" if conf else None
    if path is not None and path.is_file():

        def load(p: Path) -> Any:
            node = OmegaConf.load(p)
            defaults = node.pop("defaults", []) if "defaults" in node else []
            merged = OmegaConf.create({})
            own_done = False
            for d in defaults:
                if d == "_self_":
                    merged = OmegaConf.merge(merged, node)
                    own_done = True
                else:
                    merged = OmegaConf.merge(merged, load(p.parent / f"{d}.yaml"))
            return merged if own_done else OmegaConf.merge(merged, node)

        cfg = OmegaConf.to_container(load(path), resolve=True)
    elif name in TASKS:
        cfg = {"name": name}
    else:
        avail = sorted(p.stem for p in (conf / "task").glob("*.yaml")) if conf else list(TASKS)
        raise ConfigError("task", name, " | ".join(avail))
    cfg.update(overrides or {})
    return cfg


def _parse(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    import yaml

    args: dict[str, Any] = {"n": 3, "split": "train", "seed": None, "jsonl": None, "packed": False}
    task_over: dict[str, Any] = {}
    for a in argv:
        if "=" not in a:
            raise ConfigError("argument", a, "key=value pairs: " + ", ".join(_KEYS) + ", task.<key>")
        k, v = a.split("=", 1)
        if k.startswith("task."):
            task_over[k[5:]] = yaml.safe_load(v)
        elif k in _KEYS:
            args[k] = v if k in ("task", "jsonl", "split") else yaml.safe_load(v)
        else:
            raise ConfigError(k, v, "one of " + ", ".join(_KEYS) + ", task.<key>")
    if "task" not in args:
        raise ConfigError("task", None, "a task config name, e.g. task=depo1_cpu")
    n = args["n"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError("n", n, "a positive integer")
    if args["split"] not in ("train", "val", "test"):
        raise ConfigError("split", args["split"], "train | val | test")
    seed = args["seed"]
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError("seed", seed, "an integer >= 0 (default: the task's data seed)")
    if not isinstance(args["packed"], bool):
        raise ConfigError("packed", args["packed"], "true | false")
    if args["jsonl"] and Path(args["jsonl"]).exists():
        raise ConfigError("jsonl", args["jsonl"], "a path that does not exist yet (nothing is overwritten)")
    return args, task_over


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def render(
    task: Any,
    tokens: np.ndarray,
    loss_mask: np.ndarray,
    answer_id: np.ndarray,
    group: np.ndarray,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One sample as printable strings and a JSON-able record.

    Args: tokens int (L,), loss_mask bool (L,), answer_id int (L,) (-1 = not scored), group int (L,), meta: dict.
    Returns: dict with ``text`` (task.decode), ``loss`` (tokens with ``*`` on loss targets), ``answers`` (list of
    ``(group, decoded span)``) and ``record`` (JSON-able dict of the arrays, text and meta)."""
    names = task.token_names() if hasattr(task, "token_names") else None
    tok = [int(t) for t in tokens]

    def nm(t: int) -> str:
        return names[t] if names is not None and 0 <= t < len(names) else str(t)

    loss = " ".join(nm(t) + ("*" if m else "") for t, m in zip(tok, loss_mask))
    answers = []
    aid = np.asarray(answer_id)
    for a in sorted(set(int(x) for x in aid if x >= 0)):
        pos = np.nonzero(aid == a)[0]
        answers.append((int(group[pos[0]]), task.decode(np.asarray(tok)[pos])))
    text = task.decode(tok)
    record = {
        "tokens": tok,
        "loss_mask": [bool(x) for x in loss_mask],
        "answer_id": [int(x) for x in answer_id],
        "group": [int(x) for x in group],
        "text": text,
        "meta": _jsonable(meta or {}),
    }
    return {"text": text, "loss": loss, "answers": answers, "record": record}


def preview(task: Any, n: int, split: str = "train", seed: int | None = None, packed: bool = False) -> list[dict]:
    """The first ``n`` instances (or packed windows) of ``split``; see :func:`render` for the items' layout
    (each also has ``index``)."""
    out = []
    gname = getattr(task, "group_name", "group")
    if packed or not hasattr(task, "instance"):
        from canonlm.data.stream import SyntheticStream

        kw = dict(
            window=int(task.context),
            batch_size=n,
            seed=int(task.seed if seed is None else seed),
            num_steps=1,
            tail=getattr(task, "tail", "drop"),
        )
        ds = task.make_stream(split, **kw) if hasattr(task, "make_stream") else SyntheticStream(task, split, **kw)
        b = next(iter(ds))
        for r in range(min(n, b["tokens"].shape[0])):
            item = render(task, *(b[k][r].numpy() for k in ("tokens", "loss_mask", "answer_id", "group")))
            item["index"] = f"window {r}"
            out.append(item)
        return out
    for w in range(n):
        inst = task.instance(split, (w, 0), seed)
        item = render(task, inst.tokens, inst.loss_mask, inst.answer_id, inst.group, inst.meta)
        item["index"] = f"instance (w={w}, i=0)"
        item["group_name"] = gname
        out.append(item)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, over = _parse(argv)
        from canonlm.data.tasks import build_task

        cfg = load_task_config(args["task"], over)
        task = build_task(cfg.get("name"), cfg)
        items = preview(task, args["n"], args["split"], args["seed"], args["packed"])
    except ConfigError as e:
        print(f"canonlm: error: {e}", file=sys.stderr)
        return 2
    gname = getattr(task, "group_name", "group")
    print(f"# {task!r}  vocab_size={task.vocab_size}  split={args['split']}  (* = loss target)")
    for j, it in enumerate(items):
        print(
            f"\n[{j}] {it['index']}, {len(it['record']['tokens'])} tokens, "
            f"{sum(it['record']['loss_mask'])} loss targets"
        )
        print(f"text:    {it['text']}")
        print(f"loss:    {it['loss']}")
        for g, a in it["answers"]:
            print(f"answer:  {gname}={g}: {a}")
        if it["record"]["meta"]:
            print(f"meta:    {json.dumps(it['record']['meta'])[:400]}")
    if args["jsonl"]:
        path = atomic_write_text(
            args["jsonl"],
            "".join(json.dumps({"index": it["index"], "split": args["split"], **it["record"]}) + "\n" for it in items),
        )
        print(f"\nwrote {len(items)} samples to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
