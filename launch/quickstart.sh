#!/usr/bin/env bash
# The quickstart: from a fresh clone to a trained, validated and checkpointed model on CPU.
#
#   bash launch/quickstart.sh [OUTPUT_DIR] [key=value ...]
#
# 1. installs what is missing (torch first, then this package and its dependencies);
# 2. preprocesses the bundled FineWeb-Edu sample (tests/data/) into Megatron indexed binaries;
# 3. trains the tiny interdomain model on 2 CPU processes: data parallel x2 with ZeRO-1
#    (configs/model/tiny.yaml + configs/train/quickstart.yaml; extra key=value overrides go last);
# 4. validates every 50 steps and at the end, saves the final checkpoint, and prints where the
#    log, the TensorBoard events and the checkpoint are.
# A few minutes on a 2-core machine. OUTPUT_DIR defaults to runs/quickstart-<date-time>.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# an override in the folder's place (`quickstart.sh model.mixer=softmax`) is an override, not a
# folder named "model.mixer=softmax"
if [[ $# -gt 0 && "$1" != *=* ]]; then
    OUT="$1"
    shift
else
    OUT="$ROOT/runs/quickstart-$(date +%Y%m%d-%H%M%S)"
fi
for item in "$@"; do
    if [[ "$item" != *=* ]]; then
        echo "quickstart: '$item' is not a key=value override; usage: bash launch/quickstart.sh [OUTPUT_DIR] [key=value ...]" >&2
        exit 2
    fi
done
# a second run into the same folder would meet the first one's data and checkpoints (and
# preprocess's advice to pass --overwrite, which this script does not take)
if [[ -d "$OUT" && -n "$(ls -A "$OUT" 2>/dev/null)" ]]; then
    echo "quickstart: $OUT already holds a run: give a new OUTPUT_DIR (or none, for a dated one); to train that run further, add train.load=$OUT/checkpoints and a larger train.train_tokens to its train command (README, Quickstart)" >&2
    exit 2
fi
PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-2}"
cd "$ROOT"

# --- 1. install what is missing --------------------------------------------------------------
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    # On a CPU-only machine, point TORCH_SPEC at a CPU build (e.g. torch==2.13.0 where a local
    # wheel exists) so pip does not pull the multi-GB CUDA one.
    echo "[quickstart] installing ${TORCH_SPEC:-torch>=2.3,<3}"
    "$PYTHON" -m pip install "${TORCH_SPEC:-torch>=2.3,<3}"
fi
if ! "$PYTHON" -c "import megatron_id, deepspeed, tokenizers, omegaconf, safetensors, tensorboard, zstandard" 2>/dev/null; then
    echo "[quickstart] installing megatron_id and its dependencies (pip install -e .)"
    "$PYTHON" -m pip install -e "$ROOT"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# glibc returns large freed blocks to the OS at once; the logits of a 50K vocabulary are such
# blocks, and the page faults of re-mapping them cost ~40% of a CPU step. Keep them instead.
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-4294967296}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-68719476736}"

mkdir -p "$OUT"
echo "[quickstart] output folder: $OUT"

# --- 2. preprocess the bundled sample ----------------------------------------------------------
"$PYTHON" -m megatron_id.cli preprocess \
    --input tests/data/fineweb-edu-sample-150.jsonl \
    --tokenizer tests/data/gpt2-tokenizer.json \
    --output-prefix "$OUT/data/fineweb-edu" --append-eod --workers 2 --no-progress

# --- 3 and 4. train on 2 processes, validate, checkpoint ---------------------------------------
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    -m megatron_id.cli train \
    --config configs/model/tiny.yaml --config configs/train/quickstart.yaml \
    "data.data_path=[$OUT/data/fineweb-edu_text_document]" \
    "train.save=$OUT/checkpoints" "train.tensorboard_dir=$OUT/tensorboard" \
    "$@" 2>&1 | grep --line-buffered -v -e "\[WARNING\]" -e "\[INFO\]" | tee "$OUT/train.log"
status=${PIPESTATUS[0]}
if [[ $status -ne 0 ]]; then
    echo "[quickstart] training failed (exit $status); the log is $OUT/train.log" >&2
    exit "$status"
fi

latest="$(cat "$OUT/checkpoints/latest")"
echo
echo "[quickstart] done."
echo "  log:          $OUT/train.log"
echo "  TensorBoard:  tensorboard --logdir $OUT/tensorboard"
echo "  checkpoint:   $OUT/checkpoints/$latest"
echo "  resume:       add train.load=$OUT/checkpoints (and a larger train.train_tokens) to the command"
echo "  generate:     $PYTHON -m megatron_id.cli generate --checkpoint $OUT/checkpoints --prompt 'The water cycle'"
echo "  export:       $PYTHON -m megatron_id.cli export-hf --checkpoint $OUT/checkpoints --output $OUT/hf"
