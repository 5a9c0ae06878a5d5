"""Reference side of tests/unit/test_mixtral.cpp, run in .venv-hf: a tiny random Mixtral built
with transformers, and what transformers computes for it.

  mixtral_reference.py make DIR    a random MixtralForCausalLM (2 layers, 8 experts, top-2, router
                                   aux coefficient 0.02) saved with save_pretrained in DIR/mixtral/,
                                   and DIR/mixtral-ref.safetensors holding token ids ("ids"), the
                                   logits ("logits"), the loss of MixtralForCausalLM(ids,
                                   labels=ids, output_router_logits=True) ("loss": the language-model
                                   loss plus the coefficient times the load-balancing loss),
                                   the language-model loss alone ("lm_loss"), the load-balancing
                                   loss pooled over the layers as transformers computes it
                                   ("aux_loss") and the mean of each layer's own ("aux_per_layer")
  mixtral_reference.py check DIR   loads Tandem's save_pretrained output DIR/cc-mixtral/ with
                                   AutoModelForCausalLM, checks it is a MixtralForCausalLM of the
                                   same configuration, and compares its logits and loss on the same
                                   ids with Tandem's (DIR/cc-mixtral-logits.safetensors, "logits")
                                   and the reference's; prints the differences, exit 1 above 1e-5
"""
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

EXPERTS, TOP_K, COEF = 8, 2, 0.02


def config():
    return MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, rope_theta=5000.0, num_local_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, router_aux_loss_coef=COEF, initializer_range=0.1)


def ids():
    g = torch.Generator().manual_seed(5)
    return torch.randint(1, 300, (3, 13), generator=g)


def losses(model, x):
    with torch.no_grad():
        out = model(x, labels=x, output_router_logits=True)
        lm = model(x, labels=x).loss
    per_layer = sum(load_balancing_loss_func((g,), EXPERTS, TOP_K) for g in out.router_logits) / len(out.router_logits)
    return out, lm, per_layer


def make(d):
    torch.manual_seed(0)
    model = MixtralForCausalLM(config()).eval()
    with torch.no_grad():  # norm weights away from 1, so that loading them is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(os.path.join(d, "mixtral"))
    x = ids()
    out, lm, per_layer = losses(model, x)
    save_file({"ids": x, "logits": out.logits.contiguous(), "loss": out.loss.reshape(1), "lm_loss": lm.reshape(1),
               "aux_loss": out.aux_loss.reshape(1), "aux_per_layer": per_layer.reshape(1)},
              os.path.join(d, "mixtral-ref.safetensors"))
    return 0


def check(d):
    model = AutoModelForCausalLM.from_pretrained(os.path.join(d, "cc-mixtral")).eval()
    c = model.config
    ok = (type(model).__name__ == "MixtralForCausalLM" and c.num_local_experts == EXPERTS
          and c.num_experts_per_tok == TOP_K and abs(c.router_aux_loss_coef - COEF) < 1e-12)
    if not ok:
        print("not the reference's Mixtral:", type(model).__name__, c)
    ref = load_file(os.path.join(d, "mixtral-ref.safetensors"))
    theirs = load_file(os.path.join(d, "cc-mixtral-logits.safetensors"))["logits"]
    out, _, _ = losses(model, ref["ids"])
    diff = (out.logits - theirs).abs().max().item()
    rel = abs(out.loss.item() - ref["loss"].item()) / ref["loss"].item()
    print(f"mixtral: transformers vs Tandem on Tandem's checkpoint, max |diff| {diff:.3g}; loss relative {rel:.2g}")
    return 0 if ok and diff <= 1e-5 and rel <= 1e-5 else 1


if __name__ == "__main__":
    mode, d = sys.argv[1], sys.argv[2]
    sys.exit(make(d) if mode == "make" else check(d))
