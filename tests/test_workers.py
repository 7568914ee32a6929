"""DataLoader workers (``data.num_workers``; ``trainer=gpu`` sets 4): the batches the training loop receives from
``SyntheticDataModule.train_dataloader`` are bit-identical for any worker count, also after a resume mid-stream
(oracle: the stream of a run without workers), and the GPU trainer preset composes with workers."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose

TINY = ["task=depo1_cpu", "model.size=2L64D", "task.N=8", "task.K=4", "task.vocab_V=6", "task.context=128"]
STEPS, ACCUMULATE, BATCH = 6, 2, 4  # 12 micro-batches of 2 windows


class Recorder(L.LightningModule):
    """Learns nothing: keeps a copy of every batch ``training_step`` receives, in order."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append({k: v.clone() for k, v in batch.items()})
        return self.w * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.fixture(scope="module")
def task():
    from canonlm.config.build import build_configs

    cfg = compose(TINY)
    task, _ = build_configs(cfg)
    return task, OmegaConf.to_container(cfg.task, resolve=True)


def _fit(task, tmp_path, workers: int, steps: int, ckpt: str | None = None, save: str | None = None):
    """Batches the training loop sees in a fit to ``steps`` optimizer steps (from ``ckpt`` if given)."""
    from canonlm.train.datamodule import SyntheticDataModule

    task_obj, task_cfg = task
    rec = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )
    dm = SyntheticDataModule(task_obj, task_cfg, batch_size=BATCH, num_workers=workers)
    trainer.fit(rec, datamodule=dm, ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(save)
    return rec.seen


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), k


@pytest.fixture(scope="module")
def no_workers(task, tmp_path_factory):
    return _fit(task, tmp_path_factory.mktemp("w0"), 0, STEPS)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_training_batches_do_not_depend_on_workers(task, no_workers, workers, tmp_path):
    assert len(no_workers) == STEPS * ACCUMULATE
    assert len({b["tokens"].numpy().tobytes() for b in no_workers}) == len(no_workers)  # distinct micro-batches
    _assert_same(_fit(task, tmp_path, workers, STEPS), no_workers)


def test_resume_with_workers_continues_the_stream(task, no_workers, tmp_path):
    """Train 2 steps without workers, save, resume with 3 workers to step 6: the resumed run sees exactly the
    micro-batches of steps 3-6 of the run without workers."""
    ckpt = str(tmp_path / "step2.ckpt")
    first = _fit(task, tmp_path, 0, 2, save=ckpt)
    _assert_same(first, no_workers[: 2 * ACCUMULATE])
    _assert_same(_fit(task, tmp_path, 3, STEPS, ckpt=ckpt), no_workers[2 * ACCUMULATE :])


@pytest.mark.parametrize(
    "overrides, workers",
    [
        (["trainer=gpu"], "gpu"),
        (["experiment=capo_N100K"], "gpu"),  # a paper preset that selects trainer: gpu
        (["trainer=gpu", "data.num_workers=2"], 2),  # the command line wins
        (["trainer=gpu", "debug=default"], 0),  # debug runs in the training process
        (["trainer=default"], 0),
    ],
)
def test_gpu_preset_uses_workers(overrides, workers):
    cfg = compose(overrides)
    if workers == "gpu":
        assert cfg.trainer.accelerator == "gpu" and cfg.data.num_workers > 0
    else:
        assert cfg.data.num_workers == workers
    assert "data" not in cfg.trainer and "trainer" not in cfg.trainer  # the preset's keys land where they belong
