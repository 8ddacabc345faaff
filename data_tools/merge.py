"""Concatenate indexed datasets (same dtype) into one: python -m data_tools.merge OUT IN [IN ...]"""
from __future__ import annotations

import argparse
import sys

from megatron_id.data.indexed_dataset import (IndexedDataset, IndexedDatasetError,
                                              IndexedDatasetWriter)


def merge_datasets(inputs, output) -> int:
    datasets = [IndexedDataset(p) for p in inputs]
    dtypes = {str(d.dtype) for d in datasets}
    if len(dtypes) > 1:
        raise IndexedDatasetError(f"cannot merge datasets of different dtypes ({', '.join(sorted(dtypes))}): "
                                  + ", ".join(f"{d.prefix} is {d.dtype}" for d in datasets))
    with IndexedDatasetWriter(output, datasets[0].dtype) as writer:
        for d in datasets:
            writer.append(d)
    return sum(len(d) for d in datasets)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_tools.merge", description=__doc__.splitlines()[0])
    p.add_argument("output_prefix")
    p.add_argument("inputs", nargs="+", help="dataset prefixes, in order")
    args = p.parse_args(argv)
    try:
        n = merge_datasets(args.inputs, args.output_prefix)
    except IndexedDatasetError as err:
        print(f"merge: error: {err}", file=sys.stderr)
        return 2
    print(f"merged {len(args.inputs)} datasets, {n:,} documents -> {args.output_prefix}.bin/.idx",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
