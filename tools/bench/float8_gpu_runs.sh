#!/usr/bin/env bash
# The float8 GPU runs in the order they matter, each under its own timeout, for one device
# call or two. Run from the repository root on a CUDA machine
# with PYTHONPATH=src (and pytest installed, for the check); results go under ${OUT:-out}.
#   bash tools/bench/float8_gpu_runs.sh [step ...]
# steps: check swap-flux2 swap-wan swap-flux steps steps-flux2 steps-wan steps-qwen
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
steps=${*:-check swap-flux2 swap-wan swap-flux steps}
run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (timeout $limit s)"
  timeout "$limit" "$@" 2>&1 | grep -v -i "warn" | tail -40
  echo "== $name rc ${PIPESTATUS[0]}"
}

for step in $steps; do
  case $step in
    check)  # the re-quantization kernel against eager torchao, one LoRA and a blend
      run check 120 env LORASWAP_GPU_EVIDENCE="$out" python -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_kernel.py ;;
    steps)  # a FLUX.1 step: torchao's scaling, the served kernel, the kernel with the GELU
      run steps 330 python tools/bench/flux_step_profile.py --variants torchao,one-pass,one-pass-gelu --rounds 3 \
        --out "$out/flux-steps.json" ;;
    steps-flux2)  # FLUX.2 [dev] at 1024 x 1024, two float8 copies from host RAM (fits 80 GB)
      run steps-flux2 560 python tools/bench/flux_step_profile.py --architecture flux2-dev --on-host --steps 4 --rounds 2 \
        --profile-steps 1 --variants torchao,one-pass --out "$out/flux2-steps.json" ;;
    steps-wan)  # Wan 2.2's first expert at 480p, 33 frames
      run steps-wan 500 python tools/bench/flux_step_profile.py --architecture wan-14b --on-host --size 832 --height 480 \
        --steps 4 --rounds 2 --profile-steps 1 --variants torchao,one-pass --out "$out/wan-steps.json" ;;
    steps-qwen)  # Qwen-Image at 1024 x 1024
      run steps-qwen 400 python tools/bench/flux_step_profile.py --architecture qwen-image --on-host --steps 8 --rounds 2 \
        --variants torchao,one-pass --out "$out/qwen-image-steps.json" ;;
    swap-flux2 | swap-wan | swap-flux)  # a float8 swap's time by kernel
      architecture=$(case $step in swap-flux2) echo flux2-dev ;; swap-wan) echo wan-14b ;; *) echo flux-dev ;; esac)
      memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      on_host=$([ "$step" = swap-flux2 ] && [ "${memory:-0}" -lt 100000 ] && echo --on-host)  # FLUX.2 on 80 GB
      run "$step" 300 python tools/bench/float8_swap_profile.py --architecture "$architecture" --rounds 8 $on_host \
        --out "$out/swap-profile-$architecture.json" ;;
    *) echo "unknown step $step" ;;
  esac
done
