"""data.carry_state (training/carry.py): a sequence run as consecutive windows with each row's
state carried equals one forward of the whole sequence.

float64, every form of the core: one 1,024-token document in 4 windows of 256, the state
carried and the gradient through all windows, gives the logits and every parameter gradient of
one 1,024-token forward (< 1e-10); with the gradient stopped at each boundary, the same logits.
Packed documents in windows (documents crossing window boundaries, a window that starts a new
document) equal the packed one-forward with Megatron's reset_attention_mask /
reset_position_ids. The Triton kernels under the interpreter: the same in float32 (< 1e-4).
"""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import CONFIGS, ROOT, relative_error
from test_distill import _close

GPT2 = ROOT / "tests" / "data" / "gpt2-tokenizer.json"
TINY = CONFIGS / "model" / "tiny.yaml"

EOD = 7


def _model(tiny_config, form, mixer="interdomain", impl="autograd", dtype=torch.float64, **dims):
    from megatron_id.model import LanguageModel
    sizes = {"d_model": 16, "n_heads": 2, "n_layers": 2, "state_size": 5, "chunk_size": 16, **dims}
    cfg = tiny_config(f"model.mixer={mixer}", *(f"model.{k}={v}" for k, v in sizes.items()), "model.vocab_size=64",
                      f"model.core_impl={impl}")
    return LanguageModel(cfg, form=form, seed=3).to(dtype)


