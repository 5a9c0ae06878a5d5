# DistributedDataParallel against single-process training, on 2, 3 and 4 ranks.
foreach(np 2 3 4)
  tandem_add_dist_test(dist_ddp_np${np} ${np} "DDP.*" TIMEOUT 240)
endforeach()
