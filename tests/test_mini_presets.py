"""The ``experiment=mini/*`` CPU reproductions: each preset is a Hydra multirun whose grid is what the issue and the
paper's figure ask for (checked against those, not against the preset's own text), every job of the grid composes
and builds, the sweep prints its report and the report command at the end, and that command writes the figures."""

from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from conftest import CONF, ROOT, compose

PRESETS = sorted(p.stem for p in (CONF / "experiment" / "mini").glob("*.yaml"))
ENV = {**os.environ, "WANDB_MODE": "disabled"}


def _hydra_cfg(overrides: list[str]):
    """The composed config with its ``hydra`` node (mode, sweeper params, callbacks), as ``train.py -m`` sees it."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from canonlm.config.resolvers import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hcompose(config_name="train", overrides=overrides, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def _grid(preset: str) -> list[list[str]]:
    """The job overrides of a preset's sweep: the cartesian product of ``hydra.sweeper.params`` (what Hydra's basic
    sweeper launches), each job with ``experiment=mini/<preset>`` in front."""
    params = _hydra_cfg([f"experiment=mini/{preset}"]).hydra.sweeper.params
    axes = [[f"{k}={v.strip()}" for v in str(vals).split(",")] for k, vals in params.items()]
    return [[f"experiment=mini/{preset}", *job] for job in itertools.product(*axes)]


def test_the_three_presets_exist():
    assert {"depth", "copy", "linear", "breadth", "manipulation", "structure", "capacity"} <= set(PRESETS)


#: presets whose paper protocol is the best of two learning rates at one seed (Capo: Part 4.1 App. A.3 / Part 3.3)
ONE_SEED = {"capacity"}


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_follows_the_papers_protocol_best_of_two_lrs_and_two_seeds(preset, tmp_path):
    """The paper's protocol (Part 4.1, Section 2: the best over several learning rates, at several seeds): every
    setting of the grid is trained at >= 2 learning rates x >= 2 seeds (Capo: >= 2 learning rates, one seed, as the
    paper's capacity runs), and those are the only keys that vary inside a setting."""
    jobs = _jobs(preset, tmp_path)
    lrs, seeds = {c.optim.lr for c in jobs}, {c.seed for c in jobs}
    assert len(lrs) >= 2 and len(seeds) >= (1 if preset in ONE_SEED else 2)
    settings: dict = {}
    for c in jobs:
        d = OmegaConf.to_container(c)
        key = (d["optim"].pop("lr"), d.pop("seed"))
        d.pop("run_name", None)
        d.pop("paths", None)
        settings.setdefault(json.dumps(d, sort_keys=True, default=str), set()).add(key)
    assert all(v == set(itertools.product(lrs, seeds)) for v in settings.values())


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_is_a_multirun_whose_every_job_builds(preset, tmp_path):
    import torch

    from canonlm.arch.model import LlamaCanon
    from canonlm.config.build import build_configs
    from canonlm.train.run import resolve_max_steps, validate_training

    from hydra.types import RunMode

    h = _hydra_cfg([f"experiment=mini/{preset}"]).hydra
    assert h.mode == RunMode.MULTIRUN  # `python train.py experiment=mini/<name>` sweeps even without -m
    assert h.callbacks.report._target_ == "canonlm.train.sweep_callbacks.ReportCommand"
    for job in _grid(preset):
        cfg = compose(job, output_dir=tmp_path)
        OmegaConf.resolve(cfg)
        task, mcfg = build_configs(cfg)
        resolve_max_steps(cfg, task)  # trainer.max_steps: auto (Capo) -> the task's schedule, as the job does
        validate_training(cfg)
        with torch.device("meta"):
            assert LlamaCanon(mcfg).num_params() > 0


def _jobs(preset, tmp_path):
    out = []
    for job in _grid(preset):
        cfg = compose(job, output_dir=tmp_path)
        OmegaConf.resolve(cfg)
        out.append(cfg)
    return out


def test_the_default_run_is_mini_depths_setting_and_its_twin_only_drops_canon(tmp_path):
    """Plain ``python train.py`` trains at mini/depth's setting (its task, model size, batch) with Canon-ABCD and RoPE;
    ``experiment=default_nocanon`` is the same run without Canon, and both land in ``logs/train/runs/`` (what the
    README names)."""
    default = compose([], output_dir=tmp_path)
    twin = compose(["experiment=default_nocanon"], output_dir=tmp_path)
    depth = [c for c in _jobs("depth", tmp_path) if c.canon.set == "ABCD" and c.pos.type == "rope"][0]
    assert default.canon.set == "ABCD" and default.pos.type == "rope" and twin.canon.set == ""
    assert default.task == depth.task and default.task.K == 2
    assert (default.model.size, default.data.batch_size) == (depth.model.size, depth.data.batch_size)
    a, b = OmegaConf.to_container(default), OmegaConf.to_container(twin)
    a.pop("canon"), b.pop("canon")
    assert a == b
    for overrides in ([], ["experiment=default_nocanon"]):
        run_dir = str(_hydra_cfg(overrides).hydra.run.dir)
        assert "/train/runs/" in run_dir, run_dir


def test_depth_follows_the_paper_protocol_on_a_two_hop_depo(tmp_path):
    """The issue: Llama with and without Canon-ABCD, RoPE and NoPE, at least 2 learning rates x 2 seeds; a Depo with
    1-token names where k = 2 is the deepest question (the report's acc@2); with and without Canon see the same
    task, data, model size, steps and learning rates."""
    jobs = _jobs("depth", tmp_path)
    grid = {(c.pos.type, c.canon.set, c.optim.lr, c.seed) for c in jobs}
    lrs, seeds = {c.optim.lr for c in jobs}, {c.seed for c in jobs}
    assert len(lrs) >= 2 and len(seeds) >= 2 and len(jobs) == len(grid)
    assert grid == set(itertools.product(["rope", "nope"], ["", "ABCD"], sorted(lrs), sorted(seeds)))
    first = jobs[0]
    for c in jobs:
        assert c.task.name == "depo1" and c.task.K == 2 and c.task.min_len == c.task.max_len == 1
        assert c.task == first.task and c.model.size == first.model.size and c.model.arch == "llama"
        assert c.trainer.max_steps == first.trainer.max_steps and c.data.batch_size == first.data.batch_size
    h = _hydra_cfg(["experiment=mini/depth"]).hydra.callbacks.report
    assert (h.rows, h.cols, h.k) == ("canon.set", "pos.type", "2,1")  # colour = acc@K (Fig. 7)


def _fig7_grid(preset: str, task_name: str, tmp_path) -> tuple[list, Any]:
    """The jobs of a Fig. 7-style preset, checked: {RoPE, NoPE} x {no Canon, Canon-ABCD} x >= 2 learning rates x
    >= 2 seeds, all on task ``task_name`` with the same task config, model size, steps and batch. Returns (jobs, the
    first job)."""
    jobs = _jobs(preset, tmp_path)
    grid = {(c.pos.type, c.canon.set, c.optim.lr, c.seed) for c in jobs}
    lrs, seeds = sorted({c.optim.lr for c in jobs}), sorted({c.seed for c in jobs})
    assert len(lrs) >= 2 and len(seeds) >= 2
    assert grid == set(itertools.product(["rope", "nope"], ["", "ABCD"], lrs, seeds))
    first = jobs[0]
    for c in jobs:
        assert c.task.name == task_name and c.task == first.task and c.model.size == first.model.size
        assert c.trainer.max_steps == first.trainer.max_steps and c.data.batch_size == first.data.batch_size
    return jobs, first


def test_breadth_follows_the_paper_protocol_on_a_small_brevo1_scored_by_generation(tmp_path):
    """Brevo1 (the paper's breadth task) with and without Canon-ABCD, RoPE and NoPE, >= 2 learning rates x 2 seeds,
    scored as the paper scores it: generation accepted by the validator, here only in the final test; every job
    sees the same task, data, model size and steps."""
    jobs, first = _fig7_grid("breadth", "brevo1", tmp_path)
    assert all(c.data.gen_eval.on_val is False for c in jobs)
    from canonlm.data.tasks import build_task

    task = build_task("brevo1", OmegaConf.to_container(first.task))
    assert task.eval_mode == "generate" and task.max_instance_len("test") <= first.task.context


def test_copy_is_one_layer_d16_rope_copy_length_64_with_and_without_canon(tmp_path):
    """The issue's probe setting (Fig. 5 at small scale): 1 layer, d_model=16, RoPE, copy length 64."""
    jobs = _jobs("copy", tmp_path)
    assert {c.canon.set for c in jobs} == {"", "ABCD"}
    for c in jobs:
        from canonlm.config.build import build_configs

        task, m = build_configs(c)
        assert c.task.name == "fullcopy" and c.task.n_tokens == 64 and c.task.context >= 2 * 64 + 2
        assert (m.n_layers, m.d_model, c.pos.type) == (1, 16, "rope")
    # with and without Canon see the same seeds, learning rate and steps: like is compared with like
    pairs = {(c.canon.set, c.seed, c.optim.lr, c.trainer.max_steps) for c in jobs}
    others = {(s, lr, n) for _, s, lr, n in pairs}
    assert len(pairs) == len(jobs) == 2 * len(others)


def test_linear_is_gla_without_conv_with_short_conv_and_canon_abcd_on_a_two_hop_depo(tmp_path):
    """Fig. 12's three GLA variants on one Depo with 1-token names and K = 2 (the report's acc@2 is the deepest
    question), the model size of mini/depth; the three see the same task, data, budget and learning rates."""
    depth = _jobs("depth", tmp_path)[0]
    jobs = _jobs("linear", tmp_path)
    assert {c.canon.set for c in jobs} == {"", "AbCD", "b"}
    first = jobs[0]
    for c in jobs:
        assert c.model.arch == "gla" and c.task.name == "depo1" and c.task.K == 2
        assert c.task.min_len == c.task.max_len == 1 and c.task == first.task
        assert c.model.size == depth.model.size and c.trainer.max_steps == first.trainer.max_steps


# ------------------------------------------------------------------------------------ the report at the end


def _depo_run(d: Path, canon: str, pos: str, seed: int, acc: dict[int, float]):
    """A finished Depo run directory (the layout ``canonlm.train.run`` writes) with accuracy ``acc`` by k."""
    d.mkdir(parents=True)
    by = {str(k): {"answers": 10, "acc": a, "tokens": 20, "token_acc": a} for k, a in acc.items()}
    cfg = {
        "task": {"name": "depo1", "N": 16, "K": 4},
        "model": {"size": "4L128D", "arch": "llama", "mlp": "gated", "qk_norm": "none"},
        "canon": {"set": canon},
        "pos": {"type": pos, "fraction": 1.0},
        "optim": {"lr": 2e-3},
        "seed": seed,
    }
    (d / "results.json").write_text(
        json.dumps(
            {
                "task": "depo1",
                "task_config": {"name": "depo1", "N": 16, "K": 4},
                "model": {"arch": "llama", "size": "4L128D", "canon": canon, "pos": pos, "qk_norm": "none"},
                "steps": 800,
                "test": {"loss": 1.0, "group_name": "k", "by_group": by, "overall": {"acc": 0.1}},
            }
        )
    )
    (d / "hparams.json").write_text(json.dumps(cfg))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 800, "time": 1.0, "val/acc_k1": acc[1]}) + "\n")


