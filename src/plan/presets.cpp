// Built-in descriptions for `tandem plan`: Tandem's reference models counted analytically, published
// models, devices, links and whole clusters. Figures and their sources: docs/drafts/plan.md.
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <stdexcept>
#include <thread>

#include "tandem/plan.h"

namespace tandem::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// A dense (non-transformer) model: parameters, forward FLOPs and stored activations per sample.
ModelSpec dense(const std::string& name, double params, double fwd_flops, double act_bytes, int64_t layers,
                int64_t widest) {
  ModelSpec m;
  m.name = name;
  m.kind = "dense";
  m.parameters = params;
  m.forward_flops_per_sample = fwd_flops;
  m.activation_bytes_per_sample = act_bytes;
  m.layers = layers;
  m.hidden = widest;
  m.heads = 0;
  m.seq = 1;
  return m;
}

LayerSpec layer(const std::string& name, double params, double flops, double in, double out,
                const std::string& tp = "") {
  LayerSpec l;
  l.name = name;
  l.parameters = params;
  l.forward_flops = flops;
  l.input_elems = in;
  l.output_elems = out;
  l.tp = tp;
  return l;
}

}  // namespace

ModelSpec transformer_model(int64_t layers, int64_t hidden, int64_t heads, int64_t seq, int64_t vocab,
                            double parameters) {
  ModelSpec m;
  m.name = "transformer";
  m.kind = "transformer";
  m.layers = layers;
  m.hidden = hidden;
  m.heads = heads;
  m.seq = seq;
  m.vocab = vocab;
  const double h = static_cast<double>(hidden);
  m.parameters = parameters > 0 ? parameters : 12.0 * layers * h * h + static_cast<double>(vocab + seq) * h;
  return m;
}

ModelSpec llama_model(int64_t layers, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t intermediate,
                      int64_t seq, int64_t vocab, double parameters) {
  auto m = transformer_model(layers, hidden, heads, seq, vocab, parameters);
  m.name = "llama";
  m.kv_heads = kv_heads;
  // What autograd keeps of Tandem's Llama layers per token, in fp32 elements: the two RMSNorms'
  // inputs and outputs (4h); q, its rotate_half and the rotated q (3h); k likewise, or with
  // grouped heads k and its rotate_half (2 h_kv) and the repeated k and v (2h) in place of the
  // rotated k and v (so 2 h_kv + 2h either way with h_kv = h); attention's output and the output
  // projection's input (2h); SwiGLU's gate, its activation, up and their product (4i). Then the
  // final norm (2h) and the log-softmax over the vocabulary. Fused attention keeps no scores.
  const double h = static_cast<double>(hidden), kv = static_cast<double>(hidden) * kv_heads / heads;
  const double per_layer = 11 * h + 2 * kv + 4 * static_cast<double>(intermediate);
  m.activation_bytes_per_sample = 4.0 * static_cast<double>(seq) * (layers * per_layer + 2 * h + vocab);
  return m;
}

ModelSpec mixtral_model(int64_t layers, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t intermediate,
                        int64_t experts, int64_t top_k, int64_t seq, int64_t vocab) {
  if (heads < 1 || kv_heads < 1)
    throw std::invalid_argument("a Mixtral model needs attention and key/value heads, got " + std::to_string(heads) +
                                " and " + std::to_string(kv_heads));
  // Per block: q and o (h x h), k and v (h x h_kv), the router (h x experts), the experts (w1,
  // w3: h x i; w2: i x h) and two RMSNorms; then untied embedding and LM head and the final norm.
  const double h = static_cast<double>(hidden), kv = h * static_cast<double>(kv_heads) / static_cast<double>(heads);
  const double e = static_cast<double>(experts), i = static_cast<double>(intermediate);
  const double block = 2 * h * h + 2 * h * kv + h * e + e * 3 * h * i + 2 * h;
  const double params = static_cast<double>(layers) * block + 2.0 * static_cast<double>(vocab) * h + h;
  // Llama's attention and norms; the MoE blocks' activations are counted from `moe`
  // (activation_bytes_per_sample), so that the capacity factor can change them.
  ModelSpec m = llama_model(layers, hidden, heads, kv_heads, 0, seq, vocab, params);
  m.name = "mixtral";
  m.moe.experts = experts;
  m.moe.top_k = top_k;
  m.moe.intermediate = intermediate;
  return m;
}

