#!/usr/bin/env bash
# One prepared check of a GPU node held for a few minutes without network: install from a carried wheelhouse,
# restore a kernel cache, warm-up, the self-check, the GPU tests, the GPU bench, pack the cache -- each phase under its
# own time limit, its output in OUT/phases.log as it comes, OUT/summary.md rewritten after each (docs/gpu_node.md).
#
#   bash scripts/gpu_check.sh --out DIR [--wheelhouse DIR] [--cache-in FILE] [options]     (--help lists them)
#
# This file is only the phase runner. The options, the checks of the inputs, the plan and the dry run, each phase's
# body, the results read from its log and the summary are scripts/gpu_check.py (standard library only: it runs with
# the node's python3 before anything is installed; tests/test_gpu_check.py).
# Exit status: 0 when every phase that ran passed, 1 when one failed or timed out, 2 for bad input (nothing run).
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGIC=scripts/gpu_check.py
WORK=$(mktemp -d "${TMPDIR:-/tmp}/canonlm-gpu-check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT

# options and inputs checked (exit 2 naming each bad one), the dry run printed (3), or the run set up (0)
GPU_CHECK_CALLER=$caller "$PY" "$LOGIC" start "$WORK" "$@"
case $? in 0) ;; 3) exit 0 ;; *) exit 2 ;; esac
out=$(cat "$WORK/out")

# each phase in turn: `next` logs its header and names it (or skips it, saying why, and names the next one)
while "$PY" "$LOGIC" next "$WORK" && read -r phase limit <"$WORK/next" && [ "$phase" != end ]; do
  # TERM at the limit, KILL 10 s later; timeout signals the phase's whole process group
  timeout -k 10 "$limit" "$PY" "$LOGIC" phase "$phase" "$WORK" </dev/null 2>&1 | tee -a "$out/phases.log" "$WORK/$phase.log"
  "$PY" "$LOGIC" done "$WORK" "$phase" "${PIPESTATUS[0]}"
done

# the log cut to the file limit, the summary, the table printed last; the exit status
"$PY" "$LOGIC" finish "$WORK"
