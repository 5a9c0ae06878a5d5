"""The batch `tandem finetune --init-from --task lm` trains on, built with transformers' tokenizer,
for the e2e scripts' checks against transformers: import it with sys.path set to tests/e2e."""
import json

import torch


def lm_batch(tok, jsonl, seq, pad):
    """(ids, labels) [N, seq] of the JSON lines file's texts as Tandem encodes them: the
    tokenizer's ids, EOS after the text when the tokenizer adds none, truncated to seq, padded
    with `pad`; labels the ids, -100 on padding (transformers shifts them)."""
    rows = []
    for line in open(jsonl):
        ids = tok(json.loads(line)["text"])["input_ids"]
        if not ids or ids[-1] != tok.eos_token_id:
            ids.append(tok.eos_token_id)
        rows.append(ids[:seq])
    ids = torch.full((len(rows), seq), pad, dtype=torch.long)
    labels = torch.full((len(rows), seq), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        labels[i, :len(r)] = torch.tensor(r)
    return ids, labels
