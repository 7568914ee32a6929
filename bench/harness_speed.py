"""lm-evaluation-harness speed: ``python -m canonlm.eval.harness`` on a run against ``lm_eval --model hf`` on the
run's export, per architecture, with the same tasks and settings, measured in one run (issue 26, deliverable 4).

    .venv/bin/python bench/harness_speed.py [--archs llama,gla,gdn,mamba2] [--size 4L128D] [--docs 40]
        [--max-gen-toks 16] [--batch-size 8] [--lm-eval-batch-size N] [--reps 2] [--threads N] [--device cpu]
        [--keep DIR]

Per architecture, a run is built as ``train.py`` would build it: the ``conf/arch/<arch>.yaml`` preset (with its
default Canon set) at ``--size`` for ``task=depo1_cpu``, composed with Hydra and built by
``canonlm.config.build.build_configs``, weights at their initialisation (``torch.manual_seed(0)``), saved as
``<dir>/<arch>/run/checkpoints/last.ckpt`` in training's checkpoint layout (``canonlm.hf.checkpoint_dict`` with the
task recorded) and exported to ``<dir>/<arch>/export`` (``canonlm.hf.export_model``, the ``canonlm`` format). Two
local lm-eval tasks read ``--docs`` Depo test instances (context: the instance up to its first ``<ans>``; target:
the answer; both as the task prints them, ``task.decode``): ``cl_ll`` (``loglikelihood``, metric ``acc``) and
``cl_gen`` (``generate_until``, greedy, ``until: ["<ans>"]``, ``max_gen_toks: --max-gen-toks``, metric
``exact_match``).

Each side runs in a fresh child process (this script with ``--child``), so its time is what a user of the command
waits, imports and loading included:

* ``lm_eval``: ``lm_eval.simple_evaluate(model="hf", model_args="pretrained=<export>,trust_remote_code=True",
  tasks, task_manager=TaskManager(include_path=<tasks>), batch_size, device)`` -- what ``lm_eval --model hf
  --model_args pretrained=<export>,trust_remote_code=True --tasks cl_ll,cl_gen --include_path <tasks>`` runs;
* ``harness``: ``canonlm.eval.harness.evaluate(<run>, tasks, include_path=<tasks>, batch_size, device)`` -- what
  ``python -m canonlm.eval.harness <run> --tasks cl_ll,cl_gen --include-path <tasks>`` runs.

Both get ``--device`` and ``--batch-size`` (lm_eval ``--lm-eval-batch-size`` when given: ``--batch-size 8
--lm-eval-batch-size 1`` compares the two commands at their own defaults) and ``torch.set_num_threads(--threads)``
when given. The two sides alternate (lm_eval first in odd rounds, harness first in even ones) over ``--reps`` rounds,
so drift on a shared machine hits both. Per side and figure, the minimum over the rounds of:

* ``wall``: seconds from starting the child process to its exit (what a user of the command waits);
* ``cpu``: the child's user + system CPU seconds (``resource.getrusage(RUSAGE_CHILDREN)``), the figure that stays
  meaningful when other processes share the cores (with ``--threads 1`` it equals the wall time on an idle core);
* ``eval``: wall seconds of the ``simple_evaluate`` / ``evaluate`` call alone (model loading included, interpreter
  start and imports before it excluded).

Printed per architecture: the figures, the ratios harness / lm_eval of ``wall`` and ``cpu`` (target <= 1.5: issue
26) and whether every document's response -- the log-likelihood and is-greedy flag of ``cl_ll``, the generated text
of ``cl_gen`` -- is identical between the two in every round (at one batch size; lm-eval's own generations can
depend on the batch size, as it stops a batch only when every row has shown a stop sequence). Exit status 0 when
the run finished (the ratios are reported, not asserted), 2 for a bad option.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "gla", "gdn", "mamba2")
TASKS = ("cl_ll", "cl_gen")
TARGET = 1.5

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: {kind}
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
{extra}"""


