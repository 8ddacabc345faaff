"""Recall probes with exact generators: what a fixed-size state can and cannot retrieve.

Two probes, each built from a seed alone (random.Random(seed)), so the same seed gives the same
prompts byte for byte on any machine:

passkey (single needle in filler, as in RULER's niah_single and the LongLLaMA passkey test):
    FILLER repeated, with the needle inserted at a fraction `depth` of the filler (at a sentence
    boundary), then the question:
        "The grass is green. The sky is blue. ... The pass key is 48213. Remember it. 48213 is the
         pass key. ... The sun is yellow. What is the pass key? The pass key is"
    answer: " 48213" (a 5-digit key). Correct when greedy decoding of as many tokens as the
    answer has gives exactly the answer's tokens. `length` is the prompt's length in tokens
    (the filler is cut to fit; the needle and question are never cut).

mqar (multi-query associative recall, Arora et al. 2023, in words):
    `pairs` key-value pairs, then the same keys queried in another order:
        "apple 42, river 17, ..., stone 88. river 17, stone 88, apple 42, ..."
    keys are distinct words of KEY_WORDS, values two-digit numbers (one GPT-2 token each). Every
    query's value is scored under teacher forcing: correct when the model's most likely next
    token after the query key is the value's first token and so on for each of its tokens.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"

KEY_WORDS = ("apple river stone cloud tiger chair piano garden window bottle candle forest island mirror "
             "pencil rocket silver castle dragon engine falcon harbor jacket ladder meadow needle orange "
             "palace rabbit saddle temple valley wallet anchor basket cactus desert feather glacier hammer "
             "kettle lantern magnet nickel oyster parrot quartz ribbon shovel teapot violin walnut yogurt "
             "zebra bridge camera dolphin helmet jungle lemon marble noodle pepper pillow rubber sponge "
             "tunnel velvet whale barrel cherry donkey eagle fossil guitar hornet igloo jelly koala").split()


@dataclass
class Probe:
    task: str
    length: int                 # prompt tokens
    depth: float | None         # passkey: where the needle is (0 = start, 1 = end)
    ids: list[int]              # the prompt (passkey) or the whole sequence (mqar)
    answers: list[list[int]]    # passkey: [answer ids]; mqar: each query's value ids
    positions: list[int] = field(default_factory=list)   # mqar: index in ids of each value's first token
    text: str = ""


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def passkey(tokenizer, length: int, depth: float, rng: random.Random) -> Probe:
    key = str(rng.randint(10000, 99999))
    needle = _ids(tokenizer, " " + NEEDLE.format(key=key))
    question = _ids(tokenizer, " " + QUESTION)
    budget = length - len(needle) - len(question)
    if budget < 0:
        raise ValueError(f"passkey length {length} is shorter than the needle and question "
                         f"({len(needle) + len(question)} tokens)")
    sentences, filler = [], []
    while len(filler) < budget:   # whole sentences, the last one cut to the budget
        sentence = FILLER[len(sentences) % len(FILLER)]
        sentences.append(sentence)
        filler += _ids(tokenizer, (" " if filler else "") + sentence)
    filler = filler[:budget]
    # the needle goes at a sentence start nearest to depth x the filler
    starts, pos = [0], 0
    for s in sentences:
        pos += len(_ids(tokenizer, " " + s))
        if pos < budget:
            starts.append(pos)
    cut = min(starts, key=lambda p: abs(p - depth * budget))
    ids = filler[:cut] + needle + filler[cut:] + question
    text = tokenizer.decode(ids)
    return Probe("passkey", len(ids), depth, ids, [_ids(tokenizer, " " + key)], text=text)


def mqar(tokenizer, pairs: int, rng: random.Random) -> Probe:
    if not 1 <= pairs <= len(KEY_WORDS):
        raise ValueError(f"mqar pairs must be 1..{len(KEY_WORDS)}, not {pairs}")
    keys = rng.sample(KEY_WORDS, pairs)
    values = [str(rng.randint(10, 99)) for _ in keys]
    ids, answers, positions = [], [], []

    def add(text):
        ids.extend(_ids(tokenizer, text))

    for i, (k, v) in enumerate(zip(keys, values)):
        add(k if i == 0 else f", {k}")
        add(f" {v}")
    add(".")
    order = list(range(pairs))
    rng.shuffle(order)
    for j, i in enumerate(order):
        add(("" if j == 0 else ",") + f" {keys[i]}")
        value = _ids(tokenizer, f" {values[i]}")
        positions.append(len(ids))
        answers.append(value)
        ids.extend(value)
    return Probe("mqar", len(ids), None, ids, answers, positions, text=tokenizer.decode(ids))


@torch.no_grad()
def passkey_correct(model, probe: Probe, device, chunk: int = 2048) -> tuple[bool, float]:
    """(greedy decoding of len(answer) tokens after the prompt equals the answer, the answer's
    loss in nats per token under teacher forcing: a graded signal where accuracy is 0)."""
    tokens, states, logits = torch.tensor([probe.ids], device=device), None, None
    for start in range(0, tokens.shape[1], chunk):
        logits, states = model(tokens[:, start:start + chunk], states=states, return_states=True)
    got, losses = [], []
    answer = probe.answers[0]
    greedy_states, greedy_logits = states, logits
    for token in answer:   # teacher forcing: the loss of each answer token
        losses.append(float(-torch.log_softmax(logits[0, -1].float(), -1)[token]))
        logits, states = model(torch.tensor([[token]], device=device), states=states, return_states=True)
    states, logits = greedy_states, greedy_logits
    for _ in answer:
        token = int(logits[0, -1].argmax())
        got.append(token)
        if len(got) == len(answer) or got != answer[:len(got)]:
            break
        logits, states = model(torch.tensor([[token]], device=device), states=states, return_states=True)
    return got == answer, sum(losses) / len(losses)


@torch.no_grad()
def mqar_correct(model, probe: Probe, device, chunk: int = 2048) -> tuple[list[bool], list[float]]:
    """Per query: whether every token of its value is the argmax under teacher forcing, and the
    value's loss in nats per token."""
    tokens, states, pieces = torch.tensor([probe.ids], device=device), None, []
    for start in range(0, tokens.shape[1], chunk):
        logits, states = model(tokens[:, start:start + chunk], states=states, return_states=True)
        pieces.append(torch.log_softmax(logits[0].float(), -1))
    logp = torch.cat(pieces)   # logp[i]: the model's distribution for ids[i + 1]
    hits, losses = [], []
    for p, value in zip(probe.positions, probe.answers):
        rows = logp[p - 1:p - 1 + len(value)]
        hits.append(bool((rows.argmax(-1) == torch.tensor(value, device=rows.device)).all()))
        picked = rows[torch.arange(len(value), device=rows.device), torch.tensor(value, device=rows.device)]
        losses.append(float(-picked.mean()))
    return hits, losses
