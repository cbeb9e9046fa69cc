# ccache for every C/C++ compile of an hpct build, when it is installed.  A rebuild of the same
# sources (another clone, the wheel for another Python, an sdist unpacked elsewhere) then takes its
# objects from the cache in seconds instead of recompiling Gloo and the extension.  ccache keys a
# hit on the compiler, its flags and the source with its headers: the object the compiler would
# write.  CCACHE_BASEDIR is the tree being built (HPCT_CCACHE_BASEDIR, default the source folder):
# its absolute paths are hashed as relative ones, so two trees at different paths share hits, and
# CCACHE_NOHASHDIR leaves the build folder out of the key (these builds carry no debug info).
# Included by build_scripts/gloo.cmake (cmake -C) and CMakeLists.txt (the extension).
# Off: CCACHE_DISABLE=1.  A launcher set by the user (-D or the environment) is kept.
if(NOT DEFINED ENV{CMAKE_CXX_COMPILER_LAUNCHER}
   AND (NOT DEFINED CACHE{CMAKE_CXX_COMPILER_LAUNCHER} OR HPCT_LAUNCHER_IS_OURS))
  unset(HPCT_CCACHE CACHE)                       # searched again at every configure: ccache
  find_program(HPCT_CCACHE ccache NO_CMAKE_SYSTEM_PATH)   # installed or removed since is seen; PATH's
  if(NOT HPCT_CCACHE_BASEDIR)
    set(HPCT_CCACHE_BASEDIR "${CMAKE_SOURCE_DIR}")
  endif()
  set(hpct_launcher "")
  if(HPCT_CCACHE)
    set(hpct_launcher env "CCACHE_BASEDIR=${HPCT_CCACHE_BASEDIR}" CCACHE_NOHASHDIR=1 "${HPCT_CCACHE}")
  endif()
  set(CMAKE_C_COMPILER_LAUNCHER "${hpct_launcher}" CACHE STRING "hpct: ccache when installed" FORCE)
  set(CMAKE_CXX_COMPILER_LAUNCHER "${hpct_launcher}" CACHE STRING "hpct: ccache when installed" FORCE)
  set(HPCT_LAUNCHER_IS_OURS ON CACHE INTERNAL "")
endif()
