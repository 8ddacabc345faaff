"""Context parallelism (parallel/context_parallel.py): a sequence split into C contiguous blocks
over C gloo ranks computes what one process computes on the whole sequence: every block's
logits and, summed over the ranks, every parameter gradient (float64, < 1e-10), for the three
mixers, with and without packed documents whose boundaries fall inside blocks and on block
edges."""
import pytest
import torch
from conftest import CONFIGS
from distributed import run_distributed

N = 48


def _model(mixer, extra=()):
    from megatron_id.config import load_config
    from megatron_id.model import LanguageModel
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"],
                      [f"model.mixer={mixer}", "model.d_model=16", "model.n_heads=2", "model.state_size=5",
                       "model.chunk_size=8", "model.vocab_size=64", "model.core_impl=autograd", *extra]).model
    return LanguageModel(cfg, seed=4).double()


def _tokens(documents: bool):
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(8, 64, (2, N), generator=g)
    # EOD (7) inside blocks, right before a block edge (24 at CP=2, 12/24/36 at CP=4), and two
    # tokens before one (9, 21: the document starting after it crosses the edge, and the convs'
    # window into the previous block must not reach the EOD before it)
    if documents:
        for row, cols in ((0, [4, 11, 23, 30]), (1, [0, 9, 17, 21, 35, 46])):
            tokens[row, cols] = 7
    return tokens


def _inputs(tokens, documents):
    from megatron_id.training.documents import document_index
    if not documents:
        return {}
    seq_idx, positions = document_index(tokens, 7)
    return {"seq_idx": seq_idx, "position_ids": positions}


def _block_losses(rank, world, mixer, documents):
    import torch.distributed as dist

    from megatron_id.parallel.context_parallel import ContextParallel, apply_context_parallel, split_sequence
    cp = ContextParallel(dist.group.WORLD, rank, world)
    model = apply_context_parallel(_model(mixer), cp)
    tokens = _tokens(documents)
    inputs = {k: split_sequence(v, cp) for k, v in _inputs(tokens, documents).items()}
    logits = model(split_sequence(tokens, cp), **inputs)
    weight = split_sequence(torch.randn(2, N, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64), cp)
    grads = torch.autograd.grad((logits * weight).sum(), list(model.parameters()))
    return logits.detach(), [g.detach() for g in grads]


@pytest.mark.slow
@pytest.mark.parametrize("mixer,documents", [("interdomain", False), ("interdomain", True), ("s4d", True),
                                             ("softmax", True)],
                         ids=["interdomain-one-document", "interdomain-packed", "s4d-packed", "softmax-packed"])
def test_context_parallel_equals_one_process(mixer, documents):
    from conftest import relative_error
    model = _model(mixer)
    tokens = _tokens(documents)
    logits = model(tokens, **_inputs(tokens, documents))
    weight = torch.randn(2, N, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((logits * weight).sum(), list(model.parameters()))
    for world in ((2, 4) if mixer == "interdomain" else (4,)):   # CP=4: documents start on block edges
        results = run_distributed(_block_losses, world, args=(mixer, documents), timeout=120)
        joined = torch.cat([r[0] for r in results], dim=1)
        assert relative_error(joined, logits) < 1e-10, world
        for i, (name, _) in enumerate(model.named_parameters()):
            summed = sum(r[1][i] for r in results)
            assert relative_error(summed, grads[i]) < 1e-10, (world, name)


# ---------------------------------------------------------------- the trainer

STEPS = 3


def _overrides(prefix, tp=1, cp=1, extra=()):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            f"parallel.tensor_model_parallel_size={tp}", f"parallel.context_parallel_size={cp}",
            "train.zero_stage=1", "train.precision=fp32", "train.micro_batch_size=2",
            "train.global_batch_size=2", f"train.train_tokens={2 * STEPS * 2 * 64}", "optimizer.lr=1e-2",
            "optimizer.warmup_tokens=256", "optimizer.min_lr=1e-3", *extra]


def _train(rank, world, items, steps, save):
    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
    losses = [trainer.train_step() for _ in range(steps)]
    if save:
        trainer.save_checkpoint(trainer.cfg.train.save)
    return losses


@pytest.mark.slow
def test_training_with_context_parallelism_equals_one_rank_and_resumes_across_cp(fineweb_prefix, tmp_path):
    """Losses of 3 steps (fp32, ZeRO-1, packed-document switches on: resets across block
    edges) at CP=2, CP=4 and TP=2 x CP=2 equal one rank's (< 1e-5 relative); a checkpoint
    written at CP=2 resumes at CP=1 (DP=2) and continues the same trajectory."""
    switches = ["data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true"]
    reference = run_distributed(_train, 1, args=(_overrides(fineweb_prefix, extra=switches), 2 * STEPS, False),
                                timeout=300)[0]
    for tp, cp in [(1, 2), (1, 4), (2, 2)]:
        results = run_distributed(_train, tp * cp, args=(_overrides(fineweb_prefix, tp, cp, switches), STEPS, False),
                                  timeout=300)
        for rank, losses in enumerate(results):
            for step, (got, want) in enumerate(zip(losses, reference)):
                assert abs(got - want) <= 1e-5 * abs(want), (tp, cp, rank, step, got, want)
    save = [f"train.save={tmp_path / 'run'}"]
    run_distributed(_train, 2, args=(_overrides(fineweb_prefix, 1, 2, switches + save), STEPS, True), timeout=300)
    resumed = run_distributed(_train, 2, args=(_overrides(fineweb_prefix, 1, 1, switches + [
        f"train.load={tmp_path / 'run'}", "train.micro_batch_size=1"]), STEPS, False), timeout=300)
    for rank, losses in enumerate(resumed):
        for step, (got, want) in enumerate(zip(losses, reference[STEPS:])):
            assert abs(got - want) <= 1e-5 * abs(want), ("resumed at CP=1", rank, step, got, want)
