"""Per-expert base scores from calibration statistics (method.md, "Scores")."""

from __future__ import annotations

import math

from torch import Tensor

from m2d_ray.calibrate.stats import LayerStats


def sf(st: LayerStats) -> Tensor:
    """Selection frequency: share of tokens that route to e."""
    return st.count / max(st.n, 1.0)


def pp(st: LayerStats) -> Tensor:
    """Pre-selection probability: mean router probability over all tokens."""
    return st.psum / max(st.n, 1.0)


def ps(st: LayerStats) -> Tensor:
    """Post-selection probability: router probability summed where selected, per token (= SF x CP)."""
    return st.psel / max(st.n, 1.0)


def cp(st: LayerStats) -> Tensor:
    """Conditional probability: mean router probability on the tokens that selected e (0 if none)."""
    return st.cp


def acp(st: LayerStats) -> Tensor:
    """Activation-weighted CP: CP_e * sqrt(E * ||f_e||^2); the constant sqrt(E) changes no ranking."""
    return st.cp * (st.num_experts * st.sqnorm).clamp(min=0).sqrt()


BASE_SCORES = {"sf": sf, "pp": pp, "ps": ps, "cp": cp, "acp": acp}


def effective_rank(eigenvalues: Tensor) -> float:
    """Roy & Vetterli's effective rank exp(H(q)), q = sigma / sum(sigma) (1..n)."""
    s = eigenvalues.double().clamp(min=0)
    total = float(s.sum())
    if total <= 0:
        return 0.0
    q = s / total
    q = q[q > 0]
    return math.exp(float(-(q * q.log()).sum()))
