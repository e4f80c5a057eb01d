"""E2B's Python SDK (``e2b``, pinned in the Makefile), unmodified, against the gateway: every
call of reference/e2b-protocol.md section 6.1 and the behaviours a user relies on."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FileNotFoundException,
    Sandbox,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException


def test_lifecycle_and_io(gateway):
    sbx = Sandbox.create(template="base", timeout=120, metadata={"suite": "gw"}, envs={"FOO": "bar"})
    try:
        r = sbx.commands.run("echo hi")
        assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "", 0)
        assert sbx.commands.run("echo $FOO").stdout == "bar\n"  # the sandbox's envVars
        assert sbx.commands.run("pwd").stdout == "/home/user\n"  # default cwd: the home
        assert sbx.commands.run("whoami").stdout == "user\n"  # default user
        assert sbx.commands.run("whoami", user="root").stdout == "root\n"
        assert sbx.commands.run("echo $X; pwd", envs={"X": "1"}, cwd="/tmp").stdout == "1\n/tmp\n"
        with pytest.raises(CommandExitException) as e:
            sbx.commands.run("echo oops >&2; exit 3")
        assert e.value.exit_code == 3 and e.value.stderr == "oops\n"
        h = sbx.commands.run("sleep 1; echo done", background=True)
        assert h.pid > 0 and h.wait().stdout == "done\n"
        h = sbx.commands.run("cat", background=True, stdin=True, timeout=0)
        sbx.commands.send_stdin(h.pid, "abc")
        sbx.commands.close_stdin(h.pid)
        assert h.wait().stdout == "abc"
        # Without stdin, a reader sees end of file at once.
        assert sbx.commands.run("cat; echo eof").stdout == "eof\n"

        w = sbx.files.write("/home/user/hello.txt", "hello")
        assert (w.path, w.name) == ("/home/user/hello.txt", "hello.txt")
        assert sbx.files.read("/home/user/hello.txt") == "hello"
        assert sbx.files.read("hello.txt") == "hello"  # relative to the home
        assert sbx.commands.run("stat -c %U /home/user/hello.txt").stdout == "user\n"
        sbx.files.write("/tmp/bin.dat", b"\x00\x01", use_octet_stream=True)
        assert sbx.files.read("/tmp/bin.dat", format="bytes") == bytearray(b"\x00\x01")
        with pytest.raises(FileNotFoundException):
            sbx.files.read("/nope")
        assert "hello.txt" in [e.name for e in sbx.files.list("/home/user")]
        assert sbx.files.exists("/home/user/hello.txt") and not sbx.files.exists("/nope")
        assert sbx.files.make_dir("/tmp/d") is True and sbx.files.make_dir("/tmp/d") is False
        sbx.files.rename("/tmp/d", "/tmp/e")
        assert sbx.files.exists("/tmp/e") and not sbx.files.exists("/tmp/d")
        sbx.files.remove("/tmp/e")
        assert not sbx.files.exists("/tmp/e")
        assert sbx.commands.kill(999999) is False

        ids = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"suite": "gw"})).next_items()]
        assert sbx.sandbox_id in ids
        assert sbx.is_running() and sbx.get_info().state == SandboxState.RUNNING
        sbx.set_timeout(300)

        assert sbx.pause() is True and sbx.pause() is False
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        assert sbx.is_running() is False  # envd's route answers 502
        sbx2 = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert sbx2.sandbox_id == sbx.sandbox_id and sbx2.files.read("/home/user/hello.txt") == "hello"
        assert sbx2.is_running()
    finally:
        assert Sandbox.kill(sbx.sandbox_id) is True
    assert Sandbox.kill(sbx.sandbox_id) is False  # 404 -> False


def test_a_background_command_outlives_its_client_and_connect_reattaches(gateway):
    with Sandbox.create() as sbx:
        h = sbx.commands.run("for i in 1 2 3; do echo tick $i; sleep 1; done; echo finished", background=True, timeout=0)
        pid = h.pid
        h.disconnect()
        assert pid in [p.pid for p in sbx.commands.list()]
        again = sbx.commands.connect(pid)
        r = again.wait()
        assert r.stdout.endswith("finished\n") and r.exit_code == 0
        assert pid not in [p.pid for p in sbx.commands.list()]


def test_kill_and_timeouts(gateway):
    with Sandbox.create() as sbx:
        h = sbx.commands.run("sleep 60", background=True)
        assert sbx.commands.kill(h.pid) is True
        with pytest.raises(CommandExitException) as e:
            h.wait()
        assert e.value.exit_code == -1
        with pytest.raises(TimeoutException):
            sbx.commands.run("sleep 30", timeout=2)
        # The timeout killed the process, connected or not.
        time.sleep(0.5)
        assert not any("sleep 30" in " ".join(p.args) for p in sbx.commands.list())


def test_binary_files_round_trip_in_both_upload_forms(gateway):
    data = bytes(range(256)) * 4096  # 1 MiB of every byte value
    with Sandbox.create() as sbx:
        sbx.files.write("/tmp/a.bin", data)
        sbx.files.write("/tmp/b.bin", data, use_octet_stream=True)
        for p in ("/tmp/a.bin", "/tmp/b.bin"):
            assert bytes(sbx.files.read(p, format="bytes")) == data
        infos = sbx.files.write_files([{"path": "/tmp/m/one.txt", "data": "1"}, {"path": "/tmp/m/two.txt", "data": b"2"}])
        assert [i.path for i in infos] == ["/tmp/m/one.txt", "/tmp/m/two.txt"]
        assert sbx.commands.run("cat /tmp/m/one.txt /tmp/m/two.txt").stdout == "12"
        info = sbx.files.get_info("/tmp/a.bin")
        assert info.size == len(data) and info.name == "a.bin"
        deep = sbx.files.list("/tmp", depth=2)
        assert "/tmp/m/one.txt" in [e.path for e in deep]


def test_pty(gateway):
    from e2b import PtySize

    with Sandbox.create() as sbx:
        t = sbx.pty.create(PtySize(rows=24, cols=80), timeout=30)
        sbx.pty.resize(t.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(t.pid, b"stty size; tty; exit 7\n")
        out = []
        with pytest.raises(CommandExitException) as e:
            t.wait(on_pty=out.append)
        assert e.value.exit_code == 7
        text = b"".join(out).decode(errors="replace")
        assert "30 100" in text and "/dev/pts/" in text


def test_a_bad_key_is_unauthenticated_and_another_projects_sandbox_is_not_found(gateway):
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="dsk.nosuch.notarealsecret0000")
    with Sandbox.create() as sbx:
        tok = _other_project_token(gateway)
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sbx.sandbox_id, api_key=tok)
        assert Sandbox.kill(sbx.sandbox_id, api_key=tok) is False
        with pytest.raises(NotFoundException):
            Sandbox.connect(sbx.sandbox_id, api_key=tok)
        # Its envd, addressed with the other tenant's token, is a sandbox that is not there.
        r = httpx.post(
            f"{gateway.url}/process.Process/List",
            headers={"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "49983", "x-access-token": tok,
                     "content-type": "application/json"},
            content=b"{}",
        )
        assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"
        # Without a token: unauthenticated, nothing reached.
        r = httpx.post(
            f"{gateway.url}/process.Process/List",
            headers={"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "49983", "content-type": "application/json"},
            content=b"{}",
        )
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
        # Nor its metrics.
        r = httpx.get(f"{gateway.url}/sandboxes/{sbx.sandbox_id}/metrics", headers={"x-api-key": tok})
        assert r.status_code == 404 and r.json()["code"] == 404
        assert sbx.commands.run("echo still mine").stdout == "still mine\n"


def _other_project_token(gateway) -> str:
    import opendsec

    async def make() -> str:
        async with opendsec.AsyncClient(gateway.local.addr, token=gateway.key, ca=gateway.local.ca) as admin:
            await admin.create_project("root/e2b-other")
            await admin.create_principal("e2b-other", "root/e2b-other")
            await admin.grant("e2b-other", "root/e2b-other", "sandbox.create")
            await admin.grant("e2b-other", "root/e2b-other", "sandbox.operate")
            return (await admin.create_token("e2b-other", ttl_s=3600)).token

    return asyncio.run(make())


def test_a_killed_sandbox_answers_502_as_the_sdk_expects(gateway):
    sbx = Sandbox.create()
    Sandbox.kill(sbx.sandbox_id)
    assert sbx.is_running() is False
    with pytest.raises(SandboxException) as e:
        sbx.commands.run("true")
    assert "not running" in str(e.value).lower() or "not found" in str(e.value).lower()


def test_set_timeout_ends_the_sandbox_when_it_runs_out(gateway):
    sbx = Sandbox.create(timeout=120)
    sbx.set_timeout(3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sbx.is_running():
        time.sleep(0.5)
    assert not sbx.is_running()
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)


def test_list_filters_by_metadata_and_state_across_pages(gateway):
    made = [Sandbox.create(metadata={"batch": "list-test", "i": str(i)}) for i in range(5)]
    try:
        made[0].pause()
        seen = []
        pages = Sandbox.list(query=SandboxQuery(metadata={"batch": "list-test"}), limit=2)
        while pages.has_next:
            seen.extend(s.sandbox_id for s in pages.next_items())
        assert sorted(seen) == sorted(s.sandbox_id for s in made)
        paused = Sandbox.list(query=SandboxQuery(metadata={"batch": "list-test"}, state=[SandboxState.PAUSED]))
        assert [s.sandbox_id for s in paused.next_items()] == [made[0].sandbox_id]
    finally:
        for s in made:
            s.kill()


def test_async_api_and_fifty_sandboxes_at_once(gateway):
    from e2b_code_interpreter import AsyncSandbox as AsyncCodeSandbox

    async def one(i: int) -> str:
        s = await AsyncCodeSandbox.create(metadata={"async": "50"}, timeout=600)
        try:
            r = await s.commands.run(f"echo {i}")
            await s.files.write(f"/tmp/{i}.txt", str(i))
            ex = await s.run_code(f"{i} * 2")
            return r.stdout.strip() + (await s.files.read(f"/tmp/{i}.txt")) + ex.text
        finally:
            await s.kill()

    async def main():
        return await asyncio.gather(*(one(i) for i in range(50)))

    assert asyncio.run(main()) == [f"{i}{i}{i * 2}" for i in range(50)]


def test_pause_and_resume_keep_files_and_running_processes(gateway):
    with Sandbox.create() as sbx:
        sbx.files.write("/home/user/kept.txt", "kept")
        h = sbx.commands.run("sleep 300", background=True, timeout=0)
        assert sbx.pause() is True
        back = Sandbox.connect(sbx.sandbox_id)
        assert back.files.read("/home/user/kept.txt") == "kept"
        assert h.pid in [p.pid for p in back.commands.list()]
        assert back.commands.kill(h.pid) is True


def test_watch_dir_sees_files_made_by_commands(gateway):
    from e2b import FilesystemEventType

    with Sandbox.create() as sbx:
        sbx.files.make_dir("/home/user/w")
        h = sbx.files.watch_dir("/home/user/w", recursive=True)
        sbx.commands.run("mkdir -p /home/user/w/sub && echo x > /home/user/w/sub/made.txt && echo y > /home/user/w/top.txt")
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not {"sub/made.txt", "top.txt"} <= {e.name for e in seen}:
            seen.extend(h.get_new_events())
            time.sleep(0.2)
        h.stop()
        names = {e.name for e in seen}
        assert {"sub", "sub/made.txt", "top.txt"} <= names
        assert any(e.name == "top.txt" and e.type == FilesystemEventType.CREATE for e in seen)
        # Not recursive: below the top level nothing is seen.
        flat = sbx.files.watch_dir("/home/user/w", recursive=False)
        sbx.commands.run("echo z > /home/user/w/sub/deeper.txt; echo z > /home/user/w/flat.txt")
        time.sleep(1)
        got = {e.name for e in flat.get_new_events()}
        assert "flat.txt" in got and "sub/deeper.txt" not in got
        flat.stop()


def test_async_watch_streams_events(gateway):
    async def main():
        s = await AsyncSandbox.create()
        try:
            evs = []
            h = await s.files.watch_dir("/home/user", on_event=evs.append)
            await s.files.write("/home/user/w.txt", "x")
            await asyncio.sleep(1)
            await h.stop()
            assert any(e.name == "w.txt" for e in evs)
        finally:
            await s.kill()

    asyncio.run(main())


def test_metrics_come_from_the_sandbox_cgroup_and_disk(gateway):
    with Sandbox.create() as sbx:
        sbx.files.write("/home/user/ballast.bin", b"z" * (50 << 20))
        h = sbx.commands.run("python3 -c 'x = bytearray(150 << 20); import time; time.sleep(30)'", background=True)
        time.sleep(2)
        busy = sbx.commands.run("timeout 3 sh -c 'while :; do :; done' & sleep 0.5; echo", background=True)
        time.sleep(1)
        m = sbx.get_metrics()
        assert len(m) == 1
        m = m[0]
        assert m.cpu_count == 2 and m.mem_total == 512 << 20
        assert m.mem_used > 100 << 20, m  # the python holding 150 MiB
        assert m.disk_used >= 50 << 20 and m.disk_total > m.disk_used, m
        assert 0 < m.cpu_used_pct <= 100, m
        h.kill()
        busy.kill()


def test_snapshots_and_forks_of_the_file_system(gateway):
    sbx = Sandbox.create()
    made = [sbx]
    try:
        sbx.commands.run("echo branch-point > /home/user/state")
        snap = sbx.create_snapshot()
        named = sbx.create_snapshot(name="e2b-snap:named")
        assert named.snapshot_id == "e2b-snap:named" and named.names == ["e2b-snap:named"]
        # A snapshot is a template: new sandboxes start from its file system.
        copy = Sandbox.create(snap.snapshot_id)
        made.append(copy)
        assert copy.commands.run("cat /home/user/state").stdout == "branch-point\n"
        listed = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
        assert sorted(s.snapshot_id for s in listed) == sorted([snap.snapshot_id, "e2b-snap:named"])
        assert [s.snapshot_id for s in Sandbox.list_snapshots(name="e2b-snap:named").next_items()] == ["e2b-snap:named"]
        # Forks: copies of the file system, each its own sandbox.
        forks = sbx.fork(count=2, timeout=120)
        assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), forks
        made += forks
        for i, f in enumerate(forks):
            f.commands.run(f"echo {i} >> /home/user/state")
        assert [f.commands.run("cat /home/user/state").stdout for f in forks] == ["branch-point\n0\n", "branch-point\n1\n"]
        assert sbx.commands.run("cat /home/user/state").stdout == "branch-point\n"
        # memory snapshots are refused (containers keep no memory); deletes answer as E2B's.
        with pytest.raises(SandboxException):
            sbx.create_snapshot(mode="full")
        assert Sandbox.delete_snapshot("e2b-snap:named") is True
        assert Sandbox.delete_snapshot("e2b-snap:named") is False
    finally:
        for s in made:
            s.kill()
