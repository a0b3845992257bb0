#!/usr/bin/env bash
# The GPU regression check after a change to the engine, in one device call of under 10 minutes:
# the fused swap against the compiled base on FLUX.1-dev, and one image split over two processes
# against one process.
#   bash tools/bench/regression_gpu_run.sh OUT
set -u
out=$1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import diffusers, torch; print(diffusers.__version__, torch.__version__)"
timeout 360 python3 -m loraswap bench swap --architecture flux-dev --rounds 3 --variants fused,base \
  --out "$out/swap" > "$out/swap.log" 2>&1
echo "bench swap rc=$?"; grep -v "Warn\|warn" "$out/swap.log" | tail -12
timeout 200 python3 tools/gpu_checks/context_parallel_gpu_check.py --out "$out/context-parallel.json" \
  > "$out/context-parallel.log" 2>&1
echo "context parallel rc=$?"; tail -12 "$out/context-parallel.log"
ls -la "$out"
