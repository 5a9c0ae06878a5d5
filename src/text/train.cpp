// The loops behind `tandem pretrain` (causal LM) and `tandem finetune` (classification), the
// checkpoint directory they share, and their report.
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <random>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "tandem/engine.h"
#include "tandem/models.h"
#include "tandem/plan.h"
#include "tandem/progress.h"
#include "tandem/text.h"
#include "tandem/trace.h"
#include "text/hf_packed.h"
#include "text/loop.h"

namespace tandem::text {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// ---- manifest

void write_manifest(const std::string& dir, const Manifest& m) {
  nlohmann::json j;
  j["format"] = "tandem-text-checkpoint-1";
  j["kind"] = m.kind;
  j["model"] = {{"vocab", m.shape.vocab},   {"d_model", m.shape.d_model}, {"heads", m.shape.heads},
                {"layers", m.shape.layers}, {"seq", m.shape.seq},         {"mlp_ratio", m.shape.mlp_ratio}};
  j["task"] = m.task;
  j["labels"] = m.labels;
  j["tokenizer"] = {{"file", m.tokenizer_file}, {"fingerprint", m.tokenizer_fingerprint}, {"vocab", m.tokenizer_vocab}};
  j["steps"] = m.steps;
  j["weights"] = "model.pt";
  std::ofstream f(fs::path(dir) / "manifest.json");
  f << j.dump(2) << '\n';
  if (!f) throw std::runtime_error("writing '" + (fs::path(dir) / "manifest.json").string() + "' failed");
}

Manifest read_manifest(const std::string& dir) {
  const auto path = (fs::path(dir) / "manifest.json").string();
  std::ifstream f(path);
  if (!f) {
    throw std::runtime_error("checkpoint '" + dir + "' has no manifest.json; make one with tandem pretrain --out " +
                             dir);
  }
  try {
    auto j = nlohmann::json::parse(f);
    if (j.value("format", "") != "tandem-text-checkpoint-1") throw std::runtime_error("unknown format");
    Manifest m;
    m.kind = j.at("kind").get<std::string>();
    const auto& mo = j.at("model");
    m.shape.vocab = mo.at("vocab");
    m.shape.d_model = mo.at("d_model");
    m.shape.heads = mo.at("heads");
    m.shape.layers = mo.at("layers");
    m.shape.seq = mo.at("seq");
    m.shape.mlp_ratio = mo.at("mlp_ratio");
    m.task = j.at("task").get<std::string>();
    m.labels = j.at("labels").get<std::vector<std::string>>();
    m.tokenizer_file = j.at("tokenizer").at("file").get<std::string>();
    m.tokenizer_fingerprint = j.at("tokenizer").at("fingerprint").get<std::string>();
    m.tokenizer_vocab = j.at("tokenizer").at("vocab");
    m.steps = j.value("steps", int64_t{0});
    return m;
  } catch (const std::exception& e) {
    throw std::runtime_error("'" + path + "' is not a tandem text checkpoint manifest (" + e.what() + ")");
  }
}

namespace {

models::TransformerConfig model_config(const ModelShape& s, int64_t num_classes) {
  models::TransformerConfig c;
  c.vocab = s.vocab;
  c.d_model = s.d_model;
  c.heads = s.heads;
  c.layers = s.layers;
  c.seq = s.seq;
  c.mlp_ratio = s.mlp_ratio;
  c.num_classes = num_classes;
  c.pad_id = 0;
  return c;
}

EngineOptions transformer_options() {
  EngineOptions eo;
  eo.model_name = "transformer";
  return eo;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

Tokenizer load_checked_tokenizer(const TextTrainConfig& cfg, const Manifest* m, const std::string& path) {
  auto tok = Tokenizer::load(path);
  if (m) {
    if (tok.fingerprint() != m->tokenizer_fingerprint || tok.vocab_size() != m->tokenizer_vocab) {
      throw std::runtime_error("tokenizer '" + path + "' (vocabulary " + std::to_string(tok.vocab_size()) +
                               ", fingerprint " + tok.fingerprint() + ") does not match checkpoint '" + cfg.checkpoint +
                               "' (vocabulary " + std::to_string(m->tokenizer_vocab) + ", fingerprint " +
                               m->tokenizer_fingerprint +
                               "); use the tokenizer saved with the checkpoint, or --from-scratch");
    }
  }
  return tok;
}

// The report's header from the configuration and the engine's layout.
void describe_model(const Engine& eng, const TextTrainConfig& cfg, TextReport& rep) {
  const ModelShape& m = rep.shape;
  rep.model = "transformer d_model " + std::to_string(m.d_model) + ", " + std::to_string(m.layers) + " layers, seq " +
              std::to_string(m.seq) + ", vocabulary " + std::to_string(m.vocab);
  rep.global_batch = cfg.batch;
  rep.baseline_samples_per_second = cfg.baseline_samples_per_second;
  describe_engine(eng, rep);
}

// What ran: the report's header, from the configuration, the engine's layout and the corpus.
void describe_run(const Engine& eng, const TextTrainConfig& cfg, const Corpus& corpus, TextReport& rep) {
  describe_model(eng, cfg, rep);
  rep.labels = corpus.labels;
  rep.train_documents = static_cast<int64_t>(corpus.train.size());
  rep.valid_documents = static_cast<int64_t>(corpus.valid.size());
  rep.test_documents = static_cast<int64_t>(corpus.test.size());
  rep.context.emplace_back("data", std::to_string(rep.train_documents) + " train / " +
                                       std::to_string(rep.valid_documents) + " validation / " +
                                       std::to_string(rep.test_documents) + " test documents, " +
                                       std::to_string(rep.labels.size()) + " labels");
  if (rep.command == "finetune") {
    rep.context.emplace_back("initialised", rep.initialised_from_checkpoint ? "from checkpoint " + cfg.checkpoint
                                                                            : "at random (from scratch)");
  }
}

// The confusion table printed under the test accuracy: rows the true label, columns the predicted.
std::string confusion_table(const std::vector<std::string>& labels, const std::vector<std::vector<int64_t>>& conf) {
  std::ostringstream os;
  os << "confusion        rows: true label, columns: predicted\n";
  os << "        ";
  for (const auto& l : labels) os << std::setw(7) << l.substr(0, 6);
  os << "\n";
  for (size_t i = 0; i < conf.size(); ++i) {
    os << "  " << std::setw(6) << std::left << labels[i].substr(0, 6) << std::right;
    for (auto v : conf[i]) os << std::setw(7) << v;
    os << "\n";
  }
  return os.str();
}

// The Engine's figures, tandem plan's memory for this shape and layout beside them, and the
// metrics file and the TensorBoard run's final figures (rank 0). Collective.
void finish_report(Engine& eng, const EngineStats& loop, const TextTrainConfig& cfg, TextReport& rep,
                   tensorboard::Log& tb) {
  collect_engine_report(eng, loop, rep);
  if (eng.world()->rank() == 0) {
    const ModelShape& m = rep.shape;
    const auto spec =
        plan::transformer_model(m.layers, m.d_model, m.heads, m.seq, m.vocab, static_cast<double>(rep.parameters));
    plan::add_planned_memory(spec, cfg.parallel, eng.world_size(), cfg.batch, "adamw", {}, rep);
    // The planner cuts its own stages of decoder layers; the run's cut counts the embedding and
    // head too, so its per-stage figures would describe another partition.
    rep.plan_memory_bytes_per_stage.clear();
  }
  if (eng.world()->rank() == 0 && !cfg.metrics_path.empty()) write_metrics(cfg.metrics_path, rep);
  tb.finish(rep);
}

// Writes model.pt (the dense fp32 parameters) and the manifest that describes it into `dir`.
// `task` and `labels`: what the model learned (a packed dataset: "lm", no labels).
void save_model(const fs::path& dir, const char* kind, const std::map<std::string, torch::Tensor>& params,
                const ModelShape& shape, const TextTrainConfig& cfg, const std::string& task,
                const std::vector<std::string>& labels, const Tokenizer& tok) {
  torch::serialize::OutputArchive ar;
  for (auto& [name, t] : params) ar.write(name, t);
  ar.save_to((dir / "model.pt").string());
  Manifest m;
  m.kind = kind;
  m.shape = shape;
  m.task = task;
  m.labels = labels;
  m.tokenizer_fingerprint = tok.fingerprint();
  m.tokenizer_vocab = tok.vocab_size();
  m.steps = cfg.steps;
  write_manifest(dir.string(), m);
}

// What a text command's checkpoints record about the run; a resume checks it (LoopCheckpoints).
nlohmann::json run_record(const char* command, const TextTrainConfig& cfg, const Tokenizer& tok) {
  return {{"command", command}, {"tokenizer", tok.fingerprint()}, {"batch", cfg.batch}, {"seed", cfg.seed}};
}

// Tandem's own transformer has no sequence-parallel form (llama::tensor_parallel is the one).
void refuse_sequence_parallel(const TextTrainConfig& cfg) {
  if (cfg.parallel.sequence_parallel) {
    throw std::invalid_argument("--sequence-parallel needs a Llama model (tandem finetune --init-from DIR); Tandem's "
                                "own transformer does not split the sequence: drop --sequence-parallel");
  }
}

// The run's tokenizer as --out DIR/tokenizer.model: `make(path)` writes it there (rank 0), unless
// a resumed run takes the one its checkpoints were trained with (kept beside them); the other
// ranks wait and load it. Collective.
Tokenizer place_tokenizer(Runtime& rt, const TextTrainConfig& cfg,
                          const std::function<void(const std::string&)>& make) {
  const fs::path dir(cfg.checkpoint);
  const auto tok_path = (dir / "tokenizer.model").string();
  const TextCheckpoints& ck = cfg.checkpoints;
  const auto kept_tok = ck.dir.empty() ? fs::path() : fs::path(ck.dir) / "tokenizer.model";
  std::string error;
  if (rt.rank() == 0) {
    try {
      fs::create_directories(dir);
      if (ck.resume && fs::exists(kept_tok)) {
        fs::copy_file(kept_tok, tok_path, fs::copy_options::overwrite_existing);
      } else {
        make(tok_path);
      }
      if (!ck.dir.empty()) {
        fs::create_directories(ck.dir);
        if (!fs::exists(kept_tok)) fs::copy_file(tok_path, kept_tok);
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  auto ok = torch::tensor({error.empty() ? 1.0f : 0.0f}).to(rt.device());
  rt.world()->allreduce(ok, ReduceOp::kSum);
  if (ok.item<float>() < rt.world_size()) {
    throw std::runtime_error(error.empty() ? "rank 0 could not make the tokenizer (see its message)" : error);
  }
  return Tokenizer::load(tok_path);
}

// --tp must divide the heads and the vocabulary (the rest is checked when the model is split;
// these before a tokenizer is trained or read).
void check_tp_split(const TextTrainConfig& cfg, int64_t vocab) {
  const int tp = cfg.parallel.tp;
  if (tp > 1 && (cfg.shape.heads % tp != 0 || vocab % tp != 0)) {
    throw std::invalid_argument("--tp " + std::to_string(tp) + " must divide --heads (" +
                                std::to_string(cfg.shape.heads) + ") and the vocabulary (" + std::to_string(vocab) +
                                ")");
  }
}

}  // namespace

ParallelConfig default_text_parallel() {
  ParallelConfig pc;
  pc.strategy = Strategy::kSingle;
  return pc;
}

void validate(const TextTrainConfig& cfg, int world) {
  if (!cfg.trace.empty()) trace::check_path(cfg.trace);
  if (!cfg.tensorboard.empty()) tensorboard::check_dir(cfg.tensorboard);
  tandem::validate(cfg.parallel, world);
  // The loop gives every replica an equal share of the global batch.
  const int dp = data_parallel_size(cfg.parallel, world);
  if (cfg.batch < 1 || cfg.batch % dp != 0) {
    throw std::invalid_argument("--batch " + std::to_string(cfg.batch) + " (global) does not split evenly over " +
                                std::to_string(dp) + " data-parallel replicas; use a multiple of " +
                                std::to_string(dp));
  }
  tandem::validate(cfg.parallel, world, cfg.batch);
  if (cfg.steps < 1) throw std::invalid_argument("--steps must be >= 1");
  if (cfg.lr <= 0) throw std::invalid_argument("--lr must be > 0");
  if (cfg.warmup_steps < 0) throw std::invalid_argument("--warmup-steps must be >= 0");
  const auto& s = cfg.shape;
  if (s.d_model < 1 || s.heads < 1 || s.layers < 1 || s.seq < 2 || s.d_model % s.heads != 0) {
    throw std::invalid_argument(
        "model shape: --d-model must be a positive multiple of --heads, --layers >= 1, --seq >= 2");
  }
  if (cfg.tokenizer.vocab_size < 8) throw std::invalid_argument("--vocab must be >= 8");
  const TextCheckpoints& c = cfg.checkpoints;
  if (c.every < 0) throw std::invalid_argument("--checkpoint-every must be >= 0 (0: at the end only)");
  if (c.keep < 0) throw std::invalid_argument("--keep must be >= 0 (0: keep all)");
  if ((c.every > 0 || c.resume || c.async) && c.dir.empty()) {
    throw std::invalid_argument(std::string(c.resume  ? "--resume"
                                            : c.async ? "--checkpoint-async"
                                                      : "--checkpoint-every") +
                                " needs --checkpoint-dir DIR");
  }
  if (c.async && c.every == 0) {
    throw std::invalid_argument("--checkpoint-async needs --checkpoint-every N (it makes those saves asynchronous)");
  }
}

namespace {

// tandem pretrain --data DIR on a preprocessed dataset: the packed windows of its .bin (mmap),
// the model's vocabulary that of the tokenizer named in DIR/dataset.json (its tokenizer.model
// becomes --out's), attention and positions reset at each EOS, every target a loss term.
TextReport pretrain_packed(Runtime& rt, const TextTrainConfig& cfg) {
  const std::string& data = cfg.corpus.root;
  refuse_unmasked_layouts(cfg.parallel, "--data '" + data + "' (a preprocessed dataset) packs documents into windows");
  // Each token's position in its document travels to the blocks as a channel of the activations,
  // in the compute dtype: integers are exact up to 256 in bf16 and 2048 in fp16.
  const int64_t exact = cfg.parallel.precision == Precision::kBF16   ? 256
                        : cfg.parallel.precision == Precision::kFP16 ? 2048
                                                                     : int64_t{1} << 24;
  if (cfg.shape.seq - 1 > exact) {
    throw std::invalid_argument("--data '" + data + "' (packed documents) with --precision " +
                                precision_name(cfg.parallel.precision) + " takes --seq " + std::to_string(exact + 1) +
                                " at most (positions in a document must stay exact in that dtype), got --seq " +
                                std::to_string(cfg.shape.seq) + "; lower --seq or train in fp32");
  }
  const auto info = data::read_dataset_info(data);
  const auto source = (fs::path(info.tokenizer_dir) / "tokenizer.model").string();
  if (!fs::exists(source)) {
    throw std::runtime_error("--data '" + data + "' was tokenized by '" + info.tokenizer_dir +
                             "', which holds no SentencePiece tokenizer.model for tandem pretrain to keep as its own; "
                             "preprocess with a model directory that ships one");
  }
  check_tp_split(cfg, info.vocab_size);
  torch::manual_seed(cfg.seed);
  auto tok = place_tokenizer(rt, cfg, [&](const std::string& path) {
    fs::copy_file(source, path, fs::copy_options::overwrite_existing);
  });
  if (tok.vocab_size() != info.vocab_size || tok.eos_id() != info.eos) {
    throw std::runtime_error("--data '" + data + "': its " + data::kDatasetInfoFile + " says vocabulary " +
                             std::to_string(info.vocab_size) + ", EOS " + std::to_string(info.eos) + ", but '" +
                             cfg.checkpoint + "/tokenizer.model' has " + std::to_string(tok.vocab_size()) + ", EOS " +
                             std::to_string(tok.eos_id()) + "; preprocess again, or resume with the same data");
  }
  ModelShape shape = cfg.shape;
  shape.vocab = tok.vocab_size();
  PackedSet set(PackedSource{data, shape.seq, shape.vocab, info.eos, cfg.data_record}, rt.rank());
  auto mc = model_config(shape, 0);
  mc.pad_id = -1;
  mc.eos_id = info.eos;
  auto engine = make_engine(rt, cfg, models::transformer(mc), set.sample(), transformer_options());
  Engine& eng = *engine;
  TextReport rep;
  rep.command = "pretrain";
  rep.shape = shape;
  describe_model(eng, cfg, rep);
  rep.context.emplace_back("data", set.describe());
  auto run = run_record("pretrain", cfg, tok);
  run["dataset"] = set.identity();
  LoopCheckpoints checkpoints(eng, cfg, "text", run, {"command", "tokenizer", "seed", "dataset"});
  checkpoints.set_epoch_size(set.size());
  tensorboard::Log tb(cfg.tensorboard, rt.rank() == 0);
  LoopHooks hooks = checkpoints.start();
  hooks.tensorboard = &tb;
  set.start(hooks.first_step, hooks.first_sample >= 0 ? hooks.first_sample : hooks.first_step * cfg.batch, cfg.batch);
  const EngineStats loop = train_loop(
      rt, cfg, eng, set.size(),
      [&](const std::vector<int64_t>& idx, int64_t from, int64_t to) {
        auto [x, y] = set.batch(idx, from, to);
        return std::make_pair(x.to(rt.device()), y.to(rt.device()));
      },
      [](const torch::Tensor& logits, const torch::Tensor& targets) {
        return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(2)}).to(torch::kFloat),
                                                    targets.reshape({-1}),
                                                    torch::nn::functional::CrossEntropyFuncOptions().reduction(
                                                        torch::kSum));
      },
      [&](const std::vector<int64_t>& idx, int64_t from, int64_t to) { return set.terms(idx, from, to); }, rep, hooks);
  checkpoints.finish();
  if (rep.stopped) {  // relaunched from the checkpoint: no --out yet
    finish_report(eng, loop, cfg, rep, tb);
    return rep;
  }
  auto params = eng.full_parameters();
  finish_report(eng, loop, cfg, rep, tb);
  if (rt.rank() == 0) save_model(cfg.checkpoint, "pretrain", params, shape, cfg, "lm", {}, tok);
  return rep;
}

}  // namespace

TextReport pretrain(Runtime& rt, const TextTrainConfig& cfg) {
  refuse_sequence_parallel(cfg);
  validate(cfg, rt.world_size());
  if (cfg.checkpoint.empty()) throw std::invalid_argument("pretrain needs an output directory (--out DIR)");
  if (is_preprocessed_dataset(cfg.corpus.root)) return pretrain_packed(rt, cfg);
  check_tp_split(cfg, cfg.tokenizer.vocab_size);
  const int rank = rt.rank();
  torch::manual_seed(cfg.seed);
  auto corpus = read_corpus(cfg.corpus);
  auto tok = place_tokenizer(rt, cfg, [&](const std::string& path) {
    Tokenizer::train(texts_of(corpus.train), cfg.tokenizer).save(path);
  });
  const fs::path dir(cfg.checkpoint);
  ModelShape shape = cfg.shape;
  shape.vocab = tok.vocab_size();

  auto train = tok.encode_batch(texts_of(corpus.train), shape.seq);
  auto valid = tok.encode_batch(texts_of(corpus.valid.empty() ? corpus.test : corpus.valid), shape.seq);
  auto net = models::transformer(model_config(shape, 0));
  TextReport rep;
  rep.command = "pretrain";
  rep.shape = shape;
  auto engine = make_engine(rt, cfg, net, train.ids, transformer_options());
  Engine& eng = *engine;
  describe_run(eng, cfg, corpus, rep);
  const auto device = rt.device();
  // Next-token cross-entropy over the real tokens (mean, or the sum for the validation loss).
  auto lm_loss_sum = [&](const torch::Tensor& logits, const torch::Tensor& ids, bool sum) {
    const int64_t v = logits.size(2);
    auto pred = logits.narrow(1, 0, ids.size(1) - 1).reshape({-1, v}).to(torch::kFloat);
    auto target = ids.narrow(1, 1, ids.size(1) - 1).reshape({-1});
    auto o = torch::nn::functional::CrossEntropyFuncOptions().ignore_index(tok.pad_id());
    if (sum) o.reduction(torch::kSum);
    return torch::nn::functional::cross_entropy(pred, target, o);
  };
  // The loss terms of documents: their predicted tokens that are not padding.
  auto real_tokens = [&](const torch::Tensor& ids) {
    return ids.narrow(1, 1, ids.size(1) - 1).ne(tok.pad_id()).sum().item<int64_t>();
  };
  LoopCheckpoints checkpoints(eng, cfg, "text", run_record("pretrain", cfg, tok), {"command", "tokenizer", "seed"});
  tensorboard::Log tb(cfg.tensorboard, rank == 0);
  LoopHooks hooks = checkpoints.start();
  hooks.tensorboard = &tb;
  const EngineStats loop = train_loop(
      rt, cfg, eng, train.ids.size(0),
      [&](const std::vector<int64_t>& idx, int64_t from, int64_t to) {
        auto ids = rows(train.ids, idx, from, to).to(device);
        return std::make_pair(ids, ids);  // the targets: the inputs, shifted by lm_loss_sum
      },
      [&](const torch::Tensor& logits, const torch::Tensor& ids) { return lm_loss_sum(logits, ids, true); },
      [&](const std::vector<int64_t>& idx, int64_t from, int64_t to) {
        return static_cast<double>(real_tokens(rows(train.ids, idx, from, to)));
      },
      rep, hooks);
  checkpoints.finish();
  if (rep.stopped) {  // relaunched from the checkpoint: neither evaluation nor --out yet
    finish_report(eng, loop, cfg, rep, tb);
    return rep;
  }
  if (cfg.evaluate) {
    // Validation loss per predicted token, summed over ranks.
    const int64_t n = cfg.eval_limit >= 0 ? std::min<int64_t>(cfg.eval_limit, valid.ids.size(0)) : valid.ids.size(0);
    double sum = 0.0;
    int64_t tokens = 0;
    eng.evaluate(valid.ids, n, 256, [&](const torch::Tensor& logits, int64_t from, int64_t to) {
      auto ids = valid.ids.narrow(0, from, to - from).to(device);
      sum += lm_loss_sum(logits, ids, true).item<double>();
      tokens += real_tokens(ids);
    });
    auto t = torch::tensor({sum, static_cast<double>(tokens)}, torch::kDouble).to(device);
    rt.world()->allreduce(t, ReduceOp::kSum);
    auto h = t.cpu();
    rep.eval_loss = h[1].item<double>() > 0 ? h[0].item<double>() / h[1].item<double>() : -1.0;
  }
  auto params = eng.full_parameters();
  finish_report(eng, loop, cfg, rep, tb);
  if (rank == 0) save_model(dir, "pretrain", params, shape, cfg, cfg.corpus.task, corpus.labels, tok);
  return rep;
}

TextReport finetune(Runtime& rt, const TextTrainConfig& cfg) {
  refuse_sequence_parallel(cfg);
  validate(cfg, rt.world_size());
  const int rank = rt.rank();
  torch::manual_seed(cfg.seed);
  std::unique_ptr<Manifest> manifest;
  if (!cfg.checkpoint.empty()) manifest = std::make_unique<Manifest>(read_manifest(cfg.checkpoint));
  if (!manifest && !cfg.from_scratch) {
    throw std::invalid_argument(
        "finetune needs --checkpoint DIR (from tandem pretrain), or --from-scratch with --tokenizer FILE");
  }
  std::string tok_path = cfg.tokenizer_path;
  if (tok_path.empty()) {
    if (!manifest) throw std::invalid_argument("--from-scratch without --checkpoint needs --tokenizer FILE");
    tok_path = (fs::path(cfg.checkpoint) / manifest->tokenizer_file).string();
  }
  auto tok = load_checked_tokenizer(cfg, manifest.get(), tok_path);
  auto corpus = read_corpus(cfg.corpus);
  if (manifest && manifest->task == cfg.corpus.task && manifest->labels != corpus.labels) {
    throw std::runtime_error("the labels of '" + cfg.corpus.root + "' {" + join(corpus.labels) +
                             "} differ from those of checkpoint '" + cfg.checkpoint + "' {" + join(manifest->labels) +
                             "}; fine-tune on data with the checkpoint's labels, or pre-train on this data");
  }
  ModelShape shape = manifest ? manifest->shape : cfg.shape;
  shape.vocab = tok.vocab_size();
  const int64_t k = static_cast<int64_t>(corpus.labels.size());
  if (k < 2)
    throw std::runtime_error("'" + cfg.corpus.root + "' has one label only (" + corpus.labels[0] +
                             "); classification needs two or more");

  auto encode = [&](const std::vector<Document>& docs) {
    auto e = tok.encode_batch(texts_of(docs), shape.seq);
    std::vector<int64_t> y;
    y.reserve(docs.size());
    for (const auto& d : docs) y.push_back(corpus.label_index(d.label));
    return std::make_pair(e.ids, torch::tensor(y, torch::kLong));
  };
  auto [train_x, train_y] = encode(corpus.train);
  auto [test_x, test_y] = encode(corpus.test);

  auto net = models::transformer(model_config(shape, k));
  TextReport rep;
  rep.command = "finetune";
  rep.shape = shape;
  if (manifest && !cfg.from_scratch) {
    // Every parameter but the classifier head (the last child) from the checkpoint.
    const auto weights = (fs::path(cfg.checkpoint) / "model.pt").string();
    torch::serialize::InputArchive ar;
    try {
      ar.load_from(weights);
    } catch (const std::exception& e) {
      throw std::runtime_error("cannot read the weights '" + weights + "': " + std::string(e.what()).substr(0, 200));
    }
    const std::string head = std::to_string(net->size() - 1) + ".";
    torch::NoGradGuard ng;
    for (auto& p : net->named_parameters()) {
      if (p.key().rfind(head, 0) == 0 && manifest->kind == "pretrain") continue;
      torch::Tensor t;
      if (!ar.try_read(p.key(), t)) {
        throw std::runtime_error("checkpoint '" + cfg.checkpoint + "' has no parameter '" + p.key() + "'");
      }
      if (t.sizes() != p.value().sizes()) {
        std::ostringstream os;
        os << "checkpoint parameter '" << p.key() << "' has shape " << t.sizes() << ", the model needs "
           << p.value().sizes();
        throw std::runtime_error(os.str());
      }
      p.value().copy_(t);
    }
    rep.initialised_from_checkpoint = true;
  }
  auto engine = make_engine(rt, cfg, net, train_x, transformer_options());
  Engine& eng = *engine;
  describe_run(eng, cfg, corpus, rep);
  const auto device = rt.device();
  auto run = run_record("finetune", cfg, tok);
  run["labels"] = corpus.labels;
  LoopCheckpoints checkpoints(eng, cfg, "text", run, {"command", "tokenizer", "labels", "seed"});
  tensorboard::Log tb(cfg.tensorboard, rank == 0);
  LoopHooks hooks = checkpoints.start();
  hooks.tensorboard = &tb;
  const EngineStats loop = train_loop(
      rt, cfg, eng, train_x.size(0),
      [&](const std::vector<int64_t>& idx, int64_t from, int64_t to) {
        return std::make_pair(rows(train_x, idx, from, to).to(device), rows(train_y, idx, from, to).to(device));
      },
      [](const torch::Tensor& out, const torch::Tensor& y) {
        return torch::nn::functional::cross_entropy(out.to(torch::kFloat), y,
                                                    torch::nn::functional::CrossEntropyFuncOptions().reduction(
                                                        torch::kSum));
      },
      [](const std::vector<int64_t>&, int64_t from, int64_t to) { return static_cast<double>(to - from); }, rep, hooks);
  checkpoints.finish();
  if (rep.stopped) {  // relaunched from the checkpoint: neither evaluation nor --out yet
    finish_report(eng, loop, cfg, rep, tb);
    return rep;
  }
  if (cfg.evaluate) {
    const int64_t n = cfg.eval_limit >= 0 ? std::min<int64_t>(cfg.eval_limit, test_x.size(0)) : test_x.size(0);
    auto conf = torch::zeros({k, k}, torch::kLong);
    eng.evaluate(test_x, n, 256, [&](const torch::Tensor& out, int64_t from, int64_t to) {
      auto pred = out.argmax(1).cpu();
      auto y = test_y.narrow(0, from, to - from);
      conf.view({-1}).index_add_(0, y * k + pred, torch::ones_like(y));
    });
    auto c = conf.to(device);
    rt.world()->allreduce(c, ReduceOp::kSum);
    conf = c.cpu();
    rep.confusion.assign(k, std::vector<int64_t>(k, 0));
    int64_t correct = 0, total = 0;
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        rep.confusion[i][j] = conf[i][j].item<int64_t>();
        total += rep.confusion[i][j];
        if (i == j) correct += rep.confusion[i][j];
      }
    }
    rep.test_samples = total;
    rep.test_unit = "documents";
    rep.test_accuracy = total > 0 ? static_cast<double>(correct) / total : 0.0;
    rep.evaluation_detail = confusion_table(rep.labels, rep.confusion);
  }
  auto params = cfg.output.empty() ? std::map<std::string, torch::Tensor>{} : eng.full_parameters();
  finish_report(eng, loop, cfg, rep, tb);
  if (rank == 0 && !cfg.output.empty()) {
    fs::create_directories(cfg.output);
    tok.save((fs::path(cfg.output) / "tokenizer.model").string());
    save_model(cfg.output, "finetune", params, shape, cfg, cfg.corpus.task, corpus.labels, tok);
  }
  return rep;
}

}  // namespace tandem::text
