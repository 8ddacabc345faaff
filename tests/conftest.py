import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = ROOT / "configs"

torch.set_num_threads(min(2, os.cpu_count() or 1))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the whole tensor (complex allowed); 0 when both are zero."""
    a, b = a.detach(), b.detach()
    denom = b.abs().pow(2).sum().sqrt().item()
    num = (a - b).abs().pow(2).sum().sqrt().item()
    return num if denom == 0 else num / denom


@pytest.fixture
def tiny_config():
    from megatron_id.config import load_config

    def make(*overrides):
        return load_config([CONFIGS / "model" / "tiny.yaml"], list(overrides)).model
    return make
