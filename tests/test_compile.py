"""train.compile=true (issue 15, item 4): the compiled model trains like eager, its checkpoints
load with compile off and the other way round, the training forward compiles as one graph, and
what cannot compile is refused before any work.

Cost: one cold inductor compilation of the tiny model's training step (one layer, forward and
backward, float32): about a minute on 2 CPU cores (75 s for this file, cold), 25 s warm.
"""
import importlib.util

import pytest
import torch
from conftest import CONFIGS
from distributed import run_distributed

from megatron_id.config import ConfigError, load_config
from megatron_id.training.compilation import CompileToolchainError, check_compile_toolchain
from megatron_id.training.layout import training_layout

TINY = CONFIGS / "model" / "tiny.yaml"
SAVE_AT, STEPS = 3, 4
# Compiled and eager float32 differ only by rounding: inductor fuses the pointwise ops, reorders
# reductions (the norms' means, the SSM's sums) and uses its own vectorised exp/rsqrt, a few
# ulp (~1e-7 relative) per op. Over these 4 AdamW steps at lr 1e-2 the losses and gradient norms
# differed by at most 1.8e-7 relative (measured: two float32 ulps of a loss of 10.8). 1e-5 leaves
# a margin of 50 for other CPUs' vector units and still fails on any real mistake: a wrong or
# missed update, or a step on another batch, moves the loss by 1e-3 or more.
LOSS_RTOL = NORM_RTOL = 1e-5


def items(prefix, *extra):
    # one layer: inductor's compile time grows with the graph, and the second layer would test
    # nothing the first does not
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257", "model.n_layers=1",
            "train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=2",
            f"train.train_tokens={STEPS * 2 * 64}", "optimizer.lr=1e-2", "optimizer.warmup_tokens=256",
            "optimizer.min_lr=1e-3", *extra]


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}


def _eager_compiled_and_crossed(rank, world, base, folder):
    """Eager and compiled: SAVE_AT steps, save, one more step. Then each checkpoint resumed by
    the other mode for that last step."""
    from torch._dynamo.utils import counters

    from megatron_id.training.engine import Trainer

    def compiled_so_far():   # what dynamo made: graphs, and graph breaks (in any frame, backward too)
        return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())

    def trainer(compiled, *extra):
        return Trainer(load_config([TINY], base + [f"train.compile={str(compiled).lower()}", *extra]))

    def steps(t, n):
        return [(t.train_step(), t.grad_norm()) for _ in range(n)]

    out = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        t = trainer(compiled, f"train.save={folder / name}")
        run = steps(t, SAVE_AT)
        t.save_checkpoint(folder / name)
        out[f"{name}_saved"] = _weights(t)
        out[name] = run + steps(t, STEPS - SAVE_AT)
        out[f"{name}_keys"] = list(t.engine.module.state_dict())
        out[f"{name}_graphs_and_breaks"] = compiled_so_far()
        t.close()
    for name, compiled, source in (("eager_from_compiled", False, "compiled"),
                                   ("compiled_from_eager", True, "eager")):
        t = trainer(compiled, f"train.load={folder / source}")
        assert t.step == SAVE_AT
        out[f"{name}_loaded_equal"] = all(torch.equal(v, out[f"{source}_saved"][k])
                                          for k, v in _weights(t).items())
        out[name] = steps(t, STEPS - SAVE_AT)
        t.close()
    for name in ("eager", "compiled"):
        del out[f"{name}_saved"]   # (the parent needs only the verdicts)
    return out


def _close(got, want, rtol):
    return abs(got - want) <= rtol * abs(want)


