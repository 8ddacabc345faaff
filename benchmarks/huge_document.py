"""Peak memory of preprocessing one huge document, in pieces versus tokenised whole.

    python benchmarks/huge_document.py            # 50 MB document; ~2 minutes on 2 cores, needs ~6 GB
    python benchmarks/huge_document.py --mb 10 --skip-whole

1. A jsonl file holding ONE document of --mb megabytes of real text (the FineWeb-Edu sample,
   sentences shuffled on each repetition).
2. `data_tools.preprocess` on it (GPT-2 tokenizer, --append-eod, --workers 2) in a fresh process
   reporting its own peak RSS: the document is cut into pieces (data_tools/pieces.py).
3. Unless --skip-whole: `tokenizers` encoding the same text whole, as preprocessing did before,
   in a fresh process reporting its peak RSS; it also checks that its ids equal the .bin of 2.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "data" / "gpt2-tokenizer.json"
SAMPLE = ROOT / "tests" / "data" / "fineweb-edu-sample-150.jsonl"

# peak RSS from /proc (VmHWM): getrusage's ru_maxrss survives exec (it would include the parent)
PEAK = 'int(__import__("re").search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024'

PIPELINE = """
import sys, time
sys.path.insert(0, {root!r})
from data_tools.preprocess import build_parser, run
t = time.time(); stats = run(build_parser().parse_args({argv!r})); t = time.time() - t
print(stats.tokens, t, """ + PEAK + """)
"""

WHOLE = """
import json, time
import numpy as np
from tokenizers import Tokenizer
tok = Tokenizer.from_file({tok!r})
text = json.loads(open({src!r}, encoding="utf-8").readline())["text"]
t = time.time(); ids = tok.encode(text, add_special_tokens=False).ids; t = time.time() - t
same = np.array_equal(np.array(ids + [tok.token_to_id("<|endoftext|>")], dtype=np.uint16),
                      np.fromfile({bin!r}, dtype=np.uint16))
print(len(ids), t, """ + PEAK + """, int(same))
"""


def huge_text(megabytes: int) -> str:
    rng = np.random.RandomState(0)
    docs = [json.loads(line)["text"] for line in open(SAMPLE, encoding="utf-8")]
    parts, size = [], 0
    while size < megabytes * 1_000_000:
        for text in docs:
            sentences = text.split(". ")
            rng.shuffle(sentences)
            parts.append(". ".join(sentences))
            size += len(parts[-1]) + 2
    return "\n\n".join(parts)[: megabytes * 1_000_000]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--mb", type=int, default=50)
    p.add_argument("--skip-whole", action="store_true", help="do not run the whole-document encode")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        src = tmp / "huge.jsonl"
        src.write_text(json.dumps({"text": huge_text(args.mb)}) + "\n", encoding="utf-8")
        argv = ["--input", str(src), "--tokenizer", str(TOKENIZER), "--output-prefix", str(tmp / "out"),
                "--append-eod", "--workers", "2", "--no-progress"]
        out = subprocess.run([sys.executable, "-c", PIPELINE.format(root=str(ROOT), argv=argv)],
                             capture_output=True, text=True, check=True).stdout.split()
        tokens, seconds, rss = int(out[0]), float(out[1]), int(out[2])
        print(f"# one {args.mb} MB document, GPT-2 tokenizer\n")
        print("| how | tokens | time | peak RSS |")
        print("|---|---|---|---|")
        print(f"| preprocess, in pieces (--workers 2) | {tokens:,} | {seconds:.1f} s | {rss / 2**20:,.0f} MiB |")
        if not args.skip_whole:
            code = WHOLE.format(tok=str(TOKENIZER), src=str(src), bin=str(tmp / "out_text_document.bin"))
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True).stdout.split()
            print(f"| tokenizers, whole document (1 thread) | {int(out[0]) + 1:,} | {float(out[1]):.1f} s | "
                  f"{int(out[2]) / 2**20:,.0f} MiB |")
            print(f"\nids identical to the whole-document encoding: {'yes' if out[3] == '1' else 'NO'}")
            return 0 if out[3] == "1" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
