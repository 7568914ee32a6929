"""``python -m canonlm.estimate <train.py overrides> [--world-size N] [--gpu h100|h200|a100|<GiB>] [--mfu X]``: what a
training run will cost, printed before it starts. Nothing is trained, built on a device or written.

Examples:
    python -m canonlm.estimate arch=llama canon=none model.size=24L2048D task=text task.data_dir=<prepared dir> \\
        task.context=4096 data.batch_size=48 trainer.max_steps=510000 strategy=fsdp2 --world-size 8 --gpu h100
    python -m canonlm.estimate -m canon=none,ABCD ... --world-size 32       # every job of a sweep, and their sum

The overrides are composed exactly as ``python train.py <overrides>`` composes them
(:func:`canonlm.config.strict.compose_jobs`, the same search path, defaults and sweep split) and checked by the same
function training runs first (:func:`canonlm.train.run.check_job`, without the checks of this machine's devices), so
a misspelt key, a bad value or a batch that does not split over the ranks is refused with the same one line. The
task is built as training builds it (``task=text`` reads the prepared corpus' ``meta.json`` for its vocabulary; the
token shards are not read), with one difference: a run is planned before its corpus exists. When a ``task=text``
corpus key is unset (a real-life preset's ``${paths.corpora.<name>}`` left ``???``), ``check_job(plan=True)`` builds
the model with the vocabulary the config declares for its tokenizer (``task.vocab_size``, e.g. the presets' Llama-2
32,000 or Llama-3 128,256; :class:`canonlm.data.text.TextPlan`) instead of refusing, as ``train.py`` still does.

Printed, per job (docs/estimate.md gives every formula and a hand check):

* **vocabulary**: where it comes from: the corpus' meta.json, or the declared tokenizer while the corpus is unset;
  a ``VOCABULARY DIFFERS`` line when the corpus' vocabulary is not the one ``task.vocab_size`` declares (the numbers
  are then the corpus' model's, and ``train.py`` refuses the run until ``task.vocab_size`` agrees or is null);
* **parameters**: ``CanonLM(cfg).num_params()`` on the meta device (:func:`canonlm.arch.memory.count_parameters`);
* **FLOPs per token**: the training FLOPs ``3 x forward`` of :func:`canonlm.arch.flops.flops_per_token` (dense
  convention), the number training's MFU uses (``CanonLM.flops_per_token``), with GLA / GDN at fla's chunk of 64
  as on a GPU;
* **tokens and steps**: ``trainer.max_steps`` (or ``data.max_tokens``, resolved to steps as training resolves it)
  x ``data.batch_size`` (the GLOBAL windows per optimizer step in canonlm) x ``task.context``; the split of the
  batch into ``world size x trainer.accumulate_grad_batches x micro-batch``;
* **memory per GPU** (:func:`canonlm.arch.memory.strategy_memory` over ``training_memory``, the arithmetic
  ``train.py``'s own refusal uses):
  parameters, gradients and AdamW state, sharded over the ranks under ``strategy=fsdp2`` and replicated under DDP;
  FSDP2's all-gathered units or DDP's gradient buckets; activations of the micro-batch without and with
  ``activation_checkpointing``, with document masking's costs under ``task.doc_mask=true`` (the attention mask for
  the ``model.kernels.attention`` / ``model.ops`` backend, the index tensors, ``doc_ids``; a line says which were
  counted); a lower bound;
* **GPU-hours and wall time**: ``total FLOPs / (peak x MFU)``, at the GPU's dense bf16 peak
  (:data:`canonlm.train.module.PEAK_FLOPS`) and an MFU that is said to be measured (a ``bench/gpu_step.py`` result of
  the same architecture, size, Canon set, context and GPU, in ``--bench`` files or ``docs/results/**/gpu_step.jsonl``)
  or assumed (:data:`ASSUMED_MFU`, or ``--mfu``).

A job whose memory (with the config's own ``activation_checkpointing``) exceeds the GPU's is refused with one line
on stderr naming ``data.batch_size`` (when the micro-batch's activations and data are the larger part) or
``model.size``, and the numbers, exit code 2 -- as any other bad config: nothing was written. Exit code 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from canonlm.errors import ConfigError

#: The repository's config tree (``train.py``'s ``config_path``).
CONF = Path(__file__).resolve().parents[2] / "conf"
#: Where measured ``bench/gpu_step.py`` results are looked for by default (``--bench`` adds files).
BENCH_GLOB = ("docs/results", "**/gpu_step.jsonl")

#: ``--gpu`` names: (the name ``torch.cuda.get_device_name`` reports, the key of ``PEAK_FLOPS``; memory in MiB as
#: ``nvidia-smi --query-gpu=memory.total`` reports it for the SXM parts).
GPUS = {
    "h100": ("NVIDIA H100 80GB HBM3", 81559),
    "h200": ("NVIDIA H200", 143771),
    "a100": ("NVIDIA A100-SXM4-80GB", 81920),
}
#: The MFU assumed when no measurement of the shape exists: an assumption, not a measurement (``--mfu`` overrides).
ASSUMED_MFU = 0.40


@dataclass(frozen=True)
class Gpu:
    """The target device: ``label`` (for the printout), ``name`` (``torch.cuda.get_device_name``'s, or None for a
    memory size given in GiB), ``memory`` (bytes per GPU), ``peak`` (dense bf16 FLOP/s, or None: unknown)."""

    label: str
    name: str | None
    memory: int
    peak: float | None


@dataclass
class Estimate:
    """What :func:`estimate_job` computes for one job (units: counts, FLOPs, bytes, seconds)."""

    label: str
    arch: str
    size: str
    canon: str
    context: int
    vocab: int
    n_params: int
    n_non_embedding: int
    flops: dict[str, float]
    steps: int
    steps_from: str
    batch: int
    world: int
    accumulate: int
    micro_batch: int
    strategy: str
    precision: str
    param_dtype: str | None
    checkpointing: bool
    memory: Any  # TrainingMemory without activation checkpointing
    memory_ckpt: Any  # TrainingMemory with activation checkpointing
    gpu: Gpu
    mfu: float
    mfu_from: str
    vocab_from: str = ""  # where the vocabulary comes from (the corpus' meta.json, or the declared tokenizer)
    vocab_differs: str | None = None  # the corpus' vocabulary differs from task.vocab_size's: the sentence saying so
    corpus_vocab: int | None = None  # the corpus' own vocabulary (meta.json) when it differs
    doc_mask: bool = False  # task.doc_mask: the memory counts document masking's costs

    @property
    def tokens(self) -> int:
        return self.steps * self.batch * self.context

    @property
    def total_flops(self) -> float:
        return self.flops["total"] * self.tokens

    @property
    def chosen(self):
        return self.memory_ckpt if self.checkpointing else self.memory

    @property
    def gpu_seconds(self) -> float | None:
        return None if self.gpu.peak is None else self.total_flops / (self.gpu.peak * self.mfu)


# ------------------------------------------------------------------------------------------------ command line


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError("--world-size", text, "a positive integer (the number of GPUs, all nodes)")
    return int(text)


def gpu_spec(text: str, peak: float | None = None) -> Gpu:
    """``--gpu``: a name of :data:`GPUS` (its memory and ``PEAK_FLOPS`` entry) or a memory size in GiB (peak
    unknown unless ``--peak-flops``). Raises ConfigError."""
    key = str(text).strip().lower()
    if key in GPUS:
        from canonlm.train.module import peak_flops

        name, mib = GPUS[key]
        return Gpu(f"{name} ({mib} MiB)", name, mib * 2**20, peak if peak is not None else peak_flops(name))
    try:
        gib = float(key)
    except ValueError:
        gib = -1.0
    if not math.isfinite(gib) or gib <= 0:
        raise ConfigError("--gpu", text, f"{' | '.join(GPUS)} or a memory size in GiB (e.g. 40)")
    return Gpu(f"{gib:g} GiB GPU", None, int(gib * 2**30), peak)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, the train.py overrides): the options of this command anywhere on the line, the rest for
    Hydra. Raises ConfigError for a bad option value."""
    ap = argparse.ArgumentParser(
        prog="python -m canonlm.estimate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=True,
    )
    ap.add_argument("--world-size", default=None, help="GPUs in all (default: trainer.devices x trainer.num_nodes)")
    ap.add_argument("--gpu", default="h100", help=f"{' | '.join(GPUS)} | <GiB per GPU> (default h100)")
    ap.add_argument(
        "--mfu",
        default=None,
        help=f"model FLOPs utilisation in (0, 1] (default: a measured value "
        f"for the shape, else {ASSUMED_MFU}, assumed)",
    )
    ap.add_argument("--peak-flops", default=None, help="dense bf16 FLOP/s of one GPU (default: the table's)")
    ap.add_argument(
        "--bench",
        action="append",
        default=[],
        help="a bench/gpu_step.py gpu_step.jsonl to take measured MFU from (repeatable)",
    )

    def error(message: str):
        raise ConfigError(
            "command line",
            " ".join(argv),
            f"python -m canonlm.estimate [train.py overrides] [--world-size N] [--gpu NAME|GiB] [--mfu X] ({message})",
        )

    ap.error = error  # type: ignore[method-assign]
    opts, rest = ap.parse_known_args(argv)
    for name in ("mfu", "peak_flops"):
        v = getattr(opts, name)
        if v is None:
            continue
        try:
            f = float(v)
        except ValueError:
            f = float("nan")
        ok = 0 < f <= 1 if name == "mfu" else 0 < f < math.inf
        if not ok:
            raise ConfigError(
                f"--{name.replace('_', '-')}",
                v,
                "a number in (0, 1]" if name == "mfu" else "a positive number of FLOP/s (e.g. 989e12)",
            )
        setattr(opts, name, f)
    if opts.world_size is not None:
        opts.world_size = _positive_int(opts.world_size)
    return opts, rest


