# `tandem k8s` (Kubernetes manifests for the Kubeflow MPI Operator): every generated MPIJob of a
# matrix validates against the MPIJob CRD schema (tests/data/k8s) and the checks of
# k8s_validate.py, broken copies are rejected; bad flags get a clear message; and a manifest's
# launcher command and environment run for real in network-namespace hosts named after the pods
# (NET_ID 40; needs root, else SKIPPED). The validation tests need /usr/bin/python3 with
# python3-jsonschema and python3-yaml (scripts/setup.sh installs them: part of the test setup, so
# without them they fail).
add_test(NAME e2e_k8s_schema COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/k8s_schema.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_k8s_schema PROPERTIES TIMEOUT 120)
add_test(NAME e2e_k8s_bad_input COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/k8s_bad_input.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_k8s_bad_input PROPERTIES TIMEOUT 120)
if(TANDEM_HAVE_MPI)
  add_test(NAME e2e_k8s_run_in_netns COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/k8s_run.sh $<TARGET_FILE:tandem_cli> 40)
  set_tests_properties(e2e_k8s_run_in_netns PROPERTIES TIMEOUT 600 PROCESSORS 2 SKIP_RETURN_CODE 77)
endif()
