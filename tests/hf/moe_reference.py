"""Reference side of tests/unit/test_moe.cpp, run in .venv-hf: two of transformers'
MixtralSparseMoeBlock in float32 (h = x + block0(x), y = h + block1(h)) and the gradients of
sum(y * gy) + coef * load_balancing_loss_func(router logits of both layers), as
MixtralForCausalLM(output_router_logits=True) adds it.

  moe_reference.py make FILE   writes FILE (safetensors): "x", "gy", "y", "aux", "grad.x"; each
                               block's weights under Mixtral's checkpoint names
                               ("layers.<l>.gate.weight", "layers.<l>.experts.<e>.w1.weight", w2,
                               w3) and their gradients under "grad." + the name
"""
import sys

import torch
from safetensors.torch import save_file
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

HIDDEN, INTER, EXPERTS, TOP_K, COEF = 16, 24, 4, 2, 0.3


def checkpoint_names(layer, block):
    """Mixtral's per-expert names for transformers' stacked expert weights (w1 gate, w3 up, w2 down)."""
    out = {f"layers.{layer}.gate.weight": block.gate.weight}
    for e in range(EXPERTS):
        gate_up = block.experts.gate_up_proj[e]
        out[f"layers.{layer}.experts.{e}.w1.weight"] = gate_up[:INTER]
        out[f"layers.{layer}.experts.{e}.w3.weight"] = gate_up[INTER:]
        out[f"layers.{layer}.experts.{e}.w2.weight"] = block.experts.down_proj[e]
    return out


def make(path):
    torch.manual_seed(3)
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, router_jitter_noise=0.0, router_aux_loss_coef=COEF)
    config._experts_implementation = "eager"  # the reference loop over experts
    blocks = [MixtralSparseMoeBlock(config).float() for _ in range(2)]
    for b in blocks:
        for p in b.parameters():
            torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, HIDDEN, requires_grad=True)
    gy = torch.randn(2, 5, HIDDEN)
    h = x + blocks[0](x)
    y = h + blocks[1](h)
    logits = tuple(torch.nn.functional.linear(t.reshape(-1, HIDDEN), b.gate.weight) for t, b in zip((x, h), blocks))
    aux = load_balancing_loss_func(logits, EXPERTS, TOP_K)
    ((y * gy).sum() + COEF * aux).backward()
    out = {"x": x.detach(), "gy": gy, "y": y.detach(), "aux": aux.detach().reshape(1), "grad.x": x.grad}
    for layer, b in enumerate(blocks):
        out.update({k: v.detach() for k, v in checkpoint_names(layer, b).items()})
        grads = {"gate.weight": b.gate.weight.grad}
        for e in range(EXPERTS):
            grads[f"experts.{e}.w1.weight"] = b.experts.gate_up_proj.grad[e][:INTER]
            grads[f"experts.{e}.w3.weight"] = b.experts.gate_up_proj.grad[e][INTER:]
            grads[f"experts.{e}.w2.weight"] = b.experts.down_proj.grad[e]
        out.update({f"grad.layers.{layer}.{k}": v for k, v in grads.items()})
    save_file({k: v.contiguous() for k, v in out.items()}, path)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "make":
        sys.exit(__doc__)
    make(sys.argv[2])
