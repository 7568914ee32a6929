#!/usr/bin/env bash
# End to end on real text, on a CPU (docs/text_data.md, "End to end"; the same steps are tested, with oracles, by
# tests/test_text_e2e.py): two real corpora shipped with installed packages (tests/fixtures/corpora/*/SOURCE.md)
# -> a byte-level BPE (the `tokenizers` library) -> `python -m canonlm.data.prepare` (2 workers, paragraphs, EOS)
# -> a 70/30 mixture trained with `python train.py` (Llama 2L64D + Canon-ABCD) -> SIGKILL after the first step
# checkpoint -> resume with ckpt_path=auto -> `python -m canonlm.eval.harness` on a local lm-eval task built from
# held-out paragraphs. Prints each command's wall time and the per-source validation losses.
#
#   bash scripts/text_e2e.sh [OUT]      # OUT: a new folder (default: a fresh one under /tmp); nothing is overwritten
#
# Needs the project's venv (.venv, with the `eval` extra for the last step) and about 1-2 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-$(mktemp -d /tmp/canonlm_text_e2e.XXXXXX)}
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then echo "text_e2e.sh: $OUT exists and is not empty" >&2; exit 2; fi
mkdir -p "$OUT"
export WANDB_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
C=tests/fixtures/corpora
exec 3>&2  # timings go to the terminal's stderr even when a command's output is redirected to a file
timed() { local t0; t0=$(date +%s.%N); "$@"; echo "[time] $(echo "$(date +%s.%N) - $t0" | bc) s: ${*:1:6}" >&3; }
echo "[load] $(cut -d' ' -f1-3 /proc/loadavg)" >&2

# 1. tokenizer: byte-level BPE, 1,024 ids, trained on both corpora
timed "$PY" - "$OUT/tokenizer.json" "$C/licenses/text" "$C/readmes/text" <<'EOF'
import sys
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
files = sorted(str(f) for d in sys.argv[2:] for f in Path(d).iterdir())
tok.train(files, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<pad>", "</s>"], show_progress=False,
                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.save(sys.argv[1])
EOF

# 2. prepare each corpus: one document per paragraph, </s> after each, 2 worker processes
for c in readmes licenses; do
  timed "$PY" -m canonlm.data.prepare --input "$C/$c/text" --tokenizer "$OUT/tokenizer.json" --out "$OUT/data/$c" \
      --text-unit paragraph --append-eos --workers 2 --val-fraction 0.1 --test-fraction 0.05
done

# 3. train on the 70/30 mixture
ARGS=(task=text task.data_dir=null
      "task.sources={readmes: {data_dir: $OUT/data/readmes, weight: 0.7}, licenses: {data_dir: $OUT/data/licenses, weight: 0.3}}"
      task.context=128 arch=llama canon=ABCD model.size=2L64D data.batch_size=8 data.val_windows=32
      data.test_windows=32 trainer.max_steps=200 trainer.val_check_interval=50 trainer.log_every_n_steps=10
      callbacks.checkpoint.every_n_train_steps=100 callbacks.progress.force=lines paths.log_dir="$OUT/logs")
timed "$PY" train.py "${ARGS[@]}" run_name=ref > "$OUT/ref.out" 2>&1

# 4. the same run, killed (SIGKILL) 10 steps after its step-100 checkpoint, then resumed with ckpt_path=auto
t0=$(date +%s.%N)
"$PY" train.py "${ARGS[@]}" run_name=kr > "$OUT/kr.out" 2>&1 &
pid=$!
until [ -e "$OUT/logs/train/runs/kr/checkpoints/step0000100.ckpt" ] && grep -q '^\[step 110/' "$OUT/kr.out"; do
  kill -0 $pid 2>/dev/null || { echo "text_e2e.sh: the run ended before the kill" >&2; exit 1; }
  sleep 0.05
done
kill -KILL $pid; wait $pid || true
echo "[time] $(echo "$(date +%s.%N) - $t0" | bc) s: train until SIGKILL (last line: $(grep '^\[step' "$OUT/kr.out" | tail -1 | cut -c1-20))" >&2
timed "$PY" train.py "${ARGS[@]}" run_name=kr ckpt_path=auto > "$OUT/kr_resume.out" 2>&1
grep 'resuming from' "$OUT/kr_resume.out" | sed 's/.*INFO\] - //' >&2

# 5. lm-eval on held-out (test-split) paragraphs: last-word log-likelihood, one task per source
mkdir -p "$OUT/tasks"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
import numpy as np
from tokenizers import Tokenizer
out = Path(sys.argv[1]); tok = Tokenizer.from_file(str(out / "tokenizer.json"))
for name in ("readmes", "licenses"):
    d = out / "data" / name; meta = json.loads((d / "meta.json").read_text()); items = []
    for sh in meta["splits"]["test"]["shards"]:
        ids = np.fromfile(d / sh["file"], dtype=meta["dtype"]); st = np.load(d / sh["index"])[:, 1].tolist() + [len(ids)]
        for a, b in zip(st[:-1], st[1:]):
            p = tok.decode(ids[a:b - 1].tolist()); ctx, _, last = p.rpartition(" ")
            if 16 <= b - 1 - a <= 120 and ctx.strip() and ctx == ctx.rstrip() and last.rstrip(".,;:)").isalpha():
                items.append({"context": ctx, "target": " " + last})
    (out / f"heldout_{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items[:16]))
    (out / "tasks" / f"e2e_{name}.yaml").write_text(
        f"task: e2e_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {out}/heldout_{name}.jsonl\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: \"{{context}}\"\ndoc_to_target: \"{{target}}\"\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
EOF
timed "$PY" -m canonlm.eval.harness "$OUT/logs/train/runs/kr" --tasks e2e_readmes,e2e_licenses \
    --include-path "$OUT/tasks" --device cpu --out "$OUT/harness.json" > /dev/null

# summary: per-source validation losses of both runs, equality of the resumed run, the harness numbers
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
import torch
from canonlm.train.metrics_file import read_metrics
out = Path(sys.argv[1]); runs = out / "logs" / "train" / "runs"
for run in ("ref", "kr"):
    rows = read_metrics(runs / run / "metrics.jsonl"); res = json.loads((runs / run / "results.json").read_text())
    for s in ("readmes", "licenses"):
        val = " ".join(f"@{r['step'] + 1}:{r[f'val/{s}/loss']:.4f}" for r in rows if f"val/{s}/loss" in r)
        print(f"{run} val/{s}/loss {val}; test {res['test']['sources'][s]['loss']:.4f}")
    print(f"{run}: steps {res['steps']}, tokens {res['tokens_seen']}, attempts {res['attempts']}, "
          f"train_time_s {res['train_time_s']}, test loss {res['test']['loss']!r}")
a, b = (torch.load(runs / r / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"] for r in ("ref", "kr"))
print("resumed == uninterrupted (weights bit-identical):", all(torch.equal(a[k], b[k]) for k in a))
h = json.loads((out / "harness.json").read_text())
for t, r in sorted(h.items()):
    print(f"harness {t}: perplexity {r['perplexity,none']:.6g}, acc {r['acc,none']:.4f}")
EOF
echo "[out] $OUT" >&2
