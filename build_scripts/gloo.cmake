# Initial cache for Gloo (cmake -C): the TCP transport only, a static library
# with position-independent code so it can be linked into hpct's Python
# extension.  Gloo's top-level CMakeLists forces -std=c++11; the patches keep to it.
set(CMAKE_BUILD_TYPE Release CACHE STRING "")
set(BUILD_SHARED_LIBS OFF CACHE BOOL "")
set(CMAKE_POSITION_INDEPENDENT_CODE ON CACHE BOOL "")
set(USE_REDIS OFF CACHE BOOL "")
set(USE_IBVERBS OFF CACHE BOOL "")
set(USE_MPI OFF CACHE BOOL "")
set(USE_LIBUV OFF CACHE BOOL "")
set(USE_NCCL OFF CACHE BOOL "")
set(USE_CUDA OFF CACHE BOOL "")
set(USE_ROCM OFF CACHE BOOL "")
set(USE_TCP_OPENSSL_LINK OFF CACHE BOOL "")
set(USE_TCP_OPENSSL_LOAD OFF CACHE BOOL "")
set(BUILD_BENCHMARK OFF CACHE BOOL "")
# BUILD_TEST is chosen per invocation (hpct-build build gloo --tests).
# Gloo asks for cmake_minimum_required(VERSION 3.4); CMake 4 (e.g. PyPI's cmake)
# refuses anything below 3.5 unless told the project is fine with 3.5 policies.
set(CMAKE_POLICY_VERSION_MINIMUM 3.5 CACHE STRING "")
# ccache when installed (build_scripts/compiler_cache.cmake; hpct-build passes HPCT_CCACHE_BASEDIR,
# the work tree, so the build folder's generated headers hash alike in every clone).
include("${CMAKE_CURRENT_LIST_DIR}/compiler_cache.cmake")
