"""Early stopping of hopeless stage-1 configs, per (scoring, grouping) pair.

Stage 1 promotes the best (K, scaling) of every (scoring, grouping) pair, so a config is only
hopeless relative to its own pair: comparing with the global best would stop the winner of a weak
pair. After each chunk a trial reports the perplexity of the windows seen so far; all trials see the
windows in the same order, so partials at the same chunk are comparable like for like. A trial is
stopped when, for every pair it stands for (deduplicated students stand for several), its partial is
more than `factor` x the best partial at that chunk among the pair's other trials.
"""

from __future__ import annotations

import math
from collections import defaultdict

from ray.tune.schedulers import FIFOScheduler, TrialScheduler


def hopeless(
    ppl: float, chunk: int, pairs: list[str], best: dict[str, dict[int, float]], factor: float, grace: int
) -> bool:
    """The stopping rule (pure, for tests): far worse than each pair's best at the same chunk."""
    if not math.isfinite(ppl):
        return True
    if chunk < grace:
        return False
    return all(chunk in best.get(p, {}) and ppl > factor * best[p][chunk] for p in pairs)


class PairwiseStopper(FIFOScheduler):
    """Tune scheduler applying `hopeless` to every intermediate result (metric "ppl", step "chunk")."""

    def __init__(self, factor: float, grace_chunks: int, pairs: dict[str, list[str]]) -> None:
        super().__init__()
        self.factor, self.grace = factor, grace_chunks
        self.pairs = pairs  # trial key -> the (scoring, grouping) pairs its student stands for
        self.best: dict[str, dict[int, float]] = defaultdict(dict)  # pair -> chunk -> best partial ppl
        self.stopped: set[str] = set()  # trial keys stopped by this scheduler

    def seed(self, records: list[dict]) -> None:
        """Resume: the partials of configs finished before the restart count as seen."""
        for r in records:
            for chunk, ppl in r.get("partials", []):
                self._update([f"{r['scoring']}/{r['grouping']}"], chunk, ppl)

    def seed_probes(self, probes: dict[str, float]) -> None:
        """The probe round's first-chunk perplexities count as seen (for every pair of each student)."""
        for key, ppl in probes.items():
            self._update(self.pairs.get(key, []), 1, ppl)

    def is_hopeless(self, key: str, chunk: int, ppl: float) -> bool:
        return hopeless(ppl, chunk, self.pairs[key], self.best, self.factor, self.grace)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        if "chunk" not in result or result.get("final"):
            self._record(trial, result)
            return TrialScheduler.CONTINUE
        key = trial.config["key"]
        if self.is_hopeless(key, result["chunk"], result["ppl"]):
            self.stopped.add(key)
            return TrialScheduler.STOP
        self._record(trial, result)
        return TrialScheduler.CONTINUE

    def _record(self, trial, result: dict) -> None:
        self._update(self.pairs[trial.config["key"]], result.get("chunk"), result.get("ppl"))

    def _update(self, pairs: list[str], chunk: int | None, ppl: float | None) -> None:
        if chunk is None or ppl is None or not math.isfinite(ppl):
            return
        for p in pairs:
            self.best[p][chunk] = min(ppl, self.best[p].get(chunk, math.inf))

    def debug_string(self) -> str:
        return f"PairwiseStopper(factor={self.factor}): stopped {len(self.stopped)} trials"
