"""`megatron-id plan` (training/plan.py): the layouts it lists are exactly the engine's, its
state terms are exact parameter counts x bytes, and its marks and recommendation are consistent.
No training here: the calibration against measured memory is benchmarks/plan_memory.py."""
import copy
import json
import math

from conftest import CONFIGS

from megatron_id.cli import main
from megatron_id.config import ConfigError, GiB, load_config, parse_size
from megatron_id.model.accounting import count_parameters
from megatron_id.training.layout import training_layout
from megatron_id.training.plan import accepted_layouts, estimate, plan, stage_parameters

SMALL = CONFIGS / "model" / "125m.yaml"   # 12 heads and 12 layers: TP=8 and PP=8 are refused


def test_accepted_layouts_are_exactly_the_ones_training_layout_accepts():
    world, base = 8, ["train.global_batch_size=16"]
    cfg = load_config([SMALL], base)
    planned = {(tp, pp, zero, mb) for tp, pp, zero, mb, _ in accepted_layouts(cfg, world, max_micro_batch=16)}
    brute = set()
    for tp in range(1, world + 1):
        for pp in range(1, world + 1):
            for zero in range(4):
                for mb in (1, 2, 4, 8, 16):
                    trial = copy.deepcopy(cfg)   # (load_config per trial: minutes for 1,280)
                    trial.parallel.tensor_model_parallel_size = tp
                    trial.parallel.pipeline_model_parallel_size = pp
                    trial.train.zero_stage, trial.train.micro_batch_size = zero, mb
                    try:
                        training_layout(trial, world)
                    except ConfigError:
                        continue
                    brute.add((tp, pp, zero, mb))
    assert planned == brute
    assert not any(tp == 8 or pp == 8 or (pp > 1 and zero >= 2) for tp, pp, zero, _ in planned)
    assert (1, 1, 2, 2) in planned and (2, 2, 1, 1) in planned and (2, 1, 3, 1) in planned


def _estimate(items, world, zero, checkpointing=False, memory=80 * GiB):
    cfg = load_config([SMALL], items + [f"train.zero_stage={zero}"])
    return estimate(cfg, training_layout(cfg, world), zero, memory, checkpointing=checkpointing)


def test_weights_gradients_and_optimizer_are_exact_parameter_counts_times_bytes():
    cfg = load_config([SMALL])
    n = count_parameters(cfg.model)
    e = _estimate([], 1, zero=0)
    assert e.parameters_per_gpu == n
    assert (e.weights, e.gradients, e.optimizer, e.zero_buffers) == (4 * n, 4 * n, 8 * n, 0)
    for pp in (2, 3, 4):   # the stages together hold the whole model exactly once
        assert sum(stage_parameters(cfg, 1, pp)) == n


def test_zero_partitions_the_optimizer_state_over_data_parallel_ranks():
    n = count_parameters(load_config([SMALL]).model)
    for dp in (2, 4, 8):
        z0, z1, z2 = (_estimate(["train.global_batch_size=64"], dp, zero) for zero in (0, 1, 2))
        assert z0.optimizer == 8 * n
        assert z1.optimizer == z2.optimizer == 8 * math.ceil(n / dp)
        assert z1.gradients == 4 * n and z2.gradients == 4 * math.ceil(n / dp)
        # DeepSpeed's fp32 partition copy and its gradient, plus the 5e8-element bucket
        assert z1.zero_buffers == 8 * math.ceil(n / dp) + 4 * 500_000_000
        # Adam's temporaries during the step (GPU: foreach, 1 fp32 per element it updates)
        assert z0.optimizer_step == 4 * n and z1.optimizer_step == z2.optimizer_step == 4 * math.ceil(n / dp)
        assert z1.total == sum((z1.weights, z1.gradients, z1.optimizer, z1.zero_buffers, z1.optimizer_step,
                                z1.activations, z1.overhead))


def test_the_host_memory_figure_counts_adams_temporaries_on_the_cpu():
    """run_estimate_gib on CPU (train's host-memory check): torch's CPU AdamW updates one tensor
    at a time with 2 fp32 temporaries of it, i.e. of the whole flat partition under ZeRO-1
    (issue 40: a 1-step ZeRO-1 run of the 350M config measured 36 bytes/parameter besides
    activations, 28 without this term; benchmarks/checkpoint_memory.py)."""
    from megatron_id.parallel.tensor_parallel import padded_vocab_size
    from megatron_id.training.plan import largest_parameter, run_estimate_gib, stage_memory
    cfg = load_config([SMALL], ["train.zero_stage=1", "train.global_batch_size=8"])
    n = count_parameters(cfg.model)
    layout = training_layout(cfg, 1)
    terms = stage_memory(cfg, layout, 1, 0, checkpointing=False, overhead=0, touched_only=True)
    assert terms["optimizer_step"] == 8 * n
    without_activations = terms["total"] - terms["activations"]
    assert without_activations == 36 * n   # 4 weights + 4 grads + 8 Adam + 12 ZeRO buffers + 8 step
    assert abs(run_estimate_gib(cfg, layout, on_gpu=False) * GiB - terms["total"]) < 1
    zero0 = load_config([SMALL], ["train.zero_stage=0", "train.global_batch_size=8"])
    largest = largest_parameter(zero0, 1, 1, 0)   # the embedding, its vocabulary padded
    assert largest == padded_vocab_size(zero0.model, 1) * zero0.model.d_model
    assert stage_memory(zero0, training_layout(zero0, 1), 0, 0, checkpointing=False, overhead=0,
                        touched_only=True)["optimizer_step"] == 8 * largest


