# Expert parallelism through the Engine: ep 2 (with dp on 4 ranks), under ZeRO-1 and ZeRO-3 and
# with a pipeline (4 ranks) against one worker running the same micro-batches; a checkpoint
# saved under ep 2 loaded whole; the splits it cannot make refused.
foreach(np 2 4)
  tandem_add_dist_test(dist_expert_parallel_np${np} ${np} "ExpertParallel.*" TIMEOUT 150)
endforeach()
