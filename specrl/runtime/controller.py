"""``Controller``: an exported policy (an MLP in safetensors + JSON, or a baseline rule).

Artifact layout (directory):

* ``controller.json``: format and version, feature schema (version and field list), kind
  (``mlp`` or ``rule``), the network layout (layer tensor names, activations, action heads),
  observation normalisation (mean, var, clip), frame stacking, action tables (``defer``: the rule
  behind the k head's extra choice, see ``specrl.defer``), the deterministic action rule, the
  guard (training feature range, fallback rule), provenance.
* ``policy.safetensors``: the weights (``mlp`` only). A ``rule`` artifact of a learned acceptance
  model or decision network (``accmodel:.``) carries ``accmodel.json`` + ``accmodel.safetensors``
  beside it, and the guard of its training range like an ``mlp``. A per-request table
  (``rowmodel:.``) carries ``rowmodel.json``; ``decide_rows`` then gives every running request its
  own (k, w). safetensors holds raw tensors: loading it cannot execute code, unlike a pickle.

The guard: a feature vector with NaN/inf or outside the training range (widened by ``margin``)
is answered by the fallback rule instead of the network; any error while deciding also falls
back, so ``decide`` never raises in a serving loop. The default fallback is ``ar`` (no
speculation: never worse than not speculating); ``goodput`` when a cost model was exported.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from specrl.defer import NOT_DEFERRABLE
from specrl.errors import ArtifactError
from specrl.features import FIELDS, NUM_FEATURES, SCHEMA_VERSION

FORMAT = "specrl-controller"
FORMAT_VERSION = 1
MAX_JSON_BYTES = 4 << 20  # a controller.json is a few KB
MAX_WEIGHTS_BYTES = 64 << 20  # a controller MLP is tens of KB
MAX_DIM = 4096  # no layer of a controller is wider
ACTIVATIONS = {
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0.0),
    "identity": lambda x: x,
}


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ArtifactError(msg)


class Controller:
    """Deterministic (k, w) decisions from schema-v2 features; numpy only."""

    def __init__(self, meta: dict[str, Any], weights: dict[str, np.ndarray] | None, path: str = "") -> None:
        self.meta = meta
        self.path = path
        act = meta["actions"]
        self.k_choices = [int(k) for k in act["k_choices"]]
        self.w_choices = [int(w) for w in act["w_choices"]]
        self.flat = [tuple(map(int, a)) for a in act["flat"]] if act.get("kind") == "flat" else None
        norm = meta.get("normalization")
        self.mean = None if norm is None else np.asarray(norm["mean"], np.float32)
        self.inv_std = None if norm is None else (1.0 / np.sqrt(np.asarray(norm["var"], np.float32) + norm["eps"])
                                                  ).astype(np.float32)
        self.clip = None if norm is None else float(norm["clip"])
        self.frame_stack = int(meta.get("frame_stack", 1))
        guard = meta.get("guard", {})
        self.low = np.asarray(guard["feature_low"], np.float32) if guard.get("feature_low") is not None else None
        self.high = np.asarray(guard["feature_high"], np.float32) if guard.get("feature_high") is not None else None
        self.fallback_name = guard.get("fallback", "ar")
        self.fallbacks = 0  # decisions answered by the fallback rule
        self._stack: list[np.ndarray] = []
        self.kind = meta["kind"]
        if self.kind == "mlp":
            self.layers = [(weights[L["weight"]].T.copy(), weights[L["bias"]], ACTIVATIONS[L["activation"]])
                           for L in meta["architecture"]["layers"]]  # type: ignore[index]
            head = meta["architecture"]["head"]
            self.head_w = weights[head["weight"]].T.copy()  # type: ignore[index]
            self.head_b = weights[head["bias"]]  # type: ignore[index]
            self.split = np.cumsum([0, *head["sizes"]])
            self.rule = None
        else:
            self.rule = self._make_rule(meta["rule"])
        self.fallback = self._make_rule(self.fallback_name)
        # the k head's extra choice that hands the step to a rule (specrl.defer); None = no such choice
        self.defer = self._make_rule(act["defer"]) if act.get("defer") else None
        # a per-request rule (rowmodel:.): decide_rows gives every running request its own (k, w)
        self.per_row = bool(getattr(self.rule, "per_row", False))

    # ----- loading --------------------------------------------------------------------------------
    @staticmethod
    def load(path: str | Path) -> Controller:
        """Load and validate an artifact directory; every problem is an ``ArtifactError``."""
        p = Path(path)
        js = p / "controller.json"
        _require(p.is_dir() and js.is_file(), f"{str(p)!r} is not a controller artifact (no controller.json). "
                 "Fix: pass the directory written by `specrl export`.")
        _require(js.stat().st_size <= MAX_JSON_BYTES, f"{js} is {js.stat().st_size} bytes, more than a controller "
                 f"description can be ({MAX_JSON_BYTES}). Refusing to read it.")
        try:
            meta = json.loads(js.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ArtifactError(f"{js} is not valid JSON ({e}). Fix: re-export the controller.") from e
        _check_meta(meta, js)
        weights = None
        if meta["kind"] == "mlp":
            weights = _load_weights(p / "policy.safetensors", meta)
        try:
            return Controller(meta, weights, str(p))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ArtifactError(f"{js} is malformed ({type(e).__name__}: {e}). Fix: re-export the controller.") from e

    def _make_rule(self, spec: str) -> Any:
        from specrl.costs import CostModel
        from specrl.policies import PolicyContext, make_policy

        name, _, arg = spec.partition(":")
        if name in ("accmodel", "rowmodel") and self.path and not Path(arg).is_absolute():
            spec = f"{name}:{Path(self.path) / arg}"  # the model's files travel in the artifact
        cm = self.meta.get("cost_model")
        ctx = PolicyContext(self.k_choices, self.w_choices, CostModel(**_cost_args(cm)) if cm else None,
                            self.meta.get("provenance", {}).get("drafter", "ngram"), self.meta.get("verify", "ragged"))
        try:
            return make_policy(spec, ctx)
        except Exception as e:  # noqa: BLE001 - any failure here means a bad artifact
            raise ArtifactError(f"The artifact's rule {spec!r} cannot be built ({e}).") from e

    # ----- deciding ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start of a new request stream (clears frame stacks and rule state)."""
        self._stack = []
        for r in (self.rule, self.fallback, self.defer):
            if r is not None:
                r.reset()

    def in_range(self, x: np.ndarray) -> bool:
        if not np.isfinite(x).all():
            return False
        if self.low is not None and ((x < self.low) | (x > self.high)).any():
            return False
        return True

    def decide(self, features: np.ndarray) -> tuple[int, int]:
        """(k, w) for the next step. Never raises: out-of-range features and errors fall back."""
        try:
            x = raw = np.asarray(features, np.float32).reshape(-1)
            if x.shape[0] != NUM_FEATURES:
                raise ValueError(f"expected {NUM_FEATURES} features (schema v{SCHEMA_VERSION}), got {x.shape[0]}")
            if self.rule is not None and self.low is None:  # a hand-written rule: no training range
                return self.rule.decide(x)
            if not self.in_range(x):
                return self._fall_back(x)  # counted once, even if the fallback itself fails
            if self.rule is not None:  # a learned rule (accmodel:.) inside its training range
                return self.rule.decide(x)
            if self.mean is not None:
                x = np.clip((x - self.mean) * self.inv_std, -self.clip, self.clip)
            if self.frame_stack > 1:
                if not self._stack:
                    self._stack = [np.zeros_like(x)] * self.frame_stack
                self._stack = [*self._stack[1:], x]
                x = np.concatenate(self._stack)
            for w, b, f in self.layers:
                x = f(x @ w + b)
            logits = x @ self.head_w + self.head_b
            if self.flat is not None:
                return self.flat[int(logits.argmax())]
            ki = int(logits[self.split[0] : self.split[1]].argmax())
            wi = int(logits[self.split[1] : self.split[2]].argmax())
            if self.defer is not None and ki == len(self.k_choices):
                return self.defer.decide(raw)
            k = self.k_choices[ki]
            return (k, 1) if k == 0 else (k, self.w_choices[wi])
        except Exception:  # noqa: BLE001 - the serving loop must not die because of the controller
            return self._fall_back(features)

    def _fall_back(self, features: np.ndarray) -> tuple[int, int]:
        """The fallback rule's decision on the (NaN-cleaned) features; (0, 1) if even that fails."""
        self.fallbacks += 1
        try:
            return self.fallback.decide(np.nan_to_num(np.asarray(features, np.float32).reshape(-1)))
        except Exception:  # noqa: BLE001
            return (0, 1)

    def decide_rows(self, features: np.ndarray, view: Any) -> list[tuple[int, int]]:
        """One (k, w) per running request (``view``: a one-engine ``specrl.rows.RowView``, slots =
        the running rows in engine order). A per-request artifact plans the rows; any other
        artifact gives every row its ``decide``. Never raises: errors give every row the fallback."""
        n = int(view.valid.shape[1])
        try:
            if not self.per_row:
                return [self.decide(features)] * n
            x = np.asarray(features, np.float32).reshape(1, -1)
            if x.shape[1] != NUM_FEATURES or not np.isfinite(x).all():
                raise ValueError("bad features")
            idx = self.rule.decide_rows(x, view)[0]  # (S,) indices into the rule's action table
            kw = self.rule.actions_kw[idx]
            return [(int(k), int(w)) for k, w in kw]
        except Exception:  # noqa: BLE001 - the serving loop must not die because of the controller
            if self.per_row:  # the rule did not see this step: its per-request history would span two
                try:
                    self.rule.reset()
                except Exception:  # noqa: BLE001
                    pass
            return [self._fall_back(features)] * n

    def observe(self, features: np.ndarray, info: dict[str, Any]) -> None:
        """Let stateful rules (and the fallback) see what a step did."""
        for r in (self.rule, self.fallback, self.defer):
            if r is not None:
                r.observe(features, info)


