"""Unit tests: error mapping and the catalogue, addresses, backoff, ids, retry safety against
an in-process fake apiserver, and docs/sdk-reference.md being current."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

import opendsec
from opendsec import errors
from opendsec._ids import LEASE_ID_RE, REQUEST_ID_RE, check_lease_id, new_lease_id, new_request_id
from opendsec._net import AddressPool, Backoff, parse_addresses
from opendsec._pb import opendsec_pb2 as pb
from opendsec._pb import opendsec_pb2_grpc as pb_grpc
from opendsec._pb import runtime_pb2 as rt
from opendsec._pb import runtime_pb2_grpc as rt_grpc

REPO = Path(__file__).resolve().parents[3]


# -- the catalogue ----------------------------------------------------------------------------


def errors_doc() -> str:
    """docs/errors.md up to its retry policy (the reasons' table)."""
    return (REPO / "docs" / "errors.md").read_text().split("\n## Retries")[0]


def doc_reasons() -> List[str]:
    doc = errors_doc()
    return [l.split("|")[1].strip().strip("`") for l in doc.splitlines() if l.startswith("| `")]


def rust_reasons() -> List[str]:
    src = (REPO / "crates" / "common" / "src" / "reason.rs").read_text()
    body = src[src.index("pub fn as_str"):]
    body = body[: body.index("\n    }\n")]
    return re.findall(r'=>\s*"([a-z_]+)"', body)


def test_sdk_reasons_equal_docs_and_rust_catalogue() -> None:
    sdk = [c.reason for c in errors.ALL]
    assert doc_reasons() == sdk
    assert rust_reasons() == sdk
    assert len(set(sdk)) == len(sdk)


def test_sdk_codes_equal_docs() -> None:
    doc = errors_doc()
    rows = [[c.strip() for c in l.split("|")] for l in doc.splitlines() if l.startswith("| `")]
    for row, cls in zip(rows, errors.ALL):
        assert row[2] == cls.grpc_code.name, cls
        assert int(row[5]) == errors.EXIT_CODES[cls.reason], cls
        assert type(errors.from_exit_code(int(row[5]), "m")) is cls
    assert errors.from_exit_code(1, "local") is None and errors.from_exit_code(0, "") is None


def test_one_class_per_reason_under_one_base() -> None:
    for cls in errors.ALL:
        assert issubclass(cls, errors.OpendsecError)
        assert getattr(errors, cls.__name__) is cls
        assert errors.BY_REASON[cls.reason] is cls
        assert "".join(p.title() for p in cls.reason.split("_")) == cls.__name__


def details(reason: str, meta: dict, domain: str = "opendsec") -> bytes:
    info = error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata=meta)
    a = any_pb2.Any()
    a.Pack(info)
    return status_pb2.Status(code=8, message="m", details=[a]).SerializeToString()


@pytest.mark.parametrize("cls", errors.ALL, ids=lambda c: c.reason)
def test_error_info_maps_to_its_class(cls) -> None:
    md = [("grpc-status-details-bin", details(cls.reason, {"k": "v"}))]
    e = errors.from_status(cls.grpc_code, "boom", md)
    assert type(e) is cls
    assert (e.reason, e.message, e.metadata, e.has_error_info) == (cls.reason, "boom", {"k": "v"}, True)
    assert str(e) == f"{cls.reason}: boom"


def test_missing_or_foreign_error_info_falls_back_to_the_code() -> None:
    assert type(errors.from_status(grpc.StatusCode.UNAVAILABLE, "refused", [])) is errors.Unavailable
    assert type(errors.from_status(grpc.StatusCode.CANCELLED, "", None)) is errors.Unavailable
    assert type(errors.from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "", None)) is errors.RateLimited
    assert type(errors.from_status(grpc.StatusCode.ABORTED, "", None)) is errors.InvalidState
    assert type(errors.from_status(grpc.StatusCode.UNKNOWN, "", None)) is errors.Internal
    assert type(errors.from_status(grpc.StatusCode.OUT_OF_RANGE, "", None)) is errors.InvalidArgument
    foreign = [("grpc-status-details-bin", details("not_found", {}, domain="other"))]
    e = errors.from_status(grpc.StatusCode.UNAVAILABLE, "", foreign)
    assert type(e) is errors.Unavailable and not e.has_error_info
    garbage = [("grpc-status-details-bin", b"\xff\xff")]
    assert type(errors.from_status(grpc.StatusCode.NOT_FOUND, "", garbage)) is errors.NotFound


