"""Error feedback for lossy outer-gradient codecs and sparsifiers.

Each replica m keeps, per fragment p, a residual e_m,p (float32, the fragment's length): what it meant
to send and the codec did not. At every send of fragment p

    target_m = Δ_m,p + e_m,p                 (before encoding)
    sent_m   = decode(encode(target_m))      (what every receiver decodes: the same bytes on the wire)
    e_m,p   ← target_m − sent_m

so after K sends Σ_k sent_m(k) + e_m,p = Σ_k Δ_m,p(k) (up to float32 rounding of the sums): nothing the
codec drops is lost, only delayed. A lossless codec ("none") sends target exactly and e stays 0, bit for
bit. The residual starts at 0, is checkpointed with the outer state, and never crosses the network.
Pure functions over (R, n) arrays (numpy or jax).
"""
from __future__ import annotations


def compensate(delta_Rxn, residual_Rxn):
    """What each replica encodes: its outer gradient plus its residual."""
    return delta_Rxn + residual_Rxn


def residual(target_Rxn, sent_Rxn):
    """The new residual: what was meant minus what the receivers decode."""
    return target_Rxn - sent_Rxn

