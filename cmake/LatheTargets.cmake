# Warning flags for Lathe's own targets. Generated code and third-party headers are
# exempt (they are included as SYSTEM or compiled in their own targets).
# LATHE_WERROR OFF keeps the warnings but lets them pass: scripts/gpu-check builds on a lent GPU
# machine's image, whose compiler is not Debian 12's GCC 12 (a warning a newer GCC adds must not
# cost the lease). CI's builds keep it ON.
option(LATHE_WERROR "Warnings of Lathe's own targets are errors" ON)
if(LATHE_WERROR)
  set(LATHE_WERROR_FLAG -Werror)
else()
  set(LATHE_WERROR_FLAG -Wno-error)
endif()
function(lathe_warnings target)
  target_compile_options(${target} PRIVATE
    -Wall -Wextra -Wshadow -Wnon-virtual-dtor ${LATHE_WERROR_FLAG})
endfunction()

# Own library: warnings, include root at the source tree.
function(lathe_library name)
  add_library(${name} ${ARGN})
  lathe_warnings(${name})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
endfunction()

function(lathe_executable name)
  add_executable(${name} ${ARGN})
  lathe_warnings(${name})
endfunction()

# A GoogleTest binary registered with ctest under the given labels. A binary labelled gpu
# gets tests/testing/gpu_test_main.cc as its main, which exits 77 when every test skipped
# (no GPU): ctest then reports it as skipped, never as passed, and a GPU machine that runs
# some of its tests and skips others (too few GPUs for a case) still sees it pass.
#   lathe_test(NAME src.cc... LIBS lib... LABELS unit...)
function(lathe_test name)
  cmake_parse_arguments(T "" "" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  lathe_warnings(${name})
  if("gpu" IN_LIST T_LABELS)
    target_sources(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests/testing/gpu_test_main.cc)
    target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock)
  else()
    target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  endif()
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}"
    ENVIRONMENT "LATHE_BIN_DIR=${CMAKE_BINARY_DIR}/bin;LATHE_SOURCE_DIR=${PROJECT_SOURCE_DIR};LATHE_REFERENCE_PYTHON=${LATHE_PYTHON}")
  if("gpu" IN_LIST T_LABELS)
    set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77)
  endif()
endfunction()
