import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

# One intra-op thread: the tiny test models gain nothing from threads, and on a busy 2-core
# machine OpenMP hand-offs stall each small op by milliseconds (tests ran 10x slower).
# SPECRL_TEST_THREADS=2 restores torch's default for the real-model tests.
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("SPECRL_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def default_pair():
    """The embedded SmolLM2-135M-Instruct (float32, CPU), loaded once per session."""
    from specrl.models import ModelPair

    return ModelPair.load("default", device="cpu")


def _builtin_words():
    import re

    from specrl.prompts import load_prompts

    return sorted({w for p in load_prompts("builtin") for w in re.findall(r"\S+", p.text)})[:3000]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama + word-level tokenizer over the built-in prompts' words."""
    from tiny import save_tiny

    return str(save_tiny(tmp_path_factory.mktemp("tiny") / "model", _builtin_words(), seed=0, max_pos=4096))


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory):
    """(target dir, draft dir): a tiny target and a perturbed copy as its draft, same tokenizer.

    The vocabulary is the 14 most frequent words of the built-in prompts (+ [UNK], </s>): a
    16-token model loops soon, so the n-gram drafter is accepted often, and </s> ends some
    requests early."""
    import collections
    import re

    from tiny import save_tiny_pair

    from specrl.prompts import load_prompts

    counts = collections.Counter(w for p in load_prompts("builtin") for w in re.findall(r"\S+", p.text))
    words = sorted(w for w, _ in counts.most_common(14))
    return save_tiny_pair(tmp_path_factory.mktemp("tinypair"), words, noise=0.05, seed=3)


@pytest.fixture()
def isolated_cache(tmp_path, monkeypatch):
    """Point the specrl cache (traces, costs, replay tables) at a temporary folder."""
    monkeypatch.setenv("SPECRL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def tiny_replay_env(tiny_pair_dirs, tmp_path_factory):
    """A replay env preset (YAML path) on the tiny pair: 16 built-in prompts, analytic costs,
    its own specrl cache (traces are recorded on first use)."""
    import json

    import yaml

    from specrl.prompts import load_prompts

    root = tmp_path_factory.mktemp("replayenv")
    old = os.environ.get("SPECRL_CACHE_DIR")
    os.environ["SPECRL_CACHE_DIR"] = str(root / "cache")
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [p.text], "category": p.category})
                                 for p in load_prompts("builtin")[::6]))
    env = dict(backend="replay", model=tiny_pair_dirs[0], prompts=str(prompts), cost_model="analytic",
               horizon_s=3.0, time_penalty="ar",
               workload={"arrival": "closed", "concurrency": [1, 4], "max_new_tokens": 24})
    path = root / "env.yaml"
    path.write_text(yaml.safe_dump(env))
    yield str(path)
    if old is None:
        os.environ.pop("SPECRL_CACHE_DIR", None)
    else:
        os.environ["SPECRL_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def tiny_traces(tiny_pair_dirs, tmp_path_factory):
    """Traces for 16 built-in prompts with both drafters (float64: no numerical near-ties); shared by
    the replay and headroom tests."""
    from specrl.models import ModelPair
    from specrl.prompts import load_prompts
    from specrl.traces import collect_traces

    target, draft = tiny_pair_dirs
    pair = ModelPair.load(target, draft=draft, device="cpu", dtype="float64")
    prompts = load_prompts("builtin")[::6]
    out = {}
    for drafter in ("ngram", "model"):
        path = tmp_path_factory.mktemp("tr") / f"tiny-{drafter}"
        out[drafter] = collect_traces(pair, prompts, drafter, max_new_tokens=40, batch_size=4, progress=False,
                                      out=path)
        out[drafter + "_path"] = path
    return pair, prompts, out
