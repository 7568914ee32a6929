"""bench/gpu_step.py (the GPU training-step benchmark of issue 25) in its ``--tiny`` CPU mode.

The whole ``--tiny`` run happens once, in a subprocess, as a user runs it; the tests then read its files and stdout.
Every figure is re-derived here from the raw step times in ``gpu_step.jsonl`` (median, tokens/s, the per-token
ratios printed last) and MFU from the issue's own count (``6N + 12·L·T·d`` per token with N the matrix parameters);
the expected variants come from ``canonlm.ops.canon.available_backends`` on this CPU; the document-masked variants
(``.../docs``) must have stepped with their ``doc_ids`` (the documents and loss tokens recorded, re-derived here from
the documented generator). The time limit, the batch fallback after an out-of-memory error, the skip when the whole
run's time is spent, ``--list`` and the step's ``doc_ids`` and loss mask are checked in this process.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import statistics
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_step.py"
# the documented tiny shape: 2 layers, d_model 64, 2 heads, SwiGLU 192, vocab 256, T 64, batch 2
L, D, FF, V, T, B = 2, 64, 192, 256, 64, 2
PEAK = 1e12  # --peak-flops given to the run, so that MFU is computed on CPU too
RATIO = re.compile(r"^ratio (\S+) (\S+) (.+): ([0-9.]+)x \((.*)\)$")


def _load():
    spec = importlib.util.spec_from_file_location("gpu_step_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One ``--tiny`` run with a forced failure (``dao`` cannot run on a CPU): (records, stdout, out dir)."""
    out = tmp_path_factory.mktemp("gpu_step") / "tmp"
    env = dict(os.environ, CANONLM_KERNEL_CACHE=str(out.parent / "kernels"))  # the bench's kernel cache, apart
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--out",
            str(out),
            "--backends",
            "available,dao",
            "--peak-flops",
            str(PEAK),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = (out / "gpu_step.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines], p.stdout, out


def _expected_names() -> set[str]:
    from canonlm.ops.canon import available_backends

    here = [n for n, why in available_backends("cpu", torch.bfloat16).items() if why is None]
    assert {"reference", "torch"} <= set(here)
    names = {
        "tiny/llama/none/-/eager",
        "tiny/llama/ABCD/auto/eager",
        "tiny/llama/ABCD/dao/eager",
        "tiny/llama/none/-/compiled",
        "tiny/llama/ABCD/torch/compiled",
    }
    names |= {f"tiny/llama/ABCD/{b}/eager" for b in here}
    if importlib.util.find_spec("transformers") is not None:
        names.add("tiny/hf/none/-/eager")
    for arch in ("gla", "gdn", "mamba2"):
        names |= {f"tiny/{arch}/b/auto/eager", f"tiny/{arch}/AbCD/auto/eager", f"tiny/{arch}/AbCD/auto/eager/docs"}
    names.add("tiny/llama/ABCD/auto/eager/docs")  # document masking: one variant per canonlm model, after its twin
    return names


def mod_doc_ids(batch: int, seq_len: int, mean_len: int) -> torch.Tensor:
    """The documented document generator, re-implemented: lengths uniform in 1 .. 2·mean - 1 from seed 0, cut at the
    window's end, row after row."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq_len:
            lengths.append(min(int(torch.randint(1, 2 * mean_len, (1,), generator=g)), seq_len - sum(lengths)))
        rows.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
    return torch.stack(rows)


def _per_token(r: dict) -> float:
    return statistics.median(r["step_times_s"]) / (r["batch"] * r["seq_len"])


def test_tiny_run_records_every_variant_and_the_forced_failure(tiny):
    recs, _, out = tiny
    head, variants, last = recs[0], [r for r in recs if r["record"] == "variant"], recs[-1]
    assert head["record"] == "header" and head["device"] == "cpu" and last["record"] == "ratios"
    assert head["versions"]["torch"] == torch.__version__ and "transformers" in head["versions"]
    assert head["canonlm_git"]["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", head["canonlm_git"]["commit"])
    names = [r["name"] for r in variants]
    assert len(names) == len(set(names)) and set(names) == _expected_names()

    dao = next(r for r in variants if r["backend"] == "dao")
    assert dao["status"] == "failed" and "dao" in dao["reason"] and "model.kernels.canon" in dao["reason"]
    # the failure stopped nothing: every other variant ran, in the planned order after it too
    assert names.index(dao["name"]) < len(names) - 1
    for r in variants:
        if r is dao:
            continue
        assert r["status"] == "ok", (r["name"], r["reason"])
        times = r["step_times_s"]
        assert len(times) == 3 and all(math.isfinite(t) and t > 0 for t in times), r["name"]
        assert r["step_s"] == pytest.approx(statistics.median(times), rel=1e-12)
        assert r["batch"] == B and r["seq_len"] == T
        assert r["tokens_per_s"] == pytest.approx(B * T / statistics.median(times), rel=1e-9)
        assert math.isfinite(r["first_step_s"]) and r["first_step_s"] > 0
        assert math.isfinite(r["loss_first"]) and math.isfinite(r["loss_last"])
        # what ran is recorded: an explicit Canon backend on every Canon layer, the compiled graphs of compiled ones
        if r["model"] == "llama" and r["canon"] == "ABCD" and r["backend"] != "auto":
            assert r["canon_backends"] and set(r["canon_backends"].values()) == {r["backend"]}
        if r["compiled"]:
            assert r["dynamo"]["unique_graphs"] >= 1
        else:
            assert r["dynamo"] is None
        # document masking: the step passed doc_ids (documents of mean length T/4) and masked cross-document targets
        assert r["doc_mask"] == r["name"].endswith("/docs")
        if r["doc_mask"]:
            ids = mod_doc_ids(B, T, T // 4)
            starts = int((ids[:, 1:] != ids[:, :-1]).sum()) + B
            same = int((ids[:, 1:] == ids[:, :-1]).sum())
            assert r["docs"] == {"mean_len": T // 4, "documents": starts, "loss_tokens": same}, r["docs"]
            assert B < starts and same < B * (T - 1)
            # run right after the eager variants it pairs with: its twin (linear), the Llama's Canon backends
            before = [n for n in names if n.startswith(f"tiny/{r['model']}/") and n.endswith("/eager")]
            assert names.index(r["name"]) == names.index(before[-1]) + 1 and r["name"][:-5] in before
        else:
            assert "docs" not in r
    md = (out / "gpu_step.md").read_text()
    assert all(f"| {n} |" in md for n in names)


def test_mfu_uses_the_issue_count_and_transformers_gets_canonlm_flops(tiny):
    recs, _, _ = tiny
    by = {r["name"]: r for r in recs if r["record"] == "variant"}
    n_matrix = L * (4 * D * D + 3 * D * FF) + D * V  # q, k, v, o, SwiGLU's three, the LM head
    per_token = 6 * n_matrix + 12 * L * T * D
    for name in ("tiny/llama/none/-/eager", "tiny/llama/none/-/compiled", "tiny/hf/none/-/eager"):
        if name not in by:
            continue
        r = by[name]
        # same model, layer for layer: matrices + embedding + 2 norms a layer + the final norm
        assert r["params"] == n_matrix + V * D + (2 * L + 1) * D
        assert r["flops_per_token"] == per_token
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / PEAK, rel=1e-9)


def test_ratios_are_printed_last_and_recomputed_from_the_medians(tiny):
    recs, stdout, _ = tiny
    ok = {r["name"]: r for r in recs if r["record"] == "variant" and r["status"] == "ok"}
    want = {}
    for r in ok.values():
        none = ok.get(f"tiny/llama/none/-/{r['mode']}")
        if r["name"].endswith("/docs"):
            twin = ok[r["name"][: -len("/docs")]]
            want[("doc_mask_overhead", f"{r['model']} {r['canon']} docs/plain {r['backend']} {r['mode']}")] = (
                _per_token(r) / _per_token(twin)
            )
        elif r["model"] == "llama" and r["canon"] == "ABCD":
            want[("canon_overhead", f"llama ABCD/none {r['backend']} {r['mode']}")] = _per_token(r) / _per_token(none)
        elif r["model"] == "hf":
            want[("vs_transformers", f"transformers/canonlm llama none {r['mode']}")] = _per_token(r) / _per_token(none)
        elif r["canon"] == "AbCD":
            b = ok[f"tiny/{r['model']}/b/{r['backend']}/{r['mode']}"]
            want[("linear_overhead", f"{r['model']} AbCD/b {r['backend']} {r['mode']}")] = _per_token(r) / _per_token(b)
    lines = stdout.rstrip().splitlines()
    printed = lines[-len(want) :]
    got = {}
    for line in printed:
        m = RATIO.match(line)
        assert m, line
        assert m.group(2) == "tiny" and m.group(5) == "no target at this shape"
        got[(m.group(1), m.group(3))] = float(m.group(4))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=6e-4), k
    assert not RATIO.match(lines[-len(want) - 1])  # nothing but ratios after them
    assert "| tiny/llama/none/-/eager | ok |" in stdout  # the table comes before them


def test_yaml_presets_compose_as_hydra():
    """The fallback for a GPU node without hydra-core reads conf/arch like Hydra composes it."""
    mod = _load()
    for arch in mod.linear_presets():
        via_hydra, how = mod.preset_model(arch, "12L768D")
        assert how == "hydra"
        yaml_only = mod._yaml_preset(arch)
        yaml_only["size"] = "12L768D"
        assert yaml_only == via_hydra, arch


@pytest.fixture
def bench(tmp_path):
    mod = _load()
    threads = torch.get_num_threads()
    args, ap = mod.parse_args(["--tiny", "--out", str(tmp_path / "o"), "--steps", "1"])
    mod.check_args(args, ap)
    torch.set_num_threads(args.threads)  # what main() does
    yield mod, args
    torch.set_num_threads(threads)


def test_a_variant_over_its_budget_is_recorded_and_the_next_runs(bench):
    mod, args = bench
    shape, cpu = mod.SHAPES["tiny"], torch.device("cpu")
    ok = mod.Variant("tiny", "llama", "none", "-", False)
    assert mod.run_variant(ok, shape, cpu, args, 60.0, {})["status"] == "ok"  # imports done
    slow = mod.run_variant(mod.Variant("tiny", "llama", "ABCD", "torch", False), shape, cpu, args, 1e-3, {})
    assert slow["status"] == "timeout" and "--budget-s" in slow["reason"] and "step_s" not in slow
    after = mod.run_variant(ok, shape, cpu, args, 60.0, {})
    assert after["status"] == "ok" and after["step_s"] > 0


def test_out_of_memory_tries_the_next_batch(bench, monkeypatch):
    """A CUDA out-of-memory error cannot be caused on a CPU: the step raises torch's OutOfMemoryError above a batch."""
    mod, args = bench
    shape, cpu = mod.SHAPES["tiny"], torch.device("cpu")
    real, seen = mod.Stepper.__call__, []

    def step(self):
        seen.append(self.x.shape[0])
        if self.x.shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        real(self)

    monkeypatch.setattr(mod.Stepper, "__call__", step)
    args.batch, limit, start = (8, 4, 2, 1), 2, {}
    r = mod.run_variant(mod.Variant("tiny", "llama", "none", "-", False), shape, cpu, args, 60.0, start)
    assert r["status"] == "ok" and r["batch"] == 2 and [t["batch"] for t in r["batches_oom"]] == [8, 4]
    assert seen[:3] == [8, 4, 2] and start == {"tiny": 2}
    seen.clear()
    r = mod.run_variant(mod.Variant("tiny", "llama", "ABCD", "torch", False), shape, cpu, args, 60.0, start)
    assert r["status"] == "ok" and r["batch"] == 2 and set(seen) == {2}  # starts where the shape fitted
    limit = 0
    r = mod.run_variant(mod.Variant("tiny", "llama", "none", "-", False), shape, cpu, args, 60.0, {})
    assert r["status"] == "failed" and "out of memory at every batch" in r["reason"]


def test_variants_left_when_the_run_is_out_of_time_are_skipped(bench, tmp_path, capsys):
    mod, _ = bench
    out = tmp_path / "skip"
    assert (
        mod.main(
            [
                "--tiny",
                "--out",
                str(out),
                "--models",
                "llama",
                "--backends",
                "torch",
                "--compile",
                "eager",
                "--max-minutes",
                "1e-9",
            ]
        )
        == 0
    )
    recs = [json.loads(x) for x in (out / "gpu_step.jsonl").read_text().splitlines()]
    variants = [r for r in recs if r["record"] == "variant"]
    assert [r["name"] for r in variants] == [
        "tiny/llama/none/-/eager",
        "tiny/llama/ABCD/torch/eager",
        "tiny/llama/ABCD/torch/eager/docs",
    ]
    assert all(r["status"] == "skipped" and "--max-minutes" in r["reason"] for r in variants)
    assert recs[-1] == {"record": "ratios", "ratios": []}
    assert capsys.readouterr().out.rstrip().endswith("ratio: none (no complete pair measured)")


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--backends", "torch,nope"], "--backends"),
        (["--models", "llama,glaa"], "--models"),
        (["--shapes", "12L768D"], "--shapes"),  # a GPU shape on a CPU
        (["--compile", "eager,jit"], "--compile"),
        (["--batch", "4,0"], "--batch"),
        (["--steps", "0"], "--steps"),
        (["--doc-models", "hf"], "--doc-models"),  # transformers' model takes no doc_ids
        (["--doc-len", "0"], "--doc-len"),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(tmp_path, capsys, argv, option):
    mod = _load()
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        mod.main(["--tiny", "--out", str(out), *argv])
    assert e.value.code == 2 and option in capsys.readouterr().err
    assert not out.exists()


def test_a_previous_run_is_not_overwritten(tmp_path, capsys):
    mod = _load()
    (tmp_path / "gpu_step.jsonl").write_text("mine\n")
    with pytest.raises(SystemExit):
        mod.main(["--tiny", "--out", str(tmp_path)])
    assert "--out" in capsys.readouterr().err and (tmp_path / "gpu_step.jsonl").read_text() == "mine\n"


def test_the_bench_uses_the_kernel_cache(tiny):
    """The header records the kernel cache the run compiled into: ``$CANONLM_KERNEL_CACHE`` as the test set it."""
    records, _, out = tiny
    head = records[0]
    assert head["record"] == "header"
    assert head["options"]["kernel_cache"] == str(out.parent / "kernels")
    assert (out.parent / "kernels" / "triton").is_dir()


def test_list_prints_the_plan_with_the_document_masked_variants(capsys, tmp_path):
    """``--list`` prints the variants in run order (a GPU preset is planned for CUDA even on this CPU) and writes
    nothing; ``--doc-models none`` leaves the document-masked variants out."""
    mod = _load()
    assert mod.main(["--quick", "--list"]) == 0
    names = capsys.readouterr().out.split("\n")
    names = [n.split("  [", 1)[0] for n in names if n]
    assert names == [
        "12L768D/llama/none/-/eager",
        "12L768D/llama/ABCD/auto/eager",
        "12L768D/llama/ABCD/auto/eager/docs",
        "12L768D/hf/none/-/eager",
        "12L768D/llama/none/-/compiled",
        "12L768D/llama/ABCD/auto/compiled",
    ] + [
        f"12L768D/{a}/{c}"
        for a in ("gla", "gdn", "mamba2")
        for c in ("b/auto/eager", "AbCD/auto/eager", "AbCD/auto/eager/docs")
    ]
    assert mod.main(["--quick", "--list", "--doc-models", "none", "--models", "llama,gla"]) == 0
    assert "/docs" not in capsys.readouterr().out


def test_a_document_masked_step_passes_doc_ids_and_masks_cross_document_targets(bench):
    """The step of a ``docs`` variant calls the model with the generator's ``doc_ids`` and gives the loss the
    same-document targets as its mask; its plain twin passes neither."""
    mod, args = bench
    shape, cpu = mod.SHAPES["tiny"], torch.device("cpu")
    for docs in (True, False):
        model, _ = mod.build(mod.Variant("tiny", "llama", "ABCD", "torch", False, docs=docs), shape, cpu)
        seen, masks, forward, loss_fn = [], [], model.forward, None
        model.forward = lambda x, **kw: (seen.append(kw), forward(x, **kw))[1]
        step = mod.Stepper(model, False, 2, shape, cpu, doc_len=8 if docs else None)
        loss_fn = step.loss_fn
        step.loss_fn = lambda logits, tgt, mask: (masks.append(mask), loss_fn(logits, tgt, mask))[1]
        step()
        if docs:
            ids = mod_doc_ids(2, T, 8)
            assert len(seen) == 1 and torch.equal(seen[0]["doc_ids"], ids)
            assert torch.equal(masks[0], ids[:, 1:] == ids[:, :-1]) and not masks[0].all()
        else:
            assert seen == [{}] and masks == [None]
        assert math.isfinite(float(step.loss))
    with pytest.raises(ValueError, match="mean_len=0"):
        mod.doc_ids_for(1, 8, 0)
