"""Retrieval and alignment against the reference library (DESIGN.md §4).

At each call: cosine similarity between the current retrieval descriptor and every recorded call; per
episode the best match within its aligned position and the next `lookahead` (positions 0 to
`lookahead` on the first call after a reset); the `top_k` episodes by that similarity are the
candidates. If the best one is below `threshold`, the episode runs dense from then on: the fallback is
sticky until `reset()`.
`restrict` limits the search to some episodes (rMuscle: those of the current task) without rebuilding.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RetrievalConfig:
    top_k: int = 4
    lookahead: int = 4
    threshold: float = 0.8

    def __post_init__(self) -> None:
        # lookahead 0 froze the alignment at the reference's first call (found in review): the aligned
        # position only moves on through the positions past it that retrieval looks at.
        if self.top_k < 1 or self.lookahead < 1:
            raise ValueError(f"top_k must be >= 1 and lookahead >= 1, got {self.top_k}, {self.lookahead}")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a cosine similarity in [-1, 1], got {self.threshold}")


@dataclass(frozen=True)
class Match:
    episode: int
    position: int  # aligned call index in that episode
    similarity: float  # cosine similarity of the descriptors


def unit_rows(x: np.ndarray) -> np.ndarray:
    """(N, ...) descriptors -> (N, D) float32 rows of unit L2 norm: how retrieval holds the library's
    descriptors, and the window's match keys (bit for bit the same rows)."""
    flat = x.reshape(x.shape[0], -1).astype(np.float32)
    return flat / np.maximum(np.linalg.norm(flat, axis=1, keepdims=True), 1e-12)