def test_activation_checkpointing_lowers_the_activation_term():
    for mixer in ("interdomain", "softmax", "s4d"):
        plain = _estimate([f"model.mixer={mixer}"], 1, 0)
        ckpt = _estimate([f"model.mixer={mixer}"], 1, 0, checkpointing=True)
        assert 0 < ckpt.activations < plain.activations
        assert ckpt.weights == plain.weights


def test_fits_means_total_within_the_margin_and_too_small_gpus_fit_nothing():
    cfg = load_config([SMALL], ["train.global_batch_size=16"])
    estimates = plan(cfg, 8, 24 * GiB, margin=0.1, max_micro_batch=16)
    assert all(e.fits == (e.total <= 0.9 * 24 * GiB) for e in estimates)
    assert any(e.fits for e in estimates) and not all(e.fits for e in estimates)
    assert not any(e.fits for e in plan(cfg, 8, 2 * GiB, max_micro_batch=4))


def test_parse_size():
    assert parse_size("80GiB") == parse_size("80GB") == 80 * GiB
    assert parse_size("512MiB") == 512 * 2 ** 20


def test_cli_json_parses(capsys):
    assert main(["plan", "--config", str(SMALL), "--nodes", "1", "--gpus-per-node", "4",
                 "--gpu-memory", "40GiB", "--max-micro-batch", "4", "--json",
                 "train.global_batch_size=16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layouts"] and {"tensor", "pipe", "data", "zero_stage", "total", "fits",
                               "comm_total"} <= set(out["layouts"][0])
    assert out["recommended"]["fits"]


def test_cli_recommends_a_layout_that_fits_for_1p3b_on_4_x_8_x_80gib(capsys):
    assert main(["plan", "--config", str(CONFIGS / "model" / "1p3b.yaml"), "--nodes", "4",
                 "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--top", "5"]) == 0
    text = capsys.readouterr().out
    line = [x for x in text.splitlines() if x.startswith("recommended:")]
    assert line and "fits" in line[0]
    assert "FITS" in text.splitlines()[2]   # the first row is the recommended one


def test_cli_fails_when_nothing_fits_and_on_bad_sizes(capsys):
    """An empty plan is not a success; impossible cluster sizes are one-line errors."""
    assert main(["plan", "--config", str(CONFIGS / "model" / "1p3b.yaml"), "--nodes", "1",
                 "--gpus-per-node", "1", "--gpu-memory", "4GiB", "--top", "1"]) == 1
    assert "no layout fits" in capsys.readouterr().err
    # a GPU smaller than the assumed overhead: named as such, not "no layout fits" (issue 41)
    assert main(["plan", "--config", str(SMALL), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory", "1GiB"]) == 2
    assert "--overhead 2GiB is not less than the 0.9 GiB" in capsys.readouterr().err
    assert main(["plan", "--config", str(SMALL), "--nodes", "0", "--gpus-per-node", "4",
                 "--gpu-memory", "40GiB"]) == 2
    assert "--nodes 0: must be at least 1" in capsys.readouterr().err.strip().splitlines()[-1]


def test_distillation_counts_the_teacher_and_trains_only_the_converted_mixers(monkeypatch):
    """train.distill (issue 57: the plan printed the same memory for both stages, as plain
    training): both stages add the teacher's weights (in its dtype) and its logits; stage logits
    trains the whole student and keeps the KL's gradient ([tokens, V/TP] float32); stage layers
    has gradients and Adam's state for the converted mixers' parameters alone and keeps their
    activations, not the student's LM head's. The measured side is benchmarks/plan_memory.py --distill."""
    from megatron_id.model.accounting import build_on_meta
    from megatron_id.parallel.layout import padded_vocab_size
    from megatron_id.training import plan as planner
    from megatron_id.training.plan import stage_memory
    teacher = load_config([SMALL], ["model.mixer=softmax"]).model
    monkeypatch.setattr(planner, "_teacher_model", lambda path: teacher)
    student = ["model.layer_pattern=IAAAAAAAAAAI", "train.global_batch_size=2", "parallel.tensor_model_parallel_size=2"]
    tokens, vocab_local = 1 * teacher.seq_length, padded_vocab_size(teacher, 2) // 2

    def terms(*extra):
        cfg = load_config([SMALL], student + list(extra))
        return stage_memory(cfg, training_layout(cfg, 2), 0, 0, checkpointing=False, overhead=0)
    plain = terms()
    teacher_params = stage_parameters(load_config([SMALL], ["model.mixer=softmax"]), 2, 1)[0]
    logits = terms("train.distill.teacher=t", "train.distill.stage=logits")
    assert logits["teacher"] == 4 * teacher_params + 4 * tokens * vocab_local
    assert logits["activations"] == plain["activations"] + 4 * tokens * vocab_local
    assert (logits["gradients"], logits["optimizer"]) == (plain["gradients"], plain["optimizer"])
    layers = terms("train.distill.teacher=t", "train.distill.stage=layers")
    model = build_on_meta(load_config([SMALL], student).model)
    converted = sum(p.numel() for name, p in model.named_parameters()
                    if name.startswith(("layers.0.mixer.", "layers.11.mixer.")))
    assert 0 < layers["gradients"] < plain["gradients"] / 10
    # TP=2 halves the mixers' split parameters: between a half and the whole of the converted count
    assert converted / 2 <= layers["gradients"] / 4 < converted
    assert layers["optimizer"] == 2 * layers["gradients"] and layers["activations"] < plain["activations"] / 3
    assert layers["teacher"] == logits["teacher"] and layers["total"] < plain["total"] < logits["total"]
    half = terms("train.distill.teacher=t", "train.distill.stage=logits", "train.distill.teacher_dtype=bfloat16")
    assert half["teacher"] == logits["teacher"] // 2
