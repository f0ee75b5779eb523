#!/usr/bin/env bash
# One-GPU check (H100/H200), under 8 minutes expected, in one command that ends in a table:
#   1. inner-step throughput and MFU of the tiny and 178M models (bf16 autocast; 178M also
#      with torch.compile), measured peak memory beside gpu_memory's estimate
#                                                                 benchmarks/gpu_step.py
#   2. a full outer round with two replicas on one GPU worker, isoloco and tsv, and the
#      worker's measured peak memory against gpu_memory's estimate  benchmarks/gpu_round.py
#   3. merge speed on the GPU against per-tensor SVDs             benchmarks/merge.py
#   4. agreement: wire codecs on the GPU decode as on the CPU; a background (outer.delay) sync
#      is repeatable and matches the CPU's; a resume is bit for bit   benchmarks/gpu_agree.py
#   5. optional, where Ray is importable: a Ray Train run of one GPU worker (the train CLI,
#      tiny model), with the memory check's figures             python -m isoloco_ray.train
# Steps 1-4 need torch alone (no Ray, torchft or wandb); without Ray, step 5 is skipped with
# a row saying so, which is no failure. Writes the table to $OUT/gpu_check.json too (after
# every step, so a killed command leaves what it measured); exit status 1 when a check failed.
#
# Made for a fixed image with no network (docs/cluster.md "The one-GPU check"): Python 3.12
# with the CUDA build of torch, transformers, tokenizers, safetensors, pyarrow, pyyaml and
# numpy. It runs from this checkout (PYTHONPATH; nothing is installed, so no setuptools or pip
# is needed, and the image's venv may be read-only). What the image lacks (pydantic,
# pydantic-settings, universal_pathlib and what they require) comes as wheels in .gpu_bundle/,
# made beforehand by `bash benchmarks/gpu_bundle.sh`: the wheels that the image has not, or
# only at an older version, are unpacked into a temporary directory put on PYTHONPATH. Ray's
# wheel (79 MB) does not fit the 64 MiB the machine takes along, so the image runs steps 1-4.
# On a machine prepared like the project's own (`pip install -e .`), the bundle is not needed
# and step 5 runs too. No data is downloaded: the round check trains a tokenizer on generated
# text.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine, from anywhere
#   PEAK_FLOPS=989e12 OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh
#   CHECKS="merge agree" bash benchmarks/gpu_check.sh   # a rerun of some checks only
#   bash benchmarks/gpu_check.sh --cpu           # tiny sizes on CPU: checks the script itself
#
# PYTHON: the interpreter (default: python3). BUNDLE: the wheels' folder (.gpu_bundle).
# BUDGET: seconds the whole command may take (default 570, under the GPU machine's 600 s per
# command): a step's time limit is cut to what is left, and a step that would get under 20 s is
# not run (a failure), so the table is always printed. CHECKS: names of the checks to run (step-*,
# round, merge, agree, train; default: all); train reads the data agree prepares in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PYTHON=${PYTHON:-python3}
PEAK_FLOPS=${PEAK_FLOPS:-989e12}   # dense bf16 peak: H100 SXM and H200 989e12; H100 PCIe 756e12
OUT=${OUT:-/tmp/gpu_check}
BUNDLE=${BUNDLE:-$ROOT/.gpu_bundle}
BUDGET=${BUDGET:-570}
CHECKS=${CHECKS:-}
mkdir -p "$OUT"

# The project from this checkout, never an installed copy of another.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c "import pydantic, pydantic_settings, upath" 2>/dev/null; then
  if ! compgen -G "$BUNDLE/*.whl" > /dev/null; then
    echo "$PYTHON lacks pydantic, pydantic-settings or universal_pathlib, and $BUNDLE holds" \
         "no wheels: make it with 'bash benchmarks/gpu_bundle.sh' and bring it along" >&2
    exit 1
  fi
  DEPS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_deps.XXXXXX")
  trap 'rm -rf "$DEPS"' EXIT
  # A wheel is a zip of what goes into site-packages: unpacking it onto PYTHONPATH installs
  # it for these processes alone, without pip. Ahead of site-packages, so a bundled version
  # shadows an older one of the image's (pydantic needs typing-extensions >= 4.16).
  "$PYTHON" - "$BUNDLE" "$DEPS" <<'PY' || exit 1
import importlib.metadata as md
import shutil
import sys
import zipfile
from pathlib import Path

try:
    from packaging.version import Version
except ImportError:  # then an installed one is kept, whatever its version
    Version = None

