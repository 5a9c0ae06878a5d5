"""Reference checks of `tandem preprocess` and packed training, for tests/e2e/hf_packed*.sh.

usage: packed_reference.py megatron DATA_DIR MODEL_DIR JSONL
         Megatron-LM's own reader (megatron.core.datasets.indexed_dataset.IndexedDataset) reads
         DATA_DIR/text_document: one sequence per JSON line, each transformers' tokenization of the
         text followed by EOS; and this file's numpy reader agrees with it.
       packed_reference.py record DATA_DIR SEQ BATCH RECORD_PREFIX@FIRST_STEP... [--ref PREFIX]
         What each rank trained on (the finetune --data-record files of one or more runs, in
         order, each starting at FIRST_STEP): every row is the packed window of the .bin (numpy
         memmap, read here from the documented format) and its positions restart after each EOS
         as Megatron's reset_position_ids; each run's first sample is FIRST_STEP x BATCH (a
         resumed run replaces what the run before it trained after that checkpoint); every global
         sample appears once, each whole epoch's windows are each window once, and with --ref the
         windows are those of the uninterrupted run PREFIX at the same samples."""
import glob
import json
import sys

import numpy as np


def read_indexed(prefix):
    """(sizes, pointers, doc_idx, tokens) of Megatron's MMapIndexedDataset, from its format."""
    raw = np.memmap(prefix + ".idx", dtype=np.uint8, mode="r")
    assert bytes(raw[:9]) == b"MMIDIDX\x00\x00", "magic"
    version, = np.frombuffer(raw[9:17], "<u8")
    assert version == 1
    dtype = {8: np.uint16, 4: np.int32}[int(raw[17])]
    n, d = np.frombuffer(raw[18:34], "<u8")
    off = 34
    sizes = np.frombuffer(raw[off:off + 4 * n], "<i4"); off += 4 * n
    pointers = np.frombuffer(raw[off:off + 8 * n], "<i8"); off += 8 * n
    doc_idx = np.frombuffer(raw[off:off + 8 * d], "<i8"); off += 8 * d
    assert off == raw.size, "index length"
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    assert tokens.size == sizes.sum()
    return sizes, pointers, doc_idx, tokens


def megatron_positions(ids, eos):
    """Megatron's get_ltor_masks_and_position_ids(reset_position_ids=True) for one row."""
    pos = np.arange(len(ids))
    prev = 0
    for i in np.nonzero(np.asarray(ids) == eos)[0]:
        pos[i + 1:] -= i + 1 - prev
        prev = i + 1
    return pos


def check_megatron(data_dir, model_dir, jsonl):
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    info = json.load(open(data_dir + "/dataset.json"))
    eos = info["tokenizer"]["eos"]
    prefix = data_dir + "/" + info["prefix"]
    ds = IndexedDataset(prefix)
    texts = [json.loads(l)["text"] for l in open(jsonl) if l.strip()]
    sizes, pointers, doc_idx, tokens = read_indexed(prefix)
    assert len(ds) == len(texts) == len(sizes), (len(ds), len(texts), len(sizes))
    assert list(ds.document_indices) == list(range(len(texts) + 1))
    bad = 0
    for i, t in enumerate(texts):
        want = tok(t)["input_ids"] + [eos]
        got = ds[i].tolist()
        mine = tokens[pointers[i] // tokens.itemsize:][:sizes[i]].tolist()
        if got != want or mine != got:
            bad += 1
            if bad < 3:
                print(f"FAIL document {i}: megatron {got[:12]}..., transformers {want[:12]}..., numpy {mine[:12]}...")
    print(f"{'ok  ' if not bad else 'FAIL'} Megatron's IndexedDataset reads {len(ds)} documents "
          f"({int(sizes.sum())} tokens, {ds.index.dtype.__name__}); {bad} differ from transformers' ids + EOS")
    return bad == 0


def read_record(prefix, seq, tokens, eos):
    """{sample: window} of one run's record, and the count of rows that are wrong or repeated."""
    run, bad, rows = {}, 0, 0
    for path in sorted(glob.glob(prefix + ".rank*.jsonl")):
        for line in open(path):
            r = json.loads(line)
            for s, w, ids, pos in zip(r["samples"], r["windows"], r["ids"], r["positions"]):
                rows += 1
                want = tokens[w * seq:w * seq + seq].astype(np.int64)
                if ids != want.tolist() or pos != megatron_positions(want, eos).tolist():
                    bad += 1
                if s in run:
                    bad += 1
                    print(f"FAIL sample {s} trained twice in run {prefix}")
                run[s] = w
    return run, bad, rows


def check_record(data_dir, seq, batch, runs, ref):
    info = json.load(open(data_dir + "/dataset.json"))
    eos = info["tokenizer"]["eos"]
    _, _, _, tokens = read_indexed(data_dir + "/" + info["prefix"])
    n = (tokens.size - 1) // seq
    by_sample = {}
    rows = bad = 0
    for spec in runs:
        prefix, first_step = spec.rsplit("@", 1)
        run, b, r = read_record(prefix, seq, tokens, eos)
        bad, rows = bad + b, rows + r
        if not run or min(run) != int(first_step) * batch:
            bad += 1
            print(f"FAIL run {prefix} starts at sample {min(run) if run else None}, not {int(first_step) * batch}")
            continue
        by_sample = {s: w for s, w in by_sample.items() if s < min(run)}
        by_sample.update(run)
    if ref:
        want, b, _ = read_record(ref, seq, tokens, eos)
        differ = sum(1 for s, w in by_sample.items() if want.get(s, w) != w)
        bad += b + differ
        print(f"{'ok  ' if not differ else 'FAIL'} {differ} samples differ from the uninterrupted run's windows")
    total = max(by_sample) + 1 if by_sample else 0
    gaps = [s for s in range(total) if s not in by_sample]
    epochs_ok = True
    for e in range(total // n):
        ws = sorted(by_sample[s] for s in range(e * n, (e + 1) * n))
        epochs_ok &= ws == list(range(n))
    ok = not bad and not gaps and epochs_ok and total % batch == 0 and rows > 0
    print(f"{'ok  ' if ok else 'FAIL'} {rows} rows of {len(runs)} run(s) are the .bin's packed windows "
          f"(seq {seq}) with Megatron's reset positions ({bad} wrong); samples 0..{total - 1} each once "
          f"({len(gaps)} gaps); {total // n} whole epoch(s) of {n} windows each window once: {epochs_ok}")
    return ok


if __name__ == "__main__":
    if sys.argv[1] == "megatron":
        ok = check_megatron(*sys.argv[2:5])
    else:
        args = sys.argv[5:]
        ref = args[args.index("--ref") + 1] if "--ref" in args else None
        runs = [a for a in args if "@" in a]
        ok = check_record(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), runs, ref)
    sys.exit(0 if ok else 1)
