#!/usr/bin/env bash
# GPU smoke test: the whole user path on one GPU in a few minutes, with PASS/FAIL per step.
#
#   bash launch/gpu_smoke.sh [OUTPUT_DIR]
#
# Steps: preprocess the bundled FineWeb-Edu sample; train the tiny model with NCCL, bf16
# autocast, ZeRO-1 and activation checkpointing for 4 steps (checkpoints at 2 and 4); resume
# to step 6 from `latest`; verify the checkpoint's manifest; export to Hugging Face format;
# load the export in bf16 (SSM parameters must stay float32) and generate with the cache.
# Run it first on any machine with a GPU; it exits non-zero when a step fails.
#
# NPROC (default 1) GPUs on this node, one process each. SMOKE_DEVICE=cpu runs the same steps
# on the CPU with gloo (how CI tests this script on machines without a GPU). SMOKE_OVERRIDES:
# more key=value items for the model (launch/gpu_check.sh trains head_dim 64 and M 64 with
# "model.d_model=256 model.n_heads=4 model.state_size=64": the tiny config alone compiles
# kernels no shipped config uses).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/gpu-smoke-$(date +%Y%m%d-%H%M%S)}"
PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-1}"
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${SMOKE_DEVICE:-gpu}" == "cpu" ]]; then
    export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
    if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_smoke: no CUDA device visible to torch (set SMOKE_DEVICE=cpu to test on the CPU)" >&2
        exit 2
    fi
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
fi
if [[ -e "$OUT" ]] && [[ -n "$(ls -A "$OUT" 2>/dev/null)" ]]; then
    echo "gpu_smoke: $OUT exists and is not empty: give a new folder" >&2
    exit 2
fi
mkdir -p "$OUT"
echo "gpu_smoke: output and logs in $OUT"

failed=0
results=()
step() {   # step NAME COMMAND...: run it, log it, record PASS/FAIL
    local name="$1"; shift
    local log="$OUT/$name.log"
    local start=$SECONDS
    if "$@" >"$log" 2>&1; then
        results+=("PASS  $name ($((SECONDS - start)) s)")
        echo "PASS  $name ($((SECONDS - start)) s)"
    else
        results+=("FAIL  $name ($((SECONDS - start)) s): see $log")
        echo "FAIL  $name ($((SECONDS - start)) s): last lines of $log:"
        tail -n 5 "$log" | sed 's/^/      /'
        failed=1
    fi
}

TRAIN=(-m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m megatron_id.cli train
       --config configs/model/tiny.yaml
       "data.data_path=[$OUT/data/fineweb-edu_text_document]" "data.split=90,10,0"
       data.tokenizer=tests/data/gpt2-tokenizer.json model.vocab_size=50257
       train.precision=bf16 train.zero_stage=1 train.activation_checkpointing=true
       train.micro_batch_size=2 "train.global_batch_size=$((2 * NPROC))"
       optimizer.warmup_tokens=256 train.eval_interval=2 train.eval_iters=1 train.log_interval=1
       train.save_interval=2 "train.save=$OUT/checkpoints" "train.load=$OUT/checkpoints"
       train.collective_timeout_minutes=5)
# shellcheck disable=SC2206  # word splitting of the override list is the point
TRAIN+=(${SMOKE_OVERRIDES:-})
TOKENS_PER_STEP=$((2 * NPROC * 64))

step preprocess "$PYTHON" -m data_tools.preprocess --input tests/data/fineweb-edu-sample-150.jsonl \
    --tokenizer tests/data/gpt2-tokenizer.json --output-prefix "$OUT/data/fineweb-edu" \
    --append-eod --no-progress
step train "$PYTHON" "${TRAIN[@]}" "train.train_tokens=$((4 * TOKENS_PER_STEP))"
check_latest() { [[ "$(cat "$OUT/checkpoints/latest")" == "$1" ]]; }
step train-checkpoint check_latest iter_0000004
step resume "$PYTHON" "${TRAIN[@]}" "train.train_tokens=$((6 * TOKENS_PER_STEP))" train.override_scheduler=true
resumed() { grep -q "steps 5-6" "$OUT/resume.log" && check_latest iter_0000006; }
step resume-continues-at-step-5 resumed
step check-checkpoint "$PYTHON" -m megatron_id.cli check-checkpoint "$OUT/checkpoints" --all
step export-hf "$PYTHON" -m megatron_id.cli export-hf --checkpoint "$OUT/checkpoints" --output "$OUT/hf"
step generate "$PYTHON" -m megatron_id.cli generate --checkpoint "$OUT/hf" --prompt "The water cycle" \
    --max-new-tokens 20
step hf-bf16-keeps-ssm-fp32 "$PYTHON" - "$OUT/hf" <<'EOF'
import sys
import torch
from transformers import AutoModelForCausalLM
device = "cuda" if torch.cuda.is_available() and __import__("os").environ.get("DS_ACCELERATOR") != "cpu" else "cpu"
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.bfloat16).to(device)
ssm = {n: p.dtype for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in ("a_im", "a_log", "log_dt", "c_re", "c_im")}
assert ssm and all(d == torch.float32 for d in ssm.values()), ssm
ids = torch.tensor([[464, 1660, 6772]], device=device)
out = model.generate(ids, max_new_tokens=8, do_sample=False)
assert out.shape == (1, 11), out.shape
print("ok", len(ssm), "SSM parameters in float32; generated", out[0, 3:].tolist())
EOF

echo
echo "gpu_smoke summary ($OUT):"
printf '  %s\n' "${results[@]}"
if [[ $failed -ne 0 ]]; then
    echo "gpu_smoke: FAIL" >&2
    exit 1
fi
echo "gpu_smoke: PASS"
