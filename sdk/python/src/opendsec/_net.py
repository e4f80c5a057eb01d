"""Addresses, channels and the retry policy.

* :class:`AddressPool`: round-robin over the apiserver addresses; an address whose call failed
  at the transport (UNAVAILABLE without an opendsec ErrorInfo: refused, reset, unreachable) is
  avoided for ``avoid_s`` seconds. When every address is being avoided the one whose avoidance
  ends first is used, so a call is always attempted.
* :class:`Backoff`: exponential backoff with jitter, bounded by a total ``retry_timeout``.

Which calls are retried is decided by the caller (client.py): only calls that are safe to
repeat (reads; creations with a lease id; exec with a request id; whole-file writes).
"""

from __future__ import annotations

import os
import random
import time
from typing import Callable, Iterable, List, Optional, Sequence

DEFAULT_RETRY_TIMEOUT_S = 30.0
DEFAULT_AVOID_S = 10.0


def parse_addresses(value: Optional[Iterable[str] | str]) -> List[str]:
    """Splits ``"a:1, b:2"`` (or a list) into addresses; falls back to ``$OPENDSEC_ADDR``."""
    if value is None:
        value = os.environ.get("OPENDSEC_ADDR", "")
    if isinstance(value, str):
        items: Sequence[str] = value.split(",")
    else:
        items = list(value)
    out = []
    for a in items:
        a = a.strip()
        for prefix in ("http://", "grpc://"):
            if a.startswith(prefix):
                a = a[len(prefix):]
        a = a.rstrip("/")
        if a:
            out.append(a)
    return out


class AddressPool:
    """Round-robin over addresses, avoiding recently broken ones."""

    def __init__(
        self,
        addresses: Sequence[str],
        avoid_s: float = DEFAULT_AVOID_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not addresses:
            raise ValueError("no apiserver address: pass addresses= or set OPENDSEC_ADDR")
        self.addresses = list(addresses)
        self.avoid_s = avoid_s
        self._clock = clock
        self._next = 0
        self._avoid_until = {a: 0.0 for a in self.addresses}

    def pick(self) -> str:
        """The next healthy address in turn (or the least recently broken one)."""
        now = self._clock()
        n = len(self.addresses)
        for i in range(n):
            a = self.addresses[(self._next + i) % n]
            if self._avoid_until[a] <= now:
                self._next = (self._next + i + 1) % n
                return a
        return min(self.addresses, key=lambda a: self._avoid_until[a])

    def mark_broken(self, address: str) -> None:
        """Avoid ``address`` for ``avoid_s`` seconds."""
        if address in self._avoid_until:
            self._avoid_until[address] = self._clock() + self.avoid_s

    def mark_ok(self, address: str) -> None:
        """``address`` answered: stop avoiding it."""
        if address in self._avoid_until:
            self._avoid_until[address] = 0.0

    def is_avoided(self, address: str) -> bool:
        return self._avoid_until.get(address, 0.0) > self._clock()


class Backoff:
    """Exponential backoff with full jitter within a total budget.

    ``next_delay()`` returns the time to sleep before the next attempt, or ``None`` once the
    budget (``retry_timeout`` seconds since construction) would be exceeded.
    """

    def __init__(
        self,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT_S,
        base: float = 0.05,
        cap: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.deadline = clock() + retry_timeout
        self.base = base
        self.cap = cap
        self._clock = clock
        self._rand = rand
        self.attempt = 0

    def next_delay(self, hint: Optional[float] = None) -> Optional[float]:
        ceiling = min(self.cap, self.base * (2 ** self.attempt))
        self.attempt += 1
        delay = ceiling * (0.5 + 0.5 * self._rand())
        if hint is not None:
            delay = max(delay, hint)
        remaining = self.deadline - self._clock()
        if remaining <= 0:
            return None
        return min(delay, remaining)
