"""The GPU paths that no CPU run would otherwise exercise (issue 25, item 7), checked here:

- the static decode step (StaticDecodeStep: fixed buffers updated in place, what a CUDA graph
  replays) equals the dynamic decode, logits and tokens, and keeps its buffers;
- generate and eval keep every tensor they make on the model's device: the stated fake device
  is a guard (a TorchFunctionMode) that fails any tensor factory called from inference/generate.py or
  evaluation/ without device=, so the code runs unchanged on a CUDA model;
- --device and --cuda-graph refuse what this machine cannot do, with the fix.
The graphed step itself (torch.cuda.CUDAGraph) runs on a GPU: launch/gpu_check.sh compares it
with the eager decode there.
"""
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, ROOT
from torch.overrides import TorchFunctionMode

from megatron_id.config import load_config
from megatron_id.inference.generate import StaticDecodeStep, generate_ids
from megatron_id.model.language_model import LanguageModel

CLI = [sys.executable, "-m", "megatron_id.cli"]


def tiny_model(mixer):
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], [f"model.mixer={mixer}", "model.init_std=0.2"]).model
    return LanguageModel(cfg, seed=5).eval()


@pytest.mark.parametrize("mixer", ["interdomain", "s4d"])
def test_static_decode_step_equals_the_dynamic_decode_and_keeps_its_buffers(mixer):
    model = tiny_model(mixer)
    prompt = torch.randint(0, 512, (1, 37), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        logits, states = model(prompt, return_states=True)
        step = StaticDecodeStep(model, states, position=prompt.shape[1])
        buffers = [step.states[0]["ssm"].data_ptr(), step.position.data_ptr()]
        for i, token in enumerate(tokens):
            dynamic, states = model(torch.tensor([[token]]), states=states, return_states=True)
            static = step(token)
            assert torch.allclose(static, dynamic[0, -1], rtol=1e-5, atol=1e-5), i
            assert int(step.position) == prompt.shape[1] + i + 1
        assert [step.states[0]["ssm"].data_ptr(), step.position.data_ptr()] == buffers   # updated in place
        assert not torch.equal(step.states[0]["ssm"], _fresh_state(model, prompt))   # ... and they moved
    eager = list(generate_ids(model, prompt[0].tolist(), 10))
    static = list(generate_ids(model, prompt[0].tolist(), 10, decode="static"))
    assert eager == static and len(eager) == 10


def _fresh_state(model, prompt):
    _, states = model(prompt, return_states=True)
    return states[0]["ssm"]


def test_static_decode_refuses_what_it_cannot_hold():
    from megatron_id.errors import BadOptionError
    softmax = tiny_model("softmax")
    with torch.no_grad():
        _, states = softmax(torch.tensor([[1, 2, 3]]), return_states=True)
    with pytest.raises(BadOptionError, match="KV cache grows"):
        StaticDecodeStep(softmax, states, position=3)
    model = tiny_model("interdomain")
    with torch.no_grad():
        _, states = model(torch.tensor([[1, 2, 3]]), return_states=True)
    with pytest.raises(BadOptionError, match="--device cuda"):
        StaticDecodeStep(model, states, position=3, graph=True)   # a CPU model
    with pytest.raises(BadOptionError, match="decode='fast'"):
        next(generate_ids(model, [1, 2], 3, decode="fast"))


FACTORIES = {"tensor", "zeros", "ones", "full", "empty", "arange", "randn", "rand", "randint", "zeros_like",
             "eye", "linspace"}
WATCHED = (str(ROOT / "megatron_id" / "inference" / "generate.py"), str(ROOT / "megatron_id" / "evaluation"))


class DeviceGuard(TorchFunctionMode):
    """Fails a tensor factory called from inference/generate.py or evaluation/ without device=: on a
    CUDA model such a tensor would land on the CPU (and the next op fails, or copies)."""

    def __init__(self):
        super().__init__()
        self.checked, self.missing = 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in FACTORIES and not name.endswith("_like"):
            frames = traceback.extract_stack(limit=6)[:-1]   # without this method's own frame
            caller = next(f for f in reversed(frames) if "/torch/" not in f.filename)
            if caller.filename.startswith(WATCHED):
                self.checked += 1
                if "device" not in kwargs:
                    self.missing.append(f"{Path(caller.filename).name}:{caller.lineno} torch.{name}")
        return func(*args, **kwargs)


def test_generate_and_eval_make_every_tensor_on_the_models_device():
    import random

    import numpy as np

    from megatron_id.evaluation.recall import mqar, mqar_correct, passkey, passkey_correct
    from megatron_id.evaluation.scoring import score_windows
    model = tiny_model("interdomain")
    guard = DeviceGuard()
    with guard, torch.no_grad():
        list(generate_ids(model, [5, 6, 7, 8], 4))
        list(generate_ids(model, [5, 6, 7, 8], 4, decode="static", temperature=0.7, top_k=5,
                          generator=torch.Generator().manual_seed(0)))
        tokenizer = _ids_tokenizer()
        passkey_correct(model, _small_vocab(passkey(tokenizer, 60, 0.5, random.Random(0))), torch.device("cpu"), 16)
        mqar_correct(model, _small_vocab(mqar(tokenizer, 2, random.Random(0))), torch.device("cpu"), 16)
        rows = np.random.default_rng(0).integers(0, 512, size=(3, 33))
        score_windows(model, rows, 2, 16, np.ones(512, dtype=np.int64), torch.device("cpu"))
    assert guard.checked >= 6, guard.checked   # the guard saw the calls it is there for
    assert guard.missing == [], guard.missing


def _small_vocab(probe):
    """The probe's ids folded into the tiny model's 512-token vocabulary."""
    probe.ids = [i % 512 for i in probe.ids]
    probe.answers = [[i % 512 for i in a] for a in probe.answers]
    return probe


def _ids_tokenizer():
    from megatron_id.data.tokenizer import load_tokenizer
    return load_tokenizer(str(ROOT / "tests" / "data" / "gpt2-tokenizer.json"))


def test_device_guard_catches_a_factory_without_device():
    """The guard can fail: the generation code as it was before (tokens made on the CPU)."""
    guard = DeviceGuard()
    source = compile("import torch\ntorch.tensor([[1]])\n", WATCHED[0], "exec")   # "called from generate.py"
    with guard:
        exec(source, {})
    assert guard.missing == ["generate.py:2 torch.tensor"]


def refused(args, *needles):
    result = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, (result.returncode, result.stderr)
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without CUDA")
def test_generate_and_eval_refuse_devices_this_machine_lacks(tmp_path):
    missing = tmp_path / "never-read"   # the device is checked before the checkpoint is read
    refused(["generate", "--checkpoint", missing, "--prompt", "Hi", "--device", "cuda"],
            "--device cuda: no CUDA device here; use --device cpu")
    refused(["generate", "--checkpoint", missing, "--prompt", "Hi", "--device", "cpu", "--cuda-graph"],
            "--cuda-graph needs a CUDA device", "drop --cuda-graph")
    refused(["generate", "--checkpoint", missing, "--prompt", "Hi", "--device", "gpu0"],
            "--device 'gpu0' is not a device")
    refused(["eval", "perplexity", "--checkpoint", missing, "--device", "cuda:1"],
            "--device cuda:1: no CUDA device here")
