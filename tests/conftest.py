import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def default_pair():
    """The embedded SmolLM2-135M-Instruct (float32, CPU), loaded once per session."""
    from specrl.models import ModelPair

    return ModelPair.load("default", device="cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama + word-level tokenizer over the built-in prompts' words."""
    import re

    from specrl.prompts import load_prompts
    from tiny import save_tiny

    words = sorted({w for p in load_prompts("builtin") for w in re.findall(r"\S+", p.text)})[:3000]
    return str(save_tiny(tmp_path_factory.mktemp("tiny") / "model", words, seed=0, max_pos=4096))
