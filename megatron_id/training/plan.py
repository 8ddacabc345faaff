"""Memory and communication planner: which TP x PP x DP x ZeRO x micro-batch layouts fit a GPU
(what `megatron-id plan` prints). Plain functions, estimates per GPU of the busiest stage.

Which layouts exist is decided by `training_layout` (the engine's own checks), never here.

Memory per GPU (bytes; P = parameters of the stage on this rank, TP shards divided by TP, norms
replicated; vocabulary padded as parallel/tensor_parallel.py pads it):
- weights      4 P         fp32 weights even with bf16 autocast (layout.py, "Precision")
- gradients    4 P         ZeRO-0/1: every parameter's .grad; ZeRO-2: 4 P / DP (the rank's
                            partition, `grads_in_partition` in deepspeed/runtime/zero/stage_1_and_2.py)
- optimizer    8 P         Adam exp_avg + exp_avg_sq in fp32; ZeRO-1/2: 8 P / DP
- zero copies  ZeRO-1/2:   DeepSpeed clones the rank's partition as its "fp32 master" even for an
                            fp32 model (`single_partition_of_fp32_groups`, `.detach().clone()`), and
                            gives it an fp32 gradient partition for the step: 2 x 4 P / DP; plus
                            the contiguous-gradient bucket `torch.empty(reduce_bucket_size)` of 5e8
                            elements (4 bytes each: 2 GB on a GPU; on CPU only the touched pages,
                            min(P, 5e8) elements, are resident)
- optimizer step  the temporaries of Adam's update, alive at the step's peak on top of all the
               above (issue 40: a 1-step ZeRO-1 run on one CPU process peaked at 36.9 bytes per
               parameter at 117M parameters, the terms above giving 28 + 2.9 of activations; at
               the 350M config 13.99 GiB where they gave 11.44, benchmarks/checkpoint_memory.py
               prints both): torch's AdamW computes its denominator out of place,
               sqrt(exp_avg_sq) then / bias correction: on CPU (one tensor at a time) two fp32
               temporaries of its largest tensor, which under ZeRO-1/2/3 is the rank's whole flat
               partition: 8 P / DP (ZeRO-0: 8 x the largest parameter); on a GPU (foreach over
               the group) one fp32 temporary per tensor: 4 P / DP (ZeRO-0: 4 P)
- activations  per micro-batch b, sequence N, per block (bytes, coefficients below):
                  softmax:           b N (c_d d + c_f f)
                  interdomain / s4d: b N (c_d d + c_f f + c_hm H M + c_chunk d M / T)
                                     + c_mm H M^2 + c_tm H T M   (tables of C and the decays)
               with d width, f FFN width, H heads, M modes, T chunk; a hybrid's blocks each by
               their own mixer (model.layer_pattern). Under TP everything but the
               block input and the two norms (3 d per token, fp32) is divided by TP.
               The coefficients were calibrated once by counting the bytes of the tensors that
               autograd saves for one block (torch.autograd.graph.saved_tensors_hooks, 11 shapes
               with d 128-512, f 128-2048, N 256-1024, H 2-8, M 16-64, T 16-64, fp32 and bf16
               autocast; fit error <= 8.1%, softmax under bf16 <= 31%), plus the block input
               (4 bytes per token and channel: the residual stream is fp32); the fit is
               benchmarks/plan_coefficients.py. The softmax fp32 numbers match a count by hand:
               9.5 d + 4 f floats per token besides the input (norm outputs, q k v, their RoPE
               outputs, the SDPA output, the SwiGLU's w1, w3, silu and product).
               Grouped-query attention (model.n_kv_heads) changes P (k_proj and v_proj are
               built n_kv_heads wide; P comes from the built model) but not these bytes: SDPA
               saves k and v repeated to every query head (counted as above: the same bytes in
               fp32, 1-7 d per token fewer under bf16 autocast), so the softmax coefficients stand.
               Activation checkpointing keeps only each block's input (4 b N d) and recomputes
               one block at a time, so a stage holds layers x 4 b N d + one block's activations.
- pipeline     1F1B: the first stage holds min(PP, gradient accumulation) micro-batches in flight
               (the last holds 1). Stage 0 adds the embedding output, the last stage the final
               norm (2 x 4 b N d), the LM head's logits and the vocab-parallel loss
               (16 bytes per token and local vocabulary entry: four fp32 [tokens, V/TP] tensors
               at its peak; PP > 1: + 4 for the logits DeepSpeed's PipelineEngine keeps in its
               second output buffer, `pipe_buffers['outputs']` in deepspeed/runtime/pipe/engine.py).
- distillation train.distill (distill_memory): the teacher's weights in its dtype and its logits;
               stage logits keeps the KL's gradient (4 bytes per token and local vocabulary entry);
               stage layers trains (gradients, Adam) and keeps activations of the converted
               mixers only, plus the teacher's input and output of each. benchmarks/plan_memory.py
               --distill measures both stages.
- overhead     a constant per process (CUDA context, NCCL, allocator): an assumption on GPUs
               (--overhead, default 2 GiB); measured on CPU by benchmarks/plan_memory.py.

Communication per optimizer step and GPU (bytes sent; ring algorithms: an all-reduce of S bytes
over n ranks sends 2 (n-1)/n S, a reduce-scatter or all-gather (n-1)/n S):
- DP   ZeRO-0: all-reduce of the fp32 gradients 4 P; ZeRO-1/2: gradient reduction (all-reduce,
       resp. reduce-scatter) + all-gather of the updated fp32 partitions.
- TP   per block 2 all-reduces forward (mixer and FFN outputs) and 2 backward of b N d
       activations (2 bytes under bf16 autocast, else 4), 2 more forward with activation
       checkpointing (recompute); plus the vocab-parallel embedding (1 fwd + 1 bwd).
- PP   per micro-batch the stage's output activation forward and its gradient back (fp32
       residual stream: 4 b N d each way).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config import Config, ConfigError, GiB, ffn_hidden_size
from ..model.accounting import build_on_meta
from ..model.pattern import layer_mixer
from ..parallel.layout import stage_layers
from ..parallel.tensor_parallel import padded_vocab_size, partition_dim
from .layout import training_layout

ZERO_BUCKET_ELEMENTS = 500_000_000   # DeepSpeed's default reduce_bucket_size (zero/config.py)

# bytes per block, see the module docstring; keys (mixer, bf16 autocast)
ACTIVATION_COEFFICIENTS = {   # benchmarks/plan_coefficients.py, d + 4 for the block input
    ("softmax", False): dict(d=42.2, f=15.8),
    ("softmax", True): dict(d=38.5, f=12.8),
    ("interdomain", False): dict(d=97.4, f=17.7, hm=63.5, chunk=20.4, mm=0.0, tm=588.1),
    ("interdomain", True): dict(d=129.0, f=11.8, hm=22.4, chunk=2.9, mm=398.2, tm=418.4),
    ("s4d", False): dict(d=69.7, f=17.8, hm=28.4, chunk=21.1, mm=0.0, tm=563.1),
    ("s4d", True): dict(d=103.0, f=13.0, hm=0.0, chunk=0.0, mm=356.5, tm=341.9),
}


@dataclass(frozen=True)
class Estimate:
    tensor: int
    pipe: int
    data: int
    zero_stage: int
    micro_batch_size: int
    gradient_accumulation: int
    activation_checkpointing: bool
    mixer: str
    parameters_per_gpu: int       # the largest stage's parameters on one rank
    weights: int                  # bytes
    gradients: int
    optimizer: int
    zero_buffers: int
    activations: int
    overhead: int
    total: int
    fits: bool
    comm_dp: int                  # bytes sent per step and GPU
    comm_tp: int
    comm_pp: int
    comm_total: int
    optimizer_step: int = 0       # bytes: Adam's temporaries during the step (in total)


_SHAPES_CACHE: dict = {}
_COUNTS: dict = {}


def _parameter_table(cfg: Config) -> dict:
    """{part: [(name, numel, split by TP?)]} for the embedding, each block, the final norm and the
    LM head, from one build on the meta device (exact, no memory; cached: a plan asks hundreds of
    times, and asking each parameter's role every time cost the grid's dry run 8 of its 11 s)."""
    key = repr(cfg.model)
    if key not in _SHAPES_CACHE:
        model = build_on_meta(cfg.model)
        parts = {"embed": model.embed, "norm": model.norm, "lm_head": model.lm_head,
                 **{f"layers.{i}": block for i, block in enumerate(model.layers)}}
        _SHAPES_CACHE[key] = {prefix: [(f"{prefix}.{n}", p.numel(), partition_dim(f"{prefix}.{n}", cfg.model)
                                        is not None) for n, p in mod.named_parameters()]
                              for prefix, mod in parts.items()}
    return _SHAPES_CACHE[key]


def stage_parameters(cfg: Config, tp: int, pp: int) -> list[int]:
    """Parameters on one rank of each pipeline stage: the embedding on the first stage, the
    blocks as the pipeline places them (parallel/layout.stage_layers), the final norm and LM
    head on the last; TP shards divided by TP."""
    m = cfg.model
    table = _parameter_table(cfg)
    vocab_scale = padded_vocab_size(m, tp) / m.vocab_size
    counted = _COUNTS.setdefault((repr(m), tp), {})   # per part, once per config and TP

    def count(prefix):
        if prefix not in counted:
            total = 0
            for _, n, split in table[prefix]:
                n = n * vocab_scale if prefix in ("embed", "lm_head") else n
                total += n // tp if split else n
            counted[prefix] = int(total)
        return counted[prefix]

    per_stage = [sum(count(f"layers.{i}") for i in layers) for layers in stage_layers(m, pp)]
    per_stage[0] += count("embed")
    if not (m.tie_embeddings and pp == 1):   # tied across stages: the last stage holds a copy
        per_stage[-1] += count("lm_head")
    per_stage[-1] += count("norm")
    return per_stage


COEFFICIENT_TERMS = ("d", "f", "hm", "chunk", "mm", "tm")


def activation_coefficients(mixer: str, bf16: bool) -> dict[str, float]:
    """The measured coefficients of `mixer` (missing terms 0). A mixer nobody has measured yet
    (docs/adding-a-mixer.md) gets, term by term, the largest any measured mixer has: a guess on
    the high side until benchmarks/plan_coefficients.py fits its own."""
    found = ACTIVATION_COEFFICIENTS.get((mixer, bf16))
    if found is None:
        measured = [c for (_, autocast), c in ACTIVATION_COEFFICIENTS.items() if autocast == bf16]
        return {term: max(c.get(term, 0.0) for c in measured) for term in COEFFICIENT_TERMS}
    return {term: found.get(term, 0.0) for term in COEFFICIENT_TERMS}


def block_activation_bytes(cfg: Config, micro_batch: int, tp: int, bf16: bool, layer: int = 0) -> float:
    """Bytes autograd keeps for block `layer` and one micro-batch (module docstring); a hybrid's
    blocks each by their own mixer's coefficients (a W layer's as softmax: its attention keeps
    q, k, v and the output, as SDPA's kernel does)."""
    m = cfg.model
    mixer = layer_mixer(m, layer)
    c = activation_coefficients(mixer, bf16)
    d, f, H, M, T = m.d_model, ffn_hidden_size(m), m.n_heads, m.state_size, m.chunk_size
    tokens = micro_batch * m.seq_length
    total = tokens * (c["d"] * d + c["f"] * f)
    total += tokens * (c["hm"] * H * M + c["chunk"] * d * M / T)   # the interdomain / s4d terms
    total += c["mm"] * H * M * M + c["tm"] * H * T * M   # parameter-only tables (C, decays)
    replicated = tokens * 3 * d * 4   # block input and the two norms' outputs, on every TP rank
    return replicated + (total - replicated) / tp


