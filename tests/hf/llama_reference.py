"""Reference side of tests/unit/test_llama.cpp, run in .venv-hf: tiny random Llama models built
with transformers, and the logits transformers computes for them.

  llama_reference.py make DIR    for each variant (lm: untied embeddings, saved in shards;
                                 lm_tied; cls: a sequence classifier), a random model saved with
                                 save_pretrained in DIR/<variant>/, and DIR/<variant>-ref.safetensors holding the
                                 token ids ("ids") and transformers' logits for them ("logits"); for lm
                                 also DIR/lm-ref-bf16.safetensors, the logits of the model cast to bf16
  llama_reference.py check DIR   loads Tandem's save_pretrained output DIR/cc-<variant>/ with
                                 transformers and compares its logits on the same ids with those
                                 Tandem computed (DIR/cc-<variant>-logits.safetensors, "logits");
                                 prints the largest difference, exit 1 above 1e-5
"""
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

VARIANTS = {"lm": (LlamaForCausalLM, False), "lm_tied": (LlamaForCausalLM, True), "cls": (LlamaForSequenceClassification, False)}
PAD = 0


def config(tied):
    return LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=tied, initializer_range=0.1,
                       pad_token_id=PAD, num_labels=3)


def ids():
    g = torch.Generator().manual_seed(5)
    x = torch.randint(1, 300, (3, 13), generator=g)
    x[1, 9:] = PAD  # right padding: the classifier pools position 8 of this row
    x[2, 12:] = PAD
    return x


def make(d):
    for name, (cls, tied) in VARIANTS.items():
        torch.manual_seed(0)
        model = cls(config(tied)).eval()
        with torch.no_grad():  # norm weights away from 1, so that loading them is tested
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.uniform_(0.5, 1.5)
        # The untied LM in shards (model.safetensors.index.json), as large checkpoints come.
        model.save_pretrained(os.path.join(d, name), max_shard_size="100KB" if name == "lm" else "5GB")
        x = ids()
        with torch.no_grad():
            logits = model(x).logits
        save_file({"ids": x, "logits": logits.contiguous()}, os.path.join(d, name + "-ref.safetensors"))
        if name == "lm":  # transformers' own bf16 forward: how far bf16 puts the logits from fp32's
            with torch.no_grad():
                low = model.to(torch.bfloat16)(x).logits.float()
            save_file({"logits": low.contiguous()}, os.path.join(d, name + "-ref-bf16.safetensors"))
    return 0


def check(d):
    worst = 0.0
    for name, (cls, tied) in VARIANTS.items():
        auto = AutoModelForSequenceClassification if name == "cls" else AutoModelForCausalLM
        model = auto.from_pretrained(os.path.join(d, "cc-" + name)).eval()
        x = load_file(os.path.join(d, name + "-ref.safetensors"))["ids"]
        theirs = load_file(os.path.join(d, "cc-" + name + "-logits.safetensors"))["logits"]
        with torch.no_grad():
            mine = model(x).logits
        diff = (mine - theirs).abs().max().item()
        print(f"{name}: transformers vs Tandem on Tandem's checkpoint, max |diff| {diff:.3g}")
        worst = max(worst, diff)
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    mode, d = sys.argv[1], sys.argv[2]
    sys.exit(make(d) if mode == "make" else check(d))