# ------------------------------------------------------------------------------------------------ measured MFU


def _bench_files(extra: list[str]) -> list[Path]:
    root = CONF.parent / BENCH_GLOB[0]
    found = sorted(root.glob(BENCH_GLOB[1])) if root.is_dir() else []
    return [*[Path(p) for p in extra], *found]


def _shape_size(shape: str) -> str | None:
    """``<L>L<D>D`` of a ``bench/gpu_step.py`` shape name (``"1.3B"`` is 24L2048D there)."""
    return {"1.3B": "24L2048D"}.get(shape, shape if re.fullmatch(r"\d+L\d+D", str(shape)) else None)


def measured_mfu(
    files: list[Path], gpu: Gpu, arch: str, size: str, canon: str, context: int
) -> tuple[float, str] | None:
    """The best MFU of the ``bench/gpu_step.py`` records in ``files`` that measured this shape: status ``ok``, the
    GPU's exact name in the file's header, the architecture (``model``), ``<L>L<D>D``, the Canon set and the
    context; (mfu, where it comes from) or None. A file that cannot be read is skipped."""
    best: tuple[float, str] | None = None
    for f in files:
        try:
            lines = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            continue
        header = next((r for r in lines if r.get("record") == "header"), {})
        if gpu.name is None or header.get("device_name") != gpu.name:
            continue
        for r in lines:
            if r.get("record") != "variant" or r.get("status") != "ok" or r.get("mfu") is None:
                continue
            if (r.get("model"), _shape_size(r.get("shape")), r.get("seq_len")) != (arch, size, context):
                continue
            if str(r.get("canon") or "none") not in ({canon, "none", ""} if canon in ("", "none") else {canon}):
                continue
            if best is None or r["mfu"] > best[0]:
                best = (float(r["mfu"]), f"measured: {f} variant {r.get('name')}")
    return best


