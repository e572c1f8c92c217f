"""Prompt chunks sized so that running streams keep an inter-token latency target (`itl_target_ms`).

Dynamic SplitFuse fills each step's token budget with prompt chunks behind the decode tokens. On a GPU such a step
costs little more than a decode step; on two CPU cores a budget of 256-512 prompt tokens is a 200-400 ms step, and
every running stream waits that long for its next token. With a target, the engine sizes the prompt tokens of a
step that carries decode tokens so that no stream's inter-token latency — its gaps' exponential moving average
over `SPAN` tokens, bias-corrected as FastGen's SLA (and pandas' `ewm(span=16, adjust=True)`) computes it —
exceeds the target after the step. A stream that has just begun has only its first gaps in that average, so
the chunks beside it are short until its average has room; one whose recent gaps were short lets a long chunk
through at once. (Holding prompts back until 32 tokens fit, so that fewer and larger chunks run, was tried: in a
simulation of this scheduler on the step costs of a 2-core CPU, `bench/pacing_sim.py`, it reached first tokens
later: 30-31% against 38-42% of W64-like requests within FastGen's SLA at 1 request/s.)

The step's time is predicted from the steps this engine ran: mean time per step by its row count (prompt tokens
plus decode tokens, in power-of-two bins), interpolated between the bins seen. Before a bin is seen, its time is
extrapolated from the largest one seen (or taken as 0 when none is: the first steps learn). A prompt waits while
the streams have no room; streams end, so it is not starved forever, but a machine too slow for the target at its
load runs decode-only steps and queues prompts (what the target asks for: running streams first).

Pure Python, tested without a model.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mii.engine.scheduler import ScheduledBatch, Scheduler

SPAN = 16
"""Tokens in the latency average: FastGen's SLA (its blog's benchmark) takes an EMA of span 16."""
ALPHA = 2 / (SPAN + 1)
DECAY = 1 - ALPHA
SIGMAS = 3.0
"""A step is planned to fill the share of the streams' room that leaves this many standard deviations of the
recent error of the time predictions (steps vary: other processes share the cores)."""
ERROR_WEIGHT = 0.05
"""Weight of a step in the error's moving mean and spread (~20 steps)."""
COST_WEIGHT = 0.25
"""Weight of a new step's time in its bin's mean: a few steps follow a change of the machine's pace."""


class StreamGaps:
    """One stream's bias-corrected EMA of its gaps between tokens (seconds): `sum / weight` after each gap."""
    __slots__ = ("last", "sum", "weight")

    def __init__(self, now: float):
        self.last = now
        self.sum = 0.0
        self.weight = 0.0

    def add(self, now: float) -> None:
        self.sum = DECAY * self.sum + (now - self.last)
        self.weight = DECAY * self.weight + 1.0
        self.last = now

    @property
    def mean(self) -> float:
        return self.sum / self.weight if self.weight else 0.0

    def longest_gap(self, target: float) -> float:
        """Longest next gap that keeps the average within `target`."""
        return target * (DECAY * self.weight + 1.0) - DECAY * self.sum


class StepCosts:
    """Mean time of a step by its rows, in power-of-two bins of rows, learned from the steps run."""

    def __init__(self):
        self.bins: dict[int, list[float]] = {}  # bin -> [mean rows, mean seconds]

    def record(self, rows: int, seconds: float) -> None:
        b = self.bins.get(rows.bit_length())
        if b is None:
            self.bins[rows.bit_length()] = [float(rows), seconds]
        else:
            b[0] += COST_WEIGHT * (rows - b[0])
            b[1] += COST_WEIGHT * (seconds - b[1])

    def points(self) -> list[tuple[float, float]]:
        """(rows, seconds) of the bins seen, by rows, the times made non-decreasing."""
        pts, most = [], 0.0
        for _, (rows, t) in sorted(self.bins.items()):
            most = max(most, t)
            pts.append((rows, most))
        return pts

    @staticmethod
    def predict(points: list[tuple[float, float]], rows: int) -> float:
        if not points:
            return 0.0
        i = bisect.bisect_left(points, (rows, -1.0))
        if i == 0:
            return points[0][1]
        if i == len(points):
            r, t = points[-1]
            return t * rows / r
        (r0, t0), (r1, t1) = points[i - 1], points[i]
        return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)

    def most_rows(self, base: int, limit: int, seconds: float) -> int:
        """Most extra rows (0..limit) that a step of `base` rows can take within `seconds`."""
        pts = self.points()
        if self.predict(pts, base + limit) <= seconds:
            return limit
        lo, hi = 0, limit  # predict(base + lo) fits or lo == 0; predict(base + hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.predict(pts, base + mid) <= seconds:
                lo = mid
            else:
                hi = mid
        return lo


