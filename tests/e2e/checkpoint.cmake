# `tandem train --checkpoint-dir/--checkpoint-every/--resume`: bitwise resume of DDP, resume as
# ZeRO-2 and on one worker, and refusal of a checkpoint of another model or batch.
add_test(NAME e2e_train_checkpoint COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_checkpoint.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_train_checkpoint PROPERTIES TIMEOUT 300 PROCESSORS 2)
# Faults: rank 1 of a training run killed with SIGKILL mid-training -> the launcher exits
# non-zero naming it within 30 s; with --max-restarts 1 the job relaunches from the newest
# checkpoint and finishes.
foreach(mode kill restart)
  add_test(NAME e2e_train_fault_${mode} COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_faults.sh $<TARGET_FILE:tandem_cli> ${mode})
  set_tests_properties(e2e_train_fault_${mode} PROPERTIES TIMEOUT 120 PROCESSORS 2)
endforeach()
