# `tandem train` as a user runs it.
add_test(NAME e2e_train_loss_parity COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_parity.sh $<TARGET_FILE:tandem_cli> steps)
set_tests_properties(e2e_train_loss_parity PROPERTIES TIMEOUT 300 PROCESSORS 2)
add_test(NAME e2e_train_accuracy_parity COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_parity.sh $<TARGET_FILE:tandem_cli> epoch)
set_tests_properties(e2e_train_accuracy_parity PROPERTIES TIMEOUT 900 PROCESSORS 2)
add_test(NAME e2e_train_bad_input COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_bad_input.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_train_bad_input PROPERTIES TIMEOUT 600 PROCESSORS 2)
# --trace FILE: the merged timeline of 2 ranks parses and holds forward, backward, optimizer,
# data, sized collectives, waits, checkpoint save/write/commit, and a pipeline's sends/receives.
add_test(NAME e2e_train_trace COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_trace.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_train_trace PROPERTIES TIMEOUT 180 PROCESSORS 2)
# Mixed precision: bf16 (ZeRO-2) and fp16 with loss scaling (ZeRO-3) reach fp32's accuracy
# within 0.5 points after 150 steps of the MLP, a third of an epoch (fp16 convolutions have no
# fast CPU kernels, and the 16-bit MLP runs take 9-10x fp32's time here: 282 s for a whole epoch
# of each; `train_precision.sh TANDEM -1` runs the epoch).
add_test(NAME e2e_train_precision COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_precision.sh $<TARGET_FILE:tandem_cli> 150)
set_tests_properties(e2e_train_precision PROPERTIES TIMEOUT 900 PROCESSORS 2)
# Gradient accumulation: --grad-accum K follows one batch of the same size (one worker, DDP,
# ZeRO-1/3, tensor parallel); DDP and ZeRO-1 communicate once per step, ZeRO-3 per micro-batch.
add_test(NAME e2e_train_grad_accum COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_grad_accum.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_train_grad_accum PROPERTIES TIMEOUT 600 PROCESSORS 2)
# LARS and LAMB: two workers under ZeRO follow one worker step for step.
add_test(NAME e2e_train_layerwise COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_layerwise.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_train_layerwise PROPERTIES TIMEOUT 300 PROCESSORS 2)
# --replicas K (threads of one process) against -n K processes: DDP and ZeRO-2 losses within
# 1e-5 over 20 steps; bad input to --replicas.
add_test(NAME e2e_train_replicas COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_replicas.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_train_replicas PROPERTIES TIMEOUT 600 PROCESSORS 2)
# Flags with one effect each, checked for it: --scale-lr (lr x workers), --compress fp16 (half
# the all-reduce bytes), --no-overlap and --activation-checkpointing (the same losses), --model
# cnn_bn (its BatchNorm parameters and broadcast running statistics).
add_test(NAME e2e_train_flags COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_flags.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_train_flags PROPERTIES TIMEOUT 300 PROCESSORS 2)
# --tensorboard DIR on train, pretrain, finetune and finetune --init-from: TensorBoard's
# EventAccumulator reads every step's figures and the final ones equal to the same run's
# --metrics; a run killed midway leaves readable steps; an unusable directory is refused before
# training. Fails without .venv-hf (with tensorboard) or the fortunes corpus (test setup).
add_test(NAME e2e_tensorboard COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/tensorboard.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR})
set_tests_properties(e2e_tensorboard PROPERTIES TIMEOUT 300 PROCESSORS 2)
# --compress powersgd --powersgd-rank 4: the CNN on 2 workers for 120 steps against DDP, the
# compressed bytes reported exactly, accuracy within 1 point (train_powersgd.sh TANDEM -1 0.5 3
# is the 3-epoch comparison).
add_test(NAME e2e_train_powersgd COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_powersgd.sh $<TARGET_FILE:tandem_cli> 120 1.0)
set_tests_properties(e2e_train_powersgd PROPERTIES TIMEOUT 300 PROCESSORS 2)
