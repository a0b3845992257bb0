#!/usr/bin/env bash
# The GPU regression check after a change to the engine, in two device calls of under 10 minutes:
#   bash tools/bench/regression_gpu_run.sh OUT 1   # tests/gpu: the cold read and its digest, the CUDA-only paths,
#                                               # the float8 kernel, one image split over two processes
#   bash tools/bench/regression_gpu_run.sh OUT 2   # the fused swap against the compiled base on FLUX.1-dev
# with PYTHONPATH=/tmp/site:src:tests (pytest among /tmp/site's packages).
set -u
out=$1; call=${2:-1}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import diffusers, torch; print(diffusers.__version__, torch.__version__)"
if [ "$call" = 1 ]; then
  for test in test_read_digest_on_gpu test_gpu_smoke test_fp8_kernel test_context_parallel_on_gpu; do
    timeout 200 env LORASWAP_GPU_EVIDENCE="$out" python3 -m pytest -q -p no:cacheprovider "tests/gpu/$test.py" \
      > "$out/$test.log" 2>&1
    echo "$test rc=$?"; tail -4 "$out/$test.log"
  done
fi
if [ "$call" = 2 ]; then
  timeout 500 python3 -m loraswap bench swap --architecture flux-dev --rounds 3 --variants fused,base \
    --out "$out/swap" > "$out/swap.log" 2>&1
  echo "bench swap rc=$?"; grep -v "Warn\|warn" "$out/swap.log" | tail -12
fi
ls -la "$out"
