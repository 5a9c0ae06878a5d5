# Expert parallelism (tandem/moe.h): the block with its experts over 2 and 4 ranks against the
# full block on every rank (outputs, gradients, capacity drops, auxiliary losses, a rank sent no
# tokens, a rank without tokens) and the refusal of experts that ep does not divide.
foreach(np 2 4)
  tandem_add_dist_test(dist_moe_expert_parallel_np${np} ${np} "ExpertParallel.*" TIMEOUT 120)
endforeach()
