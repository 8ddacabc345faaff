"""Reading a checkpoint at another layout without the whole model (megatron_id/checkpoint/read.py):
each rank's slices, taken from the saved shards, equal what splitting the whole model gives,
for every saving (TP, PP) and loading TP, the vocabulary padding included."""
import pytest
import torch

from conftest import CONFIGS
from megatron_id.checkpoint.files import ClientState, model_config_dict
from megatron_id.checkpoint.read import read_local_state, read_model_state, write_weights_only
from megatron_id.config import load_config
from megatron_id.model import LanguageModel
from megatron_id.parallel.tensor_parallel import split_state_dict


def _model(*overrides):
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], ["model.vocab_size=1000", *overrides]).model
    full = {k: v.clone() for k, v in LanguageModel(cfg, seed=3).state_dict().items()}
    return cfg, full


def _write(tmp_path, cfg, full, tp, pp):
    layout = {"tensor": tp, "pipe": pp, "data": 1, "zero_stage": 0}
    client = ClientState(step=0, model=model_config_dict(cfg), layout=layout, weights_only=True)
    root = tmp_path / f"tp{tp}pp{pp}"
    root.mkdir()
    return write_weights_only(root, split_state_dict(full, cfg, tp), cfg, pp, client), layout


@pytest.mark.parametrize("saved_tp,saved_pp", [(1, 1), (2, 1), (4, 2), (2, 2)])
def test_each_rank_reads_exactly_its_slices(tmp_path, saved_tp, saved_pp):
    cfg, full = _model()
    folder, layout = _write(tmp_path, cfg, full, saved_tp, saved_pp)
    assert all(torch.equal(v, full[k]) for k, v in read_model_state(folder, cfg, layout).items())
    for tp in (1, 2, 4):
        want = split_state_dict(full, cfg, tp)
        for rank in range(tp):
            got = read_local_state(folder, cfg, layout, tp, rank, list(want[rank]))
            assert set(got) == set(want[rank])
            for name, tensor in want[rank].items():
                assert torch.equal(got[name], tensor), (saved_tp, tp, rank, name)


def test_a_subset_of_names_reads_only_those(tmp_path):
    """A pipeline stage asks for its own pieces only; a name the checkpoint lacks is an error."""
    cfg, full = _model("model.tie_embeddings=true")
    folder, layout = _write(tmp_path, cfg, full, 2, 2)
    names = ["embed.weight", "lm_head.weight", "layers.1.mixer.o_proj.weight"]
    got = read_local_state(folder, cfg, layout, 4, 3, names)
    want = split_state_dict(full, cfg, 4)[3]
    assert list(got) == names and all(torch.equal(got[n], want[n]) for n in names)
    with pytest.raises(Exception, match="no tensor layers.9.mixer.o_proj.weight"):
        read_local_state(folder, cfg, layout, 1, 0, ["layers.9.mixer.o_proj.weight"])
