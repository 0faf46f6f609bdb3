"""The embedded default (SmolLM2-135M-Instruct) loads offline and decodes exactly. Slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from specrl.engine import Action, SpecEngine
from specrl.prompts import load_prompts

pytestmark = pytest.mark.slow


def test_default_pair_loads_offline(default_pair):
    assert default_pair.target_name == "SmolLM2-135M-Instruct"
    assert default_pair.vocab_size == 49152
    assert default_pair.eos_token_ids == frozenset({2})
    ids = default_pair.encode_prompt("Hello!")
    assert ids[0] == 1 and len(ids) > 5  # chat template applied (<|im_start|> first)


def test_default_pair_greedy_exact_with_ngram(default_pair):
    prompts = load_prompts("builtin")
    chosen = [prompts[i] for i in (0, 30, 84)]  # code, summarization, rag
    ids = [default_pair.encode_prompt(p.text) for p in chosen]
    n = 40
    refs = []
    with torch.inference_mode():
        for p in ids:
            x = torch.tensor([p])
            out = default_pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                               do_sample=False, eos_token_id=None, pad_token_id=2)
            ref = out[0, len(p):].tolist()
            refs.append(ref[: ref.index(2) + 1] if 2 in ref else ref)
    rng = np.random.default_rng(0)
    eng = SpecEngine(default_pair, drafter="ngram", max_batch_size=2)
    done = eng.generate(ids, n, action=lambda _: Action(int(rng.integers(0, 9)), int(rng.integers(1, 5))))
    accepted = sum(r.accepted for r in done)
    for r, ref in zip(done, refs):
        assert r.output.tolist() == ref
    assert accepted > 0


def _cli(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "specrl.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("drafter_args", [["--drafter", "ngram"], ["--drafter", "model", "--draft", "default"],
                                          ["--drafter", "feature"]])
def test_cli_generate_json_on_default(drafter_args):
    rows = _cli("generate", "--prompt", "List three colours.", "--prompt", "What is 12 times 3?",
                "--k", "3", "--w", "2", "--max-new-tokens", "24", "--json", *drafter_args)
    assert [r["prompt_index"] for r in rows] == [0, 1]
    for r in rows:
        assert {"tokens", "text", "steps", "mean_accept_length", "seconds"} <= r.keys()
        assert 0 < len(r["tokens"]) <= 24 and r["steps"] >= 1 and r["text"]
    if "model" in drafter_args:  # the target drafting for itself accepts every token
        assert all(r["mean_accept_length"] > 1.5 for r in rows)
