"""megatron_id: a Megatron-style training stack for Interdomain Attention language models.

Install torch first (`pip install torch==2.13.0` on a CPU machine, or your CUDA build), then
`pip install -e .[test]`. The torch range below is wide on purpose so that pip never replaces
an installed torch with another build.
"""
from setuptools import find_packages, setup

setup(
    name="megatron_id",
    version="0.1.0",
    description="Megatron-style distributed training for Interdomain Attention language models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_id", "megatron_id.*", "data_tools", "data_tools.*"]),
    # the C++ source of the CPU decode kernel, built on first use (megatron_id/inference/cpu_kernel.py;
    # ninja comes with deepspeed)
    # and the data path's blend-index helper (megatron_id/data/native.py: cc, on first use)
    package_data={"megatron_id.inference": ["csrc/*.cpp"], "megatron_id.data": ["csrc/*.c"]},
    install_requires=[
        "torch>=2.3,<3",
        "numpy",
        "omegaconf>=2.3",
        "safetensors",
        "deepspeed",
        "datasets",        # pulls pyarrow (parquet input)
        "tokenizers",
        "zstandard",       # .jsonl.zst input
        "tensorboard",
        "matplotlib",      # megatron-id eval's plots
    ],
    extras_require={
        # loading exported folders with AutoModelForCausalLM (exporting itself needs only safetensors)
        # the range tests/test_hf_clients.py runs: 5.0.0 (a venv of its own) and the newest 5.x
        # here (5.24); accelerate for from_pretrained(device_map=...)
        "hf": ["transformers>=5.0,<5.25", "accelerate>=1.0"],
        # lm-evaluation-harness on exported folders, and its local-completions on megatron-id serve
        # ([api]: tenacity, requests; tested with 0.4.13)
        "eval": ["lm_eval[api]>=0.4.13,<0.5"],
        # preprocessing extras: the gigatoken encoder (the default when installed; what Megatron-LM's
        # fast preprocessor uses; tested with 0.10.0), tiktoken (--tokenizer-backend tiktoken) and NeoX's --ftfy
        "preprocess": ["gigatoken>=0.10,<0.11", "tiktoken>=0.7", "ftfy>=6"],
        # the fused chunked core for CUDA (model.core_impl=auto|triton; tl.gather needs >= 3.3);
        # tests run its kernels on the CPU under TRITON_INTERPRET=1 (tested with 3.9.0)
        "triton": ["triton>=3.3,<4"],
        # Weights & Biases tracking (train.wandb; tested offline with 0.31)
        "wandb": ["wandb>=0.19,<1"],
        # megatron-id serve (tested with aiohttp 3.14; its load test drives it with the openai client)
        "serve": ["aiohttp>=3.9,<4"],
        # megatron-core: the reference benchmarks/data_scale.py measures our index build against (its
        # GPTDataset/BlendedDataset on the same files); its Linux wheels (cp310-cp313, x86_64 and aarch64)
        # carry the compiled C++ helpers and need only torch>=2.6, numpy and packaging. No macOS wheel
        # (the sdist would compile), hence the marker; the benchmark runs our side alone without it.
        "test": ["pytest>=7", "pytest-timeout", "transformers>=5.0,<5.25", "accelerate>=1.0", "lm_eval[api]==0.4.13",
                 "gigatoken>=0.10,<0.11", "tiktoken>=0.7", "ftfy>=6", "triton>=3.3,<4", "wandb>=0.19,<1",
                 "aiohttp>=3.9,<4", "openai>=1.0",
                 "megatron-core==0.16.1; platform_system == 'Linux'",
                 # the lint tests/test_code_layout.py runs (.ruff.toml); pinned: isort's order moves between releases
                 "ruff==0.17.6"],
        # NVIDIA apex (fused RMSNorm / optimizers on GPU) is not on PyPI: build it from source on
        # a CUDA machine; megatron_id uses it when importable and falls back to torch otherwise.
    },
    entry_points={"console_scripts": ["megatron-id=megatron_id.cli:entry"],
                  # vLLM calls it in each of its processes (megatron_id/vllm_plugin: docs/vllm.md); it
                  # imports vLLM only then, and nothing else in megatron_id imports vLLM
                  "vllm.general_plugins": ["megatron_id=megatron_id.vllm_plugin:register"]},
)
