# ZeRO stages 1 and 2 against DDP (losses, parameters, clipping) and the memory model, on 2 and 4 ranks.
foreach(np 2 4)
  tandem_add_dist_test(dist_zero_np${np} ${np} "Zero.*" TIMEOUT 240)
endforeach()
# `tandem train --strategy zero1|zero2` against --strategy ddp (losses and reported memory).
add_test(NAME e2e_train_zero COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/e2e/train_zero.sh $<TARGET_FILE:tandem_cli>)
set_tests_properties(e2e_train_zero PROPERTIES TIMEOUT 300 PROCESSORS 2)
# ZeRO-3 with a unit per block on the 8-block transformer through the Engine: losses against DDP,
# the gathered peak within three units, and a checkpoint resumed on half the workers (4 -> 2, 2 -> 1);
# units chosen by a WrapPolicy (type, path, size) against DDP, and the policies refused.
foreach(np 2 4)
  tandem_add_dist_test(dist_zero3_transformer_np${np} ${np} "Zero3Transformer.*:Zero3WrapPolicy.*" TIMEOUT 120)
endforeach()
# Hybrid sharding (hsdp, hsdp2) on 4 ranks: groups of 2 against DDP, groups of 4 against ZeRO and
# of 1 against DDP, the traffic per group, bad groups refused, a checkpoint resumed elsewhere.
tandem_add_dist_test(dist_hsdp_np4 4 "Stages/Hsdp.*:HsdpConfig.*:HsdpCheckpoint.*" TIMEOUT 120)
