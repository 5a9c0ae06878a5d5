// tandem::parameter_placements (tandem/placement.h): a module tree's parameters with their dense
// names and placements, from the PlacedModules in it.
#include <torch/nn/module.h>

#include <map>
#include <set>

#include "engine/wrapped.h"
#include "tandem/placement.h"

namespace tandem {
namespace {

// Outer modules first: what a PlacedModule lists for its descendants wins over theirs.
void walk(torch::nn::Module& m, const std::string& prefix, int64_t replica, std::set<std::string>& seen,
          std::vector<ParameterPlacement>& out) {
  if (const auto* placed = engine::as_or_wrapped<PlacedModule>(m)) {
    for (auto& p : prefixed(placed->parameter_placements(), prefix, prefix))
      if (seen.insert(p.name).second) out.push_back(std::move(p));
  }
  for (auto& kv : m.named_parameters(/*recurse=*/false)) {
    auto pl = Placement::whole(kv.value().sizes().vec());
    pl.replica = replica;
    if (seen.insert(prefix + kv.key()).second) out.push_back({prefix + kv.key(), prefix + kv.key(), pl});
  }
  for (auto& c : m.named_children()) walk(*c.value(), prefix + c.key() + ".", replica, seen, out);
}

}  // namespace

std::vector<ParameterPlacement> parameter_placements(torch::nn::Module& module, int64_t replica) {
  std::vector<ParameterPlacement> out;
  std::set<std::string> seen;
  walk(module, "", replica, seen, out);
  return out;
}

}  // namespace tandem
