// ZeRO-3 units chosen by policy, as FSDP's auto-wrap policies choose them: by module type, by
// named path, by parameter count, or every child of a ModuleList. apply_wrap_policy() rebuilds a
// Sequential with the children the policy chooses wrapped in tandem::ShardedUnit (same child
// names, so parameter names and checkpoints are those of the model) and returns it as a module
// that is not a Sequential: ZeRO-3 then gathers each chosen unit around its forward and keeps
// the parameters outside every unit (the other children) as the root unit.
//
// Only a child of the Sequential can be rewritten: LibTorch has no forward hooks, and a module
// held in a parent's typed member (or a ModuleList entry) is called by the parent's own code. A
// policy that matches such a module is refused, naming it: wrap it in the model with
// tandem::ShardedUnit instead. (LibTorch's AnyModule cannot hold an nn::Sequential, so a
// Sequential's children are never Sequentials and the rewrite is one level deep.)
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tandem {

// A module is a unit when any rule matches it (the rules are a union).
struct WrapPolicy {
  // Module types: the class name Module::name() gives ("tandem::models::TransformerBlockImpl"),
  // or its last component with or without "Impl" ("TransformerBlock"). Each must match a module.
  std::vector<std::string> types;
  // Dotted paths of named_modules() ("3", "body.1"). Each must name a module.
  std::vector<std::string> paths;
  // > 0: every child of the Sequential holding at least this many parameters (FSDP's
  // size_based_auto_wrap_policy, min_num_params).
  int64_t min_parameters = 0;
  // Every entry of a ModuleList (FSDP's usual per-block policy for models that keep their
  // blocks in one).
  bool module_list_children = false;
};

// The rebuilt Sequential, registered under no name of its own: its children are this module's
// children under the same names. forward() runs the Sequential.
class PolicyWrappedImpl : public torch::nn::Module {
 public:
  PolicyWrappedImpl(torch::nn::Sequential rebuilt, std::vector<std::string> units);
  at::Tensor forward(const at::Tensor& x);
  // The children wrapped in ShardedUnit, by name, in the Sequential's order.
  const std::vector<std::string>& units() const { return units_; }

 private:
  torch::nn::Sequential seq_;
  std::vector<std::string> units_;
};
TORCH_MODULE(PolicyWrapped);

// The model with the children chosen by `policy` wrapped in ShardedUnit (the modules are shared,
// not copied). Throws std::invalid_argument naming the problem: a policy with no rule, a type or
// path that matches no module, a path or type listed twice, a match that is not a child of the
// Sequential (wrap it with ShardedUnit in the model), a chosen child without parameters, or a
// policy that chooses nothing.
PolicyWrapped apply_wrap_policy(const torch::nn::Sequential& model, const WrapPolicy& policy);

}  // namespace tandem