def _cost_args(cm: dict[str, Any]) -> dict[str, Any]:
    d = dict(cm)
    d["overhead"] = tuple(d["overhead"])
    d["prefill"] = tuple(d["prefill"])
    return d


def _check_meta(meta: Any, where: Path) -> None:
    _require(isinstance(meta, dict), f"{where}: the top level must be a JSON object.")
    _require(meta.get("format") == FORMAT, f"{where}: format is {meta.get('format')!r}, not {FORMAT!r}.")
    _require(meta.get("format_version") == FORMAT_VERSION,
             f"{where}: format_version {meta.get('format_version')!r} is not supported (expected {FORMAT_VERSION}). "
             "Fix: re-export with this specrl version.")
    for key in ("kind", "schema", "actions"):
        _require(key in meta, f"{where}: missing key {key!r}. Fix: re-export the controller.")
    schema = meta["schema"]
    _require(isinstance(schema, dict) and schema.get("version") == SCHEMA_VERSION,
             f"{where}: feature schema version {schema.get('version') if isinstance(schema, dict) else schema!r} "
             f"does not match this runtime's version {SCHEMA_VERSION}. Fix: export the policy with a specrl whose "
             "feature schema matches the runtime, or retrain it.")
    _require(list(schema.get("fields", [])) == list(FIELDS),
             f"{where}: the feature field list differs from schema v{SCHEMA_VERSION}'s. Fix: re-export.")
    _require(meta["kind"] in ("mlp", "rule"), f"{where}: kind {meta['kind']!r} is not 'mlp' or 'rule'.")
    act = meta["actions"]
    _require(isinstance(act, dict) and isinstance(act.get("k_choices"), list) and isinstance(act.get("w_choices"), list)
             and 0 < len(act["k_choices"]) <= 64 and 0 < len(act["w_choices"]) <= 64,
             f"{where}: actions must hold non-empty k_choices and w_choices lists.")
    if meta["kind"] == "mlp":
        arch = meta.get("architecture")
        _require(isinstance(arch, dict) and isinstance(arch.get("layers"), list) and isinstance(arch.get("head"), dict),
                 f"{where}: an mlp artifact needs architecture.layers and architecture.head.")
        for L in arch["layers"]:
            _require(isinstance(L, dict) and L.get("activation") in ACTIVATIONS,
                     f"{where}: layer {L!r} has an unknown activation (allowed: {sorted(ACTIVATIONS)}).")
        norm = meta.get("normalization")
        if norm is not None:
            dim = NUM_FEATURES
            _require(len(norm.get("mean", [])) == dim and len(norm.get("var", [])) == dim,
                     f"{where}: normalization mean/var must have {dim} entries.")
            _require(all(math.isfinite(v) for v in [*norm["mean"], *norm["var"]]) and min(norm["var"]) >= 0,
                     f"{where}: normalization statistics hold NaN, inf or negative variances.")
    else:
        _require(isinstance(meta.get("rule"), str), f"{where}: a rule artifact needs a 'rule' name.")
    _require(act.get("defer") is None or (isinstance(act["defer"], str)
                                          and act["defer"].partition(":")[0] not in NOT_DEFERRABLE),
             f"{where}: actions.defer must be the name of a rule that decides from the features, got "
             f"{act.get('defer')!r}.")