bundle, deps = Path(sys.argv[1]), Path(sys.argv[2])
unpacked, kept = [], []
for wheel in sorted(bundle.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is not None and (Version is None or Version(have) >= Version(version)):
        kept.append(f"{name} {have}")
        continue
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(deps)
    unpacked.append(f"{name} {version}" + (f" (over {have})" if have else ""))
for data in deps.glob("*.data"):  # a wheel's purelib/platlib parts belong beside the rest
    for part in ("purelib", "platlib"):
        if (data / part).is_dir():
            shutil.copytree(data / part, deps, dirs_exist_ok=True)
    shutil.rmtree(data)
print(f"bundle: unpacked {', '.join(unpacked) or 'nothing'}; the image's own: "
      f"{', '.join(kept) or 'none'}", file=sys.stderr)
PY
  export PYTHONPATH="$ROOT:$DEPS${PYTHONPATH#"$ROOT"}"
fi
"$PYTHON" -c "import torch, transformers, pydantic, pydantic_settings, upath, isoloco_ray" || {
  echo "$PYTHON cannot import what the check needs (above): use the image described at the" \
       "top of $0, or point PYTHON at such a python" >&2; exit 1; }
if "$PYTHON" -c "import ray" 2>/dev/null; then HAVE_RAY=true; else HAVE_RAY=false; fi

if [[ "${1:-}" == "--cpu" ]]; then   # the same steps at sizes a laptop CPU finishes
  DEV=cpu
  STEP=(--device cpu --steps 1 --warmup 0 --batch 2 --seq-len 32 --vocab 512)
  ROUND=(--device cpu --preset tiny --steps 1 --rounds 1 --batch 2 --seq-len 64 --documents 1500)
  MERGE=(--device cpu --model demo --blocks 1 --replicas 2 --strategies isoc tsv)
  PRESETS=(tiny demo)
  GPU=false
else
  DEV=cuda
  "$PYTHON" - <<'PY' || exit 1
import torch
assert torch.cuda.is_available(), f"no CUDA device for torch {torch.__version__}"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PY
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  STEP=(--device cuda)
  ROUND=(--device cuda --preset 178M --steps 5 --rounds 2 --batch 16 --seq-len 512)
  # One block: the float64 SVD baseline of the 32000x1024 embedding must fit the 100 s limit.
  MERGE=(--device cuda --blocks 1)
  PRESETS=(tiny 178M)
  GPU=true
fi

ROWS=()
# The rows so far as JSON in $OUT: rewritten after every check.
write_json() {
  printf '%s\n' "${ROWS[@]}" | "$PYTHON" -c '
import json, sys
rows = [line.rstrip("\n").split("|", 1) for line in sys.stdin if line.strip()]
json.dump({"device": sys.argv[1], "rows": [{"check": c, "result": r} for c, r in rows]},
          open(sys.argv[2], "w"), indent=1)' "$DEV" "$OUT/gpu_check.json"
}
# check NAME SECONDS PATTERN COMMAND...: runs COMMAND under a time limit, keeps its log in
# $OUT and adds the log's lines matching PATTERN (grep -E) to the table, or why it failed; one
# failure skips nothing else. The limit is cut to what is left of BUDGET.
check() {
  local name=$1 limit=$2 pattern=$3; shift 3
  [[ -n $CHECKS && " $CHECKS " != *" $name "* ]] && return 0
  local log="$OUT/$name.log" started=$SECONDS left=$((BUDGET - SECONDS - 15))
  if ((left < 20)); then
    ROWS+=("$name|NOT RUN: ${left}s left of the ${BUDGET}s budget")
    write_json; return 0
  fi
  ((limit > left)) && limit=$left
  echo "== $name (${limit}s): $*" >&2
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local rc=$? took=$((SECONDS - started)) line
  tail -n 3 "$log" >&2
  if [[ $rc -eq 0 ]]; then
    while IFS= read -r line; do
      ROWS+=("$name (${took}s)|$line")
    done < <(grep -E "$pattern" "$log")
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    ROWS+=("$name|TIMEOUT after ${limit}s (log: $log)")
  else
    ROWS+=("$name|FAILED, exit $rc: $(tail -n 1 "$log") (log: $log)")
  fi
  write_json
}
step() {
  check "$1" "$2" "tok/s" "$PYTHON" benchmarks/gpu_step.py "${@:3}" "${STEP[@]}" \
    --peak-flops "$PEAK_FLOPS"
}

# Part 1: torch alone.
step "step-${PRESETS[0]}" 45 --preset "${PRESETS[0]}" --batch 32 --seq-len 256
step "step-${PRESETS[1]}" 75 --preset "${PRESETS[1]}" --batch 16 --seq-len 2048
[[ $DEV == cuda ]] &&  # torch.compile on CPU needs a C++ toolchain; not what is checked here
  step "step-${PRESETS[1]}-compile" 120 --preset "${PRESETS[1]}" --batch 16 --seq-len 2048 --compile
check round 130 "tok/s|^memory" "$PYTHON" benchmarks/gpu_round.py "${ROUND[@]}" \
  --strategies isoloco tsv
# merge.py's summary table: the header and one row per strategy.
check merge 100 "^(strategy|isoc|tsv|isocts|ties|mean) " "$PYTHON" benchmarks/merge.py "${MERGE[@]}"
check agree 60 "^(codecs|background|resume): " "$PYTHON" benchmarks/gpu_agree.py \
  --device "$DEV" --data-dir "$OUT/data" --json "$OUT/agree.json"

# Part 2: Ray Train, where Ray is there.
if $HAVE_RAY; then
  check train 90 "^(GPU memory per worker|final eval loss)" "$PYTHON" -m isoloco_ray.train \
    --model.preset=tiny --data.path="$OUT/data" --data.seq_len=64 --data.batch_size=4 \
    --scaling.replicas=2 --scaling.replicas_per_worker=2 --scaling.use_gpu=$GPU \
    --inner.steps=4 --run.rounds=2 --run.eval_tokens=256 --run.storage_path="$OUT/runs" \
    --run.name="gpu-check-$(date +%s)"
elif [[ -z $CHECKS || " $CHECKS " == *" train "* ]]; then
  skipped="SKIPPED: $PYTHON cannot import ray (its wheel, 79 MB, is over the 64 MiB a GPU"
  ROWS+=("train|$skipped machine takes along); the checks above need torch alone")
  echo "${ROWS[-1]#*|}" >&2
  write_json
fi

echo
echo "GPU check ($DEV, peak ${PEAK_FLOPS} FLOPS; logs in $OUT)"
printf '%-24s | %s\n' "check" "result"
printf '%-24s-+-%s\n' "------------------------" "------------------------------------------"
for row in "${ROWS[@]}"; do printf '%-24s | %s\n' "${row%%|*}" "${row#*|}"; done
write_json
for row in "${ROWS[@]}"; do
  [[ ${row#*|} == FAILED* || ${row#*|} == TIMEOUT* || ${row#*|} == "NOT RUN"* ]] && exit 1
done
exit 0
