#!/usr/bin/env bash
# The installed package from outside the tree: `cmake --install` into a
# temporary prefix, then examples/c/consumer.c built against it four ways
# (find_package with the shared and the static library, pkg-config kqsvd
# and kqsvd-static) and run: each feeds rows to an accumulator, checks R
# against LAPACK dgeqrf (1e-12) and writes a proj.h5 that `kqsvd ranks`
# reads.  The installed kqsvd --help and man page are checked too.
#     tests/install_consumer.sh BUILD_DIR WORK_DIR
set -euo pipefail
build=$1 work=$2
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rm -rf "$work" && mkdir -p "$work"
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" > "$work/install.log"
for f in bin/kqsvd include/kqsvd/kqsvd.h include/kqsvd/version.h lib/libkqsvd.a \
         lib/cmake/kqsvd/kqsvdConfig.cmake lib/pkgconfig/kqsvd.pc share/man/man1/kqsvd.1 \
         share/kqsvd/slurm/kqsvd-submit share/kqsvd/examples/export_hf.py \
         share/kqsvd/python/kqsvd/__init__.py share/doc/kqsvd/LICENSE; do
  found=$(find "$prefix" -path "$prefix/$f" -o -path "$prefix/lib/*/${f#lib/}" | head -1)
  [ -n "$found" ] || { echo "install_consumer: $f is not installed" >&2; exit 1; }
done
"$prefix/bin/kqsvd" --help > /dev/null
man -l "$prefix/share/man/man1/kqsvd.1" > /dev/null 2>&1 || [ ! -x "$(command -v man)" ] ||
  { echo "install_consumer: the man page does not render" >&2; exit 1; }
# Only the public API leaves the shared library.
lib=$(find "$prefix" -name 'libkqsvd.so' | head -1)
extra=$(nm -D --defined-only "$lib" | awk '$2 == "T" {print $3}' | grep -v '^kqsvd_' || true)
[ -z "$extra" ] || { echo "install_consumer: $lib exports $extra" >&2; exit 1; }
internal=$(nm -D --defined-only "$lib" | awk '$2 == "T" {print $3}' |
           grep -E '^kqsvd_(tsqr|qr_|tri_|h5_|shard_|proj_|checkpoint)' || true)
[ -z "$internal" ] || { echo "install_consumer: $lib exports internal $internal" >&2; exit 1; }

run() {  # NAME COMMAND...: the consumer built some way, run, its output checked
  local name=$1; shift
  "$@" "$work/$name.h5" > "$work/$name.log" || { cat "$work/$name.log"; echo "install_consumer: $name failed" >&2; exit 1; }
  grep -q "R factor vs LAPACK" "$work/$name.log"
  "$prefix/bin/kqsvd" ranks --proj "$work/$name.h5" --json > /dev/null
  echo "$name: $(grep 'R factor' "$work/$name.log")"
}
for static in OFF ON; do
  cmake -S "$src/examples/c" -B "$work/cmake-$static" -DCMAKE_PREFIX_PATH="$prefix" \
        -DKQSVD_CONSUMER_STATIC=$static > "$work/cmake-$static.log"
  cmake --build "$work/cmake-$static" > "$work/build-$static.log"
  run "find_package-static-$static" "$work/cmake-$static/kqsvd_consumer"
done
pc=$(dirname "$(find "$prefix" -name kqsvd.pc | head -1)")
export PKG_CONFIG_PATH=$pc
cc -std=c11 "$src/examples/c/consumer.c" -o "$work/pc-shared" $(pkg-config --cflags --libs kqsvd) \
   -llapacke -lm -Wl,-rpath,"$(dirname "$lib")"
run pkg-config-shared "$work/pc-shared"
cc -std=c11 "$src/examples/c/consumer.c" -o "$work/pc-static" $(pkg-config --cflags --libs kqsvd-static) -llapacke
run pkg-config-static "$work/pc-static"
# A program that only decodes or reads a result builds with the installed
# headers alone: no MPI include path (mpi.h is on none of the compiler's
# own; the control shows that kqsvd.h, which has the accumulator, needs it).
if ! echo '#include <mpi.h>' | cc -fsyntax-only -x c - 2> /dev/null; then
  if echo '#include <kqsvd/kqsvd.h>' | cc -std=c11 -fsyntax-only -I"$prefix/include" -x c - \
       2> /dev/null; then
    echo "install_consumer: kqsvd.h compiled without MPI's headers: the control is void" >&2; exit 1
  fi
  cc -std=c11 -Wall -Werror -I"$prefix/include" "$src/examples/c/decode_only.c" \
     -o "$work/decode-only" -L"$(dirname "$lib")" -lkqsvd -lm -Wl,-rpath,"$(dirname "$lib")" ||
    { echo "install_consumer: decode_only.c needs more than the headers without MPI" >&2; exit 1; }
  "$work/decode-only"
else
  echo "install_consumer: mpi.h is on the compiler's own path here; the no-MPI build is not shown"
fi
# C++: the header is extern "C" and must not drag in MPI's C++ bindings;
# find_package must work in a project that enables only C++.
if command -v c++ > /dev/null; then
  mkdir -p "$work/cxx"
  cat > "$work/cxx/main.cpp" <<'CXX'
#include <kqsvd/kqsvd.h>
#include <cstdio>
int main() {
  kqsvd_shape_t shape = {1, 1, 1, 4, 4};
  kqsvd_acc_t *acc = nullptr;
  if (kqsvd_acc_init(&shape, nullptr, &acc) != KQSVD_OK) return 1;
  double rows[8] = {1, 2, 3, 4, 5, 6, 7, 9}, R[16];
  if (kqsvd_acc_absorb(acc, KQSVD_KEYS, 0, 0, 0, rows, KQSVD_F64, 2, 4) != KQSVD_OK) return 1;
  if (kqsvd_acc_factor(acc, KQSVD_KEYS, 0, 0, R) != KQSVD_OK) return 1;
  std::printf("C++ consumer: kqsvd %s, R[0][0] = %g\n", kqsvd_version(), R[0] < 0 ? -R[0] : R[0]);
  kqsvd_acc_free(&acc);
  return 0;
}
CXX
  cat > "$work/cxx/CMakeLists.txt" <<'CXX'
cmake_minimum_required(VERSION 3.20)
project(kqsvd_cxx LANGUAGES CXX)
find_package(kqsvd REQUIRED)
add_executable(kqsvd_cxx main.cpp)
target_link_libraries(kqsvd_cxx PRIVATE kqsvd::kqsvd)
CXX
  cmake -S "$work/cxx" -B "$work/cxx/build" -DCMAKE_PREFIX_PATH="$prefix" > "$work/cxx.log" 2>&1 ||
    { cat "$work/cxx.log"; echo "install_consumer: find_package in a C++ project failed" >&2; exit 1; }
  cmake --build "$work/cxx/build" >> "$work/cxx.log" 2>&1 ||
    { cat "$work/cxx.log"; echo "install_consumer: the C++ consumer did not build" >&2; exit 1; }
  "$work/cxx/build/kqsvd_cxx"
  c++ "$work/cxx/main.cpp" -o "$work/cxx/pc" $(pkg-config --cflags --libs kqsvd) -Wl,-rpath,"$(dirname "$lib")"
  "$work/cxx/pc" > /dev/null
fi
echo "install_consumer: passed"