def test_report_callback_prints_the_tables_and_a_command_that_writes_the_figures(tmp_path, capsys):
    from canonlm.train.sweep_callbacks import ReportCommand

    sweep = tmp_path / "multiruns" / "t"
    accs = {("", "rope"): 0.05, ("ABCD", "rope"): 0.50, ("", "nope"): 0.04, ("ABCD", "nope"): 0.30}
    for i, ((canon, pos), a1) in enumerate(accs.items()):
        _depo_run(sweep / str(i), canon, pos, 1, {1: a1, 2: 0.06, 4: 0.07})
    cb = ReportCommand(rows="canon.set", cols="pos.type", k="1,2")
    cb.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    out = capsys.readouterr().out
    # acc@1 / acc@2 (not the default acc@K / acc@K/2 = k=4 / k=2), rows Canon set, columns positions
    assert "canon.set \\ pos.type |         nope |         rope" in out
    assert " none |    4.0/  6.0 |    5.0/  6.0" in out and " ABCD |   30.0/  6.0 |   50.0/  6.0" in out
    assert "acc@1 / acc@2 (%)" in out
    cmd = [line for line in out.splitlines() if line.startswith("report (tables")]
    assert len(cmd) == 1
    argv = shlex.split(cmd[0].split(": ", 1)[1])
    assert argv[:3] == ["python", "-m", "canonlm.train.report"] and argv[-2:] == ["--out", str(sweep / "report")]
    r = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, env=ENV, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    written = {p.name for p in (sweep / "report").iterdir()}
    # canon x pos are the rows x columns: one table, one heat map with the four cells, its learning curves
    assert {"table.md", "report.json", "table.csv", "heatmap.png", "curves.png"} <= written
    import matplotlib.image

    assert matplotlib.image.imread(sweep / "report" / "heatmap.png").shape[0] > 100
    md = (sweep / "report" / "table.md").read_text()
    assert "| ABCD | 30.0 / 6.0 | 50.0 / 6.0 |" in md