def _document(length, rows=2, eod_every=None, seed=5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(8, 64, (rows, length), generator=g)
    if eod_every:   # documents of varied lengths; one ends exactly at a window boundary
        for b, every in enumerate(eod_every):
            tokens[b, every - 1::every] = EOD
    return tokens


def _logits_and_grads(model, fn, weight):
    logits = fn()
    grads = torch.autograd.grad((logits * weight).sum(), list(model.parameters()), allow_unused=True)
    return logits.detach(), grads


def _check(model, tokens, windows, tol, reset_documents):
    from megatron_id.training.carry import RowStates, carried_forward
    from megatron_id.training.documents import document_index
    weight = torch.randn(*tokens.shape, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    weight = weight.to(next(model.parameters()).dtype)
    extra = {}
    if reset_documents:
        seq_idx, positions = document_index(tokens, EOD)
        extra = {"seq_idx": seq_idx, "position_ids": positions}
    whole, whole_grads = _logits_and_grads(model, lambda: model(tokens, **extra), weight)
    fresh = RowStates.fresh(tokens.shape[0])
    carried, carried_grads = _logits_and_grads(
        model, lambda: carried_forward(model, tokens, EOD, fresh, windows=windows)[0], weight)
    assert relative_error(carried, whole) < tol
    for (name, _), g, ref in zip(model.named_parameters(), carried_grads, whole_grads):
        assert relative_error(g, ref) < tol, (name, relative_error(g, ref))
    detached, detached_grads = _logits_and_grads(
        model, lambda: carried_forward(model, tokens, EOD, fresh, windows=windows, detach=True)[0], weight)
    assert relative_error(detached, whole) < tol
    # the gradient stopped at the boundaries is another gradient (the state's path is cut)
    differs = [relative_error(g, ref) for (name, _), g, ref in zip(model.named_parameters(), detached_grads,
                                                                    whole_grads) if name.endswith("log_dt")]
    assert max(differs) > 1e-6


@pytest.mark.parametrize("mixer,form,impl", [("interdomain", "chunked", "autograd"),
                                             ("interdomain", "chunked", "recompute"),
                                             ("interdomain", "recurrent", "autograd"),
                                             ("s4d", "chunked", "autograd")])
def test_one_document_in_four_windows_equals_one_forward(tiny_config, mixer, form, impl):
    model = _model(tiny_config, form, mixer, impl)
    tokens = _document(1024 if form != "recurrent" else 256)   # (the recurrent form steps token by token)
    _check(model, tokens, 4, 1e-10, reset_documents=False)


@pytest.mark.parametrize("form,impl", [("chunked", "autograd"), ("recurrent", "autograd")])
def test_packed_documents_in_windows_equal_the_packed_forward(tiny_config, form, impl):
    """Row 0's documents are 64 tokens: one ends exactly at each window boundary (the next
    window starts a new document, its row's state zeroed); row 1's (37) cross them."""
    model = _model(tiny_config, form, "interdomain", impl)
    tokens = _document(256, eod_every=(64, 37))
    _check(model, tokens, 4, 1e-10, reset_documents=True)


def test_what_a_window_carries(tiny_config):
    """Positions continue across a boundary inside a document and restart after an EOD that ends
    a window; the state of a row that starts a document is zeroed, the other row's kept."""
    from megatron_id.training.carry import RowStates, window_model_inputs
    model = _model(tiny_config, "chunked")
    first = torch.tensor([[9, 9, 9, 9], [9, 9, EOD, 9]])
    kwargs, after = window_model_inputs(first, EOD, RowStates.fresh(2))
    assert kwargs["states"] is None and kwargs["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    _, after.layers = model(first, return_states=True, **kwargs)
    assert after.position.tolist() == [4, 1] and after.ends_document.tolist() == [False, False]
    second = torch.tensor([[9, 9, 9, EOD], [9, EOD, 9, 9]])
    kwargs, after2 = window_model_inputs(second, EOD, after)
    assert kwargs["position_ids"].tolist() == [[4, 5, 6, 7], [1, 2, 0, 1]]
    assert after2.ends_document.tolist() == [True, False]
    _, after2.layers = model(second, return_states=True, **kwargs)
    kwargs, _ = window_model_inputs(torch.tensor([[9, 9, 9, 9], [9, 9, 9, 9]]), EOD, after2)
    assert kwargs["position_ids"].tolist() == [[0, 1, 2, 3], [2, 3, 4, 5]]
    ssm = kwargs["states"][0]["ssm"]
    assert torch.all(ssm[0] == 0) and torch.any(ssm[1] != 0)
    assert all(torch.all(t[0] == 0) and torch.any(t[1] != 0) for t in kwargs["states"][0]["conv"].values())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter is off")
def test_the_triton_kernels_carry_the_state_alike(tiny_config, monkeypatch):
    """float32 (the kernels' precision), under the interpreter: 64 tokens in 4 windows of 16."""
    pytest.importorskip("triton")
    monkeypatch.setenv("MEGATRON_ID_DOT_PRECISION", "ieee")
    model = _model(tiny_config, "chunked", "interdomain", "triton", dtype=torch.float32, d_model=32)
    _check(model, _document(64, eod_every=(16, 23)), 4, 1e-4, reset_documents=True)


def _cp_windows(rank, world, tokens):
    """This rank's blocks of the logits of 4 carried windows, and its parameter gradients."""
    import torch.distributed as dist

    from megatron_id.config import load_config
    from megatron_id.model import LanguageModel
    from megatron_id.parallel.context_parallel import ContextParallel, apply_context_parallel, split_sequence
    from megatron_id.training.carry import CarriedRows
    cfg = load_config([TINY], CP_MODEL).model
    cp = ContextParallel(dist.group.WORLD, rank, world)
    model = apply_context_parallel(LanguageModel(cfg, seed=3).double(), cp)
    carry = CarriedRows(1, tokens.shape[0], EOD, windows=4)
    split = lambda x: split_sequence(x, cp)   # noqa: E731
    logits = carry.forward(model, tokens, split)
    weight = carry.split_like_outputs(_weight(tokens), split)
    grads = torch.autograd.grad((logits * weight).sum(), list(model.parameters()))
    return logits.detach(), [g.detach() for g in grads], carry.states[0].layers[0]["ssm"]


CP_MODEL = ["model.d_model=16", "model.n_heads=2", "model.n_layers=2", "model.state_size=5", "model.chunk_size=8",
            "model.vocab_size=64", "model.core_impl=autograd"]


def _weight(tokens):
    return torch.randn(*tokens.shape, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


@pytest.mark.slow
def test_context_parallel_with_the_state_carried_equals_one_process(tiny_config):
    """float64: 4 windows of 32 tokens, each split over CP=2 ranks (blocks of 16), the state
    carried with the gradient through all windows, documents ending inside blocks, 1-2 tokens
    before a block edge and on a window boundary: the joined logits, the summed gradients and
    the carried state equal one process running the same windows (< 1e-10)."""
    from distributed import run_distributed

    from megatron_id.model import LanguageModel
    from megatron_id.training.carry import CarriedRows
    tokens = _document(128, eod_every=(32, 15))
    tokens[0, [13, 46, 77]] = EOD
    model = LanguageModel(tiny_config(*CP_MODEL), seed=3).double()
    carry = CarriedRows(1, 2, EOD, windows=4)
    logits = carry.forward(model, tokens)
    grads = torch.autograd.grad((logits * _weight(tokens)).sum(), list(model.parameters()))
    results = run_distributed(_cp_windows, 2, args=(tokens,), timeout=120)
    joined = torch.cat([torch.cat([r[0][:, w * 16:(w + 1) * 16] for r in results], dim=1) for w in range(4)], dim=1)
    assert relative_error(joined, logits) < 1e-10
    for i, (name, _) in enumerate(model.named_parameters()):
        assert relative_error(results[0][1][i] + results[1][1][i], grads[i]) < 1e-10, name
    for rank in range(2):
        assert relative_error(results[rank][2], carry.states[0].layers[0]["ssm"]) < 1e-10


# ---------------------------------------------------------------- the data order and the trainer

def test_each_row_reads_consecutive_windows_of_its_stream(fineweb_prefix, tmp_path):
    """StreamOrder: row r of step t + 1 starts where row r of step t ended (the samples share their
    boundary token), and the rows together read every sample once."""
    from megatron_id.data.gpt_dataset import StreamOrder, build_gpt_datasets
    train, _, _ = build_gpt_datasets([str(fineweb_prefix)], "100,0,0", (24, 0, 0), 32, 1234, tmp_path)
    order = StreamOrder(train, rows=4)
    assert len(order) == 24 and order.steps == 6
    for row in range(4):
        for step in range(5):
            now, after = order[step * 4 + row], order[(step + 1) * 4 + row]
            assert now[-1] == after[0] and not np.array_equal(now, after)
    seen = sorted(order._unshuffled(i) for i in range(24))
    assert seen == list(range(24))
    assert order.locate(5, 0) == train.locate_in_stream_order(order._unshuffled(5), 0)


def _items(prefix, save, *extra):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", f"data.tokenizer={GPT2}", "model.vocab_size=50257",
            f"train.save={save}", "train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=4",
            "train.eval_iters=0", "train.log_interval=1", "optimizer.warmup_tokens=0", "optimizer.lr=1e-2",
            "train.check_host_memory=false", "data.carry_state=true", "train.save_interval=2",
            "train.train_tokens=1536", *extra]   # 6 steps of 4 rows x 64 tokens, 2 micro-batches of 2


@pytest.mark.parametrize("setting, mention", [
    ("parallel.pipeline_model_parallel_size=2", "pipeline_model_parallel_size=2: the carried state would have"),
    ("parallel.context_parallel_size=2 train.carry_grad_windows=64",
     "context_parallel_size=2 with train.carry_grad_windows=64: each window of 1 tokens splits"),
    ("model.layer_pattern=IA", r"softmax layers \(model.layer_pattern=IA\): their state is a KV cache"),
    ("train.carry_grad_windows=3", "carry_grad_windows=3: it must be >= 1 and divide model.seq_length=64"),
    ("train.activation_checkpointing=true", "activation_checkpointing=true: a block recomputed"),
    ("data.source=mqar", "data.source=mqar and data.mqar.query_window=0: the classic task"),
])
def test_what_cannot_carry_state_is_refused_from_the_config(setting, mention):
    from megatron_id.config import ConfigError, load_config
    from megatron_id.training.layout import training_layout
    cfg = load_config([TINY], ["data.carry_state=true", "train.global_batch_size=4", *setting.split()])
    with pytest.raises(ConfigError, match=mention):
        training_layout(cfg, 2)
    cfg = load_config([TINY], ["train.carry_grad_windows=2"])
    with pytest.raises(ConfigError, match="set data.carry_state=true, or leave it at 1"):
        training_layout(cfg, 1)


@pytest.mark.slow
def test_carried_training_at_tp2_and_cp2_equals_tp1_and_a_kill_resumes_it_bit_for_bit(fineweb_prefix, tmp_path):
    """6 steps of 2 micro-batches of 2 rows, the state carried step to step: TP=2 + ZeRO-2 and
    CP=2 give TP=1's losses; the TP=2 run killed after step 5 resumes from step 4 and gives step 5 bit for
    bit, with every rank's carried state from the checkpoint; without it, step 5 differs (the
    state carries something). train.carry_grad_windows=2 starts at the same loss."""
    from distributed import RankError, run_distributed
    from test_distill import _train

    def run(name, world, *extra, kill_after=None, record=None):
        return run_distributed(_train, world, (_items(fineweb_prefix, tmp_path / name, *extra), kill_after,
                                               record), timeout=300)[0]

    _, one = run("tp1", 1)
    assert one[-1] < one[0]
    tp2 = ["parallel.tensor_model_parallel_size=2", "train.zero_stage=2"]
    record = tmp_path / "killed.json"
    with pytest.raises(RankError):
        run("tp2", 2, *tp2, kill_after=5, record=str(record))
    killed = [float.fromhex(x) for x in json.loads(record.read_text())]
    _close(one[:5], killed)
    saved = tmp_path / "tp2" / "iter_0000004"
    files = sorted(p.name for p in saved.glob("carried_state_rank*.pt"))
    assert files == ["carried_state_rank00000.pt", "carried_state_rank00001.pt"]
    carried = torch.load(saved / files[1], weights_only=True)
    assert carried["layout"]["tensor"] == 2 and len(carried["states"]) == 2
    assert carried["states"][0]["layers"][0]["ssm"].shape[:2] == (2, 2)   # 2 rows, this rank's 2 of 4 heads
    assert torch.all(carried["states"][1]["position"] > 0)
    shutil.copytree(tmp_path / "tp2", tmp_path / "tp2-without")
    start, resumed = run("tp2", 2, *tp2, f"train.load={tmp_path / 'tp2'}")
    assert start == 4 and resumed[0] == killed[4]   # step 5, bit for bit
    _close(one, killed[:4] + resumed)

    for name in files:   # the same checkpoint without its carried state: every row restarts from zero
        (tmp_path / "tp2-without" / "iter_0000004" / name).unlink()
    manifest = tmp_path / "tp2-without" / "iter_0000004" / "manifest.json"
    entries = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**entries, "files": {k: v for k, v in entries["files"].items()
                                                         if not k.startswith("carried_state")}}))
    _, without = run("tp2-without", 2, *tp2, f"train.load={tmp_path / 'tp2-without'}")
    assert abs(without[0] - killed[4]) > 1e-4, (without[0], killed[4])

    _, cp2 = run("cp2", 2, "parallel.context_parallel_size=2")   # each row's window in 2 blocks of 32
    _close(one, cp2)

    _, windows = run("windows", 1, "train.carry_grad_windows=2")
    assert math.isclose(windows[0], one[0], rel_tol=1e-5)


