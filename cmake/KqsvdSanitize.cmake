# -DKQSVD_SANITIZE=ON: every C target of the project (libraries, kqsvd, the
# test programs) is compiled and linked with AddressSanitizer and
# UndefinedBehaviorSanitizer.  UBSan does not recover, so any finding ends
# the process with a report and a non-zero exit.  tests/sanitize.sh builds
# this into build-asan/ and sets the runtime options (ASAN_OPTIONS,
# UBSAN_OPTIONS, LSAN_OPTIONS with tests/lsan.supp).
#
# Included before the CUDA option: a sanitizer build leaves the CUDA module
# out by default.  -DKQSVD_CUDA=ON still builds it: the flags apply to C
# compiles and C links only, so nvcc never sees them; the module's C part
# is instrumented and its .cu code is not, and it resolves the sanitizer's
# symbols from the kqsvd that loads it.
option(KQSVD_SANITIZE "Build with -fsanitize=address,undefined (see tests/sanitize.sh)" OFF)

if(KQSVD_SANITIZE)
  if(NOT CMAKE_C_COMPILER_ID MATCHES "GNU|Clang")
    message(FATAL_ERROR "KQSVD_SANITIZE=ON needs GCC or Clang")
  endif()
  set(KQSVD_SANITIZE_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=all
      -fno-omit-frame-pointer)
  add_compile_options("$<$<COMPILE_LANGUAGE:C>:${KQSVD_SANITIZE_FLAGS}>")
  add_link_options("$<$<LINK_LANGUAGE:C>:-fsanitize=address,undefined>")

  # Executables keep every shared library loaded, so LeakSanitizer can name
  # the library behind each allocation left by Open MPI's components
  # (sanitize_keep_loaded.c says why).
  add_library(kqsvd_keep_loaded OBJECT ${CMAKE_CURRENT_LIST_DIR}/sanitize_keep_loaded.c)
  set(_kqsvd_exe "$<STREQUAL:$<TARGET_PROPERTY:TYPE>,EXECUTABLE>")
  link_libraries("$<${_kqsvd_exe}:kqsvd_keep_loaded>")
  add_link_options("$<$<AND:$<LINK_LANGUAGE:C>,${_kqsvd_exe}>:LINKER:--export-dynamic-symbol=dlclose>")
  message(STATUS "kqsvd: AddressSanitizer + UndefinedBehaviorSanitizer build")
endif()
