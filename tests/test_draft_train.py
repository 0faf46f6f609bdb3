"""Draft distillation: the pipeline end to end on a tiny random pair, and the shipped draft."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny import save_tiny, tiny_llama

from specrl.drafters import make_drafter
from specrl.drafttrain.data import (
    DataConfig,
    check_manifest,
    generate_batch,
    plan_shards,
    score_batch,
    stages,
)
from specrl.drafttrain.student import ShortlistHead, build_student, load_draft, shortlist_from_counts
from specrl.drafttrain.train import TrainConfig, distill_loss, lr_at
from specrl.engine import Action, SpecEngine
from specrl.errors import ConfigError
from specrl.models import ModelPair

WORDS = [f"w{i}" for i in range(40)]


def _greedy_refs(pair: ModelPair, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Target-alone greedy continuations (cut after the first EOS), the exactness reference."""
    eos = sorted(pair.eos_token_ids)
    refs = []
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p])
            out = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                       eos_token_id=None, pad_token_id=eos[0] if eos else 0)
            ref = out[0, len(p):].tolist()
            cut = next((i + 1 for i, t in enumerate(ref) if t in pair.eos_token_ids), len(ref))
            refs.append(ref[:cut])
    return refs


def test_shortlist_head_full_vocab_logits():
    target = tiny_llama(vocab=64, dtype=torch.float32)
    ids = shortlist_from_counts(torch.arange(64.0), 16, always=[0])
    assert ids.numel() == 16 and 0 in ids.tolist() and 63 in ids.tolist()
    student = build_student(target, [1], ids)
    assert isinstance(student.lm_head, ShortlistHead)
    assert student.get_output_embeddings().weight.shape[0] == 64  # the engine's vocabulary check
    x = torch.randint(0, 64, (2, 5))
    logits = student(x).logits  # (2, 5, 64)
    assert logits.shape == (2, 5, 64)
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    assert (logits[..., outside] == torch.finfo(logits.dtype).min).all()
    assert logits.argmax(-1).unique().tolist() == sorted(set(logits.argmax(-1).flatten().tolist()) & set(ids.tolist()))
    # the student shares (does not copy) the target's embedding and head
    assert student.get_input_embeddings().weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert student.lm_head.weight.data_ptr() == target.get_output_embeddings().weight.data_ptr()


def test_student_rejects_bad_layers():
    target = tiny_llama(vocab=32, dtype=torch.float32)
    with pytest.raises(ConfigError, match="--layers"):
        build_student(target, [5])


def test_plan_shards_respects_budget():
    cfg = DataConfig(max_new_tokens=10, batch_size=4, token_budget=100)
    lengths = [5, 50, 7, 80, 3, 6, 9]
    shards = plan_shards(lengths, cfg)
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    for s in shards:
        assert len(s) <= 4
        assert len(s) == 1 or len(s) * max(lengths[i] + 10 for i in s) <= 100


def test_plan_shards_counts_copies_as_rows():
    cfg = DataConfig(max_new_tokens=10, batch_size=8, token_budget=10_000)
    shards = plan_shards([5] * 10, cfg, copies=4)
    assert [len(s) for s in shards] == [2, 2, 2, 2, 2]  # 2 prompts x 4 samples = 8 rows per batch