def _validate(rank, world, items):
    """The trainer's validation loss at step 0, and the same loss from one forward per row."""
    import torch.nn.functional as F

    from megatron_id.config import load_config
    from megatron_id.training.documents import document_index
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    try:
        validated = trainer.evaluate()
        streams, model = trainer.valid_data, trainer.engine.module
        losses = []
        with torch.no_grad():
            for row in range(streams.rows):   # its 2 windows joined (they share a boundary token)
                first, second = (torch.from_numpy(streams.dataset.in_stream_order(row * streams.steps + t))
                                 for t in range(2))
                tokens = torch.cat([first, second[1:]])[None]
                seq_idx, positions = document_index(tokens[:, :-1], trainer.carry.eod_id)
                logits = model(tokens[:, :-1], seq_idx=seq_idx, position_ids=positions)
                vocab = trainer.cfg.model.vocab_size   # (the module's logits have the padded rows too)
                losses.append(F.cross_entropy(logits[0, :, :vocab].float(), tokens[0, 1:], reduction="none"))
        return validated, torch.cat(losses).mean().item()
    finally:
        trainer.close()


def test_validation_reads_each_row_window_by_window_with_its_state_carried(fineweb_prefix, tmp_path):
    """train.eval_iters=2 batches of 4 rows: the validation loss is that of each row's 2 windows
    read as one sequence (documents reset as in training)."""
    from distributed import run_distributed
    items = _items(fineweb_prefix, tmp_path / "run", "data.split=70,30,0", "train.eval_iters=2")
    validated, whole = run_distributed(_validate, 1, (items,), timeout=300)[0]
    assert math.isclose(validated, whole, rel_tol=1e-5), (validated, whole)


