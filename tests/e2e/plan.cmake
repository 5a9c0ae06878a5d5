# `tandem plan` and `tandem bench` as a user runs them: bad model and cluster descriptions get a
# clear message and a non-zero exit; a plan prints ranked layouts and valid JSON (MoE models with
# their expert-parallel layouts too); a short bench
# writes its CSV (and plot when gnuplot is installed).
add_test(NAME e2e_plan_bad_input COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/plan_bad_input.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_plan_bad_input PROPERTIES TIMEOUT 120)
add_test(NAME e2e_plan_output COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/plan_output.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_plan_output PROPERTIES TIMEOUT 120)
add_test(NAME e2e_plan_moe COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/plan_moe.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_plan_moe PROPERTIES TIMEOUT 120)
if(TANDEM_HAVE_MPI)
  add_test(NAME e2e_bench_short COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/bench_short.sh $<TARGET_FILE:tandem_cli>)
  set_tests_properties(e2e_bench_short PROPERTIES TIMEOUT 300 PROCESSORS 2)
endif()