def build(arch: str, size: str, n_docs: int, max_gen_toks: int, out: Path) -> Path:
    """Write ``out/<arch>/{run,export,tasks,docs.jsonl}`` (module docstring); returns ``out/<arch>``."""
    import numpy as np
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from canonlm.arch.model import CanonLM
    from canonlm.config.build import build_configs
    from canonlm.config.resolvers import register_resolvers
    from canonlm.hf import checkpoint_dict, export_model

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"arch={arch}", "task=depo1_cpu", f"model.size={size}"])
    GlobalHydra.instance().clear()
    task, mcfg = build_configs(cfg)
    torch.manual_seed(0)
    model = CanonLM(mcfg).eval()
    d = out / arch
    (d / "run" / "checkpoints").mkdir(parents=True)
    ck = checkpoint_dict(mcfg, model.state_dict(), {})
    ck["canonlm"]["task"] = OmegaConf.to_container(cfg.task, resolve=True)
    torch.save(ck, d / "run" / "checkpoints" / "last.ckpt")
    export_model(d / "run", d / "export")
    docs = []
    for i in range(n_docs):
        inst = task.instance("test", i)
        a = int(np.argmax(inst.loss_mask)) + 1  # past the first <ans> (the first loss position)
        b = a
        while b < len(inst.loss_mask) and inst.loss_mask[b]:
            b += 1
        docs.append({"context": task.decode(inst.tokens[:a]), "target": " " + task.decode(inst.tokens[a:b])})
    (d / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    t = d / "tasks"
    t.mkdir()
    (t / "ll.yaml").write_text(
        TASK_YAML.format(
            name="cl_ll", docs=d / "docs.jsonl", kind="loglikelihood", extra="metric_list:\n  - metric: acc\n"
        )
    )
    (t / "gen.yaml").write_text(
        TASK_YAML.format(
            name="cl_gen",
            docs=d / "docs.jsonl",
            kind="generate_until",
            extra=f'generation_kwargs:\n  until: ["<ans>"]\n  max_gen_toks: {max_gen_toks}\n  do_sample: false\n'
            "metric_list:\n  - metric: exact_match\n",
        )
    )
    return d


def child(side: str, d: Path, batch_size: int, device: str, threads: int | None, dump: Path) -> None:
    """One side's evaluation (module docstring); writes ``{"eval_s", "responses"}`` to ``dump``."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    if side == "lm_eval":
        res = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={d / 'export'},trust_remote_code=True",
            tasks=list(TASKS),
            task_manager=TaskManager(include_path=str(d / "tasks")),
            batch_size=batch_size,
            device=device,
            log_samples=True,
        )
    else:
        from canonlm.eval.harness import evaluate

        res = evaluate(
            d / "run",
            list(TASKS),
            include_path=str(d / "tasks"),
            batch_size=batch_size,
            device=device,
            log_samples=True,
        )
    eval_s = time.perf_counter() - t0
    responses = {
        f"{task}\t{s['doc']['context']}": s["filtered_resps"][0]
        for task, samples in res["samples"].items()
        for s in samples
    }
    dump.write_text(json.dumps({"eval_s": eval_s, "responses": responses}, default=str))


def run_side(side: str, d: Path, args: argparse.Namespace, dump: Path) -> tuple[float, float, dict]:
    """(wall seconds of the child process, its CPU seconds, its dump)."""
    bs = args.lm_eval_batch_size if side == "lm_eval" and args.lm_eval_batch_size else args.batch_size
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        side,
        "--dir",
        str(d),
        "--batch-size",
        str(bs),
        "--device",
        args.device,
        "--dump",
        str(dump),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"{side} on {d.name} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall, cpu, json.loads(dump.read_text())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default=",".join(ARCHS), help=f"comma-separated, from {', '.join(ARCHS)}")
    ap.add_argument("--size", default="4L128D", help="model.size (<layers>L<d_model>D)")
    ap.add_argument("--docs", type=int, default=40, help="documents per task")
    ap.add_argument("--max-gen-toks", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lm-eval-batch-size", type=int, default=None, help="lm_eval's (default: --batch-size)")
    ap.add_argument("--reps", type=int, default=2, help="rounds (each side's minimum is reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads in each child (default: torch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--keep", default=None, help="write the runs here (a new folder) and keep them")
    ap.add_argument("--child", choices=("lm_eval", "harness"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dump", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    archs = [x for x in a.archs.split(",") if x]
    bad = [x for x in archs if x not in ARCHS]
    for key, val, ok in (
        ("--archs", a.archs, archs and not bad),
        ("--docs", a.docs, a.docs >= 1),
        ("--max-gen-toks", a.max_gen_toks, a.max_gen_toks >= 1),
        ("--batch-size", a.batch_size, a.batch_size >= 1),
        ("--reps", a.reps, a.reps >= 1),
        ("--lm-eval-batch-size", a.lm_eval_batch_size, a.lm_eval_batch_size is None or a.lm_eval_batch_size >= 1),
        ("--threads", a.threads, a.threads is None or a.threads >= 1),
        ("--keep", a.keep, a.keep is None or not Path(a.keep).exists()),
    ):
        if not ok:
            allowed = {
                "--archs": f"a comma-separated subset of {', '.join(ARCHS)}",
                "--keep": "a path that does not exist yet",
            }.get(key, "an integer >= 1")
            ap.exit(2, f"harness_speed.py: error: {key}={val!r}; allowed: {allowed}\n")
    a.arch_list = archs
    return a


def main(argv: list[str] | None = None) -> int:
    """Run the bench (module docstring); returns the exit status."""
    args = parse_args(argv)
    if args.child:
        child(args.child, Path(args.dir), args.batch_size, args.device, args.threads, Path(args.dump))
        return 0
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="harness_speed_"))
    base.mkdir(parents=True, exist_ok=True)
    lm_bs = args.lm_eval_batch_size or args.batch_size
    print(
        f"# {len(args.arch_list)} architectures, {args.size}, task depo1_cpu, {args.docs} docs x (cl_ll, cl_gen "
        f"max_gen_toks {args.max_gen_toks}), batch size {args.batch_size} (lm_eval {lm_bs}), device {args.device}, "
        f"threads {args.threads or 'default'}, {args.reps} rounds; runs in {base}",
        flush=True,
    )
    rows = []
    try:
        for arch in args.arch_list:
            d = build(arch, args.size, args.docs, args.max_gen_toks, base)
            times: dict[str, list[tuple[float, float, float]]] = {"lm_eval": [], "harness": []}
            identical = True
            for r in range(args.reps):
                order = ("lm_eval", "harness") if r % 2 == 0 else ("harness", "lm_eval")
                got = {}
                for side in order:
                    wall, cpu, dump = run_side(side, d, args, d / f"{side}_{r}.json")
                    times[side].append((wall, cpu, dump["eval_s"]))
                    got[side] = dump["responses"]
                identical &= got["lm_eval"] == got["harness"] and len(got["harness"]) == len(TASKS) * args.docs
            lm, hr = ([min(x[i] for x in times[s]) for i in range(3)] for s in ("lm_eval", "harness"))
            ratio = (hr[0] / lm[0], hr[1] / lm[1])
            rows.append((arch, ratio, identical))
            print(
                f"{arch:7s} lm_eval wall {lm[0]:6.1f} s cpu {lm[1]:6.1f} s (eval {lm[2]:5.1f})  harness wall "
                f"{hr[0]:6.1f} s cpu {hr[1]:6.1f} s (eval {hr[2]:5.1f})  harness/lm_eval wall {ratio[0]:.2f} cpu "
                f"{ratio[1]:.2f} (target <= {TARGET})  identical responses: {identical}",
                flush=True,
            )
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(base, ignore_errors=True)
    print(
        "ratios (wall, cpu): "
        + ", ".join(f"{a} {r[0]:.2f} {r[1]:.2f}" for a, r, _ in rows)
        + f"; all <= {TARGET}: {all(max(r) <= TARGET for _, r, _ in rows)}; all identical: "
        f"{all(i for *_, i in rows)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
