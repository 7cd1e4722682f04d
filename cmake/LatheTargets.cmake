# Warning flags for Lathe's own targets. Generated code and third-party headers are
# exempt (they are included as SYSTEM or compiled in their own targets).
function(lathe_warnings target)
  target_compile_options(${target} PRIVATE
    -Wall -Wextra -Wshadow -Wnon-virtual-dtor -Werror)
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

# A GoogleTest binary registered with ctest under the given labels.
#   lathe_test(NAME src.cc... LIBS lib... LABELS unit...)
function(lathe_test name)
  cmake_parse_arguments(T "" "" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  lathe_warnings(${name})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}"
    ENVIRONMENT "LATHE_BIN_DIR=${CMAKE_BINARY_DIR}/bin;LATHE_SOURCE_DIR=${PROJECT_SOURCE_DIR};LATHE_REFERENCE_PYTHON=${LATHE_REFERENCE_PYTHON}")
endfunction()

# A gpu-labelled GoogleTest binary skips every test without a GPU (GTEST_SKIP); ctest then
# reports it as skipped, never as passed.
function(lathe_gpu_skips name)
  set_tests_properties(${name} PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
endfunction()
