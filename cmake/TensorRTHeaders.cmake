# Finds the TensorRT C++ headers for the plugin and sets TENSORRT_INCLUDE_DIR (the directory
# holding NvInferRuntime.h), or leaves it unset with DFLASH_TRT_HEADERS_REASON saying why.
# Include it from the top-level CMakeLists.txt before add_subdirectory(trt_plugin). In order:
#   1. TENSORRT_INCLUDE_DIR, when given (-DTENSORRT_INCLUDE_DIR=...);
#   2. TENSORRT_ROOT (CMake or environment variable): a TensorRT install, headers in include/;
#   3. editable builds only (make build): .deps/tensorrt/include, filled by
#      tools/fetch_trt_headers.py (wheels never read ignored folders of the source tree);
#   4. a system install (e.g. /usr/include/x86_64-linux-gnu from NVIDIA's libnvinfer-dev);
#   5. the headers of the PyPI wheel kernel-lens==2.0.1 (TensorRT 10.14), downloaded at configure
#      time into the build directory by tools/fetch_trt_headers.py (once per build directory).
# Without headers TENSORRT_INCLUDE_DIR is left defined but empty, so that no later search picks
# up headers this order did not choose.
# DFLASH_FETCH_TRT_HEADERS=OFF turns the download off (offline builds say so instead of waiting).

option(DFLASH_FETCH_TRT_HEADERS "Download the TensorRT headers when no TensorRT install is given" ON)
set(DFLASH_TRT_HEADERS_REASON "")
set(DFLASH_TRT_HEADERS_SOURCE "")
if(DEFINED DFLASH_BUILD_TRT_PLUGIN AND NOT DFLASH_BUILD_TRT_PLUGIN)
  return()  # the plugin is off: nothing to look for
endif()

function(_dflash_trt_headers_in dir out)
  if(dir AND EXISTS "${dir}/NvInferRuntime.h")
    set(${out} TRUE PARENT_SCOPE)
  else()
    set(${out} FALSE PARENT_SCOPE)
  endif()
endfunction()

if(NOT DEFINED TENSORRT_ROOT AND DEFINED ENV{TENSORRT_ROOT})
  set(TENSORRT_ROOT "$ENV{TENSORRT_ROOT}")
endif()
set(_dflash_trt_fetched "${CMAKE_BINARY_DIR}/_deps/tensorrt/include")

if(TENSORRT_INCLUDE_DIR)
  _dflash_trt_headers_in("${TENSORRT_INCLUDE_DIR}" _found)
  if(_found)
    set(DFLASH_TRT_HEADERS_SOURCE "TENSORRT_INCLUDE_DIR")
  else()
    set(DFLASH_TRT_HEADERS_REASON "TENSORRT_INCLUDE_DIR=${TENSORRT_INCLUDE_DIR} has no NvInferRuntime.h")
    unset(TENSORRT_INCLUDE_DIR)
    unset(TENSORRT_INCLUDE_DIR CACHE)
  endif()
elseif(TENSORRT_ROOT)
  foreach(_dir "${TENSORRT_ROOT}/include" "${TENSORRT_ROOT}/include/tensorrt")
    _dflash_trt_headers_in("${_dir}" _found)
    if(_found)
      set(TENSORRT_INCLUDE_DIR "${_dir}")
      set(DFLASH_TRT_HEADERS_SOURCE "TENSORRT_ROOT")
      break()
    endif()
  endforeach()
  if(NOT TENSORRT_INCLUDE_DIR)
    set(DFLASH_TRT_HEADERS_REASON "TENSORRT_ROOT=${TENSORRT_ROOT} has no include/NvInferRuntime.h")
  endif()
else()
  _dflash_trt_headers_in("${PROJECT_SOURCE_DIR}/.deps/tensorrt/include" _in_deps)
  _dflash_trt_headers_in("${_dflash_trt_fetched}" _in_build)
  find_path(_dflash_trt_system NvInferRuntime.h PATH_SUFFIXES tensorrt NO_CACHE
            NO_CMAKE_ENVIRONMENT_PATH NO_SYSTEM_ENVIRONMENT_PATH)
  if(SKBUILD_STATE STREQUAL "editable" AND _in_deps)
    set(TENSORRT_INCLUDE_DIR "${PROJECT_SOURCE_DIR}/.deps/tensorrt/include")
    set(DFLASH_TRT_HEADERS_SOURCE ".deps (tools/fetch_trt_headers.py)")
  elseif(_dflash_trt_system)
    set(TENSORRT_INCLUDE_DIR "${_dflash_trt_system}")
    set(DFLASH_TRT_HEADERS_SOURCE "a system install")
  elseif(_in_build)
    set(TENSORRT_INCLUDE_DIR "${_dflash_trt_fetched}")
    set(DFLASH_TRT_HEADERS_SOURCE "kernel-lens==2.0.1 (downloaded earlier into the build directory)")
  elseif(NOT DFLASH_FETCH_TRT_HEADERS)
    set(DFLASH_TRT_HEADERS_REASON
        "no TensorRT headers: set TENSORRT_ROOT, or allow the download (DFLASH_FETCH_TRT_HEADERS=ON)")
  else()
    if(NOT Python_EXECUTABLE)
      find_package(Python 3.10 REQUIRED COMPONENTS Interpreter)
    endif()
    message(STATUS "TensorRT headers: downloading kernel-lens==2.0.1 (set TENSORRT_ROOT to use an install)")
    execute_process(
      COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_LIST_DIR}/../tools/fetch_trt_headers.py"
              --dest "${_dflash_trt_fetched}" --quiet
      RESULT_VARIABLE _rc ERROR_VARIABLE _err OUTPUT_QUIET TIMEOUT 180)
    _dflash_trt_headers_in("${_dflash_trt_fetched}" _in_build)
    if(_rc EQUAL 0 AND _in_build)
      set(TENSORRT_INCLUDE_DIR "${_dflash_trt_fetched}")
      set(DFLASH_TRT_HEADERS_SOURCE "kernel-lens==2.0.1 (downloaded)")
    else()
      string(STRIP "${_err}" _err)
      string(REGEX REPLACE "^fetch_trt_headers: " "" _err "${_err}")
      if(NOT _err)
        set(_err "tools/fetch_trt_headers.py: ${_rc}")
      endif()
      set(DFLASH_TRT_HEADERS_REASON
          "the TensorRT headers could not be downloaded (offline? set TENSORRT_ROOT to a TensorRT install): ${_err}")
    endif()
  endif()
endif()

if(TENSORRT_INCLUDE_DIR)
  message(STATUS "TensorRT headers: ${TENSORRT_INCLUDE_DIR} (${DFLASH_TRT_HEADERS_SOURCE})")
else()
  set(TENSORRT_INCLUDE_DIR "")
  message(WARNING "TensorRT headers: ${DFLASH_TRT_HEADERS_REASON}; the TensorRT plugin is left out")
endif()
