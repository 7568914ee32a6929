"""The peak-FLOPs table behind ``perf/mfu``: device names as ``torch.cuda.get_device_name`` reports them are matched
exactly (no substring confusions such as L40 / L40S or H200 / H200 NVL), the values are the dense bf16 figures of
the vendors' data sheets, and an unknown device gets no MFU at all (None, no ``perf/mfu``)."""

from __future__ import annotations

import pytest
import torch

from test_grad_step import counted  # noqa: F401  (fixture: an in-process training run of a tiny model)

# Dense bf16 tensor-core TFLOP/s from the data sheets (they quote "with sparsity", twice these): A100 312 (624);
# H100 SXM 1,979 / PCIe 1,513 / NVL 1,671 sparse; H200 SXM 1,979 / NVL 1,671 sparse; GH200 1,979 sparse; HGX B200
# 4.5 PFLOPS sparse per GPU; L40S 362.05; L40 181.05; A10 125; RTX 4090 165.2 (fp32 accumulate, Ada whitepaper).
KNOWN = [
    ("NVIDIA A100-SXM4-40GB", 312),
    ("NVIDIA A100-SXM4-80GB", 312),
    ("NVIDIA A100-PCIE-40GB", 312),
    ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA H100 80GB HBM3", 1979 / 2),
    ("NVIDIA H100 PCIe", 1513 / 2),
    ("NVIDIA H100 NVL", 1671 / 2),
    ("NVIDIA H200", 1979 / 2),
    ("NVIDIA H200 NVL", 1671 / 2),
    ("NVIDIA GH200 480GB", 1979 / 2),
    ("NVIDIA B200", 4500 / 2),
    ("NVIDIA L40S", 362.05),
    ("NVIDIA L40", 181.05),
    ("NVIDIA A10", 125),
    ("NVIDIA GeForce RTX 4090", 165.2),
]
UNKNOWN = [
    "NVIDIA GeForce RTX 3090",
    "NVIDIA A10G",
    "NVIDIA H20",
    "Tesla V100-SXM2-16GB",
    "NVIDIA L4",
    "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition",
    "",
]


@pytest.mark.parametrize("name, tflops", KNOWN)
def test_known_devices_get_their_data_sheet_peak(name, tflops, monkeypatch):
    from canonlm.train.module import _peak_flops, peak_flops

    assert peak_flops(name) == pytest.approx(tflops * 1e12, rel=2e-3)  # the table rounds to 3 digits
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert _peak_flops(torch.device("cuda", 0)) == peak_flops(name)


@pytest.mark.parametrize("name", UNKNOWN)
def test_unknown_devices_get_no_peak(name, monkeypatch):
    from canonlm.train.module import _peak_flops, peak_flops

    assert peak_flops(name) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert _peak_flops(torch.device("cuda", 0)) is None


def test_names_that_contain_other_names():
    """The two confusions of a substring match: L40S is twice L40, H200 NVL is the 835 TFLOP/s part."""
    from canonlm.train.module import peak_flops

    assert peak_flops("NVIDIA L40S") == pytest.approx(2 * peak_flops("NVIDIA L40"), rel=1e-2)
    assert peak_flops("NVIDIA H200 NVL") == pytest.approx(835.5e12, rel=1e-3)
    assert peak_flops("NVIDIA H100 NVL") == pytest.approx(835.5e12, rel=1e-3)
    assert peak_flops("NVIDIA H100 PCIe") == pytest.approx(756.5e12, rel=1e-3)


def test_cpu_has_no_peak():
    from canonlm.train.module import _peak_flops

    assert _peak_flops(torch.device("cpu")) is None


@pytest.mark.parametrize("device_name", ["NVIDIA L40S", "NVIDIA L40X"])
def test_mfu_is_logged_only_for_a_known_device(device_name, tmp_path, counted, monkeypatch):  # noqa: F811 -- `counted`: the pytest fixture imported above
    """A CPU run whose device is reported as ``device_name``: a known one logs perf/mfu = tokens/s x training
    FLOPs per token / peak (the formula of docs/mfu.md, FLOPs from arch.flops), an unknown one logs no perf/mfu."""
    from canonlm.arch import flops
    from canonlm.train import module as M

    monkeypatch.setattr(M, "_peak_flops", lambda device: M.peak_flops(device_name))
    module, trainer, rows = counted(tmp_path, steps=6, every=2)
    perf = [m for _, m in rows if "perf/tokens_per_s" in m]
    assert perf
    peak = M.peak_flops(device_name)
    if peak is None:
        assert not any("perf/mfu" in m for _, m in rows)
        return
    per_token = flops.flops_per_token(module.model.cfg, 128, training=True)["total"]
    for m in perf:
        assert m["perf/mfu"] == pytest.approx(m["perf/tokens_per_s"] * per_token / peak, rel=1e-9)


def test_first_step_seconds_are_logged_once(tmp_path, counted):  # noqa: F811 -- the fixture imported above
    """``perf/first_step_s``: logged once, at the first optimizer step of the fit, positive and no longer than the
    whole fit took (timed around ``trainer.fit`` here: an independent clock)."""
    import time

    t0 = time.perf_counter()
    module, trainer, rows = counted(tmp_path, steps=4, every=2)
    wall = time.perf_counter() - t0
    firsts = [m["perf/first_step_s"] for _, m in rows if "perf/first_step_s" in m]
    assert len(firsts) == 1 and 0 < firsts[0] < wall
    assert module.first_step_s == pytest.approx(firsts[0])


def test_first_step_waits_for_the_optimizer_step_under_accumulation(tmp_path, counted, monkeypatch):  # noqa: F811 -- the fixture imported above
    """With gradient accumulation the first batch end is a micro-batch: ``perf/first_step_s`` is logged at the step
    where ``global_step`` first moves (the batch end of the 2nd micro-batch here), not before."""
    from canonlm.train import module as M

    seen = []
    orig = M.LMModule._first_step_done

    def spy(self):
        seen.append(self.trainer.global_step)
        return orig(self)

    monkeypatch.setattr(M.LMModule, "_first_step_done", spy)
    counted(tmp_path, steps=3, every=1, accumulate=2)
    assert seen == [1]
