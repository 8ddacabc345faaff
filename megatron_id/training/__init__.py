"""Training: the DeepSpeed engine and loop (engine.py), the optimiser recipe (optim.py), layout
checks and the DeepSpeed config (layout.py), the process group (distributed.py), the memory
planner (plan.py) and job preparation (job.py). Checkpoints live in megatron_id/checkpoint."""
