# Elastic runs (tandem train -n MIN:MAX, tandem/elastic.h) on network-namespace hosts
# (tests/netns; root, else SKIPPED). NET_IDs 21-24, used by no other test.
# A host lost for good: the job finishes on the rest; its losses after the cut equal a manual
# --resume on that many workers (1e-6).
# --elastic-batch grow (the default) and accumulate.
add_test(NAME e2e_elastic_shrink COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/elastic_shrink.sh $<TARGET_FILE:tandem_cli> 21
         grow)
add_test(NAME e2e_elastic_shrink_accumulate COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/elastic_shrink.sh
         $<TARGET_FILE:tandem_cli> 24 accumulate)
# The host comes back: the job grows again at a checkpoint.
add_test(NAME e2e_elastic_regrow COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/elastic_regrow.sh $<TARGET_FILE:tandem_cli> 22)
# Below MIN: a non-zero exit naming the lost host.
add_test(NAME e2e_elastic_below_min COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/elastic_below_min.sh
         $<TARGET_FILE:tandem_cli> 23)
set_tests_properties(e2e_elastic_shrink e2e_elastic_shrink_accumulate e2e_elastic_regrow e2e_elastic_below_min
                     PROPERTIES TIMEOUT 180 PROCESSORS 2 SKIP_RETURN_CODE 77)
add_test(NAME e2e_elastic_bad_input COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/elastic_bad_input.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_elastic_bad_input PROPERTIES TIMEOUT 120)
# The text commands' elastic runs (tandem pretrain -n 1:2 --elastic-lr scale; NET_ID 26): a host
# lost for good, the job finishes on the other at half the global batch and learning rate; losses
# after the cut equal a manual --resume on 1 worker (1e-6). The relaunch is train's (above);
# tests/e2e/text_elastic.sh also takes keep, the default, which CI leaves out for time.
add_test(NAME e2e_text_elastic_scale COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/text_elastic.sh
         $<TARGET_FILE:tandem_cli> 26 scale)
set_tests_properties(e2e_text_elastic_scale PROPERTIES TIMEOUT 180 PROCESSORS 2 SKIP_RETURN_CODE 77)
# tandem train -n 1:2 --elastic-lr scale (NET_ID 27): the worker that remains keeps its 32 samples,
# the global batch and learning rate halve, the cosine schedule goes on in steps of 64; losses
# after the cut equal a manual --resume on 1 worker with --elastic-lr scale (1e-6).
add_test(NAME e2e_elastic_shrink_scale COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/elastic_shrink.sh
         $<TARGET_FILE:tandem_cli> 27 scale)
set_tests_properties(e2e_elastic_shrink_scale PROPERTIES TIMEOUT 180 PROCESSORS 2 SKIP_RETURN_CODE 77)
# tandem finetune --init-from HF_DIR -n 1:2 (NET_ID 28): the tiny Llama of tests/hf/hf_fixture.py
# loses a host after its first checkpoint; the other finishes, its losses those of a manual
# --resume on 1 worker (1e-6).
add_test(NAME e2e_hf_elastic COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/hf_elastic.sh $<TARGET_FILE:tandem_cli>
         ${CMAKE_SOURCE_DIR} 28)
set_tests_properties(e2e_hf_elastic PROPERTIES TIMEOUT 240 PROCESSORS 2 SKIP_RETURN_CODE 77)
