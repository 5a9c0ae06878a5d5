// Expert parallelism in the Engine (private to src/engine): the MoE layers' experts taken out of
// the trained module into a bank of this rank's experts, and the updater that steps them beside
// the strategy's updater of the dense weights.
//
// Every rank of an ep group (consecutive data-parallel ranks) trains its own samples. The dense
// weights are the strategy's over the dp ranks as always. Expert e lives on one rank of each ep
// group; its gradient there holds the contributions of every token of that group routed to it
// (the all-to-all's backward brings them back), so averaging it over the dp / ep ranks holding
// expert e (edp) and dividing by ep gives the gradient of the mean of all dp replicas' losses, as
// the dense weights get.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/updater.h"

namespace tandem::engine {

struct ExpertShards {
  CommPtr ep, edp;                                          // the ep group, and the ranks holding the same experts
  std::shared_ptr<torch::nn::Module> bank;                  // the local experts as children "0", "1", ...
  std::vector<std::pair<std::string, at::Tensor>> trained;  // the bank's trainable parameters, in order
  std::map<std::string, ParameterPlacement> placed;         // by name in the bank
};

// Collective over L.data: splits the ep and edp groups and calls use_expert_parallel on every
// moe::ExpertParallel module of L.net (after its tensor-parallel conversion, before activation
// checkpointing wraps its layers, so that the wrappers adopt the layers without the experts they
// released, and before the pipeline cut). Throws std::invalid_argument when there is none.
std::unique_ptr<ExpertShards> split_experts(Layout& L);

// The experts the MoE layers of L.trained_module (this rank's stage) keep, into X's bank, with
// their placements; `dense_name` maps a parameter's name in the trained module to the dense
// model's.
void bank_experts(Layout& L, ExpertShards& X, const std::function<std::string(const std::string&)>& dense_name);

// The strategy's updater (made by `make_dense`, after the experts' fp32 masters are taken) for
// every weight but the experts, whose gradients are averaged over X.edp and divided by ep: under
// zero1-3 stepped by ZeRO-1 over X.edp (optimizer state and masters sharded), else whole by one
// optimizer per rank. Both clip by, and in fp16 skip with, the whole model's norm.
std::unique_ptr<Updater> with_experts(const std::function<std::unique_ptr<Updater>()>& make_dense, Layout& L,
                                      ExpertShards& X, const OptimizerOptions& optimizer);

}  // namespace tandem::engine
