#!/usr/bin/env bash
# The GPU runs still owed to the speed and memory options (see BENCHMARKS.md), in the
# order they matter, each under its own timeout so one hang costs minutes. Run from the
# repository root on a CUDA machine with PYTHONPATH=src (and pytest installed, for the checks
# under tests/gpu); results go under ${OUT:-out}.
#   bash tools/bench/gpu_speed_options.sh [step ...]
# steps: smoke fp8-kernel options swap-fp8 serve-sdxl serve-flux lowmem lowmem-profile startup
set -uo pipefail
out=${OUT:-out}/results
mkdir -p "$out"
steps=${*:-smoke options serve-sdxl serve-flux lowmem startup}
run() {
  local name=$1
  echo "== $name (timeout $2 s)"; shift 2; timeout "$@"; echo "== rc $?"
  # bench serve's server logs (its work folder also holds GBs of adapters, left behind)
  mkdir -p "$out/logs/$name" && cp /tmp/loraswap-bench-serve/server-*.log "$out/logs/$name/" 2>/dev/null
  rm -f /tmp/loraswap-bench-serve/server-*.log
}

for step in $steps; do
  case $step in
    smoke)  # CUDA graphs == eager across swaps; dynamic float8 vs bf16; cache tiers
      run smoke 240 240 env LORASWAP_GPU_EVIDENCE="$out" python -m pytest -q -p no:cacheprovider \
        tests/gpu/test_gpu_smoke.py 2>&1 | tail -20 ;;
    fp8-kernel)  # the float8 re-quantization kernel against eager torchao, FLUX-sized layers
      run fp8-kernel 100 100 env LORASWAP_GPU_EVIDENCE="$out" python -m pytest -q -p no:cacheprovider \
        tests/gpu/test_fp8_kernel.py ;;
    swap-fp8)  # a LoRA kept unfused on float8 (the hotswap baseline) against re-quantizing it in
      run swap-fp8 400 400 python -m loraswap bench swap --architecture flux-dev --quantize fp8 --rounds 3 \
        --recompile-swaps 10 --variants hotswap,fused,base --out "$out" ;;
    options)  # attention backends x compile modes, a swap before each image
      for attention in native _native_cudnn _native_flash; do  # one backend per process
        run "options-sdxl-$attention" 300 300 python -m loraswap bench options --architecture sdxl --rounds 3 \
          --out "$out/sdxl-$attention" --variants "$attention@default,$attention@reduce-overhead"
      done
      for attention in native _native_cudnn; do
        run "options-flux-$attention" 420 420 python -m loraswap bench options --architecture flux-dev --steps 28 \
          --rounds 3 --out "$out/flux-$attention" --variants "$attention@default"
      done ;;
    serve-sdxl)  # target: >= 3x the load-and-fuse server with a LoRA per request
      run serve-sdxl 580 580 python -m loraswap bench serve --model sdxl-random --requests 20 --concurrency 4 \
        --out "$out" --fused-args "--compile-mode reduce-overhead" ;;
    serve-flux)  # target: full FLUX pipeline >= 2.5x the load-and-fuse server
      run serve-flux 590 590 python -m loraswap bench serve --model flux-dev-random --requests 12 --concurrency 2 \
        --steps 28 --out "$out" --fused-args "--quantize fp8" ;;
    lowmem)  # target: peak <= 22 GB under a 24 GB cap (gpu_peak_GiB in the JSON);
      # the servers' logs are copied under $out after every serve step (the last attempt left none)
      run lowmem 590 590 python -m loraswap bench serve --model flux-dev-random --requests 6 --concurrency 1 \
        --steps 28 --modes fused --out "$out/lowmem" --fused-args "--quantize fp8 --quantize-text-encoders \
fp8-weight-only --pristine host --gpu-cache-mb 0 --max-gpu-memory-gb 24" ;;
    lowmem-profile)  # the same mode in one process: phase timings, peak memory, a swap per image
      run lowmem-profile 500 500 python tools/bench/startup_profile.py --model flux-dev-random --quantize fp8 \
        --quantize-text-encoders fp8-weight-only --pristine host --gpu-cache-mb 0 --max-gpu-memory-gb 24 \
        --loras 8 --images 4 --compile-cache /tmp/loraswap-cc --no-profile --out "$out/lowmem/profile.txt" \
        2>&1 | tee "$out/lowmem-profile.log" ;;
    startup)  # target: first image after a restart with the compile cache <= 1.5x the load time
      run startup 590 590 python -m loraswap bench startup --model flux-dev-random --rounds 2 --out "$out" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
