# FindNCCL: locate the NCCL headers and library that unifab builds against.
#
# The device-API code must be compiled against the exact headers of the runtime library, so the
# search is explicit and reports where it found NCCL. Order:
#   1. NCCL_HOME (CMake variable or environment variable),
#   2. the CUDA toolkit's NCCL (include/ and lib/ next to nvcc),
#   3. NVIDIA's nvidia-nccl wheel: site-packages/nvidia/nccl of the first python3 found (PyTorch's
#      NCCL), then the private environment that .ci/setup creates in build/.nccl-venv.
# Only the first root that has both nccl.h and the library is used; the system paths are never
# searched implicitly, so a stray /usr/include/nccl.h of another version cannot be mixed in.
#
# Results: NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION (x.y.z), NCCL_VERSION_CODE,
# NCCL_SOURCE (which rule found it), NCCL_HAS_DEVICE_API, and the imported target NCCL::nccl.

include(FindPackageHandleStandardArgs)

function(_unifab_nccl_try root source)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    return()
  endif()
  if(NOT EXISTS "${root}/include/nccl.h")
    return()
  endif()
  find_library(_unifab_nccl_lib NAMES nccl libnccl.so.2
               PATHS "${root}/lib" "${root}/lib64" NO_DEFAULT_PATH NO_CACHE)
  if(NOT _unifab_nccl_lib)
    return()
  endif()
  set(NCCL_INCLUDE_DIR "${root}/include" CACHE PATH "NCCL include directory" FORCE)
  set(NCCL_LIBRARY "${_unifab_nccl_lib}" CACHE FILEPATH "NCCL library" FORCE)
  set(NCCL_SOURCE "${source}" CACHE STRING "Where NCCL was found" FORCE)
endfunction()

set(_unifab_nccl_home "${NCCL_HOME}")
if(NOT _unifab_nccl_home AND DEFINED ENV{NCCL_HOME})
  set(_unifab_nccl_home "$ENV{NCCL_HOME}")
endif()

if(_unifab_nccl_home)
  # An explicit NCCL_HOME must win even over a cached earlier result.
  unset(NCCL_INCLUDE_DIR CACHE)
  unset(NCCL_LIBRARY CACHE)
  _unifab_nccl_try("${_unifab_nccl_home}" "NCCL_HOME")
  if(NOT NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "NCCL_HOME=${_unifab_nccl_home} has no include/nccl.h with lib/libnccl.so")
  endif()
endif()

if(CUDAToolkit_BIN_DIR)
  get_filename_component(_unifab_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  _unifab_nccl_try("${_unifab_cuda_root}" "CUDA toolkit")
endif()

if(NOT NCCL_INCLUDE_DIR)
  set(_unifab_nccl_py_roots "")
  find_program(_unifab_python NAMES python3 NO_CACHE)
  if(_unifab_python)
    execute_process(
      COMMAND "${_unifab_python}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE _unifab_py_nccl OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _unifab_py_rc ERROR_QUIET)
    if(_unifab_py_rc EQUAL 0 AND _unifab_py_nccl)
      list(APPEND _unifab_nccl_py_roots "${_unifab_py_nccl}")
    endif()
  endif()
  # The private environment .ci/setup installs NVIDIA's wheel into when nothing else has NCCL.
  file(GLOB _unifab_venv_nccl "${PROJECT_SOURCE_DIR}/build/.nccl-venv/lib/python3*/site-packages/nvidia/nccl")
  list(APPEND _unifab_nccl_py_roots ${_unifab_venv_nccl})
  foreach(_root IN LISTS _unifab_nccl_py_roots)
    _unifab_nccl_try("${_root}" "the nvidia-nccl wheel")
  endforeach()
endif()

if(NCCL_INCLUDE_DIR)
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _unifab_nccl_ver_lines
       REGEX "^#define NCCL_(MAJOR|MINOR|PATCH|VERSION_CODE) +[0-9]+")
  foreach(_line IN LISTS _unifab_nccl_ver_lines)
    if(_line MATCHES "^#define NCCL_([A-Z_]+) +([0-9]+)")
      set(_unifab_nccl_${CMAKE_MATCH_1} "${CMAKE_MATCH_2}")
    endif()
  endforeach()
  set(NCCL_VERSION "${_unifab_nccl_MAJOR}.${_unifab_nccl_MINOR}.${_unifab_nccl_PATCH}")
  set(NCCL_VERSION_CODE "${_unifab_nccl_VERSION_CODE}")
  if(EXISTS "${NCCL_INCLUDE_DIR}/nccl_device.h")
    set(NCCL_HAS_DEVICE_API TRUE)
  else()
    set(NCCL_HAS_DEVICE_API FALSE)
  endif()
endif()

find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION
  REASON_FAILURE_MESSAGE
    "set NCCL_HOME to a directory with include/nccl.h and lib/libnccl.so, or install the CUDA toolkit's NCCL or 'pip install nvidia-nccl-cu13'")

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl SHARED IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