def test_generate_batch_samples_keep_prompts_and_labels_aligned():
    """samples > 1: every continuation sits after its own prompt and its labels are the target's
    log-probs at that position (teacher-forced scoring of the output reproduces them)."""
    torch.manual_seed(0)
    target = tiny_llama(vocab=48, dtype=torch.float32).eval()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    cfg = DataConfig(max_new_tokens=6, topk=4)
    out = generate_batch(target, prompts, cfg, temperature=1.0, seed=3, eos_ids=[], pad_id=0, samples=3)
    assert out["seq_len"].tolist() == [9, 9, 9, 11, 11, 11] and out["prompt_len"].tolist() == [3] * 3 + [5] * 3
    seqs, t0 = [], 0
    for sl in out["seq_len"].tolist():
        seqs.append(out["tokens"][t0 : t0 + sl].tolist())
        t0 += sl
    assert [q[:3] for q in seqs[:3]] == [prompts[0]] * 3 and [q[:5] for q in seqs[3:]] == [prompts[1]] * 3
    assert len({tuple(q) for q in seqs[:3]}) > 1  # sampled: the three continuations differ
    ref = score_batch(target, seqs, 4, pad_id=0)  # labels for every token after the first
    m_gen = m_ref = 0
    for q, pl in zip(seqs, out["prompt_len"].tolist()):
        g = len(q) - pl
        skip = pl - 1  # score_batch also labels the prompt's own tokens
        assert torch.equal(out["top_i"][m_gen : m_gen + g], ref["top_i"][m_ref + skip : m_ref + skip + g])
        assert torch.allclose(out["top_v"][m_gen : m_gen + g].float(), ref["top_v"][m_ref + skip : m_ref + skip + g].float(),
                              atol=2e-3)
        m_gen += g
        m_ref += len(q) - 1
    with pytest.raises(ConfigError, match="samples=1 for greedy"):
        generate_batch(target, prompts, cfg, temperature=0.0, seed=3, eos_ids=[], pad_id=0, samples=2)


def test_no_text_skips_only_the_text_stage_and_keeps_resuming(tmp_path):
    with_text, without = stages(DataConfig(rounds=1)), stages(DataConfig(rounds=1, text=False))
    assert [s.name for s in with_text] == ["heldout-greedy", "train-greedy", "train-text", "train-t0.7-r1"]
    assert [s.name for s in without] == ["heldout-greedy", "train-greedy", "train-t0.7-r1"]
    # the shards of the other stages are the same, so a directory made either way resumes the other way
    check_manifest(tmp_path, DataConfig(), "t")
    check_manifest(tmp_path, DataConfig(text=False), "t")


def test_manifest_refuses_to_resume_with_other_samples(tmp_path):
    """Shards of sampled stages hold other prompts when ``samples`` changes: no silent resume,
    in either direction, and data made before the field existed still resumes with samples=1."""
    check_manifest(tmp_path / "a", DataConfig(samples=8), "t")
    with pytest.raises(ConfigError, match="samples"):
        check_manifest(tmp_path / "a", DataConfig(samples=1), "t")
    check_manifest(tmp_path / "b", DataConfig(), "t")
    assert "samples" not in json.loads((tmp_path / "b" / "manifest.json").read_text())
    check_manifest(tmp_path / "b", DataConfig(samples=1), "t")
    with pytest.raises(ConfigError, match="samples"):
        check_manifest(tmp_path / "b", DataConfig(samples=2), "t")


def test_distill_loss_prefers_target_argmax():
    top_i = torch.tensor([[3, 1, 2]])
    top_v = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    good = torch.tensor([[0.0, 1.0, 0.5, 3.0, 0.0]])
    bad = torch.tensor([[0.0, 3.0, 0.5, 1.0, 0.0]])
    lg, sg = distill_loss(good, top_i, top_v, None, 0.2)
    lb, sb = distill_loss(bad, top_i, top_v, None, 0.2)
    assert float(lg) < float(lb) and sg["agree"] == 1.0 and sb["agree"] == 0.0


def test_lr_schedule_warms_up_and_decays():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, min_lr_frac=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(1e-4)
    assert lr_at(9, 100, cfg) == pytest.approx(1e-3)
    assert lr_at(100, 100, cfg) == pytest.approx(1e-4)


