"""The async opendsec client (grpc.aio) and the :class:`Sandbox` handle.

Invariants kept here:

* Retries follow the one policy (``docs/errors.md``, "Retries"; the same tables as the Rust
  client's, in :mod:`opendsec._net`): each call's class says which reasons it retries, with
  full-jitter backoff never sooner than ``retry_after_ms``, within ``retry_timeout``. Reads
  retry ``unavailable``/``not_leader``/``rate_limited``; ``create_sandbox`` (it always
  carries a lease id, so a retry returns the sandbox the first attempt made) also
  ``no_capacity`` and ``deadline_exceeded``; ``repeat`` calls find their own earlier effect:
  ``run_shell``/``stream_shell`` (a request id: a retry re-attaches to the same command),
  stop/pause/resume (a repeat answers the state reached), whole-file writes (staged until
  ``finish``). ``create_sandboxes`` asks again, in one new batch, for the items refused with
  a ``create`` reason (a refused item made nothing); a batch whose stream breaks is not
  repeated. Appends, process starts, input and signals are never retried.
* Streams (``stream_shell``, ``connect_process``, ``read_file``) resume after a disconnect from
  the offsets already received, dropping any overlap, so nothing is lost or repeated.
* Every failed call raises a subclass of :class:`opendsec.errors.OpendsecError`.
"""

from __future__ import annotations

