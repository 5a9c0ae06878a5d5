# Sharded checkpoints: bitwise resume (ZeRO stages 1-3, DDP) and resharding 4 -> 2 -> 1 -> 4
# ranks across ZeRO-2/3, DDP and ZeRO-1 against an uninterrupted single-process run (np 2, 4);
# a tensor-parallel transformer (tp = np) saved whole and loaded back into shards;
# bad input (corrupted, truncated, missing files, another model) and a save killed with SIGKILL
# midway, each rank in its own directory.
foreach(np 2 4)
  tandem_add_dist_test(dist_checkpoint_np${np} ${np} "*CheckpointResume.*:CheckpointReshard.*:CheckpointMixed.*" TIMEOUT 120)
endforeach()
tandem_add_dist_test(dist_checkpoint_errors 1 "CheckpointErrors.*" TIMEOUT 60)
