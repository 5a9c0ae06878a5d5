# Expert parallelism through the Engine: ep 2 (with dp on 4 ranks), under ZeRO-1, ZeRO-3, hsdp and
# hsdp2, with a pipeline (4 ranks), with tensor-parallel experts (tp 2; tp 2 x ep 2 on 4 ranks),
# every layer recomputed, clipped and in fp16, against one worker running the same micro-batches;
# a checkpoint saved under ep 2 (tp 2 x ep 2) loaded whole; the experts' optimizer state sharded
# under ZeRO and resumed; initial values read by the experts' owners only; the splits it cannot
# make refused.
tandem_add_dist_test(dist_expert_parallel_np2 2 "ExpertParallelLayouts.*:-ExpertParallelLayouts.FollowsOneWorkerWithPipeline"
                     TIMEOUT 150)
tandem_add_dist_test(dist_expert_parallel_np4 4 "ExpertParallelLayouts.*" TIMEOUT 200)
