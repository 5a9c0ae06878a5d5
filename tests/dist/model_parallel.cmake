# Model parallelism: pipeline (GPipe, 1F1B, interleaved, zb-h1, zb-v) with 2 and 4 stages, tensor parallelism with 2 and 4
# ranks, and the dp x tp x pp grid with its compositions on 4 ranks, against single-process
# training in float64.
foreach(np 2 4)
  tandem_add_dist_test(dist_pipeline_np${np} ${np} "Pipeline.*" TIMEOUT 120)
  # Interleaved 1F1B: chunks per rank against one process; through the Engine with dp on 4 ranks.
  tandem_add_dist_test(dist_pipeline_interleaved_np${np} ${np} "PipelineInterleaved.*" TIMEOUT 150)
  # zb-h1 and zb-v: gradients against one process; with ZeRO and DDP through the Engine.
  tandem_add_dist_test(dist_pipeline_zero_bubble_np${np} ${np} "PipelineZeroBubble.*" TIMEOUT 150)
  tandem_add_dist_test(dist_tensor_parallel_np${np} ${np} "TensorParallel.*" TIMEOUT 120)
endforeach()
tandem_add_dist_test(dist_grid_np4 4 "Grid.*" TIMEOUT 150)
# A test-only layer with its own split (interleaved rows): checkpoints across tp 2 and DDP, the
# checkpoint read whole, and initial values from a source, with no code of their own.
tandem_add_dist_test(dist_toy_placement_np2 2 "ToyPlacement.*" TIMEOUT 120)