def stage_activation_bytes(cfg: Config, stage: int, pp: int, tp: int, micro_batch: int,
                           grad_accum: int, checkpointing: bool, bf16: bool) -> float:
    m = cfg.model
    tokens = micro_batch * m.seq_length
    layers = stage_layers(m, pp)[stage]
    blocks = [block_activation_bytes(cfg, micro_batch, tp, bf16, i) for i in layers]
    in_flight = min(pp - stage, grad_accum)   # 1F1B: stage s warms up with PP - s forwards
    if checkpointing:   # stored block inputs, plus one block being recomputed in backward
        per_mb, once = len(layers) * 4 * tokens * m.d_model, max(blocks)
    else:
        per_mb, once = sum(blocks), 0.0
    if stage == 0:
        per_mb += 4 * tokens * m.d_model   # embedding output
    total = in_flight * per_mb + once
    if stage == pp - 1:   # final norm, logits, loss: one micro-batch at a time
        vocab_local = padded_vocab_size(m, tp) // tp
        # the vocab-parallel loss (parallel/layers.py) peaks at 4 fp32 [tokens, V_local]
        # tensors: the logits, the shifted logits, exp and the softmax it saves (in backward:
        # logits, softmax, its clone and the product); DeepSpeed's pipeline keeps the last
        # stage's outputs (the logits) in 2 buffers, so one more micro-batch's logits stay alive
        retained = 1 if pp > 1 and grad_accum > 1 else 0
        total += 2 * 4 * tokens * m.d_model + (16 + 4 * retained) * tokens * vocab_local
    return total


