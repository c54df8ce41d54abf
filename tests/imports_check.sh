#!/usr/bin/env bash
# Note [The wheel's std::filesystem] (src/util/checked_file.cpp): with the pip
# wheel, a program's call of std::filesystem::remove_all can bind to
# libtorch's own copy, which crashed. No program of lockstep's may import it.
#
#   tests/imports_check.sh PROGRAM...
set -uo pipefail
status=0
for program in "$@"; do
  # grep reads all its input (no -q): under pipefail, a grep that stops at its match leaves nm a SIGPIPE.
  if nm -D --undefined-only "$program" | c++filt | grep "std::filesystem::remove_all" >/dev/null; then
    echo "FAILED: $program imports std::filesystem::remove_all; use lockstep::detail::remove_tree"
    status=1
  else
    echo "ok: $program"
  fi
done
exit $status