def test_rate_limited_hint() -> None:
    md = [("grpc-status-details-bin", details("rate_limited", {"retry_after_ms": "1500"}))]
    e = errors.from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down", md)
    assert isinstance(e, errors.RateLimited) and e.retry_after_s == 1.5 and e.retryable


def test_detail_maps_to_class() -> None:
    assert type(errors.from_detail("no_capacity", "full")) is errors.NoCapacity
    assert type(errors.from_detail("what", "x")) is errors.Internal


# -- addresses and backoff ------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_parse_addresses(monkeypatch) -> None:
    monkeypatch.setenv("OPENDSEC_ADDR", " a:1, http://b:2/ ,,c:3")
    assert parse_addresses(None) == ["a:1", "b:2", "c:3"]
    assert parse_addresses(["x:1", " y:2 "]) == ["x:1", "y:2"]
    monkeypatch.delenv("OPENDSEC_ADDR")
    with pytest.raises(ValueError):
        AddressPool(parse_addresses(None))


def test_round_robin_and_avoidance() -> None:
    clock = FakeClock()
    pool = AddressPool(["a", "b", "c"], avoid_s=10, clock=clock)
    assert [pool.pick() for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    pool.mark_broken("b")
    assert [pool.pick() for _ in range(4)] == ["a", "c", "a", "c"]
    clock.t += 10.5
    assert sorted(pool.pick() for _ in range(3)) == ["a", "b", "c"]
    pool.mark_broken("a")
    pool.mark_broken("b")
    pool.mark_broken("c")
    clock.t += 1
    pool.mark_broken("a")
    assert pool.pick() == "b"  # all avoided: the one whose avoidance ends first
    pool.mark_ok("c")
    assert pool.pick() == "c"


def test_backoff_grows_and_respects_budget() -> None:
    clock = FakeClock()
    b = Backoff(retry_timeout=3, base=0.1, cap=1.0, clock=clock, rand=lambda: 1.0)
    delays = []
    while (d := b.next_delay()) is not None:
        delays.append(d)
        clock.t += d
    assert delays[:4] == [0.1, 0.2, 0.4, 0.8]
    assert max(delays) <= 1.0
    assert sum(delays) == pytest.approx(3.0)
    assert Backoff(5, clock=clock).next_delay(hint=2.5) >= 2.5
    # Full jitter: a draw of 0 waits nothing (unless hinted); the budget still cuts a hint.
    z = Backoff(retry_timeout=3, clock=clock, rand=lambda: 0.0)
    assert z.next_delay() == 0.0 and z.next_delay(hint=10) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        Backoff(call_class="sometimes")


# -- the retry policy: the same table in docs/errors.md, the SDK and the Rust client ---------


def doc_retry_tables():
    doc = (REPO / "docs" / "errors.md").read_text()
    section = doc[doc.index("## Retries"):]
    classes, calls = {}, {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.split("|")]
        name = cells[1].strip("`")
        if "/" in name:
            calls[name] = cells[2].strip("`")
        else:
            classes[name] = frozenset(r.strip().strip("`") for r in cells[2].split(",") if r.strip() not in ("", "none"))
    return classes, calls


def rust_retry_calls():
    src = (REPO / "crates" / "common" / "src" / "retry.rs").read_text()
    return {m: c.lower() for m, c in re.findall(r'\("([A-Za-z]+/[A-Za-z]+)", ([A-Z][a-z]+)\)', src)}


def test_retry_policy_equals_docs_and_rust() -> None:
    from opendsec._net import CALLS, CLASS_RETRIES
    classes, calls = doc_retry_tables()
    assert classes == CLASS_RETRIES
    assert calls == CALLS
    assert rust_retry_calls() == CALLS
    assert list(rust_retry_calls()) == list(CALLS)  # and in the same order
    # Every reason a class retries is a reason of the catalogue, and `retryable` says whether
    # any class retries it.
    every = frozenset().union(*CLASS_RETRIES.values())
    assert every <= {c.reason for c in errors.ALL}
    for cls in errors.ALL:
        assert cls.retryable == (cls.reason in every), cls


# -- ids --------------------------------------------------------------------------------------


def test_ids() -> None:
    leases = {new_lease_id() for _ in range(1000)}
    assert len(leases) == 1000
    assert all(LEASE_ID_RE.match(l) and len(l) == 24 for l in leases)
    reqs = {new_request_id() for _ in range(1000)}
    assert len(reqs) == 1000 and all(REQUEST_ID_RE.match(r) for r in reqs)
    assert check_lease_id("job-1") == "job-1"
    for bad in ("", "Upper", "-lead", "a" * 41, "under_score"):
        with pytest.raises(ValueError):
            check_lease_id(bad)


def test_backend_is_required() -> None:
    c = opendsec.AsyncClient("127.0.0.1:1", token="t", insecure_plaintext=True)
    with pytest.raises(ValueError):
        asyncio.run(c.create_sandbox("", "img"))


def test_the_runtime_requirements_are_what_the_generated_code_checks() -> None:
    """The install asks for the grpcio and protobuf the generated modules accept at import: a
    looser bound once let pip install grpcio 1.85.3 under code generated by grpcio-tools 1.85.4,
    which then refused to load."""
    from importlib.metadata import requires, version

    reqs = requires("opendsec") or []
    assert f"grpcio>={pb_grpc.GRPC_GENERATED_VERSION}" in reqs, reqs
    source = Path(pb.__file__).read_text()
    m = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", source)
    assert m, "the generated code no longer checks the protobuf runtime version"
    major, minor, patch = m.groups()
    assert f"protobuf<{int(major) + 1},>={major}.{minor}.{patch}" in reqs or (
        f"protobuf>={major}.{minor}.{patch},<{int(major) + 1}" in reqs
    ), reqs
    assert version("protobuf").split(".")[0] == major


# -- retry safety against a fake apiserver ----------------------------------------------------


class FlakySandboxes(pb_grpc.SandboxesServicer):
    """Fails the first `fail` calls with a bare UNAVAILABLE after recording the request."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.leases: List[str] = []
        self.tokens: List[str] = []

    async def CreateSandbox(self, request, context):
        self.leases.append(request.lease_id)
        self.tokens.append(dict(context.invocation_metadata()).get("authorization", ""))
        if self.full > 0:
            self.full -= 1
            await self._refuse_full(context)
        if self.fail > 0:
            self.fail -= 1
            # Alternately a bare UNAVAILABLE and a DEADLINE_EXCEEDED (an edge slower than the
            # apiserver's deadline: the sandbox may exist; the same lease id finds it).
            code = grpc.StatusCode.UNAVAILABLE if self.fail % 2 else grpc.StatusCode.DEADLINE_EXCEEDED
            await context.abort(code, "try again")
        return pb.Sandbox(id="e." + request.lease_id, spec=request.spec, state=pb.SANDBOX_STATE_RUNNING)

    full: int = 0  # creations refused with no_capacity before the `fail` ones

    async def _refuse_full(self, context) -> None:
        details = status_pb2.Status(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="every edge is full")
        info = error_details_pb2.ErrorInfo(reason="no_capacity", domain="opendsec")
        any_info = any_pb2.Any()
        any_info.Pack(info)
        details.details.append(any_info)
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "every edge is full",
            trailing_metadata=(("grpc-status-details-bin", details.SerializeToString()),),
        )

    async def PauseSandbox(self, request, context):
        # A `repeat` call: refused twice, then answered (a repeat finds the state reached).
        self.leases.append("pause")
        if self.leases.count("pause") <= 2:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "try again")
        return pb.Sandbox(id=request.id, state=pb.SANDBOX_STATE_PAUSED)


class FlakyRuntime(rt_grpc.RuntimeServicer):
    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.request_ids: List[str] = []

    async def Exec(self, request, context):
        self.request_ids.append(request.request_id)
        if self.fail > 0:
            self.fail -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "try again")
        return rt.ExecResult(exit_code=0, stdout=b"ok", request_id=request.request_id)

    async def StartProcess(self, request, context):
        # A `once` call: refused as UNAVAILABLE, which must not be repeated.
        self.request_ids.append("start")
        await context.abort(grpc.StatusCode.UNAVAILABLE, "try again")


async def serve(fail: int):
    server = grpc.aio.server()
    sbx, rtm = FlakySandboxes(fail), FlakyRuntime(fail)
    pb_grpc.add_SandboxesServicer_to_server(sbx, server)
    rt_grpc.add_RuntimeServicer_to_server(rtm, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", sbx, rtm


async def test_create_retries_with_the_same_lease_id() -> None:
    server, addr, sbx, _ = await serve(fail=2)
    try:
        async with opendsec.AsyncClient(addr, token="tok", project="root/p", retry_timeout=20, insecure_plaintext=True) as c:
            sb = await c.create_sandbox("sim", labels={"x": "y"})
        assert len(sbx.leases) == 3 and len(set(sbx.leases)) == 1
        assert sb.id == "e." + sbx.leases[0] and sb.state == "running" and sb.labels == {"x": "y"}
        assert sb.info.spec.project == "root/p" and sb.backend == "sim"
        assert sbx.tokens == ["Bearer tok"] * 3
    finally:
        await server.stop(None)


async def test_after_no_capacity_a_creation_takes_a_fresh_lease_unless_the_caller_chose_it() -> None:
    # The refused lease id names a FAILED sandbox at the edge: repeating it would answer that.
    server, addr, sbx, _ = await serve(fail=0)
    sbx.full = 2
    try:
        async with opendsec.AsyncClient(addr, token="tok", retry_timeout=20, insecure_plaintext=True) as c:
            sb = await c.create_sandbox("sim")
            assert len(sbx.leases) == 3 and len(set(sbx.leases)) == 3 and sb.id == "e." + sbx.leases[-1]
            sbx.full, sbx.leases = 1, []
            with pytest.raises(errors.NoCapacity):
                await c.create_sandbox("sim", lease_id="my-key")
            assert sbx.leases == ["my-key"]
    finally:
        await server.stop(None)


async def test_run_shell_retries_with_the_same_request_id() -> None:
    server, addr, _, rtm = await serve(fail=2)
    try:
        async with opendsec.AsyncClient(addr, token="tok", retry_timeout=20, insecure_plaintext=True) as c:
            r = await c.sandbox("e.l").run_shell("echo")
        assert r.stdout == "ok" and len(rtm.request_ids) == 3 and len(set(rtm.request_ids)) == 1
    finally:
        await server.stop(None)


async def test_once_calls_are_made_once_and_repeat_calls_are_retried() -> None:
    server, addr, sbx, rtm = await serve(fail=0)
    try:
        async with opendsec.AsyncClient(addr, token="tok", retry_timeout=20, insecure_plaintext=True) as c:
            with pytest.raises(errors.Unavailable):
                await c.sandbox("e.l").start_process(["sleep", "1"])
            assert rtm.request_ids == ["start"]
            sb = await c.pause_sandbox("e.l")
        assert sb.state == "paused" and sbx.leases == ["pause"] * 3
    finally:
        await server.stop(None)


async def test_a_retry_waits_at_least_the_servers_hint(monkeypatch) -> None:
    slept: List[float] = []

    async def sleep(d: float) -> None:
        slept.append(d)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    async with opendsec.AsyncClient("127.0.0.1:1", token="t", insecure_plaintext=True) as c:
        limited = errors.RateLimited("slow down", metadata={"retry_after_ms": "1500"})
        assert await c._retry_sleep(c._backoff("Sandboxes/GetSandbox"), limited)
        assert slept == [1.5]
        # A class that does not retry the reason, and a `once` call: no sleep, give up.
        assert not await c._retry_sleep(c._backoff("Sandboxes/GetSandbox"), errors.NoCapacity("full"))
        assert c._backoff("Runtime/StartProcess") is None
        assert await c._retry_sleep(c._backoff("Sandboxes/CreateSandbox"), errors.NoCapacity("full"))
        assert len(slept) == 2


async def test_retry_gives_up_after_retry_timeout(dead_address: str) -> None:
    # A server that never creates (unavailable / deadline exceeded in turn): retried, the same
    # lease each time, then given up with the last answer.
    server, addr, sbx, _ = await serve(fail=10**9)
    try:
        async with opendsec.AsyncClient(addr, token="tok", retry_timeout=0.5, insecure_plaintext=True) as c:
            with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
                await c.create_sandbox("sim")
        assert len(sbx.leases) > 1 and len(set(sbx.leases)) == 1
    finally:
        await server.stop(None)
    # Nothing listening at all: the same, as a transport failure.
    async with opendsec.AsyncClient(dead_address, token="tok", retry_timeout=0.5, insecure_plaintext=True) as c:
        with pytest.raises(errors.Unavailable):
            await c.get_sandbox("e.l")


async def test_a_dead_address_is_avoided(dead_address: str) -> None:
    server, addr, sbx, _ = await serve(fail=0)
    dead = dead_address
    try:
        async with opendsec.AsyncClient([dead, addr], token="tok", retry_timeout=20, insecure_plaintext=True) as c:
            for _ in range(6):
                await c.create_sandbox("sim")
            assert c.pool.is_avoided(dead) and not c.pool.is_avoided(addr)
        # Every creation landed once.
        assert len(sbx.leases) == 6 and len(set(sbx.leases)) == 6
    finally:
        await server.stop(None)


class BatchSandboxes(pb_grpc.SandboxesServicer):
    """A batch endpoint whose first call refuses every odd item with ``no_capacity`` (as an
    edge under pressure would) and one whose items are a permanent ``quota_exceeded``."""

    def __init__(self, permanent: bool = False, first_call_delay: float = 0.0) -> None:
        self.counts: List[int] = []
        self.permanent = permanent
        self.first_call_delay = first_call_delay
        self.made = 0

    async def CreateSandboxes(self, request, context):
        first = not self.counts
        self.counts.append(request.count)
        if first:
            await asyncio.sleep(self.first_call_delay)
        for i in range(request.count):
            if self.permanent and first and i == 0:
                yield pb.CreateSandboxesResponse(index=i, error=pb.ErrorDetail(reason="quota_exceeded", message="over"))
            elif first and i % 2 == 1:
                yield pb.CreateSandboxesResponse(index=i, error=pb.ErrorDetail(reason="no_capacity", message="cpu pressure"))
            else:
                self.made += 1
                yield pb.CreateSandboxesResponse(
                    index=i, sandbox=pb.Sandbox(id=f"e.s{self.made}", spec=request.spec, state=pb.SANDBOX_STATE_RUNNING)
                )


async def serve_batch(permanent: bool = False, first_call_delay: float = 0.0):
    server = grpc.aio.server()
    sbx = BatchSandboxes(permanent, first_call_delay)
    pb_grpc.add_SandboxesServicer_to_server(sbx, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", sbx


async def test_batch_items_refused_for_a_passing_reason_are_asked_for_again() -> None:
    server, addr, sbx = await serve_batch()
    progress: List[int] = []
    try:
        async with opendsec.AsyncClient(addr, token="tok", retry_timeout=20, insecure_plaintext=True) as c:
            got = await c.create_sandboxes(7, "sim", on_progress=lambda d, n: progress.append(d))
        # One call for 7, then one for the 3 refused; every slot filled once, in order.
        assert sbx.counts == [7, 3]
        assert len({s.id for s in got}) == 7 and all(s.state == "running" for s in got)
        assert progress == list(range(1, 8))
    finally:
        await server.stop(None)


async def test_a_slow_first_batch_call_does_not_use_up_the_retry_budget() -> None:
    server, addr, sbx = await serve_batch(first_call_delay=0.6)
    try:
        async with opendsec.AsyncClient(addr, token="tok", retry_timeout=0.5, insecure_plaintext=True) as c:
            got = await c.create_sandboxes(4, "sim")
        assert sbx.counts == [4, 2] and len({s.id for s in got}) == 4
    finally:
        await server.stop(None)


async def test_batch_retry_can_be_turned_off_and_permanent_errors_are_not_retried() -> None:
    server, addr, sbx = await serve_batch()
    try:
        async with opendsec.AsyncClient(addr, token="tok", retry_timeout=20, insecure_plaintext=True) as c:
            got = await c.create_sandboxes(4, "sim", retry=False, return_exceptions=True)
        assert sbx.counts == [4]
        assert [type(r).__name__ for r in got] == ["Sandbox", "NoCapacity", "Sandbox", "NoCapacity"]
    finally:
        await server.stop(None)
    server, addr, sbx = await serve_batch(permanent=True)
    try:
        async with opendsec.AsyncClient(addr, token="tok", retry_timeout=20, insecure_plaintext=True) as c:
            with pytest.raises(errors.QuotaExceeded) as e:
                await c.create_sandboxes(2, "sim")
        # Item 1 was retried once (no_capacity), item 0 (quota) never; the made one is listed.
        assert sbx.counts == [2, 1] and [s.id for s in e.value.created] == ["e.s1"]
    finally:
        await server.stop(None)


def test_the_sync_facade_wraps_handles_and_batch_errors() -> None:
    loop = asyncio.new_event_loop()
    server, addr, _ = loop.run_until_complete(serve_batch(permanent=True))
    import threading

    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        with opendsec.Client(addr, token="tok", retry_timeout=5, insecure_plaintext=True) as c:
            assert type(c.sandbox("e.l")).__name__ == "SyncSandbox"
            with pytest.raises(errors.QuotaExceeded) as e:
                c.create_sandboxes(2, "sim")
            assert [type(s).__name__ for s in e.value.created] == ["SyncSandbox"]
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)


class ChunkRuntime(rt_grpc.RuntimeServicer):
    """Sends the asked-for range then breaks the stream (the answer arrived whole)."""

    def __init__(self) -> None:
        self.requests: List[tuple] = []

    async def ReadFile(self, request, context):
        self.requests.append((request.offset, request.length))
        yield rt.FileChunk(offset=request.offset, data=b"x" * request.length)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "cut")


async def test_a_ranged_read_cut_after_its_last_byte_does_not_read_on() -> None:
    server = grpc.aio.server()
    rtm = ChunkRuntime()
    rt_grpc.add_RuntimeServicer_to_server(rtm, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with opendsec.AsyncClient(f"127.0.0.1:{port}", token="tok", retry_timeout=20, insecure_plaintext=True) as c:
            data = await c.sandbox("e.l").read_file("/f", offset=10, length=5)
        assert data == b"xxxxx" and rtm.requests == [(10, 5)]
    finally:
        await server.stop(None)


# -- the generated reference ------------------------------------------------------------------


def test_sdk_reference_is_current() -> None:
    here = Path(__file__).resolve().parent
    script = here / ".." / "tools" / "gen_reference.py"
    committed = here / ".." / ".." / ".." / "docs" / "sdk-reference.md"
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, cwd=here
    ).stdout
    assert committed.read_text() == out, (
        "docs/sdk-reference.md is out of date with the SDK's docstrings; regenerate it from the "
        "repository root with: pip install ./sdk/python && "
        "target/sdk-venv/bin/python sdk/python/tools/gen_reference.py > docs/sdk-reference.md"
    )


def test_tls_settings_never_default_to_plain_text(monkeypatch, tmp_path) -> None:
    from opendsec.client import PUBLIC_TLS_NAME, _tls_settings

    for k in ("OPENDSEC_CA", "OPENDSEC_INSECURE_PLAINTEXT", "OPENDSEC_TLS_NAME"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="no CA"):
        _tls_settings(None, None, None)
    with pytest.raises(ValueError, match="no CA"):
        opendsec.AsyncClient("127.0.0.1:1", token="t")
    assert _tls_settings(None, None, True) == (None, PUBLIC_TLS_NAME, True)
    assert _tls_settings("/x/ca.pem", "api.example.com", None) == ("/x/ca.pem", "api.example.com", False)
    with pytest.raises(ValueError, match="not both"):
        _tls_settings("/x/ca.pem", None, True)
    # From the environment, and arguments over it.
    monkeypatch.setenv("OPENDSEC_CA", "/env/ca.pem")
    assert _tls_settings(None, None, None) == ("/env/ca.pem", PUBLIC_TLS_NAME, False)
    assert _tls_settings(None, None, True) == (None, PUBLIC_TLS_NAME, True)
    monkeypatch.setenv("OPENDSEC_INSECURE_PLAINTEXT", "1")
    with pytest.raises(ValueError, match="both set"):
        _tls_settings(None, None, None)
    monkeypatch.delenv("OPENDSEC_CA")
    assert _tls_settings(None, None, None) == (None, PUBLIC_TLS_NAME, True)
    # A CA that cannot be read fails at once, naming the file.
    monkeypatch.delenv("OPENDSEC_INSECURE_PLAINTEXT")
    with pytest.raises(ValueError, match="missing.pem"):
        opendsec.AsyncClient("127.0.0.1:1", token="t", ca=tmp_path / "missing.pem")


def test_egress_rules_split_into_their_parts() -> None:
    r = opendsec.egress_rule("203.0.113.0/24:tcp/80-90")
    assert (r.target, r.protocol, r.port_min, r.port_max) == ("203.0.113.0/24", "tcp", 80, 90)
    assert opendsec.egress_text(r) == "203.0.113.0/24:tcp/80-90"
    for t in ["pypi.org", "@pypi", "*:udp/53", "x.org:icmp"]:
        assert opendsec.egress_text(opendsec.egress_rule(t)) == t
    with pytest.raises(ValueError):
        opendsec.egress_rule("x.org:tcp/http")
    with pytest.raises(ValueError):
        opendsec.egress_rule("")
