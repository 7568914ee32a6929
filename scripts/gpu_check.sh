#!/usr/bin/env bash
# One prepared check of a GPU node held for a few minutes without network (a cluster's debug queue, an air-gapped
# node): install from a carried wheelhouse, restore a carried kernel cache, then warm-up, the self-check, the GPU
# tests and the GPU bench, each under its own time limit, and pack the warm kernel cache for the next allocation.
#
#   bash scripts/gpu_check.sh --out DIR [--wheelhouse DIR] [--cache-in FILE] [options]    (docs/gpu_node.md)
#
# Phases, in order (name: what, default limit in seconds; they add up to the default --budget of 480):
#   facts      nvidia-smi, Python / torch / CUDA / triton / kernel-package versions, commit                   15
#   install    bash scripts/setup.sh --wheelhouse DIR EXTRAS (offline; the image's CUDA torch is kept)         60
#   restore    the carried kernel cache (--cache-in, a .tar.gz) into --cache-dir, mode 0700; CANONLM_KERNEL_CACHE  20
#   warmup     python -m canonlm.warmup <overrides>, for each --warmup config (GPU only; none by default)       90
#   selfcheck  python -m canonlm.selfcheck --quick --budget-s <limit - 25> --out OUT/selfcheck.md --force   130
#   pytest     python -m pytest -o addopts= -m gpu -ra -q (pytest-timeout per test when installed; GPU only)  100
#   bench      python bench/gpu_step.py BENCH_ARGS --out WORK/bench --max-minutes (the phase's limit) (GPU only) 120
#   pack       the kernel cache as OUT/kernel-cache.tar.gz (split into .00, .01, ... when over --max-file-mib)  30
# A phase whose limit, cut to the time left, falls below what it needs to finish usefully (selfcheck 55 s, bench
# 50 s, pytest 30 s, install 20 s, warmup 30 s, the others 5 s) is skipped with the reason.
# Each phase runs under coreutils `timeout` (TERM, then KILL 10 s later) with cwd = the repository root; its output goes
# to OUT/phases.log as it comes (and to this terminal); a phase that fails or times out is recorded and the next one
# runs. The phases before pack together never start past --budget minus pack's limit: a phase's limit is cut to the
# time left, and a phase with under 5 s left is skipped. OUT/summary.md holds the facts and the table, rewritten
# after every phase; the table is printed last. Without a CUDA GPU (nvidia-smi -L lists none) warmup, pytest and
# bench are skipped and say so.
#
# Options:
#   --out DIR               results (created; default ./gpu-check-<date>); at most --max-files files, flat, each at
#                           most --max-file-mib: summary.md, phases.log, selfcheck.md, gpu_step.jsonl, gpu_step.md,
#                           kernel-cache.tar.gz (or its parts). A summary.md already there is not overwritten without
#                           --force
#   --wheelhouse DIR        the carried wheelhouse (scripts/wheelhouse.sh); without it install is skipped
#   --extras LIST           the extras setup.sh installs (default none: the node's own pytest runs the GPU tests;
#                           dev adds pytest, transformers, wandb, faker, ...: a bigger wheelhouse)
#   --cache-in FILE         the kernel cache packed by an earlier run (kernel-cache.tar.gz, or FILE.00, FILE.01, ...)
#   --cache-dir ABS         where the cache lives (default /tmp/canonlm-kernel-cache). Triton's cache index stores
#                           absolute paths: use the same path on every run and node
#   --budget S              all phases together (default 480: a 10-minute allocation with 2 minutes to spare)
#   --limit PHASE=S         a phase's limit (repeatable)
#   --skip PHASE[,PHASE]    phases not to run (repeatable)
#   --warmup "OVERRIDES"    a config to warm, as train.py's overrides (repeatable), e.g. "task=depo1 trainer=gpu
#                           model.size=12L768D arch=gla canon=AbCD"; without one the warmup phase is skipped
#   --bench-args "ARGS"     bench/gpu_step.py's options before --out / --max-minutes (default --quick)
#   --max-files N           files allowed in --out (default 8; 0: no limit)
#   --max-file-mib M        size allowed per file (default 16; 0: no limit)
#   --force                 overwrite this script's own files in --out
#   --dry-run               check the inputs (wheelhouse, cache archive, --out writable, cache directory), print
#                           each phase's command and limit, and the lines of the self-check and the variants of the
#                           bench (their --list, document masking included); runs nothing, writes nothing
# Exit status: 0 when every phase that ran passed, 1 when one failed or timed out, 2 for bad input (nothing run).
set -uo pipefail
caller=$PWD                       # relative paths in the options are taken from here
ARGS_TEXT=""
for a in "$@"; do ARGS_TEXT+=" $a"; done
cd "$(dirname "$0")/.."
say() { echo "[gpu_check] $*"; }
die() { echo "[gpu_check] ERROR: $*" >&2; exit 2; }

