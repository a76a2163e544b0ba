"""Membership of a process group with bounded waits: the ranks agree on their inputs before joining, join only
once all have arrived, and name the rank that left when a collective fails (docs/design.md, "Runtime").

Legend: ``W`` ranks.

Every rank holds a client of the group's key-value store (torchrun's agent store, which outlives any one rank,
or the store rank 0 hosts under a plain ``env://`` launch) and uses it for three things, each bounded by the
timeout (:func:`dist_timeout`: the ``MOEBALANCE_DIST_TIMEOUT`` environment variable, in seconds, default
:data:`DEFAULT_TIMEOUT`):

- **agreement** (:meth:`Membership.agree`): each rank posts "ok" or its error (class code and one line,
  :mod:`moebalance.runtime.errors`) and waits for every rank's post; then every rank raises the lowest failing
  rank's error, or, if a rank posted nothing in time, a :class:`GroupError` naming it. A rank given a bad plan
  thus fails every rank with the same line before any of them waits in ``init_process_group``.
- **heartbeat** (:meth:`Membership.start_heartbeat`): a thread adds 1 to the rank's counter every
  :data:`BEAT_SECONDS`.
- **diagnosis** (:meth:`Membership.explain`): when a collective fails (gloo's "Connection reset by peer", a
  timeout), the rank reads every counter, waits :data:`STALL_SECONDS` and reads them again: a rank whose
  counter stood still and that posted no exit record left the group (killed, crashed); one that posted an
  error of its own is named with it. The first survivor's one-line verdict is kept in the store
  (compare-and-set), so every survivor raises the same :class:`GroupError`.

On NCCL a dead peer is not seen as a reset connection: the collective waits out the timeout, and NCCL's
watchdog then ends the process.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
import traceback
from typing import Any

from moebalance.core.errors import InputError, MoebalanceError
from moebalance.runtime.errors import GroupError, agreed_message, error_code, one_line, raise_coded

__all__ = ["BEAT_SECONDS", "DEFAULT_TIMEOUT", "STALL_SECONDS", "TIMEOUT_ENV", "Membership", "collective_name",
           "dist_timeout", "failure_reason", "is_comm_failure"]

#: The environment variable that sets every wait of the group, in seconds.
TIMEOUT_ENV = "MOEBALANCE_DIST_TIMEOUT"
#: Seconds a rank waits for the others to arrive, and a collective for its peers, unless told otherwise.
DEFAULT_TIMEOUT = 60.0
#: Seconds between two heartbeats of a rank, and how long a diagnosis watches the counters.
BEAT_SECONDS = 0.5
STALL_SECONDS = 2.5


def dist_timeout(timeout: float | None = None) -> float:
    """``timeout`` if given, else ``$MOEBALANCE_DIST_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`; checked positive."""
    what = "timeout"
    value: Any = timeout
    if value is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT
        what = f"{TIMEOUT_ENV}={raw!r}"
        try:
            value = float(raw)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise InputError(f"{what} must be a positive number of seconds, e.g. {TIMEOUT_ENV}=120")
    return float(value)


def _module(filename: str) -> str:
    path = filename.replace("\\", "/")
    return "moebalance." + path.rsplit("/moebalance/", 1)[1].removesuffix(".py").replace("/", ".")


def collective_name(exc: BaseException) -> str:
    """Which collective ``exc`` came from, from its traceback: torch's function and the moebalance function that
    called it, e.g. ``all_gather in moebalance.runtime.agree.agreed_gather``."""
    frames = traceback.extract_tb(exc.__traceback__)
    c10d = next((i for i, f in enumerate(frames) if f.filename.replace("\\", "/").endswith(
        "torch/distributed/distributed_c10d.py")), len(frames))
    ours = [f for f in frames[:c10d] if "/moebalance/" in f.filename.replace("\\", "/")]
    caller = f"{_module(ours[-1].filename)}.{ours[-1].name}" if ours else None
    if c10d < len(frames):
        return frames[c10d].name + (f" in {caller}" if caller else "")
    return caller or "a collective"


def failure_reason(exc: BaseException) -> str:
    """What went wrong with the connection, in a few words (``connection reset by peer``, ``timed out``, ...)."""
    text = " ".join(str(exc).split())
    low = text.lower()
    for needle in ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused"):
        if needle in low:
            return needle
    if "timed out" in low or "timeout" in low:
        return "timed out"
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[path/pair.cc:537] " prefix
    return text.split(". ")[0][:100] or type(exc).__name__


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective or store operation (not a user error or a bug of this rank)."""
    import torch.distributed as dist

    if isinstance(exc, MoebalanceError) or not isinstance(exc, RuntimeError):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if any(f.filename.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py")
           for f in traceback.extract_tb(exc.__traceback__)):
        return True
    low = str(exc).lower()
    return any(w in low for w in ("gloo", "nccl", "connection", "timed out", "socket", "broken pipe"))


class Membership:
    """This process's place in a group: its rank, the group's store and the waits bound (module doc).

    ``store`` is a ``torch.distributed.Store`` every rank reaches; ``hosts_store``: this process hosts it
    (rank 0 under a plain ``env://`` launch), so it stays until the others have read an agreed error;
    ``store_owner`` names who hosts it in a message.
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float, *, hosts_store: bool = False,
                 store_owner: str = "rank 0", prefix: str = "moebalance") -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = dist_timeout(timeout)
        self.hosts_store = hosts_store
        self.store_owner = store_owner
        self.prefix = prefix
        self._rounds = 0
        #: Joins of the group so far (:meth:`start_heartbeat`): the heartbeat, exit records and verdict of each
        #: join have keys of their own, so a process that joins again never reads its last join's records.
        self._joins = 0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _key(self, *parts: object) -> str:
        return "/".join((self.prefix, *map(str, parts)))

    def _joined(self, *parts: object) -> str:
        """A key of the current join (heartbeats, exit records, the verdict)."""
        return self._key("join", self._joins, *parts)

    def _missing(self, keys: list[str]) -> list[int]:
        """Wait (bounded) for every key; the ranks whose key did not come. Polls: a store's own timed-out wait
        prints warnings of its own."""
        deadline = time.monotonic() + self.timeout
        pause = 0.01
        while not self.store.check(keys):
            if time.monotonic() >= deadline:
                return [r for r, k in enumerate(keys) if not self.store.check([k])]
            time.sleep(pause)
            pause = min(2 * pause, 0.2)
        return []

    def _late(self, missing: list[int], what: str) -> str:
        s = "s" if len(missing) > 1 else ""
        return (f"rank{s} {', '.join(map(str, missing))} did not arrive within {self.timeout:g} s to {what} (it did "
                f"not start, or stopped before: see its launcher's log; {TIMEOUT_ENV} sets the wait in seconds)")

    def agree(self, error: BaseException | None, what: str) -> None:
        """Post this rank's ``error`` (or none), wait for every rank's, and raise the agreed error if any rank
        failed or did not come; the same on every rank that came. ``what`` names the step in a message."""
        n = self._rounds
        self._rounds += 1
        keys = [self._key("check", n, r) for r in range(self.world_size)]
        mine = "0" if error is None else f"{error_code(error)}\n{one_line(error)}"
        try:
            self.store.set(keys[self.rank], mine)
            missing = self._missing(keys)
            posts = {r: self.store.get(keys[r]).decode("utf-8", "replace")
                     for r in range(self.world_size) if r not in missing}
        except Exception as exc:
            raise GroupError(f"the group's store is unreachable ({failure_reason(exc)}) while waiting to {what}: "
                             f"{self.store_owner}, which hosts it, has stopped; see its log") from exc
        failed = {r: p.split("\n", 1) for r, p in posts.items() if p != "0"}
        if not (failed or missing):
            return
        self._let_others_read(n, len(posts))
        if failed:
            first = min(failed)
            text = agreed_message({r: f[1] for r, f in failed.items()})
            if missing:
                text += f"; and {self._late(missing, what)}"
            raise_coded(int(failed[first][0]), text, error if self.rank == first else None)
        raise GroupError(self._late(missing, what))

    def _let_others_read(self, n: int, present: int) -> None:
        """Count this rank as having read round ``n``; the store's host waits (briefly) for the others."""
        try:
            key = self._key("read", n)
            self.store.add(key, 1)
            deadline = time.monotonic() + min(self.timeout, 10.0)
            while self.hosts_store and self.store.add(key, 0) < present and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:
            pass  # the readers' problem now: they fail on the store in their own agree

    def next_join(self) -> Any:
        """Begin a new join of the group (every rank alike, once per ``init_process_group``): its heartbeats, exit
        records and verdict get keys of their own, so a process that joins again never reads its last join's
        (a heartbeat still running from it is stopped). Returns the store the process group is to use: the
        group's store under a prefix of this join, so that torch's own keys are fresh too."""
        import torch.distributed as dist

        if self._beat is not None:
            self._stop.set()
            self._beat.join(timeout=2 * BEAT_SECONDS)
            self._beat = None
        self._joins += 1
        return dist.PrefixStore(self._joined("group"), self.store)

    def start_heartbeat(self) -> None:
        """Start adding 1 to this rank's counter of the current join (:meth:`next_join`) every
        :data:`BEAT_SECONDS` (a daemon thread, own connection)."""
        if self._beat is not None and self._beat.is_alive():
            return
        self._stop = threading.Event()
        stop = self._stop
        try:
            store = self.store.clone()
        except Exception:  # a store without clone(): share it (its operations are serialised)
            store = self.store
        key = self._joined("beat", self.rank)

        def beat() -> None:
            try:
                while True:
                    store.add(key, 1)
                    if stop.wait(BEAT_SECONDS):
                        return
            except Exception:
                return  # the store is gone; a diagnosis will say so

        self._beat = threading.Thread(target=beat, name="moebalance-heartbeat", daemon=True)
        self._beat.start()

    @property
    def beating(self) -> bool:
        """Whether this rank's heartbeat runs (every rank's does once it joined by
        :func:`moebalance.runtime.init_from_env`), so that a diagnosis can tell who stopped."""
        return self._beat is not None and self._beat.is_alive()

    def leave(self, record: str = "done") -> None:
        """Post this rank's exit record (``done``, ``survivor``, or ``error:<line>``) and stop its heartbeat."""
        try:
            self.store.set(self._joined("exit", self.rank), record)
        except Exception:
            pass  # the store's host has gone already: nobody is left to read it
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=2 * BEAT_SECONDS)

    def _verdict(self) -> str | None:
        key = self._joined("verdict")
        return self.store.get(key).decode("utf-8", "replace") if self.store.check([key]) else None

    def _beats(self) -> list[int]:
        return [int(self.store.add(self._joined("beat", r), 0)) for r in range(self.world_size)]

    def _blame(self, stalled: list[int], where: str, why: str) -> str | None:
        """The verdict on the ranks whose heartbeat stopped, or ``None`` if none is to blame."""
        records = {r: self.store.get(self._joined("exit", r)).decode("utf-8", "replace")
                   if self.store.check([self._joined("exit", r)]) else None for r in stalled}
        left = [r for r in stalled if records[r] is None]
        if left:
            s, its = ("s", "their") if len(left) > 1 else ("", "its")
            return (f"rank{s} {', '.join(map(str, left))} left the group during {where} ({why}): stopped without a "
                    f"word (killed, or crashed); see {its} launcher's log")
        for r in stalled:
            rec = records[r] or ""
            if rec.startswith("error:"):
                return f"rank {r} stopped on an error of its own during {where}: {rec[6:]}"
            if rec == "done":
                return (f"rank {r} finished while rank {self.rank} waited in {where} ({why}): the ranks made "
                        "different collective calls")
        return None

    def explain(self, exc: BaseException) -> GroupError:
        """The one-line error for a collective that failed with ``exc`` (module doc, "diagnosis"); this rank
        then leaves the group (its heartbeat stops)."""
        where, why = collective_name(exc), failure_reason(exc)
        verdict: str | None = None
        try:
            self.store.set(self._joined("exit", self.rank), "survivor")  # alive, giving up: not a cause
            verdict = self._verdict()
            if verdict is None:
                before = self._beats()
                deadline = time.monotonic() + STALL_SECONDS
                while verdict is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                    verdict = self._verdict()
                if verdict is None:
                    after = self._beats()
                    stalled = [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]
                    text = self._blame(stalled, where, why)
                    if text is not None:
                        verdict = self.store.compare_set(self._joined("verdict"), "", text).decode("utf-8", "replace")
        except Exception as err:
            verdict = (f"{where} failed ({why}) and the group's store is unreachable too ({failure_reason(err)}): "
                       f"{self.store_owner}, which hosts it, has stopped; see its log")
        finally:
            self.leave("survivor")
        if verdict is None:
            verdict = (f"{where} failed on rank {self.rank} ({why}) while every rank was still running: a rank is "
                       f"stuck or slower than the {self.timeout:g} s timeout ({TIMEOUT_ENV} sets it in seconds)")
        return GroupError(verdict)