def test_draft_train_cli_end_to_end_and_resume(tmp_path, monkeypatch, capsys):
    """`specrl draft train` on a tiny random pair: data, training, export, resume, exact decoding."""
    from specrl.cli import main

    monkeypatch.setenv("SPECRL_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = save_tiny(tmp_path / "tiny", WORDS, seed=3)
    rng = np.random.default_rng(0)
    prompts = tmp_path / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(16):
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9))))
            f.write(json.dumps({"turns": [text], "category": ["a", "b"][i % 2], "question_id": i}) + "\n")
    out = tmp_path / "draft"
    args = ["draft", "train", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "12",
            "--rounds", "1", "--gen-dtype", "float32", "--layers", "1", "--shortlist", "24", "--topk", "8",
            "--train-tokens", "300", "--batch-tokens", "128", "--eval-every", "5", "--threads", "1",
            "--no-progress", "--run", "t", "--export", str(out)]
    assert main(args) == 0
    run_dir = tmp_path / "cache" / "drafttrain" / "tiny" / "runs" / "t"
    data_dir = tmp_path / "cache" / "drafttrain" / "tiny" / "data"
    assert {p.name for p in data_dir.iterdir()} >= {"manifest.json", "heldout-greedy", "train-greedy", "train-text",
                                                   "train-t0.7-r1"}
    curve = [json.loads(line) for line in (run_dir / "curve.jsonl").read_text().splitlines()]
    assert curve[0]["train_tokens"] == 0 and curve[-1]["train_tokens"] >= 300
    card = json.loads((out / "card.json").read_text())
    assert card["arch"]["layers"] == [1] and card["arch"]["shortlist"] == 24
    assert set(card["heldout"]["per_category"]) == {"a", "b"}
    assert (out / "draft.safetensors").stat().st_size < 2**20
    # the stored ranking cuts a cheaper head without the run: the 12 best-ranked ids of the 24
    tiny_target = ModelPair.load(str(model_dir), device="cpu", dtype="float32").target
    from safetensors.torch import load_file

    stored = load_file(str(out / "draft.safetensors"))
    assert sorted(stored["shortlist_rank"].tolist()) == stored["shortlist"].tolist()
    cut = load_draft(out, tiny_target, shortlist=12)
    assert cut.lm_head.ids.tolist() == sorted(stored["shortlist_rank"][:12].tolist())
    with pytest.raises(ConfigError, match="must be > 0"):
        load_draft(out, tiny_target, shortlist=0)
    # ... and `specrl draft export --draft` writes that cut as a new draft
    cut_dir = tmp_path / "cut"
    assert main(["draft", "export", "--model", str(model_dir), "--draft", str(out), "--shortlist", "12",
                 "--out", str(cut_dir)]) == 0
    recut = load_draft(cut_dir, tiny_target)
    assert recut.lm_head.ids.tolist() == cut.lm_head.ids.tolist()
    assert json.loads((cut_dir / "card.json").read_text())["arch"]["shortlist"] == 12

    # running again resumes: no new data, training already at its budget
    step = torch.load(run_dir / "ckpt.pt", weights_only=False)["step"]
    assert main(args) == 0
    assert torch.load(run_dir / "ckpt.pt", weights_only=False)["step"] == step
    # other settings for the same run are refused with a fix
    assert main([*args[:-2], "--lr", "0.1"]) == 2

    # the exported draft plugs into the engine; greedy output equals the target alone
    pair = ModelPair.load(str(model_dir), device="cpu", dtype="float32")
    draft = load_draft(out, pair.target)
    pair = ModelPair.from_models(pair.target, draft, tokenizer=pair.tokenizer, draft_name="trained")
    ids = [pair.encode_prompt(" ".join(rng.choice(WORDS, size=5))) for _ in range(3)]
    refs = _greedy_refs(pair, ids, 16)
    eng = SpecEngine(pair, drafter="model", max_batch_size=2)
    done = eng.generate(ids, 16, action=lambda _: Action(int(rng.integers(0, 6)), int(rng.integers(1, 3))))
    assert [r.output.tolist() for r in done] == refs

    # `specrl draft head` trains a feature head on the same data; the feature drafter runs it exactly
    head_dir = tmp_path / "head"
    assert main(["draft", "head", "--model", str(model_dir), "--out", str(head_dir), "--shortlist", "24",
                 "--epochs", "2", "--batch-tokens", "128", "--eval-every", "5", "--unroll", "2", "--threads", "1",
                 "--no-progress"]) == 0
    hcard = json.loads((head_dir / "card.json").read_text())
    assert hcard["recipe"]["unroll"] == 2 and hcard["recipe"]["unroll_weight"] == 0.5
    assert hcard["arch"] == {"kind": "mlp", "hidden_size": 32, "vocab_size": pair.vocab_size, "shortlist": 24}
    assert set(hcard["per_category"]) == {"a", "b"} and hcard["data"]["train_generated_tokens"] > 0
    assert hcard["learning_curve"][0]["trained_tokens"] == 0 < hcard["learning_curve"][-1]["trained_tokens"]
    eng = SpecEngine(pair, drafter=make_drafter("feature", pair, head=str(head_dir)), max_batch_size=2)
    done = eng.generate(ids, 16, action=lambda _: Action(int(rng.integers(0, 6)), int(rng.integers(1, 3))))
    assert [r.output.tolist() for r in done] == refs
    assert main(["draft", "head", "--model", str(model_dir), "--out", str(head_dir), "--kind", "medusa"]) == 2
    # ... and `specrl generate --drafter feature --head DIR` decodes with it
    assert main(["generate", "--model", str(model_dir), "--drafter", "feature", "--head", str(head_dir), "--no-chat",
                 "--prompt", " ".join(WORDS[:4]), "--k", "2", "--w", "2", "--max-new-tokens", "8", "--json"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(model_dir), "--head", str(head_dir), "--prompt", "a"]) == 2
    assert "is a feature head, but --drafter is 'ngram'. Fix: add --drafter feature" in capsys.readouterr().err