PHASES=(facts install restore warmup selfcheck pytest bench pack)
# The defaults add up to the default --budget (480 s): 15 + 60 + 20 + 130 + 100 + 120 + 30 = 475 (warmup only when asked)
declare -A LIMIT=([facts]=15 [install]=60 [restore]=20 [warmup]=90 [selfcheck]=130 [pytest]=100 [bench]=120 [pack]=30)
# the least time a phase needs to be worth starting (its tool's own budget inside the limit, then its report)
declare -A MIN_USEFUL=([facts]=5 [install]=20 [restore]=5 [warmup]=30 [selfcheck]=55 [pytest]=30 [bench]=50 [pack]=5)
declare -A SKIP=() STATUS=() SECS=() KEY=() LIM_USED=()
GPU_PHASES=" warmup pytest bench "
out="" wheelhouse="" extras="" cache_in="" cache_dir=/tmp/canonlm-kernel-cache budget=480 force="" dry=""
bench_args="--quick" max_files=8 max_file_mib=16
warmups=()
is_int() { [[ $1 =~ ^[0-9]+$ ]]; }
known_phase() { [[ " ${PHASES[*]} " == *" $1 "* ]]; }
abs() { case "$1" in /*) echo "$1" ;; *) echo "$caller/$1" ;; esac; }

# --- command line -------------------------------------------------------------------------------------------------------
while [ $# -gt 0 ]; do
  opt=$1
  case "$opt" in
    --out|--wheelhouse|--extras|--cache-in|--cache-dir|--budget|--limit|--skip|--warmup|--bench-args|--max-files|--max-file-mib)
      [ $# -ge 2 ] || die "$opt needs a value (see the top of scripts/gpu_check.sh)"
      val=$2; shift ;;
    --force) force=1; shift; continue ;;
    --dry-run) dry=1; shift; continue ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$opt' (options: --out, --wheelhouse, --extras, --cache-in, --cache-dir, --budget, --limit,
--skip, --warmup, --bench-args, --max-files, --max-file-mib, --force, --dry-run)" ;;
  esac
  case "$opt" in
    --out) out=$(abs "$val") ;;
    --wheelhouse) wheelhouse=$(abs "$val") ;;
    --extras) extras=$val ;;
    --cache-in) cache_in=$(abs "$val") ;;
    --cache-dir) [[ $val == /* ]] || die "--cache-dir '$val': must be an absolute path (Triton's cache index stores
absolute paths, so the cache must sit at the same absolute path on every run and node)"
                 cache_dir=${val%/}; [ -n "$cache_dir" ] || die "--cache-dir '/': not the root directory" ;;
    --budget) is_int "$val" && [ "$val" -gt 0 ] || die "--budget '$val': a whole number of seconds > 0"; budget=$val ;;
    --limit) p=${val%%=*} s=${val#*=}
             [[ $val == *=* ]] && known_phase "$p" || die "--limit '$val': PHASE=SECONDS with PHASE one of: ${PHASES[*]}"
             is_int "$s" && [ "$s" -gt 0 ] || die "--limit '$val': SECONDS must be a whole number > 0"
             LIMIT[$p]=$s ;;
    --skip) IFS=, read -r -a ps <<<"$val"
            for p in "${ps[@]}"; do known_phase "$p" || die "--skip '$val': unknown phase '$p' (phases: ${PHASES[*]})"; SKIP[$p]=1; done ;;
    --warmup) [ -n "$val" ] || die "--warmup needs train.py overrides, e.g. \"arch=gla canon=AbCD trainer=gpu\""
              warmups+=("$val") ;;
    --bench-args) bench_args=$val ;;
    --max-files) is_int "$val" || die "--max-files '$val': a whole number (0: no limit)"; max_files=$val ;;
    --max-file-mib) is_int "$val" || die "--max-file-mib '$val': a whole number (0: no limit)"; max_file_mib=$val ;;
  esac
  shift
done
if [ ${#warmups[@]} -eq 0 ]; then SKIP[warmup]=1; WARMUP_WHY="skipped (no --warmup config: the bench and the self-check compile what they use)"; fi
[ -n "$out" ] || out=$(abs "gpu-check-$(date +%Y%m%d-%H%M%S)")
OWN=(summary.md phases.log selfcheck.md gpu_step.jsonl gpu_step.md kernel-cache.tar.gz)
PARTS_MIB=$(( max_file_mib > 1 ? max_file_mib - 1 : 1 ))   # parts 1 MiB under the per-file limit

# --- inputs, checked before anything runs ----------------------------------------------------------------------------
problems=()
if [ -n "$wheelhouse" ]; then
  if [ ! -d "$wheelhouse" ]; then problems+=("--wheelhouse '$wheelhouse': no such directory")
  elif ! compgen -G "$wheelhouse/*.whl" >/dev/null; then problems+=("--wheelhouse '$wheelhouse': holds no .whl file")
  fi
fi
cache_parts=()
if [ -n "$cache_in" ]; then
  if [ -f "$cache_in" ]; then cache_parts=("$cache_in")
  else for f in "$cache_in".[0-9][0-9]; do [ -f "$f" ] && cache_parts+=("$f"); done; fi
  if [ ${#cache_parts[@]} -eq 0 ]; then
    problems+=("--cache-in '$cache_in': no such file (nor its parts $cache_in.00, .01, ...)")
  elif ! cat "${cache_parts[@]}" 2>/dev/null | tar -tzf - >/dev/null 2>&1; then
    problems+=("--cache-in '$cache_in': not a readable .tar.gz (tar -tzf fails; ${#cache_parts[@]} file(s))")
  fi
fi
if [ -e "$out" ]; then
  if [ ! -d "$out" ]; then problems+=("--out '$out': exists and is not a directory")
  elif [ ! -w "$out" ] || [ ! -x "$out" ]; then problems+=("--out '$out': not writable")
  elif [ -z "$force" ]; then
    for f in "${OWN[@]}"; do
      if [ -e "$out/$f" ]; then problems+=("--out '$out': already holds $f from an earlier run (choose another --out, or --force)"); break; fi
    done
  fi
else
  parent=$(dirname "$out")
  while [ ! -e "$parent" ]; do parent=$(dirname "$parent"); done
  if [ ! -d "$parent" ] || [ ! -w "$parent" ]; then problems+=("--out '$out': cannot be created ($parent is not a writable directory)"); fi
fi
mib_of() { du -sk --apparent-size "$1" | awk '{ printf "%.1f", $1 / 1024 }'; }      # a file's or a tree's size in MiB
# the cache directory: canonlm refuses one that is a symlink, owned by another user or writable by group / others
cache_problem() {
  local d=$1
  [ -L "$d" ] && { echo "is a symlink"; return; }
  [ -d "$d" ] || { echo "is not a directory"; return; }
  [ "$(stat -c %u "$d")" = "$(id -u)" ] || { echo "is owned by uid $(stat -c %u "$d"), not by this user ($(id -u))"; return; }
  local mode; mode=$(stat -c %a "$d")
  (( (8#$mode & 8#022) == 0 )) || { echo "is writable by group or others (mode $mode)"; return; }
}
# ...and one that holds anything but a kernel cache's own folders is refused: the script packs and chmods it
foreign_entries() {
  local d=$1 e n
  for e in "$d"/* "$d"/.[!.]*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    n=${e##*/}
    case "$n" in triton|inductor|autotune) ;; *) echo "$n"; return ;; esac
  done
}
if [ -z "${SKIP[restore]:-}" ] && { [ -e "$cache_dir" ] || [ -L "$cache_dir" ]; }; then
  why=$(cache_problem "$cache_dir")
  if [ -z "$why" ]; then
    f=$(foreign_entries "$cache_dir")
    [ -z "$f" ] || why="holds '$f', which is not a kernel cache's (only triton/, inductor/ and autotune/ may be there: the script packs the directory and makes it private)"
  fi
  [ -z "$why" ] || problems+=("--cache-dir '$cache_dir': $why; canonlm would refuse it (use a directory of yours with chmod 700, or another path)")
