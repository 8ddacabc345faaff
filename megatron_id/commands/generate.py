"""`megatron-id generate`: stream text from a training checkpoint or an exported folder, or
complete a file of prompts with continuous batching (--input-file)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..atomic import write_atomic
from ..errors import BadOptionError, OutputExistsError, check_writable
from .options import MISMATCH_HELP, add_verify_arg


def add_parser(sub) -> None:
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
    add_verify_arg(g)
    g.set_defaults(func=run)


def run(args) -> int:
    import torch  # torch: not at import (cli.py)

    from ..inference.generate import check_options, generate_ids, load_model_and_tokenizer, resolve_device, stream_text
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
    from ..inference.fused_decode import fused_decode_refusal
    from ..inference.generate import static_decode_refusal
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
        from ..inference.fused_decode import check_kv_pool
        check_kv_pool(model, 1, len(prompt) + max(args.max_new_tokens, 1), device,
                      f"--max-new-tokens {args.max_new_tokens:,} after a prompt of {len(prompt):,} tokens",
                      "Ask for fewer --max-new-tokens")
    if decode == "fused" and next(model.parameters()).device.type == "cpu":
        from ..inference.cpu_kernel import fixed_state_step_kernel
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
    file = Path(path)
    if file.is_dir():
        raise BadOptionError(f"--input-file {path} is a folder: give a file of prompts, one per line (.jsonl: a "
                             f"{{\"prompt\": ...}} object per line).")
    if not file.exists():   # (not is_file(): a pipe, `--input-file <(grep ... prompts.txt)`, is read as a file)
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
    if path is None:
        return
    out = Path(path)
    if out.exists():
        raise OutputExistsError(f"--output-file {path} exists: give a new file (it is never replaced).")
    if not out.parent.is_dir():
        raise BadOptionError(f"--output-file {path}: the folder {out.parent} does not exist.")
    # before the model is loaded and every prompt generated
    check_writable(out.parent, f"--output-file {path}: its folder")


def generate_file(args, model, tokenizer, eos_id, prompts_text: list[str], unfused: str | None) -> int:
    """Every prompt of --input-file, --batch-size at a time with continuous batching (the fused
    step); one JSON line per prompt, in the file's order, to --output-file (written whole, then
    renamed into place) or stdout."""
    import torch

    from ..inference.batching import generate_batch
    from ..inference.generate import generate_ids
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
        from ..inference.fused_decode import check_kv_pool
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
    try:   # written whole, then renamed into place (its temporary file removed on any failure)
        write_atomic(args.output_file, lambda tmp: tmp.write_text(body, encoding="utf-8"),
                     temp=f"{args.output_file}.tmp-{os.getpid()}")
    except OSError as err:   # (a disk that filled while generating): the completions are not lost
        sys.stdout.write(body)
        sys.stdout.flush()
        raise OSError(err.errno, f"--output-file {args.output_file} could not be written ({err.strerror or err}): "
                                 f"the {len(lines)} completions were written to stdout instead") from None
    print(f"wrote {len(lines)} completions to {args.output_file}", file=sys.stderr)
    return 0