def zero_buffer_bytes(zero_stage: int, params: int, dp: int, bucket_elements: int,
                      touched_only: bool = False) -> int:
    """ZeRO-1/2: fp32 master partition + its fp32 gradient + the reduction bucket. The bucket is
    allocated whole (torch.empty); `touched_only` counts only the part gradients are written to,
    which is what a CPU's resident memory (RSS) shows."""
    if zero_stage == 0:
        return 0
    bucket = min(bucket_elements, params) if touched_only else bucket_elements
    return 2 * 4 * math.ceil(params / dp) + 4 * bucket


def optimizer_step_bytes(zero_stage: int, params: int, dp: int, largest: int, on_cpu: bool) -> int:
    """Adam's temporaries during the step (module docstring): on CPU 2 fp32 copies of the
    largest tensor it updates (the flat partition under ZeRO), on a GPU 1 per tensor."""
    if on_cpu:
        return 8 * (math.ceil(params / dp) if zero_stage > 0 else largest)
    return 4 * (math.ceil(params / dp) if zero_stage > 0 else params)


def largest_parameter(cfg: Config, tp: int, pp: int, stage: int) -> int:
    """Elements of the largest parameter on one rank of `stage` (TP shards divided by TP)."""
    m = cfg.model
    table = _parameter_table(cfg)
    vocab_scale = padded_vocab_size(m, tp) / m.vocab_size
    parts = [f"layers.{i}" for i in stage_layers(m, pp)[stage]]
    parts += ["embed"] if stage == 0 else []
    parts += ["norm", "lm_head"] if stage == pp - 1 else []
    sizes = [int(n * vocab_scale if part in ("embed", "lm_head") else n)
             // (tp if split else 1)
             for part in parts for _, n, split in table[part]]
    return max(sizes, default=0)