fi
if [ ${#problems[@]} -gt 0 ]; then
  printf '[gpu_check] ERROR: %s\n' "${problems[@]}" >&2
  exit 2
fi

# --- the phases' commands ---------------------------------------------------------------------------------------------
vpy() { if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo "${PYTHON:-python3}"; fi; }
PYV=$(vpy)
WORK=""
cmd_of() {   # the command line of a phase, for the dry run and the log
  local p=$1 py; py=$(vpy)
  case "$p" in
    facts) echo "nvidia-smi --query-gpu=... ; $py -c <versions>; git rev-parse HEAD" ;;
    install) echo "bash scripts/setup.sh --wheelhouse $wheelhouse${extras:+ $extras}" ;;
    restore) if [ ${#cache_parts[@]} -gt 0 ]; then echo "(umask 077; cat ${cache_parts[*]} | tar -xz -C $cache_dir --no-same-owner --no-same-permissions); export CANONLM_KERNEL_CACHE=$cache_dir"
             else echo "mkdir -m 700 $cache_dir; export CANONLM_KERNEL_CACHE=$cache_dir (no --cache-in: starts empty)"; fi ;;
    warmup) local w s=""; for w in "${warmups[@]}"; do s+="$py -m canonlm.warmup $w; "; done; echo "${s%; }" ;;
    selfcheck) echo "$py -m canonlm.selfcheck --quick --budget-s <limit - 25 s> --out $out/selfcheck.md --force" ;;
    pytest) echo "$py -m pytest -o addopts= -m gpu -ra -q -p no:cacheprovider [--timeout 90, with pytest-timeout] tests" ;;
    bench) echo "$py bench/gpu_step.py $bench_args --out <work>/bench --max-minutes <limit - 20 s>" ;;
    pack) echo "tar -czf $out/kernel-cache.tar.gz -C $cache_dir . (parts of $PARTS_MIB MiB when over --max-file-mib $max_file_mib)" ;;
  esac
}
gpu=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then gpu=1; fi
why_skip() {   # why phase $1 does not run (empty: it runs)
  local p=$1
  if [ "$p" = warmup ] && [ -n "${WARMUP_WHY:-}" ]; then echo "$WARMUP_WHY"; return; fi
  if [ -n "${SKIP[$p]:-}" ]; then echo "skipped (--skip)"; return; fi
  if [ "$p" = install ] && [ -z "$wheelhouse" ]; then echo "skipped (no --wheelhouse: the environment as it is)"; return; fi
  if [[ $GPU_PHASES == *" $p "* ]] && [ -z "$gpu" ]; then echo "skipped: no CUDA GPU (nvidia-smi -L lists none)"; return; fi
}

