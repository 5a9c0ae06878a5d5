#include "tandem/wrap_policy.h"

#include <torch/nn/modules/container/modulelist.h>

#include <map>
#include <set>
#include <stdexcept>

#include "strategy/module_wrapper.h"
#include "tandem/zero.h"

namespace tandem {

namespace {

using ModulePtr = std::shared_ptr<torch::nn::Module>;

[[noreturn]] void refuse(const std::string& what) { throw std::invalid_argument("WrapPolicy: " + what); }

// "tandem::models::TransformerBlockImpl" matches itself, "TransformerBlockImpl" and "TransformerBlock".
bool type_matches(const std::string& type, const std::string& wanted) {
  if (type == wanted) return true;
  const auto cut = type.rfind("::");
  const std::string last = cut == std::string::npos ? type : type.substr(cut + 2);
  if (last == wanted) return true;
  const std::string impl = "Impl";
  return last.size() > impl.size() && last.compare(last.size() - impl.size(), impl.size(), impl) == 0 &&
         last.substr(0, last.size() - impl.size()) == wanted;
}

void refuse_repeats(const std::vector<std::string>& list, const char* what) {
  std::set<std::string> seen;
  for (const auto& s : list) {
    if (!seen.insert(s).second) refuse(std::string(what) + " '" + s + "' is listed twice");
  }
}

std::string parent_of(const std::string& path) {
  const auto dot = path.rfind('.');
  return dot == std::string::npos ? "" : path.substr(0, dot);
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

int64_t parameter_count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// The model's modules by path (root excluded) and the matches of each rule, checked.
class Matcher {
 public:
  explicit Matcher(const torch::nn::Sequential& model) {
    for (const auto& nm : model->named_modules("", /*include_self=*/false)) {
      by_path_[nm.key()] = nm.value();
      order_.push_back(nm.key());
    }
    for (const auto& c : model->named_children()) children_.push_back(c.key());
  }

  void choose(const std::string& path, const std::string& rule) {
    const std::string parent = parent_of(path);
    if (!parent.empty()) {
      const auto& p = by_path_.at(parent);
      refuse(rule + " matches '" + path + "' (" + by_path_.at(path)->name() + "), a member of '" + parent + "' (" +
             p->name() +
             "), not a child of the Sequential: its parent calls it, so it cannot be rewritten here. "
             "Wrap it with tandem::ShardedUnit in the model (e.g. blocks->push_back(tandem::ShardedUnit(Block(...))))");
    }
    chosen_.insert(path);
  }

  void types(const std::vector<std::string>& wanted) {
    for (const auto& t : wanted) {
      std::vector<std::string> hits;
      for (const auto& path : order_) {
        if (type_matches(by_path_.at(path)->name(), t)) hits.push_back(path);
      }
      if (hits.empty()) refuse("type '" + t + "' matches no module of the model; its types are: " + model_types());
      for (const auto& h : hits) choose(h, "type '" + t + "'");
    }
  }

  void paths(const std::vector<std::string>& wanted) {
    for (const auto& p : wanted) {
      if (!by_path_.count(p)) {
        refuse("path '" + p + "' names no module of the model; the Sequential's children are: " + joined(children_));
      }
      choose(p, "path '" + p + "'");
    }
  }

  void module_list_children() {
    bool any = false;
    for (const auto& path : order_) {
      const std::string parent = parent_of(path);
      if (parent.empty() || !std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(by_path_.at(parent))) continue;
      any = true;
      choose(path, "module_list_children");
    }
    if (!any) refuse("module_list_children is set, but the model holds no ModuleList");
  }

  void min_parameters(int64_t n) {
    int64_t largest = 0;
    for (const auto& c : children_) {
      const int64_t k = parameter_count(*by_path_.at(c));
      largest = std::max(largest, k);
      if (k >= n) chosen_.insert(c);
    }
    if (largest < n) {
      refuse("min_parameters " + std::to_string(n) + " chooses no child: the largest holds " + std::to_string(largest) +
             " parameters");
    }
  }

  const std::set<std::string>& chosen() const { return chosen_; }

 private:
  std::string model_types() const {
    std::set<std::string> seen;
    std::vector<std::string> out;
    for (const auto& path : order_) {
      if (seen.insert(by_path_.at(path)->name()).second) out.push_back(by_path_.at(path)->name());
    }
    return joined(out);
  }

  std::map<std::string, ModulePtr> by_path_;
  std::vector<std::string> order_, children_;
  std::set<std::string> chosen_;
};

}  // namespace

PolicyWrappedImpl::PolicyWrappedImpl(torch::nn::Sequential rebuilt, std::vector<std::string> units)
    : seq_(std::move(rebuilt)), units_(std::move(units)) {
  detail::adopt_members(*this, *seq_);
}

at::Tensor PolicyWrappedImpl::forward(const at::Tensor& x) { return seq_->forward(x); }

PolicyWrapped apply_wrap_policy(const torch::nn::Sequential& model, const WrapPolicy& policy) {
  if (policy.types.empty() && policy.paths.empty() && policy.min_parameters == 0 && !policy.module_list_children) {
    refuse("no rule given; set types, paths, min_parameters or module_list_children");
  }
  if (policy.min_parameters < 0) {
    refuse("min_parameters must be >= 0 (0: no size rule), got " + std::to_string(policy.min_parameters));
  }
  refuse_repeats(policy.types, "type");
  refuse_repeats(policy.paths, "path");
  Matcher m(model);
  m.types(policy.types);
  m.paths(policy.paths);
  if (policy.module_list_children) m.module_list_children();
  if (policy.min_parameters > 0) m.min_parameters(policy.min_parameters);

  torch::nn::Sequential rebuilt;
  std::vector<std::string> units;
  const auto names = model->named_children();
  size_t k = 0;
  for (const auto& child : *model) {
    const std::string& name = names[k++].key();
    if (!m.chosen().count(name)) {
      rebuilt->push_back(name, child);
      continue;
    }
    if (child.ptr()->parameters().empty()) {
      refuse("child '" + name + "' (" + child.ptr()->name() +
             ") holds no parameters, so it cannot be a unit; leave it out of the policy");
    }
    rebuilt->push_back(name, torch::nn::AnyModule(ShardedUnit(std::make_shared<ShardedUnitImpl>(child))));
    units.push_back(name);
  }
  return PolicyWrapped(rebuilt, std::move(units));
}

}  // namespace tandem
