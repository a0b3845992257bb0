#!/usr/bin/env bash
# The demo-flux GPU run, for one device call: train, then the grid and float8's cost on it.
#   [START=FOLDER] bash tools/demo/demo_flux_gpu_run.sh OUT [TRAIN_ARGS...]
# OUT gets train.log, grid.png, fp8.json, shortcuts.log and weights.tgz (the trained folder).
set -u
out=$1; shift
export PYTHONPATH=/tmp/site:src:tools/demo:tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import diffusers, transformers, peft, torch; print(diffusers.__version__, transformers.__version__, peft.__version__, torch.__version__)"
mkdir -p "$out/w"
[ -n "${START:-}" ] && cp -r "$START"/. "$out/w/"  # the weights of earlier stages, for a later --stage
timeout "${TRAIN_S:-430}" python3 tools/demo/train_demo_flux.py --device cuda --out "$out/w" "$@" > "$out/train.log" 2>&1
echo "train rc=$?"; grep -v "it/s\|Warn\|warn" "$out/train.log" | tail -25
weights=src/loraswap/models/demo_flux_weights
if [ -d "$out/w/adapters" ]; then
  cp "$out"/w/*.safetensors "$out"/w/vae_factors.json "$weights/"; rm -f "$weights/transformer_undistilled.safetensors"
  cp "$out"/w/adapters/*.safetensors "$weights/adapters/"
  timeout 60 python3 tools/demo/demo_flux_grid.py --folder "$weights" -o "$out/grid.png" 2>&1 | tail -2
  timeout 90 python3 tools/demo/demo_flux_shortcuts.py --variant fp8 --json "$out/fp8.json" > "$out/shortcuts.log" 2>&1
  echo "shortcuts rc=$?"; tail -5 "$out/shortcuts.log"
fi
tar czf "$out/weights.tgz" -C "$out" w && rm -rf "$out/w"
ls -la "$out"
