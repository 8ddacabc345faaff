"""Train a byte-level BPE tokenizer on local text files (offline work, quickstarts).

    python -m data_tools.train_tokenizer --input corpus.txt more/*.jsonl --vocab-size 8192 \\
        --output tokenizer.json
Text files are read line by line; .jsonl/.parquet inputs contribute their --json-keys fields.
An existing --output is replaced only with --overwrite; the file is written under a temporary
name and renamed when complete.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

from megatron_id.atomic import write_atomic
from megatron_id.data.indexed_dataset import remove_stale_temps, temp_path
from megatron_id.errors import UserError, run_guarded

from .outputs import check_outputs, make_folder, remove_folders, report_stale
from .readers import TEXT_SUFFIXES, Record, check_input_files, expand_inputs, iter_documents

EOD = "<|endoftext|>"
MIN_VOCAB = 258   # 256 byte tokens + EOD + at least one merge


class TrainTokenizerError(UserError, ValueError):
    pass


def _texts(files, keys, counted: list | None = None, skipped: collections.Counter | None = None):
    """The texts of `files`; `counted` (when given) gets the number of characters read added to
    its first item, `skipped` the reasons of the JSON lines that gave no text."""
    for text in _all_texts(files, keys, skipped if skipped is not None else collections.Counter()):
        if counted is not None:
            counted[0] += len(text)
        yield text


def _all_texts(files, keys, skipped: collections.Counter):
    for path in files:
        if path.name.lower().endswith(TEXT_SUFFIXES):
            with open(path, encoding="utf-8-sig", errors="replace") as f:   # a BOM is not text
                yield from f
        else:
            for item in iter_documents([path], columns=keys):
                if isinstance(item, Record):
                    yield from (item.data[k] for k in keys if isinstance(item.data.get(k), str))
                else:   # counted, said at the end
                    skipped[item.reason] += 1


def train(files, vocab_size: int, keys=("text",), min_frequency: int = 2, counted: list | None = None,
          skipped: collections.Counter | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(files, keys, counted, skipped), trainer=trainer)
    return tok


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data_tools.train_tokenizer",
                                description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--output", required=True, help="tokenizer.json to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output (only once the new tokenizer is written)")
    return p


def main(argv=None, debug: bool = False) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        if args.vocab_size < MIN_VOCAB:
            raise TrainTokenizerError(f"--vocab-size {args.vocab_size}: must be at least {MIN_VOCAB} "
                                      f"(the 256 byte tokens, {EOD} and some merges).")
        out = Path(args.output)
        notes: list[str] = []
        files = expand_inputs(args.input, allow_text=True, notes=notes)
        check_input_files(files)   # UTF-16 JSON lines, a .gz that is not gzip: refused before training
        for note in notes:
            print(f"train_tokenizer: note: {note}", file=sys.stderr)
        check_outputs([out], "--output", out, args.overwrite)   # before the (long) training
        counted, skipped = [0], collections.Counter()
        tok = train(files, args.vocab_size, args.json_keys, args.min_frequency, counted, skipped)
        if skipped:   # lines that gave no text: counted, as preprocess counts them
            print(f"train_tokenizer: note: {sum(skipped.values()):,} JSON lines skipped: "
                  + ", ".join(f"{n:,} {reason}" for reason, n in skipped.most_common()), file=sys.stderr)
        if tok.get_vocab_size() <= MIN_VOCAB - 1:   # nothing but the alphabet: no text was read
            raise TrainTokenizerError(f"no text to learn from in {', '.join(map(str, files[:3]))}"
                                      f"{', ...' if len(files) > 3 else ''}: the inputs are empty or "
                                      f"have no --json-keys {' '.join(args.json_keys)} field.")
        created = make_folder(out.parent)
        report_stale("train_tokenizer", remove_stale_temps([out]))
        try:   # under the name remove_stale_temps knows, should a kill leave it
            write_atomic(out, lambda tmp: tok.save(str(tmp)), temp=temp_path(out))
        except BaseException:
            remove_folders(created)
            raise
        print(f"trained byte-level BPE, vocabulary {tok.get_vocab_size():,} ({EOD} = "
              f"{tok.token_to_id(EOD)}) -> {out}", file=sys.stderr)
        if tok.get_vocab_size() < args.vocab_size:   # written all the same: smaller is not wrong
            print(f"train_tokenizer: warning: --vocab-size {args.vocab_size:,} asked, {tok.get_vocab_size():,} "
                  f"obtained: the corpus is too small ({counted[0]:,} characters in {len(files):,} "
                  f"file{'s' if len(files) > 1 else ''}): no pair of adjacent tokens is left that occurs "
                  f"at least --min-frequency {args.min_frequency} times. Train on more text, or lower "
                  f"--vocab-size (or --min-frequency).", file=sys.stderr)
        return 0
    return run_guarded("train_tokenizer", body, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