import asyncio
import json
import contextlib
import functools
import os
from pathlib import Path
from typing import (
    Any,
    AsyncIterator,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import grpc
from google.protobuf import json_format

from . import errors
from ._ids import check_lease_id, check_request_id, new_lease_id, new_request_id
from ._net import CLASS_RETRIES, DEFAULT_AVOID_S, DEFAULT_RETRY_TIMEOUT_S, AddressPool, Backoff, class_of, parse_addresses
from ._pb import opendsec_pb2 as pb
from ._pb import opendsec_pb2_grpc as pb_grpc
from ._pb import runtime_pb2 as rt
from ._pb import runtime_pb2_grpc as rt_grpc
from .types import FileEntry, OutputChunk, ProcessExit, ProcessInfo, ShellExit, ShellResult

MAX_MESSAGE_BYTES = 80 * 1024 * 1024
WRITE_CHUNK_BYTES = 1024 * 1024
#: A quota: ``{"sandboxes": 100, "cpu_millis": 64000, ...}`` or a ``pb.Quota``.
QuotaLike = Union[Mapping[str, int], Any]

_QUOTA_KEYS = ("cpu_millis", "memory_mb", "disk_mb", "gpus", "sandboxes", "store_bytes")


def _quota(q: QuotaLike) -> Any:
    """A ``pb.Quota`` from a mapping (unknown keys: ``ValueError``) or a ``pb.Quota``."""
    if isinstance(q, Mapping):
        unknown = set(q) - set(_QUOTA_KEYS)
        if unknown:
            raise ValueError(f"unknown quota keys {sorted(unknown)}; known: {', '.join(_QUOTA_KEYS)}")
        return pb.Quota(**{k: int(v) for k, v in q.items()})
    return q


# The same defaults as `opendsecctl sandbox create`.
DEFAULT_IMAGE = "scratch"
DEFAULT_CPU_MILLIS = 1000
DEFAULT_MEMORY_MB = 1024
DEFAULT_DISK_MB = 10240

_STATE_NAMES = {v: k[len("SANDBOX_STATE_"):].lower() for k, v in pb.SandboxState.items()}
_FILE_TYPES = {v: k[len("FILE_TYPE_"):].lower() for k, v in rt.FileType.items()}
_STREAMS = {rt.OUTPUT_STREAM_STDOUT: "stdout", rt.OUTPUT_STREAM_STDERR: "stderr"}

StateLike = Union[str, int]
ProcessRef = Union[int, str]


def state_name(state: int) -> str:
    """``SANDBOX_STATE_RUNNING`` -> ``"running"``."""
    return _STATE_NAMES.get(state, "unspecified")


def state_value(state: StateLike) -> int:
    """``"running"`` (or ``"SANDBOX_STATE_RUNNING"``, or the number) -> the enum value."""
    if isinstance(state, int):
        return state
    name = state.upper()
    if not name.startswith("SANDBOX_STATE_"):
        name = "SANDBOX_STATE_" + name
    return pb.SandboxState.Value(name)


def _selector(process: ProcessRef) -> rt.ProcessSelector:
    if isinstance(process, int):
        return rt.ProcessSelector(pid=process)
    return rt.ProcessSelector(tag=process)


def _fresh(have: int, start: int, data: bytes) -> bytes:
    """The part of ``data`` (at ``start`` in its stream) past the ``have`` bytes already
    delivered: what a re-attached stream sends again is dropped."""
    return data[max(0, have - start):]


class _Offsets:
    """Per-stream offsets received so far; trims overlap after a re-attach."""

    def __init__(self) -> None:
        self.pos = {"stdout": 0, "stderr": 0}

    def accept(self, out: rt.OutputData) -> Optional[OutputChunk]:
        name = _STREAMS.get(out.stream, "stdout")
        have = self.pos[name]
        data = _fresh(have, out.offset, bytes(out.data))
        if not data:
            return None  # already delivered before the disconnect
        start = max(have, out.offset)
        self.pos[name] = start + len(data)
        return OutputChunk(name, start, data)


#: The name an apiserver's certificate carries, checked whatever address is dialled.
PUBLIC_TLS_NAME = "api.opendsec.internal"


def _truthy(v: Optional[str]) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes")


def _tls_settings(
    ca: Optional[Union[str, "os.PathLike[str]"]], tls_name: Optional[str], insecure_plaintext: Optional[bool]
) -> Tuple[Optional[str], str, bool]:
    """(CA path or None, TLS name, plain text) from the arguments, else the environment.

    An argument given wins over the environment; a CA and plain text together are refused,
    and so is neither (a token is never sent in the clear by default)."""
    if ca is not None and insecure_plaintext:
        raise ValueError("give either ca= or insecure_plaintext=True, not both")
    if ca is None and insecure_plaintext is None:
        env_ca = os.environ.get("OPENDSEC_CA") or None
        env_plain = _truthy(os.environ.get("OPENDSEC_INSECURE_PLAINTEXT"))
        if env_ca and env_plain:
            raise ValueError("OPENDSEC_CA and OPENDSEC_INSECURE_PLAINTEXT are both set: keep one")
        ca, insecure_plaintext = env_ca, env_plain
    name = tls_name or os.environ.get("OPENDSEC_TLS_NAME") or PUBLIC_TLS_NAME
    if ca is None and not insecure_plaintext:
        raise ValueError(
            "no CA to check the cluster's certificate: pass ca= or set OPENDSEC_CA to the cluster's CA file "
            "(opendsecctl cluster up prints it), or insecure_plaintext=True / OPENDSEC_INSECURE_PLAINTEXT=1 "
            "for a cluster started with --insecure-plaintext"
        )
    return (str(ca) if ca is not None else None), name, bool(insecure_plaintext)


def egress_rule(text: str) -> pb.EgressRule:
    """An egress rule from its text form ``TARGET[:PROTOCOL[/PORT[-PORT]]]`` (the server checks
    it fully; this only splits it). Raises ``ValueError`` for a port that is not a number."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"an egress rule is a non-empty string, not {text!r}")
    target, _, rest = text.partition(":")
    proto, _, ports = rest.partition("/")
    lo = hi = 0
    if ports:
        a, _, b = ports.partition("-")
        try:
            lo = int(a)
            hi = int(b) if b else lo
        except ValueError:
            raise ValueError(f"egress rule {text!r}: bad port {ports!r}") from None
    return pb.EgressRule(target=target, protocol=proto, port_min=lo, port_max=hi)


def egress_text(rule: pb.EgressRule) -> str:
    """The text form of an egress rule."""
    t = rule.target
    if rule.protocol or rule.port_min or rule.port_max:
        t += ":" + rule.protocol
    if rule.port_min or rule.port_max:
        t += f"/{rule.port_min}" if rule.port_min == rule.port_max else f"/{rule.port_min}-{rule.port_max}"
    return t


class AsyncClient:
    """Async client for opendsec's public API.

    Args:
        addresses: apiserver addresses (``"host:port"``; a comma-separated string or a list).
            Default: ``$OPENDSEC_ADDR``. Several are used round-robin; one that fails at the
            transport is avoided for ``avoid_s`` seconds.
        token: bearer token. Default: ``$OPENDSEC_TOKEN``.
        project: default project path for creations and listings. Default:
            ``$OPENDSEC_PROJECT``, else the caller's own project (server side).
        retry_timeout: total seconds a retry-safe call keeps retrying on ``unavailable``.
        avoid_s: how long a broken address is avoided.
        channel_options: extra ``grpc.aio`` channel options.
        ca: path of the cluster's CA certificate (PEM) the apiserver's TLS certificate is
            checked against. Default: ``$OPENDSEC_CA`` (``opendsecctl cluster up`` prints it).
        tls_name: the name the apiserver's certificate must carry. Default:
            ``$OPENDSEC_TLS_NAME``, else ``api.opendsec.internal`` (whatever address is dialled).
        insecure_plaintext: speak plain text, to a cluster started with
            ``--insecure-plaintext`` (the token then crosses the network unencrypted).
            Default: ``$OPENDSEC_INSECURE_PLAINTEXT``. With neither a CA nor this, the client
            refuses to start rather than send a token in the clear.

    Use as ``async with AsyncClient() as client:`` or call :meth:`close`.
    """

    def __init__(
        self,
        addresses: Optional[Union[str, Sequence[str]]] = None,
        token: Optional[str] = None,
        project: Optional[str] = None,
        *,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT_S,
        avoid_s: float = DEFAULT_AVOID_S,
        channel_options: Optional[Sequence[Tuple[str, Any]]] = None,
        ca: Optional[Union[str, "os.PathLike[str]"]] = None,
        tls_name: Optional[str] = None,
        insecure_plaintext: Optional[bool] = None,
    ) -> None:
        self.ca, self.tls_name, self.insecure_plaintext = _tls_settings(ca, tls_name, insecure_plaintext)
        self._credentials = None
        if self.ca is not None:
            try:
                pem = Path(self.ca).read_bytes()
            except OSError as e:
                raise ValueError(f"CA file {self.ca}: {e.strerror or e}") from None
            self._credentials = grpc.ssl_channel_credentials(root_certificates=pem)
        self.pool = AddressPool(parse_addresses(addresses), avoid_s=avoid_s)
        self.token = token if token is not None else os.environ.get("OPENDSEC_TOKEN", "")
        self.project = project if project is not None else os.environ.get("OPENDSEC_PROJECT", "")
        self.retry_timeout = retry_timeout
        self._options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 10_000),
            *([("grpc.ssl_target_name_override", self.tls_name)] if self._credentials is not None else []),
            *(channel_options or []),
        ]
        self._channels: Dict[str, grpc.aio.Channel] = {}
        self._stubs: Dict[Tuple[str, str], Any] = {}

    # -- plumbing -------------------------------------------------------------------------

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes every channel."""
        chans, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for c in chans:
            await c.close()

    def _stub(self, service: str, address: str) -> Any:
        key = (service, address)
        stub = self._stubs.get(key)
        if stub is None:
            chan = self._channels.get(address)
            if chan is None:
                if self._credentials is None:
                    chan = grpc.aio.insecure_channel(address, options=self._options)
                else:
                    chan = grpc.aio.secure_channel(address, self._credentials, options=self._options)
                self._channels[address] = chan
            cls = {
                "Sandboxes": pb_grpc.SandboxesStub,
                "Admin": pb_grpc.AdminStub,
                "Images": pb_grpc.ImagesStub,
                "Runtime": rt_grpc.RuntimeStub,
            }[service]
            stub = cls(chan)
            self._stubs[key] = stub
        return stub

    def _metadata(self) -> List[Tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def _failed(self, address: str, e: grpc.RpcError) -> errors.OpendsecError:
        """Maps the error and marks the address broken on a transport-level failure."""
        err = errors.from_rpc_error(e)
        if isinstance(err, errors.Unavailable) and not err.has_error_info:
            self.pool.mark_broken(address)
        return err

    async def _retry_sleep(self, backoff: Optional[Backoff], err: errors.OpendsecError) -> bool:
        """Sleeps before the next attempt when the call's class retries ``err``'s reason;
        False: give up. An error's ``retry_after_ms`` is the least it waits."""
        if backoff is None or not backoff.retries(err.reason):
            return False
        try:
            hint: Optional[float] = int(err.metadata["retry_after_ms"]) / 1000.0
        except (KeyError, ValueError, TypeError):
            hint = None
        delay = backoff.next_delay(hint)
        if delay is None:
            return False
        await asyncio.sleep(delay)
        return True

    def _backoff(self, call: str, call_class: Optional[str] = None) -> Optional[Backoff]:
        """The retries of one call of ``Service/Method`` (of class ``call_class`` when the
        request changes it), as the policy says (``None``: made once)."""
        cls = call_class or class_of(call)
        return None if cls == "once" or self.retry_timeout <= 0 else Backoff(self.retry_timeout, cls)

    async def _unary(
        self,
        service: str,
        method: str,
        request: Any,
        *,
        call_class: Optional[str] = None,
        timeout: Optional[float] = None,
        on_error: Optional[Callable[[errors.OpendsecError], bool]] = None,
    ) -> Any:
        """One call answered once (a unary call, or a client stream when ``request`` is a
        callable making a fresh request for each attempt), retried as its class
        (:data:`opendsec._net.CALLS`, or ``call_class`` when the request changes it) says.
        ``on_error(err)`` sees each failure first; False: it is final."""
        backoff = self._backoff(f"{service}/{method}", call_class)
        while True:
            address = self.pool.pick()
            try:
                resp = await getattr(self._stub(service, address), method)(
                    request() if callable(request) else request, metadata=self._metadata(), timeout=timeout
                )
            except grpc.RpcError as e:
                err = self._failed(address, e)
                if (on_error is None or on_error(err)) and await self._retry_sleep(backoff, err):
                    continue
                raise err from None
            self.pool.mark_ok(address)
            return resp

    # -- sandboxes ------------------------------------------------------------------------

    def _spec(
        self,
        *,
        backend: str,
        image: Optional[str],
        cpu: Optional[int],
        memory_mb: Optional[int],
        disk_mb: Optional[int],
        gpus: Optional[int],
        project: Optional[str],
        labels: Optional[Mapping[str, str]],
        env: Optional[Mapping[str, str]],
        ttl_running_stop_s: int,
        ttl_max_s: int,
        ttl_paused_s: int,
        user: str,
        workdir: str,
        best_effort: bool,
        egress: Optional[Sequence[str]] = None,
        pool: Optional[str] = None,
        session: Optional[str] = None,
        session_paths: Optional[Sequence[str]] = None,
        full_init: bool = False,
    ) -> pb.SandboxSpec:
        if bool(session) != bool(session_paths):
            raise ValueError("session and session_paths go together")
        sync = pb.SessionSync(name=session, paths=list(session_paths or [])) if session else None
        if pool and sync:
            raise ValueError(f"pool {pool!r}: a session is restored at creation, which a warm member is past")
        if pool:
            # The pool's template gives these: naming them too would be ambiguous.
            given = [
                name
                for name, v in (
                    ("backend", backend), ("image", image), ("cpu", cpu), ("memory_mb", memory_mb),
                    ("disk_mb", disk_mb), ("gpus", gpus), ("user", user), ("workdir", workdir), ("egress", egress),
                )
                if v not in (None, "")
            ]
            if given:
                raise ValueError(f"pool {pool!r} fixes {', '.join(given)}: leave them out")
            return pb.SandboxSpec(
                project=self.project if project is None else project,
                pool=pool,
                ttl_running_stop_s=ttl_running_stop_s,
                ttl_max_s=ttl_max_s,
                ttl_paused_s=ttl_paused_s,
                env=dict(env or {}),
                labels=dict(labels or {}),
                priority=pb.PRIORITY_BEST_EFFORT if best_effort else pb.PRIORITY_GUARANTEED,
            )
        if not backend:
            raise ValueError("backend (e.g. 'container', 'sim') or pool is required: callers choose it")
        return pb.SandboxSpec(
            project=self.project if project is None else project,
            image=DEFAULT_IMAGE if image is None else image,
            backend=backend,
            resources=pb.Resources(
                cpu_millis=DEFAULT_CPU_MILLIS if cpu is None else cpu,
                memory_mb=DEFAULT_MEMORY_MB if memory_mb is None else memory_mb,
                disk_mb=DEFAULT_DISK_MB if disk_mb is None else disk_mb,
                gpus=gpus or 0,
            ),
            ttl_running_stop_s=ttl_running_stop_s,
            ttl_max_s=ttl_max_s,
            ttl_paused_s=ttl_paused_s,
            env=dict(env or {}),
            labels=dict(labels or {}),
            user=user,
            workdir=workdir,
            priority=pb.PRIORITY_BEST_EFFORT if best_effort else pb.PRIORITY_GUARANTEED,
            network=None if egress is None else pb.NetworkSpec(egress=[egress_rule(r) for r in egress]),
            session=sync,
            full_init=full_init,
        )

    async def create_sandbox(
        self,
        backend: str = "",
        image: Optional[str] = None,
        *,
        pool: Optional[str] = None,
        cpu: Optional[int] = None,
        memory_mb: Optional[int] = None,
        disk_mb: Optional[int] = None,
        gpus: Optional[int] = None,
        project: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        env: Optional[Mapping[str, str]] = None,
        ttl_running_stop_s: int = 0,
        ttl_max_s: int = 0,
        ttl_paused_s: int = 0,
        user: str = "",
        workdir: str = "",
        best_effort: bool = False,
        lease_id: Optional[str] = None,
        egress: Optional[Sequence[str]] = None,
        session: Optional[str] = None,
        session_paths: Optional[Sequence[str]] = None,
        full_init: bool = False,
    ) -> "Sandbox":
        """Creates one sandbox and returns it once running.

        Args:
            backend: ``"container"``, ``"fncall"``, ``"sim"``, ``"microvm"``, ... (required
                unless ``pool`` is given: callers choose).
            image: ``repo[:tag]``, looked up in the project and its ancestors (default
                ``scratch``, an empty image every new cluster has in ``root``).
            pool: claim an idle member of this warm pool of the project
                (:meth:`create_pool`): its template gives the image, backend, resources,
                egress, user and workdir (giving one of them too is a ``ValueError``);
                ``env`` is added to the template's, labels and TTLs are yours. Without an idle
                member the sandbox is created cold from the template (a miss). Either way it
                knows its id (``$OPENDSEC_SANDBOX_ID``, ``/run/opendsec/sandbox-id``).
            cpu: millicores; memory_mb/disk_mb: MiB (defaults as ``opendsecctl``: 1000,
                1024, 10240).
            gpus: GPUs passed through (default 0; backend ``"fullvm"`` only, on an edge with
                GPUs to pass through: ``no_capacity`` otherwise).
            project: project path; default the client's project.
            labels/env: sandbox labels and environment.
            ttl_*: idle/lifetime/paused TTLs in seconds (0: cluster defaults).
            user/workdir: the user and directory sessions and processes use when a call names
                none ("": root, and the user's home).
            best_effort: best-effort priority instead of guaranteed.
            lease_id: idempotency key ``[a-z0-9-]{1,40}``; generated when omitted. Retries
                reuse it, so they never create a second sandbox.
            egress: what the sandbox may reach, as rules ``TARGET[:PROTOCOL[/PORT[-PORT]]]``
                (``"pypi.org"`` with its subdomains, ``"@pypi"`` a set from the cluster config,
                ``"203.0.113.0/24:tcp/443"``, ``"*"`` every public address). ``None``: the
                cluster's default (none at all unless configured); ``[]``: no egress.
            session/session_paths: session sync (docs/sessions.md): the absolute paths are
                restored from session ``session`` of the project when one was saved, and
                saved to it when the sandbox stops (or on :meth:`Sandbox.save_session`). Needs
                the cluster's session store (``invalid_argument`` otherwise).
            full_init: backend ``"fullvm"`` only: the image's own init (systemd) runs as PID 1,
                the agent as its service (docs/vms.md).

        Retried within ``retry_timeout`` on ``unavailable``, ``no_capacity`` (every edge full
        or under pressure, often for seconds only), ``rate_limited`` (after the wait it names)
        and ``deadline_exceeded`` (the first attempt may have created it after all: the retry,
        with the same lease id, finds it). After ``no_capacity`` nothing was made and the
        refused lease id names a FAILED sandbox: a generated lease id is replaced by a fresh
        one for the next attempt; a ``lease_id`` you gave is not retried on ``no_capacity``.

        Returns the :class:`Sandbox`. Raises ``ValueError`` for an empty ``backend`` or a
        malformed ``lease_id`` (before any call), else an :class:`~opendsec.errors.OpendsecError`
        (e.g. ``quota_exceeded``, ``no_capacity``, ``not_found`` for the image).
        """
        spec = self._spec(
            backend=backend, image=image, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb, gpus=gpus,
            project=project, labels=labels, env=env, ttl_running_stop_s=ttl_running_stop_s,
            ttl_max_s=ttl_max_s, ttl_paused_s=ttl_paused_s, user=user, workdir=workdir, best_effort=best_effort,
            egress=egress, pool=pool, session=session, session_paths=session_paths, full_init=full_init,
        )
        own = lease_id is None
        lease = [new_lease_id() if own else check_lease_id(lease_id)]

        def refused(err: errors.OpendsecError) -> bool:
            if isinstance(err, errors.NoCapacity):
                if not own:
                    return False  # the caller's key: its outcome is theirs to see
                lease[0] = new_lease_id()  # a refusal made nothing; the old key names a FAILED sandbox
            return True

        info = await self._unary(
            "Sandboxes", "CreateSandbox", lambda: pb.CreateSandboxRequest(spec=spec, lease_id=lease[0]), on_error=refused
        )
        return Sandbox(self, info)

    async def create_sandboxes(
        self,
        n: int,
        backend: str = "",
        image: Optional[str] = None,
        *,
        pool: Optional[str] = None,
        cpu: Optional[int] = None,
        memory_mb: Optional[int] = None,
        disk_mb: Optional[int] = None,
        gpus: Optional[int] = None,
        project: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        env: Optional[Mapping[str, str]] = None,
        ttl_running_stop_s: int = 0,
        ttl_max_s: int = 0,
        ttl_paused_s: int = 0,
        user: str = "",
        workdir: str = "",
        best_effort: bool = False,
        return_exceptions: bool = False,
        on_progress: Optional[Callable[[int, int], None]] = None,
        retry: bool = True,
        egress: Optional[Sequence[str]] = None,
        patches: Optional[Sequence[Mapping[str, Mapping[str, str]]]] = None,
    ) -> List[Any]:
        """Creates ``n`` sandboxes from one spec in one call (``CreateSandboxes``).

        ``patches[i]`` (``{"env": {...}, "labels": {...}}``) adds to or replaces item ``i``'s
        env and labels (at most ``n`` patches; later items take the spec as it is).

        Returns the sandboxes in index order. An item that failed is raised (the first one,
        after every item has answered; the sandboxes that were created are on the exception's
        ``created`` attribute, so the caller can stop them), or, with
        ``return_exceptions=True``, returned in its place as an ``OpendsecError``.
        ``on_progress(done, n)`` is called as each item completes (for progress bars).
        The other arguments are those of :meth:`create_sandbox`.

        Items that fail for a passing reason (``no_capacity``, ``rate_limited``,
        ``unavailable``) are asked for again, in one new batch call for all of them, with
        backoff within ``retry_timeout`` (``retry=False``: not). That is safe: a failed item
        created nothing. The call itself is not repeated when its stream breaks (a batch
        carries no idempotency key; the sandboxes answered so far are on the error's
        ``created``).
        """
        spec = self._spec(
            backend=backend, image=image, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb, gpus=gpus,
            project=project, labels=labels, env=env, ttl_running_stop_s=ttl_running_stop_s,
            ttl_max_s=ttl_max_s, ttl_paused_s=ttl_paused_s, user=user, workdir=workdir, best_effort=best_effort,
            egress=egress, pool=pool,
        )
        results: List[Any] = [None] * n
        # Made at the first refusal: the budget is for asking again, not for the first call
        # (a batch of thousands may take longer than retry_timeout by itself).
        backoff: Optional[Backoff] = None
        done = 0

        def settled() -> None:
            nonlocal done
            done += 1
            if on_progress is not None:
                on_progress(done, n)

        item_patches = [
            pb.ItemPatch(env=dict(p.get("env", {})), labels=dict(p.get("labels", {}))) for p in (patches or ())
        ]
        todo = list(range(n))
        while todo:
            got = await self._batch_once(spec, todo, results, item_patches)
            again: List[int] = []
            for i in todo:
                r = got.get(i)
                if r is None:
                    r = errors.Internal(f"no answer for batch item {i}")
                results[i] = r
                if retry and isinstance(r, errors.OpendsecError) and r.reason in CLASS_RETRIES["create"]:
                    again.append(i)
                else:
                    settled()
            if again and backoff is None:
                backoff = self._backoff("Sandboxes/CreateSandboxes")
            if not again or not await self._retry_sleep(backoff, results[again[0]]):
                for _ in again:  # given up: these answers are final
                    settled()
                break
            todo = again
        if not return_exceptions:
            failed = [r for r in results if isinstance(r, errors.OpendsecError)]
            if failed:
                first = failed[0]
                first.created = [r for r in results if isinstance(r, Sandbox)]  # type: ignore[attr-defined]
                raise first
        return results

    async def _batch_once(
        self, spec: Any, slots: List[int], results: List[Any], patches: Sequence[Any] = ()
    ) -> Dict[int, Any]:
        """One ``CreateSandboxes`` call for ``len(slots)`` sandboxes; item ``k`` of the call
        answers ``slots[k]`` (with ``slots[k]``'s patch). A broken stream raises, with every
        sandbox created so far (in ``results`` and in this call) on the error's ``created``."""
        got: Dict[int, Any] = {}
        address = self.pool.pick()
        mine = [patches[i] if i < len(patches) else pb.ItemPatch() for i in slots] if patches else []
        while mine and not mine[-1].env and not mine[-1].labels:
            mine.pop()
        call = self._stub("Sandboxes", address).CreateSandboxes(
            pb.CreateSandboxesRequest(spec=spec, count=len(slots), patches=mine), metadata=self._metadata()
        )
        try:
            async for item in call:
                if item.index >= len(slots):
                    continue
                slot = slots[item.index]
                if item.HasField("error") and item.error.reason:
                    got[slot] = errors.from_detail(item.error.reason, item.error.message)
                else:
                    got[slot] = Sandbox(self, item.sandbox)
        except grpc.RpcError as e:
            err = self._failed(address, e)
            created = [r for r in list(results) + list(got.values()) if isinstance(r, Sandbox)]
            err.created = created  # type: ignore[attr-defined]
            raise err from None
        self.pool.mark_ok(address)
        return got

    async def iter_fork(
        self, sandbox_id: str, count: int, *, snapshot_name: str = "", pack_diff: bool = False
    ) -> AsyncIterator[Any]:
        """Forks the sandbox (``ForkSandbox``): one snapshot of its file system (registered
        as ``snapshot_name``, default ``forks/<lease>:<ms>``), then ``count`` (1..=256) copies
        with its spec, placed on its edge while it has room. Yields each copy as a
        :class:`Sandbox` as it is made, or the item's error as an ``OpendsecError`` (each copy
        is admitted and charged on its own). Copies carry the file system, not the processes.
        Not retried: a retry would snapshot again."""
        req = pb.ForkSandboxRequest(id=sandbox_id, count=count, snapshot_name=snapshot_name, pack_diff=pack_diff)
        address = self.pool.pick()
        call = self._stub("Sandboxes", address).ForkSandbox(req, metadata=self._metadata())
        try:
            async for item in call:
                if item.HasField("error") and item.error.reason:
                    yield errors.from_detail(item.error.reason, item.error.message)
                else:
                    yield Sandbox(self, item.sandbox)
        except grpc.RpcError as e:
            raise self._failed(address, e) from None
        self.pool.mark_ok(address)

    async def fork_sandbox(
        self,
        sandbox_id: str,
        count: int,
        *,
        snapshot_name: str = "",
        pack_diff: bool = False,
        return_exceptions: bool = False,
    ) -> List[Any]:
        """Every copy of :meth:`iter_fork` as a list. An item that failed is raised (the first
        one, once every item has answered, with the copies made on its ``created``), or with
        ``return_exceptions=True`` returned in the list."""
        results = [r async for r in self.iter_fork(sandbox_id, count, snapshot_name=snapshot_name, pack_diff=pack_diff)]
        failed = [r for r in results if isinstance(r, errors.OpendsecError)]
        if failed and not return_exceptions:
            failed[0].created = [r for r in results if isinstance(r, Sandbox)]  # type: ignore[attr-defined]
            raise failed[0]
        return results

    async def get_sandbox(self, sandbox_id: str) -> "Sandbox":
        """The sandbox with this id (``not_found`` if none)."""
        info = await self._unary("Sandboxes", "GetSandbox", pb.GetSandboxRequest(id=sandbox_id))
        return Sandbox(self, info)

    def sandbox(self, sandbox_id: str) -> "Sandbox":
        """A handle for a known sandbox id without a call (its ``info`` is empty)."""
        return Sandbox(self, pb.Sandbox(id=sandbox_id))

    async def iter_sandboxes(
        self,
        project: Optional[str] = None,
        *,
        labels: Optional[Mapping[str, str]] = None,
        states: Optional[Iterable[StateLike]] = None,
        page_size: int = 0,
    ) -> AsyncIterator["Sandbox"]:
        """Every sandbox of the project (and its subprojects) matching every label given and
        one of ``states`` (default: the live states), page by page."""
        token = ""
        while True:
            req = pb.ListSandboxesRequest(
                project=self.project if project is None else project,
                states=[state_value(s) for s in states or ()],
                labels=dict(labels or {}),
                page_size=page_size,
                page_token=token,
            )
            resp = await self._unary("Sandboxes", "ListSandboxes", req)
            for s in resp.sandboxes:
                yield Sandbox(self, s)
            token = resp.next_page_token
            if not token:
                return

    async def list_sandboxes(
        self,
        project: Optional[str] = None,
        *,
        labels: Optional[Mapping[str, str]] = None,
        states: Optional[Iterable[StateLike]] = None,
        page_size: int = 0,
    ) -> List["Sandbox"]:
        """All pages of :meth:`iter_sandboxes` as a list."""
        return [s async for s in self.iter_sandboxes(project, labels=labels, states=states, page_size=page_size)]

    async def stop_sandbox(self, sandbox_id: str) -> "Sandbox":
        """Stops the sandbox and returns it as updated (not retried)."""
        return Sandbox(self, await self._unary("Sandboxes", "StopSandbox", pb.StopSandboxRequest(id=sandbox_id)))

    async def pause_sandbox(self, sandbox_id: str) -> "Sandbox":
        """Pauses the sandbox and returns it as updated (not retried)."""
        return Sandbox(self, await self._unary("Sandboxes", "PauseSandbox", pb.PauseSandboxRequest(id=sandbox_id)))

    async def resume_sandbox(self, sandbox_id: str) -> "Sandbox":
        """Resumes a paused sandbox and returns it as updated (not retried)."""
        return Sandbox(self, await self._unary("Sandboxes", "ResumeSandbox", pb.ResumeSandboxRequest(id=sandbox_id)))

    async def create_snapshot(self, sandbox_id: str, name: str, *, pack_diff: bool = False) -> pb.Snapshot:
        """Snapshots the sandbox's file system into image ``name`` (``repo[:tag]``) of its
        project, which :meth:`create_sandbox` then takes as ``image``; the sandbox keeps
        running. ``pack_diff`` leaves out /tmp, /var/tmp, /var/cache, home caches and shell
        histories. Processes are not kept (containers). Needs ``sandbox.operate`` and
        ``layer.publish`` on the project; a name taken is ``already_exists`` (not retried).
        """
        req = pb.CreateSnapshotRequest(id=sandbox_id, name=name, pack_diff=pack_diff)
        return await self._unary("Sandboxes", "CreateSnapshot", req)

    async def save_session(self, sandbox_id: str) -> pb.SessionSaved:
        """Saves the sandbox's session (``create_sandbox(session=...)``) now, as its stop
        would: frozen while its files are read, then running on. Returns the saved ``name``
        and ``bytes``. Needs ``sandbox.operate``; ``invalid_argument`` for a sandbox without a
        session. Retried."""
        return await self._unary("Sandboxes", "SaveSession", pb.SaveSessionRequest(id=sandbox_id))

    async def create_sandbox_tokens(self, sandbox_id: str) -> pb.SandboxTokens:
        """The caller's tokens for one sandbox, to hand to whoever should reach only it (a
        browser, a helper process): ``runtime_token`` makes every Runtime call on it (shell,
        files, processes, HTTP, code) and reads it; ``traffic_token`` reaches its ports only
        (``http_request`` and code contexts' management, not running code). Both act as the
        caller's principal, are the same on every call, and stop working when the sandbox
        ends. Needs ``sandbox.operate``. Retried."""
        return await self._unary("Sandboxes", "CreateSandboxTokens", pb.CreateSandboxTokensRequest(sandbox_id=sandbox_id))

    async def set_sandbox_timeout(
        self,
        sandbox_id: str,
        *,
        ttl_running_stop_s: Optional[int] = None,
        ttl_max_s: Optional[int] = None,
        ttl_paused_s: Optional[int] = None,
    ) -> "Sandbox":
        """Replaces the TTLs given (seconds); the others are kept. Returns the sandbox as
        updated. Retried (it sets values)."""
        req = pb.SetSandboxTimeoutRequest(id=sandbox_id)
        if ttl_running_stop_s is not None:
            req.ttl_running_stop_s = ttl_running_stop_s
        if ttl_max_s is not None:
            req.ttl_max_s = ttl_max_s
        if ttl_paused_s is not None:
            req.ttl_paused_s = ttl_paused_s
        return Sandbox(self, await self._unary("Sandboxes", "SetSandboxTimeout", req))

    async def update_network(self, sandbox_id: str, egress: Sequence[str]) -> "Sandbox":
        """Replaces every egress rule of a running or paused sandbox (``[]``: no egress at
        all), rules as in :meth:`create_sandbox`. Connections a removed rule allowed are cut at
        once. Raises ``invalid_argument`` naming a bad rule, ``permission_denied`` when the
        project's ceiling does not allow one. Retried (it sets values)."""
        req = pb.UpdateNetworkRequest(id=sandbox_id, network=pb.NetworkSpec(egress=[egress_rule(r) for r in egress]))
        return Sandbox(self, await self._unary("Sandboxes", "UpdateNetwork", req))

    @contextlib.asynccontextmanager
    async def run_sandbox(
        self, backend: str = "", image: Optional[str] = None, **kwargs: Any
    ) -> AsyncIterator["Sandbox"]:
        """``async with client.run_sandbox("container", "python:3") as sb:`` creates a sandbox
        (same arguments as :meth:`create_sandbox`) and stops it on exit, error or not."""
        sb = await self.create_sandbox(backend, image, **kwargs)
        try:
            yield sb
        finally:
            await asyncio.shield(sb.__aexit__(None, None, None))

    # -- images ---------------------------------------------------------------------------

    async def list_images(self, project: Optional[str] = None, *, recursive: bool = False) -> List[pb.Image]:
        """Images of the project (and, with ``recursive``, its subprojects)."""
        req = pb.ListImagesRequest(project=self.project if project is None else project, recursive=recursive)
        return list((await self._unary("Images", "ListImages", req)).images)

    async def get_image(self, name: str, project: Optional[str] = None) -> pb.Image:
        """The image ``repo[:tag]`` as a sandbox in ``project`` would find it."""
        req = pb.GetImageRequest(project=self.project if project is None else project, name=name)
        return await self._unary("Images", "GetImage", req)

    async def compose_image(
        self, name: str, sources: Sequence[str], project: Optional[str] = None, *, replace: bool = False
    ) -> pb.Image:
        """Registers ``name`` as the concatenation of the sources' layers (bottom first) and
        returns it; ``replace`` overwrites an existing ``name`` (else ``already_exists``). Not
        retried."""
        req = pb.ComposeImageRequest(
            project=self.project if project is None else project, name=name, sources=list(sources), replace=replace
        )
        return await self._unary("Images", "ComposeImage", req)

    async def delete_image(self, name: str, project: Optional[str] = None) -> None:
        """Deletes the image from exactly this project (not its ancestors'). Not retried."""
        req = pb.DeleteImageRequest(project=self.project if project is None else project, name=name)
        await self._unary("Images", "DeleteImage", req)

    async def import_image(
        self,
        reference: Optional[str] = None,
        *,
        name: Optional[str] = None,
        rootfs: Optional[Union[str, Path]] = None,
        oci_layout: Optional[Union[str, Path]] = None,
        docker_archive: Optional[Union[str, Path]] = None,
        insecure: bool = False,
        replace: bool = False,
        store: Optional[Union[str, Path]] = None,
        project: Optional[str] = None,
        opendsecctl: Optional[str] = None,
    ) -> pb.Image:
        """Imports an image into the cluster's image store and registers it in the project.

        Sources: a registry ``reference`` (``host[:port]/repo[:tag|@digest]``; ``insecure``
        for plain http, e.g. a local registry), or one of ``rootfs`` (a directory or tarball,
        one layer), ``oci_layout`` (with ``reference`` naming the tag when it holds several)
        or ``docker_archive``. ``name`` is the image's ``repo[:tag]`` in the project (default:
        from the reference or the file); ``replace`` replaces an image of that name.

        Importing writes layers into the store directory the cluster's nodes mount, so it runs
        where that directory is (as root, like the edges): it runs ``opendsecctl image
        import`` (``opendsecctl`` argument, else ``$OPENDSECCTL``, else ``opendsecctl`` on
        PATH) with this client's addresses, token and project; ``store`` (else
        ``$OPENDSEC_IMAGE_STORE``) is the store directory. Not retried (the tool reuses
        layers already in the store, so calling again is cheap).

        Returns the registered image. Raises the reason's class for an API failure (e.g.
        ``permission_denied`` without ``layer.publish``, ``already_exists`` without
        ``replace``), ``OSError`` for a local one (a missing file, an unwritable store, no
        ``opendsecctl``).
        """
        args = [opendsecctl or os.environ.get("OPENDSECCTL") or "opendsecctl", "--json", "image", "import"]
        if reference is not None:
            args.append(reference)
        for flag, value in (("--rootfs", rootfs), ("--oci-layout", oci_layout), ("--docker-archive", docker_archive),
                            ("--name", name), ("--store", store)):
            if value is not None:
                args += [flag, str(value)]
        if insecure:
            args.append("--insecure")
        if replace:
            args.append("--replace")
        project = self.project if project is None else project
        if project:
            args += ["--project", project]
        env = dict(os.environ)
        env["OPENDSEC_ADDR"] = ",".join(self.pool.addresses)
        env["OPENDSEC_TOKEN"] = self.token
        env.pop("OPENDSEC_CA", None)
        env.pop("OPENDSEC_INSECURE_PLAINTEXT", None)
        if self.ca is not None:
            env["OPENDSEC_CA"] = str(self.ca)
            env["OPENDSEC_TLS_NAME"] = self.tls_name
        else:
            env["OPENDSEC_INSECURE_PLAINTEXT"] = "1"
        try:
            proc = await asyncio.create_subprocess_exec(
                *args, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )
        except FileNotFoundError:
            raise FileNotFoundError(
                f"image import runs {args[0]!r}, which was not found: build it (cargo build -p opendsec-cli) "
                "and put it on PATH, or set OPENDSECCTL"
            ) from None
        try:
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled: the import must not go on writing the store
                proc.kill()
                await proc.wait()
        text = err.decode(errors="replace").strip()
        message = next((l[len("error: "):] for l in text.splitlines() if l.startswith("error: ")), text)
        # "error: <reason>: <message>": keep the message, the class carries the reason.
        reason_prefix, _, rest = message.partition(": ")
        if reason_prefix in errors.BY_REASON and rest:
            message = rest
        if proc.returncode != 0:
            api = errors.from_exit_code(proc.returncode or 0, message)
            if api is not None:
                raise api
            raise OSError(f"image import failed: {message or f'exit code {proc.returncode}'}")
        # The image as registered (not fetched again: that would need layer.use, which an
        # importer with only layer.publish need not have).
        return json_format.ParseDict(json.loads(out.decode())["image"], pb.Image(), ignore_unknown_fields=True)

    # -- identity and access --------------------------------------------------------------

    async def whoami(self) -> pb.WhoAmIResponse:
        """The caller's principal, project, token and grants."""
        return await self._unary("Admin", "WhoAmI", pb.WhoAmIRequest())

    async def create_project(self, path: str, quota: Optional[QuotaLike] = None) -> pb.Project:
        """Creates the project ``path`` (its parent must exist) and returns it. ``quota``: a
        mapping with any of ``cpu_millis``, ``memory_mb``, ``disk_mb``, ``gpus``,
        ``sandboxes`` (or a ``pb.Quota``); keys left out inherit the parent's. Not retried."""
        req = pb.CreateProjectRequest(path=path, quota=_quota(quota) if quota is not None else None)
        return await self._unary("Admin", "CreateProject", req)

    def _pool(
        self, name: str, image: str, size: int, *, cpu: int = DEFAULT_CPU_MILLIS,
        memory_mb: int = DEFAULT_MEMORY_MB, disk_mb: int = DEFAULT_DISK_MB,
        env: Optional[Mapping[str, str]] = None, egress: Optional[Sequence[str]] = None,
        user: str = "", workdir: str = "", project: Optional[str] = None,
    ) -> pb.Pool:
        return pb.Pool(
            project=self.project if project is None else project,
            name=name,
            template=pb.PoolTemplate(
                image=image, backend="fncall",
                resources=pb.Resources(cpu_millis=cpu, memory_mb=memory_mb, disk_mb=disk_mb),
                env=dict(env or {}), egress=list(egress or ()), user=user, workdir=workdir,
            ),
            size_per_edge=size,
        )

    async def create_pool(self, name: str, image: str, size: int, **template: Any) -> pb.Pool:
        """Creates a warm pool: ``size`` members started ahead of time on every edge from
        this template (backend ``fncall``; keyword arguments ``cpu``, ``memory_mb``,
        ``disk_mb``, ``env``, ``egress``, ``user``, ``workdir``, ``project``, defaults as for
        :meth:`create_sandbox`). Its ``revision`` names the template. Needs ``pool.manage``
        on the project. Not retried."""
        pool = self._pool(name, image, size, **template)
        return await self._unary("Admin", "CreatePool", pb.CreatePoolRequest(pool=pool))

    async def update_pool(self, name: str, image: str, size: int, **template: Any) -> pb.Pool:
        """Replaces a pool's template and size (arguments as :meth:`create_pool`). A new
        template is a new revision: members of the old one are replaced, never handed out."""
        pool = self._pool(name, image, size, **template)
        return await self._unary("Admin", "UpdatePool", pb.UpdatePoolRequest(pool=pool))

    async def get_pool(self, name: str, project: Optional[str] = None) -> pb.Pool:
        """The pool ``name`` of the project (``not_found`` if none), with ``edges``: its
        state on each edge keeping members (``idle``, ``starting``, ``stale``, ``claims``,
        ``misses``, ``refill_p50_ms``), as of the apiserver's latest cluster snapshot."""
        req = pb.GetPoolRequest(project=self.project if project is None else project, name=name)
        return await self._unary("Admin", "GetPool", req)

    async def list_pools(self, project: Optional[str] = None) -> List[pb.Pool]:
        """The pools of the project and its subprojects."""
        req = pb.ListPoolsRequest(project=self.project if project is None else project)
        return list((await self._unary("Admin", "ListPools", req)).pools)

    async def delete_pool(self, name: str, project: Optional[str] = None) -> None:
        """Deletes the pool (its idle members are stopped by the edges)."""
        req = pb.DeletePoolRequest(project=self.project if project is None else project, name=name)
        await self._unary("Admin", "DeletePool", req)

    async def get_project(self, path: str) -> pb.Project:
        """The project ``path`` (``not_found`` if none)."""
        return await self._unary("Admin", "GetProject", pb.GetProjectRequest(path=path))

    async def list_projects(self, path: str = "root") -> List[pb.Project]:
        """``path`` and every project below it."""
        return list((await self._unary("Admin", "ListProjects", pb.ListProjectsRequest(path=path))).projects)

    async def delete_project(self, path: str) -> None:
        """Deletes the project ``path``. Not retried."""
        await self._unary("Admin", "DeleteProject", pb.DeleteProjectRequest(path=path))

    async def set_quota(self, path: str, quota: QuotaLike) -> pb.Project:
        """Replaces the project's quota (a mapping as for :meth:`create_project`; keys left
        out inherit) and returns the project. Retried (replacing is idempotent)."""
        return await self._unary("Admin", "SetQuota", pb.SetQuotaRequest(path=path, quota=_quota(quota)))

    async def set_egress_ceiling(self, path: str, egress: Optional[Sequence[str]]) -> pb.Project:
        """Sets the most egress the project's sandboxes (and its subprojects') may ask for,
        rules as in :meth:`AsyncClient.create_sandbox`; ``None`` removes the project's own
        ceiling (an ancestor's still applies). A sandbox asking for more is refused with
        ``permission_denied`` naming the rule. Returns the project. Retried."""
        ceiling = None if egress is None else pb.EgressCeiling(allow=[egress_rule(r) for r in egress])
        return await self._unary("Admin", "SetEgressCeiling", pb.SetEgressCeilingRequest(path=path, ceiling=ceiling))

    async def create_principal(self, name: str, project: str) -> pb.Principal:
        """Creates the principal ``name`` in ``project`` and returns it. Not retried."""
        return await self._unary("Admin", "CreatePrincipal", pb.CreatePrincipalRequest(name=name, project=project))

    async def list_principals(self, project: str) -> List[pb.Principal]:
        """The principals of ``project``."""
        resp = await self._unary("Admin", "ListPrincipals", pb.ListPrincipalsRequest(project=project))
        return list(resp.principals)

    async def delete_principal(self, name: str) -> None:
        """Deletes the principal ``name``. Not retried."""
        await self._unary("Admin", "DeletePrincipal", pb.DeletePrincipalRequest(name=name))

    async def create_token(self, principal: str = "", *, ttl_s: int = 0, description: str = "") -> pb.CreateTokenResponse:
        """Creates a token for ``principal`` (default: the caller) valid ``ttl_s`` seconds (0:
        never expires); ``.token`` of the answer is the secret, shown only this once.
        Not retried."""
        req = pb.CreateTokenRequest(principal=principal, ttl_s=ttl_s, description=description)
        return await self._unary("Admin", "CreateToken", req)

    async def list_tokens(self, principal: str = "") -> List[pb.TokenInfo]:
        """The tokens of ``principal`` (default: the caller), without their secrets."""
        return list((await self._unary("Admin", "ListTokens", pb.ListTokensRequest(principal=principal))).tokens)

    async def revoke_token(self, token_id: str) -> None:
        """Revokes the token with id ``token_id``. Retried."""
        await self._unary("Admin", "RevokeToken", pb.RevokeTokenRequest(id=token_id))

    async def grant(self, principal: str, project: str, permission: str) -> None:
        """Grants ``permission`` (e.g. ``"sandbox.create"``; ``"*"``: every one) on ``project`` to
        ``principal``. Retried."""
        g = pb.Grant(principal=principal, project=project, permission=permission)
        await self._unary("Admin", "Grant", pb.GrantRequest(grant=g))

    async def revoke_grant(self, principal: str, project: str, permission: str) -> None:
        """Removes the grant made by :meth:`grant` with the same arguments. Not retried: a
        repeat after a lost answer would fail with ``not_found``."""
        g = pb.Grant(principal=principal, project=project, permission=permission)
        await self._unary("Admin", "RevokeGrant", pb.RevokeGrantRequest(grant=g))

    async def list_grants(self, principal: str = "", project: str = "") -> List[pb.Grant]:
        """The grants, filtered by ``principal`` and/or ``project`` when given."""
        req = pb.ListGrantsRequest(principal=principal, project=project)
        return list((await self._unary("Admin", "ListGrants", req)).grants)

    async def get_usage(self, project: str) -> List[pb.Project]:
        """The project and every subproject, with quota and usage."""
        return list((await self._unary("Admin", "GetUsage", pb.GetUsageRequest(project=project))).projects)


class Sandbox:
    """A handle on one sandbox: lifecycle, shell sessions, files and processes.

    ``info`` is the ``opendsec.v1.Sandbox`` as last seen (refresh with :meth:`refresh`);
    ``client`` is the :class:`AsyncClient` it was obtained from. ``async with sb:`` stops the
    sandbox on exit (a sandbox already gone or stopped is not an error).
    """

    def __init__(self, client: AsyncClient, info: pb.Sandbox) -> None:
        self.client = client
        self.info = info

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self.state!r})"

    @property
    def id(self) -> str:
        """The sandbox id."""
        return self.info.id

    @property
    def state(self) -> str:
        """``"running"``, ``"paused"``, ``"stopped"``, ..."""
        return state_name(self.info.state)

    @property
    def labels(self) -> Dict[str, str]:
        """The sandbox's labels (a copy)."""
        return dict(self.info.spec.labels)

    @property
    def backend(self) -> str:
        """The backend it runs on (``"container"``, ``"sim"``, ...)."""
        return self.info.spec.backend

    # -- lifecycle ------------------------------------------------------------------------

    async def refresh(self) -> "Sandbox":
        """Reloads ``info`` from the server; returns ``self``."""
        self.info = (await self.client.get_sandbox(self.id)).info
        return self

    async def stop(self) -> "Sandbox":
        """Stops the sandbox (not retried); returns ``self`` with ``info`` updated."""
        self.info = (await self.client.stop_sandbox(self.id)).info
        return self

    async def pause(self) -> "Sandbox":
        """Pauses the sandbox (not retried); returns ``self`` with ``info`` updated."""
        self.info = (await self.client.pause_sandbox(self.id)).info
        return self

    async def resume(self) -> "Sandbox":
        """Resumes the paused sandbox (not retried); returns ``self`` with ``info`` updated."""
        self.info = (await self.client.resume_sandbox(self.id)).info
        return self

    async def fork(
        self, count: int, *, snapshot_name: str = "", pack_diff: bool = False, return_exceptions: bool = False
    ) -> List[Any]:
        """``count`` copies of this sandbox (see :meth:`AsyncClient.fork_sandbox`): of its file
        system for a container; of its whole machine, running processes and memory included, for
        a microvm."""
        return await self.client.fork_sandbox(
            self.id, count, snapshot_name=snapshot_name, pack_diff=pack_diff, return_exceptions=return_exceptions
        )

    def iter_fork(self, count: int, *, snapshot_name: str = "", pack_diff: bool = False) -> AsyncIterator[Any]:
        """The copies of :meth:`fork` as they are made (see :meth:`AsyncClient.iter_fork`)."""
        return self.client.iter_fork(self.id, count, snapshot_name=snapshot_name, pack_diff=pack_diff)

    async def snapshot(self, name: str, *, pack_diff: bool = False) -> pb.Snapshot:
        """Snapshots this sandbox into image ``name`` of its project (see
        :meth:`AsyncClient.create_snapshot`); ``create_sandbox(image=name)`` starts from it. A
        container's snapshot is its file system; a microvm's is its memory, devices and disk
        (``vm_snapshot`` on the result), restored with processes running."""
        return await self.client.create_snapshot(self.id, name, pack_diff=pack_diff)

    async def save_session(self) -> pb.SessionSaved:
        """Saves this sandbox's session now (see :meth:`AsyncClient.save_session`)."""
        return await self.client.save_session(self.id)

    async def set_timeout(
        self,
        *,
        ttl_running_stop_s: Optional[int] = None,
        ttl_max_s: Optional[int] = None,
        ttl_paused_s: Optional[int] = None,
    ) -> "Sandbox":
        """Replaces the TTLs given, as :meth:`AsyncClient.set_sandbox_timeout`; returns ``self``."""
        self.info = (
            await self.client.set_sandbox_timeout(
                self.id, ttl_running_stop_s=ttl_running_stop_s, ttl_max_s=ttl_max_s, ttl_paused_s=ttl_paused_s
            )
        ).info
        return self

    async def update_network(self, egress: Sequence[str]) -> "Sandbox":
        """Replaces the sandbox's egress rules, as :meth:`AsyncClient.update_network`; returns
        ``self``."""
        self.info = (await self.client.update_network(self.id, egress)).info
        return self

    @property
    def egress(self) -> List[str]:
        """The sandbox's egress rules, in text form (as last fetched)."""
        net = self.info.spec.network
        return [egress_text(r) for r in net.egress]

    @property
    def address(self) -> str:
        """The sandbox's IPv4 address on its edge's network ("" without a network)."""
        return self.info.address

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        with contextlib.suppress(errors.NotFound, errors.InvalidState):
            await self.stop()

    # -- shell sessions -------------------------------------------------------------------

    def _exec_request(
        self,
        cmd: str,
        session: Optional[str],
        timeout: Optional[float],
        env: Optional[Mapping[str, str]],
        cwd: Optional[str],
        user: Optional[str],
        request_id: Optional[str],
        max_output_bytes: int = 0,
    ) -> rt.ExecRequest:
        if max_output_bytes < 0:
            raise ValueError("max_output_bytes must be 0 (the agent's default) or more")
        limits = rt.OutputLimits(stdout_max_bytes=max_output_bytes, stderr_max_bytes=max_output_bytes)
        return rt.ExecRequest(
            limits=limits,
            sandbox_id=self.id,
            session_id=session or "",
            command=cmd,
            request_id=check_request_id(request_id) if request_id else new_request_id(),
            timeout_ms=max(1, int(timeout * 1000)) if timeout else 0,
            env=dict(env or {}),
            cwd=cwd or "",
            user=user or "",
        )

    async def run_shell(
        self,
        cmd: str,
        session: Optional[str] = None,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        *,
        request_id: Optional[str] = None,
        max_output_bytes: int = 0,
    ) -> ShellResult:
        """Runs shell text in a session's long-lived shell (cd, exports persist) and waits.

        Args:
            cmd: shell text.
            session: session id (default: the ``"default"`` session).
            timeout: seconds; on timeout the command's processes are killed and
                ``timed_out`` is set (the exit code is not raised as an error).
            env: exported before the command (persist in the session).
            cwd: ``cd`` there first (persists).
            user: the session's user on its first use.
            request_id: ``[A-Za-z0-9._-]{1,128}``; generated when omitted. Retries reuse it,
                so the command runs at most once.
            max_output_bytes: bytes kept per stream (0: the agent's default, 16 MiB; at most
                32 MiB here, as the result carries it all: use :meth:`stream_shell` for more);
                the rest is read, dropped and counted in ``*_dropped_bytes``.
        """
        req = self._exec_request(cmd, session, timeout, env, cwd, user, request_id, max_output_bytes)
        r = await self.client._unary("Runtime", "Exec", req)
        return ShellResult(
            exit_code=r.exit_code,
            stdout_bytes=bytes(r.stdout),
            stderr_bytes=bytes(r.stderr),
            timed_out=r.timed_out,
            cwd=r.cwd,
            request_id=r.request_id or req.request_id,
            stdout_dropped_bytes=r.stdout_dropped_bytes,
            stderr_dropped_bytes=r.stderr_dropped_bytes,
        )

    async def stream_shell(
        self,
        cmd: str,
        session: Optional[str] = None,
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        *,
        request_id: Optional[str] = None,
        max_output_bytes: int = 0,
    ) -> AsyncIterator[Union[OutputChunk, ShellExit]]:
        """Like :meth:`run_shell`, yielding :class:`OutputChunk` items as output comes and a
        final :class:`ShellExit`. After a disconnect it re-attaches with the same request id
        from the offsets already received: nothing is lost or repeated. ``max_output_bytes``
        (per stream; 0: 16 MiB) has no upper bound here: what is kept is recorded in the
        sandbox (on its disk) so that a re-attach can read it again."""
        req = self._exec_request(cmd, session, timeout, env, cwd, user, request_id, max_output_bytes)

        def call(offsets: _Offsets) -> Any:
            req.stdout_offset, req.stderr_offset = offsets.pos["stdout"], offsets.pos["stderr"]
            return req

        def done(x: rt.ExecExit) -> ShellExit:
            return ShellExit(
                x.exit_code, x.timed_out, x.cwd, req.request_id, x.stdout_dropped_bytes, x.stderr_dropped_bytes
            )

        async for item in self._resumable("ExecStream", call, done, _Offsets(), "command"):
            yield item

    async def close_session(self, session: str) -> bool:
        """Ends a session (its shell and processes die). Returns False when it did not exist
        (which a retry after a lost answer also reports)."""
        req = rt.CloseSessionRequest(sandbox_id=self.id, session_id=session)
        return (await self.client._unary("Runtime", "CloseSession", req)).existed

    # -- files ----------------------------------------------------------------------------

    async def iter_file(
        self, path: str, *, session: Optional[str] = None, user: Optional[str] = None, offset: int = 0, length: int = 0
    ) -> AsyncIterator[bytes]:
        """The file's bytes in chunks (``length`` bytes from ``offset``; 0: to the end),
        resuming after a disconnect from the bytes received. ``session``/``user`` choose whose
        view of the filesystem (relative paths from the session's cwd)."""
        pos = offset
        end = offset + length if length else 0
        backoff = self.client._backoff("Runtime/ReadFile")
        while True:
            if end and pos >= end:
                return  # everything asked for arrived before the stream broke
            address = self.client.pool.pick()
            req = rt.ReadFileRequest(
                sandbox_id=self.id, session_id=session or "", path=path, offset=pos,
                length=(end - pos) if end else 0, user=user or "",
            )
            call = self.client._stub("Runtime", address).ReadFile(req, metadata=self.client._metadata())
            try:
                async for chunk in call:
                    data = _fresh(pos, chunk.offset, bytes(chunk.data))
                    pos += len(data)
                    if data:
                        yield data
                self.client.pool.mark_ok(address)
                return
            except grpc.RpcError as e:
                err = self.client._failed(address, e)
                if await self.client._retry_sleep(backoff, err):
                    continue
                raise err from None
            finally:
                call.cancel()

    async def read_file(
        self, path: str, *, session: Optional[str] = None, user: Optional[str] = None, offset: int = 0, length: int = 0
    ) -> bytes:
        """The whole file (or ``length`` bytes from ``offset``)."""
        return b"".join([c async for c in self.iter_file(path, session=session, user=user, offset=offset, length=length)])

    async def write_file(
        self,
        path: str,
        data: Union[bytes, str],
        *,
        session: Optional[str] = None,
        user: Optional[str] = None,
        mode: int = 0,
        append: bool = False,
        make_parents: bool = True,
    ) -> int:
        """Writes ``data`` (str is UTF-8) to ``path``; returns the bytes written. Missing parent
        directories are made (as by :meth:`upload` and ``opendsecctl cp``) unless
        ``make_parents=False``.

        Sent in chunks, ``finish`` on the last: an upload cut short writes nothing. Retried on
        ``unavailable`` unless ``append`` (a repeated append would write twice).
        """
        raw = memoryview(data.encode() if isinstance(data, str) else bytes(data))

        def chunks() -> Iterable[bytes]:
            return (bytes(raw[i:i + WRITE_CHUNK_BYTES]) for i in range(0, len(raw), WRITE_CHUNK_BYTES))

        return await self._write(path, chunks, session, user, mode, append, make_parents)

    async def _write(
        self,
        path: str,
        chunks: Callable[[], Iterable[bytes]],
        session: Optional[str],
        user: Optional[str],
        mode: int,
        append: bool,
        make_parents: bool,
    ) -> int:
        sid = self.id

        async def requests() -> AsyncIterator[rt.WriteFileRequest]:
            it = iter(chunks())
            cur = next(it, b"")  # no chunks (an empty file): one message, with finish
            first = True
            while True:
                nxt = next(it, None)
                req = rt.WriteFileRequest(sandbox_id=sid, session_id=session or "", data=cur, user=user or "")
                if first:
                    req.path, req.append, req.mode, req.make_parents = path, append, mode, make_parents
                    first = False
                if nxt is None:
                    req.finish = True
                    yield req
                    return
                yield req
                cur = nxt

        resp = await self.client._unary("Runtime", "WriteFile", requests, call_class="once" if append else None)
        return resp.bytes_written

    async def upload(
        self,
        local_path: Union[str, os.PathLike],
        remote_path: str,
        *,
        session: Optional[str] = None,
        user: Optional[str] = None,
        mode: Optional[int] = None,
        make_parents: bool = True,
    ) -> int:
        """Copies a local file into the sandbox (its permission bits kept unless ``mode``;
        missing parent directories made unless ``make_parents=False``); returns the bytes
        written. Retried like a whole-file :meth:`write_file`."""
        local = Path(local_path)
        file_mode = mode if mode is not None else local.stat().st_mode & 0o7777

        def chunks() -> Iterable[bytes]:
            with open(local, "rb") as f:
                yield from iter(functools.partial(f.read, WRITE_CHUNK_BYTES), b"")

        return await self._write(remote_path, chunks, session, user, file_mode, False, make_parents)

    async def download(
        self, remote_path: str, local_path: Union[str, os.PathLike], *, session: Optional[str] = None, user: Optional[str] = None
    ) -> int:
        """Copies a sandbox file to a local path (written to ``<name>.part``, then renamed, so
        the local path never holds a partial file); returns the bytes copied."""
        local = Path(local_path)
        tmp = local.with_name(local.name + ".part")
        n = 0
        try:
            with open(tmp, "wb") as f:
                async for c in self.iter_file(remote_path, session=session, user=user):
                    f.write(c)
                    n += len(c)
            os.replace(tmp, local)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return n

    @staticmethod
    def _entry(f: rt.FileInfo) -> FileEntry:
        return FileEntry(
            name=f.name, path=f.path, type=_FILE_TYPES.get(f.type, "other"), size=f.size, mode=f.mode,
            modified_ms=f.modified_ms, uid=f.uid, gid=f.gid, symlink_target=f.symlink_target,
        )

    async def list_dir(self, path: str, *, session: Optional[str] = None, user: Optional[str] = None) -> List[FileEntry]:
        """Entries of a directory (``not_found`` if it does not exist)."""
        req = rt.ListDirRequest(sandbox_id=self.id, session_id=session or "", path=path, user=user or "")
        return [self._entry(f) for f in (await self.client._unary("Runtime", "ListDir", req)).entries]

    async def stat(self, path: str, *, session: Optional[str] = None, user: Optional[str] = None) -> FileEntry:
        """The :class:`FileEntry` of ``path`` (``not_found`` if it does not exist)."""
        req = rt.StatRequest(sandbox_id=self.id, session_id=session or "", path=path, user=user or "")
        return self._entry(await self.client._unary("Runtime", "Stat", req))

    async def make_dir(
        self, path: str, *, parents: bool = True, mode: int = 0, session: Optional[str] = None, user: Optional[str] = None
    ) -> None:
        """Creates a directory (with ``parents``, like ``mkdir -p``: missing parents made, an
        existing directory is fine). Retried only with ``parents``."""
        req = rt.MakeDirRequest(sandbox_id=self.id, session_id=session or "", path=path, parents=parents, mode=mode, user=user or "")
        await self.client._unary("Runtime", "MakeDir", req, call_class=None if parents else "once")

    async def remove(self, path: str, *, recursive: bool = False, session: Optional[str] = None, user: Optional[str] = None) -> None:
        """Removes a file or empty directory (with ``recursive``, a whole tree). Not retried."""
        req = rt.RemoveRequest(sandbox_id=self.id, session_id=session or "", path=path, recursive=recursive, user=user or "")
        await self.client._unary("Runtime", "Remove", req)

    async def move(self, src: str, dst: str, *, session: Optional[str] = None, user: Optional[str] = None) -> None:
        """Renames ``src`` to ``dst`` inside the sandbox. Not retried."""
        req = rt.MoveRequest(sandbox_id=self.id, session_id=session or "", to=dst, user=user or "")
        setattr(req, "from", src)
        await self.client._unary("Runtime", "Move", req)

    # -- processes ------------------------------------------------------------------------

    async def start_process(
        self,
        cmd: Sequence[str],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        tag: Optional[str] = None,
        pty: Optional[Tuple[int, int]] = None,
    ) -> int:
        """Starts a process outside sessions (argv, ``cmd[0]`` looked up in PATH); returns
        its pid. ``tag`` names it (unique among running processes); ``pty=(rows, cols)``
        runs it on a terminal. Not retried."""
        req = rt.StartProcessRequest(
            sandbox_id=self.id, cmd=list(cmd), env=dict(env or {}), cwd=cwd or "", user=user or "", tag=tag or ""
        )
        if pty is not None:
            req.pty.rows, req.pty.cols = pty
        return (await self.client._unary("Runtime", "StartProcess", req)).pid

    async def connect_process(
        self, process: ProcessRef, *, stdout_offset: int = 0, stderr_offset: int = 0
    ) -> AsyncIterator[Union[OutputChunk, ProcessExit]]:
        """The process's output from the offsets, then a :class:`ProcessExit`; re-attaches
        after a disconnect from the bytes received (the process keeps running meanwhile)."""
        offsets = _Offsets()
        offsets.pos.update(stdout=stdout_offset, stderr=stderr_offset)

        def call(o: _Offsets) -> Any:
            return rt.ConnectProcessRequest(
                sandbox_id=self.id, process=_selector(process),
                stdout_offset=o.pos["stdout"], stderr_offset=o.pos["stderr"],
            )

        async for item in self._resumable(
            "ConnectProcess", call, lambda x: ProcessExit(x.exit_code, x.signal), offsets, "process"
        ):
            yield item

    async def _resumable(
        self,
        method: str,
        request: Callable[[_Offsets], Any],
        on_exit: Callable[[Any], Any],
        offsets: _Offsets,
        what: str,
    ) -> AsyncIterator[Any]:
        """A stream of output events ending in an exit (``ExecStream``, ``ConnectProcess``):
        output as it comes, then ``on_exit(exit)``. A disconnect, or an end without an exit,
        re-attaches with ``request(offsets)`` (the offsets received so far; overlap trimmed)
        within ``retry_timeout``."""
        backoff = self.client._backoff(f"Runtime/{method}")
        while True:
            address = self.client.pool.pick()
            call = getattr(self.client._stub("Runtime", address), method)(
                request(offsets), metadata=self.client._metadata()
            )
            try:
                async for ev in call:
                    kind = ev.WhichOneof("kind")
                    if kind == "output":
                        out = offsets.accept(ev.output)
                        if out is not None:
                            yield out
                    elif kind == "exit":
                        yield on_exit(ev.exit)
                        self.client.pool.mark_ok(address)
                        return
            except grpc.RpcError as e:
                err = self.client._failed(address, e)
                if await self.client._retry_sleep(backoff, err):
                    continue
                raise err from None
            finally:
                call.cancel()
            err = errors.Unavailable(f"the {what}'s stream ended without an exit")
            if not await self.client._retry_sleep(backoff, err):
                raise err

    async def wait_process(self, process: ProcessRef) -> Tuple[ProcessExit, bytes, bytes]:
        """Collects a process's whole output and waits for its exit: ``(exit, stdout, stderr)``."""
        out: Dict[str, List[bytes]] = {"stdout": [], "stderr": []}
        async for ev in self.connect_process(process):
            if isinstance(ev, ProcessExit):
                return ev, b"".join(out["stdout"]), b"".join(out["stderr"])
            out[ev.stream].append(ev.data)
        raise errors.Internal("process stream ended without an exit")

    async def send_input(self, process: ProcessRef, data: Union[bytes, str] = b"", *, eof: bool = False) -> None:
        """Writes to the process's stdin (``eof`` closes it afterwards). Not retried."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        req = rt.SendInputRequest(sandbox_id=self.id, process=_selector(process), data=raw, eof=eof)
        await self.client._unary("Runtime", "SendInput", req)

    async def signal_process(self, process: ProcessRef, signal: int = 15) -> None:
        """Sends a signal number to the process (default 15, SIGTERM). Not retried."""
        req = rt.SignalProcessRequest(sandbox_id=self.id, process=_selector(process), signal=signal)
        await self.client._unary("Runtime", "SignalProcess", req)

    async def list_processes(self) -> List[ProcessInfo]:
        """Processes started with :meth:`start_process`, running or exited."""
        resp = await self.client._unary("Runtime", "ListProcesses", rt.ListProcessesRequest(sandbox_id=self.id))
        return [
            ProcessInfo(
                pid=p.pid, tag=p.tag, cmd=list(p.cmd), running=p.running,
                exit=ProcessExit(p.exit.exit_code, p.exit.signal) if p.HasField("exit") else None,
            )
            for p in resp.processes
        ]

    # -- HTTP -----------------------------------------------------------------------------

    async def http_request(
        self,
        port: int,
        path: str = "/",
        *,
        method: str = "GET",
        headers: Optional[Mapping[str, str]] = None,
        body: bytes = b"",
        timeout: Optional[float] = None,
    ) -> rt.HttpRequestResponse:
        """One HTTP/1.1 request to ``127.0.0.1:<port>`` inside the sandbox (retried only for
        GET/HEAD); returns the raw ``opendsec.v1.HttpRequestResponse`` (status, headers, body).
        ``timeout`` is in seconds."""
        method = method.upper()  # "get" means GET here
        req = rt.HttpRequestRequest(
            sandbox_id=self.id, port=port, method=method, path=path,
            headers=[rt.HttpHeader(name=k, value=v) for k, v in (headers or {}).items()],
            body=body, timeout_ms=max(1, int(timeout * 1000)) if timeout else 0,
        )
        return await self.client._unary("Runtime", "HttpRequest", req, call_class="repeat" if method in ("GET", "HEAD") else None)
