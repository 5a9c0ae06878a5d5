# libFuzzer targets for the checkpoint manifest parser, the IDX parser and the safetensors
# header parser, and a bounded fuzz run of each in ctest (fuzz_manifest, fuzz_idx,
# fuzz_safetensors). They are built by invoking clang++ directly on the LibTorch-free sources
# (src/checkpoint/manifest.cpp, src/data/idx_parse.cpp, src/checkpoint/safetensors_header.cpp)
# with nlohmann-json and zlib, so the rest of Tandem can use any compiler. On by default when
# clang++ can link -fsanitize=fuzzer (Debian 12: packages clang and libclang-rt-14-dev).
find_program(TANDEM_FUZZ_CLANG NAMES clang++ clang++-14)
if(NOT DEFINED TANDEM_FUZZ)
  set(_fuzz_default OFF)
  if(TANDEM_FUZZ_CLANG)
    set(_probe_dir ${CMAKE_CURRENT_BINARY_DIR}/fuzz/probe)
    file(WRITE ${_probe_dir}/probe.cpp
         "#include <cstddef>\n#include <cstdint>\nextern \"C\" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n")
    execute_process(COMMAND ${TANDEM_FUZZ_CLANG} -fsanitize=fuzzer,address,undefined probe.cpp -o probe
                    WORKING_DIRECTORY ${_probe_dir} RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_QUIET)
    if(_rc EQUAL 0)
      set(_fuzz_default ON)
    endif()
  endif()
  message(STATUS "Tandem: libFuzzer targets ${_fuzz_default} (clang++: ${TANDEM_FUZZ_CLANG})")
endif()
option(TANDEM_FUZZ "Build the libFuzzer targets with clang++ and run them briefly in ctest" ${_fuzz_default})
set(TANDEM_FUZZ_SECONDS 20 CACHE STRING "Seconds each ctest fuzz run mutates")

if(TANDEM_FUZZ)
  if(NOT TANDEM_FUZZ_CLANG)
    message(FATAL_ERROR "TANDEM_FUZZ=ON needs clang++ with libFuzzer (Debian: apt-get install clang libclang-rt-14-dev)")
  endif()
  set(_src ${CMAKE_SOURCE_DIR}/src)
  set(_flags -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
             -I${_src} -I${CMAKE_SOURCE_DIR}/include -I${CMAKE_BINARY_DIR}/generated)
  set(_libs "")
  if(TANDEM_HAVE_ZLIB)
    set(_libs -lz)
  endif()
  set(fuzz_manifest_sources ${_src}/checkpoint/manifest.cpp ${_src}/checkpoint/placement.cpp ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_manifest.cpp)
  set(fuzz_manifest_headers ${_src}/checkpoint/manifest.h ${CMAKE_SOURCE_DIR}/include/tandem/placement.h ${CMAKE_SOURCE_DIR}/include/tandem/checkpoint_meta.h)
  set(fuzz_manifest_dict ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/manifest.dict)
  set(fuzz_idx_sources ${_src}/data/idx_parse.cpp ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_idx.cpp)
  set(fuzz_idx_headers ${_src}/data/idx_parse.h ${CMAKE_BINARY_DIR}/generated/tandem_build_config.h)
  set(fuzz_idx_dict "")
  set(fuzz_safetensors_sources ${_src}/checkpoint/safetensors_header.cpp
                               ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_safetensors.cpp)
  set(fuzz_safetensors_headers ${_src}/checkpoint/safetensors_header.h)
  set(fuzz_safetensors_dict ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/safetensors.dict)
  foreach(t manifest idx safetensors)
    set(_out ${CMAKE_CURRENT_BINARY_DIR}/fuzz/fuzz_${t})
    add_custom_command(OUTPUT ${_out}
                       COMMAND ${TANDEM_FUZZ_CLANG} ${_flags} ${fuzz_${t}_sources} -o ${_out} ${_libs}
                       DEPENDS ${fuzz_${t}_sources} ${fuzz_${t}_headers}
                       COMMENT "Building libFuzzer target fuzz_${t} with ${TANDEM_FUZZ_CLANG}" VERBATIM)
    add_custom_target(fuzz_${t} ALL DEPENDS ${_out})
    add_test(NAME fuzz_${t}
             COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/run_fuzz.sh ${_out} ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/corpus/${t}
                     ${CMAKE_CURRENT_BINARY_DIR}/fuzz/work-${t} ${TANDEM_FUZZ_SECONDS} ${fuzz_${t}_dict})
    set_tests_properties(fuzz_${t} PROPERTIES TIMEOUT 90 PROCESSORS 1)
  endforeach()
endif()
