"""The `megatron-id` command. Subcommands grow with the project; each is small.

    megatron-id params --config configs/model/125m.yaml [key=value ...]
    megatron-id preprocess --input ... --tokenizer ... --output-prefix ...   (= python -m data_tools.preprocess)
    megatron-id train --nproc N --config run.yaml [key=value ...]          (or under torchrun / srun, without --nproc)
    megatron-id export-hf --checkpoint runs/x/checkpoints --output runs/x/hf
    megatron-id import-hf --input runs/x/hf --output runs/y/checkpoints --tensor-parallel 2
    megatron-id generate --checkpoint runs/x/hf --prompt "The water cycle" --max-new-tokens 50
    megatron-id check-checkpoint runs/x/checkpoints [--all]
    megatron-id kernel-resources --config configs/model/1p3b.yaml [--arch sm_80 sm_90]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from .config import load_config
from .errors import run_guarded


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", default=[], metavar="YAML",
                   help="config file; repeat to merge several (later wins)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides, e.g. model.mixer=softmax model.n_layers=2")


def cmd_params(args) -> int:
    from .model.accounting import report
    from .model.pattern import describe_pattern, is_hybrid
    cfg = load_config(args.config, args.overrides)
    r = report(cfg.model)
    if args.json:
        print(json.dumps(asdict(r)))
        return 0
    m = cfg.model
    print(f"mixer={m.mixer.value} d_model={m.d_model} n_layers={m.n_layers} n_heads={m.n_heads} "
          f"state_size={m.state_size} query_readout={m.query_readout} "
          f"dual_kv_input={m.dual_kv_input} rope={m.rope} seq_length={m.seq_length}")
    if is_hybrid(m) or m.layer_pattern:
        window = f", window {m.window}" if m.window else ""
        print(f"layers: {describe_pattern(m)}{window}")
    rows = [("parameters", f"{r.parameters:,}"),
            ("non-embedding parameters", f"{r.non_embedding_parameters:,}")]
    if r.state_per_token_per_layer is not None:
        rows.append(("recurrent state per interdomain/s4d layer (real numbers, any context)",
                     f"{r.state_per_token_per_layer:,}"))
    if r.kv_cache_per_token_per_layer is not None:
        rows.append(("KV cache per softmax layer (real numbers)",
                     f"{r.kv_cache_per_token_per_layer:,} x context length"))
    if is_hybrid(m) or m.layer_pattern:
        grows = f" + {r.decode_state_per_token:,} x context" if r.decode_state_per_token else " (any context)"
        rows.append(("decode state, all layers (real numbers)", f"{r.fixed_state:,}{grows}"))
        rows.append((f"  at model.seq_length={m.seq_length:,}", f"{r.decode_state(m.seq_length):,}"))
    rows += [("forward FLOPs per token", f"{r.forward_flops_per_token:,}"),
             ("training FLOPs per token (3 x forward)", f"{r.training_flops_per_token:,}")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v:>20}")
    return 0


# The exit status of a run that a signal (SIGTERM, SIGUSR1) stopped before train_iters, after
# saving: not 0, so that a script or an `afterok` chain does not take it for a finished run, and
# not 1 or 2 (an error) [our choice: 3]. launch/slurm/train.sbatch sets
# MEGATRON_ID_STOPPED_EXIT_STATUS=0: srun's --kill-on-bad-exit would end the other ranks on a
# non-zero exit, and the script tells a stop from a finish by the checkpoint's step itself.
STOPPED_EXIT_STATUS = 3


def _stopped_exit_status() -> int:
    value = os.environ.get("MEGATRON_ID_STOPPED_EXIT_STATUS", "")
    return int(value) if value.isdigit() else STOPPED_EXIT_STATUS


def cmd_train(args) -> int:
    # SIGTERM / SIGUSR1 during the minutes of imports and setup must not kill the rank (their
    # default action): note them, and the trainer stops at its first step boundary
    early_stop = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: early_stop.append(signum))
    from .allocator import keep_freed_memory
    keep_freed_memory()   # glibc keeps freed blocks: ~1.5x on CPU steps (allocator.py)
    if args.nproc is not None:
        from .training.launcher import check_nproc
        check_nproc(args.nproc)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _cuda() else "cuda")
    import warnings
    # DeepSpeed calls a torch.distributed function that torch has deprecated: not the user's concern
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")
    if args.nproc is not None:   # start the ranks of this machine (training/launcher.py)
        import contextlib
        import io
        from .training.launcher import check_devices, check_host, launch
        from .training.layout import training_layout
        check_devices(args.nproc)
        said = io.StringIO()   # its warnings: rank 0 says them, or this process before its error
        try:
            with contextlib.redirect_stderr(said):
                cfg = load_config(args.config, args.overrides)   # errors: once, before any rank starts
                layout = training_layout(cfg, args.nproc)   # as is a layout the ranks cannot hold
                check_host(cfg, layout, args.nproc)   # and, on CPU, more memory than the host has
        except BaseException:
            sys.stderr.write(said.getvalue())
            raise
        debug = "--debug" in sys.argv[1:]
        return launch(args.nproc, [*(a for c in args.config for a in ("--config", c)), *args.overrides], debug,
                      early=early_stop)
    cfg = load_config(args.config, args.overrides)   # config errors first, before heavy imports
    from .training.distributed import init_distributed_from_env
    from .training.engine import Trainer
    import torch.distributed as dist
    init_distributed_from_env(cfg.train.collective_timeout_minutes)
    # from here on the process ends by os._exit, an error too (a refused config after the
    # process group started aborted at teardown now and then: exit -6 instead of 2; see entry)
    _TEARDOWN.append(lambda: None)
    trainer, status = None, 0
    t = cfg.train
    try:
        trainer = Trainer(cfg, skip_finished=True)   # a finished run is not built again
        trainer.stop_requested = early_stop[0] if early_stop else False
        trainer.train()
        iters = trainer.layout.train_iters
        if trainer.step < iters and trainer.stop_signal:
            status = _stopped_exit_status()
            if dist.get_rank() == 0:
                name = signal.Signals(trainer.stop_signal).name
                if not t.save or trainer.step == 0:
                    why = "train.save unset" if not t.save else "no step was trained"
                    saved = f"nothing saved ({why}): a rerun starts from step 1"
                else:
                    saved = (f"checkpoint {trainer._last_checkpoint()}; resume with the same command and "
                             f"train.load={t.save}")
                print(f"stopped at step {trainer.step:,} of {iters:,} ({name}): {saved} (exit {status})",
                      file=sys.stderr, flush=True)
        elif dist.get_rank() == 0 and trainer.finished_at is None:   # (else "already finished at ...")
            print(f"finished at step {trainer.step}; checkpoint: {t.save or 'not saved (train.save unset)'}; "
                  f"TensorBoard: {t.tensorboard_dir or 'off (train.tensorboard_dir unset)'}",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        # Ctrl-C stops at once (no save, as in Megatron); say what is on disk, not only "interrupted"
        if dist.get_rank() == 0:
            where = (f"at step {trainer.step:,} of {trainer.layout.train_iters:,}; last checkpoint: "
                     f"{trainer._last_checkpoint()}" if trainer is not None else
                     "before training started: nothing was saved")
            print(f"megatron-id: interrupted (SIGINT) {where}", file=sys.stderr, flush=True)
        return 130
    finally:
        if trainer is not None:
            trainer.close()
    # every rank reaches the end before any exits; then entry() ends the process without the
    # interpreter's teardown of the process group and DeepSpeed (see entry)
    _TEARDOWN.append(dist.barrier)
    return status


# Run after main() returns, just before the process exits (see entry()).
_TEARDOWN: list = []


def cmd_check_checkpoint(args) -> int:
    """Verify checkpoint folders against their manifests offline: the one `latest` names (or
    every iter_ folder with --all, or the iter_ folder given). Exit 0 only when all are whole."""
    from pathlib import Path
    from .checkpoint.files import CLIENT_STATE, STAGING, latest_folder
    from .checkpoint.integrity import MANIFEST, CheckpointError, verify_checkpoint
    root = Path(args.path)
    if not root.exists():
        raise CheckpointError(f"{root} does not exist: give a train.save folder or an iter_XXXXXXX folder.")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a folder: give a train.save folder or an iter_XXXXXXX folder.")
    if (root / MANIFEST).is_file() or (root / CLIENT_STATE).is_file():
        folders = [root]
    elif args.all:
        folders = sorted(p for p in root.glob("iter_*") if p.is_dir())
    else:
        folders = [f for f in [latest_folder(root)] if f is not None]
    if not folders and (root / "config.json").is_file():
        raise CheckpointError(f"{root} is an export without {MANIFEST} (written before exports carried one): its "
                              f"files cannot be verified. Export the checkpoint again to get one.")
    if not folders:
        raise CheckpointError(f"{root} holds no checkpoint (no `latest`, no iter_ folder): give a train.save "
                              f"folder or an iter_XXXXXXX folder.")
    stale = sorted((root / STAGING).glob("iter_*"))
    for path in stale:
        print(f"note: {path} was left by an interrupted save (the next run into {root} removes it)")
    damaged = 0
    for folder in folders:
        problems = verify_checkpoint(folder)
        if problems:
            damaged += 1
            for problem in problems:
                print(f"DAMAGED {folder}: {problem}", file=sys.stderr)
        else:
            print(f"ok {folder}")
    if damaged and (root / "config.json").is_file():   # an export (it carries the same manifest)
        raise CheckpointError(f"the export {root} is damaged (listed above): export the checkpoint again with "
                              f"megatron-id export-hf.")
    if damaged:
        raise CheckpointError(f"{damaged} of {len(folders)} checkpoint folders in {root} are damaged "
                              f"(listed above): resume from a whole one by writing its name into {root}/latest.")
    return 0


# every command that pairs a trained model with a tokenizer checks it is the model's own
MISMATCH_HELP = "use a tokenizer other than the one the model was trained with, on purpose"


def cmd_export_hf(args) -> int:
    from .hf.export import export_hf
    out = export_hf(args.checkpoint, args.output, tokenizer=args.tokenizer,
                    prefill_chunk_size=args.prefill_chunk_size, overwrite=args.overwrite,
                    allow_tokenizer_mismatch=args.allow_tokenizer_mismatch)
    print(f"exported {args.checkpoint} -> {out} (load with AutoModelForCausalLM.from_pretrained("
          f"'{out}', trust_remote_code=True))")
    return 0


def cmd_import_hf(args) -> int:
    from .hf.export import import_hf
    out = import_hf(args.input, args.output, args.tensor_parallel, args.pipeline_parallel,
                    overwrite=args.overwrite, allow_tokenizer_mismatch=args.allow_tokenizer_mismatch,
                    verify=args.verify)
    print(f"imported {args.input} -> {out} (TP={args.tensor_parallel}, PP={args.pipeline_parallel}; "
          f"weights only: train with train.load={out})")
    return 0


def cmd_generate(args) -> int:
    from .errors import BadOptionError
    from .generation import check_options, generate_ids, load_model_and_tokenizer, resolve_device, stream_text
    import torch
    # option values first: a bad one fails before the model is loaded
    check_options(args.max_new_tokens, args.temperature, args.top_k, args.prefill_chunk_size)
    device = resolve_device(args.device)
    if args.cuda_graph and device.type != "cuda":
        raise BadOptionError(f"--cuda-graph needs a CUDA device; --device is {device}: drop --cuda-graph "
                             "or give --device cuda.")
    if args.batch_size < 1:
        raise BadOptionError(f"--batch-size {args.batch_size}: at least 1 (sequences decoded at once).")
    prompts_text = None
    if args.input_file is not None:
        if args.cuda_graph:
            raise BadOptionError("--cuda-graph decodes one prompt: drop it with --input-file (the batch "
                                 "runs the fused step).")
        prompts_text = read_prompts(args.input_file)
        check_output_file(args.output_file)
    elif args.output_file is not None:
        raise BadOptionError("--output-file goes with --input-file (one completion per prompt); a single "
                             "--prompt streams to the terminal.")
    model, tokenizer, eos = load_model_and_tokenizer(args.checkpoint, args.tokenizer,
                                                     args.allow_tokenizer_mismatch, args.verify)
    from .generation import static_decode_refusal
    from .inference.fused_decode import fused_decode_refusal
    why = static_decode_refusal(model.cfg) if args.cuda_graph else None
    if why:
        raise BadOptionError(f"--cuda-graph needs fixed-size states: {why}; drop --cuda-graph.")
    unfused = fused_decode_refusal(model)
    if args.decode == "fused" and unfused:
        raise BadOptionError(f"--decode fused: {unfused}; use --decode eager.")
    model.to(device)
    eos_id = None if args.ignore_eos else eos
    if prompts_text is not None:
        return generate_file(args, model, tokenizer, eos_id, prompts_text, unfused)
    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
        raise BadOptionError(f"--prompt {args.prompt!r} gives no tokens: give a prompt with some text.")
    decode = "graph" if args.cuda_graph else ("eager" if args.decode == "eager" or unfused else "fused")
    if decode == "fused":   # a hybrid's KV cache is allocated whole: refused before the prompt is echoed
        from .inference.fused_decode import check_kv_pool
        check_kv_pool(model, 1, len(prompt) + max(args.max_new_tokens, 1), device,
                      f"--max-new-tokens {args.max_new_tokens:,} after a prompt of {len(prompt):,} tokens",
                      "Ask for fewer --max-new-tokens")
    if decode == "fused" and next(model.parameters()).device.type == "cpu":
        from .inference.cpu_kernel import fixed_state_step_kernel
        fixed_state_step_kernel()   # built (once) before the prompt is echoed, so its message comes first
    sys.stdout.write(args.prompt)
    stream_text(tokenizer, generate_ids(
        model, prompt, args.max_new_tokens, eos_id=eos_id,
        temperature=args.temperature, top_k=args.top_k, prefill_chunk_size=args.prefill_chunk_size,
        generator=torch.Generator(device=device).manual_seed(args.seed), decode=decode))
    sys.stdout.write("\n")
    return 0


def read_prompts(path: str) -> list[str]:
    """--input-file: one prompt per line (a .jsonl file: a {"prompt": ...} object per line).
    Blank lines are skipped, counted and reported; anything else that is not a prompt is refused."""
    from .errors import BadOptionError
    file = Path(path)
    if file.is_dir():
        raise BadOptionError(f"--input-file {path} is a folder: give a file of prompts, one per line (.jsonl: a "
                             f"{{\"prompt\": ...}} object per line).")
    if not file.is_file():
        raise BadOptionError(f"--input-file {path}: no such file.")
    prompts, blank = [], 0
    data = file.read_bytes()
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise BadOptionError(f"--input-file {path} is UTF-16 text (it starts with a byte-order mark), not UTF-8: "
                             f"save it as UTF-8, e.g. iconv -f utf-16 -t utf-8 {path} > prompts.txt.")
    try:
        text = data.decode("utf-8-sig")   # a UTF-8 byte-order mark is not part of the first prompt
    except UnicodeDecodeError as err:
        start = err.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        line = data.count(b"\n", 0, start) + 1
        raise BadOptionError(f"--input-file {path}, line {line} (byte {start:,}): not UTF-8 text (byte "
                             f"0x{data[start]:02x}): save the file as UTF-8, e.g. iconv -f latin1 -t utf-8 "
                             f"{path} > prompts.txt.") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            blank += 1
            continue
        if file.suffix == ".jsonl":
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadOptionError(f"--input-file {path}, line {number}: not JSON ({e.msg}): a .jsonl file "
                                     f"holds one {{\"prompt\": ...}} object per line.") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise BadOptionError(f"--input-file {path}, line {number}: no \"prompt\" string in it.")
            line = record["prompt"]
        prompts.append(line)
    if blank:
        print(f"--input-file {path}: skipped {blank} blank line(s)", file=sys.stderr)
    if not prompts:
        raise BadOptionError(f"--input-file {path} holds no prompts.")
    return prompts


def check_output_file(path: str | None) -> None:
    from .errors import BadOptionError, OutputExistsError
    if path is None:
        return
    out = Path(path)
    if out.exists():
        raise OutputExistsError(f"--output-file {path} exists: give a new file (it is never replaced).")
    if not out.parent.is_dir():
        raise BadOptionError(f"--output-file {path}: the folder {out.parent} does not exist.")
    from .errors import check_writable   # before the model is loaded and every prompt generated
    check_writable(out.parent, f"--output-file {path}: its folder")


def generate_file(args, model, tokenizer, eos_id, prompts_text: list[str], unfused: str | None) -> int:
    """Every prompt of --input-file, --batch-size at a time with continuous batching (the fused
    step); one JSON line per prompt, in the file's order, to --output-file (written whole, then
    renamed into place) or stdout."""
    import torch
    from .errors import BadOptionError
    from .generation import generate_ids
    from .inference.batching import generate_batch
    prompts = [tokenizer.encode(text).ids for text in prompts_text]
    for number, (text, ids) in enumerate(zip(prompts_text, prompts), 1):
        if not ids:
            raise BadOptionError(f"--input-file {args.input_file}: prompt {number} ({text!r}) gives no tokens.")
    done = [0]

    def progress(index, tokens):
        done[0] += 1
        print(f"[{done[0]}/{len(prompts)}] prompt {index + 1}: {len(tokens)} tokens", file=sys.stderr, flush=True)

    if unfused or args.decode == "eager":   # one prompt at a time with the model's own step
        device = next(model.parameters()).device
        completions = []
        for i, ids in enumerate(prompts):
            completions.append(list(generate_ids(
                model, ids, args.max_new_tokens, eos_id=eos_id, temperature=args.temperature, top_k=args.top_k,
                prefill_chunk_size=args.prefill_chunk_size,
                generator=torch.Generator(device=device).manual_seed(args.seed + i))))
            progress(i, completions[-1])
    else:
        from .inference.fused_decode import check_kv_pool
        check_kv_pool(model, min(args.batch_size, len(prompts)), max(map(len, prompts)) + args.max_new_tokens,
                      next(model.parameters()).device, f"--max-new-tokens {args.max_new_tokens:,} after prompts of up "
                      f"to {max(map(len, prompts)):,} tokens x --batch-size {min(args.batch_size, len(prompts))}",
                      "Ask for fewer --max-new-tokens or a smaller --batch-size")
        completions = generate_batch(model, prompts, args.max_new_tokens, slots=args.batch_size, eos_id=eos_id,
                                     temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                                     prefill_chunk_size=args.prefill_chunk_size, on_finish=progress)
    lines = []
    for text, ids in zip(prompts_text, completions):
        finish = "stop" if ids and ids[-1] == eos_id else "length"
        lines.append(json.dumps({"prompt": text, "completion": tokenizer.decode(ids), "tokens": len(ids),
                                 "finish_reason": finish}, ensure_ascii=False))
    body = "\n".join(lines) + "\n"
    if args.output_file is None:
        sys.stdout.write(body)
        return 0
    tmp = Path(f"{args.output_file}.tmp-{os.getpid()}")
    try:
        tmp.write_text(body, encoding="utf-8")
        os.replace(tmp, args.output_file)
    except OSError as err:   # (a disk that filled while generating): the completions are not lost
        tmp.unlink(missing_ok=True)
        sys.stdout.write(body)
        sys.stdout.flush()
        raise OSError(err.errno, f"--output-file {args.output_file} could not be written ({err.strerror or err}): "
                                 f"the {len(lines)} completions were written to stdout instead") from None
    print(f"wrote {len(lines)} completions to {args.output_file}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    """An OpenAI-compatible completions server over continuous batching (inference/server.py)."""
    from .errors import BadOptionError
    from .generation import check_options
    for option, value, least in (("--slots", args.slots, 1), ("--port", args.port, 0),
                                 ("--max-pending", args.max_pending, 1), ("--max-model-len", args.max_model_len, 2),
                                 ("--threads", args.threads, 1)):
        if value is not None and value < least:
            raise BadOptionError(f"{option} {value}: at least {least}.")
    if args.port > 65535 or args.drain_timeout < 0:
        raise BadOptionError(f"--port {args.port} / --drain-timeout {args.drain_timeout}: a port up to 65535, "
                             f"a timeout of at least 0 seconds.")
    check_options(0, prefill_chunk_size=args.prefill_chunk_size)
    from .inference.server import serve
    return serve(args)


def cmd_plan(args) -> int:
    """Memory and communication per GPU of every layout the engine accepts (training/plan.py)."""
    from .training.plan import GiB, parse_size, plan, rank_key, recommend
    from .model.pattern import model_label
    from .config import ConfigError
    # every option before the config is read; `is not None`: 0 is a value given, and wrong
    for flag, value, least in (("--nodes", args.nodes, 1), ("--gpus-per-node", args.gpus_per_node, 1),
                               ("--seq-length", args.seq_length, 1), ("--global-batch", args.global_batch, 1),
                               ("--max-micro-batch", args.max_micro_batch, 1), ("--top", args.top, 0)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} {value}: must be at least {least}.")
    if not 0 <= args.margin < 1:
        raise ConfigError(f"--margin {args.margin}: must be in [0, 1) (a fraction of --gpu-memory kept free).")
    gpu_memory = parse_size(args.gpu_memory, "--gpu-memory")
    overhead = parse_size(args.overhead, "--overhead", allow_zero=True)
    usable = (1 - args.margin) * gpu_memory
    if overhead >= usable:   # (once "no layout fits: use more GPUs ...", which no number of GPUs cures)
        raise ConfigError(f"--overhead {args.overhead} is not less than the {usable / GiB:.3g} GiB a layout may use "
                          f"of --gpu-memory {args.gpu_memory} ({1 - args.margin:.0%}, --margin {args.margin:g}): "
                          f"no layout could fit; check --gpu-memory (one GPU's), lower --overhead (default 2GiB) or --margin "
                          f"(default 0.1).")
    overrides = list(args.overrides)
    if args.seq_length is not None:
        overrides.append(f"model.seq_length={args.seq_length}")
    if args.global_batch is not None:
        overrides.append(f"train.global_batch_size={args.global_batch}")
    cfg = load_config(args.config, overrides)
    estimates = plan(cfg, args.nodes * args.gpus_per_node, gpu_memory, margin=args.margin,
                     overhead=overhead, max_micro_batch=args.max_micro_batch)
    best, why = recommend(estimates)
    if args.json:
        print(json.dumps({"gpu_memory": gpu_memory, "margin": args.margin,
                          "recommended": asdict(best) if best else None, "reason": why,
                          "layouts": [asdict(e) for e in estimates]}))
        return 0 if best else 1
    m, t = cfg.model, cfg.train
    print(f"{model_label(m)} d_model={m.d_model} n_layers={m.n_layers} seq_length={m.seq_length} "
          f"global batch {t.global_batch_size} sequences, precision {t.precision.value}; "
          f"{args.nodes} x {args.gpus_per_node} GPUs of {gpu_memory / GiB:.0f} GiB, fits = total <= "
          f"{1 - args.margin:.0%} of that (overhead {overhead / GiB:.1f} GiB per GPU included)")
    rows = sorted(estimates, key=rank_key)   # the recommended layout first
    if args.top:
        rows = rows[:args.top]
    header = ("TP", "PP", "DP", "ZeRO", "mb", "GA", "ckpt", "weights", "grads", "optim", "zero-buf",
              "step", "activ", "total GiB", "fits", "comm DP", "comm TP", "comm PP GiB/step")
    print("  ".join(f"{h:>7}" for h in header))
    for e in rows:
        cells = (e.tensor, e.pipe, e.data, e.zero_stage, e.micro_batch_size, e.gradient_accumulation,
                 "yes" if e.activation_checkpointing else "no",
                 *(f"{v / GiB:.1f}" for v in (e.weights, e.gradients, e.optimizer, e.zero_buffers,
                                               e.optimizer_step, e.activations, e.total)),
                 "FITS" if e.fits else "-",
                 *(f"{v / GiB:.2f}" for v in (e.comm_dp, e.comm_tp, e.comm_pp)))
        print("  ".join(f"{c:>7}" for c in cells))
    if args.top and len(estimates) > args.top:
        print(f"... {len(estimates) - args.top} more (--top 0 for all)")
    if best:
        print(f"recommended: TP={best.tensor} PP={best.pipe} DP={best.data} ZeRO-{best.zero_stage} "
              f"micro-batch {best.micro_batch_size} activation checkpointing "
              f"{'on' if best.activation_checkpointing else 'off'}: {why}")
        print(f"  megatron-id train ... parallel.tensor_model_parallel_size={best.tensor} "
              f"parallel.pipeline_model_parallel_size={best.pipe} train.zero_stage={best.zero_stage} "
              f"train.micro_batch_size={best.micro_batch_size} "
              f"train.activation_checkpointing={str(best.activation_checkpointing).lower()}")
        return 0
    print(f"megatron-id plan: {why}", file=sys.stderr)   # an empty result is not a success
    return 1


def cmd_job_prepare(args) -> int:
    """For launch/slurm/train.sbatch: resolve and record the config, check the layout against
    the job's tasks, print key=value lines for the script (training/job.py)."""
    from .training.job import prepare, shell_lines
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    parsed = argparse.ArgumentParser(prog="megatron-id train", allow_abbrev=False)
    _add_config_args(parsed)
    parsed = _parse_with_overrides_anywhere(parsed, train_args)
    values = prepare(args.run_dir, parsed.config, parsed.overrides, world_size=args.world_size,
                     job_id=args.job_id, attempt=args.attempt, check_run=True)   # train's own checks too
    sys.stdout.write(shell_lines(values))
    return 0