def test_a_plain_sweeps_report_compares_what_was_swept(tmp_path, capsys):
    """``python train.py -m canon=none,ABCD`` (the callback's default, --rows/--cols auto): one table with the two
    Canon sets side by side, each cell the best of its seeds -- not one single-cell table per Canon set with rows
    task.N and columns model.size. A 2 x 2 (canon x pos) sweep gets the paper's layout, rows canon.set."""
    from canonlm.train.sweep_callbacks import ReportCommand

    sweep = tmp_path / "plain"
    runs = [("", 1, 0.10), ("", 2, 0.20), ("ABCD", 1, 0.70), ("ABCD", 2, 0.60)]
    for i, (canon, seed, a) in enumerate(runs):
        _depo_run(sweep / str(i), canon, "rope", seed, {1: a, 2: a / 2, 4: a / 4})
    ReportCommand().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    cap = capsys.readouterr()
    out = cap.out.split("== report of", 1)[1]
    header = [line for line in out.splitlines() if " | " in line]
    assert header[0].split() == ["task.name", "\\", "canon.set", "|", "none", "|", "ABCD"]  # one table
    assert len(header) == 2 and header[1].split()[0] == "depo1"
    # the best of the two seeds per Canon set: acc@K / acc@K/2 = k=4 / k=2 by default
    assert (
        header[1].split("|")[1].split("/")[0].strip() == "5.0"
        and header[1].split("|")[2].split("/")[0].strip() == "17.5"
    )
    assert "canon.set=" not in out and "rows task.name, columns canon.set (auto" in cap.err
    assert "--rows auto --cols auto" in out.splitlines()[-1]

    square = tmp_path / "square"
    for i, (canon, pos) in enumerate([("", "rope"), ("", "nope"), ("ABCD", "rope"), ("ABCD", "nope")]):
        _depo_run(square / str(i), canon, pos, 1, {1: 0.5, 2: 0.3, 4: 0.1})
    ReportCommand().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(square)}}}))
    out = capsys.readouterr().out
    assert out.count("canon.set \\ pos.type |") == 1


