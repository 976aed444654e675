# Finds the libraries of the design card and exposes each as an imported target:
#   MPI::MPI_C, hdf5::hdf5 (parallel build required), LAPACK::LAPACK / BLAS::BLAS
#   (OpenBLAS preferred) and kqsvd::lapacke (LAPACKE + CBLAS headers).
find_package(MPI REQUIRED COMPONENTS C)

set(HDF5_PREFER_PARALLEL ON)
find_package(HDF5 REQUIRED COMPONENTS C)
if(NOT HDF5_IS_PARALLEL)
  message(FATAL_ERROR "kqsvd needs a parallel (MPI) build of HDF5; on Debian: apt-get install libhdf5-openmpi-dev")
endif()
if(NOT TARGET hdf5::hdf5)
  message(FATAL_ERROR "FindHDF5 did not create hdf5::hdf5 (CMake >= 3.19 does)")
endif()

if(NOT DEFINED BLA_VENDOR)
  set(BLA_VENDOR OpenBLAS)
endif()
find_package(LAPACK REQUIRED)

find_path(KQSVD_LAPACKE_INCLUDE_DIR lapacke.h)
find_library(KQSVD_LAPACKE_LIBRARY lapacke)
find_path(KQSVD_CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas x86_64-linux-gnu aarch64-linux-gnu)
if(NOT KQSVD_LAPACKE_INCLUDE_DIR OR NOT KQSVD_LAPACKE_LIBRARY OR NOT KQSVD_CBLAS_INCLUDE_DIR)
  message(FATAL_ERROR "LAPACKE or CBLAS not found; on Debian: apt-get install liblapacke-dev libopenblas-dev")
endif()
add_library(kqsvd::lapacke INTERFACE IMPORTED)
set_target_properties(kqsvd::lapacke PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "${KQSVD_LAPACKE_INCLUDE_DIR};${KQSVD_CBLAS_INCLUDE_DIR}"
  INTERFACE_LINK_LIBRARIES "${KQSVD_LAPACKE_LIBRARY};LAPACK::LAPACK")

# OpenMP (optional): the decode kernels (src/core/decode.c) share a step's
# work among threads with it, and run on one without it.
find_package(OpenMP COMPONENTS C)

# OpenBLAS threads would oversubscribe cores shared by MPI ranks; kqsvd sets
# them explicitly when the library lets it.
include(CheckFunctionExists)
set(CMAKE_REQUIRED_LIBRARIES ${LAPACK_LIBRARIES})
check_function_exists(openblas_set_num_threads KQSVD_HAVE_OPENBLAS_THREADS)
unset(CMAKE_REQUIRED_LIBRARIES)

# ScaLAPACK (optional): only the `calibrate --qr scalapack` comparison
# backend uses it.  Debian 12's CMake package for it points at /usr/lib
# instead of the multiarch folder, so the library is found directly and
# wrapped in an imported target.
# AUTO (the default) looks again at every configure, so a build folder made
# before the library was installed picks it up.
find_library(KQSVD_SCALAPACK_LIBRARY NAMES scalapack-openmpi scalapack)
set(KQSVD_SCALAPACK AUTO CACHE STRING
    "Build the ScaLAPACK pdgeqrf backend (calibrate --qr scalapack): ON, OFF or AUTO")
if(KQSVD_SCALAPACK STREQUAL "AUTO")
  if(KQSVD_SCALAPACK_LIBRARY)
    set(KQSVD_WITH_SCALAPACK ON)
  else()
    set(KQSVD_WITH_SCALAPACK OFF)
  endif()
else()
  set(KQSVD_WITH_SCALAPACK ${KQSVD_SCALAPACK})
endif()
if(KQSVD_WITH_SCALAPACK)
  if(NOT KQSVD_SCALAPACK_LIBRARY)
    message(FATAL_ERROR "KQSVD_SCALAPACK=ON but ScaLAPACK was not found; on Debian: "
                        "apt-get install libscalapack-openmpi-dev")
  endif()
  add_library(kqsvd::scalapack UNKNOWN IMPORTED)
  set_target_properties(kqsvd::scalapack PROPERTIES
    IMPORTED_LOCATION "${KQSVD_SCALAPACK_LIBRARY}"
    INTERFACE_LINK_LIBRARIES "LAPACK::LAPACK;MPI::MPI_C")
  message(STATUS "kqsvd: ScaLAPACK backend enabled (${KQSVD_SCALAPACK_LIBRARY})")
endif()
