"""A local Hugging Face model directory for the tokenizer, fine-tuning and export tests, run in
.venv-hf (no hub downloads):

  hf_fixture.py make DIR [CORPUS]
      trains a SentencePiece BPE model on the fortune cookies under CORPUS (default
      /usr/share/games/fortunes; Llama's settings: byte fallback, identity normalisation, unk 0,
      bos 1, eos 2, no pad), and writes with save_pretrained
        DIR/lm   a tiny random LlamaForCausalLM (2 layers, width 64, 4 heads, 2 KV heads) + tokenizer
        DIR/lm_tied  the same with tied input and output embeddings
        DIR/lm_tp3  width 96, 6 heads, 3 KV heads, MLP 192 and the vocabulary padded to 804 rows:
                 every cut dimension divides by 3 (and 2), for tensor parallelism over 3 ranks
        DIR/cls  a tiny random LlamaForSequenceClassification (3 labels, pad token) + tokenizer
        DIR/mixtral  a tiny random MixtralForCausalLM (2 layers, 4 experts, top-2, router aux
                 coefficient 0.02) + tokenizer
      and DIR/tokens.json: for each of some texts, the ids of transformers' tokenizer (loaded back
      from DIR/lm with AutoTokenizer) with and without special tokens, and its decoding.

  hf_fixture.py check-export OUT REF lm|cls [OUT REF lm|cls ...]
      loads Tandem's export OUT with transformers (AutoModelForCausalLM or
      AutoModelForSequenceClassification, AutoTokenizer), computes the logits of REF's "ids" and
      compares them with REF's "logits" (Tandem's); prints the largest difference, exit 1 above
      1e-5 (or when the classifier's labels or the tokenizer did not come through).
"""
import json
import os
import sys

import sentencepiece as spm
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
from transformers import MixtralConfig, MixtralForCausalLM
from transformers import LlamaTokenizer
from transformers.tokenization_utils_base import generate_merges

TEXTS = [
    "Hello world",
    "  two leading spaces and  double  spaces inside",
    "You will be married within a year.",
    "Line one\nline two\ttabbed",
    "Zeichen: äöü ß, Ελληνικά, 日本語 and an emoji \U0001F600",
    "1234567 digits, punctuation!?; (brackets) [x] {y}",
    "",
    "trailing space ",
]


def documents(root, limit):
    docs = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.islink(path) or not os.path.isfile(path) or name.endswith((".dat", ".u8")):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for doc in f.read().split("\n%\n"):
                doc = doc.strip()
                if doc:
                    docs.append(doc.replace("\n", " "))
        if len(docs) >= limit:
            break
    return docs[:limit]


def train_tokenizer(root, out_prefix):
    docs = documents(root, 4000)
    if len(docs) < 100:
        raise SystemExit(f"hf_fixture.py: too few fortune cookies under {root} (apt-get install fortunes)")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs), model_prefix=out_prefix, model_type="bpe", vocab_size=800,
        character_coverage=0.9995, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    return out_prefix + ".model"


def transformers_tokenizer(sp_file, **special):
    """transformers' LlamaTokenizer (a tokenizers BPE) from the SentencePiece model's pieces, as its
    SentencePieceExtractor converts one (which needs protobuf, absent from .venv-hf)."""
    sp = spm.SentencePieceProcessor(model_file=sp_file)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    return LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab), **special)


def config(vocab, tied=False, **extra):
    shape = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2)
    shape.update(extra)
    return LlamaConfig(vocab_size=vocab, num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                       tie_word_embeddings=tied, initializer_range=0.1, bos_token_id=1, eos_token_id=2, **shape)


