#!/usr/bin/env bash
# Builds .gpu_bundle/ here: the wheels benchmarks/gpu_check.sh needs on the lent GPU machine
# that its image lacks, for CPython 3.12 on manylinux x86_64. That image (docs/cluster.md
# "The one-GPU check") has torch, transformers, tokenizers, safetensors, pyarrow, pyyaml and
# numpy, and no network: what the check imports beyond them is pydantic (the config),
# pydantic-settings (load_config's CLI source) and universal_pathlib (`upath`: storage and the
# dataset format), with everything they require. typing-extensions and fsspec are in the
# image too (transformers' huggingface_hub requires them), but pydantic needs a newer
# typing-extensions than an image may have: gpu_check.sh uses a bundled wheel only where the
# image has none or an older one. Ray (79 MB for cp312), torchft and wandb are left out: the
# check's Ray step is skipped without them.
#
# Versions: those of the checkout's dev venv (.venv) where it has the package, else the pins
# below (the dev venv's when this was written). Prints the bundle's files
# and what bringing it costs: the repository's files plus the bundle must stay under 64 MiB.
#
#   bash benchmarks/gpu_bundle.sh                # writes .gpu_bundle/ (replacing what is there)
#   PYTHON=python3.12 BUNDLE=/tmp/b bash benchmarks/gpu_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}   # runs pip
DEV_VENV=.venv/bin/python   # whose versions the bundle takes, where the checkout has it
BUNDLE=${BUNDLE:-.gpu_bundle}
LIMIT=$((64 * 1024 * 1024))   # what the GPU machine takes along: the repository and its extras
# The closure of pydantic, pydantic-settings and universal_pathlib (each one's Requires-Dist).
PINS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      typing-extensions==4.16.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
      universal-pathlib==0.3.11 pathlib-abc==0.5.2 fsspec==2026.9.0)
# The GPU image's interpreter. manylinux2014 (glibc 2.17) also admits the older manylinux tags
# and pure-Python wheels; pip takes the most specific wheel that fits.
TARGET=(--only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.12
        --implementation cp --abi cp312)

# Each pin, at the dev venv's version where it has the package (a clean clone: the pins).
REQS=("${PINS[@]}")
[[ -x $DEV_VENV ]] && mapfile -t REQS < <("$DEV_VENV" - "${PINS[@]}" <<'PY'
import importlib.metadata as md
import sys

for pin in sys.argv[1:]:
    name, fallback = pin.split("==")
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(pin)
PY
)

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
echo "downloading into $BUNDLE: ${REQS[*]}" >&2
"$PYTHON" -m pip download -q --no-deps --dest "$BUNDLE" "${TARGET[@]}" "${REQS[@]}"

# The bundle alone must satisfy every requirement of what the check imports: a resolve with no
# index but the bundle (no pip configuration's find-links either), for the GPU image's
# interpreter, installing nothing.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install -q --dry-run \
  --ignore-installed --no-index --find-links "$BUNDLE" --target "$scratch" "${TARGET[@]}" \
  pydantic pydantic-settings universal-pathlib ||
  { echo "error: $BUNDLE does not satisfy its own requirements: add the missing wheel" \
         "to PINS in $0" >&2; exit 1; }

bundle_bytes=$(du -cb "$BUNDLE"/* | tail -n 1 | cut -f 1)
# What a copy of the working tree brings: the tracked files and the untracked, unignored ones.
repo_bytes=$({ git ls-files -z; git ls-files -z --others --exclude-standard; } |
  du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f 1)
total=$((bundle_bytes + repo_bytes))
echo
find "$BUNDLE" -type f -printf '%10s  %p\n' | sort -k 2
mib() { awk -v b="$1" 'BEGIN { printf "%.2f MiB", b / 1048576 }'; }
echo "bundle $(mib "$bundle_bytes") + repository $(mib "$repo_bytes") = $(mib "$total")" \
     "of the $(mib "$LIMIT") the GPU machine takes along"
if ((total >= LIMIT)); then
  echo "error: over the limit" >&2
  exit 1
fi
