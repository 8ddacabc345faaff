"""One schema, YAML files, key=value overrides; bad input is a clear error."""
import pytest
import torch
from conftest import CONFIGS

from megatron_id.cli import main
from megatron_id.config import ConfigError, Mixer, Readout, ffn_hidden_size, load_config

MODEL = CONFIGS / "model"


@pytest.mark.parametrize("scale,d,layers,heads", [("tiny", 64, 2, 4), ("125m", 768, 12, 12),
                                                  ("350m", 1024, 24, 16), ("760m", 1536, 24, 16),
                                                  ("1p3b", 2048, 24, 32)])
def test_scale_files_load(scale, d, layers, heads):
    m = load_config([MODEL / f"{scale}.yaml"]).model
    assert (m.d_model, m.n_layers, m.n_heads) == (d, layers, heads)
    assert m.mixer is Mixer.interdomain and m.query_readout and m.dual_kv_input and m.rope


def test_overrides_and_mixer_defaults():
    cfg = load_config([MODEL / "125m.yaml"], ["model.mixer=s4d", "model.n_layers=3", "seed=7"])
    m = cfg.model
    assert (m.mixer, m.n_layers, cfg.seed) == (Mixer.s4d, 3, 7)
    # s4d is the interdomain mixer without both ingredients; the paper's S4D-only has no RoPE
    assert (m.query_readout, m.dual_kv_input, m.rope) == (False, False, False)
    assert load_config([MODEL / "125m.yaml"], ["model.mixer=s4d", "model.rope=true"]).model.rope
    m = load_config([MODEL / "125m.yaml"], ["model.readout=plain", "model.output_gate=true"]).model
    assert m.readout is Readout.plain and m.output_gate


def test_later_files_and_overrides_win(tmp_path):
    extra = tmp_path / "exp.yaml"
    extra.write_text("model:\n  n_layers: 5\n  mixer: softmax\n")
    m = load_config([MODEL / "125m.yaml", extra], ["model.n_layers=6"]).model
    assert (m.n_layers, m.mixer, m.d_model) == (6, Mixer.softmax, 768)


def test_swiglu_hidden_rule():
    assert ffn_hidden_size(load_config([MODEL / "125m.yaml"]).model) == 2048
    assert ffn_hidden_size(load_config([MODEL / "350m.yaml"]).model) == 2816
    assert ffn_hidden_size(load_config([MODEL / "1p3b.yaml"]).model) == 5504


@pytest.mark.parametrize("override,needles", [
    (["model.n_layer=3"], ["unknown config key 'model.n_layer'", "n_layers"]),
    (["modle.mixer=softmax"], ["unknown config key", "modle", "model"]),
    (["model.mixer=mamba"], ["'mamba'", "model.mixer", "interdomain, softmax, s4d"]),
    (["model.readout=polar"], ["'polar'", "hermitian, plain"]),
    (["model.n_layers=two"], ["'two'", "model.n_layers"]),
    (["model.mixer"], ["key=value"]),
    (["model.d_model=100"], ["model.d_model=100", "n_heads=12"]),
    (["model.mixer=s4d", "model.query_readout=true"], ["query_readout", "contradicts", "mixer=s4d"]),
    (["model.mixer=softmax", "model.dual_kv_input=false"], ["dual_kv_input", "softmax"]),
])
def test_bad_values_name_the_key_and_the_fix(override, needles):
    with pytest.raises(ConfigError) as err:
        load_config([MODEL / "125m.yaml"], override)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist.*nope.yaml"):
        load_config([tmp_path / "nope.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_heads: 4\n  vocab: 100\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'model.vocab'.*vocab_size"):
        load_config([bad])


def test_cli_params(capsys):
    assert main(["params", "--config", str(MODEL / "125m.yaml")]) == 0
    out = capsys.readouterr().out
    assert "135,416,208" in out and "196,608" in out
    assert main(["params", "--config", str(MODEL / "125m.yaml"), "model.mixer=softmax"]) == 0
    assert "134,105,856" in capsys.readouterr().out
    assert main(["params", "--config", str(MODEL / "125m.yaml"), "model.heads=3"]) == 2
    assert "unknown config key 'model.heads'" in capsys.readouterr().err


def test_a_plain_data_path_override_becomes_a_list():
    """Megatron users write --data-path PREFIX or 'W1 P1 W2 P2' without brackets."""
    from megatron_id.config import load_config
    assert load_config([], ["data.data_path=data/x_text_document"]).data.data_path == ["data/x_text_document"]
    assert load_config([], ["data.data_path=0.3 data/a 0.7 data/b"]).data.data_path == \
        ["0.3", "data/a", "0.7", "data/b"]
    assert load_config([], ["data.data_path=[data/y]"]).data.data_path == ["data/y"]


def test_delta_init_range_is_a_config_with_the_papers_default():
    """model.dt_min / dt_max set Delta's initial range (log-uniform per head); the default is the
    paper's [1e-3, 1e-1] and draws what the fixed constants drew; a bad range is refused."""
    import math

    from megatron_id.model import LanguageModel
    base = load_config([CONFIGS / "model" / "tiny.yaml"], ["model.n_heads=4", "model.n_layers=1"]).model
    assert (base.dt_min, base.dt_max) == (1e-3, 1e-1)
    dt = LanguageModel(base, seed=3).layers[0].mixer.log_dt.detach().exp()
    assert ((dt >= 1e-3) & (dt <= 1e-1)).all()
    scaled = load_config([CONFIGS / "model" / "tiny.yaml"], ["model.n_heads=4", "model.n_layers=1",
                                                               "model.dt_min=0.02", "model.dt_max=0.5"]).model
    dt_scaled = LanguageModel(scaled, seed=3).layers[0].mixer.log_dt.detach().exp()
    assert ((dt_scaled >= 0.02) & (dt_scaled <= 0.5)).all()
    # the same uniform draws, mapped to the other range
    u = (dt.log() - math.log(1e-3)) / (math.log(1e-1) - math.log(1e-3))
    v = (dt_scaled.log() - math.log(0.02)) / (math.log(0.5) - math.log(0.02))
    assert torch.allclose(u, v, atol=1e-5)
    for bad in (["model.dt_min=0"], ["model.dt_min=0.2", "model.dt_max=0.1"]):
        with pytest.raises(ConfigError, match="model.dt_min=.* must be positive and at most model.dt_max"):
            load_config([CONFIGS / "model" / "tiny.yaml"], bad)