# ---------------------------------------------------------------- megatron-id eval length --carry-state

def _documents_file(path, tokenizer_text, count=12):
    """jsonl documents of varied lengths (40 to 900 words) cut from the bundled text."""
    words = tokenizer_text.split()
    rng, at, rows = __import__("random").Random(4), 0, []
    for _ in range(count):
        n = rng.randint(40, 900)
        rows.append(json.dumps({"text": " ".join(words[at:at + n])}))
        at += n
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.slow
def test_eval_length_with_the_state_carried_scores_each_document_as_one_sequence(tiny_config, tmp_path):
    """`eval length --carry-state`: every row starts at a document's first token; the perplexity
    at factor F is that of the predictions less than F x 64 tokens into their document, as one
    forward of each row (documents reset) gives them; a softmax model is refused with the reason."""
    import subprocess
    import sys

    import torch.nn.functional as F
    from hf_tiny import export_model

    from megatron_id.evaluation.run import document_rows, read_documents, token_stream
    from megatron_id.inference.generate import load_trained
    from megatron_id.model import LanguageModel
    from megatron_id.training.documents import document_index
    cfg = tiny_config("model.d_model=32", "model.vocab_size=50257", "model.n_heads=2")
    export = export_model(LanguageModel(cfg, seed=5).eval(), cfg, tmp_path / "export")
    text = _documents_file(tmp_path / "docs.jsonl", (ROOT / "tests/data/tinyshakespeare-200k.txt").read_text())
    command = [sys.executable, "-m", "megatron_id.cli", "eval", "length", "--checkpoint", str(export), "--text",
               str(text), "--carry-state", "--factors", "1", "2", "8", "--batch-size", "3", "--max-tokens", "100000",
               "--bucket", "1", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)["results"][0]
    assert result["carry_state"] and result["rows"] == 3 and result["windows_per_row"] >= 4

    trained = load_trained(str(export), None, False)
    stream = token_stream(trained, read_documents([str(text)]))
    rows = document_rows(stream, trained.eod, 3)
    assert all(r[0] != trained.eod for r in rows) and stream[len(rows[0]) - 1] == trained.eod
    length = result["windows_per_row"] * 64
    tokens = torch.from_numpy(np.stack([r[:length + 1] for r in rows]))
    seq_idx, positions = document_index(tokens[:, :-1], trained.eod)
    with torch.no_grad():
        logits = trained.model(tokens[:, :-1], seq_idx=seq_idx, position_ids=positions)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
    for context in result["contexts"]:
        inside = positions.flatten() < context["context"]
        assert context["tokens"] == int(inside.sum())
        assert math.isclose(context["loss"], losses[inside].double().mean().item(), rel_tol=1e-5), context
    assert result["tokens_beyond"] == int((positions >= 8 * 64).sum()) > 0

    softmax = tiny_config("model.d_model=32", "model.vocab_size=50257", "model.n_heads=2", "model.layer_pattern=IA")
    export = export_model(LanguageModel(softmax, seed=5).eval(), softmax, tmp_path / "softmax")
    done = subprocess.run([*command[:6], str(export), *command[7:]], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.returncode != 0 and "has softmax layers, whose KV cache would grow" in done.stderr, done.stderr[-2000:]


# ---------------------------------------------------------------- MQAR across windows

def test_mqar_episodes_put_the_queries_windows_after_their_pairs_and_each_row_streams_them():
    """data.mqar.query_window=2, windows of 32: the pairs open window 0, the queries (and only
    they) are answers, in window 2 past its first 2 x pairs positions; the episode ends with the
    end-of-document id; a row's consecutive samples continue its stream of episodes."""
    from megatron_id.data.mqar import MQARStreams, MQARTask
    task = MQARTask(seq_length=32, num_pairs=4, num_queries=2, num_keys=16, num_values=16, query_window=2, window=32)
    task.check(task.vocab_needed)
    assert task.eod == 33 and task.vocab_needed == 34 and task.episode_tokens == 96
    episode = task.episode(1, "train", row=3, index=5)
    assert episode[-1] == task.eod and np.array_equal(episode, task.episode(1, "train", 3, 5))
    keys, values = episode[0:8:2], episode[1:8:2]
    assert set(keys) <= set(range(1, 17)) and set(values) <= set(range(17, 33))
    assert np.all(episode[8:64] == 0)   # filler until the queries' window
    mask = task.answer_mask(torch.from_numpy(episode[:-1])[None])[0].bool()
    where = torch.nonzero(mask).flatten().tolist()
    assert len(where) == 2 and all(64 + 8 <= w <= 96 - 3 for w in where)
    for w in where:   # a query of a key of the pairs, followed by its value
        assert episode[w + 1] == values[list(keys).index(episode[w])]

    streams = MQARStreams(task, num_samples=4 * 7, seed=1, rows=4)
    for row in range(4):
        windows = [streams[step * 4 + row] for step in range(7)]
        assert all(a[-1] == b[0] for a, b in zip(windows, windows[1:]))
        joined = np.concatenate([windows[0]] + [w[1:] for w in windows[1:]])
        phase = (row % 3) * 32   # rows start at every window of their episodes
        episodes = np.concatenate([task.episode(1, "train", row, e) for e in range(4)])
        assert np.array_equal(joined, episodes[phase:phase + len(joined)])
    whole = MQARStreams(MQARTask(96, 4, 2, 16, 16, query_window=2, window=32), num_samples=8, seed=1, rows=4)
    for i in range(8):   # samples of 3 windows: every row reads whole episodes, from the first
        assert np.array_equal(whole[i][:96], task.episode(1, "train", i % 4, i // 4))
    with pytest.raises(Exception, match="query_window=2: the window of 8 tokens"):
        MQARTask(32, 4, 2, 16, 16, query_window=2, window=8).check()


@pytest.mark.slow
def test_the_carry_study_trains_both_controls_of_both_studies_and_scores_each_as_trained(tmp_path):
    """launch/carry_study.py --smoke: MQAR carried (48-token episodes in 3 windows, the state
    carried) and reset (the windows read alone) at the same tokens per step, `eval mqar` scoring
    each as it was trained; long text carried against reset, both read to 8x the window by `eval
    length --carry-state`; a rerun skips what is done and prints the same tables."""
    import subprocess
    import sys
    sample = ROOT / "tests" / "data" / "fineweb-edu-sample-150.jsonl"
    command = [sys.executable, str(ROOT / "launch" / "carry_study.py"), "--smoke", "--seeds", "1", "--out",
               str(tmp_path), "--train-text", str(sample), "--val-text", str(sample)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for control in ("carried", "reset"):
        assert (tmp_path / "runs" / f"{control}-seed1" / "latest").read_text().strip() == "iter_0000004"
        result = json.loads((tmp_path / "eval" / f"{control}-seed1.json").read_text())["results"][0]
        assert result["task"]["query_window"] == 2 and result["task"]["window"] == 16
        assert result["answers"] == 2 * 64 and 0 <= result["accuracy"] <= 1
        text = json.loads((tmp_path / "eval" / f"text-{control}-seed1.json").read_text())["results"][0]
        assert text["carry_state"] and text["train_length"] == 32 and text["windows_per_row"] == 8
        assert [c["factor"] for c in text["contexts"]] == [1, 2, 4, 8]
        assert len(text["positions"]["buckets"]) == 8 and all(b["tokens"] > 0 for b in text["positions"]["buckets"])
    carried = torch.load(tmp_path / "runs" / "text-carried-seed1" / "iter_0000004" / "carried_state_rank00000.pt",
                         weights_only=True)
    assert carried, "the carried text run saved no carried state"
    assert not (tmp_path / "runs" / "text-reset-seed1" / "iter_0000004" / "carried_state_rank00000.pt").exists()
    table = (tmp_path / "results.md").read_text()
    assert "| carried | " in table and "| reset | " in table and "carried > 0.9 on every seed" in table
    assert "## Long text" in table and "carried's perplexity to 8x below reset's" in table
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert again.returncode == 0 and again.stdout == done.stdout


def test_carrying_state_on_data_without_an_eod_id_is_refused_before_any_work(tmp_path):
    """Documents restart the carried state: data written without --append-eod (no EOD id) stops
    the run in the checks before any work, naming the file and the fix."""
    from data_tools.preprocess import main as preprocess
    from megatron_id.config import load_config
    from megatron_id.data.gpt_dataset import DataConfigError
    from megatron_id.training.engine import check_run
    from megatron_id.training.layout import training_layout
    out = tmp_path / "noeod"
    assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"), "--tokenizer", str(GPT2),
                       "--output-prefix", str(out), "--no-progress"]) == 0
    cfg = load_config([TINY], [f"data.data_path=[{out}_text_document]", "data.carry_state=true",
                               "model.vocab_size=50257", "train.global_batch_size=2", "train.check_host_memory=false"])
    with pytest.raises(DataConfigError, match=r"data.carry_state needs the end-of-document token id, and "
                                              r".*noeod_text_document\.meta\.json .*set data\.eod_token_id"):
        check_run(cfg, training_layout(cfg, 1), on_gpu=False)


# ---------------------------------------------------------------- careless runs (issue 52)

def test_every_reason_a_run_cannot_carry_state_is_named():
    """A run refused for several reasons names each (they were a dict keyed by booleans, each
    overwriting the last); a softmax model is named by its model.mixer; a packed-document switch
    set to false on purpose is refused, not overridden (carrying the state implies it)."""
    from megatron_id.config import ConfigError, load_config
    from megatron_id.training.layout import training_layout

    def refusal(*extra):
        cfg = load_config([TINY], ["data.carry_state=true", "train.global_batch_size=4", *extra])
        with pytest.raises(ConfigError) as err:
            training_layout(cfg, 1)
        return str(err.value)
    several = refusal("model.layer_pattern=IA", "train.activation_checkpointing=true", "train.carry_grad_windows=3")
    for reason in ("train.carry_grad_windows=3: it must be >= 1", "softmax layers (model.layer_pattern=IA): their",
                   "train.activation_checkpointing=true: a block recomputed"):
        assert reason in several, several
    assert "softmax layers (model.mixer=softmax): their state" in refusal("model.mixer=softmax")
    assert "data.reset_position_ids=false: carrying the state implies it" in refusal("data.reset_position_ids=false")



def test_the_keys_description_names_the_layouts_the_check_takes():
    """docs/reference/config.md (from config.py's comment) said carry ran "not with pipeline or
    context parallelism yet" while context parallelism worked: the description and the check agree."""
    from megatron_id import reference
    from megatron_id.config import ConfigError, load_config
    from megatron_id.training.layout import training_layout
    meaning = {k.name: k.meaning for k in reference.schema_keys()}["data.carry_state"]
    assert "context parallelism, not pipeline parallelism" in meaning, meaning
    base = [TINY], ["data.carry_state=true", "train.global_batch_size=4"]
    training_layout(load_config(base[0], [*base[1], "parallel.context_parallel_size=2"]), 2)
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size=2"):
        training_layout(load_config(base[0], [*base[1], "parallel.pipeline_model_parallel_size=2"]), 2)

def test_an_eod_id_other_than_the_datas_is_refused_naming_both(fineweb_prefix, tmp_path):
    """data.eod_token_id=0 where the sidecar records 50256 is refused in the checks, naming both ids and
    the sidecar, for a carry run and for the packed-document switches (the same id finds their
    documents), and for data.source=mqar (its episodes end with the task's own id). Data whose sidecar
    records none: a given id must end its documents (written without --append-eod, 50256 ends none);
    the same documents ending with 50256, without a sidecar, take it."""
    from data_tools.preprocess import main as preprocess
    from megatron_id.config import ConfigError, load_config
    from megatron_id.data.gpt_dataset import DataConfigError
    from megatron_id.training.carry import carried_eod_id
    from megatron_id.training.documents import DocumentOptions
    from megatron_id.training.engine import check_run
    from megatron_id.training.layout import training_layout
    items = [f"data.data_path=[{fineweb_prefix}]", "model.vocab_size=50257", "train.global_batch_size=2",
             "train.check_host_memory=false", "data.eod_token_id=0"]
    both = rf"data.eod_token_id=0, but {fineweb_prefix}.meta.json records the end-of-document id 50256"
    cfg = load_config([TINY], [*items, "data.carry_state=true"])
    with pytest.raises(DataConfigError, match=both + r".*data.carry_state needs it.*set data.eod_token_id=50256"):
        check_run(cfg, training_layout(cfg, 1), on_gpu=False)
    with pytest.raises(DataConfigError, match=both + r".*data.reset_attention_mask / reset_position_ids"):
        DocumentOptions.from_config(load_config([TINY], [*items, "data.reset_attention_mask=true"]).data)
    mqar = load_config([TINY], ["data.source=mqar", "data.mqar.query_window=2", "data.carry_state=true",
                                "model.vocab_size=256", "data.eod_token_id=5"])
    with pytest.raises(ConfigError, match=r"data.eod_token_id=5 is not what data.source=mqar ends its episodes with: "
                                          r"the task's end-of-document id is 129"):
        carried_eod_id(mqar)

    out = tmp_path / "noeod"
    assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"), "--tokenizer", str(GPT2),
                       "--output-prefix", str(out), "--no-progress"]) == 0
    given = load_config([TINY], [f"data.data_path=[{out}_text_document]", "data.carry_state=true",
                                 "data.eod_token_id=50256"])
    with pytest.raises(DataConfigError, match=r"data.eod_token_id=50256 ends none of the first 64 documents of "
                                              r".*noeod_text_document \(they end with"):
        carried_eod_id(given)
    bare = tmp_path / "bare_text_document"   # the EOD data without its sidecar (as Megatron's tools write it)
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{fineweb_prefix}{suffix}", f"{bare}{suffix}")
    given.data.data_path = [str(bare)]
    assert carried_eod_id(given) == 50256