class Retriever:
    """Retrieval over every recorded call of the library, held as one matrix of unit rows.

    Similarities are computed on the host (NumPy), or, with `device`, on the GPU: `queue` starts them on
    the current CUDA stream right after the descriptor is computed, and `query()` picks from them. At 256
    episodes of 30 calls (~190 MB of rows) that took 0.26 ms on an H200 with the round trip, against 1.66 ms
    for the host's scan, and a cached call stayed at its one-episode time (bench/bench_rmuscle.py
    --library-episodes)."""

    def __init__(
        self,
        cfg: RetrievalConfig,
        descriptors: Mapping[int, np.ndarray],
        device: torch.device | None = None,
    ) -> None:
        """descriptors: episode id -> (calls, cameras, dim) retrieval descriptors of that episode.
        device: a CUDA device to hold the rows and compute the similarities on (see `queue`)."""
        self.cfg = cfg
        episodes = {eid: unit_rows(d) for eid, d in descriptors.items() if len(d)}
        self._ids = np.array(list(episodes), dtype=np.int64)
        self._lengths = np.array([len(r) for r in episodes.values()], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._lengths)[:-1]]).astype(np.int64)
        dim = next(iter(episodes.values())).shape[1] if episodes else 0
        self._rows = np.concatenate(list(episodes.values())) if episodes else np.zeros((0, dim), np.float32)
        n, longest = len(self._rows), int(self._lengths.max(initial=0))
        # Every episode's calls as one row of indices into the similarities, padded with n: the similarity
        # vector gets a -inf at index n, so a padded slot never wins.
        steps = np.arange(longest)
        self._whole = np.where(steps < self._lengths[:, None], self._starts[:, None] + steps, n)
        self._rows_dev: torch.Tensor | None = None
        if device is not None and device.type == "cuda" and n:
            self._rows_dev = torch.from_numpy(self._rows).to(device)
            self._sims_dev = torch.full((n + 1,), -torch.inf, device=device)
            self._sims_host = torch.full((n + 1,), -torch.inf, pin_memory=True)
            self._sims_ready = torch.cuda.Event()
            torch.cuda.current_stream(device).synchronize()  # ready for calls on any stream
        self._queued = False
        self._allowed = np.ones(len(self._ids), dtype=bool)  # per episode (in _ids order): searched
        self.reset()

    def restrict(self, episodes: Iterable[int] | None, *, keep_alignment: bool = False) -> None:
        """Search only these library episodes (None: all of them); alignment and fallback start over (a
        new task), or with `keep_alignment` stay as they are (an episode left out mid-episode: the others'
        alignments hold, found in review). A mask over the rows already held, so changing it costs nothing
        like a rebuild (at 64 episodes on a GPU, ~47 MB of rows to upload)."""
        allowed = None if episodes is None else set(episodes)
        self._allowed = np.array([allowed is None or int(i) in allowed for i in self._ids], dtype=bool)
        if not keep_alignment:
            self.reset()

    @property
    def episodes(self) -> int:
        """How many episodes this retriever searches."""
        return int(self._allowed.sum())

    @property
    def on_device(self) -> bool:
        """Whether similarities are computed on the GPU (`queue`, then `query()`)."""
        return self._rows_dev is not None

    def reset(self) -> None:
        """A new episode on the cell: forget alignments, leave fallback."""
        self.positions: dict[int, int] = {}
        self._aligned: np.ndarray | None = None  # per episode (in _ids order), its aligned position
        self.fallback = False
        self.last_similarity = 0.0  # best similarity of the latest query (0.0 with no episodes)
        self._queued = False

    def queue(self, descriptor: torch.Tensor) -> None:
        """Start the similarities of `descriptor` (cameras, dim), on the GPU, against every library call:
        queued on the current stream and copied back to pinned memory. The next `query()` (no argument)
        waits for them and picks from them."""
        if self._rows_dev is None:
            raise RuntimeError(
                "this retriever computes similarities on the host (built without a CUDA device)"
            )
        q = descriptor.reshape(-1).float()
        q = q * torch.rsqrt((q * q).sum().clamp_min(1e-24))
        torch.mv(self._rows_dev, q, out=self._sims_dev[:-1])
        self._sims_host.copy_(self._sims_dev, non_blocking=True)
        self._sims_ready.record()
        self._queued = True

    def _similarities(self, descriptor: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
        """Cosine similarities at `rows` (indices into the library's calls; len(self._rows) = -inf)."""
        if descriptor is None:
            if not self._queued:
                raise RuntimeError("query() without a descriptor needs similarities queued by queue()")
            self._queued = False
            self._sims_ready.synchronize()
            return self._sims_host.numpy()[rows]
        q = np.asarray(descriptor, dtype=np.float32).reshape(-1)
        q = q / max(float(np.sqrt(q @ q)), 1e-12)
        if rows is self._whole:  # every row: one matrix-vector product, no gathered copy of the library
            return np.append(self._rows @ q, np.float32(-np.inf))[rows]
        # Aligned: each episode's rows are one contiguous block, read in place (a gathered copy of them
        # measured 2-5x slower on the host).
        out = np.full(rows.shape, -np.inf, dtype=np.float32)
        counts = (rows < len(self._rows)).sum(axis=1)
        for k, (first, count) in enumerate(zip(rows[:, 0].tolist(), counts.tolist(), strict=True)):
            out[k, :count] = self._rows[first : first + count] @ q
        return out

    def query(self, descriptor: np.ndarray | None = None) -> list[Match]:
        """descriptor (cameras, dim) -> up to top_k matches, best first; [] means run dense. None: use the
        similarities started by `queue` for this call's descriptor.

        On the call's critical path with matching on the host (between vision and the cached stages). A
        query reads each episode's lookahead rows only; a fallback call reads the whole library (then the
        runtime queues the dense stages first)."""
        if not self._allowed.any():
            if self._queued:  # similarities were queued for this call: collect them all the same
                self._similarities(None, self._whole)
            self.last_similarity = 0.0
            return []
        if self.fallback:  # still report how far the scene is from the repertoire
            sims = _nan_never_wins(self._similarities(descriptor, self._whole))
            self.last_similarity = float(sims[self._allowed].max())
            return []
        # The aligned position and the next `lookahead`, within the episode. An episode's first call
        # searches its start, 0 to lookahead (DESIGN §4; the window's start entries, which the GPU's match
        # picks from): searched whole, a task that ends where it began matched its first call to the
        # reference's end, and alignment, which only moves forward, stayed there (found in review).
        aligned = self._aligned if self._aligned is not None else np.zeros(len(self._lengths), np.int64)
        ahead = aligned[:, None] + np.arange(self.cfg.lookahead + 1)
        rows = np.where(ahead < self._lengths[:, None], self._starts[:, None] + ahead, len(self._rows))
        sims = _nan_never_wins(self._similarities(descriptor, rows))
        sims[~self._allowed] = -np.inf  # episodes outside the search never win
        best = sims.argmax(axis=1)  # the first of equal maxima, as before
        best_sims = sims[np.arange(len(best)), best]
        positions = aligned + best
        order = np.lexsort((self._ids, -best_sims))  # by similarity, ties by episode id
        order = order[self._allowed[order]]  # the episodes searched (some are, checked above)
        # a NaN live descriptor reports NaN, also beside other tasks' episodes (their -inf came first)
        self.last_similarity = float(best_sims[order[0]])
        if not reaches(self.last_similarity, self.cfg.threshold):  # NaN too (a NaN descriptor): dense
            self.fallback = True  # sticky: the scene left the repertoire for this episode
            return []
        self._aligned = positions  # every episode stays aligned
        searched = np.flatnonzero(self._allowed)
        self.positions = dict(zip(self._ids[searched].tolist(), positions[searched].tolist(), strict=True))
        return [
            Match(int(self._ids[k]), int(positions[k]), float(best_sims[k])) for k in order[: self.cfg.top_k]
        ]


def reaches(similarity: float, threshold: float) -> bool:
    """Whether a similarity (computed in float32) is at or above the threshold, compared in float32: a
    cosine of exactly 0.7 is 0.699999988 in float32, below the float 0.7, and sent the episode dense for
    good while 0.8 (0.800000012) passed (found in review). False for NaN."""
    return bool(np.float32(similarity) >= np.float32(threshold))


def _nan_never_wins(sims: np.ndarray) -> np.ndarray:
    """Similarities with a library call's NaN as -inf, so that argmax does not pick it (np.argmax takes a NaN
    as the maximum, and that episode's good matches were hidden; found in review), as the GPU's pick ranks
    NaN last. All NaN (a NaN live descriptor) stays NaN: the call falls back and reports it; -inf entries
    (positions past an episode's end) do not count (found in review: they made it -inf)."""
    nan = np.isnan(sims)
    if nan.any() and not (nan | np.isneginf(sims)).all():
        return np.where(nan, np.float32(-np.inf), sims)
    return sims
