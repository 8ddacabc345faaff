#!/usr/bin/env bash
# The first run on a GPU machine: one command, under 8 minutes on one H200 (two more checks when
# 2 GPUs are visible), PASS/FAIL per step with its figures. Run it first whenever a GPU is lent;
# its output goes into the session's note and the README (docs/gpu.md).
#
#   bash launch/gpu_check.sh [OUTPUT_DIR]
#   bash launch/gpu_check.sh --dry-run [OUTPUT_DIR]      (or DEVICE=cpu): the same steps on the CPU
#                                                        with small shapes: how CI tests this script
# Steps, in order:
#   resources  every kernel variant of the shipped configs compiled for this GPU's arch: shared
#              memory against the limit, registers, spills, tensor cores (python -m
#              megatron_id.ops.interdomain.resources)
#   kernel     the Triton core against the float64 PyTorch form at the 125M and 1.3B head shapes,
#              both readouts, bf16 and fp32 training: outputs, final state, every gradient, with
#              packed documents and an initial state; two backward passes bitwise equal
#   smoke      launch/gpu_smoke.sh at head_dim 64 and M 64 (train, resume, export, generate)
#   layouts    2 GPUs only: TP=2 + sequence parallel, and CP=2, train the losses of TP=1 (fp32,
#              relative 1e-4, the CPU tests' tolerance)
#   attention  softmax with packed documents / a sliding window (hybrids' A and W layers):
#              FlexAttention, compiled, against the dense-mask SDPA (outputs, q k v gradients)
#   decode     eager decode against the CUDA-graph decode: equal tokens, ms per token (the
#              1.3B config at batch 1, the paper's Appendix C measurement)
#   benchmark  benchmarks/gpu.py's tables in the time that is left
# Exits 1 when a step fails, 2 when it cannot start (no GPU, a non-empty OUTPUT_DIR).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
if [[ "${1:-}" == -* ]]; then
    echo "gpu_check: unknown option $1 (usage: bash launch/gpu_check.sh [--dry-run] [OUTPUT_DIR])" >&2
    exit 2
fi
if [[ "${DEVICE:-gpu}" == "cpu" ]]; then DRY=1; fi
OUT="${1:-$ROOT/runs/gpu-check-$(date +%Y%m%d-%H%M%S)}"
PYTHON="${PYTHON:-python3}"
BUDGET="${BUDGET:-480}"   # seconds for the whole check; the benchmark gets what the steps before leave
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
die() { echo "gpu_check: $1" >&2; exit 2; }

DRY_FLAG=()   # the Python steps' --dry-run
if [[ $DRY -eq 1 ]]; then
    DRY_FLAG=(--dry-run)
    export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # the kernel step sets TRITON_INTERPRET
    NGPU=2            # two gloo processes stand for two GPUs
    ARCH=sm_90
else
    info="$("$PYTHON" -c "import torch; assert torch.cuda.is_available(); p = torch.cuda.get_device_capability(); print(torch.cuda.device_count(), p[0], p[1])" 2>/dev/null)" \
        || die "no CUDA device visible to torch (--dry-run runs the steps on the CPU)"
    read -r NGPU MAJOR MINOR <<<"$info"
    ARCH="sm_${MAJOR}0"
    if [[ "$MAJOR" != 8 && "$MAJOR" != 9 ]]; then
        echo "gpu_check: sm_${MAJOR}${MINOR}: the resource table knows sm_80 and sm_90; showing sm_90" >&2
        ARCH=sm_90
    fi
fi
if [[ -e "$OUT" ]] && [[ -n "$(ls -A "$OUT" 2>/dev/null)" ]]; then
    die "$OUT exists and is not empty: give a new folder"
fi
mkdir -p "$OUT" || die "cannot create $OUT"
echo "gpu_check: $([[ $DRY -eq 1 ]] && echo "dry run on the CPU" || echo "$NGPU GPU(s), $ARCH"); logs in $OUT"

failed=0
results=()
step() {   # step NAME COMMAND...: run it, log it, show its figures, record PASS/FAIL
    local name="$1"; shift
    local log="$OUT/$name.log"
    local start=$SECONDS
    "$@" >"$log" 2>&1
    local status=$?
    grep -v -e '^WARNING' -e 'UserWarning' -e 'warn(' -e '^\s*$' "$log" | tail -n "${SHOW:-12}" | sed 's/^/      /'
    if [[ $status -eq 0 ]]; then
        results+=("PASS  $name ($((SECONDS - start)) s)")
        echo "PASS  $name ($((SECONDS - start)) s)"
    else
        results+=("FAIL  $name ($((SECONDS - start)) s): see $log")
        echo "FAIL  $name ($((SECONDS - start)) s): see $log"
        failed=1
    fi
}

