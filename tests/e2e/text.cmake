# `tandem pretrain` / `tandem finetune` on real text (Debian's fortune cookies) as a user runs
# them: accuracy parity of ddp and zero2 with single, pre-trained beating from scratch, bf16 /
# --tp 2 / --pp 2 against fp32 and the category task, and bad input rejected with a clear
# message. Fails without the corpus (scripts/setup.sh installs it).
add_test(NAME e2e_text_finetune COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/text_finetune.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_text_finetune PROPERTIES TIMEOUT 600 PROCESSORS 2)
add_test(NAME e2e_text_bad_input COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/text_bad_input.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_text_bad_input PROPERTIES TIMEOUT 300 PROCESSORS 2)
add_test(NAME e2e_text_pretrained_beats_scratch COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/text_pretrain_gap.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_text_pretrained_beats_scratch PROPERTIES TIMEOUT 300 PROCESSORS 2)
add_test(NAME e2e_text_parallel COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/text_parallel.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_text_parallel PROPERTIES TIMEOUT 400 PROCESSORS 2)
# Loss normalised by the global batch's tokens: one worker with one pass, DDP, --grad-accum, a
# pipeline's micro-batches, ZeRO-1 with accumulation, tensor parallelism and tensor parallelism
# with ZeRO-2 and ZeRO-3 over its replicas end at the same loss.
add_test(NAME e2e_text_grad_accum COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/text_grad_accum.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_text_grad_accum PROPERTIES TIMEOUT 400 PROCESSORS 2)
# Checkpoints of pretrain and finetune (--checkpoint-dir/--checkpoint-every/--keep/--resume): a
# run stopped at a checkpoint and resumed follows the uninterrupted one (1e-6 on the same
# workers, 2e-5 on one worker).
add_test(NAME e2e_text_resume COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/text_resume.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_text_resume PROPERTIES TIMEOUT 300 PROCESSORS 2)
