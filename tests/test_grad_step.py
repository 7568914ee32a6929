"""The optimizer step of LMModule (``configure_gradient_clipping``): one gradient norm per step, clipping equal to
``torch.nn.utils.clip_grad_norm_``, non-finite steps skipped on the device (no parameter or optimizer-state update,
counted, ``max_nonfinite_steps`` in a row stop the run with ``last.ckpt``), and host syncs only at logging steps.

Runs are in-process on the CPU (tiny Depo model, a real Lightning ``Trainer``). A host sync cannot be observed on the
CPU, so the tests count the calls that copy a tensor's value to the host (``item``, ``bool``, ``float``, ``int``,
``tolist``, ``cpu``, ...; on CUDA each one waits for the device) made between the start of a training batch and the
end of the module's ``on_train_batch_end``: the forward, backward, clipping, optimizer step and logging of the step.
Lightning reads its progress-bar values after that, at every batch end: ``test_logged_values_are_host_tensors``
checks that those are host tensors written at logging steps only."""

from __future__ import annotations

import math
from functools import partial

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from omegaconf import OmegaConf

from conftest import compose

TINY = ["task=depo1_cpu", "model.size=2L64D", "task.N=8", "task.K=4", "task.vocab_V=6", "task.context=128"]
BATCH = 8
READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy")


class Capture(Logger):
    """Keeps every ``log_metrics`` call as (step, metrics)."""

    name, version = "capture", 0

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