# ------------------------------------------------------------------------------------------------ the estimate


def training_flops(mcfg) -> dict[str, float]:
    """Training FLOPs per token of the model ``mcfg`` on its context, by component (``"total"`` = 3 x forward): the
    number training's MFU uses (``CanonLM.flops_per_token``: :func:`canonlm.arch.flops.flops_per_token`, dense
    convention) with GLA / GDN at the GPU kernels' chunk (``canonlm.arch.model._FLA_CHUNK``)."""
    from canonlm.arch.flops import flops_per_token

    from canonlm.arch.model import _FLA_CHUNK  # the chunk of fla's GLA / GDN kernels, which run them on a GPU

    chunk = _FLA_CHUNK if mcfg.arch in ("gla", "gdn") else None
    return flops_per_token(mcfg, int(mcfg.max_seq_len), training=True, chunk_size=chunk)


def world_size_of(cfg, given: int | None) -> int:
    """``--world-size``, else ``trainer.devices x trainer.num_nodes`` when both are integers. Raises ConfigError."""
    if given is not None:
        return given
    from canonlm.train.run import _declared_world_size

    world = _declared_world_size(cfg)
    if world is None:
        raise ConfigError(
            "--world-size",
            None,
            f"a positive integer: trainer.devices={cfg.trainer.get('devices')!r}"
            " leaves the number of GPUs to the machine, so give it",
        )
    return world


