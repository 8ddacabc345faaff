#!/usr/bin/env bash
# Training on one machine with several GPUs (or CPU processes): the local twin of
# launch/slurm/train.sbatch. The arguments are exactly those of `megatron-id train`:
#
#   bash launch/local.sh --config configs/model/125m.yaml data.data_path=[...] ...
#   NPROC=2 MEGATRON_ID_DEVICE=cpu bash launch/local.sh --config configs/model/tiny.yaml ...
#
# Same run folder as the job script (MEGATRON_ID_RUN_DIR, default runs/local-<date-time>):
#   logs/<id>.out  logs/<id>.0.config.yaml  checkpoints/ (train.save unless set)
# and train.load defaults to train.save, so running the same command again with the same
# MEGATRON_ID_RUN_DIR resumes from `latest`. The config and the layout are checked once
# before any process starts.
#
# With train.max_restarts=K among the arguments a rank that dies, raises or hangs restarts every
# rank in place, up to K times, from the newest train.local_save / checkpoint
# (docs/training-loop.md, "In-job restarts and local saves").
#
# Environment: NPROC (processes; default: the number of visible GPUs, or 2 on CPU),
# MEGATRON_ID_DEVICE (gpu: default when a GPU is visible; cpu), MEGATRON_ID_PYTHON (python3),
# MEGATRON_ID_RUN_DIR; OMP_NUM_THREADS and NCCL_* as exported.
# To stop with a checkpoint, send SIGTERM or SIGUSR1 to this script (or to the training
# processes, `pkill -USR1 -f "megatron_id.cli train"`): each rank finishes its step, saves and
# exits with status 3, and so does this script (stopped early: not a finished run; the SLURM
# script's ranks exit 0 instead). Ctrl-C stops at once without a save (exit 130).
set -uo pipefail

PYTHON="${MEGATRON_ID_PYTHON:-python3}"
ID="local-$(date +%Y%m%d-%H%M%S)-$$"
RUN_DIR="$(realpath -m "${MEGATRON_ID_RUN_DIR:-runs/$ID}")"
LOGS="$RUN_DIR/logs"

say() { echo "[megatron-id $ID $(date +%FT%T)] $*"; }
die() { say "error: $1" >&2; exit "${2:-2}"; }   # die MESSAGE [STATUS]

gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)" \
    || die "$PYTHON cannot import torch: activate the environment megatron_id is installed in, or set MEGATRON_ID_PYTHON"
DEVICE="${MEGATRON_ID_DEVICE:-$([[ "$gpus" -gt 0 ]] && echo gpu || echo cpu)}"
case "$DEVICE" in
    gpu)
        [[ "$gpus" -gt 0 ]] || die "MEGATRON_ID_DEVICE=gpu but torch sees no GPU"
        NPROC="${NPROC:-$gpus}"
        export NCCL_DEBUG="${NCCL_DEBUG:-WARN}" TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
        ;;
    cpu)
        NPROC="${NPROC:-2}"
        export DS_ACCELERATOR=cpu
        ;;
    *) die "MEGATRON_ID_DEVICE=$DEVICE: use gpu or cpu" ;;
esac
export MEGATRON_ID_DEVICE="$DEVICE"   # (job-prepare: the memory estimate of this device)
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "NPROC=$NPROC: give a positive number of processes"
for arg in "$@"; do   # the arguments are train's, less the process count, which is this script's
    [[ "$arg" == --nproc || "$arg" == --nproc=* ]] && die "$arg: the number of processes is NPROC here (NPROC=2 bash launch/local.sh ...)"
done
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1

created_run_dir=0
[[ -e "$RUN_DIR" ]] || created_run_dir=1
mkdir -p "$LOGS" || die "cannot create the run folder $LOGS (MEGATRON_ID_RUN_DIR)"
prepared="$LOGS/$ID.prepare"
"$PYTHON" -m megatron_id.cli job-prepare --run-dir "$RUN_DIR" --world-size "$NPROC" \
    --job-id "$ID" --attempt 0 -- "$@" >"$prepared"
status=$?
if [[ $status -ne 0 ]]; then
    [[ $created_run_dir -eq 1 ]] && rm -rf "$RUN_DIR"   # nothing of this run is worth keeping
    die "the training arguments were refused (above); nothing was started" "$status"
fi
extra=()
declare -A job
while IFS= read -r line; do
    case "$line" in
        override=*) extra+=("${line#override=}") ;;
        *=*) job["${line%%=*}"]="${line#*=}" ;;
    esac
done <"$prepared"

{
    say "run folder $RUN_DIR; $NPROC process(es) on $(hostname) ($DEVICE)"
    say "${job[mixer]} ${job[model]}: TP=${job[tensor]} PP=${job[pipe]} DP=${job[data]}, micro-batch ${job[micro_batch]} x ${job[accumulation]} accumulation, about ${job[memory_gib]} GiB per GPU (megatron-id plan's estimate); step ${job[step]} of ${job[train_iters]}"
    if [[ "${job[step]}" -gt 0 ]]; then say "resuming from ${job[save]}/latest (step ${job[step]})"; else say "starting from scratch; checkpoints go to ${job[save]}"; fi
    say "config ${job[config_record]}; log $LOGS/$ID.out"
} | tee -a "$LOGS/$ID.out"
if [[ "${job[step]}" -ge "${job[train_iters]}" ]]; then
    say "finished already: step ${job[step]} of ${job[train_iters]}; nothing to do" | tee -a "$LOGS/$ID.out"
    exit 0
fi

# megatron-id starts the ranks itself (--nproc): one line for a refusal and the ranks' own exit
# status, where torchrun adds its ChildFailedError report and exits 1. SIGTERM / SIGUSR1 / SIGINT
# to this script go to it, and it to every rank (they save and stop: exit 3; SIGINT: 130).
"$PYTHON" -m megatron_id.cli train --nproc "$NPROC" "$@" "${extra[@]}" > >(tee -i -a "$LOGS/$ID.out") 2>&1 &
train=$!
for sig in TERM USR1 INT; do
    # shellcheck disable=SC2064  # (the signal's name now; the pid at the signal)
    trap "kill -$sig \"\$train\" 2>/dev/null" "$sig"
done
while kill -0 "$train" 2>/dev/null; do wait "$train"; done   # a trapped signal ends a wait early
wait "$train"
status=$?
trap - TERM USR1 INT
wait   # tee: the log is complete before the last lines
if [[ $status -eq 3 ]]; then   # stopped by a signal after saving (megatron-id train's STOPPED_EXIT_STATUS)
    say "stopped early (exit 3) with a checkpoint; to resume, run the same command with MEGATRON_ID_RUN_DIR=$RUN_DIR" | tee -a "$LOGS/$ID.out" >&2
elif [[ $status -eq 130 ]]; then   # Ctrl-C: stopped at once, without a save (the line above says where)
    say "interrupted (exit 130); the log is $LOGS/$ID.out" | tee -a "$LOGS/$ID.out" >&2
elif [[ $status -ne 0 ]]; then
    say "training failed (exit $status); the log is $LOGS/$ID.out" | tee -a "$LOGS/$ID.out" >&2
fi
exit "$status"
