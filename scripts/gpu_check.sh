#!/usr/bin/env bash
# GPU check for asyncpool: one prepared script, under 5 minutes on a CUDA machine.
#
#   scripts/gpu_check.sh            # logs and summary go to $OUT if set, else a temp dir
#   OUT=/some/dir scripts/gpu_check.sh
#   DEMO_N=1500 PYTHON=python3.11 scripts/gpu_check.sh   # demo size, interpreter
#   INSTALL=0 scripts/gpu_check.sh  # offline machine whose python already has
#                                   # the test dependencies: run from the checkout
#   PYTEST_ARGS="-W default" scripts/gpu_check.sh   # extra pytest options
#   FULL_SUITE=1 scripts/gpu_check.sh   # also the whole suite (xdist if present)
#
# Steps (each has its own time limit; a failure does not stop the others):
#   1. environment: GPU, driver, torch and CUDA versions
#   2. install the project (pip install -e '.[test]'; offline-safe fallbacks)
#   3. every test marked `cuda` (both event loops): CUDA events as fences and
#      their pool, the pool on a device with a lagging forward kernel, resets on
#      the pool's stream, the watcher's wake latency and CPU, memory saver
#      release/resume of the `kv_cache` region (torch hook mode)
#   4. the memory-saver test again with the LD_PRELOAD hooks (preload mode)
#   5. the scheduler demo on CUDA, fenced: must complete with 0 corruptions
#   6. the scheduler demo on CUDA, --unsafe: must show corruptions (exit 1)
#   7. every examples/*.py with --device cuda (each checks itself, exit 0/1;
#      examples/_*.py are modules the examples share, not programs)
#   8. the demo as one tensor-parallel replica over NCCL (--tp 1): explicit
#      pools, agree() with CUDA tensors; must finish with 0 mismatches
#   9. (FULL_SUITE=1) the whole suite on the CUDA machine, reported apart:
#      not part of the pass/fail verdict
# Writes $OUT/gpu_check_summary.txt and $OUT/gpu_check_summary.json, per-step
# logs, junit XML, and the demo reports ($OUT/demo_fenced.json, demo_unsafe.json).
# Exit status: 0 when every step passed, 1 otherwise.

set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT_DIR="${OUT:-$(mktemp -d -t asyncpool-gpu-check.XXXXXX)}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
# pip: fail fast without network instead of retrying for minutes
export PY ROOT PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PIP_RETRIES=1 PIP_TIMEOUT=10
STEPS="$OUT_DIR/gpu_check_steps.tsv"
: >"$STEPS"
T_START=$(date +%s)

say() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# run_step NAME LIMIT_S CMD...: run with a time limit, log to $OUT_DIR/NAME.log
run_step() {
    local name="$1" limit="$2"
    shift 2
    local log="$OUT_DIR/$name.log" t0 t1 rc
    say "step $name (limit ${limit}s): $*"
    t0=$(date +%s%N)
    if declare -F "$1" >/dev/null; then  # a shell function: run it in a child bash
        timeout --kill-after=10 "$limit" bash -c "$(declare -f "$1"); $*" >"$log" 2>&1
    else
        timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    fi
    rc=$?
    t1=$(date +%s%N)
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", (b-a)/1e9}')" >>"$STEPS"
    tail -n 5 "$log" | sed "s/^/    [$name] /"
    say "step $name: rc=$rc"
    return $rc
}

# --------------------------------------------------------------------------- 1. environment
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
    "$PY" - <<'EOF' 2>&1 || true
import sys
print("python", sys.version.split()[0])
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "available", torch.cuda.is_available(),
          "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
except Exception as exc:  # noqa: BLE001
    print("torch import failed:", exc)
EOF
} >"$OUT_DIR/environment.log"
sed 's/^/    [env] /' "$OUT_DIR/environment.log"

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    say "torch is not importable; trying to install it (needs network)"
    "$PY" -m pip install torch >"$OUT_DIR/install_torch.log" 2>&1 || say "torch install failed"
fi
HAVE_CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

