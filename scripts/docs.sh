#!/usr/bin/env bash
# Builds the API reference from the `///` comments of the public headers
# (docs/Doxyfile) into build/docs/html/ (open index.html), and fails on any
# doxygen warning, an undocumented public declaration included, after printing
# them all. Needs doxygen (scripts/setup.sh installs it), not a build.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v doxygen >/dev/null; then
  echo "docs: doxygen is not installed; scripts/setup.sh installs it (Debian's doxygen)." >&2
  exit 1
fi

# The version heads every page: project(VERSION) of CMakeLists.txt, read
# without CMake.
version=$(sed -n 's/^project(lockstep VERSION \([0-9][0-9.]*\).*/\1/p' CMakeLists.txt)
if [ -z "$version" ]; then
  echo "docs: found no 'project(lockstep VERSION x.y.z' in CMakeLists.txt." >&2
  exit 1
fi
rm -rf build/docs
mkdir -p build/docs

status=0
LOCKSTEP_VERSION=$version doxygen docs/Doxyfile || status=$?
if [ -s build/docs/warnings.log ]; then
  cat build/docs/warnings.log >&2
  echo "docs: $(grep -cE ': (warning|error): ' build/docs/warnings.log) doxygen warnings (above). Every" \
       "public declaration of include/lockstep/ needs a /// comment." >&2
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "docs: doxygen failed (exit status $status)." >&2
  exit "$status"
fi
echo "docs: API reference of lockstep $version in build/docs/html/index.html"