def _load_weights(path: Path, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    _require(path.is_file(), f"{path} is missing. Fix: copy the whole artifact directory.")
    size = path.stat().st_size
    _require(size <= MAX_WEIGHTS_BYTES, f"{path} is {size} bytes, larger than any controller ({MAX_WEIGHTS_BYTES}); "
             "refusing to load it.")
    with path.open("rb") as f:
        head = f.read(8)
    _require(len(head) == 8, f"{path} is truncated (not a safetensors file).")
    header_len = int.from_bytes(head, "little")
    _require(0 < header_len <= min(size - 8, 1 << 20),
             f"{path} is not a safetensors file (declared header of {header_len} bytes in a {size}-byte file; "
             "a pickle renamed to .safetensors looks like this). Refusing to load it.")
    try:
        from safetensors.numpy import load_file

        weights = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for corrupt files
        raise ArtifactError(f"{path} is not a valid safetensors file ({e}). Refusing to load it.") from e
    arch = meta["architecture"]
    dim = NUM_FEATURES * int(meta.get("frame_stack", 1))
    for L in [*arch["layers"], arch["head"]]:
        for key in ("weight", "bias"):
            _require(L.get(key) in weights, f"{path}: tensor {L.get(key)!r} named in controller.json is missing.")
        w, b = weights[L["weight"]], weights[L["bias"]]
        _require(w.ndim == 2 and b.ndim == 1 and w.shape[0] == b.shape[0] and w.shape[1] == dim
                 and max(w.shape) <= MAX_DIM,
                 f"{path}: tensor {L['weight']!r} has shape {w.shape} (bias {b.shape}), expected (out, {dim}) with "
                 f"out <= {MAX_DIM}.")
        _require(bool(np.isfinite(w).all() and np.isfinite(b).all()), f"{path}: tensor {L['weight']!r} or its bias "
                 "holds NaN or inf weights. Refusing to run it.")
        dim = w.shape[0]
    sizes = arch["head"].get("sizes")
    _require(isinstance(sizes, list) and sum(sizes) == dim,
             f"{path}: head sizes {sizes} do not add up to the head's {dim} outputs.")
    act = meta["actions"]
    if act.get("kind") != "flat":
        want = [len(act["k_choices"]) + (1 if act.get("defer") else 0), len(act["w_choices"])]
        _require(sizes == want, f"{path}: head sizes {sizes} do not match the action tables (expected {want}: "
                 f"k choices{' + defer' if act.get('defer') else ''}, w choices). Fix: re-export the controller.")
    return {k: v.astype(np.float32) for k, v in weights.items()}
