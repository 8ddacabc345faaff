"""The paper's evaluations for training checkpoints and exported folders (`megatron-id eval`).

    scoring.py   per-token losses in chunks that carry the state; windows; perplexity, bits/byte
    recall.py    passkey and multi-query associative recall: exact generators, scoring
    run.py       the three evaluations (perplexity, length sweep, recall) and their reports
"""