@pytest.mark.slow
def test_shipped_draft_loads_offline_and_is_exact(default_pair):
    pair = ModelPair.load("default", draft="default-draft", device="cpu")
    draft = pair.draft
    assert type(draft).__name__ == "LlamaForCausalLM"
    assert draft.get_output_embeddings().weight.shape[0] == 49152
    ids = [pair.encode_prompt(t) for t in ("What is 12 times 3?", "Write a haiku about the sea.")]
    refs = _greedy_refs(default_pair, ids, 32)
    rng = np.random.default_rng(1)
    eng = SpecEngine(pair, drafter="model", max_batch_size=2)
    done = eng.generate(ids, 32, action=lambda _: Action(int(rng.integers(0, 6)), int(rng.integers(1, 3))))
    assert [r.output.tolist() for r in done] == refs
    assert sum(r.accepted for r in done) > 0  # a trained draft gets tokens accepted
    # transformers' assisted generation takes it as the assistant model
    x = torch.tensor([ids[0]])
    with torch.inference_mode():
        out = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                                   assistant_model=draft, pad_token_id=2, eos_token_id=None)
    assert out[0, len(ids[0]):].tolist()[: len(refs[0])] == refs[0]


@pytest.mark.slow
def test_shipped_feature_head_loads_offline_and_is_exact(default_pair):
    from specrl.drafters.feature import FeatureDrafter

    eng = SpecEngine(default_pair, drafter="feature", max_batch_size=2)  # the packaged head, no path given
    assert isinstance(eng.drafter, FeatureDrafter) and eng.drafter.head.ids.numel() == 8192
    ids = [default_pair.encode_prompt(t) for t in ("What is 12 times 3?", "Write a haiku about the sea.")]
    refs = _greedy_refs(default_pair, ids, 32)
    rng = np.random.default_rng(2)
    done = eng.generate(ids, 32, action=lambda _: Action(int(rng.integers(0, 6)), int(rng.integers(1, 3))))
    assert [r.output.tolist() for r in done] == refs
    assert sum(r.accepted for r in done) > 0  # a trained head gets tokens accepted


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only machine gives")
def test_draft_cli_cuda_without_gpu_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from specrl.cli import main

    monkeypatch.setenv("SPECRL_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = save_tiny(tmp_path / "tiny", WORDS, seed=3)
    assert main(["draft", "data", "--model", str(model_dir), "--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "device='cpu'" in err


def test_python_dash_m_specrl_runs_the_cli():
    """scripts/draft_gpu.sh calls `python -m specrl` on machines where the package is not installed."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "specrl", "draft", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--device" in out.stdout and "--layers" in out.stdout
