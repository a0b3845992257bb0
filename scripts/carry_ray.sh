#!/usr/bin/env bash
# Carry Ray Serve to a machine without a package index, in pieces small enough for a link
# that caps each transfer (the device tool's 64 MiB a call; the ray wheel alone is ~76 MiB).
#
#   scripts/carry_ray.sh pack [DIR]       where pip can download: every wheel `ray[serve]`
#                                         needs for the target's Python, less what the target
#                                         has (HAVE=its `pip list --format=freeze`), in one
#                                         archive split into DIR/1, DIR/2, ... (PIECE=40M each)
#                                         beside SHA256SUMS. Default DIR: .raycarry
#   scripts/carry_ray.sh receive DIR/N    on the target, one call per piece, made back to
#                                         back: keep the piece under $STASH (default
#                                         /tmp/ray-carry, which outlives the call)
#   scripts/carry_ray.sh install SITE     on the target, after the last piece: join, check
#                                         the checksum, unpack, pip install --no-index into
#                                         SITE (add it to PYTHONPATH)
#
# PYTHON_VERSION (3.12) and PLATFORM (manylinux2014_x86_64) name the target; RAY pins the
# version (the one pyproject.toml's `ray` extra pins).
set -euo pipefail
RAY=${RAY:-2.60.0}
STASH=${STASH:-/tmp/ray-carry}

pack() {
  local dir=${1:-.raycarry} work
  work=$(mktemp -d)
  python3 -m pip download -q "ray[serve]==$RAY" -d "$work/wheels" --only-binary=:all: \
    --python-version "${PYTHON_VERSION:-3.12}" --platform "${PLATFORM:-manylinux2014_x86_64}" \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
  if [[ -n ${HAVE:-} ]]; then  # drop what the target already has (any version: it is installed there)
    while IFS='=' read -r name _; do
      local norm=${name,,}; norm=${norm//-/_}
      find "$work/wheels" -iname "${norm}-[0-9]*.whl" -delete
    done < "$HAVE"
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  tar -C "$work" -cf "$work/ray.tar" wheels
  (cd "$work" && sha256sum ray.tar) > "$dir/SHA256SUMS"
  split -b "${PIECE:-40M}" -d -a 1 "$work/ray.tar" "$work/piece."
  local n=0
  for piece in "$work"/piece.*; do
    n=$((n + 1)); mkdir -p "$dir/$n"; mv "$piece" "$dir/$n/"; cp "$dir/SHA256SUMS" "$dir/$n/"
  done
  rm -rf "$work"
  echo "$n piece(s) in $dir: carry $dir/1, $dir/2, ... one per call"
}

receive() {
  mkdir -p "$STASH"
  cp "$1"/piece.* "$1"/SHA256SUMS "$STASH"/
  echo "held under $STASH: $(ls "$STASH"/piece.* | wc -l) piece(s), $(du -sh "$STASH" | cut -f1)"
}

install() {
  local site=$1
  cat "$STASH"/piece.* > "$STASH/ray.tar"
  (cd "$STASH" && sha256sum -c SHA256SUMS) || { echo "checksum mismatch: a piece is missing or stale" >&2; exit 1; }
  tar -C "$STASH" -xf "$STASH/ray.tar"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$STASH"/wheels/*.whl
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import ray, ray.serve; print('ray', ray.__version__)"
}

case ${1:-} in
  pack) pack "${2:-}" ;;
  receive) receive "$2" ;;
  install) install "$2" ;;
  *) sed -n '2,19p' "$0"; exit 2 ;;
esac
