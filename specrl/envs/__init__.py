"""Gymnasium environments: ``specrl/SpecDecode-v0`` (live) and ``specrl/SpecReplay-v0`` (replay)."""
