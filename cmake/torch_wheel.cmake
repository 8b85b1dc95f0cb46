# Included right after find_package(Torch), by paratrain's build and by the installed
# paratrainConfig.cmake: two fixes for a libtorch that is not the system's, such as the one inside
# PyTorch's wheel (torch.utils.cmake_prefix_path).

# 1. Two ways libtorch's CMake files mix a wheel's libtorch with the system's (Debian's
# libtorch-dev): TorchConfig.cmake looks for libtorch.so in the system's library directories before
# its own (find_library without NO_DEFAULT_PATH), and with Torch_DIR alone it finds the system's
# Caffe2Config.cmake, which defines the other libraries (c10, torch_cpu). The mix fails at link or
# at run time, far from its cause.
if(TARGET torch AND TORCH_INSTALL_PREFIX AND EXISTS "${TORCH_INSTALL_PREFIX}/lib/libtorch.so")
  set(_paratrain_fix "give -DCMAKE_PREFIX_PATH=\"${TORCH_INSTALL_PREFIX};${TORCH_INSTALL_PREFIX}/share/cmake\" (libtorch's directory itself first) and remove the build directory's CMakeCache.txt")
  get_filename_component(_paratrain_want "${TORCH_INSTALL_PREFIX}/lib/libtorch.so" REALPATH)
  get_filename_component(_paratrain_got "${TORCH_LIBRARY}" REALPATH)
  if(NOT _paratrain_got STREQUAL _paratrain_want)
    message(FATAL_ERROR "libtorch's CMake files are from ${TORCH_INSTALL_PREFIX} but they found "
                        "${TORCH_LIBRARY}: ${_paratrain_fix}")
  endif()
  if(Caffe2_DIR AND EXISTS "${TORCH_INSTALL_PREFIX}/share/cmake/Caffe2")
    get_filename_component(_paratrain_want "${TORCH_INSTALL_PREFIX}/share/cmake/Caffe2" REALPATH)
    get_filename_component(_paratrain_got "${Caffe2_DIR}" REALPATH)
    if(NOT _paratrain_got STREQUAL _paratrain_want)
      message(FATAL_ERROR "libtorch's CMake files are from ${TORCH_INSTALL_PREFIX} but its "
                          "libraries' (Caffe2) from ${Caffe2_DIR}: ${_paratrain_fix}")
    endif()
  endif()
  unset(_paratrain_fix)
  unset(_paratrain_want)
  unset(_paratrain_got)
endif()

# 2. A wheel's libtorch_cuda.so finds its CUDA libraries (NCCL, cuDNN, cuBLAS, ...) in the wheel's
# nvidia/ packages through its RPATH. When a program is linked, ld looks for them along the
# program's own -rpath first, where torch's CMake files put the CUDA toolkit's lib directory: a
# toolkit whose NCCL is older than the wheel's (2.28 against 2.30) leaves libtorch_cuda's NCCL
# calls undefined. With -rpath-link to the wheel's copies, ld takes what the loader takes at run
# time. Added to the torch target, so that every target linking it gets it.
if(TARGET torch_cuda AND TARGET torch AND TORCH_INSTALL_PREFIX)
  file(GLOB _paratrain_dirs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
  foreach(_paratrain_dir IN LISTS _paratrain_dirs)
    get_filename_component(_paratrain_dir "${_paratrain_dir}" REALPATH)
    set_property(TARGET torch APPEND PROPERTY INTERFACE_LINK_OPTIONS
                 "LINKER:-rpath-link,${_paratrain_dir}")
  endforeach()
  unset(_paratrain_dirs)
  unset(_paratrain_dir)
endif()
