#!/usr/bin/env bash
# Carry Ray Serve (and any other packages) to a machine without a package index, in pieces
# small enough for a link that caps each transfer (the device tool's 64 MiB a call; the ray
# wheel alone is ~76 MiB).
#
#   tools/ray/carry_ray.sh pack [DIR] [REQ...]  where pip can download: every wheel that
#                                         `ray[serve]` and the extra requirements REQ need for
#                                         the target's Python, in one archive split into DIR/1,
#                                         DIR/2, ... (PIECE=48M each) beside SHA256SUMS.
#                                         HAVE=the target's `pip list --format=freeze` leaves
#                                         out each wheel whose package the target has at a
#                                         version every requirement on it accepts.
#                                         WHEELS=a folder already downloaded skips pip.
#                                         Default DIR: .raycarry
#   tools/ray/carry_ray.sh receive DIR/N    on the target, one call per piece, made back to
#                                         back: keep the piece under $STASH (default
#                                         /tmp/ray-carry, which outlives the call)
#   tools/ray/carry_ray.sh install SITE     on the target, after the last piece: join, check
#                                         the checksum, unpack, choose the wheels the target
#                                         needs (tools/ray/carry_select.py, against its own
#                                         installed versions), pip install --no-index into
#                                         SITE, then `check` (add SITE to PYTHONPATH)
#   tools/ray/carry_ray.sh check SITE       import ray.serve, start a one-replica application,
#                                         call it, stop it
#
# PYTHON_VERSION (3.12) and PLATFORM (manylinux2014_x86_64) name the target; RAY pins the
# version (the one pyproject.toml's `ray` extra pins).
set -euo pipefail
RAY=${RAY:-2.60.0}
STASH=${STASH:-/tmp/ray-carry}
HERE=$(cd "$(dirname "$0")" && pwd)

pack() {
  local dir=${1:-.raycarry} work
  shift || true
  work=$(mktemp -d)
  mkdir -p "$work/wheels"
  printf '%s\n' "ray[serve]==$RAY" "$@" > "$work/wheels/REQUIREMENTS.txt"
  local downloaded=${WHEELS:-$work/downloaded}
  if [[ -z ${WHEELS:-} ]]; then
    python3 -m pip download -q -r "$work/wheels/REQUIREMENTS.txt" -d "$downloaded" --only-binary=:all: \
      --python-version "${PYTHON_VERSION:-3.12}" --platform "${PLATFORM:-manylinux2014_x86_64}" \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
  fi
  # without HAVE every wheel travels and the target chooses at `install`; with it, what the
  # target satisfies stays behind but for its metadata (its extras may still ask for wheels)
  if [[ -n ${HAVE:-} ]]; then
    python3 "$HERE/carry_select.py" "$downloaded" "$work/wheels/REQUIREMENTS.txt" --python "${PYTHON_VERSION:-3.12}" \
      --have "$HAVE" > "$work/chosen"
    python3 "$HERE/carry_select.py" "$downloaded" --write-metadata "$work/wheels/metadata"
  else
    ls "$downloaded"/*.whl > "$work/chosen"
  fi
  xargs -r -a "$work/chosen" cp -t "$work/wheels"
  rm -rf "$dir" && mkdir -p "$dir"
  tar -C "$work" -cf "$work/ray.tar" wheels
  (cd "$work" && sha256sum ray.tar) > "$dir/SHA256SUMS"
  split -b "${PIECE:-48M}" -d -a 3 "$work/ray.tar" "$work/piece."
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
  rm -rf "$STASH/wheels" && tar -C "$STASH" -xf "$STASH/ray.tar"
  # choose against the target's own installed versions (not SITE's: PYTHONPATH left out);
  # `packaging` from the carried wheel if the target has none
  local path=""
  python3 -c "import packaging" 2>/dev/null || path=$(ls "$STASH"/wheels/packaging-*.whl)
  env -u PYTHONPATH ${path:+PYTHONPATH=$path} python3 "$HERE/carry_select.py" \
    "$STASH/wheels" "$STASH/wheels/REQUIREMENTS.txt" > "$STASH/chosen"
  echo "installing $(grep -c . "$STASH/chosen") of $(ls "$STASH"/wheels/*.whl | wc -l) wheels into $site"
  xargs -r -a "$STASH/chosen" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site"
  check "$site"
}

check() {
  PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" RAY_USAGE_STATS_ENABLED=0 timeout 180 python3 - <<'EOF'
import ray
from ray import serve

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


@serve.deployment
class Echo:
    def __call__(self, value):
        return value


handle = serve.run(Echo.bind(), name="carry-check", route_prefix=None)
assert handle.remote(41).result(timeout_s=60) == 41
serve.shutdown()
ray.shutdown()
print(f"ray {ray.__version__}: a one-replica Serve application started, answered and stopped")
EOF
}

case ${1:-} in
  pack) shift; pack "$@" ;;
  receive) receive "$2" ;;
  install) install "$2" ;;
  check) check "$2" ;;
  *) sed -n '2,29p' "$0"; exit 2 ;;
esac