@pytest.mark.slow
def test_compiled_training_matches_eager_and_checkpoints_load_either_way(fineweb_prefix, tmp_path):
    out = run_distributed(_eager_compiled_and_crossed, 1, args=(items(fineweb_prefix), tmp_path), timeout=600)[0]
    eager, compiled = out["eager"], out["compiled"]
    assert out["eager_graphs_and_breaks"] == (0, 0)      # eager really ran eager,
    assert out["compiled_graphs_and_breaks"] == (1, 0)   # compiled: one graph for every step, no break
    assert eager[0][0] > eager[-1][0] + 0.1   # it learns: the comparison is not between constants
    for step, ((loss, norm), (want, want_norm)) in enumerate(zip(compiled, eager), start=1):
        assert _close(loss, want, LOSS_RTOL), (step, loss, want, compiled, eager)
        assert _close(norm, want_norm, NORM_RTOL), (step, norm, want_norm)
    # compiled in place: the same parameter names, no OptimizedModule `_orig_mod.` prefix
    assert out["compiled_keys"] == out["eager_keys"]
    assert not any("_orig_mod" in k for k in out["compiled_keys"])
    # each checkpoint loads bit for bit in the other mode and continues as its own run did
    assert out["eager_from_compiled_loaded_equal"] and out["compiled_from_eager_loaded_equal"]
    (loss, norm), = out["eager_from_compiled"]
    assert _close(loss, compiled[SAVE_AT][0], LOSS_RTOL) and _close(norm, compiled[SAVE_AT][1], NORM_RTOL)
    (loss, norm), = out["compiled_from_eager"]
    assert _close(loss, eager[SAVE_AT][0], LOSS_RTOL) and _close(norm, eager[SAVE_AT][1], NORM_RTOL)


@pytest.mark.parametrize("mixer", ["interdomain", "s4d", "softmax", "model.layer_pattern=IAS"])
def test_training_forward_compiles_as_one_graph(mixer):
    """No graph break in the training forward of the trainer's (tensor-parallel) model: a break
    splits the compiled graph, runs the code between in eager Python and stops fusion across it.
    (A hybrid too. A W layer on the CPU is an eager island: ops/attention.blockwise_attention.)"""
    import torch._dynamo

    from megatron_id.parallel.tensor_parallel import parallel_model
    items = [mixer, "model.n_layers=3"] if "=" in mixer else [f"model.mixer={mixer}"]
    cfg = load_config([TINY], items)
    model = parallel_model(cfg.model, None, seed=0).train()   # group None: one rank
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(model)(torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length)))
    finally:
        torch._dynamo.reset()
    reasons = [(b.reason.splitlines()[0], [f"{f.filename}:{f.lineno}" for f in b.user_stack[-3:]])
               for b in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons


@pytest.mark.parametrize("overrides,refused", [
    (["model.core_impl=recompute"], "model.core_impl=recompute"),
    (["model.mixer=s4d", "model.core_impl=recompute"], "model.core_impl=recompute"),
    (["model.seq_length=16384"], "model.core_impl=auto at model.seq_length=16384"),
    (["model.core_impl=autograd", "model.seq_length=16384"], None),
    (["model.mixer=softmax", "model.core_impl=recompute"], None),   # no SSM core to recompute
])
def test_compile_refuses_the_recomputing_core(overrides, refused):
    cfg = load_config([TINY], ["train.compile=true", *overrides])
    if refused is None:
        training_layout(cfg, 1)
        return
    with pytest.raises(ConfigError, match="train.compile=true cannot be combined") as err:
        training_layout(cfg, 1)
    assert refused in str(err.value) and "model.core_impl=autograd" in str(err.value)
    assert "train.compile=false" in str(err.value)
    training_layout(load_config([TINY], ["train.compile=false", *overrides]), 1)   # eager: fine


def test_compile_toolchain_is_checked_before_the_first_step(monkeypatch):
    check_compile_toolchain("cpu", {})   # g++ is on PATH here and in CI: the training test needs it
    with pytest.raises(CompileToolchainError, match="'/nonexistent/c\\+\\+' \\(the CXX environment variable\\)"):
        check_compile_toolchain("cpu", {"CXX": "/nonexistent/c++"})
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    with pytest.raises(CompileToolchainError, match="needs triton.*train.compile=false"):
        check_compile_toolchain("cuda")
