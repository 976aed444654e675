# The installable kqsvd: libkqsvd.so and libkqsvd.a, built from the objects
# of the parts (core, mpi, io, the GPU loader, pipeline) and exporting only the public API of
# include/kqsvd; the headers, the kqsvd binary and its CUDA module, a man
# page, the SLURM scripts, the exporter and the Python package under
# share/kqsvd, a CMake package (find_package(kqsvd) -> kqsvd::kqsvd, and
# kqsvd::kqsvd_static) and a pkg-config file (kqsvd.pc, kqsvd-static.pc).
include(GNUInstallDirs)
find_package(Threads REQUIRED)
include(CMakePackageConfigHelpers)

set(_kqsvd_parts kqsvd_core kqsvd_mpi kqsvd_io kqsvd_gpu_loader kqsvd_pipeline)
set(_kqsvd_objects)
foreach(part ${_kqsvd_parts})
  # Internal functions stay internal in the shared library; the public ones
  # carry KQSVD_API.
  set_target_properties(${part} PROPERTIES POSITION_INDEPENDENT_CODE ON C_VISIBILITY_PRESET hidden)
  list(APPEND _kqsvd_objects $<TARGET_OBJECTS:${part}>)
endforeach()

# What the parts link: MPI is public (mpi.h is in accumulator.h; decode.h and
# result.h need none of it); the rest is
# an implementation detail of the shared library, and a link requirement of
# the static one.
set(_kqsvd_private_libs hdf5::hdf5 kqsvd::lapacke Threads::Threads m ${CMAKE_DL_LIBS})
set(_kqsvd_install_libs hdf5::hdf5 ${KQSVD_LAPACKE_LIBRARY} ${LAPACK_LIBRARIES} Threads::Threads m
    ${CMAKE_DL_LIBS})
if(TARGET OpenMP::OpenMP_C)
  list(APPEND _kqsvd_private_libs OpenMP::OpenMP_C)
  list(APPEND _kqsvd_install_libs ${OpenMP_C_LIBRARIES})
endif()
if(KQSVD_WITH_SCALAPACK)
  list(APPEND _kqsvd_private_libs kqsvd::scalapack)
  list(APPEND _kqsvd_install_libs ${KQSVD_SCALAPACK_LIBRARY})
endif()

add_library(kqsvd_shared SHARED ${_kqsvd_objects})
add_library(kqsvd_static STATIC ${_kqsvd_objects})
set_target_properties(kqsvd_shared PROPERTIES OUTPUT_NAME kqsvd EXPORT_NAME kqsvd
  VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
set_target_properties(kqsvd_static PROPERTIES OUTPUT_NAME kqsvd EXPORT_NAME kqsvd_static)
foreach(lib kqsvd_shared kqsvd_static)
  target_include_directories(${lib} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
endforeach()
target_link_libraries(kqsvd_shared PUBLIC MPI::MPI_C PRIVATE ${_kqsvd_private_libs})
target_link_libraries(kqsvd_static PUBLIC MPI::MPI_C
  $<BUILD_INTERFACE:${_kqsvd_private_libs}> $<INSTALL_INTERFACE:${_kqsvd_install_libs}>)
add_library(kqsvd::kqsvd ALIAS kqsvd_shared)
add_library(kqsvd::kqsvd_static ALIAS kqsvd_static)

install(TARGETS kqsvd_shared kqsvd_static EXPORT kqsvdTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(FILES ${PROJECT_SOURCE_DIR}/include/kqsvd/kqsvd.h ${PROJECT_SOURCE_DIR}/include/kqsvd/types.h
              ${PROJECT_SOURCE_DIR}/include/kqsvd/error.h
              ${PROJECT_SOURCE_DIR}/include/kqsvd/accumulator.h
              ${PROJECT_SOURCE_DIR}/include/kqsvd/decode.h
              ${PROJECT_SOURCE_DIR}/include/kqsvd/result.h
              ${PROJECT_BINARY_DIR}/include/kqsvd/version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kqsvd)
install(TARGETS kqsvd RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET kqsvd_gpu)
  install(TARGETS kqsvd_gpu LIBRARY DESTINATION ${CMAKE_INSTALL_BINDIR})  # found next to the executable
endif()
install(FILES ${PROJECT_SOURCE_DIR}/docs/kqsvd.1 DESTINATION ${CMAKE_INSTALL_MANDIR}/man1)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/slurm/ DESTINATION ${CMAKE_INSTALL_DATADIR}/kqsvd/slurm
        USE_SOURCE_PERMISSIONS)
install(PROGRAMS ${PROJECT_SOURCE_DIR}/examples/export_hf.py
        DESTINATION ${CMAKE_INSTALL_DATADIR}/kqsvd/examples)
install(FILES ${PROJECT_SOURCE_DIR}/examples/requirements-hf.txt
        DESTINATION ${CMAKE_INSTALL_DATADIR}/kqsvd/examples)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/python/ DESTINATION ${CMAKE_INSTALL_DATADIR}/kqsvd/python
        PATTERN "__pycache__" EXCLUDE PATTERN "*.egg-info" EXCLUDE PATTERN "tests" EXCLUDE)
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE ${PROJECT_SOURCE_DIR}/CHANGELOG.md
        ${PROJECT_SOURCE_DIR}/docs/formats.md DESTINATION ${CMAKE_INSTALL_DOCDIR})

