#!/usr/bin/env bash
# FLUX.1-dev float8 restarts from safetensors on a warm compile cache, compiling while
# loading (the default) against compiling at warm-up (--no-prewarm), interleaved; packages
# byte-compiled first, as a pip install leaves them. Run on a CUDA machine from the
# repository root with PYTHONPATH=src; results under ${OUT:-out}.
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
site=$(python -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
started=$(date +%s)
timeout 150 python -m compileall -q -j 16 "$site/torch" "$site/triton" "$site/transformers" ${EXTRA_SITE:-} src \
  >/dev/null 2>&1
echo "compileall rc $? in $(( $(date +%s) - started )) s"
profile="python scripts/startup_profile.py --model flux-dev-random --quantize fp8 --images 1 --no-profile
  --compile-cache ${CACHE:-/tmp/loraswap-cc} --from-disk ${MODEL_DIR:-/tmp/flux}"
start() {  # name, extra flags
  echo "== $1"
  timeout 200 $profile --out "$out/$1.txt" ${2:-} 2>&1 |
    grep -E "compiled while|first image|ready in|swap kernels|^\{|Error|error" | cut -c1-400
}
start cold
for round in 1 2; do
  start "warm-prewarm-$round"
  start "warm-no-prewarm-$round" --no-prewarm
done
