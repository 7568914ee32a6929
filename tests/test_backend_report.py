"""Backends never change silently: every op's resolved backend is printed when a run starts and recorded in
``hparams.json`` (under ``resolved``) and ``results.json`` with the document-masking setting; an ``auto`` request that
falls back to a pure-PyTorch path on CUDA says so once, naming why (``CanonLM.place`` ->
``canonlm.arch.model.placement_notes``).

The CUDA cases run on this CPU machine by resolving for a ``cuda`` device whose CUDA check answers "runnable" and
whose libraries are made unavailable through the ops' own probes (``canonlm.ops._dispatch.probe``'s table): exactly
what resolution sees on a GPU node where the library does not import.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from canonlm.arch import CanonLM, build_model_config
from canonlm.arch import model as arch_model
from canonlm.ops import _dispatch
from conftest import ARCH_PRESETS, compose
from test_train import TINY


def _build(arch: str, canon: str) -> CanonLM:
    cfg = build_model_config(
        dict(ARCH_PRESETS[arch], size="2L64D"), canon={"set": canon}, vocab_size=32, max_seq_len=64
    )
    return CanonLM(cfg)


@pytest.fixture
def gpu_without(monkeypatch):
    """Make ``cuda`` a usable device for backend resolution and the probes named by the test unavailable with an
    ImportError (as on a node where the library does not import); returns the function that marks a probe."""
    import canonlm.ops.canon as canon_ops
    import canonlm.ops.gdn as gdn_ops
    import canonlm.ops.gla as gla_ops
    import canonlm.ops.ssd as ssd_ops

    for mod in (_dispatch, canon_ops, gla_ops, gdn_ops, ssd_ops):
        monkeypatch.setattr(mod, "cuda_reason", lambda device: None)
    _dispatch.forget_backend_choices()
    monkeypatch.setattr(arch_model, "_said", set())

    def unavailable(name: str, error: str) -> None:
        monkeypatch.setitem(_dispatch._probes, name, (None, error))

    yield unavailable
    _dispatch.forget_backend_choices()


def test_a_fallback_on_cuda_is_said_once_with_its_reason(gpu_without, caplog):
    gpu_without("ssd.chunk", "ModuleNotFoundError: No module named 'mamba_ssm'")
    gpu_without("canon.dao", "ModuleNotFoundError: No module named 'causal_conv1d'")
    gpu_without("canon.fla", "ImportError: fla causal_conv1d not found")
    model = _build("mamba2", "AbCD")
    with caplog.at_level(logging.WARNING, logger="canonlm"):
        backends = model.place("cuda", torch.bfloat16)
        model.place("cuda", torch.bfloat16)  # placed again (configure_model): said once
    assert backends["ssd"] == "reference" and backends["canon"] == "torch"
    rep = model.backend_report()
    assert rep["device"] == "cuda" and rep["compute_dtype"] == "bfloat16"
    assert (
        "mamba_ssm.ops.triton.ssd_combined is not importable (ModuleNotFoundError: No module named 'mamba_ssm')"
        in rep["fallbacks"]["ssd"]
    )
    assert "No module named 'causal_conv1d'" in rep["fallbacks"]["canon"] and "fla" in rep["fallbacks"]["canon"]
    lines = [r.getMessage() for r in caplog.records if "auto fell back" in r.getMessage()]
    assert len(lines) == 2 and all("\n" not in ln for ln in lines), lines
    assert any(ln.startswith("ssd: auto fell back to the reference path on cuda: mamba_ssm") for ln in lines)
    assert "ssd=reference (mamba_ssm: mamba_ssm.ops.triton.ssd_combined is not importable" in model.backend_line()


def test_no_fallback_is_reported_for_a_pinned_reference_or_on_the_cpu(gpu_without):
    gpu_without("gla.fla", "ImportError: no fla")
    cfg = build_model_config(
        dict(ARCH_PRESETS["gla"], size="2L64D"),
        canon={"set": "AbCD"},
        vocab_size=32,
        max_seq_len=64,
        kernels={"gla": "reference"},
    )
    model = CanonLM(cfg)
    model.place("cuda", torch.bfloat16)
    assert model.backends["gla"] == "reference" and "gla" not in model.fallbacks  # asked for: no fallback
    cpu = _build("gla", "AbCD")
    cpu.place("cpu", torch.float32)
    assert cpu.fallbacks == {} and cpu.backend_report()["fallbacks"] == {}


def test_a_run_prints_and_records_its_backends(tmp_path, caplog):
    """A real in-process run: the start line names each op's backend and the document-masking setting, and both
    files record them (``hparams.json`` under ``resolved``, ``results.json`` at the top level)."""
    from canonlm.train.run import run

    out = tmp_path / "run"
    cfg = compose(
        [
            *TINY,
            "arch=gla",
            "canon=AbCD",
            "trainer.max_steps=2",
            "logger=none",
            "callbacks=default",
            "callbacks.progress.force=lines",
        ],
        output_dir=out,
    )
    with caplog.at_level(logging.INFO, logger="canonlm"):
        res = run(cfg)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("backends on "))
    assert line.startswith("backends on cpu (float32): canon=") and "gla=reference (fla: needs a CUDA device" in line
    assert line.endswith("; document masking off")
    hp = json.loads((out / "hparams.json").read_text())
    assert hp["resolved"]["doc_mask"] is False and hp["resolved"]["backends"]["gla"] == "reference"
    assert hp["resolved"]["backends"]["canon"] in ("cpu", "torch") and hp["resolved"]["backends"]["device"] == "cpu"
    saved = json.loads((out / "results.json").read_text())
    assert saved["doc_mask"] is False and saved["backends"] == hp["resolved"]["backends"] == res["backends"]
