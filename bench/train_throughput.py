"""CPU training throughput: canonlm Llama with / without Canon-ABCD vs transformers' LlamaForCausalLM.

One training step = forward + cross-entropy + backward + AdamW step, on a 4L/256D model (4 heads, SwiGLU 704,
untied, vocab 2000) at T=512, B=8 (4096 tokens/step), fp32 and bf16 autocast, 2 threads. Every configuration is
measured in this one run (warm-up steps, then the median over rounds that interleave the configurations in a rotating
order, so machine drift and cache effects hit all of them alike), and the script prints tokens/s and the ratios the project targets:

    canon_overhead  = step(Canon-ABCD) / step(no Canon)         target <= 1.15
    vs_transformers = step(canonlm, no Canon) / step(HF Llama)  target <= 1.00

With ``--archs gla,gdn,mamba2`` (any of the ``conf/arch`` presets: gla gla5 gdn gdn2 mamba2 mamba2_nomlp) it also
measures the linear models at 4L/256D (the preset's own heads, widths and MLP; vocab 2000, same T and B) in three
Canon settings: ``none`` (no conv at all), ``b`` (the original model with its own short conv) and ``AbCD`` (the
paper's default; ``Ab`` without an MLP), and prints

    canon_overhead <arch> = step(AbCD) / step(b)      (Canon-A/C/D added to the original model)

Usage: python bench/train_throughput.py [--steps 12] [--threads 2] [--canon-backend auto] [--no-hf] [--compile]
       [--dtypes fp32,bf16] [--no-canon-arm] [--archs llama,gla,gdn,mamba2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from canonlm.arch.config import build_model_config
from canonlm.arch.model import LlamaCanon
from canonlm.utils.allocator import tune_malloc

V, L, D, H, FF, T, B = 2000, 4, 256, 4, 704, 512, 8


def canonlm_model(canon: str, backend: str) -> torch.nn.Module:
    cfg = build_model_config(
        {"n_layers": L, "d_model": D, "n_heads": H, "d_ff": FF},
        {"set": canon},
        {"type": "rope"},
        vocab_size=V,
        max_seq_len=T,
        kernels={"canon": backend} if backend != "auto" else {},
    )
    return LlamaCanon(cfg)


def linear_model(arch: str, canon: str, backend: str) -> torch.nn.Module:
    """The ``conf/arch/<arch>.yaml`` preset at 4L/256D, composed with Hydra as ``train.py`` would."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from canonlm.config.resolvers import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"arch={arch}", f"canon={canon or 'none'}", "model.size=4L256D"])
    GlobalHydra.instance().clear()
    model = OmegaConf.to_container(cfg.model, resolve=True)
    mcfg = build_model_config(
        model,
        {"set": canon},
        {"type": "nope"},
        vocab_size=V,
        max_seq_len=T,
        kernels={"canon": backend} if backend != "auto" else {},
    )
    return LlamaCanon(mcfg)


def hf_model() -> torch.nn.Module | None:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=FF,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=H,
        max_position_embeddings=T,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


class Runner:
    def __init__(self, name: str, model: torch.nn.Module, hf: bool, bf16: bool):
        self.name, self.model, self.hf, self.bf16 = name, model, hf, bf16
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, V, (B, T), generator=g)
        self.times: list[float] = []

    def step(self) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(self.x).logits if self.hf else self.model(self.x)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), self.x[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="measured rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--canon-backend", default="auto", help="kernels.canon for the Canon model")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' LlamaForCausalLM")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    ap.add_argument(
        "--no-canon-arm",
        action="store_true",
        help="measure only canonlm without Canon (and HF): the two-model comparison",
    )
    ap.add_argument("--compile", action="store_true", help="also compile each model (module.compile())")
    ap.add_argument(
        "--archs",
        default="llama",
        help="comma list: llama and/or conf/arch presets (gla, gla5, gdn, gdn2, mamba2, mamba2_nomlp)",
    )
    ap.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's allocator defaults (train.py tunes them; see canonlm.utils.allocator)",
    )
    args = ap.parse_args()
    if not args.default_malloc:
        tune_malloc()  # process-wide: applies to every model measured here alike
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    runners: list[Runner] = []
    archs = [a for a in args.archs.split(",") if a]
    linear = [a for a in archs if a != "llama"]
    for tag in args.dtypes.split(","):
        bf16 = tag == "bf16"
        if "llama" in archs:
            runners.append(Runner(f"canonlm none {tag}", canonlm_model("", args.canon_backend), False, bf16))
            if not args.no_canon_arm:
                runners.append(Runner(f"canonlm ABCD {tag}", canonlm_model("ABCD", args.canon_backend), False, bf16))
            if not args.no_hf:
                m = hf_model()
                if m is not None:
                    runners.append(Runner(f"hf-llama {tag}", m, True, bf16))
        for arch in linear:
            full = "Ab" if arch == "mamba2_nomlp" else "AbCD"
            for canon in ("", "b", full):
                runners.append(
                    Runner(
                        f"{arch} {canon or 'none'} {tag}", linear_model(arch, canon, args.canon_backend), False, bf16
                    )
                )
    if args.compile:
        for r in runners:
            r.model.compile()
    for r in runners:
        for _ in range(args.warmup):
            r.step()
    for i in range(args.steps):  # rotate the order every round so no configuration always follows the same one
        for r in runners[i % len(runners) :] + runners[: i % len(runners)]:
            r.times.append(r.step())

    med = {r.name: statistics.median(r.times) for r in runners}
    print(
        f"# {L}L/{D}D, T={T}, B={B} ({B * T} tokens/step), threads={torch.get_num_threads()}, "
        f"torch {torch.__version__}, canon backend={args.canon_backend}, compile={args.compile}, "
        f"malloc={'default' if args.default_malloc else 'tuned'}"
    )
    print(f"{'config':<26} {'step s':>8} {'tok/s':>9} {'params':>9}")
    for r in runners:
        n = sum(p.numel() for p in r.model.parameters())
        print(f"{r.name:<26} {med[r.name]:>8.3f} {B * T / med[r.name]:>9.0f} {n / 1e6:>8.2f}M")
    for tag in args.dtypes.split(","):
        if f"canonlm ABCD {tag}" in med:
            over = med[f"canonlm ABCD {tag}"] / med[f"canonlm none {tag}"]
            print(f"canon_overhead {tag}: {over:.3f}x  (target <= 1.15)")
        if f"hf-llama {tag}" in med:
            ratio = med[f"canonlm none {tag}"] / med[f"hf-llama {tag}"]
            print(f"vs_transformers {tag}: {ratio:.3f}x step time of LlamaForCausalLM  (target <= 1.00)")
        for arch in linear:
            full = "Ab" if arch == "mamba2_nomlp" else "AbCD"
            over = med[f"{arch} {full} {tag}"] / med[f"{arch} b {tag}"]
            bare = med[f"{arch} {full} {tag}"] / med[f"{arch} none {tag}"]
            print(
                f"canon_overhead {arch} {tag}: {over:.3f}x  ({full} vs b, the original model); "
                f"{bare:.3f}x vs no conv at all"
            )


if __name__ == "__main__":
    main()
