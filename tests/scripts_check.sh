#!/usr/bin/env bash
# scripts/build.sh builds against the LibTorch its configuration names, or
# stops with an error: CMake would otherwise find Debian's 1.13 by default,
# and a .venv/ without a complete torch, or a build folder configured for
# the other configuration, would build "current" against 1.13 silently.
# Each case runs a copy of scripts/ in an empty checkout, where it stops
# before CMake. Last, scripts/gpu_peak.sh's peak for each kind of card.
#
#   tests/scripts_check.sh SOURCE_DIR
set -uo pipefail
source_dir=$1
fail() { echo "FAILED: $*"; exit 1; }
repo=$(mktemp -d)
trap 'rm -rf "$repo"' EXIT
cp -r "$source_dir/scripts" "$repo/"

expect_refusal() { # CASE LOCKSTEP_TORCH MESSAGE
  local out
  # Not a sanitizer's folder, whatever stage of CI runs this.
  out=$(env -u LOCKSTEP_SANITIZE -u LOCKSTEP_CMAKE_ARGS -u LOCKSTEP_BUILD_TARGETS LOCKSTEP_TORCH=$2 \
    bash "$repo/scripts/build.sh" 2>&1) && fail "$1: build.sh went on: $out"
  grep -qF -- "$3" <<< "$out" || fail "$1: expected '$3', got: $out"
  echo "ok: $1: $out"
}

expect_refusal "no torch in .venv/" current \
  "build: no PyTorch in .venv/ ($repo/.venv/lib/python3*/site-packages/torch/share/cmake/Torch/TorchConfig.cmake is missing). Run scripts/setup.sh"

venv_torch=$repo/.venv/lib/python3.11/site-packages/torch/share/cmake/Torch
mkdir -p "$venv_torch" "$repo/build" "$repo/build-debian"
touch "$venv_torch/TorchConfig.cmake"
echo "Torch_DIR:PATH=/usr/lib/x86_64-linux-gnu/cmake/Torch" > "$repo/build/CMakeCache.txt"
expect_refusal "current's folder configured against Debian's" current \
  "build: build/ was configured against the LibTorch in '/usr/lib/x86_64-linux-gnu/cmake/Torch', not LOCKSTEP_TORCH=current's"

echo "Torch_DIR:PATH=$venv_torch" > "$repo/build-debian/CMakeCache.txt"
expect_refusal "Debian's folder configured against the wheel" debian \
  "build: build-debian/ was configured against the LibTorch in '$venv_torch', not LOCKSTEP_TORCH=debian's (under /usr)"

# A first configure that failed leaves a CMakeCache.txt and no build.ninja:
# the next run configures again (here it fails again, with CMake's own
# output: this checkout has no CMakeLists.txt), instead of running ninja on
# nothing.
rm -rf "$repo/build-debian"
mkdir -p "$repo/build-debian"
echo "Torch_DIR:PATH=/usr/lib/x86_64-linux-gnu/cmake/Torch" > "$repo/build-debian/CMakeCache.txt"
expect_refusal "a folder whose configure failed" debian \
  "build: configuring build-debian/ failed"

# scripts/gpu_bench.sh's MFU divides by the card's peak: a PCIe or NVL card
# taken for an SXM one would understate it by a sixth to a quarter.
for pair in "NVIDIA H100 80GB HBM3=989" "NVIDIA H100 PCIe=756" "NVIDIA H100 NVL=835" "NVIDIA H200=989" \
            "NVIDIA H200 NVL=835" "NVIDIA A100-SXM4-80GB=312" "Tesla T4=0"; do
  card=${pair%=*}
  got=$(bash "$repo/scripts/gpu_peak.sh" "$card")
  [ "$got" = "${pair##*=}" ] || fail "gpu_peak.sh '$card': expected ${pair##*=}, got $got"
  echo "ok: gpu_peak.sh '$card': $got"
done