ModelSpec hf_config_model(const std::string& config_json, int64_t seq) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(config_json);
  } catch (const std::exception& e) {
    throw std::invalid_argument(std::string("config.json is not valid JSON: ") + e.what());
  }
  auto need = [&](const char* key) {
    if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() < 1)
      throw std::invalid_argument(std::string("config.json: '") + key + "' missing or not a positive integer");
    return j[key].get<int64_t>();
  };
  const std::string type = j.value("model_type", std::string());
  if (type != "llama" && type != "mixtral")
    throw std::invalid_argument("config.json: model_type '" + type +
                                "' is not one tandem plan reads (llama, mixtral); describe it with --params/--layers/"
                                "--hidden/--heads/--seq");
  const int64_t layers = need("num_hidden_layers"), hidden = need("hidden_size"), heads = need("num_attention_heads");
  const int64_t kv = j.contains("num_key_value_heads") ? need("num_key_value_heads") : heads;
  const int64_t inter = need("intermediate_size"), vocab = need("vocab_size");
  const int64_t positions = j.contains("max_position_embeddings") ? need("max_position_embeddings") : 4096;
  if (seq <= 0) seq = std::min<int64_t>(4096, positions);
  const bool tied = j.value("tie_word_embeddings", false);
  ModelSpec m;
  if (type == "mixtral") {
    m = mixtral_model(layers, hidden, heads, kv, inter, need("num_local_experts"), need("num_experts_per_tok"), seq,
                      vocab);
  } else {
    // Per block q, o (h x h), k, v (h x h_kv), SwiGLU (3 h i), two norms; embedding, LM head, final norm.
    const double h = static_cast<double>(hidden), kvw = h * static_cast<double>(kv) / static_cast<double>(heads);
    const double block = 2 * h * h + 2 * h * kvw + 3 * h * static_cast<double>(inter) + 2 * h;
    const double params = static_cast<double>(layers) * block + 2.0 * static_cast<double>(vocab) * h + h;
    m = llama_model(layers, hidden, heads, kv, inter, seq, vocab, params);
  }
  if (tied) m.parameters -= static_cast<double>(vocab) * static_cast<double>(hidden);
  m.name = j.value("_name_or_path", std::string()).empty() ? type : j["_name_or_path"].get<std::string>();
  return m;
}

std::vector<std::string> builtin_model_names() {
  return {"mlp",       "cnn",       "cnn_bn",   "transformer_tiny", "resnet50",  "resnet101",    "vgg16",   "gpt2",
          "gpt3-1.3b", "zero-7.5b", "llama-7b", "llama-13b",        "llama-70b", "mixtral-8x7b", "moe_tiny"};
}