def communication(cfg: Config, tp: int, pp: int, dp: int, zero: int, micro_batch: int,
                  grad_accum: int, params: int, checkpointing: bool, bf16: bool) -> tuple[int, int, int]:
    """Bytes one GPU sends per optimizer step for DP, TP and PP (module docstring)."""
    m = cfg.model
    ring_ar = lambda n, size: 2 * (n - 1) / n * size   # noqa: E731
    ring_rs = lambda n, size: (n - 1) / n * size       # noqa: E731
    grads = 4 * params
    if zero == 0:
        dp_bytes = ring_ar(dp, grads)
    elif zero == 1:   # ZeRO-1 all-reduces the gradients, then all-gathers the updated partitions
        dp_bytes = ring_ar(dp, grads) + ring_rs(dp, grads)
    else:             # ZeRO-2 reduce-scatters them instead
        dp_bytes = 2 * ring_rs(dp, grads)
    act = micro_batch * m.seq_length * m.d_model
    act_bytes = 2 if bf16 else 4
    per_block = (4 + (2 if checkpointing else 0)) * ring_ar(tp, act * act_bytes)
    busiest = max(len(layers) for layers in stage_layers(m, pp))   # blocks of the largest stage
    tp_bytes = grad_accum * (busiest * per_block + 2 * ring_ar(tp, act * 4))
    pp_bytes = grad_accum * 2 * act * 4 if pp > 1 else 0
    return int(dp_bytes), int(tp_bytes), int(pp_bytes)


def accepted_layouts(cfg: Config, world_size: int, max_micro_batch: int = 64):
    """(tp, pp, zero, micro_batch, Layout) for every layout `training_layout` accepts."""
    out = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            for zero in (0, 1, 2, 3):
                mb = 1
                while mb <= max_micro_batch:
                    trial = _with(cfg, tp, pp, zero, mb)
                    try:
                        out.append((tp, pp, zero, mb, training_layout(trial, world_size)))
                    except ConfigError:
                        pass
                    mb *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _with(cfg: Config, tp: int, pp: int, zero: int, mb: int) -> Config:
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp),
        train=dataclasses.replace(cfg.train, zero_stage=zero, micro_batch_size=mb))