def test_report_callback_survives_a_failing_report(tmp_path, capsys):
    from canonlm.train.sweep_callbacks import ReportCommand

    sweep = tmp_path / "empty"
    sweep.mkdir()
    ReportCommand().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    cap = capsys.readouterr()
    assert "no runs below" in cap.err and "report (tables" in cap.out


@pytest.mark.slow
def test_depth_preset_end_to_end_at_toy_size(tmp_path):
    """``python train.py -m experiment=mini/depth`` as a user runs it (shrunk by overrides to seconds, one lr and
    one seed: four jobs), the report at the end with acc@2 / acc@1 per (Canon set, positions), and the report
    command."""
    tiny = [
        "model.size=2L64D",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "data.val_windows=8",
        "data.test_windows=8",
        "data.batch_size=4",
        "callbacks.progress.force=lines",
    ]
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "experiment=mini/depth", *tiny, "optim.lr=1e-3", "seed=1"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=ENV,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Launching 4 jobs locally" in p.stdout + p.stderr
    sweeps = list((tmp_path / "logs" / "mini_depth" / "multiruns").iterdir())
    assert len(sweeps) == 1 and len(list(sweeps[0].rglob("results.json"))) == 4
    assert "canon.set \\ pos.type |" in p.stdout and "acc@2 / acc@1 (%)" in p.stdout
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("report (tables") and f"{sweeps[0]} --rows canon.set --cols pos.type --k 2,1" in last