ModelSpec builtin_model(const std::string& name) {
  // Tandem's reference models (models/*.cpp), counted layer by layer.
  if (name == "mlp") {
    // Flatten, 784-1024 ReLU, 1024-1024 ReLU, 1024-10.
    const double w[] = {784, 1024, 1024, 10};
    double params = 0, flops = 0;
    std::vector<LayerSpec> kids = {layer("flatten", 0, 0, 784, 784)};
    for (int i = 0; i < 3; ++i) {
      params += w[i] * w[i + 1] + w[i + 1];
      flops += 2 * w[i] * w[i + 1];
      // tensor_parallel() pairs the first two Linears (column, row); the head stays replicated.
      kids.push_back(layer("linear", w[i] * w[i + 1] + w[i + 1], 2 * w[i] * w[i + 1], w[i], w[i + 1],
                           i == 0   ? "column"
                           : i == 1 ? "row"
                                    : ""));
      if (i < 2) kids.push_back(layer("relu", 0, 0, w[i + 1], w[i + 1]));
    }
    // Kept for backward (float32): the input, each linear output and each ReLU output, logits.
    double act = (784 + 2 * 1024 + 2 * 1024 + 10) * 4.0;
    ModelSpec m = dense("mlp", params, flops, act, 3, 1024);
    m.children = kids;
    return m;
  }
  if (name == "cnn" || name == "cnn_bn") {
    const bool bn = name == "cnn_bn";
    double params = (1 * 32 * 9 + 32) + (32 * 64 * 9 + 64) + (3136 * 128 + 128) + (128 * 10 + 10);
    if (bn) params += 2 * 32 + 2 * 64;
    double flops = 2.0 * 28 * 28 * 32 * 9 * 1 + 2.0 * 14 * 14 * 64 * 9 * 32 + 2.0 * 3136 * 128 + 2.0 * 128 * 10;
    // input, conv1 out, relu1, pool1 (+indices), conv2 out, relu2, pool2 (+indices), fc1, relu, logits
    double act = 784 + 2 * 25088.0 + 2 * 6272 + 2 * 12544.0 + 2 * 3136 + 2 * 128 + 10;
    if (bn) act += 25088 + 12544;
    ModelSpec m = dense(name, params, flops, act * 4.0, 4, 3136);
    // models/cnn.cpp, child by child; tensor_parallel() pairs the two Linears.
    m.children.push_back(layer("conv", 1 * 32 * 9 + 32, 2.0 * 28 * 28 * 32 * 9, 784, 25088));
    if (bn) m.children.push_back(layer("batchnorm", 64, 0, 25088, 25088));
    m.children.push_back(layer("relu", 0, 0, 25088, 25088));
    m.children.push_back(layer("pool", 0, 0, 25088, 6272));
    m.children.push_back(layer("conv", 32 * 64 * 9 + 64, 2.0 * 14 * 14 * 64 * 9 * 32, 6272, 12544));
    if (bn) m.children.push_back(layer("batchnorm", 128, 0, 12544, 12544));
    m.children.push_back(layer("relu", 0, 0, 12544, 12544));
    m.children.push_back(layer("pool", 0, 0, 12544, 3136));
    m.children.push_back(layer("flatten", 0, 0, 3136, 3136));
    m.children.push_back(layer("linear", 3136 * 128 + 128, 2.0 * 3136 * 128, 3136, 128, "column"));
    m.children.push_back(layer("relu", 0, 0, 128, 128));
    m.children.push_back(layer("linear", 128 * 10 + 10, 2.0 * 128 * 10, 128, 10, "row"));
    return m;
  }
  if (name == "transformer_tiny") {
    // vocab 256, d_model 64, 4 heads, 2 layers, seq 64, MLP 4x, LM head (models/transformer.cpp).
    const double v = 256, d = 64, L = 2, T = 64;
    double block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d);
    double params = v * d + T * d + L * block + 2 * d + (d * v + v);
    ModelSpec m = transformer_model(2, 64, 4, 64, 256, params);
    m.name = "transformer_tiny";
    // 2 FLOPs per weight per token (plus the LM head) and causal attention 4*T^2*d per layer.
    m.forward_flops_per_sample = 2.0 * (L * (12 * d * d) + d * v) * T + 4.0 * L * T * T * d;
    // float32 training: twice the 16-bit figure of the Korthikanti et al. formula, without
    // dropout masks or attention scores (no dropout; fused attention).
    m.activation_bytes_per_sample = 2.0 * L * T * d * 32;
    return m;
  }
  // Published models. ResNets and VGG: He et al. 2016 table 1 (multiply-adds: x2 for FLOPs);
  // activation bytes per image (float32) estimated from the feature-map sizes.
  if (name == "resnet50") return dense("resnet50", 25.6e6, 2 * 3.8e9, 100e6, 16, 2048);
  if (name == "resnet101") return dense("resnet101", 44.5e6, 2 * 7.6e9, 150e6, 33, 2048);
  if (name == "vgg16") return dense("vgg16", 138.4e6, 2 * 15.5e9, 60e6, 16, 4096);
  // Transformers: shapes from the GPT-2, GPT-3 (XL), ZeRO (7.5B example) and LLaMA papers.
  ModelSpec m;
  if (name == "gpt2") {
    m = transformer_model(12, 768, 12, 1024, 50257, 124e6);
  } else if (name == "gpt3-1.3b") {
    m = transformer_model(24, 2048, 16, 2048, 50257, 1.3e9);
  } else if (name == "zero-7.5b") {
    m = transformer_model(36, 4096, 32, 1024, 50257, 7.5e9);
  } else if (name == "llama-7b") {
    m = transformer_model(32, 4096, 32, 4096, 32000, 6.74e9);
  } else if (name == "llama-13b") {
    m = transformer_model(40, 5120, 40, 4096, 32000, 13.0e9);
  } else if (name == "llama-70b") {
    m = transformer_model(80, 8192, 64, 4096, 32000, 69.0e9);
    m.kv_heads = 8;  // grouped-query attention
  } else if (name == "mixtral-8x7b") {
    // Mixtral 8x7B (Jiang et al. 2024; its config.json): 46.7 B parameters, 12.9 B active per token.
    m = mixtral_model(32, 4096, 32, 8, 14336, 8, 2, 4096, 32000);
  } else if (name == "moe_tiny") {
    // The Mixtral-shaped model bench/moe.sh trains: 13.9 M parameters.
    m = mixtral_model(4, 256, 8, 4, 512, 8, 2, 128, 1000);
  } else {
    throw std::invalid_argument("unknown model '" + name + "'; built-in models: " + join(builtin_model_names()) +
                                " (or describe one with --params/--layers/--hidden/--heads/--seq)");
  }
  m.name = name;
  return m;
}