if [ -n "$dry" ]; then
  say "dry run: inputs checked, no phase runs and nothing is written"
  say "  --out $out ($( [ -d "$out" ] && echo exists || echo 'will be created'), at most ${max_files/#0/any number of} files of ${max_file_mib/#0/any} MiB)"
  say "  --wheelhouse ${wheelhouse:-none}$( [ -n "$wheelhouse" ] && echo " ($(compgen -G "$wheelhouse/*.whl" | wc -l) wheels)")"
  say "  --cache-in ${cache_in:-none}$( [ ${#cache_parts[@]} -gt 0 ] && echo " ($(cat "${cache_parts[@]}" | tar -tzf - | grep -vc '/$') files)")"
  if [ -n "$gpu" ]; then g="yes (nvidia-smi -L)"; else g="no (nvidia-smi -L lists none)"; fi
  say "  --cache-dir $cache_dir; CUDA GPU: $g; --budget $budget s"
  i=0
  for p in "${PHASES[@]}"; do
    i=$((i + 1))
    w=$(why_skip "$p")
    printf '[gpu_check] %d %-9s limit %4s s  %s\n' "$i" "$p" "${LIMIT[$p]}" "${w:-$(cmd_of "$p")}"
  done
  # what the selfcheck and bench phases would run, line by line (their own --list: nothing runs, nothing written)
  list_plan() {   # $1: label, rest: the listing command; each line indented, or why there is no listing
    local label=$1 listing rc; shift
    listing=$("$@" 2>/dev/null); rc=$?
    if [ $rc = 0 ]; then
      say "$label ($*):"
      printf '%s\n' "$listing" | sed 's/^/[gpu_check]     /'
    else   # run again for its error (a failing listing is quick)
      say "$label: not listed ($* exits $rc: $("$@" 2>&1 >/dev/null | grep -v '^\s*$' | tail -n 1 | cut -c1-200))"
    fi
  }
  if [ -z "${SKIP[selfcheck]:-}" ]; then
    list_plan "selfcheck plan: its lines, document masking (doc-mask) included" "$(vpy)" -m canonlm.selfcheck --quick --list
  fi
  if [ -z "${SKIP[bench]:-}" ]; then
    if [ -f bench/gpu_step.py ]; then
      # shellcheck disable=SC2086
      list_plan "bench plan (on a CUDA GPU): its variants, document-masked ones (/docs) included" "$(vpy)" bench/gpu_step.py $bench_args --list
    else say "bench plan: not listed (bench/gpu_step.py not found)"; fi
  fi
  if [ -n "$wheelhouse" ] && [ -z "$(why_skip install)" ]; then
    say "install plan (SETUP_DRY_RUN=1 bash scripts/setup.sh --wheelhouse ...): checks the wheelhouse against this machine"
    SETUP_DRY_RUN=1 bash scripts/setup.sh --wheelhouse "$wheelhouse" $extras || exit 2
  fi
  exit 0
