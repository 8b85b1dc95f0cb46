# ctest labels of the GoogleTest tests, applied when ctest reads the test list (tests/CMakeLists.txt
# appends this file to TEST_INCLUDE_FILES after gtest_discover_tests):
#
#   unit          one process, under 2 s: run with PARATRAIN_TEST_UNIT=1, under which
#                 run_process and start_process (test_util.h) fail the test, so a test that starts
#                 processes cannot keep this label;
#   multiprocess  starts processes: ranks, launchers, Python references, compilers;
#   slow          over 10 s, or one process over 2 s, on the developers' machines;
#   gpu           needs a CUDA device (skips, saying so, without one);
#   cpu-kernels   its numbers depend on which CPU kernels oneDNN and OpenBLAS pick; CI runs these
#                 a second time with the instruction set capped to AVX2 (suffix @avx2);
#   one-leg       CI runs it in the first leg only (tests/test_lists.cmake says which and why).
#
# A test is `unit` when its suite is listed in paratrain_unit_suites or its name in
# paratrain_unit_tests (tests/test_lists.cmake; measured with strace: no execve or fork beyond its
# own), unless it is slow; every other test is `multiprocess`.

cmake_policy(PUSH)
cmake_policy(SET CMP0057 NEW)  # if(... IN_LIST ...) in ctest's own reading of this file

include(${CMAKE_CURRENT_LIST_DIR}/test_lists.cmake)

# Whether a test's numbers depend on the CPU's kernels: its name, or its suite's SUITE.*, is in
# paratrain_cpu_kernel_tests.
function(paratrain_is_cpu_kernel_test bare out)
  string(REGEX REPLACE "\\..*" "" suite "${bare}")
  set(${out} OFF PARENT_SCOPE)
  if(bare IN_LIST paratrain_cpu_kernel_tests OR "${suite}.*" IN_LIST paratrain_cpu_kernel_tests)
    set(${out} ON PARENT_SCOPE)
  endif()
endfunction()

# paratrain_label_test(TEST): sets TEST's labels, environment and cost. Called by
# tests/CMakeLists.txt for the tests it adds itself (SUITE.* and single cases), and below, when
# ctest reads the test list, for the cases gtest_discover_tests found (paratrain_tests_TESTS,
# paratrain_tests_avx2_TESTS).
function(paratrain_label_test test)
  string(REGEX REPLACE "\\..*" "" suite "${test}")
  string(REGEX REPLACE "  # GetParam.*" "" bare "${test}")
  string(REGEX REPLACE "@avx2$" "" bare "${bare}")
  set(environment "")
  if(test MATCHES "@avx2$")
    set(environment ${paratrain_isa_cap_environment})
  endif()
  set(labels "")
  if(suite STREQUAL "Gpu")
    list(APPEND labels gpu)
  endif()
  set(slow OFF)
  if(bare IN_LIST paratrain_slow_tests)
    set(slow ON)
    list(APPEND labels slow)
  endif()
  set(unit OFF)
  if(suite IN_LIST paratrain_unit_suites OR bare IN_LIST paratrain_unit_tests)
    set(unit ON)
  endif()
  if(unit AND NOT slow)
    list(APPEND labels unit)
    list(APPEND environment PARATRAIN_TEST_UNIT=1)
  elseif(NOT unit AND NOT suite STREQUAL "Gpu")
    list(APPEND labels multiprocess)
  endif()
  string(REGEX REPLACE "^[^/]*/" "" unprefixed "${suite}")  # Cases/DdpEquivalence: DdpEquivalence
  set(both_legs OFF)
  if(bare IN_LIST paratrain_both_legs_tests)
    set(both_legs ON)
  elseif(unprefixed IN_LIST paratrain_both_legs_suites AND NOT bare IN_LIST paratrain_one_leg_tests
         AND NOT bare MATCHES "^Cases/.*_mpi(_|$)")
    set(both_legs ON)
  endif()
  if(NOT both_legs)
    list(APPEND labels one-leg)
  endif()
  paratrain_is_cpu_kernel_test("${bare}" cpu_kernels)
  if(test MATCHES "@avx2$")
    list(APPEND labels cpu-kernels isa-avx2)
  elseif(cpu_kernels)
    list(APPEND labels cpu-kernels)
  endif()
  set_tests_properties("${test}" PROPERTIES LABELS "${labels}" ENVIRONMENT "${environment}")
  # ctest -j starts the costliest tests first; without a previous run's times it would start them
  # in file order, and the longest could start last and run alone.
  list(FIND paratrain_slow_tests "${bare}" slow_index)
  if(slow_index GREATER_EQUAL 0)
    list(GET paratrain_slow_costs ${slow_index} cost)
    set_tests_properties("${test}" PROPERTIES COST ${cost})
  endif()
endfunction()

foreach(test IN LISTS paratrain_tests_TESTS paratrain_tests_avx2_TESTS)
  paratrain_label_test("${test}")
endforeach()
cmake_policy(POP)
