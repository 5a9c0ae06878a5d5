# Sharded checkpoints through the Engine: bitwise resume (ZeRO stages 1-3, DDP, bf16 and fp16)
# and resharding 4 -> 2 -> 1 -> 4 ranks across ZeRO-2/3, DDP and ZeRO-1 against an
# uninterrupted single-process run (np 2, 4); pipeline stages and interleaved chunks resumed
# as stages and in one process; a tensor-parallel transformer (tp = np) whose checkpoint equals
# a dense run's and loads back into shards; saves whose pieces leave a hole, overlap, have no
# writer or disagree on a shape refused on every rank.
foreach(np 2 4)
  tandem_add_dist_test(dist_checkpoint_np${np} ${np}
    "*CheckpointResume.*:CheckpointResumeDdp.*:CheckpointReshard.*:CheckpointMixed.*:CheckpointPieces.*" TIMEOUT 120)
endforeach()
# Bad input (corrupted, truncated, missing files, another model, manifest pieces that leave an
# element out, overlap or lie outside their tensor) and a save killed with SIGKILL midway, each
# rank in its own directory.
tandem_add_dist_test(dist_checkpoint_errors 1 "CheckpointErrors.*:CheckpointPieceErrors.*" TIMEOUT 60)
# Every layout's checkpoint loaded by every other (single, ddp x2, zero1 x2, zero3 x3, tp2, pp2,
# tp2 x pp2 under zero3, two replica threads): parameters and Adam's state bit for bit against
# one process that loads it, the data position, and the next losses.
tandem_add_dist_test(dist_checkpoint_matrix_np4 4 "CheckpointMatrix.*" TIMEOUT 300)