fi

# --- run ----------------------------------------------------------------------------------------------------------------
mkdir -p "$out" || die "--out '$out': cannot be created"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/canonlm-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
LOG=$out/phases.log
: >"$LOG"
T0=$SECONDS
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)

table() {
  echo "| phase | status | seconds | limit | result |"
  echo "|---|---|---|---|---|"
  local p
  for p in "${PHASES[@]}"; do
    [ -n "${STATUS[$p]:-}" ] || continue
    echo "| $p | ${STATUS[$p]} | ${SECS[$p]:-0} | ${LIM_USED[$p]:--} | ${KEY[$p]:-} |"
  done
}
write_summary() {
  {
    echo "# gpu_check $started on $(hostname)"
    echo
    echo "- command: \`bash scripts/gpu_check.sh${ARGS_TEXT}\`"
    echo "- budget: $budget s; elapsed: $((SECONDS - T0)) s; kernel cache: $cache_dir"
    if [ -s "$WORK/facts.log" ]; then echo; echo '```'; grep -v '^KEY:' "$WORK/facts.log" | head -n 60; echo '```'; fi
    echo
    table
  } >"$out/summary.md.tmp" && mv "$out/summary.md.tmp" "$out/summary.md"
}

last_line() { grep -v '^\s*$' "$1" | tail -n 1 | cut -c1-160; }
# key results, read from each phase's own log ($WORK/<phase>.log)
key_of() {
  local p=$1 rc=$2 f=$WORK/$1.log
  case "$p" in
    facts) sed -n 's/^KEY: //p' "$f" | tail -n 1 ;;
    install)
      if grep -q 'Missing:' "$f"; then
        echo "missing: $(sed -n '/Missing:/,/^[^ ]/s/^  \([^ ]*\) .*/\1/p' "$f" | awk '!seen[$0]++' | tr '\n' ' ' | sed 's/ $//; s/ /, /g')"
      elif [ "$rc" = 0 ]; then
        echo "$(sed -n 's/^\[setup\] \(keeping torch [^;]*\);.*/\1/p' "$f" | head -n 1); $(sed -n 's/.* \([0-9]*\) from \/.*/\1/p' "$f" | head -n 1) packages from the wheelhouse"
      else grep -m1 'ERROR' "$f" | cut -c1-160; fi ;;
    restore) sed -n 's/^RESULT: //p' "$f" | tail -n 1 ;;
    warmup) echo "$(grep -c '^WARMUP OK' "$f")/${#warmups[@]} configs warm$(grep -q '^WARMUP FAIL' "$f" && echo "; failed: $(sed -n 's/^WARMUP FAIL [0-9]* //p' "$f" | tr '\n' ';')")" ;;
    selfcheck)
      local line
      line=$(grep -ho '([0-9]* PASS, [0-9]* FAIL, [0-9]* SKIP)' "$out/selfcheck.md" 2>/dev/null | tail -n 1)
      if [ -n "$line" ]; then echo "${line//[()]/}"
      else echo "$(grep -c '^\[PASS\]' "$f") PASS, $(grep -c '^\[FAIL\]' "$f") FAIL, $(grep -c '^\[SKIP\]' "$f") SKIP (lines printed; no report)"; fi ;;
    pytest) local r; r=$(grep -oE '[0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)' "$f" | tail -n 6 | tr '\n' ',' | sed 's/,$//; s/,/, /g')
            echo "${r:-$(last_line "$f")}" ;;
    bench) local r; r=$(sed -n 's/^ratio \([a-z_]*\) [^ ]* \(.*\): \([0-9.]*x\).*/\2 \3/p' "$f" | head -n 6 | tr '\n' ';' | sed 's/;$//; s/;/; /g')
           if [ -n "$r" ]; then echo "$r"; elif [ "$rc" = 0 ]; then echo "no ratio (see gpu_step.md)"; else last_line "$f"; fi ;;
    pack) sed -n 's/^RESULT: //p' "$f" | tail -n 1 ;;
  esac
}