def stage_memory(cfg: Config, layout, zero: int, stage: int, *, checkpointing: bool,
                 overhead: float, bucket_elements: int = ZERO_BUCKET_ELEMENTS,
                 touched_only: bool = False) -> dict:
    """Bytes per term on one rank of pipeline stage `stage` (module docstring; train.distill:
    distill_memory)."""
    tp, pp, dp = layout.tensor, layout.pipe, layout.data
    P = stage_parameters(cfg, tp, pp)[stage]
    bf16 = cfg.train.precision.value == "bf16"
    activations = stage_activation_bytes(cfg, stage, pp, tp, layout.micro_batch_size, layout.gradient_accumulation,
                                         checkpointing, bf16)
    trained, largest, teacher = P, largest_parameter(cfg, tp, pp, stage), 0
    if cfg.train.distill.teacher is not None:
        trained, largest, activations, teacher = distill_memory(cfg, tp, layout.micro_batch_size, activations,
                                                                checkpointing, bf16)
    terms = dict(
        parameters=P,
        weights=4 * P,
        gradients=4 * trained if zero < 2 else 4 * math.ceil(trained / dp),
        optimizer=8 * trained if zero == 0 else 8 * math.ceil(trained / dp),
        zero_buffers=zero_buffer_bytes(zero, trained, dp, bucket_elements, touched_only),
        optimizer_step=optimizer_step_bytes(zero, trained, dp, largest if zero == 0 else 0, on_cpu=touched_only),
        activations=activations,
        teacher=teacher,
        overhead=overhead)
    terms["total"] = sum(v for k, v in terms.items() if k != "parameters")
    return terms


_TEACHERS: dict = {}


def _teacher_model(path: str):
    """The teacher's model config (training/distill.py reads it from its files), once per path."""
    if path not in _TEACHERS:
        from .distill import TeacherSource
        _TEACHERS[path] = TeacherSource.read(path).cfg
    return _TEACHERS[path]


def distill_memory(cfg: Config, tp: int, micro_batch: int, activations: float, checkpointing: bool,
                   bf16: bool) -> tuple[int, int, float, float]:
    """train.distill (training/distill.py; no pipeline there): (parameters trained, the largest of
    them, activation bytes, the teacher's bytes) on one TP rank.
    - the teacher: its weights in train.distill.teacher_dtype, and its logits [tokens, V / TP],
      which its forward makes in both stages (without gradients: nothing else of it stays);
    - stage logits: the student trains whole; the KL keeps its gradient from forward to backward
      (4 bytes per token and local vocabulary entry: parallel/layers.py _VocabParallelKL);
    - stage layers: only the converted mixers train (gradients and Adam's state of theirs alone),
      and only their activations are kept (each converted block's, an upper bound: the student's
      FFN does not run), plus the teacher's input and output of each converted layer (the hooks';
      2 x 4 bytes per token and channel); the student's LM head and loss do not run."""
    from .distill import converted_layers
    d, m = cfg.train.distill, cfg.model
    teacher = _teacher_model(d.teacher)
    tokens = micro_batch * m.seq_length
    vocab_local = padded_vocab_size(m, tp) // tp
    width = 2 if d.teacher_dtype.value == "bfloat16" else 4
    teacher_bytes = width * stage_parameters(dataclasses.replace(cfg, model=teacher), tp, 1)[0] \
        + width * tokens * vocab_local
    if d.stage.value == "logits":
        trained = stage_parameters(cfg, tp, 1)[0]
        return trained, largest_parameter(cfg, tp, 1, 0), activations + 4 * tokens * vocab_local, teacher_bytes
    layers = converted_layers(m, teacher)
    table = _parameter_table(cfg)
    sizes = [n // (tp if split else 1) for i in layers for name, n, split in table[f"layers.{i}"]
             if ".mixer." in name]
    kept = sum(block_activation_bytes(cfg, micro_batch, tp, bf16, i) for i in layers) \
        + len(layers) * 2 * 4 * tokens * m.d_model
    return sum(sizes), max(sizes, default=0), kept, teacher_bytes


