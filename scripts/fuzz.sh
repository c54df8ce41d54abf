#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/) with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer against Debian's libtorch, and runs each for
# SECONDS (default 60) from its seed corpus (tests/fuzz/corpus/TARGET, which
# also keeps every input that once crashed). A crash, a hang (-timeout), a
# sanitizer report or an allocation beyond -malloc_limit_mb fails the run and
# leaves the input in build-fuzz/artifacts/.
#   scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_launch_env fuzz_run_options fuzz_chunk_sizes fuzz_checkpoint fuzz_idx fuzz_safetensors)

LOCKSTEP_TORCH=debian LOCKSTEP_SETUP_FUZZ=1 bash scripts/setup.sh
build=build-fuzz
if [ ! -f "$build/build.ninja" ]; then # also after a configure that failed
  mkdir -p "$build"
  if ! cmake -S tests/fuzz -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
      >"$build/configure.log" 2>&1; then
    tail -n 30 "$build/configure.log" >&2
    echo "fuzz: configuring $build/ failed (above; all of it in $build/configure.log)." >&2
    exit 1
  fi
fi
cmake --build "$build" -j"${LOCKSTEP_JOBS:-2}" --target "${targets[@]}"

mkdir -p "$build/artifacts"
export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# One target: its status in $build/$t.status. New inputs go to a scratch
# folder: the repository's corpus stays as it is.
fuzz_one() {
  local t=$1 work=$build/corpus/$1
  mkdir -p "$work"
  "$build/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=512 \
    -artifact_prefix="$build/artifacts/$t-" -print_final_stats=1 "$work" "tests/fuzz/corpus/$t" \
    >"$build/$t.log" 2>&1
  echo $? > "$build/$t.status"
}
# Each target runs alone on a core (each is one process), LOCKSTEP_JOBS at a
# time: every target gets its SECONDS, and the whole run takes less.
jobs=${LOCKSTEP_JOBS:-2}
running=0
rm -f "$build"/*.status
for t in "${targets[@]}"; do
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  echo "fuzz: $t for ${seconds}s"
  fuzz_one "$t" &
  running=$((running + 1))
done
wait || true
failed=()
for t in "${targets[@]}"; do
  if [ "$(cat "$build/$t.status" 2>/dev/null)" != 0 ]; then
    failed+=("$t")
    tail -n 60 "$build/$t.log"
  fi
  echo "fuzz: $t: $(grep -E "^stat::number_of_executed_units|^Done [0-9]+ runs" "$build/$t.log" | tr '\n' ' ' || true)"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}; the inputs are in $build/artifacts/ (run a target on one to reproduce)." >&2
  exit 1
fi
echo "fuzz: every target ran ${seconds}s without a failure."
