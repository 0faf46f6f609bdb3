"""The learned acceptance model (specrl.accmodel): fit, decisions, artifacts, tiny end-to-end run."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from specrl import accmodel
from specrl.costs import CostModel
from specrl.errors import ConfigError
from specrl.features import INDEX, NUM_FEATURES, initial_features
from specrl.policies import PolicyContext, make_policy
from specrl.policies.base import ActionTable

CTX = PolicyContext([0, 1, 2, 4, 8], [1, 2], CostModel.analytic(), "ngram")
TABLE = ActionTable(CTX.k_choices, CTX.w_choices)
ACTIONS = TABLE.all()


def constant_model(per_action: list[float]) -> accmodel.AcceptanceModel:
    """A model that predicts the same accepted tokens per row whatever the features."""
    w = np.zeros((len(per_action), NUM_FEATURES))
    return accmodel.AcceptanceModel([(w, np.asarray(per_action, float))], np.zeros(NUM_FEATURES), np.ones(NUM_FEATURES))


def feats(batch: float = 1.0) -> np.ndarray:
    f = initial_features(1)[0]
    f[INDEX["batch_size"]], f[INDEX["mean_context"]] = batch, 200
    return f


def test_decisions_follow_the_predicted_acceptance():
    none = accmodel.AcceptanceModelPolicy(CTX, constant_model([0.0] * len(ACTIONS)))
    assert none.decide(feats()) == (0, 1)  # nothing accepted: drafting only costs time
    want = ACTIONS.index((4, 1))
    pred = [0.0] * len(ACTIONS)
    pred[want] = 4.0  # every draft token of (4, 1) accepted, nothing else
    assert accmodel.AcceptanceModelPolicy(CTX, constant_model(pred)).decide(feats()) == (4, 1)
    # k = 0 accepts nothing, whatever the network says for it
    bogus = [0.0] * len(ACTIONS)
    bogus[ACTIONS.index((0, 1))] = 50.0
    pol = accmodel.AcceptanceModelPolicy(CTX, constant_model(bogus))
    assert pol.expected_accepted_per_row(feats())[ACTIONS.index((0, 1))] == 0.0


def test_fit_learns_a_feature_dependent_target_and_numpy_matches():
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(4000, NUM_FEATURES)).astype(np.float32)
    obs[:, INDEX["match_len"]] = rng.uniform(0, 4, 4000)
    y = np.stack([np.clip(obs[:, INDEX["match_len"]] * (a[0] / 8), 0, None) for a in ACTIONS], 1)  # (M, A)
    model, stats = accmodel.fit(obs, y, accmodel.Recipe(hidden=(32,), epochs=20, batch_size=64), seed=0)
    assert stats["mse"] < 0.1 * stats["mse_constant"]  # the features explain the target
    pred = model(obs[:5])
    assert pred.shape == (5, len(ACTIONS)) and (pred >= 0).all()
    np.testing.assert_allclose(model(obs[0]), pred[0], rtol=1e-6)  # one row or a batch alike


def test_decision_fit_learns_the_feature_dependent_best_action():
    """objective 'decision': the best action switches with a feature; the fitted argmax follows it
    (held-back regret far below the best constant action's), scores are not clipped at 0."""
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(4000, NUM_FEATURES)).astype(np.float32)
    m = obs[:, INDEX["match_len"]] = rng.uniform(0, 4, 4000)
    good = np.ones((4000, len(ACTIONS)), np.float32)
    good[:, ACTIONS.index((0, 1))] = 2.0 - (m > 2)  # k = 0 best without a long match
    good[:, ACTIONS.index((4, 1))] = 1.0 + 1.5 * (m > 2)  # (4, 1) best with one
    recipe = accmodel.Recipe(objective="decision", hidden=(32,), epochs=20, batch_size=64)
    with pytest.raises(ValueError, match="needs the per-action goodput"):
        accmodel.fit(obs, good, recipe, seed=0)
    model, stats = accmodel.fit(obs, np.zeros_like(good), recipe, seed=0, goodput=good)
    assert stats["regret"] < 0.1 * stats["regret_constant"] and stats["regret_constant"] > 0.1
    pol = accmodel.DecisionPolicy(CTX, model)
    lo, hi = feats(), feats()
    lo[INDEX["match_len"]], hi[INDEX["match_len"]] = 0.5, 3.5
    assert pol.decide(lo) == (0, 1) and pol.decide(hi) == (4, 1)
    assert not model.clip and (model(obs[:200]) < 0).any()  # logits, not accepted tokens


def test_recipe_rejects_an_unknown_objective():
    from types import SimpleNamespace

    with pytest.raises(ConfigError, match="objective='greedy' is not one of .*Fix: objective: acceptance"):
        accmodel.recipe_from(SimpleNamespace(hyperparams={"objective": "greedy"}, n_envs=4))
    assert accmodel.recipe_from(SimpleNamespace(hyperparams={"objective": "decision"}, n_envs=4)).objective == "decision"
    with pytest.raises(ConfigError, match="objective='greedy' is not one of"):
        accmodel.Recipe(objective="greedy")  # what accmodel.train and the benchmark build