# CMake package.
set(_cfgdir ${CMAKE_INSTALL_LIBDIR}/cmake/kqsvd)
install(EXPORT kqsvdTargets NAMESPACE kqsvd:: DESTINATION ${_cfgdir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/kqsvdConfig.cmake.in
  ${PROJECT_BINARY_DIR}/kqsvdConfig.cmake INSTALL_DESTINATION ${_cfgdir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kqsvdConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/kqsvdConfig.cmake ${PROJECT_BINARY_DIR}/kqsvdConfigVersion.cmake
        DESTINATION ${_cfgdir})

# pkg-config: kqsvd.pc (shared) and kqsvd-static.pc (everything to link).
string(REPLACE ";" " -I" _mpi_inc "-I${MPI_C_INCLUDE_DIRS}")
set(_static_libs "")
foreach(l ${MPI_C_LIBRARIES} ${HDF5_C_LIBRARIES} ${KQSVD_LAPACKE_LIBRARY} ${LAPACK_LIBRARIES}
          ${KQSVD_SCALAPACK_LIBRARY})
  if(l)
    string(APPEND _static_libs " ${l}")
  endif()
endforeach()
string(REPLACE ";" " " _mpi_libs "${MPI_C_LIBRARIES}")
file(RELATIVE_PATH _pc_to_prefix "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
configure_file(${PROJECT_SOURCE_DIR}/cmake/kqsvd.pc.in ${PROJECT_BINARY_DIR}/kqsvd.pc @ONLY)
configure_file(${PROJECT_SOURCE_DIR}/cmake/kqsvd-static.pc.in ${PROJECT_BINARY_DIR}/kqsvd-static.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/kqsvd.pc ${PROJECT_BINARY_DIR}/kqsvd-static.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# The Python wheel (pyproject.toml, scikit-build-core, which installs this
# component alone): the executable, its CUDA module and libkqsvd.so in the
# package's _native folder, where kqsvd.native finds them.  Only under
# scikit-build-core (SKBUILD): a plain cmake --install keeps the layout above.
if(SKBUILD)
  # One file per library (a wheel is a zip: links would become copies);
  # libkqsvd.so is loaded by path, never linked against, so its name can drop
  # the version.
  install(TARGETS kqsvd RUNTIME DESTINATION kqsvd/_native COMPONENT python)
  install(FILES $<TARGET_FILE:kqsvd_shared> DESTINATION kqsvd/_native RENAME libkqsvd.so
          COMPONENT python)
  if(TARGET kqsvd_gpu)
    install(TARGETS kqsvd_gpu LIBRARY DESTINATION kqsvd/_native COMPONENT python)
  endif()
endif()
