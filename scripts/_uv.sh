# Sourced by scripts/setup.sh, scripts/wheelhouse.sh and .ci/run: find uv, or install it; the offline node's lock
# export. Needs PY (a python3 with pip).
#   find_uv [WHEELHOUSE]   sets UV: $UV when set; else .venv's, PATH's or a earlier-installed uv when it is 0.13 or
#                          newer (the lock format and options these scripts use); else uv==$UV_PIN installed by pip into
#                          $UV_HOME (once per user, shared by every checkout), from PyPI or, offline, from the wheel
#                          folder WHEELHOUSE only
UV_PIN=0.13.9
UV_HOME=${XDG_CACHE_HOME:-$HOME/.cache}/canonlm/uv-$UV_PIN
uv_ok() { "$1" --version 2>/dev/null | awk '{ split($2, v, "."); exit !(v[1] > 0 || v[2] >= 13) }'; }
find_uv() {
  local c
  if [ -n "${UV:-}" ]; then uv_ok "$UV" || { echo "UV='$UV' is not uv 0.13 or newer" >&2; return 2; }; return 0; fi
  for c in .venv/bin/uv "$(command -v uv || true)" "$UV_HOME/bin/uv"; do
    if [ -n "$c" ] && [ -x "$c" ] && uv_ok "$c"; then UV=$(cd "$(dirname "$c")" && pwd)/uv; return 0; fi
  done
  echo "[uv] installing uv==$UV_PIN into $UV_HOME (pip, from ${1:-PyPI})" >&2
  if [ -n "${1:-}" ]; then
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore \
      --no-index --find-links "$1" --upgrade --target "$UV_HOME" "uv==$UV_PIN" >&2 || return 2
  else
    "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore --upgrade --target "$UV_HOME" \
      "uv==$UV_PIN" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) || return 2
  fi
  UV=$UV_HOME/bin/uv
}
# node_export OUT [OPTION...]: what an offline node gets from uv.lock, one pinned line per package with its markers
# (uv export: canonlm's dependencies, the OPTIONs' extras, the build and node groups; never torch or triton, which
# come with the node's torch). Used by setup.sh --wheelhouse and wheelhouse.sh, so both read the same list.
node_export() {
  local out=$1; shift
  "$UV" export --no-hashes --no-header --no-annotate --no-emit-project --no-emit-package torch \
    --no-emit-package triton --group build --group node "$@" -o "$out" >/dev/null
}
