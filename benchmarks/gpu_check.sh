#!/usr/bin/env bash
# One-GPU check (H100/H200), under 8 minutes expected (its steps' time limits add up to
# 10.5), ending in a table:
#   1. inner-step throughput and MFU of the tiny and 178M models (bf16 autocast; 178M also
#      with torch.compile)                                        benchmarks/gpu_step.py
#   2. a full outer round with two replicas on one GPU worker, isoloco and tsv
#                                                                 benchmarks/gpu_round.py
#   3. merge speed on the GPU against per-tensor SVDs             benchmarks/merge.py
#   4. agreement: wire codecs on the GPU decode as on the CPU; a background (outer.delay) sync
#      is repeatable and matches the CPU's; a resume is bit for bit   benchmarks/gpu_agree.py
#   5. a Ray Train run of one GPU worker (the train CLI, tiny model), with the memory check's
#      figures                                                    python -m isoloco_ray.train
# Writes the table to $OUT/gpu_check.json too; exit status 1 when a check failed.
#
# The machine it runs on may reach no network: prepare the Python environment beforehand
# (Python >= 3.11 with the CUDA build of torch==2.13.0, ray[default,train,tune,data]==2.60.0,
# transformers, tokenizers, pyarrow, pydantic, pydantic-settings, pyyaml, safetensors: what
# `pip install -e .` installs) and activate it, or point PYTHON at it. The only install this
# script does is the repository itself (`pip install -e . --no-deps --no-build-isolation`,
# offline), and only when `import isoloco_ray` fails. No data is downloaded: the round check
# trains a tokenizer on generated text.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine, from anywhere
#   PEAK_FLOPS=989e12 OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh --cpu           # tiny sizes on CPU: checks the script itself
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
PEAK_FLOPS=${PEAK_FLOPS:-989e12}   # dense bf16 peak: H100 SXM and H200 989e12; H100 PCIe 756e12
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"

"$PYTHON" -c "import isoloco_ray" 2>/dev/null ||
  "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
"$PYTHON" -c "import torch, ray, isoloco_ray" || {
  echo "$PYTHON cannot import torch, ray and isoloco_ray: activate the environment described" \
       "above, or point PYTHON at its python" >&2; exit 1; }

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
# check NAME SECONDS PATTERN COMMAND...: runs COMMAND under a time limit, keeps its log in
# $OUT and adds the log's lines matching PATTERN (grep -E) to the table, or why it failed; one
# failure skips nothing else.
check() {
  local name=$1 limit=$2 pattern=$3; shift 3
  local log="$OUT/$name.log" started=$SECONDS
  echo "== $name: $*" >&2
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local rc=$? took=$((SECONDS - started)) line
  tail -n 3 "$log" >&2
  if [[ $rc -eq 0 ]]; then
    while IFS= read -r line; do ROWS+=("$name (${took}s)|$line"); done < <(grep -E "$pattern" "$log")
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    ROWS+=("$name|TIMEOUT after ${limit}s (log: $log)")
  else
    ROWS+=("$name|FAILED, exit $rc: $(tail -n 1 "$log") (log: $log)")
  fi
}
step() {
  check "$1" "$2" "tok/s" "$PYTHON" benchmarks/gpu_step.py "${@:3}" "${STEP[@]}" \
    --peak-flops "$PEAK_FLOPS"
}

step "step-${PRESETS[0]}" 45 --preset "${PRESETS[0]}" --batch 32 --seq-len 256
step "step-${PRESETS[1]}" 75 --preset "${PRESETS[1]}" --batch 16 --seq-len 2048
[[ $DEV == cuda ]] &&  # torch.compile on CPU needs a C++ toolchain; not what is checked here
  step "step-${PRESETS[1]}-compile" 120 --preset "${PRESETS[1]}" --batch 16 --seq-len 2048 --compile
check round 130 "tok/s" "$PYTHON" benchmarks/gpu_round.py "${ROUND[@]}" --strategies isoloco tsv
# merge.py's summary table: the header and one row per strategy.
check merge 100 "^(strategy|isoc|tsv|isocts|ties|mean) " "$PYTHON" benchmarks/merge.py "${MERGE[@]}"
check agree 60 "^(codecs|background|resume): " "$PYTHON" benchmarks/gpu_agree.py \
  --device "$DEV" --data-dir "$OUT/data" --json "$OUT/agree.json"
check train 90 "^(GPU memory per worker|final eval loss)" "$PYTHON" -m isoloco_ray.train \
  --model.preset=tiny --data.path="$OUT/data" --data.seq_len=64 --data.batch_size=4 \
  --scaling.replicas=2 --scaling.replicas_per_worker=2 --scaling.use_gpu=$GPU \
  --inner.steps=4 --run.rounds=2 --run.eval_tokens=256 --run.storage_path="$OUT/runs" \
  --run.name="gpu-check-$(date +%s)"

echo
echo "GPU check ($DEV, peak ${PEAK_FLOPS} FLOPS; logs in $OUT)"
printf '%-24s | %s\n' "check" "result"
printf '%-24s-+-%s\n' "------------------------" "------------------------------------------"
for row in "${ROWS[@]}"; do printf '%-24s | %s\n' "${row%%|*}" "${row#*|}"; done
printf '%s\n' "${ROWS[@]}" | "$PYTHON" -c '
import json, sys
rows = [line.rstrip("\n").split("|", 1) for line in sys.stdin if line.strip()]
json.dump({"device": sys.argv[1], "rows": [{"check": c, "result": r} for c, r in rows]},
          open(sys.argv[2], "w"), indent=1)' "$DEV" "$OUT/gpu_check.json"
for row in "${ROWS[@]}"; do
  [[ ${row#*|} == FAILED* || ${row#*|} == TIMEOUT* ]] && exit 1
done
exit 0
