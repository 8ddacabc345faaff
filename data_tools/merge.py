"""Concatenate indexed datasets (same dtype) into one: python -m data_tools.merge OUT IN [IN ...]

Refuses, before any work, an output whose .bin/.idx exist (unless --overwrite, which replaces
them only once the merged pair is complete), a missing or broken input, and inputs of different
dtypes. Writes the .meta.json sidecar beside the pair: the id range over all inputs (read while
copying, so inputs need no sidecar) and the largest vocabulary size the inputs' sidecars record.
Temporary files of killed merges into the same output are removed at the start.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_id.data.indexed_dataset import (IndexedDataset, IndexedDatasetError,
                                              IndexedDatasetWriter, matching_meta, output_files,
                                              remove_stale_temps)
from megatron_id.errors import run_guarded

from .outputs import check_outputs, make_folder, remove_folders, report_stale


def _common(values):
    """The one value all inputs agree on, else None (unknown)."""
    values = set(values)
    return values.pop() if len(values) == 1 else None


def merge_datasets(inputs, output, overwrite: bool = False, warn=None) -> int:
    """Write the concatenation of the datasets `inputs` to `output` (a prefix); returns the
    number of documents. `warn(message)` receives warnings (default: stderr)."""
    warn = warn or (lambda message: print(f"merge: warning: {message}", file=sys.stderr))
    datasets = [IndexedDataset(p) for p in inputs]   # a missing or broken input fails here
    dtypes = {str(d.dtype) for d in datasets}
    if len(dtypes) > 1:
        raise IndexedDatasetError(
            f"cannot merge datasets of different dtypes ({', '.join(sorted(dtypes))}): "
            + ", ".join(f"{d.prefix} is {d.dtype}" for d in datasets)
            + ". Different dtypes mean different vocabulary sizes, so different tokenizers: merge "
              "only datasets made with the same tokenizer.")
    check_outputs([Path(f"{output}.bin"), Path(f"{output}.idx")], "output prefix", output, overwrite)

    metas = [matching_meta(d) for d in datasets]
    known = [m for m in metas if m is not None]
    vocab_sizes = {m["vocab_size"] for m in known if m.get("vocab_size") is not None}
    if len(vocab_sizes) > 1:
        warn(f"the inputs record different vocabulary sizes ({', '.join(map(str, sorted(vocab_sizes)))}): "
             f"were they made with different tokenizers? Their ids would then mean different things.")
    complete = len(known) == len(datasets)
    writer_meta = {"vocab_size": max(vocab_sizes) if vocab_sizes else None,
                   "tokenizer": _common(m.get("tokenizer") for m in known) if complete else None,
                   "eod_id": _common(m.get("eod_id") for m in known) if complete else None}

    created = make_folder(Path(output).parent)
    report_stale("merge", remove_stale_temps(output_files(output)))
    writer = None
    try:
        writer = IndexedDatasetWriter(output, datasets[0].dtype, **writer_meta)
        for d in datasets:
            writer.append(d)
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
    return p


def main(argv=None, debug: bool = False) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        n = merge_datasets(args.inputs, args.output_prefix, overwrite=args.overwrite)
        print(f"merged {len(args.inputs)} datasets, {n:,} documents -> {args.output_prefix}.bin/.idx",
              file=sys.stderr)
        return 0
    return run_guarded("merge", body, debug=debug)


if __name__ == "__main__":
    sys.exit(main())
