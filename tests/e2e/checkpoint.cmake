# `tandem train --checkpoint-dir/--checkpoint-every/--resume`: bitwise resume of DDP, resume as
# ZeRO-2 and on one worker, and refusal of a checkpoint of another model or batch.
add_test(NAME e2e_train_checkpoint COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_checkpoint.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_train_checkpoint PROPERTIES TIMEOUT 300 PROCESSORS 2)
# Pipeline checkpoints (--pp 2: one writer per stage): bitwise resume with --pp 2; resume on one
# worker, 2 DDP workers and 2 replicas x 2 stages within 1e-5; the same with ZeRO-1 over the
# replicas (each stage's chunks gathered, written whole).
add_test(NAME e2e_train_checkpoint_pipeline COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_checkpoint.sh $<TARGET_FILE:tandem_cli> pipeline)
set_tests_properties(e2e_train_checkpoint_pipeline PROPERTIES TIMEOUT 240 PROCESSORS 2)
# Tensor-parallel checkpoints (--tp 2: gathered, written whole by rank 0): bitwise resume with
# --tp 2; resume on one worker, 2 DDP workers and 2 replicas x 2 shards, and a DDP checkpoint
# resumed with --tp 2, within 1e-5; --tp with --pp, with ZeRO-3, and with --pp and ZeRO-1, each resumed bit
# for bit and on one worker.
add_test(NAME e2e_train_checkpoint_tp COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_checkpoint.sh $<TARGET_FILE:tandem_cli> tp)
set_tests_properties(e2e_train_checkpoint_tp PROPERTIES TIMEOUT 400 PROCESSORS 2)
# Asynchronous checkpoints (--checkpoint-async) under DDP, ZeRO-2 and --tp 2: the same losses
# and the same files byte for byte as synchronous saves, and a bitwise resume from them.
add_test(NAME e2e_train_checkpoint_async COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_checkpoint.sh $<TARGET_FILE:tandem_cli> async)
set_tests_properties(e2e_train_checkpoint_async PROPERTIES TIMEOUT 300 PROCESSORS 2)
# Faults: rank 1 of a training run killed with SIGKILL mid-training -> the launcher exits
# non-zero naming it within 30 s; with --max-restarts 1 the job relaunches from the newest
# checkpoint and finishes; restart1: the same with one worker (-n 1), which is killed.
foreach(mode kill restart restart1)
  add_test(NAME e2e_train_fault_${mode} COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_faults.sh $<TARGET_FILE:tandem_cli> ${mode})
  set_tests_properties(e2e_train_fault_${mode} PROPERTIES TIMEOUT 120 PROCESSORS 2)
endforeach()