def estimate(cfg: Config, layout, zero: int, gpu_memory: float, *, checkpointing: bool,
             margin: float = 0.10, overhead: float = 2 * GiB,
             bucket_elements: int = ZERO_BUCKET_ELEMENTS, touched_only: bool = False) -> Estimate:
    """Memory of the busiest stage and communication per step of one accepted layout."""
    tp, pp, dp = layout.tensor, layout.pipe, layout.data
    bf16 = cfg.train.precision.value == "bf16"
    stages = [stage_memory(cfg, layout, zero, s, checkpointing=checkpointing, overhead=overhead,
                           bucket_elements=bucket_elements, touched_only=touched_only)
              for s in range(pp)]
    m = max(stages, key=lambda t: t["total"])   # the busiest stage decides whether it fits
    dp_b, tp_b, pp_b = communication(cfg, tp, pp, dp, zero, layout.micro_batch_size,
                                     layout.gradient_accumulation,
                                     max(t["parameters"] for t in stages), checkpointing, bf16)
    return Estimate(tp, pp, dp, zero, layout.micro_batch_size, layout.gradient_accumulation,
                    checkpointing, cfg.model.mixer.value, m["parameters"],
                    *(int(m[k]) for k in ("weights", "gradients", "optimizer", "zero_buffers",
                                          "activations", "overhead", "total")),
                    m["total"] <= gpu_memory * (1 - margin), dp_b, tp_b, pp_b, dp_b + tp_b + pp_b,
                    optimizer_step=int(m["optimizer_step"]))


def run_estimate_gib(cfg: Config, layout, on_gpu: bool) -> float:
    """The estimate for the run `cfg` at `layout`, as the train header and job scripts print it:
    on a GPU with the assumed 2 GiB of CUDA context and NCCL buffers, on CPU without them and
    counting only the written pages of ZeRO's reduction bucket (what RSS shows)."""
    return estimate(cfg, layout, cfg.train.zero_stage, float("inf"),
                    checkpointing=cfg.train.activation_checkpointing,
                    overhead=2 * GiB if on_gpu else 0, touched_only=not on_gpu).total / GiB


def plan(cfg: Config, world_size: int, gpu_memory: float, *, margin: float = 0.10,
         overhead: float = 2 * GiB, max_micro_batch: int = 64) -> list[Estimate]:
    """Every accepted layout, with and without activation checkpointing."""
    out = []
    for tp, pp, zero, mb, layout in accepted_layouts(cfg, world_size, max_micro_batch):
        for ckpt in (False, True):
            out.append(estimate(_with(cfg, tp, pp, zero, mb), layout, zero, gpu_memory,
                                checkpointing=ckpt, margin=margin, overhead=overhead))
    return out


def pipeline_bubble(e: Estimate) -> float:
    """Idle fraction of 1F1B: (PP - 1) / (gradient accumulation + PP - 1) (Narayanan et al. 2021)."""
    return (e.pipe - 1) / (e.gradient_accumulation + e.pipe - 1)


def rank_key(e: Estimate) -> tuple:
    """The order of preference (see recommend); layouts that do not fit come last."""
    return (not e.fits, e.activation_checkpointing, round(pipeline_bubble(e), 3), e.comm_total,
            e.total, -e.data, -e.micro_batch_size)


def recommend(estimates: list[Estimate]) -> tuple[Estimate | None, str]:
    """Among the layouts that fit: no activation recompute (a third more compute) if possible,
    then the smallest pipeline bubble, then the least communication per step, then the least
    memory, the largest DP and the largest micro-batch."""
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return None, "no layout fits: use more GPUs, a shorter sequence or a smaller model"
    best = min(fitting, key=rank_key)
    why = [f"fits ({best.total / GiB:.1f} GiB per GPU)",
           "no activation recompute" if not best.activation_checkpointing
           else "only with activation checkpointing",
           "no pipeline bubble" if best.pipe == 1 else f"pipeline bubble {pipeline_bubble(best):.0%}",
           f"least communication among those ({best.comm_total / GiB:.1f} GiB sent per GPU and step)",
           f"DP={best.data}"]
    return best, ", ".join(why) + f"; {len(fitting)} of {len(estimates)} layouts fit"
