"""Concatenate indexed datasets (same dtype) into one: python -m data_tools.merge OUT IN [IN ...]

Refuses, before any work, an output whose .bin/.idx exist (unless --overwrite, which replaces
them only once the merged pair is complete), an output that is one of the inputs (with
--overwrite too), an input given twice, a missing or broken input, inputs of different dtypes,
and inputs whose sidecars record different tokenizers (by identity, else by vocabulary size;
--allow-tokenizer-mismatch merges them with a warning). Writes the .meta.json sidecar beside
the pair: the id range over all inputs (read while copying, so inputs need no sidecar), the
largest vocabulary size the inputs' sidecars record, and their tokenizer, its identity and the
end-of-document id when every input records the same. An input whose ids reach that vocabulary
(one without a sidecar made by another tokenizer, or damaged) is refused, nothing written.
Temporary files of killed merges into the same output are removed at the start.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_id.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    matching_meta,
    output_files,
    remove_stale_temps,
)
from megatron_id.data.tokenizer import MISMATCH_FLAG, check_same_tokenizer
from megatron_id.errors import OutputExistsError, UserError, run_guarded

from .outputs import check_outputs, check_prefix, make_folder, remove_folders, report_stale


def _common(values):
    """The one value all inputs agree on, else None (unknown)."""
    values = set(values)
    return values.pop() if len(values) == 1 else None


class MergeError(UserError, ValueError):
    pass


def _same_file(a: Path, b: Path) -> bool:
    """One file under two names (the same path spelled differently, a symlink, a hard link)."""
    if not (Path(a).exists() and Path(b).exists()):
        return False
    return os.path.samefile(a, b)


def _check_tokenizers(inputs, metas, allow: bool, warn) -> bool:
    """Refuse inputs whose sidecars tell their tokenizers apart: by identity when both record
    one, else by the vocabulary sizes recorded (data written before identities were). Inputs
    without a sidecar cannot be compared. Returns True when they differ and `allow` (the user's
    --allow-tokenizer-mismatch) let them through, after a warning."""
    fix = (f"Merge only datasets preprocessed with one tokenizer (data_tools.preprocess with the same "
           f"--tokenizer), or pass {MISMATCH_FLAG} to merge them on purpose.")
    sides = [(f"input {given}", m.get("tokenizer_id"), m.get("tokenizer"), m.get("vocab_size"))
             for given, m in zip(inputs, metas) if m is not None]
    for i, a in enumerate(sides):
        for b in sides[i + 1:]:
            if a[1] is not None and b[1] is not None:
                pair = (a[:3], b[:3])
            elif a[3] is not None and b[3] is not None and a[3] != b[3]:
                pair = tuple((what, f"of {vocab:,} tokens", path) for what, _, path, vocab in (a, b))
            else:
                continue
            if not check_same_tokenizer(*pair, fix, allow=allow, warn=warn):
                return True   # warned once: the merged sidecar records no tokenizer
    return False


def _check_ids_fit(writer, given, meta, inputs, metas, allow: bool, warn) -> None:
    """An input (without a sidecar, as Megatron's tools write them, or with a damaged .bin) whose
    ids reach the vocabulary the other inputs' sidecars record: its ids are another tokenizer's,
    or damage, and the merged sidecar would record ids above its own vocabulary. Refused, or
    with --allow-tokenizer-mismatch merged with the vocabulary and tokenizer left unrecorded."""
    vocab = writer.vocab_size
    if vocab is None or writer.max_token_id is None or writer.max_token_id < vocab:
        return
    recorded = [str(g) for g, m in zip(inputs, metas) if m is not None and m.get("vocab_size") == vocab]
    whose = f"the sidecar of {recorded[0]} records" if len(recorded) == 1 else \
        f"the sidecars of {', '.join(recorded)} record"
    how = "it has no sidecar" if meta is None else "its sidecar records a smaller vocabulary or none"
    message = (f"input {given} holds token id {writer.max_token_id:,}, but {whose} a tokenizer of {vocab:,} tokens "
               f"({how}): its ids are another tokenizer's, or it is damaged")
    if not allow:
        raise MergeError(f"{message}. Nothing was written. python -m data_tools.inspect {given} --check shows its "
                         f"ids; merge only data of one tokenizer, or pass {MISMATCH_FLAG} to merge them on purpose "
                         f"(the merged sidecar then records no tokenizer).")
    warn(f"{message} (mixed on purpose: allowed; the merged sidecar records no vocabulary or tokenizer)")
    writer.vocab_size = writer.tokenizer = writer.tokenizer_id = None


def merge_datasets(inputs, output, overwrite: bool = False, warn=None,
                   allow_tokenizer_mismatch: bool = False) -> int:
    """Write the concatenation of the datasets `inputs` to `output` (a prefix); returns the
    number of documents. `warn(message)` receives warnings (default: stderr)."""
    warn = warn or (lambda message: print(f"merge: warning: {message}", file=sys.stderr))
    check_prefix(output, "output prefix", "merged", "{}.bin/.idx")
    datasets = [IndexedDataset(p) for p in inputs]   # a missing or broken input fails here
    for i, d in enumerate(datasets):
        for j in range(i):
            if _same_file(d.bin_path, datasets[j].bin_path):
                same = "" if str(inputs[i]) == str(inputs[j]) else f" (as {inputs[j]} and as {inputs[i]})"
                raise MergeError(
                    f"input {d.prefix} is given twice{same}: its {len(d):,} documents would be written "
                    f"twice. Name each dataset once (to weight one more, blend at training: "
                    f"data.data_path='2 A 1 B', as Megatron's --data-path).")
    for given, d in zip(inputs, datasets):
        if _same_file(Path(f"{output}.bin"), d.bin_path) or _same_file(Path(f"{output}.idx"), d.idx_path):
            spelled = "" if str(given) == str(d.prefix) else f" ({d.prefix})"
            raise OutputExistsError(
                f"output prefix {output} is the input {given}{spelled}: the merge would replace a "
                f"dataset it reads, --overwrite or not; nothing was written. Choose another output prefix "
                f"(and move the result over the input afterwards if you mean to replace it).")
    dtypes = {str(d.dtype) for d in datasets}
    if len(dtypes) > 1:
        raise IndexedDatasetError(
            f"cannot merge datasets of different dtypes ({', '.join(sorted(dtypes))}): "
            + ", ".join(f"{d.prefix} is {d.dtype}" for d in datasets)
            + ". Different dtypes mean different vocabulary sizes, so different tokenizers: merge "
              "only datasets made with the same tokenizer.")
    check_outputs([Path(f"{output}.bin"), Path(f"{output}.idx")], "output prefix", output, overwrite)

    metas = [matching_meta(d) for d in datasets]
    mixed = _check_tokenizers(inputs, metas, allow_tokenizer_mismatch, warn)
    known = [m for m in metas if m is not None]
    vocab_sizes = {m["vocab_size"] for m in known if m.get("vocab_size") is not None}
    # the tokenizer is known when every input records it and they agree (one identity; paths
    # may differ for copies of one tokenizer file); an input without a sidecar makes it unknown
    agreed = len(known) == len(datasets) and not mixed
    identity = _common(m.get("tokenizer_id") for m in known) if agreed else None
    paths = [m.get("tokenizer") for m in known]
    tokenizer = _common(paths) if agreed else None
    if tokenizer is None and identity is not None:
        tokenizer = next((p for p in paths if p), None)
    writer_meta = {"vocab_size": max(vocab_sizes) if vocab_sizes else None, "tokenizer": tokenizer,
                   "tokenizer_id": identity,
                   "eod_id": _common(m.get("eod_id") for m in known) if len(known) == len(datasets) else None}

    created = make_folder(Path(output).parent)
    report_stale("merge", remove_stale_temps(output_files(output)))
    writer = None
    try:
        writer = IndexedDatasetWriter(output, datasets[0].dtype, **writer_meta)
        for given, d, meta in zip(inputs, datasets, metas):
            writer.append(d)
            _check_ids_fit(writer, given, meta, inputs, metas, allow_tokenizer_mismatch, warn)
        writer.finalize()
    except BaseException:
        if writer is not None:
            writer.abort()
        remove_folders(created)
        raise
    return sum(len(d) for d in datasets)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data_tools.merge", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("output_prefix")
    p.add_argument("inputs", nargs="+", help="dataset prefixes, in order")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output (only once the merged pair is complete)")
    p.add_argument(MISMATCH_FLAG, action="store_true",
                   help="merge inputs whose sidecars record different tokenizers on purpose (a warning; "
                        "the merged sidecar then records no tokenizer)")
    return p


def main(argv=None, debug: bool = False) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        n = merge_datasets(args.inputs, args.output_prefix, overwrite=args.overwrite,
                           allow_tokenizer_mismatch=args.allow_tokenizer_mismatch)
        print(f"merged {len(args.inputs)} datasets, {n:,} documents -> {args.output_prefix}.bin/.idx",
              file=sys.stderr)
        return 0
    return run_guarded("merge", body, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
