# Plugins: the example plugin (examples/plugin, which is also a standalone project) built
# against this tree, the plugins the loader must refuse, the registry's unit tests that load
# them, and `tandem train` / `tandem bench` with them.
add_library(tandem_example_plugin SHARED ${CMAKE_SOURCE_DIR}/examples/plugin/mynet.cpp)
target_link_libraries(tandem_example_plugin PRIVATE tandem)
target_precompile_headers(tandem_example_plugin REUSE_FROM tandem)

set(_test_plugin_kinds no_stamp other_version empty duplicate two_models)
set(_plugin_env "TANDEM_TEST_PLUGIN_example=$<TARGET_FILE:tandem_example_plugin>")
foreach(kind ${_test_plugin_kinds})
  string(TOUPPER ${kind} _kind)
  add_library(tandem_test_plugin_${kind} SHARED ${CMAKE_CURRENT_SOURCE_DIR}/e2e/plugins/test_plugins.cpp)
  target_link_libraries(tandem_test_plugin_${kind} PRIVATE tandem)
  target_precompile_headers(tandem_test_plugin_${kind} REUSE_FROM tandem)
  target_compile_definitions(tandem_test_plugin_${kind} PRIVATE TANDEM_TEST_PLUGIN_${_kind}=1)
  list(APPEND _plugin_env "TANDEM_TEST_PLUGIN_${kind}=$<TARGET_FILE:tandem_test_plugin_${kind}>")
endforeach()
target_compile_definitions(tandem_test_plugin_other_version PRIVATE TANDEM_TEST_PLUGIN_VERSION="0.0.1-other")

# The registry's unit tests (tests/unit/test_registry.cpp) load these files.
add_dependencies(tandem_unit_tests tandem_example_plugin)
foreach(kind ${_test_plugin_kinds})
  add_dependencies(tandem_unit_tests tandem_test_plugin_${kind})
endforeach()
set_property(TEST unit APPEND PROPERTY ENVIRONMENT ${_plugin_env})
add_test(NAME unit_registry COMMAND ${TANDEM_RUN_GTEST} $<TARGET_FILE:tandem_unit_tests> --gtest_filter=Registry*:Plugin*)
set_tests_properties(unit_registry PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 ENVIRONMENT "${_plugin_env}")

# Bad input: each a one-line error naming the problem, a non-zero exit, at once (before any
# worker starts).
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/not_a_plugin.so "text, not a shared library\n")
function(tandem_plugin_refused name pattern)
  add_test(NAME e2e_plugin_${name}
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/expect_run.sh --exit nonzero --within 60 --stderr "${pattern}"
                   -- ${ARGN})
  set_tests_properties(e2e_plugin_${name} PROPERTIES TIMEOUT 120)
endfunction()
set(_train $<TARGET_FILE:tandem_cli> train -n 2 --max-steps 1 --no-baseline)
tandem_plugin_refused(missing "plugin '/nonexistent/libnothing.so' not found \\(No such file or directory\\)"
                      ${_train} --model /nonexistent/libnothing.so)
tandem_plugin_refused(not_a_library "not_a_plugin.so. is not a shared library \\(.*\\); pass the .so file"
                      ${_train} --model ${CMAKE_CURRENT_BINARY_DIR}/not_a_plugin.so)
tandem_plugin_refused(no_stamp "lacks the symbol tandem_plugin_stamp.*TANDEM_PLUGIN\\(\\)"
                      ${_train} --model $<TARGET_FILE:tandem_test_plugin_no_stamp>)
tandem_plugin_refused(other_version "was built against Tandem 0\\.0\\.1-other with LibTorch .*but this is Tandem [0-9.]+ with LibTorch"
                      ${_train} --model $<TARGET_FILE:tandem_test_plugin_other_version>)
tandem_plugin_refused(empty "registers no model and no dataset"
                      ${_train} --model $<TARGET_FILE:tandem_test_plugin_empty>)
tandem_plugin_refused(duplicate "model 'cnn' \\(plugin .*\\) is already registered \\(built into Tandem\\)"
                      ${_train} --model $<TARGET_FILE:tandem_test_plugin_duplicate>)
tandem_plugin_refused(several_models "registers several models \\(twin_a, twin_b\\); choose one as .*:twin_a"
                      ${_train} --model $<TARGET_FILE:tandem_test_plugin_two_models>)
tandem_plugin_refused(unknown_model_in_plugin "has no model 'twin_c' \\(its models: twin_a, twin_b\\)"
                      ${_train} --model $<TARGET_FILE:tandem_test_plugin_two_models>:twin_c)
tandem_plugin_refused(unknown_dataset "unknown dataset 'imagenet' \\(known: fashion-mnist, blobs\\)"
                      ${_train} --model $<TARGET_FILE:tandem_example_plugin> --dataset imagenet)
tandem_plugin_refused(bench_missing "plugin '/nonexistent/libnothing.so' not found"
                      $<TARGET_FILE:tandem_cli> bench --model /nonexistent/libnothing.so --no-plot)

# Training a plugin's model on its dataset with 2 workers: each worker loads the plugin itself.
if(TANDEM_HAVE_MPI)
  add_test(NAME e2e_plugin_train
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/expect_run.sh --exit 0 --within 240
                   --stdout "tiny_mlp \\([0-9]+ parameters\\), strategy ddp, 2 worker" --stdout "final loss"
                   -- $<TARGET_FILE:tandem_cli> train --model $<TARGET_FILE:tandem_example_plugin> --dataset blobs
                   -n 2 --strategy ddp --batch 64 --max-steps 20 --no-baseline --no-eval --no-progress)
  set_tests_properties(e2e_plugin_train PROPERTIES TIMEOUT 300 PROCESSORS 2)
endif()
