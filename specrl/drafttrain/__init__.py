"""Draft-model distillation for a target LM (``specrl draft ...``).

Pipeline (each stage resumable, everything cached under ``specrl.models.cache_root()``):

1. ``data``: the target's own continuations of the training prompts (greedy, then sampled
   rounds), with the target's top-k log-probabilities at every generated position
   (:mod:`specrl.drafttrain.data`).
2. ``train``: a few-layer student initialised from target layers, sharing the target's frozen
   embedding and head, distilled with soft top-k targets (:mod:`specrl.drafttrain.train`).
3. ``eval`` / ``export``: top-1/top-4 agreement on held-out prompts; export the layers that the
   draft owns as safetensors + a JSON card (:mod:`specrl.drafttrain.student`).

The shipped draft for the default target is loaded by :mod:`specrl.drafttrain.shipped`.
"""