def test_a_resume_that_cannot_continue_the_carried_rows_is_refused_before_any_work(fineweb_prefix, tmp_path):
    """Rank 0's checks before any work (one line on every rank): a carry checkpoint resumed with
    data.carry_state=false, another micro-batch, another DP (the refusal that came from rank 0 alone
    once the ranks had started, rank 1 then failing with a gloo traceback), another
    train.train_tokens (other streams), and a checkpoint trained without carry resumed with it, each
    naming what would change and train.load_carried_state=false, which accepts it. Another
    train.carry_grad_windows continues (the state at a step's end is the same)."""
    from distributed import run_distributed
    from test_distill import _train

    from megatron_id.checkpoint.files import latest_folder, read_client_state, write_client_state
    from megatron_id.checkpoint.integrity import checkpoint_files, manifest_entries, write_manifest
    from megatron_id.config import ConfigError, load_config
    from megatron_id.training.engine import check_run
    from megatron_id.training.layout import training_layout
    save = tmp_path / "run"
    run_distributed(_train, 1, (_items(fineweb_prefix, save, "train.train_tokens=512"),), timeout=300)   # 2 steps

    def check(*extra, world=1, root=save):
        cfg = load_config([TINY], _items(fineweb_prefix, root, "train.train_tokens=512", f"train.load={root}", *extra))
        return check_run(cfg, training_layout(cfg, world), on_gpu=False)

    check()
    check("train.carry_grad_windows=2")
    refused = [(["data.carry_state=false"], "trained with data.carry_state=true, and this run has data.carry_state="
                                            "false: the state every row carried would be dropped and the data order "
                                            "would change"),
               (["train.micro_batch_size=1"], "another layout (gradient_accumulation: saved 2, now 4, "
                                              "micro_batch_size: saved 2, now 1)"),
               ([], "another layout (data: saved 1, now 2, gradient_accumulation: saved 2, now 1, world: saved 1, "
                    "now 2)")]
    for extra, message in refused:
        world = 1 if extra else 2
        with pytest.raises(ConfigError) as err:
            check(*extra, world=world)
        assert message in str(err.value) and "train.load_carried_state=false" in str(err.value), str(err.value)
        check(*extra, "train.load_carried_state=false", world=world)
    with pytest.raises(ConfigError, match=r"train.train_tokens=1,024 makes 4 steps where the checkpoint's run had 2"):
        check("train.train_tokens=1024")

    plain = tmp_path / "plain"   # the same checkpoint, recorded as trained without carry
    shutil.copytree(save, plain)
    folder = latest_folder(plain)
    client = read_client_state(folder)
    client.data["carry_state"] = False
    write_client_state(folder, client)
    write_manifest(folder, manifest_entries(folder, checkpoint_files(folder)))
    with pytest.raises(ConfigError, match=r"trained without data.carry_state, and this run has data.carry_state=true: "
                                          r"the data order would change .*train.load_carried_state=false"):
        check(root=plain)
    check("train.load_carried_state=false", root=plain)


