"""lm-evaluation-harness on a model in memory: train.eval_tasks' `lm-eval` entries.

The model is loaded as its Hugging Face export loads (the export's code, config.json and
tokenizer files in a temporary folder, hf/export.py's write_model_files; the weights copied from
memory, never written), and scored by lm_eval's HFLM and simple_evaluate on tasks of local
YAML (`megatron-id eval lm-eval-tasks` writes two). `lm_eval_results` is the one call for
both: the in-process model, or an export's folder (what `lm_eval --model hf` loads).
"""
from __future__ import annotations

import tempfile
from pathlib import Path


def in_process_lm(model, cfg, tokenizer_path: Path, batch_size: int, chunk_size: int, device, folder: Path):
    """lm_eval's HFLM over the weights of `model` (a TP=1 LanguageModel), loaded as its export
    loads: the export's code, config.json and tokenizer files are written to `folder` (no
    weights), the model class built from them and given `model`'s weights."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..hf.export import _tokenizer_ids, write_model_files
    write_model_files(folder, cfg, _tokenizer_ids(tokenizer_path), tokenizer_path, None, chunk_size, None, None)
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=True)
    wrapper = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    wrapper.model.load_state_dict(model.state_dict(), strict=True)
    wrapper.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    return HFLM(pretrained=wrapper, tokenizer=tokenizer, batch_size=batch_size, device=str(device))


def export_lm(folder, batch_size: int, device="cpu"):
    """HFLM on an exported folder, as `lm_eval --model hf --model_args pretrained=FOLDER` builds it."""
    from lm_eval.models.huggingface import HFLM
    return HFLM(pretrained=str(folder), trust_remote_code=True, batch_size=batch_size, device=str(device))


def lm_eval_results(lm, include_path, tasks: list[str], limit: int | None) -> dict:
    """{task: {metric: value}} of lm_eval's simple_evaluate (stderr and aliases left out)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    out = simple_evaluate(model=lm, tasks=list(tasks), task_manager=TaskManager(include_path=str(include_path)),
                          limit=limit, bootstrap_iters=0, log_samples=False)
    results = {}
    for task, metrics in out["results"].items():
        results[task] = {name.split(",")[0]: float(value) for name, value in metrics.items()
                         if "_stderr" not in name and isinstance(value, (int, float))
                         and name.split(",")[0] not in ("alias", "sample_len")}
    return results


def lm_eval_scores(model, cfg, tokenizer_path: Path, args) -> dict:
    """train.eval_tasks' `lm-eval --include-path DIR --tasks ... [--limit N]` on `model`."""
    with tempfile.TemporaryDirectory(prefix="megatron-id-lm-eval-") as folder:
        lm = in_process_lm(model, cfg, tokenizer_path, args.batch_size, args.chunk_size, args.device, Path(folder))
        return lm_eval_results(lm, args.include_path, args.tasks, args.limit)
