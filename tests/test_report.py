"""Sweep report: best run over learning rates per (row, column) cell, one table per setting, unfinished runs listed."""

import json

import pytest
import yaml

from canonlm.train.report import load_runs, main, table, tables

NAN = float("nan")


def _config(N, size, lr, K=8, canon="ABCD", pos="rope"):
    """The identity keys of a run's resolved config (hparams.json; Hydra's .hydra/config.yaml has the same keys)."""
    return {
        "task": {"name": "depo1", "N": N, "K": K},
        "model": {"size": size, "arch": "llama", "mlp": "gated", "qk_norm": "none"},
        "canon": {"set": canon, "kernel": 4},
        "pos": {"type": pos, "fraction": 1.0},
        "optim": {"lr": lr},
        "seed": 0,
    }


def _val_rows(curve):
    """metrics.jsonl lines of validation passes: curve = [(step, {k: acc}), ...] -> ``val/acc_k<k>`` keys."""
    return "".join(
        json.dumps({"step": st, "time": 1.0 + st, "val/loss": 2.0, **{f"val/acc_k{k}": a for k, a in accs.items()}})
        + "\n"
        for st, accs in curve
    )


def _run(root, name, N, size, lr, acc_hi, acc_lo, K=8, canon="ABCD", pos="rope", hparams=True, curve=()):
    """A finished run directory as train.py leaves it: results.json (the layout of canonlm.train.run), the resolved
    config in hparams.json and .hydra/config.yaml, metrics.jsonl (a training line, then ``curve``'s val lines)."""
    d = root / name
    d.mkdir(parents=True)
    by = {
        str(K // 2): {"answers": 10, "acc": acc_lo, "tokens": 20, "token_acc": 0.5},
        str(K): {"answers": 10, "acc": acc_hi, "tokens": 20, "token_acc": 0.5},
    }
    (d / "results.json").write_text(
        json.dumps(
            {
                "task": "depo1",
                "task_config": {"name": "depo1", "N": N, "K": K, "context": 256},
                "model": {"arch": "llama", "size": size, "n_heads": 2, "canon": canon, "pos": pos, "qk_norm": "none"},
                "steps": 100,
                "tokens_seen": 409600,
                "train_time_s": 1.0,
                "test": {
                    "loss": 2.0,
                    "ppl": 7.4,
                    "group_name": "k",
                    "by_group": by,
                    "overall": {"answers": 20, "acc": (acc_hi + acc_lo) / 2, "tokens": 40, "token_acc": 0.5},
                },
            }
        )
    )
    if hparams:
        (d / "hparams.json").write_text(json.dumps(_config(N, size, lr, K, canon, pos)))
        (d / ".hydra").mkdir()
        (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(_config(N, size, lr, K, canon, pos)))
    else:
        (d / ".hydra").mkdir()
    (d / "checkpoints").mkdir()
    (d / "metrics.jsonl").write_text('{"step": 100, "time": 1.0, "train/loss": 2.0}\n' + _val_rows(curve))
    return d


def test_best_lr_per_cell(tmp_path, capsys):
    _run(tmp_path, "0", 225, "8L512D", 1e-3, 0.50, 0.90)
    _run(tmp_path, "1", 225, "8L512D", 2e-3, 0.70, 0.80)  # best of the cell: higher acc@K wins
    _run(tmp_path, "2", 375, "8L512D", 1e-3, 0.10, 0.30)
    t = table(load_runs(tmp_path), "task.N", "model.size")
    assert t["225"]["8L512D"]["acc"] == (0.70, 0.80) and t["225"]["8L512D"]["dir"].endswith("/1")
    assert t["225"]["8L512D"]["runs"] == 2
    assert t["375"]["8L512D"]["acc"] == (0.10, 0.30)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:3] == [
        "task.N \\ model.size |       8L512D",
        "                225 |   70.0/ 80.0",
        "                375 |   10.0/ 30.0",
    ]
    assert "unfinished" not in out


