#!/usr/bin/env bash
# Installs what lockstep needs from Debian 12, and nothing that is already there.
# Idempotent and quiet: a machine that has everything costs one dpkg query.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev
  # libtorch runs its intra-op threads on OpenMP; OpenBLAS's OpenMP build takes
  # its thread count from the calling thread, so each DataParallel replica's
  # matrix products stay on that replica's share of the cores (docs/design.md).
  libopenblas0-openmp
  googletest libgtest-dev libbenchmark-dev libcli11-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Never run on the reference BLAS: it is about 20x slower for matrix products.
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null || true)
case "$blas" in
  *openblas-openmp*) ;;
  *)
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    for alt in libblas.so.3-x86_64-linux-gnu liblapack.so.3-x86_64-linux-gnu; do
      target=/usr/lib/x86_64-linux-gnu/openblas-openmp/${alt%%-x86_64-linux-gnu}
      [ -e "$target" ] && "${sudo_cmd[@]}" update-alternatives --quiet --set "$alt" "$target"
    done
    ;;
esac
