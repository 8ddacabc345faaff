"""The reports of `megatron-id eval`: markdown tables, CSV, PNG plots and the results folder
(--out); launch/reproduce.py draws its studies' plots with the same helpers.

    md_table, fmt       a markdown table; a number or "-"
    markdown            the table(s) `eval` prints, per evaluation
    write_csv           results.csv
    pyplot, save_png    matplotlib without a display (None when it is not installed); a figure saved
    write_png           results.png
    write_results       results.json/.md/.csv/.png into --out, each replaced whole
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np

from ..atomic import write_atomic

RESULT_FILES = ("results.json", "results.md", "results.csv", "results.png")


def md_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(evaluation: str, results: list[dict]) -> str:
    if evaluation == "perplexity":
        rows = [(r["name"], r["tokens"], fmt(r["loss"], 4), fmt(r["perplexity"], 2), fmt(r["bits_per_byte"], 4))
                for r in results]
        return md_table(["model", "tokens", "loss", "perplexity", "bits/byte"], rows)
    if evaluation == "length":
        factors = [c["factor"] for c in results[0]["contexts"]]
        head = ["model", "train length"] + [f"{f}x" for f in factors]
        rows = [(r["name"], r["train_length"], *[fmt(c["perplexity"], 2) for c in r["contexts"]]) for r in results]
        what = ("perplexity of the predictions within F x the training length of their document's start, "
                "each document read in windows of the training length with the state carried (--carry-state)"
                if results[0].get("carry_state") else "perplexity by context (x the training length)")
        text = what + "\n\n" + md_table(head, rows)
        rel = [(r["name"], r["train_length"], *[fmt(c["vs_1x"], 3) for c in r["contexts"]]) for r in results]
        return text + "\n\nrelative to 1x\n\n" + md_table(head, rel)
    if evaluation == "mqar":
        rows = [(r["name"], r["mixer"], r["layer_pattern"], f"{r['state_bytes_fp32']:,}", r["task"]["num_pairs"],
                 r["answers"], fmt(r["accuracy"], 3), fmt(r["chance"], 3), fmt(r["answer_loss"], 3)) for r in results]
        return "MQAR accuracy (the task's test split; state: the decode state at the task's length, fp32)\n\n" + \
            md_table(["model", "mixer", "layers", "state bytes", "pairs", "answers", "accuracy", "chance",
                       "answer loss"], rows)
    parts = []
    if "passkey" in results[0]:
        cells = results[0]["passkey"]
        keys = sorted({(c["factor"], c["length"]) for c in cells})
        head = ["model", "depth"] + [f"{f}x ({n})" for f, n in keys]
        rows = []
        for r in results:
            for depth in sorted({c["depth"] for c in r["passkey"]}):
                got = {(c["factor"], c["length"]): c["accuracy"] for c in r["passkey"] if c["depth"] == depth}
                rows.append((r["name"], depth, *[fmt(got[k], 2) for k in keys]))
        parts.append("passkey accuracy (prompt length in tokens)\n\n" + md_table(head, rows))
        def mean_loss(r, k):   # over the depths of one prompt length
            losses = [c["answer_loss"] for c in r["passkey"] if (c["factor"], c["length"]) == k]
            return sum(losses) / len(losses)
        loss_rows = [(r["name"], *[fmt(mean_loss(r, k), 3) for k in keys]) for r in results]
        parts.append("passkey: the key's loss under teacher forcing (nats per token, mean over depths; lower is "
                     "better)\n\n" + md_table(["model"] + head[2:], loss_rows))
    if "mqar" in results[0]:
        pairs = [c["pairs"] for c in results[0]["mqar"]]
        rows = [(r["name"], *[fmt(c["accuracy"], 3) for c in r["mqar"]]) for r in results]
        parts.append("multi-query associative recall: accuracy per query\n\n" +
                     md_table(["model"] + [f"{p} pairs" for p in pairs], rows))
        rows = [(r["name"], *[fmt(c["answer_loss"], 3) for c in r["mqar"]]) for r in results]
        parts.append("multi-query associative recall: the value's loss (nats per token; lower is better)\n\n" +
                     md_table(["model"] + [f"{p} pairs" for p in pairs], rows))
    return "\n\n".join(parts)


def write_csv(path: Path, evaluation: str, results: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        if evaluation == "perplexity":
            w.writerow(["model", "tokens", "loss", "perplexity", "bits_per_byte"])
            for r in results:
                w.writerow([r["name"], r["tokens"], r["loss"], r["perplexity"], r["bits_per_byte"]])
        elif evaluation == "length":
            w.writerow(["model", "kind", "factor_or_start", "context_or_end", "tokens", "loss", "perplexity"])
            for r in results:
                for c in r["contexts"]:
                    w.writerow([r["name"], "context", c["factor"], c["context"], c["tokens"], c["loss"],
                                c["perplexity"]])
                for b in r["positions"]["buckets"]:
                    w.writerow([r["name"], "position", b["start"], b["end"], "", b["loss"], b["perplexity"]])
        elif evaluation == "mqar":
            w.writerow(["model", "mixer", "layers", "state_bytes_fp32", "pairs", "answers", "accuracy", "chance",
                        "answer_loss"])
            for r in results:
                w.writerow([r["name"], r["mixer"], r["layer_pattern"], r["state_bytes_fp32"], r["task"]["num_pairs"],
                            r["answers"], r["accuracy"], r["chance"], r["answer_loss"]])
        else:
            w.writerow(["model", "task", "length", "depth_or_pairs", "accuracy", "answer_loss"])
            for r in results:
                for c in r.get("passkey", []):
                    w.writerow([r["name"], "passkey", c["length"], c["depth"], c["accuracy"], c["answer_loss"]])
                for c in r.get("mqar", []):
                    w.writerow([r["name"], "mqar", c["length"], c["pairs"], c["accuracy"], c["answer_loss"]])



def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def save_png(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def write_png(path: Path, evaluation: str, results: list[dict]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    if evaluation == "mqar":   # Zoology's figure 2: accuracy against the state's size
        fig, ax = plt.subplots(figsize=(6, 3.8))
        for mixer in sorted({r["mixer"] for r in results}):
            mine = sorted((r for r in results if r["mixer"] == mixer), key=lambda r: r["state_bytes_fp32"])
            ax.plot([r["state_bytes_fp32"] for r in mine], [r["accuracy"] for r in mine], "o-", label=mixer)
        ax.set(xlabel="decode state (bytes, fp32)", ylabel="accuracy", xscale="log", ylim=(-0.02, 1.02))
        ax.legend(fontsize=8)
    elif evaluation == "perplexity":
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([r["name"] for r in results], [r["perplexity"] for r in results])
        ax.set_ylabel("perplexity")
    elif evaluation == "length":
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for r in results:
            a.plot([c["factor"] for c in r["contexts"]], [c["perplexity"] for c in r["contexts"]], "o-",
                   label=r["name"])
            buckets = r["positions"]["buckets"]
            b.plot([(x["start"] + x["end"]) / 2 / r["train_length"] for x in buckets],
                   [x["perplexity"] for x in buckets], ".-", label=r["name"])
        a.set(xlabel="context (x training length)", ylabel="perplexity", yscale="log")
        b.set(xlabel="position (x training length)", ylabel="perplexity at that position", yscale="log")
        for ax in (a, b):
            ax.axvline(1.0, color="grey", lw=0.5)
            ax.legend(fontsize=8)
    else:
        with_passkey = [r for r in results if "passkey" in r]
        panels = len(with_passkey) + (1 if any("mqar" in r for r in results) else 0)
        fig, axes = plt.subplots(1, panels, figsize=(3.6 * panels, 3.4), squeeze=False)
        for ax, r in zip(axes[0], with_passkey):
            lengths = sorted({c["length"] for c in r["passkey"]})
            depths = sorted({c["depth"] for c in r["passkey"]})
            grid = np.array([[next(c["accuracy"] for c in r["passkey"] if c["length"] == n and c["depth"] == d)
                              for n in lengths] for d in depths])
            ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
            ax.set(xticks=range(len(lengths)), xticklabels=lengths, yticks=range(len(depths)), yticklabels=depths,
                   xlabel="prompt tokens", ylabel="needle depth", title=f"passkey: {r['name']}")
        if panels > len(with_passkey):
            ax = axes[0][-1]
            for r in results:
                if "mqar" in r:
                    ax.plot([c["pairs"] for c in r["mqar"]], [c["accuracy"] for c in r["mqar"]], "o-", label=r["name"])
            ax.set(xlabel="key-value pairs", ylabel="accuracy", ylim=(-0.02, 1.02), title="MQAR", xscale="log")
            ax.legend(fontsize=8)
    save_png(plt, fig, path)
    return True


def write_results(folder: Path, evaluation: str, summary: dict, text: str) -> None:
    """--out: the JSON summary, the markdown `text`, the CSV and the plot, each written whole then
    renamed into place; without matplotlib no results.png (an earlier one is removed), and a note."""
    results = summary["results"]
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "results.json", lambda p: p.write_text(json.dumps(summary, indent=1) + "\n"))
    write_atomic(folder / "results.md", lambda p: p.write_text(text + "\n"))
    write_atomic(folder / "results.csv", lambda p: write_csv(p, evaluation, results))
    drawn = [False]

    def png(p):
        drawn[0] = write_png(p, evaluation, results)
    write_atomic(folder / "results.png", png)
    if not drawn[0]:
        (folder / "results.png").unlink(missing_ok=True)
        print("eval: note: results.png not drawn: matplotlib is not installed (pip install matplotlib).",
              file=sys.stderr)