# phase bodies (run by `timeout ... bash -c phase_<name>`, with the variables they need exported)
phase_facts() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)  user: $(id -un)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 || true
  else echo "nvidia-smi: not found"; fi
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no git)')"
  local py
  for py in "${PYTHON:-python3}" .venv/bin/python; do
    [ "$py" = .venv/bin/python ] && [ ! -x .venv/bin/python ] && continue
    "$py" - "$py" <<'PY' || true
import importlib.metadata as md, platform, sys
print(f"{sys.argv[1]}: Python {platform.python_version()} at {sys.executable}")
vs = []
for p in ("torch", "triton", "lightning", "transformers", "hydra-core", "fla-core", "mamba-ssm", "causal-conv1d",
          "flash-attn", "canonlm"):
    try:
        vs.append(f"{p} {md.version(p)}")
    except md.PackageNotFoundError:
        vs.append(f"{p} -")
print("  " + ", ".join(vs))
try:
    import torch
    cuda = torch.cuda.is_available()
    dev = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
    print(f"  torch {torch.__version__}, CUDA {torch.version.cuda}, available: {cuda}, {dev}")
    try:
        tri = md.version("triton")
    except md.PackageNotFoundError:
        tri = "-"
    print(f"KEY: {dev}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tri}")
except Exception as e:
    print(f"  torch: {type(e).__name__}: {e}")
    print(f"KEY: no torch in {sys.argv[1]}")
