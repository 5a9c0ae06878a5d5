# `tandem train --tp/--pp`: tensor and pipeline parallelism (with data parallelism over the other
# ranks) against one worker, per-step losses; the layout and bubble in the report; bad input.
add_test(NAME e2e_train_model_parallel
         COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_model_parallel.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_train_model_parallel PROPERTIES TIMEOUT 600 PROCESSORS 2)
# `tandem train --pipeline-schedule interleaved --virtual-stages 2` against one worker; its
# checkpoint resumed on one worker and as plain 1F1B; zb-h1 and zb-v (with ZeRO-2 too) against one
# worker; bad combinations refused.
add_test(NAME e2e_train_interleaved
         COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_interleaved.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_train_interleaved PROPERTIES TIMEOUT 300 PROCESSORS 2)
