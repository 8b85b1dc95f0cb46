# ctest driver of the consumer project (see tests/CMakeLists.txt): install, build against the
# installed tree, run with the installed CLI from a directory outside the build, and check that
# the installed CLI holds no path of the source tree.
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR TORCH_DIR CXX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run.cmake needs -D${var}=...")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                  WORKING_DIRECTORY ${WORK_DIR})
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "failed (${rc}): ${cmd}\n${out}\n${err}")
  endif()
  set(last_output "${out}${err}" PARENT_SCOPE)
endfunction()

file(MAKE_DIRECTORY ${WORK_DIR})
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
# The main build's generator: the machine may have ninja and no make.
# libtorch's own Caffe2 files and library directory, as a user of a PyTorch wheel's libtorch gives
# them on a machine that also has Debian's (cmake/torch_wheel.cmake).
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}
    -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_PREFIX_PATH=${prefix} -DTorch_DIR=${TORCH_DIR} -DCaffe2_DIR=${TORCH_DIR}/../Caffe2
    -DCMAKE_LIBRARY_PATH=${TORCH_PREFIX}/lib)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)

# The installed CLI must not point into the source or build tree. Its text, that is: debug
# information (Debug, RelWithDebInfo builds) names the sources by design, so only Release builds
# are checked.
if(BUILD_TYPE STREQUAL "Release")
  foreach(tree ${SOURCE_DIR} ${BUILD_DIR})
    string(REGEX REPLACE "([][+.*()^$?|\\])" "\\\\\\1" pattern "${tree}")
    foreach(program paratrain paratrain-bench)
      file(STRINGS ${prefix}/bin/${program} tree_paths REGEX "${pattern}")
      if(tree_paths)
        message(FATAL_ERROR "the installed ${program} holds paths of ${tree}: ${tree_paths}")
      endif()
    endforeach()
  endforeach()
endif()

# Run from / with the installed CLI: 2 ranks of the consumer's DDP program.
execute_process(COMMAND ${prefix}/bin/paratrain launch --nproc-per-node 2 --standalone --
                        ${WORK_DIR}/build/consumer_ddp
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err WORKING_DIRECTORY /)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the consumer's 2-rank DDP job failed (${rc})")
endif()
foreach(rank 0 1)
  if(NOT "${out}${err}" MATCHES "consumer rank ${rank} of 2 \\([^)]*\\): parameters agree")
    message(FATAL_ERROR "rank ${rank} did not report agreeing parameters")
  endif()
endforeach()
execute_process(COMMAND ${prefix}/bin/paratrain info RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err WORKING_DIRECTORY /)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "installed paratrain info failed: ${out}${err}")
endif()
message("${out}")
