// Where every piece of a model's state lives: the one description that checkpoints (save, and
// load into any other layout), `export --to hf` and initialisation from a Hugging Face directory
// are written on. Each strategy answers one question for every parameter, optimizer-state tensor
// and buffer a rank holds: which elements of which global tensor is this, and is this rank the
// one that writes them (replica 0)? A tensor-parallel block is a box of the global tensor (or
// several: the q, k and v rows of a fused projection), a ZeRO shard is a flat range of the
// tensor it shards, a pipeline stage lists only its own names, and DDP or replicas hold the
// whole tensor with the data-parallel rank as replica id. Pieces compose: a ZeRO flat range of
// a tensor-parallel block is one Placement. LibTorch-free, so that the checkpoint manifest's
// parser (and its fuzz target) use it as it is; parameter_placements() alone needs a module.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace tandem {

// A box of the local tensor that equals a box of the global tensor (the same shape).
struct PlacementBlock {
  std::vector<int64_t> local_offset, global_offset, shape;
};

struct Placement {
  std::vector<int64_t> global_shape;  // the whole tensor, as every layout names it
  std::vector<int64_t> local_shape;   // the tensor this rank holds a view of
  // Boxes of the local tensor and where they lie in the global one; together they tile the
  // local tensor. Empty: the local tensor is the global one.
  std::vector<PlacementBlock> blocks;
  // Elements [flat_begin, flat_end) of the flattened (row-major) local tensor are held, in
  // order; flat_end -1: to the end. ZeRO's shard of a parameter is such a range.
  int64_t flat_begin = 0, flat_end = -1;
  // 0 on the one rank that writes these elements; the ranks holding the same elements again
  // (DDP's replicas, the tensor-parallel ranks of a replicated layer) number themselves 1, 2, ...
  int64_t replica = 0;

  // The whole tensor of this shape.
  static Placement whole(std::vector<int64_t> shape);
  // Block `index` of `parts` equal blocks along dimension `dim` of a tensor of `global` shape
  // (Megatron's column-, row- and vocabulary-parallel cuts). Throws std::invalid_argument when
  // `parts` does not divide that dimension.
  static Placement split(std::vector<int64_t> global, int64_t dim, int64_t index, int64_t parts);
  // Blocks `index` of `parts` along `dim` of each of `sections` equal sections of that dimension,
  // stacked in the local tensor (a fused projection: this rank's q, k and v rows).
  static Placement split_sections(std::vector<int64_t> global, int64_t dim, int64_t sections, int64_t index,
                                  int64_t parts);

  int64_t local_numel() const;
  int64_t global_numel() const;
  int64_t held_begin() const { return flat_begin; }
  int64_t held_end() const;  // flat_end, or local_numel()
  int64_t held_numel() const { return held_end() - flat_begin; }
  // The held range narrowed to local elements [begin, end) of what it holds now (ZeRO over a
  // tensor-parallel block). Throws std::out_of_range outside the held range.
  Placement flat_range(int64_t begin, int64_t end) const;
  // Throws std::invalid_argument starting with `what` when the shapes, blocks or range are
  // inconsistent (a block outside either tensor, blocks not tiling the local tensor, ...).
  void check(const std::string& what) const;
};

bool operator==(const PlacementBlock& a, const PlacementBlock& b);
bool operator==(const Placement& a, const Placement& b);

// `length` consecutive elements of the flattened global tensor from element `global` sit at
// position `held` of a piece's held elements (0: its local element flat_begin).
struct PlacementRun {
  int64_t global = 0, held = 0, length = 0;
};
// The runs of a placement's held elements, sorted by global position, neighbours merged (a
// whole tensor, a row block or a flat range of either is one run; a column block one per row).
std::vector<PlacementRun> placement_runs(const Placement& p);

// `length` elements from position `src` of one piece's held elements go to position `dst` of
// another's.
struct PlacementCopy {
  int64_t dst = 0, src = 0, length = 0;
};
// Where the elements that `want` needs lie in `have` (both from placement_runs of pieces of one
// global tensor): the copies, in `want`'s global order.
std::vector<PlacementCopy> placement_overlap(const std::vector<PlacementRun>& want,
                                             const std::vector<PlacementRun>& have);

// Checks that pieces (their runs) of a tensor of `numel` elements cover every element exactly
// once. Returns "" when they do, else what is wrong: the first element no piece holds, or the
// two pieces (indices into `pieces`) that both hold one.
std::string placement_cover_error(const std::vector<std::vector<PlacementRun>>& pieces, int64_t numel);

// A layer whose parameters are pieces of a dense layer's (a tensor-parallel form, a test's own
// split) or named otherwise says so, and every checkpoint, export and initialisation path
// handles it with no code of its own. Names are relative to the module that implements it;
// `dense_name` is the parameter's name in the dense layer it stands for. Parameters it does not
// list are whole and keep their names (replicated over the ranks that split the layer: replica
// id = their rank there).
struct ParameterPlacement {
  std::string name;        // in this module (recursively: "qkv.weight")
  std::string dense_name;  // in the dense layer ("weight", or "attn.qkv.weight" -> "qkv.weight")
  Placement placement;     // replica 0 for a block of its own, the rank for a replicated copy
};
class PlacedModule {
 public:
  virtual ~PlacedModule() = default;
  virtual std::vector<ParameterPlacement> parameter_placements() const = 0;
};

// The same list with every name prefixed: a module holding placed children reports theirs.
std::vector<ParameterPlacement> prefixed(std::vector<ParameterPlacement> list, const std::string& name_prefix,
                                         const std::string& dense_prefix);

// Every parameter of `module` (recursively, by its name there): its dense name and placement.
// A PlacedModule says where its parameters lie (found through tandem::Checkpointed and
// tandem::ShardedUnit wrappers too), and what an outer one lists wins over its children's; every
// other parameter is whole under its own name, with replica id `replica` (its rank among the
// ranks that hold the same module, e.g. the tensor-parallel rank). Defined with the Engine.
std::vector<ParameterPlacement> parameter_placements(torch::nn::Module& module, int64_t replica);

}  // namespace tandem