def cmd_convert_checkpoint(args) -> int:
    """Add the re-shardable optimizer state to a checkpoint written without it (ZeRO-0/1/2), in a
    new folder: it then resumes WITH its optimizer state at any layout (checkpoint/reshard.py)."""
    from .checkpoint.reshard import FOLDER, convert
    folder = convert(args.input, args.output, args.tensor_parallel, args.pipeline_parallel)
    print(f"{folder}: the checkpoint of {args.input} with its optimizer state per parameter in "
          f"{folder / FOLDER}; train from it at any layout with train.load={args.output}")
    return 0


def _add_verify_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify", choices=["sample", "full"], default="sample",
                   help="an export's files against its manifest.json before use: sample (default: every size, small "
                        "files whole, 16 chunks of 4 MiB of each large one) or full (every byte)")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-id", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an expected error too (or MEGATRON_ID_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("params", help="parameter count, recurrent state and FLOPs of a config",
                       allow_abbrev=False)
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_params)
    sub.add_parser("preprocess", help="tokenize a corpus into .bin/.idx (see --help of it)")
    sub.add_parser("kernel-resources", help="compile the Triton core for sm_80 / sm_90 here and report shared "
                                            "memory, registers, spills, tensor cores (see --help of it)")
    t = sub.add_parser("train", help="train with DeepSpeed (--nproc N starts N ranks here; or torchrun / srun / "
                                     "deepspeed)", allow_abbrev=False)
    _add_config_args(t)
    t.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="start N ranks on this machine (one per GPU; CPU processes on CPU) with one-line errors "
                        "and the ranks' exit status; leave out under torchrun / srun")
    t.set_defaults(func=cmd_train)
    c = sub.add_parser("check-checkpoint", help="verify checkpoint files against their manifest (sizes, sha256)",
                       allow_abbrev=False)
    c.add_argument("path", help="train.save folder (checks the one `latest` names) or an iter_XXXXXXX folder")
    c.add_argument("--all", action="store_true", help="check every iter_ folder of a train.save folder")
    c.set_defaults(func=cmd_check_checkpoint)
    e = sub.add_parser("export-hf", help="a training checkpoint -> a Hugging Face folder", allow_abbrev=False)
    e.add_argument("--checkpoint", required=True, help="train.save folder (uses `latest`) or an iter_ folder")
    e.add_argument("--output", required=True,
                   help="a new or empty folder (a non-empty one is refused: see --overwrite)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace --output when it holds an earlier export and nothing else")
    e.add_argument("--tokenizer", help="tokenizer.json (default: the one recorded in the checkpoint)")
    e.add_argument("--prefill-chunk-size", type=int, default=2048)
    e.add_argument("--allow-tokenizer-mismatch", action="store_true", help=MISMATCH_HELP)
    e.set_defaults(func=cmd_export_hf)
    i = sub.add_parser("import-hf", help="an exported folder -> a training checkpoint at any TP/PP",
                       allow_abbrev=False)
    i.add_argument("--input", required=True)
    i.add_argument("--output", required=True,
                   help="a new or empty folder (a non-empty one is refused: see --overwrite)")
    i.add_argument("--overwrite", action="store_true",
                   help="replace --output when it holds one earlier import and nothing else "
                        "(never a folder with training checkpoints)")
    i.add_argument("--tensor-parallel", type=int, default=1)
    i.add_argument("--pipeline-parallel", type=int, default=1)
    i.add_argument("--allow-tokenizer-mismatch", action="store_true", help=MISMATCH_HELP)
    _add_verify_arg(i)
    i.set_defaults(func=cmd_import_hf)
    g = sub.add_parser("generate", help="stream text from a training checkpoint or an exported folder",
                       allow_abbrev=False)
    g.add_argument("--checkpoint", required=True, help="train.save folder, iter_ folder or exported folder")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt, streamed to the terminal")
    source.add_argument("--input-file", help="many prompts: one per line (.jsonl: {\"prompt\": ...} per line), "
                                             "decoded --batch-size at a time; JSON lines out")
    g.add_argument("--output-file", help="with --input-file: a new .jsonl file (default: stdout)")
    g.add_argument("--batch-size", type=int, default=8,
                   help="with --input-file: sequences decoded at once, refilled as they finish (default 8)")
    g.add_argument("--decode", choices=["auto", "fused", "eager"], default="auto",
                   help="fused: the fused step (inference/fused_decode.py); eager: the model's own "
                        "forward per token; auto (default): fused where the model's mixers have it")
    g.add_argument("--max-new-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prefill-chunk-size", type=int, default=2048)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--tokenizer", help="tokenizer.json (default: the one the checkpoint or export records)")
    g.add_argument("--allow-tokenizer-mismatch", action="store_true", help=MISMATCH_HELP)
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    g.add_argument("--cuda-graph", action="store_true",
                   help="replay each decode step as a CUDA graph (interdomain / S4D models on CUDA)")
    _add_verify_arg(g)
    g.set_defaults(func=cmd_generate)
    sv = sub.add_parser("serve", allow_abbrev=False,
                        help="an OpenAI-compatible completions server (continuous batching over state slots)")
    sv.add_argument("--checkpoint", required=True, help="train.save folder, iter_ folder or exported folder")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--slots", type=int, default=8, help="sequences decoded together (default 8)")
    sv.add_argument("--max-model-len", type=int, default=None,
                    help="prompt + max_tokens of one request (default: the model's seq_length); softmax layers "
                         "keep a KV cache this long per slot")
    sv.add_argument("--max-pending", type=int, default=None,
                    help="requests queued or running before new ones get 503 (default 4 x --slots)")
    sv.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM / SIGINT: seconds the running requests get to finish (default 30)")
    sv.add_argument("--prefill-chunk-size", type=int, default=2048)
    sv.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the folder's)")
    sv.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    sv.add_argument("--tokenizer", help="tokenizer.json (default: the one the checkpoint or export records)")
    sv.add_argument("--allow-tokenizer-mismatch", action="store_true", help=MISMATCH_HELP)
    sv.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    _add_verify_arg(sv)
    sv.set_defaults(func=cmd_serve)
    cc = sub.add_parser("convert-checkpoint", allow_abbrev=False,
                        help="copy a ZeRO-0/1/2 checkpoint with its optimizer state made loadable at any layout")
    cc.add_argument("--input", required=True, help="train.save folder (its latest) or iter_ folder")
    cc.add_argument("--output", required=True, help="a new folder (a train.save folder for train.load)")
    cc.add_argument("--tensor-parallel", type=int, default=None,
                    help="the TP size you will load at: checked against the model before converting")
    cc.add_argument("--pipeline-parallel", type=int, default=None,
                    help="the PP size you will load at: checked against the model before converting")
    cc.set_defaults(func=cmd_convert_checkpoint)
    j = sub.add_parser("job-prepare", allow_abbrev=False,
                       help="(for job scripts) resolve, record and check a training config before srun")
    j.add_argument("--run-dir", required=True)
    j.add_argument("--world-size", type=int, required=True)
    j.add_argument("--job-id", required=True)
    j.add_argument("--attempt", type=int, default=0)
    j.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then megatron-id train's arguments")
    j.set_defaults(func=cmd_job_prepare)
    pl = sub.add_parser("plan", help="memory and communication per GPU of every layout; recommends one",
                        allow_abbrev=False)
    _add_config_args(pl)
    pl.add_argument("--nodes", type=int, required=True)
    pl.add_argument("--gpus-per-node", type=int, required=True)
    pl.add_argument("--gpu-memory", required=True, help="per GPU, e.g. 80GiB")
    pl.add_argument("--seq-length", type=int, help="override model.seq_length")
    pl.add_argument("--global-batch", type=int, help="override train.global_batch_size (sequences)")
    pl.add_argument("--margin", type=float, default=0.10,
                    help="fraction of GPU memory kept free (fragmentation, spikes); default 0.10")
    pl.add_argument("--overhead", default="2GiB",
                    help="per-GPU constant: CUDA context, NCCL buffers, allocator (assumed; default 2GiB)")
    pl.add_argument("--max-micro-batch", type=int, default=64, help="largest micro-batch tried (powers of two)")
    pl.add_argument("--top", type=int, default=0, help="print only the first N rows (0: all)")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.set_defaults(func=cmd_plan)
    from .evaluation.run import add_parser as add_eval_parser, command as eval_command
    add_eval_parser(sub)
    sub.choices["eval"].set_defaults(func=eval_command)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv   # the traceback of an expected error (also MEGATRON_ID_DEBUG=1)
    argv = [a for a in argv if a != "--debug"]
    if argv[:1] == ["preprocess"]:   # its own flags (Megatron's names), so hand over whole
        from data_tools.preprocess import main as preprocess_main
        return preprocess_main(argv[1:], debug=debug)
    if argv[:1] == ["kernel-resources"]:   # its own parser (ops/interdomain/resources.py)
        from .ops.interdomain.resources import main as resources_main
        return run_guarded("megatron-id kernel-resources", lambda: resources_main(argv[1:]), debug=debug)
    parser = build_parser()
    args = _parse_with_overrides_anywhere(parser, argv)
    return run_guarded("megatron-id", lambda: args.func(args), debug=debug)


def _parse_with_overrides_anywhere(parser: argparse.ArgumentParser, argv):
    """`--config` may come after the key=value overrides, as users type it (argparse alone ends
    the positional list at the first option and rejects the rest as unrecognized)."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = list(args.overrides) + extra   # after the first ones: the order is kept
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def entry() -> None:
    """The `megatron-id` program. Once a training process group exists, the process ends with
    os._exit after stdout/stderr are flushed, whatever the status: C++ objects of DeepSpeed and
    torch.distributed torn down by the interpreter at exit can abort ("terminate called without
    an active exception": exit 1 after a successful run, -6 after a refused one), which breaks
    SLURM `afterok` chains, requeue logic and our one-line errors."""
    status = main()
    if _TEARDOWN:
        for fn in _TEARDOWN:
            fn()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
