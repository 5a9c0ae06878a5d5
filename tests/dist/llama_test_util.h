// The tiny Llama of the distributed tests: 32 wide, 2 layers, 4 query heads over 2 key/value
// heads (grouped-query attention), SwiGLU 40 wide.
#pragma once

#include <cstdint>

#include "tandem/llama.h"

namespace tandem::test {

inline llama::LlamaConfig tiny_llama_config(int64_t vocab, int64_t seq) {
  llama::LlamaConfig c;
  c.vocab_size = vocab;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = seq;
  return c;
}

}  // namespace tandem::test
