"""Training: the paper's optimiser recipe, DeepSpeed configuration and layout checks
(the DeepSpeed engine and train loop are being built: issue 5)."""
