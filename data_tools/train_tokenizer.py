"""Train a byte-level BPE tokenizer on local text files (offline work, quickstarts).

    python -m data_tools.train_tokenizer --input corpus.txt more/*.jsonl --vocab-size 8192 \\
        --output tokenizer.json
Text files are read line by line; .jsonl/.parquet inputs contribute their --json-keys fields.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .readers import TEXT_SUFFIXES, InputError, Record, expand_inputs, iter_documents

EOD = "<|endoftext|>"


def _texts(files, keys):
    for path in files:
        if path.name.lower().endswith(TEXT_SUFFIXES):
            with open(path, encoding="utf-8", errors="replace") as f:
                yield from f
        else:
            for item in iter_documents([path], columns=keys):
                if isinstance(item, Record):
                    yield from (item.data[k] for k in keys if isinstance(item.data.get(k), str))


def train(files, vocab_size: int, keys=("text",), min_frequency: int = 2):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(files, keys), trainer=trainer)
    return tok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_tools.train_tokenizer", description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--output", required=True, help="tokenizer.json to write")
    args = p.parse_args(argv)
    try:
        files = expand_inputs(args.input, allow_text=True)
    except InputError as err:
        print(f"train_tokenizer: error: {err}", file=sys.stderr)
        return 2
    tok = train(files, args.vocab_size, args.json_keys, args.min_frequency)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tok.save(str(tmp))
    tmp.replace(out)
    print(f"trained byte-level BPE, vocabulary {tok.get_vocab_size():,} ({EOD} = "
          f"{tok.token_to_id(EOD)}) -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
