#!/usr/bin/env bash
# Installs what lockstep needs for the configuration in LOCKSTEP_TORCH
# (scripts/config.sh), and nothing that is already there. Idempotent and quiet:
# a machine that has everything costs one dpkg query and one pip check.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/config.sh

packages=(build-essential cmake ninja-build ccache googletest libgtest-dev libcli11-dev zlib1g-dev nlohmann-json3-dev
  # the main job's data (/usr/share/datasets/fashion-mnist) and its curves.png
  dataset-fashion-mnist gnuplot-nox
  # lockstep-train --model gpt's text (/usr/share/games/fortunes)
  fortunes
  # the two-machine tests run ranks in network namespaces; the lab's latency
  # queues packets to a process (tools/netlab_delay.cpp)
  iproute2 iptables libnetfilter-queue-dev
  # the mpi backend, and mpirun for its tests
  libopenmpi-dev openmpi-bin
  # Gloo's own headers, which c10d's include and PyTorch's wheels lack
  libgloo-dev
  # the API reference from the public headers' /// comments (scripts/docs.sh)
  doxygen)
if [ "$LOCKSTEP_TORCH" = debian ]; then
  packages+=(
    libtorch-dev libgloo-dev
    # torchrun of the same PyTorch, for the tests that run lockstep under it
    python3-torch
    # libtorch runs its intra-op threads on OpenMP; OpenBLAS's OpenMP build takes
    # its thread count from the calling thread, so each DataParallel replica's
    # matrix products stay on that replica's share of the cores (docs/design.md).
    libopenblas0-openmp
  )
else
  packages+=(python3 python3-venv)
fi
if [ "${LOCKSTEP_SETUP_FUZZ:-}" = 1 ]; then
  packages+=(clang libclang-rt-dev) # libFuzzer and clang's sanitizer runtimes (scripts/fuzz.sh)
fi

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ "$LOCKSTEP_TORCH" = debian ]; then
  # Never run on the reference BLAS (about 20x slower for matrix products), nor
  # on OpenBLAS's pthread build: libtorch links libopenblas.so.0 itself, besides
  # libblas.so.3, so all three names must point at the OpenMP build.
  for name in libblas.so.3 liblapack.so.3 libopenblas.so.0; do
    alt=$name-x86_64-linux-gnu
    target=/usr/lib/x86_64-linux-gnu/openblas-openmp/$name
    current=$(update-alternatives --query "$alt" 2>/dev/null | sed -n 's/^Value: //p')
    if [ -e "$target" ] && [ "$current" != "$target" ]; then
      "${sudo_cmd[@]}" update-alternatives --quiet --set "$alt" "$target"
    fi
  done
  exit 0
fi

# The pip wheel is a CUDA build: its CMake config needs the CUDA toolkit (nvcc)
# even though lockstep has no .cu files.
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: the current configuration builds against PyTorch's CUDA wheel, whose CMake config needs" \
       "the CUDA toolkit (nvcc), and none is installed. Install the CUDA toolkit (/usr/local/cuda), or" \
       "use LOCKSTEP_TORCH=debian for Debian's CPU-only libtorch." >&2
  exit 1
fi

# PyTorch from PyPI into .venv/, at the version scripts/requirements-current.txt pins.
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
wanted=$(sed -n 's/^torch==//p' scripts/requirements-current.txt)
have=$(.venv/bin/python -m pip show torch 2>/dev/null | sed -n 's/^Version: //p' || true)
if [ "$have" != "$wanted" ]; then
  # pip downloads every wheel (3.0 GB for 2.15.0) into $TMPDIR before it
  # unpacks them into .venv/ (5.3 GB): say so before pip fails halfway with
  # "No space left on device". No pip cache: it would keep a third copy.
  tmp=${TMPDIR:-/tmp}
  need_tmp_mb=3300 need_venv_mb=5600
  free_mb() { df -Pm "$1" | awk 'NR == 2 {print $4}'; }
  if [ "$(stat -c %d "$tmp")" = "$(stat -c %d .venv)" ]; then
    need_venv_mb=$((need_venv_mb + need_tmp_mb)) need_tmp_mb=0
  fi
  for check in "$tmp:$need_tmp_mb" ".venv:$need_venv_mb"; do
    dir=${check%:*} need=${check##*:} have_mb=$(free_mb "$dir")
    if [ "$need" -gt 0 ] && [ "$have_mb" -lt "$need" ]; then
      echo "setup: installing torch==$wanted needs about $need MB free in $(realpath "$dir"), and its" \
           "file system has $have_mb MB. pip downloads the wheels (3.0 GB) into \$TMPDIR, then unpacks them" \
           "into .venv/ (5.3 GB). Free some space, or set TMPDIR to a folder on a file system with room." >&2
      exit 1
    fi
  done
  echo "setup: installing torch==$wanted into .venv/ (5.3 GB with its CUDA libraries; 3.0 GB to download)"
  .venv/bin/python -m pip install -q --no-cache-dir --disable-pip-version-check -r scripts/requirements-current.txt
  have=$(.venv/bin/python -m pip show torch 2>/dev/null | sed -n 's/^Version: //p' || true)
  if [ "$have" != "$wanted" ]; then
    echo "setup: pip did not install torch==$wanted into .venv/ (found '${have:-nothing}')." >&2
    exit 1
  fi
fi
# The other pins of scripts/requirements-current.txt (safetensors, for the
# tests against Python's files), small beside torch: installed when missing
# or at another version.
while read -r pin; do
  package=${pin%%==*} version=${pin##*==}
  [ "$package" = torch ] && continue
  have=$(.venv/bin/python -m pip show "$package" 2>/dev/null | sed -n 's/^Version: //p' || true)
  if [ "$have" != "$version" ]; then
    echo "setup: installing $pin into .venv/"
    .venv/bin/python -m pip install -q --no-cache-dir --disable-pip-version-check "$pin"
  fi
done < <(grep -E '^[A-Za-z0-9_.-]+==' scripts/requirements-current.txt)
