#!/usr/bin/env bash
# A test process keeps its files in a folder of its own under TEST_TMPDIR
# (tests/support/scratch.h), removed when its tests pass. For each PROGRAM
# and gtest FILTER: with LOCKSTEP_KEEP_TEST_FILES=1 the folder must hold
# files (so the tests chosen do write some), and without it, nothing may be
# left.
#
#   tests/leaves_nothing.sh PROGRAM FILTER [PROGRAM FILTER]...
set -uo pipefail
status=0
run() { # KEEP PROGRAM FILTER DIR
  LOCKSTEP_KEEP_TEST_FILES=$1 TEST_TMPDIR=$4 "$2" --gtest_filter="$3" >"$4.log" 2>&1 ||
    { echo "FAILED: $2 --gtest_filter=$3 failed:"; tail -30 "$4.log"; return 1; }
}
while [ $# -ge 2 ]; do
  kept=$(mktemp -d) && removed=$(mktemp -d) || exit 1
  if run 1 "$1" "$2" "$kept" && run 0 "$1" "$2" "$removed"; then
    if [ -z "$(find "$kept" -mindepth 1 -print -quit)" ]; then
      echo "FAILED: $1 --gtest_filter=$2 wrote no file, so this checks nothing"
      status=1
    elif [ -n "$(ls -A "$removed")" ]; then
      echo "FAILED: $1 --gtest_filter=$2 passed and left in TEST_TMPDIR:"
      find "$removed" | head -20
      status=1
    else
      echo "ok: $1 --gtest_filter=$2"
    fi
  else
    status=1
  fi
  rm -rf "$kept" "$removed" "$kept.log" "$removed.log"
  shift 2
done
exit $status