def estimate_job(cfg, world: int, gpu: Gpu, mfu: float | None, bench: list[str], label: str = "") -> Estimate:
    """The estimate of one composed job ``cfg`` (a train.py config, within its ``Job.active()``) on ``world`` GPUs
    of kind ``gpu``: checks it as training does (:func:`canonlm.train.run.check_job` with ``plan=True``: no device
    checks, an unset ``text`` corpus planned with ``task.vocab_size``, a vocabulary that differs from it reported
    rather than refused; this resolves ``data.max_tokens`` into ``trainer.max_steps``), then computes
    :class:`Estimate` (memory with ``task.doc_mask``'s costs). Raises ConfigError."""
    from omegaconf import OmegaConf

    from canonlm.arch.memory import count_parameters, strategy_memory
    from canonlm.config.rules import micro_batch, plain
    from canonlm.train.run import check_job

    task, mcfg, _ = check_job(cfg, device_checks=False, plan=True)
    doc_mask = OmegaConf.select(cfg, "task.doc_mask", default=False) is True
    batch = int(plain(cfg.data.batch_size))
    accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    mb = micro_batch(batch, world, accumulate)
    T = int(mcfg.max_seq_len)
    n = count_parameters(mcfg)
    emb = mcfg.vocab_size * mcfg.d_model
    flops = training_flops(mcfg)
    strategy = str(cfg.strategy.name)
    param_dtype = str(cfg.strategy.get("param_dtype")) if strategy == "fsdp2" else None
    common = dict(
        strategy=strategy,
        world_size=world,
        precision=str(cfg.trainer.precision),
        param_dtype=param_dtype,
        accumulate=accumulate,
        amsgrad=bool(cfg.optim.get("amsgrad")),
        n_params=n,
        doc_mask=doc_mask,
    )
    mem = strategy_memory(mcfg, mb, T, activation_checkpointing=False, **common)
    mem_ck = strategy_memory(mcfg, mb, T, activation_checkpointing=True, **common)
    vocab_from = task.vocab_source() if hasattr(task, "vocab_source") else f"task {task.name}"
    differs = task.vocab_mismatch() if hasattr(task, "vocab_mismatch") else None

    max_tokens = plain(OmegaConf.select(cfg, "data.max_tokens", default=None))
    steps_from = f"data.max_tokens={max_tokens:g}" if max_tokens is not None else "trainer.max_steps"
    size = f"{mcfg.n_layers}L{mcfg.d_model}D"
    canon = mcfg.canon.set or "none"
    if mfu is not None:
        mfu_from = "given (--mfu)"
    else:
        hit = measured_mfu(_bench_files(bench), gpu, mcfg.arch, size, canon, T)
        mfu, mfu_from = (
            hit
            if hit
            else (ASSUMED_MFU, "ASSUMED: no bench/gpu_step.py measurement of this shape on this GPU; --mfu to override")
        )
    return Estimate(
        label=label,
        arch=mcfg.arch,
        size=size,
        canon=canon,
        context=T,
        vocab=mcfg.vocab_size,
        n_params=n,
        n_non_embedding=n - emb - (0 if mcfg.tie_embeddings else emb),
        flops=flops,
        steps=int(cfg.trainer.max_steps),
        steps_from=steps_from,
        batch=batch,
        world=world,
        accumulate=accumulate,
        micro_batch=mb,
        strategy=strategy,
        precision=str(cfg.trainer.precision),
        param_dtype=param_dtype,
        checkpointing=bool(cfg.get("activation_checkpointing", False)),
        memory=mem,
        memory_ckpt=mem_ck,
        gpu=gpu,
        mfu=float(mfu),
        mfu_from=mfu_from,
        vocab_from=vocab_from,
        vocab_differs=differs,
        corpus_vocab=task.corpus_vocab_size if differs else None,
        doc_mask=doc_mask,
    )