PY
  done
}
phase_install() { bash scripts/setup.sh --wheelhouse "$wheelhouse" $extras; }
phase_restore() {
  set -e
  if [ ! -e "$cache_dir" ]; then mkdir -p -m 700 "$cache_dir"; fi
  local why; why=$(cache_problem "$cache_dir"); [ -z "$why" ] || { echo "ERROR: $cache_dir $why"; return 1; }
  chmod 700 "$cache_dir"
  if [ -n "$cache_in_parts" ]; then
    # shellcheck disable=SC2086
    (umask 077; cat $cache_in_parts | tar -xz -C "$cache_dir" --no-same-owner --no-same-permissions)
  fi
  echo "RESULT: $(find "$cache_dir" -type f | wc -l) files, $(mib_of "$cache_dir") MiB in $cache_dir$( [ -z "$cache_in_parts" ] && echo ' (no --cache-in: empty)')"
}
phase_warmup() {
  local w rc failed=0
  while IFS= read -r w; do
    [ -n "$w" ] || continue
    echo "--- python -m canonlm.warmup $w"
    # shellcheck disable=SC2086
    "$PYV" -m canonlm.warmup $w
    rc=$?
    if [ $rc = 0 ]; then echo "WARMUP OK $w"; else echo "WARMUP FAIL $rc $w"; failed=1; fi
  done <<<"$warmup_list"
  return $failed
}
phase_selfcheck() {   # its own budget 25 s inside the phase limit, so that it stops its lines and writes its report
  local b
  b=$(awk -v s="$phase_limit" 'BEGIN { b = s - 25; if (b < 20) b = 20; printf "%d", b }')   # limit >= 55 s (MIN_USEFUL)
  "$PYV" -m canonlm.selfcheck --quick --budget-s "$b" --out "$out/selfcheck.md" --force
}
phase_pytest() {
  local per=()
  if "$PYV" -c 'import pytest_timeout' 2>/dev/null; then per=(--timeout 90); fi
  # -o addopts=: pyproject's addopts carry --dist loadgroup, which fails where pytest-xdist is not installed
  "$PYV" -m pytest -o addopts= -m gpu -ra -q -p no:cacheprovider "${per[@]}" tests
}
phase_bench() {
  local mins rc
  mins=$(awk -v s="$phase_limit" 'BEGIN { m = (s - 20) / 60; printf "%.2f", m }')   # limit >= 50 s (MIN_USEFUL)
  # shellcheck disable=SC2086
  "$PYV" bench/gpu_step.py $bench_args --out "$WORK/bench" --max-minutes "$mins"
  rc=$?
  return $rc
}
phase_pack() {
  set -e
  [ -d "$cache_dir" ] || { echo "RESULT: no cache directory $cache_dir: nothing to pack"; return 0; }
  local n mib tgz=$WORK/kernel-cache.tar.gz
  n=$(find "$cache_dir" -type f | wc -l); mib=$(mib_of "$cache_dir")
  if command -v pigz >/dev/null 2>&1; then tar -C "$cache_dir" -cf - . | pigz >"$tgz"; else tar -C "$cache_dir" -czf "$tgz" .; fi
  local size; size=$(stat -c %s "$tgz")
  local cap=$(( max_file_mib * 1048576 ))
  local have; have=$(find "$out" -maxdepth 1 -type f ! -name 'kernel-cache.tar.gz*' | wc -l)
  local room=$(( max_files == 0 ? 1000 : max_files - have ))
  rm -f "$out"/kernel-cache.tar.gz "$out"/kernel-cache.tar.gz.[0-9][0-9]
  if [ "$max_file_mib" = 0 ] || [ "$size" -le "$cap" ]; then
    [ "$room" -ge 1 ] || { echo "RESULT: no room in --out for the archive (--max-files $max_files)"; return 1; }
    mv "$tgz" "$out/kernel-cache.tar.gz"
    echo "RESULT: $n files, $mib MiB -> kernel-cache.tar.gz ($(mib_of "$out/kernel-cache.tar.gz") MiB)"
  else
    local parts=$(( (size + PARTS_MIB * 1048576 - 1) / (PARTS_MIB * 1048576) ))
    if [ "$parts" -gt "$room" ] || [ "$parts" -gt 100 ]; then
      local keep="${cache_dir}.tar.gz"
      mv "$tgz" "$keep"
      echo "RESULT: $n files packed to $(mib_of "$keep") MiB: $parts parts of $PARTS_MIB MiB would not fit the $room files left in --out; kept at $keep"
      return 1
    fi
    split -d -a 2 -b "${PARTS_MIB}M" "$tgz" "$out/kernel-cache.tar.gz."
    rm -f "$tgz"
    echo "RESULT: $n files, $mib MiB -> kernel-cache.tar.gz.00..$(printf %02d $((parts - 1))) ($parts parts of <= $PARTS_MIB MiB; restore with --cache-in kernel-cache.tar.gz)"
  fi
}
export WORK out wheelhouse extras cache_dir bench_args max_files max_file_mib PARTS_MIB PYV
export cache_in_parts="${cache_parts[*]}"
export warmup_list; warmup_list=$(printf '%s\n' "${warmups[@]}")
export -f phase_facts phase_install phase_restore phase_warmup phase_selfcheck phase_pytest phase_bench phase_pack \
  cache_problem mib_of