def _load_rows(rank, world, roots):
    """engine_io.load_carried_state on each rank of a DP=2 run, from each root: what it raised."""
    from types import SimpleNamespace

    from megatron_id.checkpoint import engine_io
    from megatron_id.config import load_config
    from megatron_id.training.carry import CarriedRows
    from megatron_id.training.layout import Layout
    layout = Layout(tensor=1, pipe=1, data=2, micro_batch_size=2, gradient_accumulation=1, global_batch_size=4,
                    tokens_per_step=256, train_iters=2)
    trainer = SimpleNamespace(cfg=load_config([TINY], []), carry=CarriedRows(1, 2, EOD, 1), layout=layout,
                              device="cpu")
    raised = []
    for root in roots:
        try:
            engine_io.load_carried_state(trainer, root)
            raised.append(None)
        except Exception as err:
            raised.append((type(err).__name__, str(err), getattr(err, "same_on_every_rank", False)))
    return raised


def test_carried_state_one_rank_cannot_load_stops_every_rank_with_one_message(tmp_path):
    """A checkpoint's carried state that one rank cannot take (rank 0's file for another layout, rank
    1 without one: a DP=1 checkpoint at DP=2; rank 1's file missing beside rank 0's) stops both ranks
    with the same error, printed once; rank 1 went on alone, into a collective rank 0 had left."""
    from distributed import run_distributed

    from megatron_id.training.carry import CARRIED_FILE, CarriedRows
    roots = []
    for name, data, accumulation in (("dp1", 1, 2), ("dp2", 2, 1)):
        folder = tmp_path / name / "iter_0000002"
        folder.mkdir(parents=True)
        (tmp_path / name / "latest").write_text("iter_0000002")
        layout = {"tensor": 1, "data": data, "micro_batch_size": 2, "gradient_accumulation": accumulation,
                  "world": data}
        torch.save(CarriedRows(accumulation, 2, EOD, 1).state_dict(layout), folder / CARRIED_FILE.format(0))
        roots.append(str(tmp_path / name))
    ranks = run_distributed(_load_rows, 2, (roots,), timeout=120)
    assert ranks[0] == ranks[1], ranks   # both ranks stop, with the same error
    (layout_kind, layout_message, everywhere), (missing_kind, missing_message, everywhere_too) = ranks[0]
    assert everywhere and everywhere_too   # printed by rank 0 alone
    assert layout_kind == "ConfigError" and "for another layout (data: saved 1, now 2" in layout_message
    assert missing_kind == "CheckpointError" and "but not of rank 1 (carried_state_rank00001.pt" in missing_message
