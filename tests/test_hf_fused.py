"""transformers' generate on an export decodes on the fused step (issue 45, Build item 5): the
bundled inference/fused_decode.py, with megatron_id's C++ core when the installed megatron_id
wrote the export, its torch ops otherwise. It must give what the model's own forward gives
(config.fused_decode = False): greedy and beam search token for token, sampling for the same
seed, logits to float rounding; left-padded batches; and refuse to continue a fused cache with
a call it cannot take."""
from __future__ import annotations

import sys

import pytest
import torch
from hf_tiny import tiny_export

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {mixer: tiny_export(root / mixer, mixer) for mixer in ("interdomain", "s4d", "hybrid")}


def load(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, local_files_only=True).eval()


def generate(model, fused: bool, **kwargs):
    model.config.fused_decode = fused
    ids = torch.randint(0, 50257, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0   # row 1 left-padded: it runs as if alone
    torch.manual_seed(7)
    return model.generate(ids, attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True,
                          output_scores=True, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("mixer,core", [("interdomain", "cpp"), ("interdomain", "torch"), ("s4d", "torch")])
def test_generate_on_the_fused_step_equals_the_models_own_forward(exports, mixer, core):
    model = load(exports[mixer])
    modeling = sys.modules[type(model).__module__]
    modeling._CPP_CORE[:] = []
    if core == "torch":
        modeling._CPP_CORE.append(None)
    for kwargs in ({"do_sample": False}, {"do_sample": True, "top_k": 20}, {"do_sample": False, "num_beams": 3}):
        fused, own = generate(model, True, **kwargs), generate(model, False, **kwargs)
        assert torch.equal(fused.sequences, own.sequences), kwargs
        if "num_beams" not in kwargs:
            gap = max((a - b).abs().nan_to_num(nan=0.0).max().item() for a, b in zip(fused.scores, own.scores))
            assert gap < 1e-4, (kwargs, gap)   # (both -inf outside the top-k: nan, not a gap)
    with torch.no_grad():   # the fused step took over the cache, with the core asked for
        model.config.fused_decode = True
        out = model(torch.tensor([[464, 318]]), use_cache=True)
        step = model(torch.tensor([[11]]), cache=out.cache, use_cache=True)
        assert step.cache.fused is not None and step.cache.states is None
        assert step.cache.fused.kernel == core
        assert step.cache.get_seq_length() == 3
        with pytest.raises(ValueError, match="this cache was advanced by the fused decode step"):
            model(torch.tensor([[11, 12]]), cache=step.cache, use_cache=True)
        model.config.fused_decode = False
        assert model(torch.tensor([[11]]), cache=out.cache, use_cache=True).cache.fused is None


def test_a_hybrid_with_softmax_layers_decodes_with_its_own_forward(exports):
    """(The export's fused step serves fixed-state layers only: a KV cache needs a capacity that
    generate does not give.)"""
    model = load(exports["hybrid"])
    with torch.no_grad():
        out = model(torch.tensor([[464, 318]]), use_cache=True)
        step = model(torch.tensor([[11]]), cache=out.cache, use_cache=True)
    assert step.cache.fused is None and step.cache.states is not None
    fused, own = generate(model, True, do_sample=False), generate(model, False, do_sample=False)
    assert torch.equal(fused.sequences, own.sequences)
