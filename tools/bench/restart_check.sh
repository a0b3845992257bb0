#!/usr/bin/env bash
# FLUX.1-dev float8 served from safetensors: a cold start on an empty compile cache, then
# restarts on it, each a fresh process timed to its first image (tools/bench/startup_profile.py),
# alternately plain and with --compile-while-loading.
# Packages are byte-compiled first, as a pip install leaves them. Run on a CUDA machine from
# the repository root with PYTHONPATH=src (EXTRA_SITE: more package folders to byte-compile);
# results under ${OUT:-out}. FLAGS: more startup_profile.py flags for every start
# (--drop-page-cache: each restart reads the weights from the disk, not the page cache).
set -uo pipefail
out=${OUT:-out}; mkdir -p "$out"
cache=${CACHE:-/tmp/loraswap-cc}
site=$(python -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
started=$(date +%s)
timeout 150 python -m compileall -q -j 16 "$site/torch" "$site/triton" "$site/transformers" ${EXTRA_SITE:-} src \
  >/dev/null 2>&1
echo "compileall rc $? in $(( $(date +%s) - started )) s"
rm -rf "$cache"  # the first start is cold
profile="python tools/bench/startup_profile.py --model flux-dev-random --quantize fp8 --images 1 --no-profile
  --compile-cache $cache --from-disk ${MODEL_DIR:-/tmp/flux} ${FLAGS:-}"
start() {  # name, extra flags
  echo "== $1"
  timeout 200 $profile --out "$out/$1.txt" ${2:-} 2>&1 |
    grep -E "compil.* while loading|copied|evicted|from_pretrained|first image|ready in|swap kernels|^\{|Error|error" | cut -c1-400
}
start cold
for round in $(seq 1 "${ROUNDS:-3}"); do
  start "warm-$round"
  start "warm-while-loading-$round" --compile-while-loading
done
