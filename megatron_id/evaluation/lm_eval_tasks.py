"""Local lm-evaluation-harness tasks, for machines that cannot download the hub's datasets.

    megatron-id eval lm-eval-tasks --text val.jsonl.zst book.txt --out eval/tasks
    lm_eval --model hf --model_args pretrained=runs/x/hf,trust_remote_code=True \\
        --include_path eval/tasks --tasks megatron_id_lastword,megatron_id_rolling --batch_size auto

Two tasks written from local text, each with its data beside its YAML (absolute paths, so lm_eval
can run from any folder):
- megatron_id_lastword (LAMBADA-style, output_type loglikelihood): passages of 40-120 words cut
  at sentence ends from the texts; the target is the passage's last word. Metrics: acc (the last
  word is the greedy continuation) and perplexity of that word, as lm_eval's lambada tasks.
- megatron_id_rolling (WikiText-style, output_type loglikelihood_rolling): each document scored
  whole in rolling windows of the model's length. Metrics: word_perplexity, byte_perplexity,
  bits_per_byte, as lm_eval's wikitext task.
The passages are chosen by --seed alone. With a connected machine, the paper's eight tasks run
as they are: `--tasks lambada_openai,piqa,hellaswag,winogrande,arc_easy,arc_challenge,siqa,boolq`.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

LASTWORD = """task: megatron_id_lastword
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

ROLLING = """task: megatron_id_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
process_results: !function megatron_id_rolling_utils.process_results
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""

ROLLING_UTILS = '''"""process_results of megatron_id_rolling (written by megatron-id eval lm-eval-tasks)."""
import re


def process_results(doc, results):
    (loglikelihood,) = results
    words = len(re.split(r"\\s+", doc["text"]))
    size = len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, size),
            "bits_per_byte": (loglikelihood, size)}
'''


def passages(docs: list[str], count: int, rng: random.Random) -> list[str]:
    """Runs of whole sentences, 40-120 words, ending with a word (no trailing punctuation after
    the target word is dropped: the target is everything after the last space)."""
    out = []
    for doc in docs:
        sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())) if s.strip()]
        run = []
        for sentence in sentences:
            run.append(sentence)
            words = " ".join(run).split(" ")
            if len(words) >= 40:
                if len(words) <= 120 and re.fullmatch(r"[A-Za-z]{2,}[.!?]?", words[-1]):
                    text = " ".join(words)
                    out.append(text[:-1] if text[-1] in ".!?" else text)   # the last word without its stop
                run = []
    rng.shuffle(out)
    return out[:count]


def write_tasks(docs: list[str], folder: Path, count: int = 200, seed: int = 1234, documents: int = 50) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    chosen = passages(docs, count, rng)
    if not chosen:
        raise ValueError("no passage of 40-120 words ending in a word was found in the texts")
    rolling = [d for d in docs if d.strip()][:documents]
    (folder / "lastword.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in chosen))
    (folder / "rolling.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rolling))
    (folder / "megatron_id_lastword.yaml").write_text(LASTWORD.format(data=(folder / "lastword.jsonl").resolve()))
    (folder / "megatron_id_rolling.yaml").write_text(ROLLING.format(data=(folder / "rolling.jsonl").resolve()))
    (folder / "megatron_id_rolling_utils.py").write_text(ROLLING_UTILS)
    return {"lastword": len(chosen), "rolling": len(rolling), "folder": str(folder)}