std::vector<std::string> device_preset_names() {
  return {"p100", "p100-sxm2", "v100", "a100-40g", "a100", "a100-80g", "h100", "h200", "cpu"};
}

DeviceSpec device_preset(const std::string& name) {
  // Vendor datasheets: memory, dense peak FLOP/s (16-bit tensor cores; FP32 for Pascal), HBM bandwidth.
  DeviceSpec d;
  d.name = name;
  if (name == "p100") {  // Tesla P100 PCIe 16 GB: 9.3 TFLOP/s fp32, 18.7 fp16, 732 GB/s
    d.memory_bytes = 16 * kGiB;
    d.flops_fp32 = 9.3e12;
    d.flops = 18.7e12;
    d.memory_bandwidth = 732e9;
    d.mfu = 0.5;
  } else if (name == "p100-sxm2") {  // Tesla P100 SXM2: 10.6 fp32, 21.2 fp16, 732 GB/s
    d.memory_bytes = 16 * kGiB;
    d.flops_fp32 = 10.6e12;
    d.flops = 21.2e12;
    d.memory_bandwidth = 732e9;
    d.mfu = 0.5;
  } else if (name == "v100") {  // V100 SXM2 32 GB: 15.7 fp32, 125 tensor, 900 GB/s
    d.memory_bytes = 32 * kGiB;
    d.flops_fp32 = 15.7e12;
    d.flops = 125e12;
    d.memory_bandwidth = 900e9;
  } else if (name == "a100-40g") {  // A100 SXM4: 19.5 fp32, 312 bf16 dense
    d.memory_bytes = 40 * kGiB;
    d.flops_fp32 = 19.5e12;
    d.flops = 312e12;
    d.memory_bandwidth = 1555e9;
  } else if (name == "a100" || name == "a100-80g") {
    d.name = "a100-80g";
    d.memory_bytes = 80 * kGiB;
    d.flops_fp32 = 19.5e12;
    d.flops = 312e12;
    d.memory_bandwidth = 2039e9;
  } else if (name == "h100") {  // H100 SXM5 80 GB: 67 fp32, 989 bf16 dense, 3.35 TB/s
    d.memory_bytes = 80 * kGiB;
    d.flops_fp32 = 67e12;
    d.flops = 989e12;
    d.memory_bandwidth = 3.35e12;
  } else if (name == "h200") {  // H200 SXM 141 GB (143771 MiB): same compute as H100, 4.8 TB/s
    d.memory_bytes = 143771 * kMiB;
    d.flops_fp32 = 67e12;
    d.flops = 989e12;
    d.memory_bandwidth = 4.8e12;
  } else if (name == "cpu") {  // one core of this machine; `--calibrate` replaces the rates
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    d.memory_bytes = pages > 0 && page > 0 ? static_cast<double>(pages) * page / cores : 4 * kGiB;
    d.flops_fp32 = 50e9;
    d.flops = 50e9;
    d.memory_bandwidth = 10e9;
    d.mfu = 1.0;
  } else {
    throw std::invalid_argument("unknown device '" + name + "'; presets: " + join(device_preset_names()));
  }
  return d;
}

std::vector<std::string> link_preset_names() {
  return {"nvlink1",  "nvlink3", "nvlink4",  "pcie3",  "pcie4",  "pcie5",     "shm",      "eth-10g",
          "roce-25g", "eth-50g", "eth-100g", "ib-hdr", "ib-ndr", "ib-hdr-8x", "ib-ndr-8x"};
}

