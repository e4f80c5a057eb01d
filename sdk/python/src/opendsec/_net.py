"""Addresses, channels and the retry policy.

* :class:`AddressPool`: round-robin over the apiserver addresses; an address whose call failed
  at the transport (UNAVAILABLE without an opendsec ErrorInfo: refused, reset, unreachable) is
  avoided for ``avoid_s`` seconds. When every address is being avoided the one whose avoidance
  ends first is used, so a call is always attempted.
* The retry policy, the same as the Rust client's (``crates/common/src/retry.rs``) and as
  ``docs/errors.md`` ("Retries") states it: :data:`CALLS` gives each call its class,
  :data:`CLASS_RETRIES` the reasons each class retries; :class:`Backoff` waits between
  attempts (full jitter, ``retry_after_ms`` honoured) within a total ``retry_timeout``.
"""

from __future__ import annotations

import os
import random
import time
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence

DEFAULT_RETRY_TIMEOUT_S = 30.0
DEFAULT_AVOID_S = 10.0

#: The reasons each class of call retries: ``read`` changes nothing; ``create`` carries a
#: lease id; a ``repeat`` call finds its own earlier effect; a ``once`` call could apply twice.
CLASS_RETRIES: Dict[str, FrozenSet[str]] = {
    "read": frozenset({"rate_limited", "not_leader", "unavailable"}),
    "create": frozenset({"rate_limited", "no_capacity", "not_leader", "unavailable", "deadline_exceeded"}),
    "repeat": frozenset({"rate_limited", "not_leader", "unavailable"}),
    "once": frozenset(),
}

#: Every public call's class. Some calls change class with the request (the callers say so):
#: an appending WriteFile and a MakeDir without parents are ``once``; an HttpRequest with GET
#: or HEAD is ``repeat``.
CALLS: Dict[str, str] = {
    "Sandboxes/CreateSandbox": "create",
    "Sandboxes/CreateSandboxes": "create",
    "Sandboxes/GetSandbox": "read",
    "Sandboxes/ListSandboxes": "read",
    "Sandboxes/StopSandbox": "repeat",
    "Sandboxes/PauseSandbox": "repeat",
    "Sandboxes/ResumeSandbox": "repeat",
    "Sandboxes/SetSandboxTimeout": "repeat",
    "Sandboxes/UpdateNetwork": "repeat",
    "Sandboxes/GetSandboxMetrics": "read",
    "Sandboxes/CreateSnapshot": "once",
    "Sandboxes/ForkSandbox": "once",
    "Sandboxes/MoveSandbox": "repeat",
    "Sandboxes/DrainEdge": "repeat",
    "Sandboxes/SaveSession": "repeat",
    "Sandboxes/CreateSandboxTokens": "repeat",
    "Admin/WhoAmI": "read",
    "Admin/CreateProject": "once",
    "Admin/GetProject": "read",
    "Admin/ListProjects": "read",
    "Admin/DeleteProject": "once",
    "Admin/SetQuota": "repeat",
    "Admin/SetEgressCeiling": "repeat",
    "Admin/CreatePrincipal": "once",
    "Admin/ListPrincipals": "read",
    "Admin/DeletePrincipal": "once",
    "Admin/CreateToken": "once",
    "Admin/ListTokens": "read",
    "Admin/RevokeToken": "repeat",
    "Admin/Grant": "repeat",
    "Admin/RevokeGrant": "once",
    "Admin/ListGrants": "read",
    "Admin/GetUsage": "read",
    "Admin/Backup": "read",
    "Admin/Restore": "once",
    "Admin/IamMembers": "read",
    "Admin/AddIamMember": "repeat",
    "Admin/RemoveIamMember": "once",
    "Admin/TransferIamLeader": "repeat",
    "Admin/CreatePool": "once",
    "Admin/UpdatePool": "repeat",
    "Admin/DeletePool": "once",
    "Admin/GetPool": "read",
    "Admin/ListPools": "read",
    "Images/RegisterImage": "once",
    "Images/ComposeImage": "once",
    "Images/DeleteImage": "once",
    "Images/ListImages": "read",
    "Images/GetImage": "read",
    "Runtime/Exec": "repeat",
    "Runtime/ExecStream": "repeat",
    "Runtime/GetOutput": "read",
    "Runtime/CloseSession": "repeat",
    "Runtime/ReadFile": "read",
    "Runtime/WriteFile": "repeat",
    "Runtime/ListDir": "read",
    "Runtime/Stat": "read",
    "Runtime/MakeDir": "repeat",
    "Runtime/Remove": "once",
    "Runtime/Move": "once",
    "Runtime/WatchDir": "read",
    "Runtime/CreateWatcher": "once",
    "Runtime/GetWatcherEvents": "once",
    "Runtime/RemoveWatcher": "repeat",
    "Runtime/HttpRequest": "once",
    "Runtime/StartProcess": "once",
    "Runtime/ConnectProcess": "read",
    "Runtime/SendInput": "once",
    "Runtime/SignalProcess": "once",
    "Runtime/ListProcesses": "read",
    "Runtime/ResizeProcess": "repeat",
    "Runtime/RunCode": "once",
    "Runtime/CreateCodeContext": "once",
    "Runtime/ListCodeContexts": "read",
    "Runtime/RestartCodeContext": "once",
    "Runtime/RemoveCodeContext": "repeat",
    "Runtime/Watch": "read",
}


def class_of(call: str) -> str:
    """The class of ``Service/Method`` (a call not in :data:`CALLS` is made once)."""
    return CALLS.get(call, "once")


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
    """The retries of one call of class ``call_class``: exponential backoff with full jitter
    within a total budget.

    ``retries(reason)`` says whether the class retries that reason; ``next_delay(hint)``
    returns the time to sleep before the next attempt (a uniform draw below a ceiling that
    starts at ``base`` and doubles up to ``cap``, at least ``hint``, cut to the budget), or
    ``None`` once the budget (``retry_timeout`` seconds since construction) is spent.
    """

    def __init__(
        self,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT_S,
        call_class: str = "read",
        base: float = 0.05,
        cap: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if call_class not in CLASS_RETRIES:
            raise ValueError(f"unknown call class {call_class!r}")
        self.call_class = call_class
        self.deadline = clock() + retry_timeout
        self.base = base
        self.cap = cap
        self._clock = clock
        self._rand = rand
        self.attempt = 0

    def retries(self, reason: str) -> bool:
        return reason in CLASS_RETRIES[self.call_class]

    def next_delay(self, hint: Optional[float] = None) -> Optional[float]:
        remaining = self.deadline - self._clock()
        if remaining <= 0:
            return None
        ceiling = min(self.cap, self.base * (2 ** min(self.attempt, 62)))
        self.attempt += 1
        delay = ceiling * self._rand()
        if hint is not None:
            delay = max(delay, hint)
        return min(delay, remaining)