pack_reserve=5                    # what the phases before pack leave for it (and for the table)
if [ -z "${SKIP[pack]:-}" ]; then pack_reserve=$(( LIMIT[pack] + 5 )); fi
worst=0
i=0
for p in "${PHASES[@]}"; do
  i=$((i + 1))
  PYV=$(vpy); export PYV
  w=$(why_skip "$p")
  left=$(( budget - (SECONDS - T0) ))
  lim=${LIMIT[$p]}
  if [ -z "$w" ]; then
    room=$left
    if [ "$p" != pack ]; then room=$(( left - pack_reserve )); fi
    if [ "$room" -lt "$lim" ]; then
      lim=$room
      if [ "$lim" -lt "${MIN_USEFUL[$p]}" ]; then
        w="skipped: no time left ($lim s of the --budget $budget s left for it; it needs at least ${MIN_USEFUL[$p]} s)"
      fi
    fi
  fi
  if [ -n "$w" ]; then
    STATUS[$p]=SKIP; SECS[$p]=0; KEY[$p]=$w
    printf '\n=== %d %s: %s\n' "$i" "$p" "$w" | tee -a "$LOG"
    write_summary
    continue
  fi
  LIM_USED[$p]=$lim
  printf '\n=== %d %s (limit %d s): %s\n' "$i" "$p" "$lim" "$(cmd_of "$p")" | tee -a "$LOG"
  t=$SECONDS
  export phase_limit=$lim
  timeout -k 10 "$lim" bash -c "phase_$p" </dev/null 2>&1 | tee -a "$LOG" "$WORK/$p.log"
  rc=${PIPESTATUS[0]}
  SECS[$p]=$(( SECONDS - t ))
  case "$rc" in
    0) STATUS[$p]=OK ;;
    124|137) STATUS[$p]=TIMEOUT ;;
    *) STATUS[$p]="FAIL (exit $rc)" ;;
  esac
  KEY[$p]=$(key_of "$p" "$rc" | tr '|' '/' | cut -c1-200)
  [ "$rc" = 0 ] || worst=1
  if [ "$p" = restore ] && [ "$rc" = 0 ]; then export CANONLM_KERNEL_CACHE=$cache_dir; fi
  if [ "$p" = bench ]; then
    for f in gpu_step.jsonl gpu_step.md; do if [ -f "$WORK/bench/$f" ]; then cp "$WORK/bench/$f" "$out/$f"; fi; done
  fi
  write_summary
done
# the log must fit one file: keep its head and tail
cap=$(( max_file_mib * 1048576 ))
if [ "$max_file_mib" -gt 0 ] && [ "$(stat -c %s "$LOG")" -gt "$cap" ]; then
  half=$(( cap / 2 - 4096 ))
  { head -c "$half" "$LOG"; printf '\n[... cut to fit --max-file-mib %s ...]\n' "$max_file_mib"; tail -c "$half" "$LOG"; } >"$WORK/log" && mv "$WORK/log" "$LOG"
fi
write_summary
echo
say "results in $out: $(cd "$out" && ls | tr '\n' ' ')"
echo
table
exit $worst
