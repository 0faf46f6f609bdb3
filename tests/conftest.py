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
