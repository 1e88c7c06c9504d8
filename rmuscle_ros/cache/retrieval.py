"""Retrieval and alignment against the reference library (DESIGN.md §4).

At each call: cosine similarity between the current retrieval descriptor and every recorded call; per
episode the best match within its aligned position and the next `lookahead` (the whole episode on the
first call after a reset); the `top_k` episodes by that similarity are the candidates. If the best one
is below `threshold`, the episode runs dense from then on: the fallback is sticky until `reset()`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RetrievalConfig:
    top_k: int = 4
    lookahead: int = 4
    threshold: float = 0.8

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.lookahead < 0:
            raise ValueError(f"top_k must be >= 1 and lookahead >= 0, got {self.top_k}, {self.lookahead}")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a cosine similarity in [-1, 1], got {self.threshold}")


@dataclass(frozen=True)
class Match:
    episode: int
    position: int  # aligned call index in that episode
    similarity: float  # cosine similarity of the descriptors


def _unit_rows(x: np.ndarray) -> np.ndarray:
    flat = x.reshape(x.shape[0], -1).astype(np.float32)
    return flat / np.maximum(np.linalg.norm(flat, axis=1, keepdims=True), 1e-12)


class Retriever:
    def __init__(self, cfg: RetrievalConfig, descriptors: Mapping[int, np.ndarray]) -> None:
        """descriptors: episode id -> (calls, cameras, dim) retrieval descriptors of that episode."""
        self.cfg = cfg
        self._episodes = {eid: _unit_rows(d) for eid, d in descriptors.items() if len(d)}
        self.reset()

    def reset(self) -> None:
        """A new episode on the cell: forget alignments, leave fallback."""
        self.positions: dict[int, int] = {}
        self.fallback = False
        self.last_similarity = 0.0  # best similarity of the latest query (0.0 with no episodes)

    def query(self, descriptor: np.ndarray) -> list[Match]:
        """descriptor (cameras, dim) -> up to top_k matches, best first; [] means run dense."""
        if not self._episodes:
            self.last_similarity = 0.0
            return []
        if self.fallback:  # still report how far the scene is from the repertoire
            q = _unit_rows(descriptor[None])[0]
            self.last_similarity = max(float((rows @ q).max()) for rows in self._episodes.values())
            return []
        q = _unit_rows(descriptor[None])[0]
        best: list[Match] = []
        for eid, rows in self._episodes.items():
            start = self.positions.get(eid)
            lo, hi = (
                (0, len(rows)) if start is None else (start, min(start + self.cfg.lookahead + 1, len(rows)))
            )
            sims = rows[lo:hi] @ q
            i = int(np.argmax(sims))
            best.append(Match(eid, lo + i, float(sims[i])))
        best.sort(key=lambda m: (-m.similarity, m.episode))
        self.last_similarity = best[0].similarity
        if best[0].similarity < self.cfg.threshold:
            self.fallback = True  # sticky: the scene left the repertoire for this episode
            return []
        matches = best[: self.cfg.top_k]
        self.positions = {m.episode: m.position for m in best}  # every episode stays aligned
        return matches
