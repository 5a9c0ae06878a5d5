# `tandem finetune --init-from` / `tandem export --to hf` on a tiny random Llama that transformers
# builds locally (tests/hf/hf_fixture.py): loss parity of ddp, zero2, zero3 (each rank reading its shard), pp2, tp2, dp2 x tp2 (ddp, zero3), dp2 x tp3 (zero2, zero3)
# and tp2 x pp2 with one worker (the classifier: ddp, tp2, pp2, tp2 x pp2), bf16/fp16 near fp32, resume across layouts, the export loaded by
# transformers, and bad input rejected with a clear message. Fails without .venv-hf or the fortunes corpus (test setup).
add_test(NAME e2e_hf_finetune COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/hf_finetune.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR})
set_tests_properties(e2e_hf_finetune PROPERTIES TIMEOUT 600 PROCESSORS 2)
add_test(NAME e2e_hf_bad_input COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/hf_bad_input.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR})
set_tests_properties(e2e_hf_bad_input PROPERTIES TIMEOUT 300 PROCESSORS 2)
# tp2 x zero3 and pp2 x zero2 on 4 workers, initialised through each rank's placements: the
# step-1 loss is transformers' on the same batch, and the export after 5 steps gives step 6's.
add_test(NAME e2e_hf_placements COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/hf_placements.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR})
set_tests_properties(e2e_hf_placements PROPERTIES TIMEOUT 400 PROCESSORS 2 LABELS e2e)
# LoRA: `tandem finetune --init-from --init-adapter` single, ddp2, zero3x2, tp2 and pp2 against
# PEFT's training of the same adapter (losses, the exported adapter's loss, the merged export,
# trainable parameters and optimizer state), and bad LoRA input rejected naming the problem.
# .venv-hf (with peft) is part of the test setup: without it this fails rather than skips.
add_test(NAME e2e_hf_lora COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/hf_lora.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR})
set_tests_properties(e2e_hf_lora PROPERTIES TIMEOUT 400 PROCESSORS 2 LABELS e2e)
# Context parallelism (--cp, ring attention): the causal LM under cp2 (ddp, zero3), cp4, tp2 x cp2
# and pp2 x cp2, the tied LM and the classifier under cp2 follow one worker's losses; a cp2 x zero3
# checkpoint resumes on one worker; a --seq not a multiple of 2 x cp is refused with the rule.
add_test(NAME e2e_hf_context_parallel COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/hf_context_parallel.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR})
set_tests_properties(e2e_hf_context_parallel PROPERTIES TIMEOUT 400 PROCESSORS 2 LABELS e2e)
# Pre-tokenized data: `tandem preprocess` read by Megatron-LM's IndexedDataset; packed training
# batches against a numpy reference, the data order over 3 epochs across a 2 -> 1 -> 4 worker
# resume, packed losses under zero3, tp2 and the tied LM, and bad data refused naming the problem.
add_test(NAME e2e_hf_packed COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/hf_packed.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR})
set_tests_properties(e2e_hf_packed PROPERTIES TIMEOUT 400 PROCESSORS 2 LABELS e2e)
# tandem pretrain --data DIR on the same preprocessed fixture corpus: Tandem's transformer on
# packed windows with the dataset's tokenizer, the rows against the numpy reference, a 2 -> 1
# worker resume with no repeat or gap, zero3 and tp2 within 1e-6 of one worker, bad flags refused.
add_test(NAME e2e_pretrain_packed COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/pretrain_packed.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR})
set_tests_properties(e2e_pretrain_packed PROPERTIES TIMEOUT 300 PROCESSORS 2 LABELS e2e)
# Data at scale: a 256 MB synthetic JSON lines corpus and a 24 MB one preprocessed (2 tokenizing
# threads) and trained on by 2 workers; each process's peak resident memory grows by less than
# 64 MiB from the small corpus to the large one (whose ids take 224 MiB) and stays under 1 GiB.
# About 1 minute on 2 idle cores (tokenizing takes about 23 CPU-seconds per 100 MB). The 2 GB run
# of the same script is a benchmark (docs/BENCHMARKS.md, "Data at scale").
add_test(NAME e2e_hf_packed_large COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/hf_packed_2gb.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR} 256000000)
set_tests_properties(e2e_hf_packed_large PROPERTIES TIMEOUT 900 PROCESSORS 2 LABELS "e2e;slow")
# A tiny random Mixtral (mixture of experts, tests/hf/hf_fixture.py) fine-tuned on one worker: the
# step-1 loss (LM loss + router_aux_loss_coef x the pooled load-balancing loss) and aux loss are
# transformers', the export after 5 steps loads as a MixtralForCausalLM and gives step 6's, the
# per-layer form and --moe-aux-loss-coef reach the loss; bad Mixtral configs and flags are refused.
add_test(NAME e2e_hf_mixtral COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/hf_mixtral.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR})
set_tests_properties(e2e_hf_mixtral PROPERTIES TIMEOUT 300 PROCESSORS 2 LABELS e2e)
# The tiny Mixtral under --ep 2 (alone, with zero3, with dp 2 and with pp 2) against one worker
# running the same micro-batches; the ep 2 export against transformers; --ep it cannot split refused.
add_test(NAME e2e_hf_mixtral_ep COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/hf_mixtral_ep.sh $<TARGET_FILE:tandem_cli> ${CMAKE_SOURCE_DIR})
set_tests_properties(e2e_hf_mixtral_ep PROPERTIES TIMEOUT 300 PROCESSORS 2 LABELS e2e)