# --- resources: the kernels the shipped configs reach, for this arch (compiled, never run:
# not under the interpreter)
if [[ $DRY -eq 1 ]]; then
    SHOW=40 step resources env -u TRITON_INTERPRET "$PYTHON" -m megatron_id.ops.interdomain.resources --arch "$ARCH" \
        --config configs/model/tiny.yaml --precision bf16 --jobs 2
else
    SHOW=100 step resources "$PYTHON" -m megatron_id.ops.interdomain.resources --arch "$ARCH" --jobs 8
fi

# --- kernel: the Triton core against the float64 PyTorch form
if [[ $DRY -eq 1 ]]; then
    SHOW=20 step kernel env TRITON_INTERPRET=1 "$PYTHON" launch/gpu_check.py kernel --dry-run
else
    SHOW=20 step kernel "$PYTHON" launch/gpu_check.py kernel
fi

# --- smoke: the user path at head_dim 64 and M 64 (the dry run: tiny, M 32)
if [[ $DRY -eq 1 ]]; then
    MODEL="model.state_size=32"   # the tiny model, cheap on the CPU: only the plumbing is tested
else
    MODEL="model.d_model=256 model.n_heads=4 model.state_size=64"
fi
smoke() {
    SMOKE_OVERRIDES="$MODEL" SMOKE_DEVICE="$([[ $DRY -eq 1 ]] && echo cpu || echo gpu)" PYTHON="$PYTHON" \
        bash launch/gpu_smoke.sh "$OUT/smoke"
}
step smoke smoke

# --- layouts: TP=2 + SP and CP=2 against TP=1 (needs 2 GPUs)
DATA="$OUT/smoke/data/fineweb-edu_text_document"
LOSSES=("data.data_path=[$DATA]" "data.split=100,0,0" data.tokenizer=tests/data/gpt2-tokenizer.json
        model.vocab_size=50257 train.precision=fp32 train.micro_batch_size=2
        train.global_batch_size=4 train.train_tokens=100000 optimizer.lr=1e-2 optimizer.warmup_tokens=512
        train.collective_timeout_minutes=5)
# shellcheck disable=SC2206  # the model items are words
LOSSES+=($MODEL)
losses() {   # losses NAME NPROC key=value...
    local name="$1" nproc="$2"; shift 2
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$nproc" launch/gpu_check.py losses \
        --steps "$((DRY == 1 ? 3 : 5))" --out "$OUT/losses-$name.json" "${LOSSES[@]}" "$@"
}
layouts() {
    losses tp1 1 || return 1
    losses tp2-sp 2 parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true || return 1
    losses cp2 2 parallel.context_parallel_size=2 || return 1
    "$PYTHON" launch/gpu_check.py compare "$OUT/losses-tp1.json" "$OUT/losses-tp2-sp.json" "$OUT/losses-cp2.json"
}
if [[ $NGPU -ge 2 ]]; then
    step layouts layouts
else
    results+=("SKIP  layouts: one GPU visible (needs 2)")
    echo "SKIP  layouts: one GPU visible (needs 2)"
fi

# --- attention: softmax with documents / a window (FlexAttention on CUDA) against the dense mask
step attention "$PYTHON" launch/gpu_check.py attention "${DRY_FLAG[@]}"

# --- decode: eager against the CUDA graph
step decode "$PYTHON" launch/gpu_check.py decode "${DRY_FLAG[@]}"

# --- benchmark: benchmarks/gpu.py in the time left
left=$((BUDGET - SECONDS - 30))
if [[ $DRY -eq 1 ]]; then
    SHOW=30 step benchmark "$PYTHON" benchmarks/gpu.py --device cpu --quick --json "$OUT/gpu.json"
elif [[ $left -ge 60 ]]; then
    SHOW=40 step benchmark "$PYTHON" benchmarks/gpu.py --budget "$left" --json "$OUT/gpu.json"
else
    results+=("SKIP  benchmark: ${left}s left of the ${BUDGET}s budget")
    echo "SKIP  benchmark: ${left}s left of the ${BUDGET}s budget"
fi

echo
echo "gpu_check summary ($OUT, $SECONDS s):"
printf '  %s\n' "${results[@]}"
if [[ $failed -ne 0 ]]; then
    echo "gpu_check: FAIL" >&2
    exit 1
fi
echo "gpu_check: PASS"