LinkSpec link_preset(const std::string& name) {
  // Bandwidth one direction: per device for intra-node links, per node for network links.
  LinkSpec l;
  l.name = name;
  if (name == "nvlink1") {
    l.bandwidth = 80e9;
    l.latency = 5e-6;
  }  // P100: 4 links x 20 GB/s
  else if (name == "nvlink3") {
    l.bandwidth = 300e9;
    l.latency = 5e-6;
  }  // A100: 12 links x 25 GB/s
  else if (name == "nvlink4") {
    l.bandwidth = 450e9;
    l.latency = 5e-6;
  }  // H100/H200: 18 x 25 GB/s
  else if (name == "pcie3") {
    l.bandwidth = 12e9;
    l.latency = 10e-6;
  }  // x16, ~12 GB/s achieved
  else if (name == "pcie4") {
    l.bandwidth = 24e9;
    l.latency = 10e-6;
  } else if (name == "pcie5") {
    l.bandwidth = 48e9;
    l.latency = 10e-6;
  } else if (name == "shm") {
    l.bandwidth = 3e9;
    l.latency = 20e-6;
  }  // MPI over shared memory (CPU)
  else if (name == "eth-10g") {
    l.bandwidth = 1.25e9;
    l.latency = 50e-6;
  } else if (name == "roce-25g") {
    l.bandwidth = 3.125e9;
    l.latency = 10e-6;
  } else if (name == "eth-50g") {
    l.bandwidth = 6.25e9;
    l.latency = 30e-6;
  } else if (name == "eth-100g") {
    l.bandwidth = 12.5e9;
    l.latency = 30e-6;
  } else if (name == "ib-hdr") {
    l.bandwidth = 25e9;
    l.latency = 5e-6;
  }  // one 200 Gb/s port
  else if (name == "ib-ndr") {
    l.bandwidth = 50e9;
    l.latency = 5e-6;
  }  // one 400 Gb/s port
  else if (name == "ib-hdr-8x") {
    l.bandwidth = 200e9;
    l.latency = 5e-6;
  }  // DGX A100: 8 ports
  else if (name == "ib-ndr-8x") {
    l.bandwidth = 400e9;
    l.latency = 5e-6;
  }  // DGX H100: 8 ports
  else {
    throw std::invalid_argument("unknown link '" + name + "'; presets: " + join(link_preset_names()));
  }
  return l;
}

std::vector<std::string> cluster_preset_names() {
  return {"local",   "h200x1",   "h200x8", "h200-ib",         "h100x8",       "h100-ib",   "a100x8",
          "a100-ib", "a100-eth", "v100x8", "mixed-a100-h100", "horovod-p100", "goyal-p100"};
}

ClusterSpec cluster_preset(const std::string& name) {
  auto make = [&](int nodes, int per_node, const std::string& dev, const std::string& intra, const std::string& inter) {
    ClusterSpec c;
    c.name = name;
    c.groups.push_back({nodes, per_node, device_preset(dev)});
    c.intra = link_preset(intra);
    c.inter = link_preset(inter);
    return c;
  };
  if (name == "local") {
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    ClusterSpec c = make(1, static_cast<int>(cores), "cpu", "shm", "eth-10g");
    c.cpu = true;
    c.overlap = 0.0;  // measured: DDP hides 6-11 % of its all-reduce on these shared cores
    return c;
  }
  if (name == "h200x1") return make(1, 1, "h200", "nvlink4", "ib-ndr-8x");
  if (name == "h200x8") return make(1, 8, "h200", "nvlink4", "ib-ndr-8x");
  if (name == "h200-ib") return make(4, 8, "h200", "nvlink4", "ib-ndr-8x");
  if (name == "h100x8") return make(1, 8, "h100", "nvlink4", "ib-ndr-8x");
  if (name == "h100-ib") return make(4, 8, "h100", "nvlink4", "ib-ndr-8x");
  if (name == "a100x8") return make(1, 8, "a100-80g", "nvlink3", "ib-hdr-8x");
  if (name == "a100-ib") return make(4, 8, "a100-80g", "nvlink3", "ib-hdr-8x");
  if (name == "a100-eth") return make(4, 8, "a100-80g", "nvlink3", "eth-100g");
  if (name == "v100x8") return make(1, 8, "v100", "nvlink1", "eth-100g");
  if (name == "mixed-a100-h100") {
    ClusterSpec c = make(2, 8, "h100", "nvlink3", "ib-hdr-8x");
    c.groups.push_back({2, 8, device_preset("a100-80g")});
    return c;
  }
  // Horovod (Sergeev & Del Balso 2018; horovod docs/benchmarks): 128 servers x 4 Pascal GPUs,
  // RoCE-capable 25 Gbit/s network; GPUs on PCIe.
  if (name == "horovod-p100") return make(128, 4, "p100", "pcie3", "roce-25g");
  // Goyal et al. 2017 sec. 5: Big Basin servers, 8 P100 (SXM2) on NVLink, 50 Gbit Ethernet; up to 32 servers.
  if (name == "goyal-p100") return make(32, 8, "p100-sxm2", "nvlink1", "eth-50g");
  throw std::invalid_argument("unknown cluster '" + name + "'; presets: " + join(cluster_preset_names()) +
                              " (or describe one with --device/--nodes/--devices-per-node/--intra/--inter)");
}

}  // namespace tandem::plan
