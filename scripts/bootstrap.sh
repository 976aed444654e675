#!/usr/bin/env bash
# Installs kqsvd's build and test dependencies (Debian packages) when they are
# missing, then configures and builds into build/.  Used by demo.sh, test.sh
# and CI; safe to run again (it only installs what is missing and rebuilds
# what changed).  Extra CMake arguments: KQSVD_CMAKE_ARGS="...".
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

packages="cmake make gcc g++ libc6-dev pkg-config libopenmpi-dev openmpi-bin libopenblas-dev
          liblapacke-dev libscalapack-openmpi-dev libhdf5-openmpi-dev hdf5-tools python3 python3-numpy python3-h5py
          python3-matplotlib python3-venv python3-pip python3-torch python3-mpi4py
          ${KQSVD_EXTRA_PACKAGES:-}"
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "bootstrap: installing$missing" >&2
  # shellcheck disable=SC2086 # one word a package
  "$root/scripts/apt-install.sh" $missing  # waits for another apt holding the lock
fi

# shellcheck disable=SC2086
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo ${KQSVD_CMAKE_ARGS:-} >/dev/null
cmake --build "$root/build" -j"$(nproc)"