# --------------------------------------------------------------------------- 2. install
install_project() {
    # Build without isolation when setuptools is here: an isolated build
    # downloads setuptools, which fails on a machine without network.
    local iso=""
    if "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)" 2>/dev/null; then
        iso="--no-build-isolation"
    fi
    cd "$ROOT" || return 1
    # shellcheck disable=SC2086  # $iso is one flag or nothing
    if "$PY" -m pip install $iso -e '.[test]'; then
        return 0
    fi
    echo "pip install -e '.[test]' failed (offline?); trying a wheelhouse, then no deps"
    local wh="${WHEELHOUSE:-$ROOT/wheelhouse}"
    # shellcheck disable=SC2086
    if [ -d "$wh" ] && "$PY" -m pip install $iso --no-index --find-links "$wh" -e '.[test]'; then
        return 0
    fi
    # shellcheck disable=SC2086
    "$PY" -m pip install $iso --no-deps -e . || true
    return 1
}
if [ "${INSTALL:-1}" = 0 ]; then
    say "INSTALL=0: not installing; asyncpool and scheduler_demo run from $ROOT"
elif run_step install 120 install_project; then :; else
    say "install incomplete: falling back to PYTHONPATH=$ROOT for asyncpool/scheduler_demo"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
MISSING=$("$PY" - <<'EOF'
import importlib.util
need = ["torch", "pytest", "pytest_asyncio", "pytest_timeout", "uvloop", "hypothesis", "asyncpool"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
)
[ -n "$MISSING" ] && say "missing modules: $MISSING (the steps below that need them will fail)"

# --------------------------------------------------------------------------- 3. cuda tests
# shellcheck disable=SC2206  # PYTEST_ARGS is split into options on purpose
PYTEST=("$PY" -m pytest -p no:cacheprovider -rA -s --timeout 120 ${PYTEST_ARGS:-})
# The step's limit leaves room for one hung test: conftest.py marks every
# cuda test timeout(180) on a CUDA machine, and a marker wins over
# --timeout, so at 150 s one hang killed the step before pytest wrote the
# junit XML, and the summary could not say which test hung.
run_step cuda_tests 300 "${PYTEST[@]}" -m cuda tests --junitxml="$OUT_DIR/cuda_tests.xml"

skip_step() {
    say "step $1 skipped: $2"
    printf '%s\tskipped\t0\n' "$1" >>"$STEPS"
}
if [ "$HAVE_CUDA" != 1 ]; then
    say "no CUDA device visible to torch: the cuda tests above skipped; skipping the rest"
    for step in memory_saver_preload demo_fenced demo_unsafe examples demo_tp; do
        skip_step "$step" "no CUDA device"
    done
else
# --------------------------------------------------------------------------- 4. preload mode
PRELOAD_LIB=$("$PY" -c "
from torch_memory_saver.utils import get_binary_path_from_package as g
print(g('torch_memory_saver_hook_mode_preload'))" 2>/dev/null || true)
if [ -n "$PRELOAD_LIB" ] && [ -e "$PRELOAD_LIB" ]; then
    run_step memory_saver_preload 60 env LD_PRELOAD="$PRELOAD_LIB" "${PYTEST[@]}" \
        tests/test_cuda.py -k memory_saver --junitxml="$OUT_DIR/memory_saver_preload.xml"
else
    skip_step memory_saver_preload "torch-memory-saver's preload library not found"
fi

# --------------------------------------------------------------------------- 5-6. demo
DEMO_N="${DEMO_N:-800}"  # requests per demo run (the demo's default is 1500)
run_step demo_fenced 90 "$PY" -m scheduler_demo --device cuda -n "$DEMO_N" --no-progress --timeout 80 \
    --json "$OUT_DIR/demo_fenced.json"
run_step demo_unsafe 90 "$PY" -m scheduler_demo --device cuda -n "$DEMO_N" --unsafe --no-progress \
    --timeout 80 --json "$OUT_DIR/demo_unsafe.json"
# --------------------------------------------------------------------------- 7. examples
run_step examples 240 bash -c 'for ex in examples/[!_]*.py; do echo "== $ex"; "$PY" "$ex" --device cuda || exit 1; done'
# --------------------------------------------------------------------------- 8. --tp over NCCL
run_step demo_tp 90 "$PY" -m scheduler_demo --device cuda --tp 1 -n 200 --no-progress --timeout 80
# --------------------------------------------------------------------------- 9. whole suite
if [ "${FULL_SUITE:-0}" = 1 ]; then
    XDIST=()
    "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${FULL_SUITE_WORKERS:-8}")
    # shellcheck disable=SC2206
    run_step full_suite "${FULL_SUITE_LIMIT:-300}" "$PY" -m pytest -p no:cacheprovider -q \
        ${PYTEST_ARGS:-} "${XDIST[@]}" tests --junitxml="$OUT_DIR/full_suite.xml"
fi
fi

# --------------------------------------------------------------------------- summary
"$PY" - "$OUT_DIR" "$STEPS" "$HAVE_CUDA" "$(($(date +%s) - T_START))" <<'EOF'
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, steps_file, have_cuda, total = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
steps = {}
for line in steps_file.read_text().splitlines():
    name, rc, secs = line.split("\t")
    steps[name] = {"rc": rc, "seconds": float(secs)}


def junit(path):
    p = out / path
    if not p.exists():
        return None
    root = ET.parse(p).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for s in suites for c in s.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    counts["failed"] = failed
    counts["skipped_tests"] = [
        f"{c.get('classname')}::{c.get('name')}: {c.find('skipped').get('message', '')}"
        for s in suites for c in s.iter("testcase")
        if c.find("skipped") is not None
    ]
    return counts


def demo(path):
    p = out / path
    if not p.exists():
        return None
    try:
        data = json.loads(p.read_text())
    except ValueError:
        return None
    return {k: data.get(k) for k in ("corruptions", "completed", "requests", "elapsed_s", "unsafe")}


def grep(log, pattern):
    p = out / log
    if not p.exists():
        return []
    return [m.group(0) for m in re.finditer(pattern, p.read_text())]


ok = {}
t = junit("cuda_tests.xml")
ok["cuda_tests"] = bool(
    t and steps.get("cuda_tests", {}).get("rc") == "0" and t["tests"] > t["skipped"] and not t["failed"]
)
mp = steps.get("memory_saver_preload", {}).get("rc")
ok["memory_saver_preload"] = mp == "0" or (mp == "skipped" and have_cuda == "1")
fenced, unsafe = demo("demo_fenced.json"), demo("demo_unsafe.json")
ok["demo_fenced"] = bool(
    steps.get("demo_fenced", {}).get("rc") == "0" and fenced and fenced.get("corruptions") == 0
)
ok["demo_unsafe"] = bool(unsafe and (unsafe.get("corruptions") or 0) > 0)
ok["examples"] = steps.get("examples", {}).get("rc") == "0"
ok["demo_tp"] = steps.get("demo_tp", {}).get("rc") == "0" and bool(
    grep("demo_tp.log", r"tensor parallel: .* 0 mismatches")
)
ok["install"] = steps.get("install", {}).get("rc") == "0"
ok["full_suite"] = steps.get("full_suite", {}).get("rc") == "0"
summary = {
    "passed": all(ok[k] for k in ("cuda_tests", "memory_saver_preload", "demo_fenced", "demo_unsafe",
                                  "examples", "demo_tp")),
    "cuda_available": have_cuda == "1",
    "total_seconds": int(total),
    "ok": ok,
    "steps": steps,
    "cuda_tests": t,
    "memory_saver_preload_tests": junit("memory_saver_preload.xml"),
    "full_suite": junit("full_suite.xml"),
    "watcher": grep("cuda_tests.log", r"watcher wake latency: [^\n]*"),
    "memory_saver": grep("cuda_tests.log", r"memory saver: released [^\n]*"),
    "demo_fenced": fenced,
    "demo_unsafe": unsafe,
    "environment": (out / "environment.log").read_text().strip().splitlines(),
}
(out / "gpu_check_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
lines = [
    f"asyncpool GPU check: {'PASS' if summary['passed'] else 'FAIL'} in {total}s "
    f"(cuda available: {summary['cuda_available']})",
    *("  env: " + e for e in summary["environment"]),
]
for name, st in steps.items():
    lines.append(f"  {name:22s} rc={st['rc']:>7s} {st['seconds']:7.1f}s  {'ok' if ok.get(name) else 'FAIL'}")
if t:
    lines.append(
        f"  cuda tests: {t['tests']} run, {t['failures'] + t['errors']} failed, {t['skipped']} skipped"
    )
    lines += ["    failed: " + f for f in t["failed"]]
    lines += ["    skipped: " + f for f in t["skipped_tests"][:20]]
fs = summary["full_suite"]
if fs:
    lines.append(
        f"  full suite (not in the verdict): {fs['tests']} run, "
        f"{fs['failures'] + fs['errors']} failed, {fs['skipped']} skipped"
    )
    lines += ["    failed: " + f for f in fs["failed"][:30]]
lines += ["  " + w for w in summary["watcher"] + summary["memory_saver"]]
lines.append(f"  demo fenced: {fenced}")
lines.append(f"  demo unsafe: {unsafe}")
text = "\n".join(lines) + "\n"
(out / "gpu_check_summary.txt").write_text(text)
print(text)
sys.exit(0 if summary["passed"] else 1)
EOF
RC=$?
say "summary: $OUT_DIR/gpu_check_summary.txt (exit $RC)"
exit $RC