def refusal(e: Estimate, model_size: Any) -> ConfigError | None:
    """The over-memory refusal of :func:`estimate_job`'s result (the rule of ``canonlm.train.run.check_memory``: the
    key is ``data.batch_size`` when the micro-batch's activations and data outweigh the model's state, else
    ``model.size``), or None when the job fits the GPU."""
    from canonlm.arch.memory import human_bytes

    m = e.chosen
    if m.total <= e.gpu.memory:
        return None
    key, value = ("data.batch_size", e.batch) if m.batch_dominated else ("model.size", model_size)
    hint = ""
    if not e.checkpointing and e.memory_ckpt.total <= e.gpu.memory:
        hint = f"; with activation_checkpointing=true it needs {human_bytes(e.memory_ckpt.total)}, which fits"
    return ConfigError(
        key,
        value,
        f"a run that fits in memory: training needs at least {human_bytes(m.total)} per GPU "
        f"({m.describe()}; micro-batch {e.micro_batch} windows x {e.context} tokens, {e.strategy} over "
        f"{e.world} GPU{'s' if e.world > 1 else ''}) and one {e.gpu.label} has "
        f"{human_bytes(e.gpu.memory)}{hint}",
    )


def _duration(seconds: float) -> str:
    days, rest = divmod(seconds, 86400)
    return f"{int(days)} d {rest / 3600:.1f} h" if days else f"{seconds / 3600:.1f} h"


