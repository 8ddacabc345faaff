"""The glibc malloc settings every CPU benchmark runs its cells with: those of
megatron_id/allocator.py, which `megatron-id train` sets for itself and for the ranks it starts.

By default glibc returns large freed blocks to the OS at once, and every step maps them again:
the page faults make long sequences and 50K-wide logits look far slower than they compute
(measured: ~40% of a CPU training step of the tiny model). Keeping freed memory avoids that.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_id.allocator import ALLOCATOR_ENV  # noqa: E402,F401
