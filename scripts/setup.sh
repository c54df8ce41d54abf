#!/usr/bin/env bash
# Installs what lockstep needs from Debian 12, and nothing that is already there.
# Idempotent and quiet: a machine that has everything costs one dpkg query.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache
  libtorch-dev libgloo-dev
  # libtorch runs its intra-op threads on OpenMP; OpenBLAS's OpenMP build takes
  # its thread count from the calling thread, so each DataParallel replica's
  # matrix products stay on that replica's share of the cores (docs/design.md).
  libopenblas0-openmp
  googletest libgtest-dev libcli11-dev
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

# Never run on the reference BLAS (about 20x slower for matrix products), nor
# on OpenBLAS's pthread build: libtorch links libopenblas.so.0 itself, besides
# libblas.so.3, so all three names must point at the OpenMP build.
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
for name in libblas.so.3 liblapack.so.3 libopenblas.so.0; do
  alt=$name-x86_64-linux-gnu
  target=/usr/lib/x86_64-linux-gnu/openblas-openmp/$name
  current=$(update-alternatives --query "$alt" 2>/dev/null | sed -n 's/^Value: //p')
  if [ -e "$target" ] && [ "$current" != "$target" ]; then
    "${sudo_cmd[@]}" update-alternatives --quiet --set "$alt" "$target"
  fi
done