class Pacer:
    """The engine's side of `itl_target_ms`: what a step's prompt chunks may add, and what each step taught."""

    def __init__(self, target_ms: float):
        self.target = target_ms / 1000
        self.costs = StepCosts()
        self.gaps: dict[int, StreamGaps] = {}  # seq uid -> its gaps, from its first token on
        self.ratio, self.ratio_sq = 1.0, 1.01  # moving means of a step's time / its prediction and of its square
        # (a spread of 0.1 until steps are seen: a share of 0.77)

    def schedule(self, scheduler: Scheduler, now: float) -> ScheduledBatch:
        """The scheduler's next step, its prompt tokens capped where it carries decode tokens and prompts wait."""
        cap = None
        if scheduler.has_prompts():
            decoding = scheduler.decoding()
            if decoding:
                cap = self.prompt_cap(decoding, scheduler.max_batch_tokens - len(decoding), now)
        return scheduler.schedule(cap)

    def stepped(self, batch: ScheduledBatch, started: float, now: float) -> None:
        """After `batch` ran from `started` to `now`: its time, its streams' gaps; a preempted sequence starts again as
        a new stream once recomputed."""
        for seq in batch.preempted:
            self.forget(seq.uid)
        self.observe(batch.num_tokens, [c.seq.uid for c in batch.chunks if c.samples], started, now)

    def prompt_cap(self, decoding: list, budget: int, now: float) -> int | None:
        """Prompt tokens (0..budget) the next step may carry beside the decode tokens of `decoding` (None: no cap)."""
        room, lost = None, 2 * self.target
        for seq in decoding:
            g = self.gaps.get(seq.uid)
            if g is not None and g.mean <= lost:  # a stream twice over the target is not held for
                r = g.longest_gap(self.target) - (now - g.last)
                room = r if room is None or r < room else room
        if room is None:
            return None
        return self.costs.most_rows(len(decoding), budget, self.share() * room)

    def share(self) -> float:
        """Share of the room a step is planned to fill: 1 / (mean + SIGMAS x spread) of the steps' time over their
        prediction, between 0.5 and 1."""
        spread = max(self.ratio_sq - self.ratio * self.ratio, 0.0) ** 0.5
        return min(max(1.0 / (self.ratio + SIGMAS * spread), 0.5), 1.0)

    def observe(self, rows: int, sampled_uids, started: float, now: float) -> None:
        """After a step of `rows` rows begun at `started`: its time (and how far it was from its prediction), and a
        gap for each sequence that got a token."""
        took = now - started
        predicted = self.costs.predict(self.costs.points(), rows)
        if predicted > 0:
            r = took / predicted
            self.ratio += ERROR_WEIGHT * (r - self.ratio)
            self.ratio_sq += ERROR_WEIGHT * (r * r - self.ratio_sq)
        self.costs.record(rows, took)
        gaps = self.gaps
        for uid in sampled_uids:
            g = gaps.get(uid)
            if g is None:
                gaps[uid] = StreamGaps(now)
            else:
                g.add(now)

    def forget(self, uid: int) -> None:
        self.gaps.pop(uid, None)
