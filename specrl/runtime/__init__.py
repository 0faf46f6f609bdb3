"""The runtime controller: load an exported policy and call it once per decode step.

Needs numpy and safetensors only: ``import specrl.runtime`` imports neither torch,
transformers, gymnasium nor stable-baselines3 (tested), so a serving process can use it.

    from specrl.runtime import Controller, FeatureTracker
    ctl = Controller.load("runs/.../export")
    tracker = FeatureTracker()
    # each step: report load and what happened, then ask for (k, w)
    tracker.update_load(batch_size, queue_len, context_lens)
    k, w = ctl.decide(tracker.vector())
    ...
    tracker.update_step(accept_lens, drafted_depths, k, w, match_len=..., num_matches=...)
"""

from specrl.errors import ArtifactError
from specrl.features import SCHEMA_VERSION, FeatureTracker
from specrl.runtime.controller import Controller

__all__ = ["ArtifactError", "Controller", "FeatureTracker", "SCHEMA_VERSION"]
