"""The self-check's lines, full and ``--quick``: names, groups (what runs in one worker process), the functions that
check them, and the cold-run estimates that order the groups (docs/selfcheck.md has the table and how it was
counted)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from canonlm.selfcheck.environment import NO_CUDA
from canonlm.selfcheck.kernels import kernel_lines
from canonlm.selfcheck.models import CANON_SETS, PRESETS
from canonlm.selfcheck.runner import LineSpec
from canonlm.selfcheck.verdict import SKIP

#: Seconds a cold H200 run is assumed to spend per Triton kernel compiled (order of the groups only): the old Canon
#: fla fp32 line took 77 s on the H200 (issue 25), and it compiles 67 kernel configurations by a count made under
#: Triton's interpreter here -- an estimate, not a measured compile time.
S_PER_COMPILE = 1.5

#: Triton kernels a cold run of each kernel line compiles with first-config autotuning: the distinct kernel
#: specializations (constexprs, dtypes, int and pointer specializations) the line launches, counted under Triton's
#: interpreter (fla-core 0.6.0, mamba-ssm 2.3.1) with the line's group run in order (a decode line reuses the
#: forward kernels its group compiled). Full autotuning multiplies each by its config count (docs/selfcheck.md).
KERNEL_COMPILES = {
    ("canon", "dao", "fwd+bwd"): 0,
    ("canon", "dao", "decode"): 0,
    ("canon", "fla", "fwd+bwd"): 6,
    ("canon", "fla", "decode"): 2,
    ("canon", "torch", "fwd+bwd"): 6,  # inductor's fused forward and backward kernels
    ("attention", "sdpa", "fwd+bwd"): 0,
    ("attention", "sdpa", "decode"): 0,
    ("attention", "flash", "fwd+bwd"): 0,
    ("attention", "flash", "decode"): 0,
    ("gla", "fla", "fwd+bwd"): 11,
    ("gla", "fla", "decode"): 2,
    ("gdn", "fla", "fwd+bwd"): 13,
    ("gdn", "fla", "decode"): 3,
    ("ssd", "mamba_ssm", "fwd+bwd"): 15,
    ("ssd", "mamba_ssm", "decode"): 1,
    ("ssd", "split", "fwd+bwd"): 13,
    # document masking: the same kernels' varlen variants (fla's IS_VARLEN, mamba-ssm's HAS_SEQ_IDX
    # constexprs), so about the fwd+bwd line's count again -- estimated from it, not counted
    ("gla", "fla", "doc-mask"): 11,
    ("gdn", "fla", "doc-mask"): 13,
    ("ssd", "mamba_ssm", "doc-mask"): 15,
}
#: The same for the model lines (2L256D; counted at 2L64D: the variants do not depend on the widths). Mamba2's
#: forward + backward (bf16 autocast through the fused split kernel) did not run under the interpreter: its count is
#: the split line's 13 plus the Canon layers' 6.
MODEL_COMPILES = {
    ("llama", "fwd"): 6,
    ("llama", "decode"): 6,
    ("gla", "fwd"): 20,
    ("gla", "decode"): 7,
    ("gdn", "fwd"): 20,
    ("gdn", "decode"): 11,
    ("mamba2", "fwd"): 19,
    ("mamba2", "decode"): 9,
    # document masking (the varlen variants: Canon's and the mixer's forward + backward; estimated as
    # the fwd lines' counts, Mamba2's as its scan's 15 plus Canon's 6 -- not counted)
    ("llama", "doc"): 6,
    ("gla", "doc"): 20,
    ("gdn", "doc"): 20,
    ("mamba2", "doc"): 21,
}
#: Training runs: the model lines' forward + backward kernels at the run's shapes, plus the process start-up.
TRAIN_START_S = 25.0

#: Sizes and steps of the training lines: (size, steps) full / --quick.
TRAIN_DEFAULTS = {False: ("12L768D", 20), True: ("4L256D", 10)}
#: Architectures of the training lines (their Canon set, CANON_SETS[arch][1]): full / --quick.
TRAIN_ARCHS = {False: ("llama", "gla", "gdn", "mamba2"), True: ("llama", "gla")}
#: Architectures of the FSDP2 lines (all GPUs; SKIP with one): full / --quick.
FSDP2_ARCHS = {False: ("llama", "gla"), True: ("llama",)}
#: Architectures whose model document-masking line ``--quick`` keeps: llama (Canon-ABCD, the Canon op's document
#: masking at the model level); the mixers' varlen kernels have their own kernel lines.
QUICK_DOC = ("llama",)
#: Model-line size (small: a float64 reference model runs beside the fast one).
MODEL_SIZE = "2L256D"


@dataclasses.dataclass
class Options:
    """What the command line chose: ``quick``; the training lines' ``size``, ``steps`` and ``batch`` (windows of 2048
    tokens per GPU); ``autotune`` (``first`` / ``full``)."""

    quick: bool = False
    size: Optional[str] = None
    steps: Optional[int] = None
    batch: int = 8
    autotune: str = "first"

    def train_size(self) -> str:
        return self.size or TRAIN_DEFAULTS[self.quick][0]

    def train_steps(self) -> int:
        return self.steps or TRAIN_DEFAULTS[self.quick][1]


def _family(op: str, fast: str) -> str:
    """The worker group of a kernel line (per dtype): Canon and attention together, one group per other kernel."""
    return {"canon": "canon", "attention": "canon", "gla": "gla", "gdn": "gdn"}.get(op) or (
        "split" if fast == "split" else "ssd"
    )


def gpu_lines(opts: Options, cuda: bool, n_gpu: int) -> list[LineSpec]:
    """The GPU lines: kernels (fp32 and bf16; ``--quick``: bf16; the GLA / GDN / SSD document-masking lines
    included), models (``--quick``: the decode lines and llama's document-masking line), one training run per
    architecture with its Canon set (``--quick``: llama and gla), FSDP2 (SKIP below two GPUs). Without CUDA every line
    is a static SKIP ``no CUDA``."""
    dts = ["bf16"] if opts.quick else ["fp32", "bf16"]
    out: list[LineSpec] = []
    for name, op, fast, fn, args, dt, mode in kernel_lines(dts):
        n = KERNEL_COMPILES[(op, fast, mode)]
        out.append(
            LineSpec(
                name,
                f"{_family(op, fast)} {dt}",
                f"canonlm.selfcheck.kernels:{fn}",
                list(args),
                {"device": "cuda"},
                op=op,
                backend=fast,
                est_compiles=n,
                est_s=0.5 + S_PER_COMPILE * n,
                device="cuda",
            )
        )
    for arch in PRESETS:
        kinds = ("fwd", "decode", "doc") if not opts.quick else ("decode",) + (("doc",) if arch in QUICK_DOC else ())
        for kind in kinds:
            n = MODEL_COMPILES[(arch, kind)]
            if kind == "fwd":
                name, fn = f"model {arch} fast vs reference (cuda, bf16)", "check_model_fast_vs_reference"
            elif kind == "doc":
                name, fn = f"model {arch} doc-mask == documents alone (cuda, fp32)", "check_model_doc_mask"
            else:
                name, fn = f"model {arch} decode == full forward (cuda, fp32)", "check_model_decode"
            out.append(
                LineSpec(
                    name,
                    f"model {arch}",
                    f"canonlm.selfcheck.models:{fn}",
                    [arch],
                    {"device": "cuda", "size": MODEL_SIZE},
                    est_compiles=n,
                    est_s=2.0 + S_PER_COMPILE * n,
                    device="cuda",
                )
            )
    size, steps = opts.train_size(), opts.train_steps()
    common = [
        f"model.size={size}",
        "task=depo1",
        "trainer=gpu",
        "trainer.devices=1",
        f"trainer.log_every_n_steps={max(1, min(5, steps // 2))}",
        f"data.batch_size={opts.batch}",
    ]
    for arch in TRAIN_ARCHS[opts.quick]:
        canon = CANON_SETS[arch][1]
        label = f"train {arch} canon={canon} {size} {steps} steps (1 GPU, bf16-mixed)"
        spec = dict(
            label=label,
            arch=arch,
            canon=canon,
            overrides=common,
            steps=steps,
            world=1,
            device="cuda",
            timeout=1200,
            autotune=opts.autotune,
        )
        n = MODEL_COMPILES[(arch, "fwd")]
        out.append(
            LineSpec(
                label,
                f"train {arch}",
                "canonlm.selfcheck.training:training_line",
                [spec],
                {"workdir": "{workdir}"},
                heavy=True,
                est_compiles=n,
                est_s=TRAIN_START_S + S_PER_COMPILE * n,
                device="cuda",
            )
        )
    for arch in FSDP2_ARCHS[opts.quick]:
        canon = CANON_SETS[arch][1]
        label = f"fsdp2 {arch} canon={canon} {size} {steps} steps (all GPUs)"
        static = None if (not cuda or n_gpu >= 2) else [SKIP, f"needs >= 2 GPUs ({n_gpu} visible)"]
        out.append(
            LineSpec(
                label,
                f"fsdp2 {arch}",
                "canonlm.selfcheck.training:fsdp2_line",
                [label, arch, canon, size, steps, opts.batch, opts.autotune],
                {"workdir": "{workdir}"},
                static=static,
                heavy=True,
                est_compiles=MODEL_COMPILES[(arch, "fwd")],
                est_s=TRAIN_START_S + S_PER_COMPILE * MODEL_COMPILES[(arch, "fwd")],
                device="cuda",
            )
        )
    if not cuda:
        for s in out:
            s.static = [SKIP, NO_CUDA]
    return out


#: The tiny CPU training runs (task depo1_cpu scaled down; 5 steps).
CPU_TRAIN = [
    "model.size=2L64D",
    "task=depo1_cpu",
    "task.N=8",
    "task.K=4",
    "task.vocab_V=6",
    "task.context=128",
    "data.batch_size=4",
    "trainer=cpu",
    "trainer.log_every_n_steps=1",
]


def cpu_lines(opts: Options) -> list[LineSpec]:
    """The CPU lines (always run): the native Canon kernel (fp32; bf16 outside ``--quick``), the references against
    their loops, SDPA, cached decoding of every architecture, document masking of every architecture (a packed
    window against each document alone), and a 5-step tiny training per architecture (``--quick``: llama)."""
    k, r, m = "canonlm.selfcheck.kernels", "canonlm.selfcheck.references", "canonlm.selfcheck.models"
    out = [LineSpec("cpu canon/cpu native kernel fp32 fwd+bwd", "cpu", f"{k}:check_cpu_canon_native", ["fp32"])]
    if not opts.quick:
        out.append(LineSpec("cpu canon/cpu native kernel bf16 fwd+bwd", "cpu", f"{k}:check_cpu_canon_native", ["bf16"]))
    out += [
        LineSpec("cpu canon reference + decode step vs loop (fp64)", "cpu", f"{r}:check_cpu_canon_reference_loop"),
        LineSpec("cpu attention sdpa fp32 fwd+bwd + decode", "cpu", f"{k}:check_cpu_attention"),
    ]
    for op in ("gla", "gdn", "ssd"):
        out.append(
            LineSpec(
                f"cpu {op} chunked reference vs recurrence (fp64) fwd+bwd",
                "cpu",
                f"{r}:check_cpu_linear_reference",
                [op],
            )
        )
    for arch in PRESETS:
        out.append(
            LineSpec(
                f"cpu model {arch} decode == full forward (fp32)",
                "cpu",
                f"{m}:check_model_decode",
                [arch, "cpu", "2L64D"],
                {"fast": False},
                est_s=1.5,
            )
        )
    for arch in PRESETS:
        out.append(
            LineSpec(
                f"cpu model {arch} doc-mask == documents alone (fp32)",
                "cpu",
                f"{m}:check_model_doc_mask",
                [arch, "cpu", "2L64D"],
                {"fast": False, "T": 48},
                est_s=1.0,
            )
        )
    for arch, sets in CANON_SETS.items():
        if opts.quick and arch != "llama":
            continue
        canon = sets[1]
        label = f"cpu train {arch} canon={canon} 2L64D 5 steps"
        spec = dict(
            label=label,
            arch=arch,
            canon=canon,
            overrides=CPU_TRAIN,
            steps=5,
            world=1,
            device="cpu",
            timeout=300,
            autotune="full",
        )
        out.append(
            LineSpec(
                label,
                f"cpu train {arch}",
                "canonlm.selfcheck.training:training_line",
                [spec],
                {"workdir": "{workdir}"},
                est_s=10.0,
            )
        )
    return out


def build_plan(opts: Options, cuda: bool, n_gpu: int) -> list[LineSpec]:
    """Every line in report order: the GPU lines (:func:`gpu_lines`), then the CPU lines (:func:`cpu_lines`)."""
    return gpu_lines(opts, cuda, n_gpu) + cpu_lines(opts)


def with_workdir(specs: list[LineSpec], workdir: str) -> list[LineSpec]:
    """The plan with the ``"{workdir}"`` placeholders of the training lines filled in."""
    return [
        dataclasses.replace(s, kwargs={k: (workdir if v == "{workdir}" else v) for k, v in s.kwargs.items()})
        for s in specs
    ]
