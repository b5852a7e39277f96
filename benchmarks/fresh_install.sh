#!/usr/bin/env bash
# What a new user meets (issue 25): a fresh venv (no system site-packages), `pip install` of this
# checkout, then `automap --help`, `automap demo` and `automap plan torchvision:resnet50`, first
# without the hf extra (the Llama half and hf: specs must say `pip install "automap[hf]"` in one
# line, never a traceback), then with it (both demo halves IDENTICAL, hf:llama plans).
#
#   bash benchmarks/fresh_install.sh [WORKDIR]      # ~5 GB of wheels, minutes; WORKDIR is kept
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d -t automap-fresh-XXXXXX)}
PYTHON=${PYTHON:-python3}
say() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

# run EXPECTED_CODE NAME COMMAND...: the exit code must match and no output may hold a traceback.
run() {
    local want=$1 name=$2; shift 2
    local out="$WORK/$name.out" code=0
    ( cd "$WORK" && "$@" ) >"$out" 2>&1 || code=$?
    tail -n 4 "$out"
    [ "$code" = "$want" ] || fail "$name exited $code, expected $want (see $out)"
    if grep -q "Traceback" "$out"; then fail "$name printed a traceback (see $out)"; fi
}

say "venv in $WORK (no system site-packages); the checkout copied to $WORK/src"
mkdir -p "$WORK/src"
git -C "$ROOT" ls-files -co --exclude-standard | tar -C "$ROOT" -cf - -T - | tar -C "$WORK/src" -xf -
ROOT="$WORK/src"  # pip builds in the tree it installs; keep the checkout clean
"$PYTHON" -m venv "$WORK/venv"
AUTOMAP="$WORK/venv/bin/automap"
start=$(date +%s)
"$WORK/venv/bin/pip" install --quiet "$ROOT"
say "pip install took $(( $(date +%s) - start )) s; $(du -sh "$WORK/venv" | cut -f1) installed"
if "$WORK/venv/bin/python" -c "import transformers" 2>/dev/null; then fail "transformers came without the hf extra"; fi

say "without the hf extra"
run 0 help "$AUTOMAP" --help
run 0 demo "$AUTOMAP" demo
grep -q 'skipped the Llama half.*pip install "automap\[hf\]"' "$WORK/demo.out" || fail "demo did not name the hf extra"
grep -q IDENTICAL "$WORK/demo.out" || fail "demo's ResNet half did not match the plain model"
run 0 plan-resnet50 "$AUTOMAP" plan torchvision:resnet50
run 1 plan-hf-llama "$AUTOMAP" plan hf:llama
[ "$(wc -l <"$WORK/plan-hf-llama.out")" = 1 ] || fail "plan hf:llama without transformers is not one line"
grep -q 'pip install "automap\[hf\]"' "$WORK/plan-hf-llama.out" || fail "plan hf:llama did not name the hf extra"

say "with the hf extra"
start=$(date +%s)
"$WORK/venv/bin/pip" install --quiet "$ROOT[hf]"
say "pip install .[hf] took $(( $(date +%s) - start )) s"
run 0 help-hf "$AUTOMAP" --help
run 0 demo-hf "$AUTOMAP" demo
[ "$(grep -c IDENTICAL "$WORK/demo-hf.out")" = 2 ] || fail "demo with hf: both halves must be IDENTICAL"
run 0 plan-resnet50-hf "$AUTOMAP" plan torchvision:resnet50
run 0 plan-hf-llama-hf "$AUTOMAP" plan hf:llama --set num_hidden_layers=2 --max-memory 0=1GB,cpu=8GB
say "fresh install: all checks passed (outputs in $WORK)"