def test_save_load_roundtrip_through_the_registry(tmp_path):
    m = constant_model([0.0, 0.5, 0.2, 1.5, 0.9, 2.8, 1.0, 3.5, 1.0])
    d = accmodel.save(m, tmp_path / "am", TABLE, {"recipe": {}, "seed": 0})
    assert sorted(p.name for p in d.iterdir()) == ["accmodel.json", "accmodel.safetensors"]
    pol = make_policy(f"accmodel:{d}", CTX)
    assert pol.name == f"accmodel:{d}"
    for b in (1, 4, 16):
        np.testing.assert_allclose(pol.scores(feats(b)), accmodel.AcceptanceModelPolicy(CTX, m).scores(feats(b)),
                                   rtol=1e-6)
    with pytest.raises(ConfigError, match="this env's table is"):
        make_policy(f"accmodel:{d}", PolicyContext([0, 1, 2], [1], CostModel.analytic(), "ngram"))
    meta = json.loads((d / "accmodel.json").read_text())
    (d / "accmodel.json").write_text(json.dumps({**meta, "schema_version": 1}))
    with pytest.raises(ConfigError, match="schema v1; this specrl reads .* Fix: retrain"):
        make_policy(f"accmodel:{d}", CTX)
    with pytest.raises(ConfigError, match="must hold accmodel.json and accmodel.safetensors"):
        make_policy(f"accmodel:{tmp_path / 'missing'}", CTX)
    with pytest.raises(ConfigError, match="needs a directory"):
        make_policy("accmodel:", CTX)
    # a decision network: negative scores survive the round trip, the registry builds its policy
    w = np.zeros((len(ACTIONS), NUM_FEATURES))
    logits = -np.arange(len(ACTIONS), 0, -1, dtype=float)  # all < 0, the last action best
    dm = accmodel.AcceptanceModel([(w, logits)], np.zeros(NUM_FEATURES), np.ones(NUM_FEATURES), clip=False)
    d2 = accmodel.save(dm, tmp_path / "dec", TABLE, {"recipe": {}, "seed": 0, "objective": "decision"})
    pol = make_policy(f"accmodel:{d2}", CTX)
    assert isinstance(pol, accmodel.DecisionPolicy) and pol.decide(feats()) == ACTIONS[-1]
    np.testing.assert_allclose(pol.scores(feats()), logits)
    meta = json.loads((d2 / "accmodel.json").read_text())
    (d2 / "accmodel.json").write_text(json.dumps({**meta, "objective": "greedy"}))
    with pytest.raises(ConfigError, match="has objective 'greedy'.*Fix: retrain"):
        make_policy(f"accmodel:{d2}", CTX)


@pytest.mark.parametrize("objective", ["acceptance", "decision"])
def test_tiny_training_run_end_to_end(tiny_replay_env, tmp_path, objective):
    from specrl.envs.config import load_env_config, policy_context
    from specrl.evaluate import evaluate, parse_loads
    from specrl.train import prepare

    cfg = load_env_config(tiny_replay_env)
    prepare(cfg, progress=False)
    recipe = accmodel.Recipe(steps=6, rounds=1, round_steps=4, n_envs=4, hidden=(16,), epochs=2, objective=objective)
    logs: list[str] = []
    model, info = accmodel.train(cfg, recipe, seed=0, progress=False, log=logs.append)
    assert [h["samples"] for h in info["history"]] == [24, 40] and len(logs) == 2
    assert ("regret" in info["history"][-1]) == (objective == "decision") and info["objective"] == objective
    d = accmodel.save(model, tmp_path / "am", ActionTable(cfg.k_choices, cfg.w_choices), info)
    res = evaluate(replace(cfg, horizon_s=2.0), ["ar", f"accmodel:{d}"], parse_loads(["closed:1"]), [0], None,
                   progress=False)
    assert res["overall"][f"accmodel:{d}"] > 0
    # exported as a runtime controller: self-contained (the model's files travel inside it), same decisions
    import shutil

    from specrl.runtime.controller import Controller
    from specrl.runtime.export import export_rule

    art = export_rule(f"accmodel:{d}", cfg, tmp_path / "ctl")
    pol = make_policy(f"accmodel:{d}", policy_context(cfg))
    assert isinstance(pol, accmodel.DecisionPolicy) == (objective == "decision")
    shutil.rmtree(d)
    ctl = Controller.load(shutil.move(str(art), str(tmp_path / "moved")))
    rng = np.random.default_rng(1)
    for b in (1, 2, 4):
        f = feats(b)
        f[INDEX["draft_top1"]], f[INDEX["match_len"]] = rng.uniform(), rng.uniform(0, 4)
        assert ctl.decide(f) == pol.decide(f)
    assert ctl.fallbacks == 0
    # the guard: the training feature range travels with the model; outside it the fallback answers
    assert ctl.low is not None and ctl.fallback_name == "goodput"
    rng_lo, rng_hi = np.asarray(info["feature_range"]["low"]), np.asarray(info["feature_range"]["high"])
    assert (ctl.low <= rng_lo).all() and (ctl.high >= rng_hi).all() and (rng_lo <= rng_hi).all()
    far = feats(2)
    far[INDEX["max_context"]] = 1e7
    assert ctl.decide(far) == ctl.fallback.decide(far) and ctl.fallbacks == 1
    with pytest.raises(ConfigError, match="prompt_split 'test'"):
        accmodel.train(replace(cfg, prompt_split="test"), recipe, seed=0, progress=False)
    assert policy_context(cfg).cost_model is not None