def _probe_class():
    from canonlm.train.module import LMModule

    class Probe(LMModule):
        """LMModule with a NaN loss at the 1-based optimizer steps in ``poison`` and, per optimizer step, the host
        reads made inside the step (``reads``), the gradients before / after ``configure_gradient_clipping``,
        the calls of the norm kernels (``torch._foreach_norm``, ``torch.linalg.vector_norm``) from
        ``on_before_optimizer_step`` to the end of the step, and a copy of the parameters and optimizer state after
        it."""

        def __init__(self, *args, poison=(), **kwargs):
            super().__init__(*args, **kwargs)
            self.poison = set(poison)
            self.reading = False  # the read counter is on
            self.norming = False  # the norm counter is on
            self.reads: dict[int, list[str]] = {}
            self.norm_calls: dict[int, dict[str, int]] = {}
            self.grads_before: dict[int, list[torch.Tensor]] = {}
            self.grads_after: dict[int, list[torch.Tensor]] = {}
            self.states: dict[int, tuple[dict, dict]] = {}
            self._reads_now: list[str] = []

        def _loss(self, batch):
            logits, out = super()._loss(batch)
            if self.trainer.training and self.trainer.global_step + 1 in self.poison:
                out = {**out, "loss_sum": out["loss_sum"] * float("nan")}
            return logits, out

        def on_train_batch_start(self, batch, batch_idx):
            super().on_train_batch_start(batch, batch_idx)
            self.reading = True

        def on_before_optimizer_step(self, optimizer):
            step = self.trainer.global_step + 1
            self.grads_before[step] = [p.grad.detach().clone() for p in self._params(optimizer)]
            self.norming = True
            self.norm_calls[step] = {}
            super().on_before_optimizer_step(optimizer)

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            step = self.trainer.global_step + 1
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            self.grads_after[step] = [
                None if p.grad is None else p.grad.detach().clone() for p in self._params(optimizer)
            ]

        def on_train_batch_end(self, outputs, batch, batch_idx):
            try:
                super().on_train_batch_end(outputs, batch, batch_idx)
            finally:
                self.reading = self.norming = False
                step = self.trainer.global_step
                self.reads[step] = self.reads.get(step, []) + self._reads_now
                self._reads_now = []
                opt = self.trainer.optimizers[0]
                self.states[step] = (
                    {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                    {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
                )

        @staticmethod
        def _params(optimizer):
            return [p for g in optimizer.param_groups for p in g["params"]]

    return Probe


@pytest.fixture
def counted(monkeypatch):
    """Patch the host-read methods of torch.Tensor and the norm kernels so that a Probe module counts them while its
    step window is open; returns a function ``fit(tmp_path, **kw) -> (module, trainer, logger rows)``."""
    current: dict[str, object] = {}

    for name in READS:
        orig = getattr(torch.Tensor, name)

        def read(t, *args, _orig=orig, _name=name, **kwargs):
            mod = current.get("module")
            if mod is not None and mod.reading:
                mod._reads_now.append(_name)
            return _orig(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    for owner, name in ((torch, "_foreach_norm"), (torch.linalg, "vector_norm")):
        orig = getattr(owner, name)

        def norm(*args, _orig=orig, _name=name, **kwargs):
            mod = current.get("module")
            if mod is not None and mod.norming:
                calls = mod.norm_calls[mod.trainer.global_step + 1]
                calls[_name] = calls.get(_name, 0) + 1
            return _orig(*args, **kwargs)

        monkeypatch.setattr(owner, name, norm)

    def fit(
        tmp_path,
        *,
        steps,
        every,
        clip=1.0,
        fused=True,
        poison=(),
        max_nonfinite=5,
        precision="32-true",
        plugins=(),
        accumulate=1,
    ):
        from canonlm.train.datamodule import SyntheticDataModule
        from canonlm.config.build import build_configs

        cfg = compose(TINY)
        task, mcfg = build_configs(cfg)
        task_cfg = OmegaConf.to_container(cfg.task, resolve=True)
        L.seed_everything(0, verbose=False)
        module = _probe_class()(
            mcfg,
            optimizer=partial(torch.optim.AdamW, lr=1e-3, fused=fused),
            sched={"name": "constant"},
            total_steps=steps,
            loss={},
            num_groups=task.num_groups,
            max_nonfinite_steps=max_nonfinite,
            poison=poison,
        )
        module.tokens_per_step = BATCH * int(task_cfg["context"])
        current["module"] = module
        logger = Capture()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            log_every_n_steps=every,
            gradient_clip_val=clip,
            precision=precision,
            logger=logger,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=str(tmp_path),
            plugins=list(plugins),
            accumulate_grad_batches=accumulate,
        )
        dm = SyntheticDataModule(task, task_cfg, batch_size=BATCH)
        try:
            trainer.fit(module, datamodule=dm)
        finally:
            current.pop("module")
        return module, trainer, logger.rows

    return fit


def _logging_steps(steps: int, every: int) -> set[int]:
    """The steps at which the values are read: multiples of ``every`` and the last step."""
    return {s for s in range(1, steps + 1) if s % every == 0} | {steps}


def _metric(rows, name):
    return [m[name] for _, m in rows if name in m]


def test_host_reads_once_per_logging_interval(tmp_path, counted):
    """12 steps, log_every_n_steps=5, two of them skipped (NaN loss): the step window reads the device exactly once
    at steps 5, 10 and 12 (the last step, read so that a final run of skipped steps is noticed) and never otherwise,
    so <= ceil(12 / 5) reads; the skipped steps are counted all the same."""
    steps, every = 12, 5
    module, trainer, rows = counted(tmp_path, steps=steps, every=every, poison=(3, 7))
    assert trainer.global_step == steps
    with_reads = {s: r for s, r in module.reads.items() if r}
    assert set(with_reads) == _logging_steps(steps, every) == {5, 10, 12}, module.reads
    assert sum(len(r) for r in with_reads.values()) <= math.ceil(steps / every)
    assert module.nonfinite_steps == 2
    assert _metric(rows, "train/nonfinite_steps") == [1.0, 2.0]  # Lightning flushes steps 5 and 10


def test_fallback_optimizer_reads_every_step(tmp_path, counted):
    """An optimizer without torch's ``found_inf`` (AdamW foreach) can only skip a step through None gradients:
    one host read per step, the documented cost; the skipped step still makes no update."""
    module, _, _ = counted(tmp_path, steps=4, every=4, fused=False, poison=(2,))
    assert all(len(module.reads[s]) >= 1 for s in range(1, 5)), module.reads
    params1, opt1 = module.states[1]
    params2, opt2 = module.states[2]
    assert all(torch.equal(params1[k], params2[k]) for k in params1)
    assert opt1.keys() == opt2.keys() and all(torch.equal(opt1[p][k], opt2[p][k]) for p in opt1 for k in opt1[p])
    assert module.nonfinite_steps == 1


def test_clipping_equals_clip_grad_norm_and_logged_norm_is_its_norm(tmp_path, counted):
    """clip 0.05 (every step's norm is larger): the gradients the optimizer gets are exactly those of
    ``torch.nn.utils.clip_grad_norm_`` applied to a copy of the gradients after backward, the logged
    ``train/grad_norm`` is exactly that function's total norm, and one norm is computed per step (one
    ``torch._foreach_norm`` over the gradients and one ``vector_norm`` of those norms, as in ``clip_grad_norm_``:
    Lightning does not clip a second time and nothing else measures the gradients)."""
    steps, clip = 4, 0.05
    module, _, rows = counted(tmp_path, steps=steps, every=1, clip=clip)
    logged = _metric(rows, "train/grad_norm")
    assert len(logged) == steps
    for step in range(1, steps + 1):
        copies = [torch.nn.Parameter(torch.zeros_like(g)) for g in module.grads_before[step]]
        for c, g in zip(copies, module.grads_before[step]):
            c.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(copies, clip)
        assert float(norm) > clip and logged[step - 1] == float(norm)
        assert all(torch.equal(c.grad, a) for c, a in zip(copies, module.grads_after[step]))
        assert module.norm_calls[step] == {"_foreach_norm": 1, "vector_norm": 1}


def test_no_clipping_still_measures_the_norm(tmp_path, counted):
    """gradient_clip_val=None: gradients untouched, the logged norm equals a naive fp64 norm of them."""
    module, _, rows = counted(tmp_path, steps=2, every=1, clip=None)
    logged = _metric(rows, "train/grad_norm")
    for step in (1, 2):
        before, after = module.grads_before[step], module.grads_after[step]
        assert all(torch.equal(b, a) for b, a in zip(before, after))
        naive = math.sqrt(sum(float((g.double() ** 2).sum()) for g in before))
        assert logged[step - 1] == pytest.approx(naive, rel=1e-6)


def test_skipped_steps_make_no_update(tmp_path, counted):
    """Steps 3 and 4 have a NaN loss: parameters, AdamW moments and step counters after step 4 equal those after
    step 2 bit for bit; step 5 updates again; the counter of the optimizer counts real updates only."""
    module, trainer, _ = counted(tmp_path, steps=5, every=5, poison=(3, 4))
    (p2, o2), (p4, o4), (p5, _) = module.states[2], module.states[4], module.states[5]
    assert all(torch.equal(p2[k], p4[k]) for k in p2)
    assert o2.keys() == o4.keys() and all(torch.equal(o2[p][k], o4[p][k]) for p in o2 for k in o2[p])
    assert not all(torch.equal(p4[k], p5[k]) for k in p4)
    assert {int(s["step"]) for s in trainer.optimizers[0].state.values()} == {3}
    assert module.nonfinite_steps == 2 and module.stop_reason is None


def test_nonfinite_run_stops_at_the_next_logging_step(tmp_path, counted):
    """Every step from 3 on has a NaN loss, max_nonfinite_steps=2, log_every_n_steps=5: the run of skipped steps is
    noticed at step 5 (the first read after it), the run stops with exit code 3 and last.ckpt at step 5, which holds
    the two real updates and the three skipped steps."""
    from canonlm.errors import RunStopped

    with pytest.raises(RunStopped) as e:
        counted(tmp_path, steps=20, every=5, poison=range(3, 21), max_nonfinite=2)
    assert e.value.exit_code == 3
    assert "2 optimizer steps in a row (steps 3-4)" in str(e.value) and "max_nonfinite_steps=2" in str(e.value)
    ck = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert ck["global_step"] == 5 and ck["canonlm"]["nonfinite_steps"] == 3
    assert {int(s["step"]) for s in ck["optimizer_states"][0]["state"].values()} == {2}


def test_logged_values_are_host_tensors(tmp_path, counted, monkeypatch):
    """Everything the module logs while training is logged at a logging step, as a CPU tensor: Lightning turns a
    Python number into a tensor on the module's device and reads progress-bar values back at every batch end, which
    on CUDA would be a host sync per step."""
    from canonlm.train.module import LMModule

    calls = []
    log = LMModule.log

    def spy(self, name, value, *args, **kwargs):
        if self.trainer.training:
            calls.append((self.trainer.global_step + 1, name, value))
        return log(self, name, value, *args, **kwargs)

    monkeypatch.setattr(LMModule, "log", spy)
    counted(tmp_path, steps=7, every=3)
    assert calls and {s for s, _, _ in calls} == _logging_steps(7, 3)
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for _, _, v in calls)
    assert {"train/loss", "train/grad_norm", "perf/tokens_per_s"} <= {n for _, n, _ in calls}


@pytest.mark.parametrize("fused", [True, False])
def test_fp16_mixed_clips_unscaled_gradients_and_skips_overflows(tmp_path, counted, fused):
    """16-mixed with a GradScaler (default scale 2**16, halved after a skipped step): the norm and the clipping see
    the unscaled gradients. Lightning unscales before its hooks for a plain optimizer; for a fused one it leaves
    unscaling to the optimizer, so the gradients in ``on_before_optimizer_step`` are still scaled and the hook must
    unscale them. A NaN step is skipped (by the scaler) and counted."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)  # Lightning maps 16-mixed on the CPU to bf16
    module, trainer, rows = counted(
        tmp_path, steps=3, every=1, clip=0.05, fused=fused, poison=(2,), precision=None, plugins=[plugin]
    )
    assert trainer.precision_plugin is plugin and scaler.get_scale() == 2.0**15
    logged = _metric(rows, "train/grad_norm")
    assert len(logged) == 3 and math.isnan(logged[1])
    for step, value, scale in ((1, logged[0], 2.0**16), (3, logged[2], 2.0**15)):
        copies = [torch.nn.Parameter(torch.zeros_like(g)) for g in module.grads_before[step]]
        for c, g in zip(copies, module.grads_before[step]):
            c.grad = g / scale if fused else g.clone()
        norm = torch.nn.utils.clip_grad_norm_(copies, 0.05)
        assert value == pytest.approx(float(norm), rel=1e-6)
        assert all(torch.allclose(c.grad, a, rtol=1e-6, atol=0) for c, a in zip(copies, module.grads_after[step]))
    p1, p2 = module.states[1][0], module.states[2][0]
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    assert module.nonfinite_steps == 1


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_device_side_skip_on_two_processes(strategy, tmp_path):
    """The device-side skip (fused AdamW's ``found_inf``, the default ``optim.fused=true``) under DDP and FSDP2
    (DTensor gradients and parameters) on 2 CPU processes: a run whose steps all blow up skips them on every rank
    and stops as one process does (tested in-process above): 3 skipped steps in a row, noticed at the logging step 4
    (log_every_n_steps=2), exit code 3. That the same default trains the same model on 2 processes as on one is
    tests/test_train.py::test_two_process_cpu_strategies_match_one_process."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *TINY,
        "data.batch_size=8",
        "data.val_windows=16",
        "trainer.val_check_interval=3",
        "trainer.log_every_n_steps=2",
        "callbacks=none",
        "logger=none",
        f"paths.log_dir={tmp_path}/logs",
        "run_name=dist_nan",
        f"strategy={strategy}",
        "trainer=ddp_sim",
        *(["strategy.param_dtype=fp32"] if strategy == "fsdp2" else []),
        "optim.lr=1e25",
        "sched.warmup_steps=0",
        "max_nonfinite_steps=3",
        "trainer.max_steps=20",
        "test=false",
    ]
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "WANDB_MODE": "disabled"}
    )
    msg = [ln for ln in p.stderr.splitlines() if ln.startswith("canonlm:")]
    assert p.returncode == 3 and msg and "3 optimizer steps in a row (steps 2-4)" in msg[0], (
        p.stdout[-3000:] + p.stderr[-5000:]
    )
