"""The glibc malloc settings every CPU benchmark runs its cells with.

By default glibc returns large freed blocks to the OS at once, and every step maps them again:
the page faults make long sequences and 50K-wide logits look far slower than they compute
(measured: ~40% of a CPU training step of the tiny model). Keeping freed memory avoids that.
launch/quickstart.sh sets the same two variables.
"""
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
