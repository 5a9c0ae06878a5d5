# `tandem pretrain` / `tandem finetune` on real text (Debian's fortune cookies) as a user runs
# them: accuracy parity of ddp and zero2 with single (pre-trained vs from scratch printed), and
# bad input rejected with a clear message. Skipped (exit 77) without the corpus.
add_test(NAME e2e_text_finetune COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/text_finetune.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_text_finetune PROPERTIES TIMEOUT 600 PROCESSORS 2 SKIP_RETURN_CODE 77)
add_test(NAME e2e_text_bad_input COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/text_bad_input.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_text_bad_input PROPERTIES TIMEOUT 300 PROCESSORS 2)
