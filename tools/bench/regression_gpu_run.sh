#!/usr/bin/env bash
# The GPU regression check after a change to the engine, in one device call of under 10 minutes:
# the fused swap against the compiled base on FLUX.1-dev, and one image split over two processes
# against one process.
#   PYTHONPATH=/tmp/site:src bash tools/bench/regression_gpu_run.sh OUT   (pytest among /tmp/site's packages)
set -u
out=$1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import diffusers, torch; print(diffusers.__version__, torch.__version__)"
timeout 360 python3 -m loraswap bench swap --architecture flux-dev --rounds 3 --variants fused,base \
  --out "$out/swap" > "$out/swap.log" 2>&1
echo "bench swap rc=$?"; grep -v "Warn\|warn" "$out/swap.log" | tail -12
timeout 200 env LORASWAP_GPU_EVIDENCE="$out" python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_context_parallel_on_gpu.py > "$out/context-parallel.log" 2>&1
echo "context parallel rc=$?"; tail -12 "$out/context-parallel.log"
ls -la "$out"
