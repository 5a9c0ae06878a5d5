# Sourced by bench scripts with $src and $py set ($work too for random_llama): random_llama DIR
# HIDDEN MLP LAYERS HEADS POSITIONS makes a random Llama (transformers, in .venv-hf; the fixture's
# 800-piece SentencePiece vocabulary and tokenizer files) in DIR; fortune_batch makes a batch of
# texts for a model of that vocabulary.
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

# fortune_batch DIR BATCH SEQ: with the fixture made in DIR/fx, copies its tokenizer files into
# DIR/model and writes BATCH texts of at least SEQ + 12 pieces (fortune cookies, in file order,
# joined until long enough) to DIR/data.jsonl, and the ids Tandem trains on (BOS, the pieces, cut
# at SEQ) to DIR/ids.pt, so that transformers can be fed the same tokens.
fortune_batch() {
  "$py" - "$@" <<'PY'
import json, os, shutil, sys, torch
import sentencepiece as spm
work, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fx = os.path.join(work, "fx", "lm")
sp = spm.SentencePieceProcessor(model_file=os.path.join(fx, "tokenizer.model"))
for f in os.listdir(fx):
    if f.startswith("tokenizer") or f == "special_tokens_map.json":
        shutil.copy(os.path.join(fx, f), os.path.join(work, "model", f))
root, docs = "/usr/share/games/fortunes", []
for name in sorted(os.listdir(root)):
    p = os.path.join(root, name)
    if os.path.isfile(p) and not os.path.islink(p) and not name.endswith((".dat", ".u8")):
        docs += [d.strip() for d in open(p, encoding="utf-8", errors="replace").read().split("\n%\n") if d.strip()]
texts, cur = [], ""
for d in docs:
    cur = (cur + " " + d).strip()
    if len(sp.encode(cur)) >= seq + 12:
        texts.append(cur)
        cur = ""
    if len(texts) == batch:
        break
with open(os.path.join(work, "data.jsonl"), "w") as f:
    for t in texts:
        f.write(json.dumps({"text": t}) + "\n")
torch.save(torch.tensor([([1] + sp.encode(t))[:seq] for t in texts]), os.path.join(work, "ids.pt"))
PY
}
