# Sourced by bench scripts with $src, $py and $work set: random_llama DIR HIDDEN MLP LAYERS HEADS
# POSITIONS makes a random Llama (transformers, in .venv-hf; the fixture's 800-piece SentencePiece
# vocabulary and tokenizer files) in DIR.
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
random_llama() {
  [ -d "$work/fx" ] || "$py" "$src/tests/hf/hf_fixture.py" make "$work/fx" >/dev/null
  "$py" - "$work" "$@" <<'PY'
import os, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
work, out = sys.argv[1], sys.argv[2]
hidden, mlp, layers, heads, positions = (int(a) for a in sys.argv[3:8])
torch.manual_seed(0)
c = LlamaConfig(vocab_size=800, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=positions,
                bos_token_id=1, eos_token_id=2)
LlamaForCausalLM(c).save_pretrained(out)
for f in os.listdir(f"{work}/fx/lm"):
    if f.startswith("tokenizer") or f.endswith(".model") or f == "special_tokens_map.json":
        os.system(f"cp {work}/fx/lm/{f} {out}/")
PY
}