def test_no_runs_is_an_error_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "sweep" / "empty").mkdir(parents=True)
    (tmp_path / "sweep" / "multirun.yaml").write_text("hydra: {}\n")
    out_json = tmp_path / "t.json"
    assert main([str(tmp_path / "sweep"), "--json", str(out_json)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and "no runs below" in cap.err
    assert not out_json.exists()
    assert main([str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def _sweep_2x2(root):
    """The README's `python train.py -m canon=none,ABCD pos=rope,nope`, two learning rates each, plus one run killed
    at step 30 (resumed once, torn last line), one that died before logging and one that ran without an evaluation."""
    s = root / "multiruns" / "2026-01-01_00-00-00"
    #                                              acc@8 acc@4        best of the cell (by hand)
    _run(s, "0", 16, "2L64D", 1e-3, 0.10, 0.30, canon="", pos="rope")
    _run(s, "1", 16, "2L64D", 2e-3, 0.12, 0.25, canon="", pos="rope")  # none/rope: 12.0/25.0 (higher acc@8)
    _run(s, "2", 16, "2L64D", 1e-3, 0.05, 0.20, canon="", pos="nope")  # none/nope:  5.0/20.0
    _run(s, "3", 16, "2L64D", 2e-3, NAN, NAN, canon="", pos="nope")  #   (diverged: never wins)
    _run(s, "4", 16, "2L64D", 1e-3, 0.60, 0.90, canon="ABCD", pos="rope")
    _run(s, "5", 16, "2L64D", 2e-3, 0.60, 0.95, canon="ABCD", pos="rope")  # ABCD/rope: 60.0/95.0 (tie: acc@4)
    _run(s, "6", 16, "2L64D", 1e-3, 0.55, 0.85, canon="ABCD", pos="nope")  # ABCD/nope: 55.0/85.0
    _run(s, "7", 16, "2L64D", 2e-3, 0.40, 0.99, canon="ABCD", pos="nope")
    killed = s / "8"
    (killed / ".hydra").mkdir(parents=True)
    (killed / "checkpoints").mkdir()
    (killed / "metrics.jsonl").write_text(
        '{"step": 10, "time": 1.0, "train/loss": 3.0}\n'
        '{"step": 20, "time": 2.0, "train/loss": 2.9}\n'
        '{"step": 20, "time": 5.0, "train/loss": 2.8}\n'  # redone after the resume
        '{"step": 30, "time": 6.0, "train/loss": "nan"}\n'
        '{"step": 40, "time": 7.0, "tra'
    )  # killed mid-write: not a step
    (s / "9").mkdir()
    (s / "9" / "results.json").write_text(json.dumps({"task": "depo1", "steps": 0, "model": {"canon": "A"}}))
    (s / "10" / "checkpoints").mkdir(parents=True)  # natural order: 8, 9, 10
    return s


EXPECTED_DEFAULT = """\
canon.set=none pos.type=nope
task.N \\ model.size |        2L64D
                 16 |    5.0/ 20.0
100 steps (410K tokens) per run; each cell the best of optim.lr in {{0.001, 0.002}} (2 runs per cell); seed=0

canon.set=none pos.type=rope
task.N \\ model.size |        2L64D
                 16 |   12.0/ 25.0
100 steps (410K tokens) per run; each cell the best of optim.lr in {{0.001, 0.002}} (2 runs per cell); seed=0

canon.set=ABCD pos.type=nope
task.N \\ model.size |        2L64D
                 16 |   55.0/ 85.0
100 steps (410K tokens) per run; each cell the best of optim.lr in {{0.001, 0.002}} (2 runs per cell); seed=0

canon.set=ABCD pos.type=rope
task.N \\ model.size |        2L64D
                 16 |   60.0/ 95.0
100 steps (410K tokens) per run; each cell the best of optim.lr in {{0.001, 0.002}} (2 runs per cell); seed=0

cells: acc@K / acc@K/2 (%) (test split, else val)

unfinished or failed: {s}/8 (last step 30 from metrics.jsonl)
unfinished or failed: {s}/9 (results.json has no test or val result; no metrics.jsonl)
unfinished or failed: {s}/10 (no metrics.jsonl)
"""

EXPECTED_CANON_BY_POS = """\
canon.set \\ pos.type |         nope |         rope
                none |    5.0/ 20.0 |   12.0/ 25.0
                ABCD |   55.0/ 85.0 |   60.0/ 95.0
"""


def test_readme_sweep_one_table_per_setting_and_unfinished_runs(tmp_path, capsys):
    s = _sweep_2x2(tmp_path)
    assert main([str(s)]) == 0
    assert capsys.readouterr().out == EXPECTED_DEFAULT.format(s=s)
    # the same sweep as one 2 x 2 table: the empty Canon set is the row "none"
    assert main([str(s), "--rows", "canon.set", "--cols", "pos.type"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(EXPECTED_CANON_BY_POS)
    assert "canon.set=" not in out and "unfinished or failed: " + str(s / "8") in out


def test_json_has_every_table(tmp_path, capsys):
    s = _sweep_2x2(tmp_path)
    j = tmp_path / "report.json"
    assert main([str(s), "--json", str(j)]) == 0
    capsys.readouterr()
    doc = json.loads(j.read_text())
    assert doc["rows"] == "task.N" and doc["cols"] == "model.size"
    got = {t["title"]: (t["setting"], t["cells"]["16"]["2L64D"]) for t in doc["tables"]}
    want = {
        ("none", "nope"): ([0.05, 0.20], "2", 2),
        ("none", "rope"): ([0.12, 0.25], "1", 2),
        ("ABCD", "nope"): ([0.55, 0.85], "6", 2),
        ("ABCD", "rope"): ([0.60, 0.95], "5", 2),
    }
    assert [t["title"] for t in doc["tables"]] == [f"canon.set={c} pos.type={p}" for c, p in want]
    for (c, p), (acc, name, n) in want.items():
        setting, e = got[f"canon.set={c} pos.type={p}"]
        assert setting == {"canon.set": c, "pos.type": p}
        assert e["acc"] == pytest.approx(acc) and e["dir"] == str(s / name) and e["runs"] == n
    assert doc["unfinished"] == [
        {"dir": str(s / "8"), "last_step": 30, "reason": "no results.json"},
        {"dir": str(s / "9"), "last_step": None, "reason": "results.json has no test or val result"},
        {"dir": str(s / "10"), "last_step": None, "reason": "no results.json"},
    ]


def test_only_unfinished_runs(tmp_path, capsys):
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / "metrics.jsonl").write_text('{"step": 5, "time": 1.0, "train/loss": 3.0}\n')
    assert main([str(tmp_path)]) == 0
    assert (
        capsys.readouterr().out == f"no finished runs\n\nunfinished or failed: {tmp_path}/0 (last step 5 from "
        "metrics.jsonl)\n"
    )


def test_runs_of_another_canon_set_are_refused_in_one_cell_and_nan_loses(tmp_path):
    _run(tmp_path, "a", 225, "8L512D", 1e-3, 0.30, 0.50, canon="", pos="nope")
    _run(tmp_path, "b", 225, "8L512D", 1e-3, 0.70, 0.90, canon="AC", pos="nope")
    ts = tables(load_runs(tmp_path), "task.N", "model.size")
    assert [(t["title"], t["cells"]["225"]["8L512D"]["acc"]) for t in ts] == [
        ("canon.set=none", (0.30, 0.50)),
        ("canon.set=AC", (0.70, 0.90)),
    ]
    # table() is one setting: runs of another Canon set in a cell are refused, naming the key
    with pytest.raises(ValueError, match="canon.set=none vs AC"):
        table(load_runs(tmp_path), "task.N", "model.size")
    # a diverged run (NaN) never wins its cell
    nan_root = tmp_path / "nan"
    _run(nan_root, "a", 225, "8L512D", 1e-3, NAN, NAN)
    _run(nan_root, "b", 225, "8L512D", 2e-3, 0.20, 0.40)
    t = table(load_runs(nan_root), "task.N", "model.size")
    assert t["225"]["8L512D"]["acc"] == (0.20, 0.40)


def _hydra_only(root, name, acc, changes: dict, hparams: str | None = None):
    """A finished Depo1 run (N=225, 8L512D) whose settings are only in Hydra's ``.hydra/config.yaml`` as train.py
    writes it: unresolved interpolations (the grid preset's step budget, the run name, the run directory), with
    ``changes`` applied; ``hparams``: the text of a damaged ``hparams.json`` beside it, or none."""
    d = _run(root, name, 225, "8L512D", 1e-3, acc, acc / 2, hparams=False)
    cfg = _config(225, "8L512D", 1e-3)
    _set(cfg, "trainer.max_steps", "${canonlm_steps:${task.name},${task.N}}")
    _set(cfg, "run_name", "${now:%Y-%m-%d_%H-%M-%S}")
    _set(cfg, "paths.output_dir", "${hydra:runtime.output_dir}")
    _set(cfg, "optim.weight_decay", 0.03)
    for k, v in changes.items():
        _set(cfg, k, v)
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    if hparams is not None:
        (d / "hparams.json").write_text(hparams)
    return d


def test_runs_without_hparams_are_compared_on_their_hydra_config(tmp_path, capsys):
    """Issue 26, item 8: two runs without hparams.json whose .hydra/config.yaml differ in weight decay (0.03 vs 0.0)
    used to share a cell ("2 runs per cell"). They are compared on their Hydra configs: two settings, one run each."""
    _hydra_only(tmp_path, "wd003", 0.40, {})
    _hydra_only(tmp_path, "wd0", 0.70, {"optim.weight_decay": 0.0}, hparams="{not json")  # damaged hparams.json
    runs = load_runs(tmp_path)
    assert sorted(r["config_source"] for r in runs) == [".hydra/config.yaml", ".hydra/config.yaml"]
    # the grid preset's ${canonlm_steps:...} resolves to the paper's budget (App. A: Depo1 N=225 -> 87,500 steps)
    assert {r["config"]["trainer"]["max_steps"] for r in runs} == {87_500}
    ts = tables(runs, "task.N", "model.size")
    assert [(t["title"], t["cells"]["225"]["8L512D"]["acc"], t["protocol"]["runs_per_cell"]) for t in ts] == [
        ("optim.weight_decay=0.0", (0.70, 0.35), [1, 1]),
        ("optim.weight_decay=0.03", (0.40, 0.20), [1, 1]),
    ]
    with pytest.raises(ValueError, match="optim.weight_decay=0.0 vs 0.03"):
        table(runs, "task.N", "model.size")
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "optim.weight_decay=0.0\n" in out and "optim.weight_decay=0.03\n" in out and "2 runs per cell" not in out
    # a run with the same settings in hparams.json (resolved, as the job wrote it) shares the cell of the one whose
    # settings come from Hydra's file: its interpolations resolved to the same values, its names and paths ignored
    d = _run(tmp_path, "resolved", 225, "8L512D", 2e-3, 0.10, 0.05)
    cfg = _config(225, "8L512D", 2e-3)
    for k, v in {
        "trainer.max_steps": 87_500,
        "run_name": "2026-01-01_00-00-00",
        "paths.output_dir": str(d),
        "optim.weight_decay": 0.03,
    }.items():
        _set(cfg, k, v)
    (d / "hparams.json").write_text(json.dumps(cfg))
    ts = tables(load_runs(tmp_path), "task.N", "model.size")
    assert [(t["title"], t["protocol"]["runs_per_cell"]) for t in ts] == [
        ("optim.weight_decay=0.0", [1, 1]),
        ("optim.weight_decay=0.03", [2, 2]),
    ]


def test_a_run_without_readable_settings_is_refused_by_name(tmp_path, capsys):
    """A finished run whose settings cannot be read (no hparams.json, and its .hydra/config.yaml missing or
    damaged) is compared with no run: it is in no table and named under the tables with the reason, never placed by
    the identity keys results.json happens to hold."""
    from canonlm.train.cells import NO_SETTINGS, find_unfinished

    _run(tmp_path, "ok", 225, "8L512D", 1e-3, 0.30, 0.50)
    _run(tmp_path, "bare", 225, "8L512D", 1e-3, 0.90, 0.95, hparams=False)  # empty .hydra/
    damaged = _run(tmp_path, "damaged", 225, "8L512D", 1e-3, 0.80, 0.95, hparams=False)
    (damaged / ".hydra" / "config.yaml").write_text("task: [unclosed\n")
    (damaged / "hparams.json").write_text("{}")
    runs = load_runs(tmp_path)
    assert [r["dir"].rsplit("/", 1)[1] for r in runs] == ["ok"]
    t = table(runs, "task.N", "model.size")
    assert t["225"]["8L512D"]["acc"] == (0.30, 0.50) and t["225"]["8L512D"]["runs"] == 1
    unf = {u["dir"].rsplit("/", 1)[1]: u["reason"] for u in find_unfinished(tmp_path, runs)}
    assert unf == {"bare": NO_SETTINGS, "damaged": NO_SETTINGS}
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"unfinished or failed: {tmp_path}/bare ({NO_SETTINGS}; last step 100 from metrics.jsonl)" in out, out
    assert " 90.0" not in out and " 80.0" not in out  # neither refused run's number is in a cell


# ---------------------------------------------------------------------------------------------------------------
# Cells compare like with like: only the best-of keys (lr, seeds) and keys that cannot change a result may differ
# ---------------------------------------------------------------------------------------------------------------


def _set(cfg: dict, dotted: str, value) -> dict:
    *path, last = dotted.split(".")
    node = cfg
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value
    return cfg


def _run_with(root, name, acc, changes: dict, lr=1e-3):
    """A finished Depo run (N=16, 2L64D, acc@8 = acc) whose hparams.json is ``_config`` with ``changes`` applied."""
    d = _run(root, name, 16, "2L64D", lr, acc, acc / 2)
    cfg = _config(16, "2L64D", lr)
    for k, v in changes.items():
        _set(cfg, k, v)
    (d / "hparams.json").write_text(json.dumps(cfg))
    return d


# (key, value of the weaker run, value of the stronger run): each can change a result
RESULT_KEYS = [
    ("trainer.max_steps", 600, 100000),
    ("canon.kernel", 2, 4),
    ("canon.residual", False, True),
    ("canon.activation", True, False),
    ("pos.theta", 500.0, 10000.0),
    ("pos.pairing", "interleaved", "half"),
    ("data.batch_size", 32, 64),
    ("optim.weight_decay", 0.0, 0.1),
    ("model.n_heads", 2, 4),
    ("sched.name", "constant", "cosine"),
    ("loss.z_loss", "palm", "none"),
    ("task.context", 128, 256),
]


@pytest.mark.parametrize("key, weak, strong", RESULT_KEYS, ids=[k for k, _, _ in RESULT_KEYS])
def test_runs_that_differ_in_a_result_key_never_share_a_cell(tmp_path, capsys, key, weak, strong):
    """Oracle: by hand, each run is the only run of its own table (the stronger one does not absorb the weaker)."""
    _run_with(tmp_path, "a", 0.20, {key: weak})
    _run_with(tmp_path, "b", 0.90, {key: strong}, lr=2e-3)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{key}={weak}\n" in out and f"{key}={strong}\n" in out, out
    assert "20.0/ 10.0" in out and "90.0/ 45.0" in out, out
    assert out.count("(1 run per cell)") == 2 and "best of" not in out, out
    runs = load_runs(tmp_path)
    with pytest.raises(ValueError, match=rf"{key}=({weak} vs {strong}|{strong} vs {weak})"):
        table(runs, "task.N", "model.size")


def test_the_issue_example_three_runs_are_three_tables(tmp_path, capsys):
    """Residual on / off, kernel 4 / 2, 600 / 100,000 steps: formerly one cell taken from the 100,000-step run."""
    _run_with(tmp_path, "a", 0.30, {"canon.residual": True, "canon.kernel": 4, "trainer.max_steps": 600})
    _run_with(tmp_path, "b", 0.50, {"canon.residual": False, "canon.kernel": 4, "trainer.max_steps": 600})
    _run_with(tmp_path, "c", 0.95, {"canon.residual": True, "canon.kernel": 2, "trainer.max_steps": 100000})
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    print(out)
    titles = [ln for ln in out.splitlines() if ln.startswith("canon.")]
    assert titles == [
        "canon.kernel=2 canon.residual=True trainer.max_steps=100000",
        "canon.kernel=4 canon.residual=True trainer.max_steps=600",
        "canon.kernel=4 canon.residual=False trainer.max_steps=600",
    ], out
    assert [ln.split("|")[1].strip() for ln in out.splitlines() if ln.startswith("                 16 |")] == [
        "95.0/ 47.5",
        "30.0/ 15.0",
        "50.0/ 25.0",
    ], out


def test_neutral_keys_and_best_of_keys_share_a_cell(tmp_path, capsys):
    """Runs that differ only in paths, names, loggers, checkpoint cadence, the resume choice and the worker count,
    and in learning rate and seeds: one cell, the best of the four, the protocol stated."""
    neutral = {
        "run_name": "x",
        "paths.output_dir": "/x",
        "logger.csv.save_dir": "/x",
        "callbacks.checkpoint.every_n_train_steps": 100,
        "data.num_workers": 4,
        "trainer.log_every_n_steps": 5,
        "trainer.devices": 2,
        "activation_checkpointing": 1,
    }
    for i, (lr, seed, acc) in enumerate([(1e-3, 1, 0.3), (1e-3, 2, 0.4), (3e-3, 1, 0.8), (3e-3, 2, 0.6)]):
        ch = {k: (f"{v}{i}" if isinstance(v, str) else v * (i + 1)) for k, v in neutral.items()}
        ch["ckpt_path"] = None if i % 2 else "auto"  # a fresh start or a resume of the run's own checkpoints
        if i == 3:
            ch["callbacks"] = None  # callbacks=none: a node null in one run only
        _run_with(tmp_path, f"r{i}", acc, {**ch, "seed": seed}, lr=lr)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("task.N \\ model.size |        2L64D\n                 16 |   80.0/ 40.0\n"), out
    assert (
        "100 steps (410K tokens) per run; each cell the best of optim.lr in {0.001, 0.003} x seed in {1, 2} "
        "(4 runs per cell)"
    ) in out, out


def test_best_of_names_other_keys(tmp_path, capsys):
    _run_with(tmp_path, "a", 0.2, {"optim.weight_decay": 0.0})
    _run_with(tmp_path, "b", 0.7, {"optim.weight_decay": 0.1})
    assert (
        main([str(tmp_path), "--best-of", "optim.lr,seed,optim.weight_decay", "--json", str(tmp_path / "r.json")]) == 0
    )
    out = capsys.readouterr().out
    assert "70.0/ 35.0" in out and "20.0" not in out and "optim.weight_decay in {0.0, 0.1} (2 runs per cell)" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["tables"][0]["protocol"]["best_of"]["optim.weight_decay"] == ["0.0", "0.1"]
    for bad, why in (
        ("task.N", "--rows, --cols or task.name"),
        ("task", "--rows, --cols or task.name"),
        ("paths.output_dir", "cannot change a result"),
        ("a b", "not a"),
        ("optim.lrr", "no run sets"),
    ):
        assert main([str(tmp_path), "--best-of", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("report: error: --best-of") and why in err, err


def test_every_figure_and_table_states_budget_learning_rates_and_seeds(tmp_path):
    """The --out files of the README sweep: table.md, report.json and each figure's caption name the steps, the
    tokens, the learning rates and the runs per cell (what the oracle, _sweep_2x2, put there)."""
    from canonlm.train.report import build_outputs, find_unfinished

    s = _sweep_2x2(tmp_path)
    runs = load_runs(s)
    files = build_outputs([s], runs, find_unfinished(s, runs), "task.N", "model.size")
    want = "100 steps (410K tokens) per run; each cell the best of optim.lr in {0.001, 0.002} (2 runs per cell); seed=0"
    assert f"Cells: acc@K / acc@K/2 (%) (test split, else val). {want}." in files["table.md"].decode()
    doc = json.loads(files["report.json"])
    assert [t["protocol"]["text"] for t in doc["tables"]] == [want] * 4
    figs = doc["figures"]
    assert figs and all(want in f["caption"] for f in figs), [f["caption"] for f in figs]


def test_a_key_that_follows_the_rows_does_not_split_the_table(tmp_path, capsys):
    """A paper grid sets trainer.max_steps from N (depo1_grid): one N x size table whose protocol names the rule,
    not one table per step count."""
    for i, (N, steps, acc) in enumerate([(16, 600, 0.9), (24, 900, 0.7), (32, 1200, 0.5)]):
        d = _run_with(tmp_path, f"r{i}", acc, {"task.N": N, "trainer.max_steps": steps})
        res = json.loads((d / "results.json").read_text())
        res["task_config"]["N"] = N
        (d / "results.json").write_text(json.dumps(res))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "task.N \\ model.size |        2L64D\n                 16 |   90.0/ 45.0\n"
        "                 24 |   70.0/ 35.0\n                 32 |   50.0/ 25.0\n"
    ), out
    assert "trainer.max_steps follows task.N (16: 600, 24: 900, 32: 1200)" in out, out


def test_whole_numbers_as_int_or_float_are_one_value(tmp_path, capsys):
    _run_with(tmp_path, "a", 0.3, {"pos.fraction": 1, "optim.weight_decay": 0})
    _run_with(tmp_path, "b", 0.6, {"pos.fraction": 1.0, "optim.weight_decay": 0.0}, lr=2e-3)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("task.N \\ model.size |        2L64D\n                 16 |   60.0/ 30.0\n"), out
    assert "(2 runs per cell)" in out


def test_a_seed_axis_is_left_out_of_the_default_best_of(tmp_path, capsys):
    """mini/copy's layout: --cols seed, each column one run; the default best-of is then the learning rate only."""
    _run_with(tmp_path, "a", 0.3, {"seed": 1})
    _run_with(tmp_path, "b", 0.6, {"seed": 2})
    assert main([str(tmp_path), "--cols", "seed"]) == 0
    out = capsys.readouterr().out
    assert "task.N \\ seed |            1 |            2\n" in out and "(1 run per cell); optim.lr=0.001" in out, out
    assert main([str(tmp_path), "--cols", "seed", "--best-of", "optim.lr,seed"]) == 2
    assert "seed is (or holds) --rows, --cols or task.name" in capsys.readouterr().err


def test_per_cell_learning_rate_sets_are_stated_as_such(tmp_path, capsys):
    """A grid with its own learning rates per model size: the protocol says each cell has its own set."""
    for i, (size, lr, acc) in enumerate(
        [("2L64D", 1e-3, 0.3), ("2L64D", 2e-3, 0.4), ("4L64D", 1e-2, 0.5), ("4L64D", 2e-2, 0.6)]
    ):
        _run(tmp_path, f"r{i}", 16, size, lr, acc, acc / 2)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "each cell the best of optim.lr in its own set per cell ({0.001, 0.002} / {0.01, 0.02}) (2 runs per cell)"
        in out
    ), out


def test_an_unfinished_run_with_unresolved_values_joins_its_setting(tmp_path):
    """A run killed before hparams.json: Hydra's .hydra/config.yaml keeps ``${...}`` and ``auto``; the run is put in
    its cell (n/a, unfinished) of the setting its other values match, not in a table of its own."""
    from canonlm.train.report import build_outputs, find_unfinished

    _run_with(tmp_path, "done", 0.5, {"trainer.max_steps": 600})
    killed = tmp_path / "killed"
    (killed / ".hydra").mkdir(parents=True)
    cfg = _set(
        _set(_config(16, "4L64D", 1e-3), "trainer.max_steps", "${canonlm_steps:depo1,16}"), "data.batch_size", "auto"
    )
    (killed / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    runs = load_runs(tmp_path)
    doc = json.loads(
        build_outputs([tmp_path], runs, find_unfinished(tmp_path, runs), "task.N", "model.size")["report.json"]
    )
    assert len(doc["tables"]) == 1, [t["title"] for t in doc["tables"]]
    cells = doc["tables"][0]["cells"]["16"]
    assert cells["2L64D"]["status"] == "ok" and cells["4L64D"]["status"] == "unfinished", cells
