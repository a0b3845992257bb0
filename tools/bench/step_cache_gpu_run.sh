#!/usr/bin/env bash
# Step caching on the GPU, in device calls of under 10 minutes each (tools/bench/step_cache_gpu_bench.py):
#   bash tools/bench/step_cache_gpu_run.sh OUT 1   # demo-flux decides (schedules.json), FLUX.1-dev float8 pipeline,
#                                              # then through the server, one client
#   bash tools/bench/step_cache_gpu_run.sh OUT 2   # FLUX.1-dev bf16 pipeline
#   SCHEDULES=FILE bash tools/bench/step_cache_gpu_run.sh OUT 4   # the leak check, the server run, Qwen-Image
#   SCHEDULES=FILE bash tools/bench/step_cache_gpu_run.sh OUT 5   # the leak check per adapter, Wan 2.2
#   bash tools/bench/step_cache_gpu_run.sh OUT 3   # transformers alone: Qwen-Image, Wan 2.2, FLUX.2 [dev]
# A call after the first takes OUT/schedules.json from an earlier call (copy it back into OUT first).
set -u
out=$1; call=$2
export PYTHONPATH=/tmp/site:src:tests PYTHONUNBUFFERED=1
mkdir -p "$out"
bench="python3 tools/bench/step_cache_gpu_bench.py"
SETTINGS=${SETTINGS:-first-block:threshold=0.08,first-block:threshold=0.12,taylorseer:interval=3,magcache:threshold=0.1}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import diffusers, torch; print(diffusers.__version__, torch.__version__)"
if [ "$call" = 1 ]; then
  timeout 240 $bench demo --out "$out" > "$out/demo.log" 2>&1; echo "demo rc=$?"; grep -v "Warn\|warn" "$out/demo.log" | tail -14
  timeout 330 $bench pipeline --schedules "$out/schedules.json" --quantize fp8 --settings "$SETTINGS" --out "$out" \
    > "$out/pipeline-fp8.log" 2>&1; echo "pipeline fp8 rc=$?"; tail -32 "$out/pipeline-fp8.log"
fi
if [ "$call" = 5 ]; then  # the leak check per adapter kind, then Wan 2.2's transformer (SCHEDULES as for 4)
  cp "$SCHEDULES" "$out/schedules.json"
  timeout 150 $bench leak --out "$out" > "$out/leak.log" 2>&1; echo "leak rc=$?"; tail -3 "$out/leak.log"
fi
if [ "$call" = 4 ]; then  # after call 1: the leak check, the server, Qwen-Image (SCHEDULES: call 1's schedules.json)
  cp "$SCHEDULES" "$out/schedules.json"
  timeout 150 $bench leak --out "$out" > "$out/leak.log" 2>&1; echo "leak rc=$?"; tail -3 "$out/leak.log"
  timeout 120 python3 -c "from pathlib import Path; from loraswap.bench.common import write_random_adapters as w
w('flux-dev-random', [(32, 'all'), (16, 'attn'), (64, 'all'), (8, 'all')], Path('$out/adapters'))" > /dev/null 2>&1
fi
if [ "$call" = 1 ] || [ "$call" = 4 ]; then
  python3 -c "import json; d=json.load(open('$out/schedules.json')); json.dump(d['ratios'], open('$out/ratios.json','w'))"
  timeout 280 $bench serve --schedules "$out/schedules.json" --out "$out" --serve-args "--model flux-dev-random \
    --quantize fp8 --adapters $out/adapters --port 8888 --step-cache-allow first-block --step-cache-allow taylorseer \
    --step-cache-allow magcache --step-cache-calibration $out/ratios.json" > "$out/serve.log" 2>&1 &
  server=$!
  for _ in $(seq 200); do curl -sf localhost:8888/ready > /dev/null && break; sleep 1; done
  timeout 120 $bench client --settings "$SETTINGS" --out "$out" > "$out/client.log" 2>&1; echo "client rc=$?"
  tail -30 "$out/client.log"; kill $server; wait $server; grep -v "Warn\|warn" "$out/serve.log" | tail -5
fi
if [ "$call" = 2 ]; then
  timeout 250 $bench pipeline --schedules "$out/schedules.json" --quantize none --settings "$SETTINGS" --rounds 2 \
    --out "$out" > "$out/pipeline-bf16.log" 2>&1; echo "pipeline bf16 rc=$?"; tail -26 "$out/pipeline-bf16.log"
fi
if [ "$call" = 3 ] || [ "$call" = 4 ] || [ "$call" = 5 ]; then
  archs="qwen-image flux2-dev wan-14b"; [ "$call" = 4 ] && archs=qwen-image; [ "$call" = 5 ] && archs=wan-14b
  for arch in $archs; do
    extra=""; [ "$arch" = wan-14b ] && extra="--size 832 --height 480 --frames 33"
    timeout 190 $bench denoiser --architecture $arch --schedules "$out/schedules.json" --settings "$SETTINGS" \
      --rounds 2 $extra --out "$out" > "$out/denoiser-$arch.log" 2>&1; echo "$arch rc=$?"; tail -22 "$out/denoiser-$arch.log"
  done
fi
ls -la "$out"
