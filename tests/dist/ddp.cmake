# DistributedDataParallel against single-process training, on 2, 3 and 4 ranks.
foreach(np 2 3 4)
  tandem_add_dist_test(dist_ddp_np${np} ${np} "DDP.*" TIMEOUT 240)
endforeach()
# Unequal batch shares: the weighted gradient of DDP and ZeRO-2 equals the full-batch gradient.
foreach(np 2 3)
  tandem_add_dist_test(dist_shares_np${np} ${np} "Shares.*" TIMEOUT 240)
endforeach()
# `tandem train --batch-shares`: loss parity with equal shares (3:1, counts, auto with a slowed
# rank; ddp and zero2) and the rejected inputs.
add_test(NAME e2e_train_shares_parity COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_shares.sh $<TARGET_FILE:tandem_cli> parity)
set_tests_properties(e2e_train_shares_parity PROPERTIES TIMEOUT 600 PROCESSORS 2)
add_test(NAME e2e_train_shares_bad_input COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_shares.sh $<TARGET_FILE:tandem_cli> bad-input)
set_tests_properties(e2e_train_shares_bad_input PROPERTIES TIMEOUT 300 PROCESSORS 2)
# PowerSGD: full rank equals DDP's average, error feedback, uncompressed tensors and warm-up
# steps exact, the bytes sent, bad options (2 and 4 ranks).
foreach(np 2 4)
  tandem_add_dist_test(dist_powersgd_np${np} ${np} "PowerSGD.*" TIMEOUT 120)
endforeach()
