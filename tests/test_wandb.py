"""``logger=wandb`` offline (never a server): sweep group, arch/canon/pos/task tags, accuracy by k in the history,
a resumed run continuing its wandb run (same id), and the report's ``--wandb`` run of job_type report.

The offline runs are read back from wandb's own transaction log (``run-<id>.wandb``: a 7-byte ``:W&B`` header, then
LevelDB-log records of ``wandb_internal_pb2.Record`` protos), not only from what canonlm says it asked for."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, compose
from test_train import TINY

pytest.importorskip("wandb")


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def read_records(path: Path) -> list:
    """Every record of an offline run's ``.wandb`` file (32 KiB blocks; chunk types full 1, first 2, middle 3,
    last 4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:
            break
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def offline_runs(save_dir: Path, timeout: float = 60.0) -> list[tuple[Path, dict]]:
    """(offline run dir, {"run": run record, "history": keys, "config": keys}) per attempt, oldest first. wandb's
    service process writes the transaction log (``run-*.wandb``) on its own schedule; on a loaded machine the run
    record can land after ``run.finish()`` has returned, so the log is re-read until every attempt has its run record
    or ``timeout`` seconds pass (then the records found so far are returned and the caller's asserts report them)."""
    deadline = time.monotonic() + timeout
    while True:
        out = _read_offline_runs(save_dir)
        if all(info["run"] is not None for _, info in out) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def _read_offline_runs(save_dir: Path) -> list[tuple[Path, dict]]:
    out = []
    for d in sorted((save_dir / "wandb").glob("offline-run-*")):
        (f,) = d.glob("run-*.wandb")
        info = {"run": None, "history": set(), "config": set()}
        for rec in read_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run" and info["run"] is None:
                info["run"] = rec.run
            elif kind == "history":
                info["history"] |= {i.key or "/".join(i.nested_key) for i in rec.history.item}
            elif kind == "config":
                info["config"] |= {i.key or "/".join(i.nested_key) for i in rec.config.update}
        out.append((d, info))
    return out


def _train(args: list[str], cwd: Path, multirun: bool = False) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *(["-m"] if multirun else []),
        *TINY,
        "logger=wandb",
        "trainer.val_check_interval=5",
        f"paths.log_dir={cwd}/logs",
        *args,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=dict(os.environ))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def test_run_tags_group_history_and_resume(tmp_path):
    _train(["run_name=wb", "trainer.max_steps=5", "tags=[mine]"], tmp_path)
    run = tmp_path / "logs" / "train" / "runs" / "wb"
    init = json.loads((run / "wandb_init.json").read_text())
    assert init["tags"] == ["mine", "arch:llama", "canon:ABCD", "pos:rope", "task:depo1"]
    assert init["group"] is None and init["job_type"] == "train" and init["resume"] == "allow"
    assert init["mode"] == "offline" and init["id"].startswith("wb-")
    ((d, info),) = offline_runs(run)
    assert d.name.endswith("-" + init["id"])
    r = info["run"]
    assert r.run_id == init["id"] and list(r.tags) == init["tags"] and r.job_type == "train" and not r.run_group
    assert {"val/acc_k1", "val/acc_k4", "test/acc_k1", "test/acc_k4", "train/loss"} <= info["history"]
    assert {"canon", "pos", "task", "model"} <= info["config"]  # the resolved config (log_hyperparams)
    assert not (tmp_path / "wandb_dir").exists() or not any((tmp_path / "wandb_dir").rglob("*.wandb"))
    # the resumed run continues the same wandb run: a second offline attempt with the same id
    _train(["run_name=wb", "trainer.max_steps=8", "ckpt_path=auto", "test=false"], tmp_path)
    runs = offline_runs(run)
    assert len(runs) == 2 and all(d.name.endswith("-" + init["id"]) for d, _ in runs)
    assert runs[1][1]["run"].run_id == init["id"]
    assert json.loads((run / "wandb_init.json").read_text())["id"] == init["id"]


