# FindNCCL: NCCL from NCCL_ROOT / NCCL_HOME, the CUDA toolkit, the system, or the nvidia-nccl-cu*
# Python wheel (site-packages/nvidia/nccl, which ships libnccl.so.2 without the unversioned link).
# Defines NCCL_FOUND, NCCL_VERSION and the imported target NCCL::NCCL.
set(_nccl_hints $ENV{NCCL_ROOT} $ENV{NCCL_HOME} ${NCCL_ROOT})
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_hints ${CUDAToolkit_LIBRARY_ROOT})
endif()
if(CUDAToolkit_INCLUDE_DIRS)
  foreach(_d ${CUDAToolkit_INCLUDE_DIRS})
    list(APPEND _nccl_hints ${_d}/..)
  endforeach()
endif()
find_program(_nccl_python NAMES python3 python)
if(_nccl_python)
  execute_process(COMMAND ${_nccl_python} -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
                  OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_nccl_wheel)
    list(APPEND _nccl_hints ${_nccl_wheel})
  endif()
endif()
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
# The library next to the header first (a wheel's libnccl.so.2 before a system libnccl.so), so
# that header and library come from the same installation.
if(NCCL_INCLUDE_DIR)
  get_filename_component(_nccl_root "${NCCL_INCLUDE_DIR}/.." ABSOLUTE)
endif()
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_nccl_root} ${_nccl_hints}
             PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_v REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*" "\\1.\\2.\\3" NCCL_VERSION "${_nccl_v}")
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)
if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