def make(d, root):
    os.makedirs(d, exist_ok=True)
    sp_file = train_tokenizer(root, os.path.join(d, "sp"))
    vocab = spm.SentencePieceProcessor(model_file=sp_file).get_piece_size()
    torch.manual_seed(0)
    LlamaForCausalLM(config(vocab)).save_pretrained(os.path.join(d, "lm"))
    # Llama 2's tokenizer_config.json: a BOS before every text, no EOS.
    transformers_tokenizer(sp_file, add_bos_token=True, add_eos_token=False).save_pretrained(os.path.join(d, "lm"))
    torch.manual_seed(2)
    LlamaForCausalLM(config(vocab, tied=True)).save_pretrained(os.path.join(d, "lm_tied"))
    transformers_tokenizer(sp_file, add_bos_token=True, add_eos_token=False).save_pretrained(
        os.path.join(d, "lm_tied"))
    torch.manual_seed(3)
    # The embedding and head rows past the tokenizer's pieces are never read: padding, as
    # Megatron pads a vocabulary to a multiple of the tensor-parallel size.
    LlamaForCausalLM(config(-(-vocab // 12) * 12, hidden_size=96, intermediate_size=192, num_attention_heads=6,
                            num_key_value_heads=3)).save_pretrained(os.path.join(d, "lm_tp3"))
    transformers_tokenizer(sp_file, add_bos_token=True, add_eos_token=False).save_pretrained(
        os.path.join(d, "lm_tp3"))
    torch.manual_seed(1)
    labels = ["negative", "neutral", "positive"]
    cls = LlamaForSequenceClassification(config(vocab, pad_token_id=2, num_labels=3,
                                                id2label=dict(enumerate(labels)),
                                                label2id={l: i for i, l in enumerate(labels)}))
    cls.save_pretrained(os.path.join(d, "cls"))
    # The classifier pads with EOS and ends every text with it (pooling reads the last real token).
    transformers_tokenizer(sp_file, add_bos_token=True, add_eos_token=True, pad_token="</s>").save_pretrained(
        os.path.join(d, "cls"))
    torch.manual_seed(4)
    MixtralForCausalLM(MixtralConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.1,
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02, bos_token_id=1,
        eos_token_id=2)).save_pretrained(os.path.join(d, "mixtral"))
    transformers_tokenizer(sp_file, add_bos_token=True, add_eos_token=False).save_pretrained(
        os.path.join(d, "mixtral"))
    for sub in ("lm", "lm_tied", "lm_tp3", "cls", "mixtral"):  # Tandem reads the SentencePiece model itself, as Llama 1/2 ship it
        with open(sp_file, "rb") as src, open(os.path.join(d, sub, "tokenizer.model"), "wb") as dst:
            dst.write(src.read())
    sp = spm.SentencePieceProcessor(model_file=sp_file)
    texts = TEXTS + documents(root, 60)[-40:]
    out = {}
    for sub in ("lm", "cls"):
        back = AutoTokenizer.from_pretrained(os.path.join(d, sub))
        ref = []
        for t in texts:
            plain = back(t, add_special_tokens=False)["input_ids"]
            ref.append({"text": t, "ids": back(t)["input_ids"], "plain": plain, "sentencepiece": sp.encode(t),
                        "decoded": back.decode(plain)})
        out[sub] = {"bos": back.bos_token_id, "eos": back.eos_token_id, "pad": back.pad_token_id, "texts": ref}
    with open(os.path.join(d, "tokens.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False)
    return 0


def check_export(out, ref_file, kind):
    auto = AutoModelForCausalLM if kind == "lm" else AutoModelForSequenceClassification
    model = auto.from_pretrained(out).eval()
    ref = load_file(ref_file)
    with torch.no_grad():
        mine = model(ref["ids"]).logits
    diff = (mine - ref["logits"]).abs().max().item()
    print(f"{kind}: transformers on Tandem's export vs Tandem on its checkpoint, max |diff| {diff:.3g}")
    ok = diff <= 1e-5 and mine.abs().max().item() > 0.01
    if kind == "cls" and model.config.id2label != {0: "negative", 1: "neutral", 2: "positive"}:
        print("labels did not come through:", model.config.id2label)
        ok = False
    tok = AutoTokenizer.from_pretrained(out)
    if tok("Hello world")["input_ids"][0] != 1:
        print("the exported tokenizer does not add BOS")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "make":
        sys.exit(make(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "/usr/share/games/fortunes"))
    if mode == "check-export":  # one or more OUT REF KIND triples, checked in one interpreter
        args = sys.argv[2:]
        sys.exit(max(check_export(*args[i:i + 3]) for i in range(0, len(args) - 2, 3)))
    sys.exit(f"hf_fixture.py: unknown mode {mode}")
