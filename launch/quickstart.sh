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
    echo "quickstart: $OUT already holds a run: give a new OUTPUT_DIR (or none, for a dated one); to train that run further, add train.load=$OUT/checkpoints, a larger train.train_tokens and train.override_scheduler=true (the cosine decay moves) to its train command (README, Quickstart)" >&2
    exit 2
fi
PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-2}"
cd "$ROOT"

# --- 1. install what is missing --------------------------------------------------------------
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    # TORCH_SPEC chooses the build. Otherwise: with a GPU (nvidia-smi answers) the CUDA build
    # from PyPI; without one the CPU build, the version the README's Install section pins:
    # PyPI's Linux torch is the CUDA build (6 GB with its nvidia-* wheels), so PyTorch's CPU
    # index is added, and pip takes its 2.13.0+cpu (a local wheel where pip finds one).
    if [[ -n "${TORCH_SPEC:-}" ]]; then
        torch_install=("$TORCH_SPEC")
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        torch_install=("torch>=2.3,<3")
    else
        torch_install=("torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu)
        echo "[quickstart] no GPU (nvidia-smi): installing the CPU build of torch; set TORCH_SPEC to choose another"
    fi
    echo "[quickstart] pip install ${torch_install[*]}"
    "$PYTHON" -m pip install "${torch_install[@]}"
fi
if ! "$PYTHON" -c "import megatron_id, deepspeed, tokenizers, omegaconf, safetensors, tensorboard, zstandard" 2>/dev/null; then
    echo "[quickstart] installing megatron_id and its dependencies (pip install -e .)"
    "$PYTHON" -m pip install -e "$ROOT"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# (glibc's malloc settings, worth ~1.5x on a CPU step, are megatron-id train's own:
# megatron_id/allocator.py; the by-hand commands of the README get them too)

mkdir -p "$OUT"
echo "[quickstart] output folder: $OUT"

# --- 2. preprocess the bundled sample ----------------------------------------------------------
"$PYTHON" -m megatron_id.cli preprocess \
    --input tests/data/fineweb-edu-sample-150.jsonl \
    --tokenizer tests/data/gpt2-tokenizer.json \
    --output-prefix "$OUT/data/fineweb-edu" --append-eod --workers 2 --no-progress

# --- 3 and 4. train on 2 processes, validate, checkpoint ---------------------------------------
set +e   # (its status is read below: a failure says where the log is)
"$PYTHON" -m megatron_id.cli train --nproc "$NPROC" \
    --config configs/model/tiny.yaml --config configs/train/quickstart.yaml \
    "data.data_path=[$OUT/data/fineweb-edu_text_document]" \
    "train.save=$OUT/checkpoints" "train.tensorboard_dir=$OUT/tensorboard" \
    "$@" 2>&1 | (trap '' INT; exec grep --line-buffered -v -e "\[WARNING\]" -e "\[INFO\]") \
    | tee -i "$OUT/train.log"   # (the filters outlive a Ctrl-C, so the last line is shown)
status=${PIPESTATUS[0]}
set -e
if [[ $status -ne 0 ]]; then
    case $status in
        3) what="stopped by a signal after saving" ;;
        130) what="interrupted (Ctrl-C)" ;;
        *) what="failed" ;;
    esac
    echo "[quickstart] training $what (exit $status); the log is $OUT/train.log" >&2
    exit "$status"
fi

latest="$(cat "$OUT/checkpoints/latest")"
echo
echo "[quickstart] done."
echo "  log:          $OUT/train.log"
echo "  TensorBoard:  tensorboard --logdir $OUT/tensorboard"
echo "  checkpoint:   $OUT/checkpoints/$latest"
echo "  resume:       add train.load=$OUT/checkpoints (and a larger train.train_tokens with train.override_scheduler=true) to the command"
echo "  generate:     $PYTHON -m megatron_id.cli generate --checkpoint $OUT/checkpoints --prompt 'The water cycle'"
echo "  export:       $PYTHON -m megatron_id.cli export-hf --checkpoint $OUT/checkpoints --output $OUT/hf"