def test_manipulation_follows_the_paper_protocol_on_a_small_mano_scored_at_l_equal_L(tmp_path):
    """Mano (the paper's manipulation task) with and without Canon-ABCD, RoPE and NoPE, >= 2 learning rates x 2
    seeds, scored as the paper scores it: the answer token at l = L (the task's val/test draw), chance 1/mod; every
    job sees the same task, data, model size and steps; the expressions have more than one operator (L >= 2), so the
    answer needs a composition of two table look-ups."""
    from canonlm.data.tasks import build_task

    jobs, first = _fig7_grid("manipulation", "mano", tmp_path)
    assert first.task.L >= 2 and first.task.loss_on == "all" and first.task.knowledge_augment is False
    task = build_task("mano", OmegaConf.to_container(first.task))
    assert task.chance == pytest.approx(1 / first.task.mod)
    b = task.generate("test", [0] * 64, list(range(64)))  # the test split draws l = L only (paper App. A.4)
    assert set(b.meta["ell"].tolist()) == {first.task.L}
    h = _hydra_cfg(["experiment=mini/manipulation"]).hydra.callbacks.report
    assert (h.rows, h.cols) == ("canon.set", "pos.type")


def test_capacity_measures_bits_per_parameter_at_fixed_exposures_for_two_populations(tmp_path):
    """Capo (Part 3.3's capacity measure) at a fixed 100 exposures per person: no Canon against Canon-ABCD at two
    population sizes, >= 2 learning rates; each job's step count is the one that shows every person exactly
    ``exposures`` times at its batch (re-derived here from the stream's pass boundaries, not from the preset), and
    the report tabulates Canon set against N."""
    from canonlm.data.tasks import build_task

    jobs = _jobs("capacity", tmp_path)
    grid = {(c.task.N, c.canon.set, c.optim.lr) for c in jobs}
    ns, lrs = sorted({c.task.N for c in jobs}), sorted({c.optim.lr for c in jobs})
    assert len(ns) == 2 and len(lrs) >= 2
    assert grid == set(itertools.product(ns, ["", "ABCD"], lrs))
    for c in jobs:
        assert c.task.name == "capo" and c.task.exposures == 100 and c.pos.type == "rope"
        assert c.model.size == jobs[0].model.size and c.trainer.max_steps == "auto"
    for n in ns:
        c = next(j for j in jobs if j.task.N == n)
        task = build_task("capo", OmegaConf.to_container(c.task))
        window = c.data.batch_size * c.task.context
        tokens = int(task.pass_starts(100)[100])  # the stream up to the end of the 100th pass
        assert task.steps_for_exposures(c.data.batch_size) == -(-tokens // window)
    h = _hydra_cfg(["experiment=mini/capacity"]).hydra.callbacks.report
    assert (h.rows, h.cols) == ("canon.set", "task.N")


def test_structure_follows_the_paper_protocol_on_a_small_cfg_scored_by_the_checker_and_kl(tmp_path):
    """Lano (the paper's structure task) with and without Canon-ABCD, RoPE and NoPE, >= 2 learning rates x 2 seeds,
    scored as the paper scores it: sentences sampled at temperature 1 and accepted by the CYK checker, with the KL to
    the grammar's exact law; the window holds the grammar's longest sentence (nothing is cut), and every job sees the
    same grammar, data, model size and steps."""
    from canonlm.data.cfg.grammar import PRESETS as FAMILIES

    jobs, first = _fig7_grid("structure", "lano", tmp_path)
    assert all(c.data.gen_eval.on_val is False for c in jobs)
    fam = FAMILIES[first.task.grammar]
    assert first.task.context >= 1 + fam["len_max"] ** fam["depth"]  # the longest sentence and its <bos> fit
    assert first.task.eval_temperature == 1.0 and first.task.kl_samples > 0 and first.task.eval_num_samples >= 64
    h = _hydra_cfg(["experiment=mini/structure"]).hydra.callbacks.report
    assert (h.rows, h.cols) == ("canon.set", "pos.type")
