"""PEFT (LoRA) references for the adapter fine-tuning and export tests, run in .venv-hf (no hub
downloads; HF_HUB_OFFLINE=1). BASE is a transformers model directory (tests/hf/hf_fixture.py's
DIR/lm, DIR/cls, ...); ADAPTER a PEFT adapter directory (adapter_config.json and
adapter_model.safetensors). Everything runs in float32 on the CPU.

  peft_reference.py make-adapter BASE OUT --rank R --alpha A --targets q_proj,v_proj
                    [--task lm|classify] [--rslora] [--seed S]
      a LoRA adapter over BASE (LoraConfig with lora_dropout 0, task CAUSAL_LM or SEQ_CLS) whose
      lora_A and lora_B weights are all random normal (std 0.05, torch seed S, default 0): PEFT
      starts B at zero, and an adapter with B = 0 leaves the forward unchanged, so a test of it
      could not see a wrong one. Written with save_pretrained; prints the file's tensor names.

  peft_reference.py train BASE ADAPTER DATA.jsonl --seq 32 --steps 5 --lr 2e-3
                    [--weight-decay 0.01] [--task lm] --out LOSSES.json
      Tandem's `finetune --warmup-steps 0` on ADAPTER's weights (BASE frozen): every step one
      batch of all of DATA's {"text"} documents, encoded as Tandem encodes them (the tokenizer's
      ids, EOS appended when the tokenizer adds none, truncated to --seq, padding not predicted);
      the loss is the mean over predicted tokens; AdamW (betas 0.9, 0.999, eps 1e-8, decoupled
      weight decay on every trainable parameter), no clipping, lr at step k (from 0)
      lr * (0.1 + 0.9 * 0.5 * (1 + cos(pi * min(1, k / steps)))). Writes each step's loss (the
      one it computed, before its update) as a JSON list to LOSSES.json and the number of
      trainable parameters as {"trainable_parameters": N} to LOSSES.trainable.json; prints both.

  peft_reference.py check-adapter BASE ADAPTER REF.safetensors
      REF holds "ids" (int64 [B, T]) and "logits" (float32, Tandem's on those ids with the
      adapter); compares them with PEFT's logits. Prints the largest difference (and how far the
      adapter moves the logits from BASE's), exit 1 above 1e-4.

  peft_reference.py check-merged BASE ADAPTER MERGED_DIR
      PEFT's merge_and_unload() of ADAPTER into BASE vs MERGED_DIR (a merged export, loaded with
      from_pretrained): the same tensor names and shapes, every value within 1e-6. Prints the
      largest difference, exit 1 otherwise.

  peft_reference.py loss BASE [ADAPTER] DATA.jsonl --seq 32 [--task lm]
      the loss of one batch of all of DATA (encoded as for train) under BASE, or BASE with
      ADAPTER, printed as {"loss": L}: Tandem's exported adapter after k steps gives Tandem's
      loss at step k + 1.

ADAPTER's task_type (CAUSAL_LM or SEQ_CLS) chooses the transformers class. Loading is strict:
PEFT only warns about adapter tensors it does not find (and leaves those weights as it
initialised them), so every mode that reads an adapter also checks that the file's tensor names
are exactly those PEFT saves for that configuration and that their values arrived.
"""
import argparse
import json
import math
import os
import sys
import warnings

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

TASKS = {"lm": ("CAUSAL_LM", AutoModelForCausalLM), "classify": ("SEQ_CLS", AutoModelForSequenceClassification)}
TASK_OF_TYPE = {peft_type: task for task, (peft_type, _) in TASKS.items()}


def fail(message):
    raise SystemExit(f"peft_reference.py: {message}")


def load_base(base, task):
    return TASKS[task][1].from_pretrained(base, dtype=torch.float32)