def report(e: Estimate) -> str:
    """The printout of one :class:`Estimate` (docs/estimate.md explains each line)."""
    from canonlm.arch.memory import human_bytes

    f = e.flops
    matmul = f["lm_head"] + f["mixer_proj"] + f["mlp"]
    seq = f["attention"] + f["scan_intra"] + f["scan_state"] + f["scan_solve"]
    conv = f["canon"] + f["short_conv"]
    a, b = e.memory, e.memory_ckpt
    shard = f"sharded over {e.world}" if e.strategy == "fsdp2" else f"replicated on each of {e.world}"
    dt = f", FSDP2 param_dtype {e.param_dtype}" if e.param_dtype else ""
    rows = [
        ("parameters", a.parameters, b.parameters),
        ("gradients", a.gradients, b.gradients),
        ("AdamW state", a.optimizer, b.optimizer),
    ]
    if a.gathered:
        rows.append(("FSDP2 all-gathered root + 1 block", a.gathered, b.gathered))
    if a.buckets:
        rows.append(("DDP gradient buckets", a.buckets, b.buckets))
    rows += [
        ("activations", a.activations, b.activations),
        ("batch data", a.batch, b.batch),
        ("total (lower bound; max(grads, acts))" if not a.accumulate else "total (lower bound)", a.total, b.total),
    ]
    gs = e.gpu_seconds
    peak = "unknown peak (give --peak-flops)" if e.gpu.peak is None else f"{e.gpu.peak / 1e12:g} TFLOP/s dense bf16"
    out = [
        f"estimate{' ' + e.label if e.label else ''}: {e.arch} {e.size}, Canon {e.canon}, context {e.context}, "
        f"vocabulary {e.vocab} (nothing is trained or written)",
        f"  vocabulary       {e.vocab:,} ({e.vocab_from})",
    ]
    if e.vocab_differs:
        out.append(
            f"  VOCABULARY DIFFERS from the preset's: {e.vocab_differs}. The parameters, FLOPs, memory and "
            f"GPU-hours below are for the corpus' {e.vocab:,}; train.py refuses this run until "
            f"task.vocab_size={e.corpus_vocab} (or null) is given"
        )
    out += [
        f"  parameters       {e.n_params:,} ({e.n_params / 1e9:.3f} B; without embedding and LM head "
        f"{e.n_non_embedding:,})",
        f"  FLOPs per token  {f['total']:.4e} training = 3 x forward {f['forward']:.4e} (weight matmuls "
        f"{matmul:.4e}, attention/scan {seq:.4e}, convolutions {conv:.4e}); 6N = {6 * e.n_params:.4e}",
        f"  tokens           {e.steps:,} steps ({e.steps_from}) x {e.batch} windows x {e.context} = {e.tokens:,} "
        f"({e.tokens / 1e9:.2f} B)",
        f"  batch split      {e.batch} = {e.world} GPUs x accumulate {e.accumulate} x micro-batch {e.micro_batch}",
        f"  memory per GPU   {e.strategy}, state {shard}, trainer.precision {e.precision}{dt}; GPU {e.gpu.label} = "
        f"{human_bytes(e.gpu.memory)}",
        f"    {'':36s}{'no checkpointing':>18s}{'checkpointing':>18s}",
        *[f"    {name:36s}{human_bytes(x):>18s}{human_bytes(y):>18s}" for name, x, y in rows],
        (
            "    document masking (task.doc_mask=true), in the rows above: " + a.doc_masking.describe()
            if a.doc_masking is not None
            else "    document masking off (task.doc_mask=false): no mask, index tensors or doc_ids counted"
        ),
        f"    this config: activation_checkpointing={str(e.checkpointing).lower()} -> "
        f"{human_bytes(e.chosen.total)} of {human_bytes(e.gpu.memory)} "
        f"({100 * e.chosen.total / e.gpu.memory:.0f} %)",
        f"  compute          {e.total_flops:.4e} FLOPs = {f['total']:.4e} x {e.tokens:,} tokens; MFU {e.mfu:g} "
        f"({e.mfu_from}) at {peak}",
    ]
    if gs is None:
        out.append("  GPU-hours        n/a (the GPU's peak FLOP/s is unknown: give --peak-flops)")
    else:
        out.append(
            f"  GPU-hours        {gs / 3600:,.0f} GPU-h; wall time {_duration(gs / e.world)} on {e.world} GPUs "
            "(training steps only: no evaluation, checkpointing or restarts)"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """The command (module docstring). Returns 0; a refusal prints ``canonlm: error: <one line>`` on stderr and
    returns 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts, overrides = parse_args(argv)
        from canonlm.config.resolvers import register_resolvers
        from canonlm.config.strict import compose_jobs, runs_jobs

        register_resolvers()
        if not runs_jobs(overrides):
            raise ConfigError(
                "command line",
                " ".join(overrides),
                "train.py overrides (--cfg, --help and --info are train.py's own: python train.py ... --cfg job)",
            )
        jobs = compose_jobs(overrides, CONF, "train")
        gpu = gpu_spec(opts.gpu, opts.peak_flops)
        estimates = []
        for i, job in enumerate(jobs):
            with job.active() as cfg:
                from canonlm.config.strict import interpolation_errors

                with interpolation_errors(cfg):
                    world = world_size_of(cfg, opts.world_size)
                    label = f"job {i} ({' '.join(job.overrides)})" if len(jobs) > 1 else ""
                    est = estimate_job(cfg, world, gpu, opts.mfu, opts.bench, label)
                    err = refusal(est, cfg.model.get("size"))
            if err is not None:
                raise err
            estimates.append(est)
    except ConfigError as e:
        print(f"canonlm: error: {e}", file=sys.stderr, flush=True)
        return 2
    print("\n\n".join(report(e) for e in estimates))
    if len(estimates) > 1:
        secs = [e.gpu_seconds for e in estimates]
        total = "n/a" if None in secs else f"{sum(secs) / 3600:,.0f} GPU-h"
        print(f"\nsweep: {len(estimates)} jobs, {sum(e.total_flops for e in estimates):.4e} FLOPs, {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
