"""Megatron-LM's and GPT-NeoX's preprocessing flags that this tool takes but does not need.

Users arrive with command lines written for Megatron-LM's `tools/preprocess_data.py` (its
runtime flags and the tokenizer flags of its TokenizerConfig) or GPT-NeoX's
`tools/datasets/preprocess_data.py`. Every flag of those two scripts is accepted here: the ones
this tool implements are ordinary options of `preprocess.py`; the others are declared below,
each with what it does here. A flag that changes nothing prints a note saying why (the run goes
on: the output is what the flag would have given, or the flag only tunes something this tool
does differently); a flag whose effect this tool cannot give is refused before any work, with
the reason and the way out. Nothing is ignored in silence.
"""
from __future__ import annotations

import argparse

NOTE, REFUSE = "note", "refuse"

# flag, argparse keywords, verdict, reason. `verdict` may be a function of the parsed value
# returning NOTE, REFUSE or None (fine as given).
FLAGS = [
    # Megatron-LM tools/preprocess_data.py
    ("--split-sentences", dict(action="store_true"), REFUSE,
     "sentence splitting (NLTK punkt) makes BERT/T5-style sentence-level data; its punkt model cannot be "
     "downloaded here, and decoder-only training reads whole documents. Input that is already split (a list "
     "of sentences per document, as Megatron's split pass writes it) is read as it is: each sentence becomes a "
     "sequence of its document"),
    ("--keep-newlines", dict(action="store_true"), NOTE,
     "it applies only to --split-sentences (as in Megatron); newlines inside documents are always kept"),
    ("--lang", dict(default=None), NOTE,
     "Megatron uses it only to choose the NLTK sentence splitter of --split-sentences; it filters nothing "
     "(to keep rows of one language, use --language en, FineWeb's field)"),
    ("--find-optimal-num-workers", dict(action="store_true"), REFUSE,
     "this tool's workers are threads inside one tokenizer call, and the best number is the number of cores; "
     "to measure, run `python benchmarks/preprocess.py --workers 1 2 4`"),
    ("--workers-to-check", dict(nargs="+", type=int, default=None), NOTE,
     "it applies only to --find-optimal-num-workers"),
    ("--max-documents", dict(type=int, default=None), NOTE,
     "it applies only to --find-optimal-num-workers (it does not limit a normal run, in Megatron either)"),
    ("--keep-sequential-samples", dict(action="store_true"), NOTE,
     "the output is always in input order here, whatever --workers and --partitions"),
    # Megatron-LM's tokenizer flags (TokenizerConfig)
    ("--padded-vocab-size", dict(type=int, default=None), NOTE,
     "vocabulary padding is a training setting (model.make_vocab_size_divisible_by); preprocessing writes "
     "token ids only"),
    ("--no-pad-vocab-size", dict(action="store_true"), NOTE,
     "vocabulary padding is a training setting (model.make_vocab_size_divisible_by); preprocessing writes "
     "token ids only"),
    ("--vocab-extra-ids", dict(type=int, default=None),
     lambda v: REFUSE if v else None,
     "T5 sentinel tokens are not added here: add them to the tokenizer.json (tokenizers' "
     "Tokenizer.add_special_tokens, then save) so that training, export and generation share the vocabulary"),
    ("--tokenizer-metadata", dict(default=None), NOTE,
     "the tokenizer files given decide the tokenizer (Megatron's metadata file names a tokenizer library)"),
    ("--tokenizer-special-tokens", dict(nargs="+", default=None), REFUSE,
     "special tokens added on the command line would exist only in this dataset: add them to the "
     "tokenizer.json (tokenizers' Tokenizer.add_special_tokens, then save) and pass that file"),
    ("--tiktoken-pattern", dict(default=None), NOTE,
     "it belongs to --tokenizer-type TikTokenizer; this tool's tiktoken path is --tokenizer-backend tiktoken, "
     "which takes the pattern from the tokenizer.json"),
    ("--tiktoken-num-special-tokens", dict(type=int, default=None), NOTE,
     "it belongs to --tokenizer-type TikTokenizer; special tokens come from the tokenizer.json here"),
    ("--tokenizer-sentencepiece-legacy", dict(action="store_true"), NOTE,
     "it belongs to SentencePiece .model files, which are not read here (tokenizer.json only)"),
    ("--tokenizer-sentencepiece-ignore-extra-whitespaces", dict(default=None), NOTE,
     "it belongs to SentencePiece .model files, which are not read here (tokenizer.json only)"),
    ("--tokenizer-hf-no-use-fast", dict(action="store_true"), NOTE,
     "tokenizer.json files always run in the Rust tokenizers library here (Megatron's fast path)"),
    ("--tokenizer-hf-no-include-special-tokens", dict(action="store_true"), NOTE,
     "this tool never adds a tokenizer's template tokens (a BOS from its post-processor), which is what this "
     "flag asks Megatron for"),
    ("--trust-remote-code", dict(action="store_true"), NOTE,
     "tokenizers are read from local files here; no code is downloaded or run"),
    ("--null-tokenizer-pad-id", dict(type=int, default=None), NOTE,
     "preprocessing writes no padding"),
    ("--chat-template", dict(default=None), NOTE,
     "chat templates format SFT conversations; pretraining documents are tokenized as they are"),
    ("--use-gigatoken", dict(action="store_true"), NOTE,
     "gigatoken is this tool's default encoder when installed (--tokenizer-backend auto; --tokenizer-backend "
     "gigatoken asks for it by name), checked against tokenizers as every fast encoder is"),
    # GPT-NeoX tools/datasets/preprocess_data.py
    ("--num-docs", dict(type=int, default=None), NOTE,
     "progress is measured in input bytes here, so the total is always known"),
    ("--dataset-impl", dict(default=None, choices=["mmap", "cached", "lazy"]),
     lambda v: None if v in (None, "mmap") else REFUSE,
     "the 'cached' and 'lazy' formats were removed from Megatron-LM and are not written here: the output is "
     "the memory-mapped format ('mmap', the default) that Megatron, NeoX and this stack read"),
]


def add_compat_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Megatron-LM / GPT-NeoX flags", "Accepted so that their command lines run unchanged. Those that change "
        "nothing here print a note saying why; those whose effect this tool cannot give stop the run before any "
        "work, with the reason.")
    for flag, kwargs, verdict, reason in FLAGS:
        kind = "refused" if verdict == REFUSE else ("no effect" if verdict == NOTE else "see below")
        if callable(verdict):
            kind = "refused unless its default" if flag != "--dataset-impl" else "only mmap"
        group.add_argument(flag, **kwargs, help=f"({kind}) {reason}")


def _given(value) -> bool:
    return value not in (None, False)


def check_compat_flags(args) -> list[str]:
    """Notes for the flags given that change nothing; raises ValueError(message) for a refused one."""
    notes = []
    for flag, _, verdict, reason in FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if not _given(value):
            continue
        outcome = verdict(value) if callable(verdict) else verdict
        shown = (flag if isinstance(value, bool)
                 else f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}")
        if outcome == REFUSE:
            raise ValueError(f"{shown}: not supported here: {reason}.")
        if outcome == NOTE:
            notes.append(f"{shown} has no effect here: {reason}.")
    return notes