def adapter_task(adapter):
    path = os.path.join(adapter, "adapter_config.json")
    if not os.path.isfile(path):
        fail(f"{path} not found")
    with open(path) as f:
        task_type = json.load(f).get("task_type")
    if task_type not in TASK_OF_TYPE:
        fail(f"{path}: task_type {task_type!r} is not one of {sorted(TASK_OF_TYPE)}")
    return TASK_OF_TYPE[task_type]


def load_peft(base, adapter, trainable=False):
    """BASE with ADAPTER, float32; fails unless the adapter file holds exactly the tensors PEFT
    saves for its configuration, each loaded as written."""
    task = adapter_task(adapter)
    model = PeftModel.from_pretrained(load_base(base, task), adapter, is_trainable=trainable)
    written = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    held = get_peft_model_state_dict(model)
    missing, extra = sorted(set(held) - set(written)), sorted(set(written) - set(held))
    if missing or extra:
        fail(f"{adapter}: adapter tensors PEFT expects but the file lacks: {missing}; "
             f"in the file but not expected: {extra}")
    for name, value in written.items():
        if not torch.equal(value.to(held[name].dtype), held[name]):
            fail(f"{adapter}: {name} did not load as written")
    return model, task


def encode_lm(tokenizer_dir, data, seq):
    """(ids, labels) [N, seq] of DATA's documents as Tandem encodes them for --task lm."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = []
    with open(data) as f:
        for line in f:
            if line.strip():
                ids = tok(json.loads(line)["text"])["input_ids"]
                if not ids or ids[-1] != tok.eos_token_id:
                    ids.append(tok.eos_token_id)
                rows.append(ids[:seq])
    if not rows:
        fail(f"{data}: no documents")
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    labels = torch.full((len(rows), seq), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        labels[i, :len(r)] = torch.tensor(r)
    return ids, labels


def lr_at(k, lr, steps):
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, k / steps))))


def trainable_count(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_adapter(base, out, rank, alpha, targets, task="lm", rslora=False, seed=0):
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora,
                        task_type=TASKS[task][0])
    model = get_peft_model(load_base(base, task), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # named_parameters' order is the model's, fixed
            if ".lora_A." in name or ".lora_B." in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out)
    names = list(load_file(os.path.join(out, "adapter_model.safetensors")))
    return names, trainable_count(model)


def train(base, adapter, data, seq, steps, lr, weight_decay):
    model, task = load_peft(base, adapter, trainable=True)
    if task != "lm":
        fail(f"train: {adapter} is a {task} adapter; only lm (CAUSAL_LM) is implemented")
    model.train()  # lora_dropout is 0 and Llama's attention dropout 0: the same as eval()
    ids, labels = encode_lm(base, data, seq)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    losses = []
    for k in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(k, lr, steps)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, sum(p.numel() for p in params)


def loss_of(base, adapter, data, seq, task="lm"):
    if adapter:
        model, task = load_peft(base, adapter)
    else:
        model = load_base(base, task)
    if task != "lm":
        fail(f"loss: only lm (CAUSAL_LM) is implemented, not {task}")
    ids, labels = encode_lm(base, data, seq)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, labels=labels).loss.item()


def check_adapter(base, adapter, ref_file, tolerance=1e-4):
    model, task = load_peft(base, adapter)
    ref = load_file(ref_file)
    model.eval()
    with torch.no_grad():
        mine = model(input_ids=ref["ids"]).logits
        with model.disable_adapter():
            plain = model(input_ids=ref["ids"]).logits
    if mine.shape != ref["logits"].shape:
        print(f"FAIL logits shape {tuple(ref['logits'].shape)}, PEFT's {tuple(mine.shape)}")
        return 1
    diff = (mine - ref["logits"].float()).abs().max().item()
    moved = (mine - plain).abs().max().item()
    ok = diff <= tolerance
    print(f"{'ok  ' if ok else 'FAIL'} {task} adapter: PEFT vs Tandem logits max |diff| {diff:.3g} "
          f"(tolerance {tolerance:g}; the adapter moves BASE's logits by up to {moved:.3g})")
    return 0 if ok else 1


def check_merged(base, adapter, merged_dir, tolerance=1e-6):
    model, task = load_peft(base, adapter)
    mine = model.merge_and_unload().state_dict()
    theirs = load_base(merged_dir, task).state_dict()
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing or extra:
        print(f"FAIL {merged_dir}: tensors missing {missing}, unexpected {extra}")
        return 1
    worst, worst_name, ok = 0.0, None, True
    for name, value in mine.items():
        if value.shape != theirs[name].shape:
            print(f"FAIL {name}: shape {tuple(theirs[name].shape)}, PEFT's merge {tuple(value.shape)}")
            ok = False
            continue
        diff = (value.float() - theirs[name].float()).abs().max().item() if value.numel() else 0.0
        if diff > worst or worst_name is None:
            worst, worst_name = diff, name
    ok = ok and worst <= tolerance
    print(f"{'ok  ' if ok else 'FAIL'} merged {task}: {len(mine)} tensors, largest |diff| {worst:.3g} "
          f"({worst_name}; tolerance {tolerance:g})")
    return 0 if ok else 1


def main(argv):
    p = argparse.ArgumentParser(prog="peft_reference.py")
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("make-adapter")
    m.add_argument("base")
    m.add_argument("out")
    m.add_argument("--rank", type=int, required=True)
    m.add_argument("--alpha", type=float, required=True)
    m.add_argument("--targets", required=True, help="comma-separated module names, e.g. q_proj,v_proj")
    m.add_argument("--task", choices=sorted(TASKS), default="lm")
    m.add_argument("--rslora", action="store_true")
    m.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train")
    t.add_argument("base")
    t.add_argument("adapter")
    t.add_argument("data")
    t.add_argument("--seq", type=int, default=32)
    t.add_argument("--steps", type=int, default=5)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--task", choices=["lm"], default="lm")
    t.add_argument("--out", required=True)
    c = sub.add_parser("check-adapter")
    c.add_argument("base")
    c.add_argument("adapter")
    c.add_argument("ref")
    g = sub.add_parser("check-merged")
    g.add_argument("base")
    g.add_argument("adapter")
    g.add_argument("merged")
    lo = sub.add_parser("loss")
    lo.add_argument("paths", nargs="+", metavar="BASE [ADAPTER] DATA.jsonl")
    lo.add_argument("--seq", type=int, default=32)
    lo.add_argument("--task", choices=["lm"], default="lm")
    a = p.parse_args(argv)
    if a.mode == "make-adapter":
        # An alpha that is a whole number is written as one, as PEFT's own configs have it.
        alpha = int(a.alpha) if a.alpha == int(a.alpha) else a.alpha
        names, n = make_adapter(a.base, a.out, a.rank, alpha, a.targets.split(","), a.task, a.rslora, a.seed)
        print("\n".join(names))
        print(f"{len(names)} tensors, {n} trainable parameters, in {a.out}")
        return 0
    if a.mode == "train":
        losses, n = train(a.base, a.adapter, a.data, a.seq, a.steps, a.lr, a.weight_decay)
        with open(a.out, "w") as f:
            json.dump(losses, f)
        with open(os.path.splitext(a.out)[0] + ".trainable.json", "w") as f:
            json.dump({"trainable_parameters": n}, f)
        print(json.dumps({"losses": losses, "trainable_parameters": n}))
        return 0
    if a.mode == "check-adapter":
        return check_adapter(a.base, a.adapter, a.ref)
    if a.mode == "check-merged":
        return check_merged(a.base, a.adapter, a.merged)
    if len(a.paths) not in (2, 3):
        p.error("loss takes BASE [ADAPTER] DATA.jsonl")
    base, data = a.paths[0], a.paths[-1]
    adapter = a.paths[1] if len(a.paths) == 3 else None
    print(json.dumps({"loss": loss_of(base, adapter, data, a.seq, a.task)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
