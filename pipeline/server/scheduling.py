"""Which batch runs next, and which running batch gives its slot up: the order the engines are shared in between
keys. Pure functions of the queue and what runs (no threads, no store, no clock): server/runner.py calls them
under its lock.

- Between keys, a free slot goes to the key with the fewest batches running, then to the key whose last turn began
  longest ago (a key never served yet first), then to the key that has waited longest. A key at its
  max_running_batches gets none.
- Within a key: the batch whose completion window ends first (`expires_at`), then the one queued first.
- Turns: with no slot free, a key waiting behind a key that runs more batches than it does takes a slot from
  that key once one of its running batches has had its turn — `fair_share_seconds` × the key's weight — and
  finished rows in it. That batch yields: the runner pauses it as the night window does (its rows stay on disk)
  and queues it again; it resumes from its checkpoint at its key's next turn. Rows in every turn: two keys cannot
  pause each other forever before either gets anything done.

With the default `max_concurrent_batches: 1` this is round-robin between the keys with batches waiting, one turn
each; weights make a key's turns longer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Waiting:
    """A queued batch: never started, or paused (by a turn's end or the window) and to be resumed."""

    batch_id: str
    owner: str
    expires_at: int | None
    arrival: int  # its place in the queue: smaller has waited longer


@dataclass(frozen=True)
class Running:
    """A running batch's turn."""

    batch_id: str
    owner: str
    started: (
        float  # when this turn's work began: its first new rows (a job's own start is not its key's time)
    )
    can_yield: bool  # rows finished in this turn, and not finalizing (a batch about to commit is let finish)
    yielding: bool = False  # already told to yield: its slot frees once its job has stopped


# owner -> a limit (None: none)
Limit = Callable[[str], "int | None"]


def _owner_order(
    owners: set[str], running: Counter, last_turn: Mapping[str, float], waited: Mapping[str, int]
) -> list[str]:
    return sorted(owners, key=lambda o: (running[o], last_turn.get(o, float("-inf")), waited[o]))


def _eligible(waiting: Sequence[Waiting], running: Counter, max_running: Limit) -> list[Waiting]:
    def room(owner: str) -> bool:
        limit = max_running(owner)
        return limit is None or running[owner] < limit

    return [w for w in waiting if room(w.owner)]


def _first_of(waiting: Sequence[Waiting], owner: str) -> Waiting:
    mine = [w for w in waiting if w.owner == owner]
    return min(mine, key=lambda w: (w.expires_at is None, w.expires_at or 0, w.arrival))


def _longest_waited(waiting: Sequence[Waiting]) -> dict[str, int]:
    waited: dict[str, int] = {}
    for w in waiting:
        waited[w.owner] = min(waited.get(w.owner, w.arrival), w.arrival)
    return waited


def pick(
    waiting: Sequence[Waiting],
    running: Sequence[Running],
    slots: int,
    last_turn: Mapping[str, float],
    max_running: Limit = lambda _: None,
) -> Waiting | None:
    """The batch to start in a free slot, or None (no slot free, or nothing that may start)."""
    if len(running) >= slots:
        return None
    busy = Counter(r.owner for r in running)
    candidates = _eligible(waiting, busy, max_running)
    if not candidates:
        return None
    owner = _owner_order({w.owner for w in candidates}, busy, last_turn, _longest_waited(candidates))[0]
    return _first_of(candidates, owner)


def to_yield(
    waiting: Sequence[Waiting],
    running: Sequence[Running],
    slots: int,
    last_turn: Mapping[str, float],
    turn_seconds: Callable[[str], float],
    now: float,
    max_running: Limit = lambda _: None,
) -> list[str]:
    """The running batches that should give their slots up now, so that waiting keys get their turns.
    `turn_seconds(owner)`: how long a turn of that key lasts (<= 0: its batches never yield)."""
    holding = [r for r in running if not r.yielding]
    busy = Counter(r.owner for r in holding)
    free = slots - len(holding)  # free now, or once the batches already yielding have stopped
    waited = _longest_waited(waiting)
    out: list[str] = []
    pending = {w.owner for w in _eligible(waiting, busy, max_running)}
    while pending:
        owner = _owner_order(pending, busy, last_turn, waited)[0]
        pending.discard(owner)
        if free > 0:
            free -= 1
            busy[owner] += 1
            continue
        due = [
            r
            for r in holding
            if r.batch_id not in out
            and r.owner != owner
            and busy[r.owner] > busy[owner]
            and r.can_yield
            and turn_seconds(r.owner) > 0
            and now - r.started >= turn_seconds(r.owner)
        ]
        if due:
            # From the key running the most, its batch that has run longest.
            victim = max(due, key=lambda r: (busy[r.owner], now - r.started))
            out.append(victim.batch_id)
            busy[victim.owner] -= 1
            busy[owner] += 1
    return out