def test_multirun_job_is_grouped_by_its_sweep(tmp_path):
    sweep = tmp_path / "logs" / "train" / "multiruns" / "2026-01-01_00-00-00"
    _train(["canon=none", "trainer.max_steps=5", "test=false", f"hydra.sweep.dir={sweep}"], tmp_path, multirun=True)
    init = json.loads((sweep / "0" / "wandb_init.json").read_text())
    assert init["group"] == "train/2026-01-01_00-00-00" and "canon:none" in init["tags"]
    assert init["id"].startswith("2026-01-01_00-00-00-0-")
    ((d, info),) = offline_runs(sweep / "0")
    assert info["run"].run_group == "train/2026-01-01_00-00-00" and d.name.endswith("-" + init["id"])


def test_logger_config_ids_and_tags(tmp_path, monkeypatch):
    """No wandb run: the id of a multirun job does not depend on its run_name (the time of each attempt), distinct
    job dirs get distinct ids, linear models are tagged pos:none, a group set in the config wins."""
    from canonlm.train import wandb_utils as wu

    sweep = str(tmp_path / "logs" / "train" / "multiruns" / "T")
    monkeypatch.setattr(wu, "multirun_sweep_dir", lambda: sweep)
    ids = []
    for name, job in (("a", "0"), ("b", "0"), ("a", "1")):
        cfg = compose(["logger=wandb", "arch=gla", "canon=none", f"run_name={name}"], output_dir=tmp_path / job)
        (tmp_path / job).mkdir(exist_ok=True)
        kw = wu.logger_config(cfg.logger.wandb, cfg, str(tmp_path / job))
        ids.append(kw.id)
        assert kw.group == "train/T" and list(kw.tags) == ["arch:gla", "canon:none", "pos:none", "task:depo1"]
    assert ids[0] == ids[1] != ids[2]
    cfg = compose(["logger=wandb", "logger.wandb.group=mine"], output_dir=tmp_path / "x")
    assert wu.logger_config(cfg.logger.wandb, cfg, str(tmp_path / "x"), rank0=False).group == "mine"
    assert not (tmp_path / "x" / "wandb_init.json").exists()


def test_report_wandb_run(tmp_path, capsys):
    from test_report import _sweep_2x2

    from canonlm.train.report import main

    s = _sweep_2x2(tmp_path / "train")
    out = tmp_path / "report"
    assert main([str(s), "--out", str(out), "--wandb"]) == 0  # 4 settings: 4 heat maps, 4 curves, 1 panel figure
    pngs = sorted(p.stem for p in out.glob("*.png"))
    csvs = sorted(p.stem for p in out.glob("*.csv"))
    assert len(pngs) == 9 and len(csvs) == 4
    ((d, info),) = offline_runs(out)
    r = info["run"]
    assert r.job_type == "report" and r.run_group == "train/2026-01-01_00-00-00"
    # media values are flattened in the history: <key>/_type, <key>/path, ...
    assert {f"figures/{p}/_type" for p in pngs} | {f"tables/{c}/_type" for c in csvs} <= info["history"]
    media = [p.name for p in (d / "files" / "media").rglob("*") if p.is_file()]
    assert sum(m.endswith(".png") for m in media) == 9 and sum(m.endswith(".table.json") for m in media) == 4
    with pytest.raises(SystemExit):
        main([str(s), "--wandb"])  # --wandb needs --out


def test_wandb_missing_is_refused_with_the_install_command(monkeypatch, tmp_path, capsys):
    """wandb is an optional extra: without it (``import wandb`` fails, as on a GPU node installed without the extra)
    ``logger=wandb`` is one ConfigError naming the key and the install command, and ``report --wandb`` one usage
    error; neither writes anything."""
    from canonlm.errors import ConfigError
    from canonlm.train.report import main as report_main
    from canonlm.train.wandb_utils import logger_config

    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    cfg = compose(["logger=wandb"], output_dir=tmp_path / "run")
    with pytest.raises(ConfigError) as e:
        logger_config(cfg.logger.wandb, cfg, str(tmp_path / "run"), rank0=True)
    assert e.value.key == "logger" and e.value.value == "wandb" and "canonlm[wandb]" in str(e.value)
    with pytest.raises(SystemExit) as ex:
        report_main([str(tmp_path), "--out", str(tmp_path / "rep"), "--wandb"])
    assert ex.value.code == 2 and "canonlm[wandb]" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
