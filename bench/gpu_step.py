"""GPU training-step benchmark: canonlm Llama without / with Canon-ABCD (every Canon backend, eager and compiled),
transformers' ``LlamaForCausalLM`` at the same shape, and GLA / GDN / Mamba2 with their own short conv (``canon=b``)
and with Canon-AbCD -- all measured one after another in ONE process, on one device (issue 25, deliverable 5).

One training step (as ``train.py`` runs it): bf16 autocast over fp32 weights, forward, training's loss
(``canonlm.arch.loss.lm_loss``: cross-entropy over the next-token targets on fp32 logits; compiled with the blocks in
a compiled variant, as ``LMModule.configure_model`` does), backward, gradient-norm clipping at 1.0, fused AdamW step, ``zero_grad``. Models
are built and placed as training does: ``CanonLM(build_model_config(..., kernels={"canon": backend}))`` on the
device, ``model.place(device, torch.bfloat16, compiled=<bool>)`` (``canonlm.train.module.LMModule.place_model``),
then for a compiled variant ``block.compile()`` on every block (``LMModule.configure_model``; transformers' model:
every decoder layer). The linear models are the ``conf/arch/<name>.yaml`` presets at the shape's layers and width
(composed with Hydra as ``train.py`` composes them; from the same YAML files when Hydra is not installed).

Shapes (``--shapes``): ``12L768D`` (12 layers, d_model 768, 12 heads, SwiGLU d_ff 2048, untied, vocab 32,000,
T=2048, batch 8); ``1.3B`` (the paper's 1.3B Llama: 24 layers, d_model 2048, 32 heads of 64, d_ff 5632, vocab
32,000, T=4096, the largest batch of 8, 4, 2, 1 that fits: tried in that order, a ``torch.cuda.OutOfMemoryError`` in
the first step frees the memory and tries the next; later variants of the shape start from the batch that fitted);
``tiny`` (2 layers, d_model 64, 2 heads, d_ff 192, vocab 256, T=64, batch 2; the CPU mode ``--tiny``). Linear models
take the shape's layers and width (``<L>L<D>D``) with their preset's own heads and widths.

Each result (one JSON line per variant in ``OUT/gpu_step.jsonl``, appended as it finishes; a header line first with
the device, library versions and canonlm commit; a ``ratios`` line last):

* ``step_ms``: median of ``--steps`` step times after ``--warmup`` steps (the first of which is the first step),
  each timed with CUDA events around the step on CUDA (``time.perf_counter`` on CPU).
* ``tokens_per_s``: batch x T / median step.
* ``mfu``: tokens/s x ``model.flops_per_token(T)`` / the device's dense bf16 peak
  (``canonlm.train.module.peak_flops(torch.cuda.get_device_name())``, or ``--peak-flops``; None, printed ``n/a``,
  for a device not in that table and on CPU). transformers' model is counted with the FLOPs of the equivalent canonlm model (same shape, no
  Canon), so the two MFUs compare.
* ``peak_gib``: ``torch.cuda.max_memory_allocated`` after the variant, reset before it was built (weights, AdamW
  state, activations); None on CPU.
* ``first_step_s``: wall time from the start of the first step (model built, moved and placed) until its optimizer
  step has finished (``torch.cuda.synchronize``): compilation, Triton autotuning and cache loading show here. The
  kernel cache is canonlm's (``canonlm.utils.kernel_cache.configure()``: ``$CANONLM_KERNEL_CACHE``, else
  ``<canonlm cache>/kernels``; its root is in the header's options), so a second run shows the warm first step.
* ``backends`` / ``canon_backends``: ``model.backends`` and ``model.canon_backends`` after placement (what ran).
* ``status``: ``ok``; ``failed`` with ``reason`` (an import error, a kernel that cannot run here, OOM at every
  batch, ...); ``timeout`` (``--budget-s`` per variant was spent: the reason says in which phase); ``skipped``
  (``--max-minutes`` for the whole run was spent). A failed variant never stops the others; each variant's model,
  optimizer and compiled graphs are freed (``torch._dynamo.reset``, ``torch.cuda.empty_cache``) before the next.

Printed last, with their targets (issue 25) and whether each is met -- reported, never asserted:

* ``canon_overhead``: step(Canon-ABCD) / step(no Canon) per Canon backend and compile mode at each shape
  (target <= 1.15 at 12L768D, <= 1.10 at 1.3B);
* ``vs_transformers``: step(LlamaForCausalLM) / step(canonlm Llama, no Canon) per compile mode (target >= 1.3 at
  12L768D and 1.3B);
* ``linear_overhead``: step(Canon-AbCD) / step(``b``) for GLA, GDN and Mamba2 (target <= 1.10 at 12L768D);
* ``doc_mask_overhead``: step(with ``doc_ids``) / step(the same variant without) -- no target, reported.

Document masking (``--doc-models``, default every canonlm model of ``--models``): for each of those models one more
eager variant of its Canon set (Llama ``ABCD``, a linear preset ``AbCD``) with the ``auto`` Canon backend (else the
first of ``--backends`` / ``--linear-backends``), named ``.../docs`` and run right after its plain twin, whose step
passes ``doc_ids`` to ``CanonLM.forward`` (every sequence op restarts at each document: ``canonlm.arch.doc_mask``) and
counts only the targets inside a document (the loss mask). Each window packs documents of random lengths, uniform in
``1 .. 2·--doc-len - 1`` (mean ``--doc-len``, default T/4: 512 at 12L768D, 16 tiny), cut at the window's end, drawn
from a fixed seed (the same batch for every variant of a shape); the record's ``docs`` says how many. MFU counts the
model's FLOPs as without masking (``flops_per_token`` does not know the documents).

Ratios are taken per token (step time / (batch x T)), which is the step ratio when both used the same batch.

Usage::

    python bench/gpu_step.py --out DIR                 # every variant, both shapes, ordered so that what fits
                                                       # --max-minutes (default 3.5) runs first
    python bench/gpu_step.py --quick --out DIR         # 12L768D, Canon auto backend, fewer steps: a short allocation
    python bench/gpu_step.py --tiny --out DIR          # CPU, the tiny shape, every variant a CPU can run, 3 steps
                                                       # after 1, 1 thread, compiled with aot_eager (the tests)
    python bench/gpu_step.py --shapes 12L768D --models llama,hf --backends fla,torch --compile eager --out DIR
    python bench/gpu_step.py --quick --list            # the variants it would run, in order, and nothing else

Options pick the shapes (``--shapes``), models (``--models``: llama, hf, any conf/arch preset), the Canon backends
(``--backends`` for the Llama, ``--linear-backends``; ``available`` = ``auto`` and every backend of
``canonlm.ops.canon.BACKENDS`` that ``available_backends`` finds runnable on the device, the ``reference`` oracle only
on CPU, plus ``fla_gluon``, fla with its Gluon conv kernels (``FLA_CONV_GLUON=1``), where fla runs and triton has
Gluon; a name that cannot run is measured as a failure), compile modes (``--compile eager,compiled``,
``--compile-models``, ``--compile-backends``, ``--compile-backend``), ``--steps``, ``--warmup``, ``--batch``, the time
limits (``--budget-s`` per variant, ``--max-minutes`` for the run), document masking (``--doc-models``,
``--doc-len``) and ``--peak-flops`` (a device not in canonlm's table). ``--out`` must not hold a previous run's files
(nothing is overwritten). ``--list`` prints the variants and exits (planned for CUDA unless ``--tiny`` or ``--device
cpu``; the device is not checked).

The issue's table (12L768D, then the 1.3B shape, every variant; at most an hour by its ``--max-minutes``)::

    python bench/gpu_step.py --shapes 12L768D,1.3B --steps 10 --warmup 3 --budget-s 300 --max-minutes 60 --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
JSONL, MD = "gpu_step.jsonl", "gpu_step.md"


@dataclasses.dataclass(frozen=True)
class Shape:
    """One model / data shape. ``batches``: per-device batch sizes tried in order (the first that fits is used)."""

    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    vocab: int
    seq_len: int
    batches: tuple[int, ...]

    @property
    def size(self) -> str:
        return f"{self.n_layers}L{self.d_model}D"


SHAPES = {
    "12L768D": Shape(12, 768, 12, 2048, 32000, 2048, (8,)),
    "1.3B": Shape(24, 2048, 32, 5632, 32000, 4096, (8, 4, 2, 1)),
    "tiny": Shape(2, 64, 2, 192, 256, 64, (2,)),
}
#: Targets of issue 25 (reported with each ratio, never asserted). ``canon_overhead`` per shape.
CANON_TARGET = {"12L768D": 1.15, "1.3B": 1.10}
LINEAR_TARGET = {"12L768D": 1.10}
HF_TARGET = {"12L768D": 1.3, "1.3B": 1.3}
MODES = ("eager", "compiled")
VERSIONED = (
    "torch",
    "triton",
    "fla-core",
    "mamba-ssm",
    "causal-conv1d",
    "transformers",
    "lightning",
    "hydra-core",
    "canonlm",
)


def linear_presets() -> list[str]:
    """Names of the ``conf/arch`` presets other than ``llama`` (gla, gla5, gdn, gdn2, mamba2, ...)."""
    return sorted(p.stem for p in (CONF / "arch").glob("*.yaml") if p.stem != "llama")


def full_linear_set(arch: str) -> str:
    """The paper's Canon set of a linear preset: ``AbCD``; ``Ab`` for a preset without an MLP (``mamba2_nomlp``)."""
    return "Ab" if arch == "mamba2_nomlp" else "AbCD"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One measured configuration. ``model``: ``llama`` (canonlm), ``hf`` (transformers' LlamaForCausalLM) or a
    linear preset; ``canon``: ``none`` / ``ABCD`` / ``b`` / ``AbCD``; ``backend``: ``model.kernels.canon`` (``-``
    where no Canon layer exists); ``docs``: document masking (``doc_ids`` packed in every window, the module
    docstring)."""

    shape: str
    model: str
    canon: str
    backend: str
    compiled: bool
    docs: bool = False

    @property
    def mode(self) -> str:
        return "compiled" if self.compiled else "eager"

    @property
    def name(self) -> str:
        return f"{self.shape}/{self.model}/{self.canon}/{self.backend}/{self.mode}" + ("/docs" if self.docs else "")


# ------------------------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------------------------


def _yaml_preset(arch: str) -> dict:
    """``conf/arch/<arch>.yaml``'s model keys without Hydra: its ``defaults`` presets of the same group first, then
    its own keys (``_self_`` last, as every preset lists it); group overrides (``override /canon...``) are left out."""
    import yaml

    node = yaml.safe_load((CONF / "arch" / f"{arch}.yaml").read_text()) or {}
    out: dict = {}
    for d in node.pop("defaults", None) or []:
        if isinstance(d, str) and d != "_self_":
            out.update(_yaml_preset(d))
    out.update(node)
    return out


def preset_model(arch: str, size: str) -> tuple[dict, str]:
    """The ``model`` node of ``python train.py arch=<arch> model.size=<size>`` as a plain dict, and how it was
    composed (``hydra`` or ``yaml`` when hydra-core / omegaconf are not installed)."""
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from omegaconf import OmegaConf
    except ImportError:
        model = _yaml_preset(arch)
        model["size"] = size
        return model, "yaml"
    from canonlm.config.resolvers import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="train", overrides=[f"arch={arch}", f"model.size={size}"])
    finally:
        GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg.model, resolve=True), "hydra"


def model_config(v: Variant, shape: Shape):
    """The canonlm ``ModelConfig`` of a variant (for ``hf``: the equivalent canonlm Llama without Canon)."""
    from canonlm.arch.config import build_model_config

    kernels = {} if v.backend in ("-", "auto") else {"canon": "fla" if v.backend == GLUON else v.backend}
    canon = {"set": "" if v.canon == "none" else v.canon}
    if v.model in ("llama", "hf"):
        model = {
            "arch": "llama",
            "n_layers": shape.n_layers,
            "d_model": shape.d_model,
            "n_heads": shape.n_heads,
            "d_ff": shape.d_ff,
            "tie_embeddings": False,
        }
        pos = {"type": "rope"}
    else:
        model, _ = preset_model(v.model, shape.size)
        pos = {"type": "nope"}
    return build_model_config(model, canon, pos, vocab_size=shape.vocab, max_seq_len=shape.seq_len, kernels=kernels)


def hf_llama(shape: Shape):
    """transformers' ``LlamaForCausalLM`` (sdpa attention) at the shape: the canonlm Llama without Canon, layer for
    layer (SwiGLU, RMSNorm eps 1e-6, untied, no biases, no GQA)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.d_model,
        intermediate_size=shape.d_ff,
        num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_heads,
        max_position_embeddings=shape.seq_len,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


GLUON = "fla_gluon"  # the fla backend with fla-core 0.6's Gluon conv kernels (FLA_CONV_GLUON=1: no autotuning)


@contextmanager
def gluon_env(backend: str) -> Iterator[None]:
    """For the :data:`GLUON` pseudo-backend, ``FLA_CONV_GLUON=1`` while the variant runs (fla-core 0.6.0 reads it at
    every call: ``fla/backends.py``, ``BaseBackend.is_enabled``; the Gluon kernels refuse a process with
    ``torch.distributed`` initialised and fall back to the Triton ones, ``fla/modules/causal_conv1d/backends/
    gluon.py``); any other backend runs with the variable as it was."""
    if backend != GLUON:
        yield
        return
    old = os.environ.get("FLA_CONV_GLUON")
    os.environ["FLA_CONV_GLUON"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLA_CONV_GLUON", None)
        else:
            os.environ["FLA_CONV_GLUON"] = old


def build(v: Variant, shape: Shape, device, compile_backend: str = "inductor") -> tuple[Any, dict]:
    """Build, move and place the variant's model (and compile its blocks, lazily, with ``torch.compile``'s
    ``compile_backend``; training's is the default, ``inductor``). Returns (model, facts)."""
    import torch

    facts: dict = {}
    if v.model == "hf":
        with torch.device(device):
            model = hf_llama(shape)
        facts["backends"] = {"attention": model.config._attn_implementation}
        facts["canon_backends"] = {}
        blocks = model.model.layers
    else:
        from canonlm.arch.model import CanonLM

        cfg = model_config(v, shape)
        with torch.device(device):  # on the device: no CPU init of 1.3B parameters (place() resolves for it below)
            model = CanonLM(cfg)
        model.to(device)
        model.place(device, torch.bfloat16, compiled=v.compiled)
        facts["backends"] = dict(model.backends)
        facts["canon_backends"] = dict(model.canon_backends)
        blocks = model.blocks
    model.train()
    if v.compiled:
        for b in blocks:
            b.compile(backend=compile_backend)
    facts["params"] = sum(p.numel() for p in model.parameters())
    return model, facts


def flops_per_token(v: Variant, shape: Shape, model) -> float:
    """``CanonLM.flops_per_token(T)`` of the variant's model; for transformers', that of the equivalent canonlm
    model (built on the meta device: nothing allocated)."""
    import torch

    if v.model != "hf":
        return float(model.flops_per_token(shape.seq_len))
    from canonlm.arch.model import CanonLM

    with torch.device("meta"):
        twin = CanonLM(model_config(Variant(v.shape, "llama", "none", "-", v.compiled), shape))
    return float(twin.flops_per_token(shape.seq_len))


# ------------------------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------------------------


class VariantTimeout(BaseException):
    """Raised by SIGALRM when a variant's time is spent (a BaseException, so that no library's ``except Exception``
    swallows it)."""


@contextmanager
def alarm_at(deadline: float) -> Iterator[None]:
    """Raise :class:`VariantTimeout` in the main thread at ``time.monotonic() == deadline`` (SIGALRM; a no-op off the
    main thread or without ``setitimer``: the per-step checks still stop the measured loop)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise VariantTimeout()

    old = signal.signal(signal.SIGALRM, fire)
    t0 = time.monotonic()
    before, _ = signal.setitimer(signal.ITIMER_REAL, max(deadline - t0, 1e-4))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if before > 0:  # someone else's timer (e.g. pytest-timeout's) was running: give it back what it had left
            signal.setitimer(signal.ITIMER_REAL, max(before - (time.monotonic() - t0), 1e-4))


def doc_ids_for(batch: int, seq_len: int, mean_len: int, device=None):
    """(batch, seq_len) int64 document ids of windows packing documents of random lengths, uniform in
    ``1 .. 2·mean_len - 1`` (mean ``mean_len`` tokens), the last one of each row cut at its end; drawn from a fixed
    seed (``torch.Generator().manual_seed(0)``), so every variant of a shape gets the same documents. Row b's ids run
    0, 0, ..., 1, ... (a change of id starts a document: ``canonlm.ops.varlen``). Raises ValueError for
    ``mean_len < 1``."""
    import torch

    if mean_len < 1:
        raise ValueError(f"doc_ids_for: mean_len={mean_len}; allowed: an integer >= 1")
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(batch):
        lengths, total = [], 0
        while total < seq_len:
            n = int(torch.randint(1, 2 * mean_len, (1,), generator=g))
            lengths.append(min(n, seq_len - total))
            total += lengths[-1]
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows).to(device)


class Stepper:
    """One training step of a model on a fixed random batch (see the module docstring); with ``doc_len`` the batch
    packs documents (:func:`doc_ids_for`), passed as ``doc_ids``, and the loss counts the targets inside a document."""

    def __init__(
        self,
        model,
        hf: bool,
        batch: int,
        shape: Shape,
        device,
        compiled: bool = False,
        compile_backend: str = "inductor",
        doc_len: int | None = None,
    ):
        import torch

        from canonlm.arch.loss import lm_loss

        self.model, self.hf, self.device, self.V = model, hf, device, shape.vocab
        # training's loss (canonlm.arch.loss.lm_loss: fp32 upcast, token-summed cross entropy), compiled with the
        # blocks as LMModule.configure_model compiles it; the same for transformers' model, so the two compare
        self.loss_fn = torch.compile(lm_loss, backend=compile_backend) if compiled else lm_loss
        g = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randint(0, shape.vocab, (batch, shape.seq_len), device=device, generator=g)
        self.doc_ids = self.mask = None
        if doc_len is not None:
            self.doc_ids = doc_ids_for(batch, shape.seq_len, doc_len, device)
            self.mask = self.doc_ids[:, 1:] == self.doc_ids[:, :-1]  # the next token is in the same document
        params = [p for p in model.parameters() if p.requires_grad]
        # conf/optim/adamw.yaml; weight decay on matrices only, as training's parameter groups
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.03},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        hp = dict(lr=2e-3, betas=(0.9, 0.98), eps=1e-6)
        try:
            self.opt, self.fused = torch.optim.AdamW(groups, fused=True, **hp), True
        except (RuntimeError, TypeError):  # a torch without the fused kernel for this device
            self.opt, self.fused = torch.optim.AdamW(groups, **hp), False
        self.params = params
        self.loss = None

    def __call__(self) -> None:
        import torch

        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            out = self.model(self.x) if self.doc_ids is None else self.model(self.x, doc_ids=self.doc_ids)
            logits = out.logits if self.hf else out
            out = self.loss_fn(logits[:, :-1], self.x[:, 1:], self.mask)
            loss = out["loss_sum"] / out["n_tokens"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = loss.detach()

    def timed(self) -> float:
        """Seconds of one step: CUDA events around it on CUDA (then synchronised), else ``perf_counter``."""
        import torch

        if self.device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            self()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3
        t0 = time.perf_counter()
        self()
        return time.perf_counter() - t0

    def wall(self) -> float:
        """Wall seconds of one step until its work has finished on the device."""
        t0 = time.perf_counter()
        self()
        sync(self.device)
        return time.perf_counter() - t0

    def free(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        self.opt = self.params = self.x = self.loss = self.model = self.doc_ids = self.mask = None


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()[:300]


def free_memory(device) -> None:
    """Collect garbage, drop compiled graphs (dynamo's per-code caches would otherwise fill across variants and fall
    back to eager), return cached CUDA blocks. A full collection (0.2 s with torch and transformers loaded) only on
    CUDA, where memory is what is freed; on CPU the young generations."""
    import torch

    gc.collect() if device.type == "cuda" else gc.collect(1)
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001 - best effort between variants
        pass
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _reason(e: BaseException) -> str:
    """``<ExceptionType>: <first line of its message>`` (at most 500 characters)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:500]


def _dynamo_counts() -> dict:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def _clear_dynamo_counters() -> None:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return
    counters.clear()


def _measure(
    v: Variant, shape: Shape, device, args, deadline: float, batch_start: dict, rec: dict, phase: list
) -> None:
    """The body of :func:`run_variant`, filling ``rec`` as it goes (``phase[0]``: what it is doing). Its model,
    optimizer and batch are locals of this frame: they are freed when it returns or its exception is handled."""
    t0 = time.monotonic()
    model, facts = build(v, shape, device, args.compile_backend)
    rec.update(facts)
    rec["build_s"] = round(time.monotonic() - t0, 3)
    rec["flops_per_token"] = flops_per_token(v, shape, model)
    batches = [b for b in (args.batch or shape.batches) if b <= batch_start.get(v.shape, 1 << 30)]
    tried: list[dict] = []
    stepper = first = None
    for b in batches:
        phase[0] = f"first step (batch {b})"
        stepper = Stepper(
            model,
            v.model == "hf",
            b,
            shape,
            device,
            v.compiled,
            args.compile_backend,
            doc_len(args, shape) if v.docs else None,
        )
        oom = None
        try:
            first = stepper.wall()
        except Exception as e:  # OOM: try the next batch; anything else is re-raised
            if not is_oom(e):
                raise
            oom = _reason(e)
        if oom is None:
            break
        tried.append({"batch": b, "reason": oom})
        stepper.free()
        stepper = None
        free_memory_keep_graphs(device)
    if stepper is None:
        raise RuntimeError(f"out of memory at every batch in {batches}: {tried[-1]['reason'] if tried else ''}")
    batch_start[v.shape] = b  # later variants of this shape start here
    rec.update(batch=b, tokens_per_step=b * shape.seq_len, first_step_s=round(first, 3), fused_adamw=stepper.fused)
    if v.docs:
        starts = int((stepper.doc_ids[:, 1:] != stepper.doc_ids[:, :-1]).sum()) + b
        rec["docs"] = {"mean_len": doc_len(args, shape), "documents": starts, "loss_tokens": int(stepper.mask.sum())}
    if tried:
        rec["batches_oom"] = tried
    rec["loss_first"] = float(stepper.loss)
    phase[0] = "warm-up"
    for _ in range(args.warmup - 1):
        stepper.wall()
    phase[0] = "measured steps"
    times: list[float] = []
    rec["step_times_s"] = times
    for _ in range(args.steps):
        if times and time.monotonic() + 1.5 * times[-1] > deadline:
            rec["truncated"] = f"time limit: measured {len(times)} of {args.steps} steps"
            break
        times.append(stepper.timed())
    rec["loss_last"] = float(stepper.loss)
    stepper.free()


def run_variant(v: Variant, shape: Shape, device, args, budget_s: float, batch_start: dict) -> dict:
    """Build, place, (compile,) and time one variant within ``budget_s`` seconds (SIGALRM; the measured loop also
    stops early rather than overrun). Never raises (except KeyboardInterrupt): a failure or timeout is recorded in
    the returned dict with its reason; the variant's memory and compiled graphs are freed before it returns."""
    import torch

    rec: dict = {
        "record": "variant",
        "name": v.name,
        "shape": v.shape,
        "model": v.model,
        "canon": v.canon,
        "backend": v.backend,
        "mode": v.mode,
        "compiled": v.compiled,
        "doc_mask": v.docs,
        "seq_len": shape.seq_len,
        "status": "ok",
        "reason": None,
        "budget_s": round(budget_s, 3),
    }
    t0 = time.monotonic()
    phase = ["build"]
    done = False
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _clear_dynamo_counters()
    try:
        with alarm_at(t0 + budget_s), gluon_env(v.backend):
            _measure(v, shape, device, args, t0 + budget_s, batch_start, rec, phase)
            done = True
    except VariantTimeout:
        if not done:  # (an alarm that fired between the end of the work and its cancellation changes nothing)
            rec.update(
                status="timeout",
                reason=f"time limit of {budget_s:g} s (--budget-s, or what --max-minutes left) spent in the {phase[0]}",
            )
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - recorded, the bench goes on
        rec.update(status="failed", reason=f"{phase[0]}: {_reason(e)}")
    rec["dynamo"] = _dynamo_counts() if v.compiled else None
    times = rec.get("step_times_s") or []
    if times:
        med = statistics.median(times)
        rec.update(
            steps_measured=len(times),
            step_s=med,
            step_ms=round(med * 1e3, 3),
            tokens_per_s=rec["tokens_per_step"] / med,
        )
        peak = args.peak_flops
        rec["mfu"] = (rec["tokens_per_s"] * rec["flops_per_token"] / peak) if peak else None
    elif rec["status"] == "ok":
        rec.update(status="failed", reason="no step measured")
    rec["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None
    free_memory(device)
    rec["wall_s"] = round(time.monotonic() - t0, 3)
    return rec


def free_memory_keep_graphs(device) -> None:
    """Free an OOM step's memory without dropping the compiled graphs (the next batch size recompiles anyway)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------------------
# variants, ratios, output
# ------------------------------------------------------------------------------------------------------------------


def doc_len(args, shape: Shape) -> int:
    """Mean document length (tokens) of the document-masked variants: ``--doc-len``, else a quarter of the window."""
    return args.doc_len or max(1, shape.seq_len // 4)


def _doc_backend(backends: list[str]) -> str | None:
    """The Canon backend of a model's document-masked variant: ``auto`` when listed, else the first one."""
    return "auto" if "auto" in backends else (backends[0] if backends else None)


def plan(args) -> list[Variant]:
    """Every variant, in the order they run: per shape, the canonlm Llama pairs and transformers eager, then
    compiled, then each linear preset's ``b`` / AbCD pairs (eager, then compiled) -- so that a run cut short by
    ``--max-minutes`` has measured complete pairs of what matters most first. A model of ``--doc-models`` gets its
    document-masked variant (eager, its Canon set, :func:`_doc_backend`) right after the eager variants it pairs
    with, so that a short run measures it too."""
    out: list[Variant] = []
    linear = [m for m in args.models if m not in ("llama", "hf")]
    for s in args.shapes:
        for mode in args.modes:
            c = mode == "compiled"
            if c and "llama" not in args.compile_models and "hf" not in args.compile_models:
                continue
            if "llama" in args.models and (not c or "llama" in args.compile_models):
                out.append(Variant(s, "llama", "none", "-", c))
                out += [Variant(s, "llama", "ABCD", b, c) for b in args.backends if not c or b in args.compile_backends]
                doc_b = _doc_backend(args.backends)
                if not c and "llama" in args.doc_models and doc_b is not None:
                    out.append(Variant(s, "llama", "ABCD", doc_b, False, docs=True))
            if "hf" in args.models and (not c or "hf" in args.compile_models):
                out.append(Variant(s, "hf", "none", "-", c))
        for arch in linear:
            for mode in args.modes:
                c = mode == "compiled"
                if c and arch not in args.compile_models:
                    continue
                for b in args.linear_backends:
                    if c and b not in args.compile_backends:
                        continue
                    out += [Variant(s, arch, "b", b, c), Variant(s, arch, full_linear_set(arch), b, c)]
                    if not c and arch in args.doc_models and b == _doc_backend(args.linear_backends):
                        out.append(Variant(s, arch, full_linear_set(arch), b, False, docs=True))
    return out


def per_token(r: dict) -> float:
    """Seconds per token of an ``ok`` result: median step / (batch x T)."""
    return r["step_s"] / (r["batch"] * r["seq_len"])


def ratios(results: list[dict]) -> list[dict]:
    """The issue's ratios from the ``ok`` results (per-token step times; see the module docstring)."""
    ok = {r["name"]: r for r in results if r.get("status") == "ok" and r.get("step_s")}
    out = []

    def add(kind, num, den, value, target, op, shape, what):
        met = None if target is None else (value <= target if op == "<=" else value >= target)
        out.append(
            {
                "kind": kind,
                "shape": shape,
                "what": what,
                "num": num["name"],
                "den": den["name"],
                "value": value,
                "target": target,
                "op": op,
                "met": met,
                "same_batch": num["batch"] == den["batch"],
            }
        )

    for r in ok.values():
        mode, s = r["mode"], r["shape"]
        if r.get("doc_mask"):
            den = ok.get(r["name"].rsplit("/docs", 1)[0])
            if den:
                add(
                    "doc_mask_overhead",
                    r,
                    den,
                    per_token(r) / per_token(den),
                    None,
                    "<=",
                    s,
                    f"{r['model']} {r['canon']} docs/plain {r['backend']} {mode}",
                )
        elif r["model"] == "llama" and r["canon"] == "ABCD":
            den = ok.get(f"{s}/llama/none/-/{mode}")
            if den:
                add(
                    "canon_overhead",
                    r,
                    den,
                    per_token(r) / per_token(den),
                    CANON_TARGET.get(s),
                    "<=",
                    s,
                    f"llama ABCD/none {r['backend']} {mode}",
                )
        elif r["model"] == "hf":
            den = ok.get(f"{s}/llama/none/-/{mode}")
            if den:
                add(
                    "vs_transformers",
                    r,
                    den,
                    per_token(r) / per_token(den),
                    HF_TARGET.get(s),
                    ">=",
                    s,
                    f"transformers/canonlm llama none {mode}",
                )
        elif r["model"] not in ("llama", "hf") and r["canon"] == full_linear_set(r["model"]):
            den = ok.get(f"{s}/{r['model']}/b/{r['backend']}/{mode}")
            if den:
                add(
                    "linear_overhead",
                    r,
                    den,
                    per_token(r) / per_token(den),
                    LINEAR_TARGET.get(s),
                    "<=",
                    s,
                    f"{r['model']} {r['canon']}/b {r['backend']} {mode}",
                )
    return out


def ratio_line(q: dict) -> str:
    """``ratio <kind> <shape> <what>: <value>x (target <op> <t>: met | NOT met | no target at this shape)``."""
    if q["target"] is None:
        verdict = "no target at this shape"
    else:
        verdict = f"target {q['op']} {q['target']:.2f}: {'met' if q['met'] else 'NOT met'}"
    note = "" if q["same_batch"] else " [different batches: per-token ratio]"
    return f"ratio {q['kind']} {q['shape']} {q['what']}: {q['value']:.3f}x ({verdict}){note}"


def _fmt(x, spec: str, none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def table(results: list[dict]) -> list[str]:
    """The results as a Markdown table."""
    rows = [
        "| variant | status | batch | step ms | tokens/s | MFU | peak GiB | first step s | backends | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        be = ", ".join(f"{k}={v}" for k, v in (r.get("backends") or {}).items())
        note = r.get("reason") or r.get("truncated") or ""
        if r.get("batches_oom"):
            note = (note + "; " if note else "") + "OOM at batch " + ",".join(str(t["batch"]) for t in r["batches_oom"])
        if r.get("dynamo"):
            note = (note + "; " if note else "") + "graphs {unique_graphs}, breaks {graph_breaks}".format(**r["dynamo"])
        mfu = "" if r.get("step_s") is None else "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f} %"
        cells = [
            r["name"],
            r["status"],
            _fmt(r.get("batch"), "d", ""),
            _fmt(r.get("step_ms"), ".1f", ""),
            _fmt(r.get("tokens_per_s"), ",.0f", ""),
            mfu,
            _fmt(r.get("peak_gib"), ".2f", "n/a" if r.get("step_s") else ""),
            _fmt(r.get("first_step_s"), ".2f", ""),
            be,
            note.replace("|", "/"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _git_commit() -> dict:
    def git(*a):
        try:
            p = subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": None if dirty is None else bool(dirty)}


def header(args, device, argv: list[str]) -> dict:
    """The run's header record: device, peak FLOP/s, versions, canonlm commit, command and options, shapes."""
    import torch

    versions = {}
    for p in VERSIONED:
        try:
            versions[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            versions[p] = None
    h = {
        "record": "header",
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/gpu_step.py", *argv]),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "peak_flops": args.peak_flops,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "versions": versions,
        "canonlm_git": _git_commit(),
        "presets_from": "hydra" if all(importlib.util.find_spec(m) for m in ("hydra", "omegaconf")) else "yaml",
        "options": {
            k: str(v) if isinstance(v, torch.device) else v for k, v in vars(args).items() if k != "peak_flops"
        },
        "shapes": {s: dataclasses.asdict(SHAPES[s]) for s in args.shapes},
    }
    return h


def write_md(path: Path, head: dict, results: list[dict], qs: list[dict]) -> None:
    """``gpu_step.md``: the header facts, the table and the ratios (rewritten after every variant, so that a run
    killed from outside still leaves the table of what it measured)."""
    g = head["canonlm_git"]
    v = head["versions"]
    lines = [
        f"# GPU step benchmark ({head['time']})",
        "",
        f"- device: {head['device_name']} ({head['device']}); peak {_fmt(head['peak_flops'], '.3g')} FLOP/s",
        "- versions: " + ", ".join(f"{k} {v[k]}" for k in v if v[k]) + f"; Python {head['python']}, "
        f"CUDA {head['cuda']}",
        f"- canonlm commit {g['commit']}{' (dirty)' if g['dirty'] else ''}",
        f"- command: `{head['command']}`",
        "",
        *table(results),
        "",
        "## Ratios",
        "",
    ]
    lines += [f"- {ratio_line(q)}" for q in qs] or ["- (none: no complete pair measured)"]
    path.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------------------------


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None):
    """The options, with the preset's defaults (``--tiny``, ``--quick`` or the full run) filled in where not given."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out",
        help="folder for gpu_step.jsonl and gpu_step.md (created; must not hold a previous "
        "run's files); required unless --list",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU, the tiny shape, every variant a CPU can run, a few steps")
    ap.add_argument(
        "--quick", action="store_true", help="12L768D, Canon auto backend, 5 steps after 2: a short GPU allocation"
    )
    ap.add_argument("--shapes", help=f"comma list of {', '.join(SHAPES)} (default 12L768D,1.3B; --tiny: tiny)")
    ap.add_argument("--models", help="comma list: llama, hf and conf/arch presets (default llama,hf,gla,gdn,mamba2)")
    ap.add_argument(
        "--backends",
        help="kernels.canon of the Canon-ABCD Llama: comma list of names and/or "
        "'available' (every backend that can run on the device, and auto; default)",
    )
    ap.add_argument("--linear-backends", help="kernels.canon of the linear models (same names; default auto)")
    ap.add_argument("--compile", dest="modes", help="comma list of eager, compiled (default both)")
    ap.add_argument("--compile-models", help="models that also get compiled variants (default: every model)")
    ap.add_argument("--compile-backends", help="Canon backends that also get compiled variants (default: every one)")
    ap.add_argument(
        "--compile-backend",
        help="torch.compile backend of the compiled variants (default inductor, as training; --tiny: "
        "aot_eager, dynamo and AOTAutograd without inductor's C++ code generation, which takes "
        "17-48 s a variant was measured on a cold, shared 2-core CPU)",
    )
    ap.add_argument(
        "--peak-flops",
        type=float,
        help="dense bf16 peak FLOP/s for MFU (default: canonlm.train.module.peak_flops of the CUDA "
        "device's name; none on CPU or for a device not in that table: MFU n/a)",
    )
    ap.add_argument("--steps", type=int, help="measured steps (median reported; default 10, --quick 5, --tiny 3)")
    ap.add_argument(
        "--warmup", type=int, help="steps before, the first one timed as first_step_s (default 3, --quick 2, --tiny 1)"
    )
    ap.add_argument(
        "--batch",
        help="comma list of batch sizes tried in order, for every shape (default: the "
        "shape's: 8 at 12L768D, 8,4,2,1 at 1.3B, 2 tiny)",
    )
    ap.add_argument("--budget-s", type=float, help="seconds per variant (default 90, --quick 45, --tiny 60)")
    ap.add_argument(
        "--max-minutes",
        type=float,
        help="the whole run (default 3.5; --tiny 5); variants left when it is spent are recorded as skipped",
    )
    ap.add_argument("--device", help="cuda (default when available) or cpu (default with --tiny)")
    ap.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's; --tiny: 1, steadier on a shared CPU)"
    )
    ap.add_argument(
        "--doc-models",
        help="models that also get a document-masked variant (doc_ids packed in every "
        "window): comma list of canonlm models of --models, or 'none' (default: "
        "every canonlm model of --models)",
    )
    ap.add_argument(
        "--doc-len",
        type=int,
        help="mean document length in tokens of the document-masked variants "
        "(default: a quarter of the window, 512 at 12L768D)",
    )
    ap.add_argument(
        "--list",
        action="store_true",
        help="print the variants in the order they would run, then exit (--out is not needed)",
    )
    args = ap.parse_args(argv)
    if args.out is None and not args.list:
        ap.error("--out is required (unless --list)")
    preset = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.tiny and args.quick:
        ap.error("--tiny and --quick: choose one")
    d = {
        "full": dict(
            shapes="12L768D,1.3B",
            models="llama,hf,gla,gdn,mamba2",
            backends="available",
            linear_backends="auto",
            modes="eager,compiled",
            steps=10,
            warmup=3,
            budget_s=90.0,
            max_minutes=3.5,
            compile_backend="inductor",
        ),
        "quick": dict(
            shapes="12L768D",
            models="llama,hf,gla,gdn,mamba2",
            backends="auto",
            linear_backends="auto",
            modes="eager,compiled",
            compile_models="llama",
            steps=5,
            warmup=2,
            budget_s=45.0,
            max_minutes=3.5,
            compile_backend="inductor",
        ),
        "tiny": dict(
            shapes="tiny",
            models="llama,hf,gla,gdn,mamba2",
            backends="available",
            linear_backends="auto",
            modes="eager,compiled",
            compile_models="llama",
            compile_backends="torch",
            steps=3,
            warmup=1,
            budget_s=60.0,
            max_minutes=5.0,
            device="cpu",
            threads=1,
            compile_backend="aot_eager",
        ),
    }[preset]
    for k, val in d.items():
        if getattr(args, k, None) is None:
            setattr(args, k, val)
    return args, ap


def check_args(args, ap) -> None:
    """Every option checked, and the lists expanded, before any work (one clear error naming the option)."""
    import torch

    from canonlm.ops.canon import BACKENDS, available_backends

    def bad(opt, val, allowed):
        ap.error(f"{opt}={val!r}: {allowed}")

    args.shapes = _csv(args.shapes)
    for s in args.shapes:
        if s not in SHAPES:
            bad("--shapes", s, f"one of {', '.join(SHAPES)}")
    allowed_models = ["llama", "hf", *linear_presets()]
    args.models = _csv(args.models)
    for m in args.models:
        if m not in allowed_models:
            bad("--models", m, f"one of {', '.join(allowed_models)}")
    args.modes = _csv(args.modes)
    for m in args.modes:
        if m not in MODES:
            bad("--compile", m, "one of eager, compiled")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() or args.list else "cpu"
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        bad("--device", args.device, "cuda, cuda:<index> or cpu")
    if args.device.startswith("cuda") and not torch.cuda.is_available() and not args.list:
        bad("--device", args.device, "no CUDA device is available here (use --tiny or --device cpu)")
    device = torch.device(args.device)
    if device.type == "cpu":
        big = [s for s in args.shapes if s != "tiny"]
        if big:
            bad("--shapes", ",".join(big), "a GPU shape needs a CUDA device; on CPU use --tiny (--shapes tiny)")
    here = [n for n, why in available_backends(device, torch.bfloat16).items() if why is None]
    if device.type == "cuda":  # the F.conv1d oracle is not a candidate for speed unless asked for by name
        here = [n for n in here if n != "reference"]
    if "fla" in here and importlib.util.find_spec("triton.experimental.gluon") is not None:
        here.append(GLUON)  # fla's Gluon conv kernels, where this triton has Gluon

    def backends(opt, spec):
        out = []
        for n in _csv(spec):
            names = ["auto", *here] if n == "available" else [n]
            for x in names:
                if x not in BACKENDS and x != GLUON:
                    bad(opt, x, f"'available' or one of {', '.join(BACKENDS)}, {GLUON}")
                if x not in out:
                    out.append(x)
        return out

    args.backends = backends("--backends", args.backends)
    args.linear_backends = backends("--linear-backends", args.linear_backends)
    canonlm_models = [m for m in args.models if m != "hf"]
    if args.doc_models is None:
        args.doc_models = canonlm_models
    else:
        args.doc_models = [] if args.doc_models.strip() == "none" else _csv(args.doc_models)
        for m in args.doc_models:
            if m not in canonlm_models:
                bad("--doc-models", m, f"'none' or canonlm models of --models: {', '.join(canonlm_models)}")
    if args.doc_len is not None and args.doc_len < 1:
        bad("--doc-len", args.doc_len, "an integer >= 1 (tokens)")
    args.compile_models = args.models if args.compile_models is None else _csv(args.compile_models)
    for m in args.compile_models:
        if m not in allowed_models:
            bad("--compile-models", m, f"one of {', '.join(allowed_models)}")
    if args.compile_backends is None:
        args.compile_backends = args.backends + [b for b in args.linear_backends if b not in args.backends]
    else:
        args.compile_backends = backends("--compile-backends", args.compile_backends)
    import torch._dynamo

    if args.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        bad(
            "--compile-backend",
            args.compile_backend,
            "one of " + ", ".join(torch._dynamo.list_backends(exclude_tags=())),
        )
    for opt, val, lo in (("--steps", args.steps, 1), ("--warmup", args.warmup, 1)):
        if val < lo:
            bad(opt, val, f"an integer >= {lo}")
    for opt, val in (("--budget-s", args.budget_s), ("--max-minutes", args.max_minutes)):
        if not (val > 0 and math.isfinite(val)):
            bad(opt, val, "a positive number")
    if args.batch is not None:
        try:
            args.batch = tuple(int(b) for b in _csv(args.batch))
        except ValueError:
            bad("--batch", args.batch, "a comma list of positive integers")
        if not args.batch or min(args.batch) < 1:
            bad("--batch", args.batch, "a comma list of positive integers")
    if args.peak_flops is not None and not (args.peak_flops > 0 and math.isfinite(args.peak_flops)):
        bad("--peak-flops", args.peak_flops, "a positive number of FLOP/s")
    if args.threads is not None and args.threads < 1:
        bad("--threads", args.threads, "a positive integer")
    if args.list:
        args.device = device
        return
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        bad("--out", args.out, "a folder (this is a file)")
    for f in (JSONL, MD):
        if (out / f).exists():
            bad("--out", args.out, f"a folder without {f} (it holds a previous run's results: choose a new folder)")
    args.device = device


def main(argv: list[str] | None = None) -> int:
    """Run the bench (see the module docstring); ``argv`` defaults to ``sys.argv[1:]``. Returns 0 when the run
    finished, whatever the variants' statuses; a bad option exits with status 2 before anything is written."""
    args, ap = parse_args(argv)
    check_args(args, ap)
    import torch

    if args.list:
        variants = plan(args)
        for v in variants:
            print(v.name + (f"  [documents of mean length {doc_len(args, SHAPES[v.shape])} tokens]" if v.docs else ""))
        print(
            f"gpu_step: {len(variants)} variants on {args.device}, --max-minutes {args.max_minutes:g}, --budget-s "
            f"{args.budget_s:g}",
            file=sys.stderr,
        )
        return 0

    from canonlm.utils.kernel_cache import configure

    args.kernel_cache = str(configure())  # $CANONLM_KERNEL_CACHE, else <canonlm cache>/kernels (docs/kernel_cache.md)
    device = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peak_flops is None and device.type == "cuda":
        from canonlm.train.module import peak_flops

        args.peak_flops = peak_flops(torch.cuda.get_device_name(device))
    variants = plan(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = header(args, device, sys.argv[1:] if argv is None else list(argv))
    jsonl = out / JSONL

    def append(rec: dict) -> None:
        with jsonl.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    append(head)
    print(
        f"# {head['device_name']}; torch {head['versions']['torch']}; canonlm {head['canonlm_git']['commit']}; "
        f"{len(variants)} variants; --max-minutes {args.max_minutes:g}, --budget-s {args.budget_s:g}",
        flush=True,
    )
    end = time.monotonic() + 60 * args.max_minutes
    results: list[dict] = []
    batch_start: dict = {}
    for i, v in enumerate(variants, 1):
        left = end - time.monotonic()
        if left <= 0 or left < min(5.0, args.budget_s):
            rec = {
                "record": "variant",
                "name": v.name,
                "shape": v.shape,
                "model": v.model,
                "canon": v.canon,
                "backend": v.backend,
                "mode": v.mode,
                "compiled": v.compiled,
                "doc_mask": v.docs,
                "seq_len": SHAPES[v.shape].seq_len,
                "status": "skipped",
                "reason": f"--max-minutes {args.max_minutes:g} spent",
            }
        else:
            rec = run_variant(v, SHAPES[v.shape], device, args, min(args.budget_s, left), batch_start)
        results.append(rec)
        append(rec)
        write_md(out / MD, head, results, ratios(results))
        msg = (
            f"batch {rec['batch']}, {rec['step_ms']:.2f} ms/step, {rec['tokens_per_s']:,.0f} tok/s, "
            f"first step {rec['first_step_s']:.2f} s"
            if rec.get("step_ms") is not None
            else rec.get("reason")
        )
        print(f"[{i}/{len(variants)}] {v.name}: {rec['status']}: {msg}", flush=True)
    qs = ratios(results)
    append({"record": "ratios", "ratios": qs})
    write_md(out / MD, head, results, qs)
    print()
    print("\n".join(table(results)))
    print()
    for q in qs:
        print(ratio_line(q))
    if not qs:
        print("ratio: none (no complete pair measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
