"""Parameter counts equal the paper's Table 3 exactly; state and FLOP accounting."""
import pytest
from conftest import CONFIGS

from megatron_id.config import load_config
from megatron_id.model.accounting import count_parameters, report

TABLE = {  # scale: (softmax, interdomain, s4d), from shared/docs/interdomain-attention.md section 5
    "125m": (134_105_856, 135_416_208, 135_425_424),
    "350m": (373_867_520, 377_360_768, 377_385_344),
    "760m": (777_856_512, 781_498_752, 781_523_328),
    "1p3b": (1_345_423_360, 1_352_406_784, 1_352_455_936),
}
CELLS = [(scale, mixer, TABLE[scale][i]) for scale in TABLE
         for i, mixer in enumerate(["softmax", "interdomain", "s4d"])]


def model_cfg(scale, *overrides):
    return load_config([CONFIGS / "model" / f"{scale}.yaml"], list(overrides)).model


@pytest.mark.parametrize("scale,mixer,expected", CELLS, ids=lambda x: str(x))
def test_paper_parameter_counts(scale, mixer, expected):
    assert count_parameters(model_cfg(scale, f"model.mixer={mixer}")) == expected


@pytest.mark.parametrize("overrides,expected", [
    (["model.query_readout=false"], 135_379_344),   # dual input, linear contraction
    (["model.dual_kv_input=false"], 135_462_288),   # single input, query readout
    (["model.rope=false"], 135_416_208),            # RoPE adds no parameters
    (["model.mixer=s4d", "model.rope=true"], 135_425_424),
])
def test_ablation_cells(overrides, expected):
    assert count_parameters(model_cfg("125m", *overrides)) == expected


def test_recurrent_state_budget():
    # paper Table 5: 32 heads x 2 x (64 + 64) x 64 = 524,288 real numbers at 1.3B, fixed
    for mixer in ("interdomain", "s4d"):
        r = report(model_cfg("1p3b", f"model.mixer={mixer}"))
        assert r.state_per_token_per_layer == 524_288 and r.kv_cache_per_token_per_layer is None
    r = report(model_cfg("1p3b", "model.mixer=softmax"))
    assert r.kv_cache_per_token_per_layer == 4096 and r.state_per_token_per_layer is None


def test_flops_follow_their_conventions():
    inter, soft = report(model_cfg("125m")), report(model_cfg("125m", "model.mixer=softmax"))
    for r in (inter, soft):
        assert r.training_flops_per_token == 3 * r.forward_flops_per_token
        # every weight but the input embedding is used once per token: >= 2 x those params
        assert r.forward_flops_per_token > 2 * r.non_embedding_parameters
    # softmax work per token grows with the context, interdomain's does not
    soft_long = report(model_cfg("125m", "model.mixer=softmax", "model.seq_length=8192"))
    inter_long = report(model_cfg("125m", "model.seq_length=8192"))
    assert soft_long.forward_flops_per_token - soft.forward_flops_per_token == 12 * 2 * 2 * 4096 * 768
    assert inter_long.forward_flops_per_token == inter.forward_flops_per_token


def test_tied_embeddings_count_the_matrix_once():
    untied, tied = report(model_cfg("125m")), report(model_cfg("125m", "model.tie_embeddings=true"))
    head = 32000 * 768   # the LM head matrix that tying removes
    assert untied.parameters - tied.parameters == head
    assert untied.non_embedding_parameters - tied.non_embedding_parameters == head
    assert tied.forward_flops_per_token == untied.forward_flops_per_token   # the head still runs
