"""What E2B's own test suites expect of the gateway beyond the core calls (issue 40): API keys
in E2B's shape, sandbox ids and hosts as E2B makes them, a sandbox's ports at
``get_host(port)``, public and private."""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest
from e2b import Sandbox, SandboxNetworkOpts

# A small server for the port tests: echoes the method, path, one header and the body.
ECHO_SERVER = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n)
        out = f"{self.command} {self.path} x-probe={self.headers.get('x-probe')} host={self.headers.get('host')} ".encode() + body
        if self.path == "/keys":
            seen = [h for h in ("x-api-key", "x-access-token", "e2b-traffic-access-token", "x-hop") if self.headers.get(h)]
            out = " ".join(seen).encode()
        self.send_response(401 if self.path == "/401" else 201)
        self.send_header("x-served-by", "echo")
        self.send_header("set-cookie", "a=1; Domain=.sandbox.localhost; Path=/")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    do_GET = do_POST = do_PUT = _answer
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def serve_echo(sbx: Sandbox, port: int) -> str:
    sbx.files.write("/tmp/echo.py", ECHO_SERVER)
    sbx.commands.run(f"python3 /tmp/echo.py {port}", background=True, timeout=0)
    url = f"https://{sbx.get_host(port)}"
    for _ in range(100):
        r = httpx.get(url, headers={"e2b-traffic-access-token": sbx.traffic_access_token})
        if r.status_code == 201:
            return url
        time.sleep(0.1)
    raise AssertionError(f"the echo server did not come up: {r.status_code} {r.text}")


def test_keys_in_e2b_shape_work_and_opendsecctl_mints_them(gateway):
    # What make up and cluster up give E2B_API_KEY: the shape SDKs up to 2.45 insist on.
    assert re.fullmatch(r"e2b_[0-9a-f]+", os.environ["E2B_API_KEY"])
    minted = gateway.ctl("token", "create", "--e2b", "--description", "e2b-shaped")["token"]
    assert re.fullmatch(r"e2b_[0-9a-f]+", minted)
    sbx = Sandbox.create(template="base", timeout=60, api_key=minted)
    try:
        assert sbx.commands.run("echo ok").stdout == "ok\n"
        assert any(s.sandbox_id == sbx.sandbox_id for s in Sandbox.list(api_key=minted).next_items())
    finally:
        sbx.kill()
    # A key in E2B's shape that stands for no token of ours is refused, as any bad key.
    r = httpx.get(f"{gateway.url}/v2/sandboxes", headers={"x-api-key": "e2b_" + "0" * 40})
    assert r.status_code == 401, r.text


def test_sandbox_ids_are_host_labels_and_both_forms_reach_the_sandbox(gateway):
    sbx = Sandbox.create(template="base", timeout=60)
    try:
        # E2B's ids carry no dot ([C 16]): `<edge>-<lease>`, a DNS label.
        assert re.fullmatch(r"[a-z0-9-]+", sbx.sandbox_id), sbx.sandbox_id
        dotted = gateway.ctl("sandbox", "get", sbx.sandbox_id.rsplit("-", 1)[0] + "." + sbx.sandbox_id.rsplit("-", 1)[1])
        assert dotted["id"].replace(".", "-") == sbx.sandbox_id
        # Either form finds it through the gateway.
        assert Sandbox.get_info(dotted["id"]).sandbox_id == sbx.sandbox_id
        assert Sandbox.connect(dotted["id"]).commands.run("echo ok").stdout == "ok\n"
        # The create answer names the domain of its hosts.
        assert sbx.sandbox_domain and sbx.get_host(8000) == f"8000-{sbx.sandbox_id}.{sbx.sandbox_domain}"
    finally:
        sbx.kill()


def test_get_host_reaches_a_public_sandbox_port_without_a_token(gateway):
    sbx = Sandbox.create(template="base", timeout=120)
    other = Sandbox.create(template="base", timeout=120, network=SandboxNetworkOpts(allow_public_traffic=False))
    try:
        url = serve_echo(sbx, 8001)
        # E2B's default: public, no token needed (what a browser opening the preview sends).
        r = httpx.post(f"{url}/some/path?q=1", content=b"payload", headers={"x-probe": "p1"})
        assert r.status_code == 201, r.text
        assert r.text == "POST /some/path?q=1 x-probe=p1 host=127.0.0.1:8001 payload"
        assert r.headers["x-served-by"] == "echo"
        # The gateway's tokens never reach the sandbox's server, nor headers its Connection
        # names; an X-API-Key is the app's own (never taken as a token).
        h = {"x-api-key": "k", "x-access-token": "t", "e2b-traffic-access-token": sbx.traffic_access_token,
             "x-hop": "1", "connection": "x-hop"}
        r = httpx.get(f"{url}/keys", headers=h)
        assert (r.status_code, r.text) == (201, "x-api-key"), r.text
        assert httpx.get(f"{url}/keys", headers={"x-api-key": "not-a-token"}).status_code == 201
        # A cookie stays on the sandbox's own host (every sandbox shares the domain).
        assert r.headers["set-cookie"] == "a=1; Path=/"
        # A sandbox answering 401 is its own business: its visitors are never paused for it.
        for _ in range(80):
            assert httpx.get(f"{url}/401").status_code == 401
        assert httpx.get(f"{gateway.url}/v2/sandboxes", headers={"x-api-key": gateway.key}).status_code == 200
        # Headers route as hosts do (the SDK's shape), for any port.
        r = httpx.get(gateway.url + "/h", headers={"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "8001"})
        assert r.status_code == 201 and r.text.startswith("GET /h ")
        # A port nothing serves: E2B's "port is not open" (502).
        r = httpx.get(f"https://{sbx.get_host(8999)}")
        assert r.status_code == 502 and "port is not open" in r.json()["message"]
        # Another sandbox's traffic token does not reach this one (502, as if it did not exist).
        r = httpx.get(url, headers={"e2b-traffic-access-token": other.traffic_access_token})
        assert r.status_code == 502 and "not found" in r.json()["message"]
        # No such sandbox.
        r = httpx.get(url.replace(sbx.sandbox_id, sbx.sandbox_id[:-4] + "0000"))
        assert r.status_code == 502
        # A WebSocket is refused with a clear answer, for now.
        r = httpx.get(url, headers={"upgrade": "websocket", "connection": "upgrade"})
        assert r.status_code == 501
    finally:
        sbx.kill()
        other.kill()


def test_a_private_sandbox_port_needs_its_traffic_token(gateway):
    sbx = Sandbox.create(template="base", timeout=120, network=SandboxNetworkOpts(allow_public_traffic=False))
    try:
        assert sbx.traffic_access_token
        url = serve_echo(sbx, 8002)
        r = httpx.get(url)
        assert r.status_code == 403, r.text
        r = httpx.get(url, headers={"e2b-traffic-access-token": sbx.traffic_access_token})
        assert r.status_code == 201
    finally:
        sbx.kill()
    # Ended: gone for everyone.
    r = httpx.get(url, headers={"e2b-traffic-access-token": sbx.traffic_access_token})
    assert r.status_code in (401, 502), r.text


def wait_state(sbx: Sandbox, state, within: float = 30):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if sbx.get_info().state == state:
            return
        time.sleep(0.2)
    raise AssertionError(f"{sbx.sandbox_id} did not become {state}: {sbx.get_info().state}")


def test_auto_pause_pauses_at_the_timeout_and_waits_for_connect(gateway):
    from e2b import SandboxState

    sbx = Sandbox.create(template="base", timeout=3, lifecycle={"on_timeout": "pause"})
    try:
        sbx.files.write("/home/user/kept.txt", "kept")
        h = sbx.commands.run("sleep 600", background=True, timeout=0)
        wait_state(sbx, SandboxState.PAUSED)
        # Not resumed by calls (E2B's default without autoResume): it waits for connect.
        assert sbx.is_running() is False
        with pytest.raises(Exception):
            sbx.files.read("/home/user/kept.txt")
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        back = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert back.files.read("/home/user/kept.txt") == "kept"
        assert h.pid in [p.pid for p in back.commands.list()]  # memory kept: its processes too
        # set_timeout(0) pauses it again at once (not a kill).
        back.set_timeout(0)
        wait_state(back, SandboxState.PAUSED)
    finally:
        sbx.kill()


def test_auto_resume_wakes_a_paused_sandbox_on_a_request_to_its_port(gateway):
    from e2b import SandboxState

    sbx = Sandbox.create(template="base", timeout=5, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        url = serve_echo(sbx, 8003)
        wait_state(sbx, SandboxState.PAUSED)
        r = httpx.get(url, timeout=30)
        assert r.status_code == 201, r.text
        assert sbx.get_info().state == SandboxState.RUNNING
    finally:
        sbx.kill()


def test_the_base_template_has_python_and_passwordless_sudo(gateway):
    with Sandbox.create(template="base", timeout=60) as sbx:
        assert sbx.commands.run("python -c 'print(6*7)'").stdout == "42\n"
        assert sbx.commands.run("sudo -n whoami").stdout == "root\n"
        # Root through sudo is the sandbox's root: its capabilities stop at the sandbox's
        # bounding set, and the seccomp filter still refuses what no sandbox may do.
        r = sbx.commands.run("sudo -n grep -E '^(CapBnd|NoNewPrivs)' /proc/self/status")
        bnd = int(r.stdout.split("CapBnd:")[1].split()[0], 16)
        assert bnd & (1 << 21) == 0, r.stdout  # no CAP_SYS_ADMIN
        r = sbx.commands.run("sudo -n mount -t tmpfs x /mnt 2>&1; echo rc=$?")
        assert "rc=0" not in r.stdout, r.stdout
        r = sbx.commands.run("sudo -n unshare -U true 2>&1; echo rc=$?")
        assert "rc=0" not in r.stdout, r.stdout


def test_files_are_described_as_envd_does(gateway):
    with Sandbox.create(template="base", timeout=60) as sbx:
        for d in ["t/b", "t/a", "t/a/z", "t/a-b"]:
            sbx.files.make_dir(d)
        sbx.files.write("t/a/f.txt", "x")
        # A walk of the tree, each directory's entries by name.
        got = [e.path for e in sbx.files.list("t", depth=3)]
        base = "/home/user/t"
        assert got == [f"{base}/a", f"{base}/a/f.txt", f"{base}/a/z", f"{base}/a-b", f"{base}/b"], got
        assert [e.mode for e in sbx.files.list("t")] == [0o755, 0o755, 0o755]
        # A symlink: the type of its target and the target's absolute path.
        sbx.commands.run("ln -s f.txt link && ln -s /nowhere dangling", cwd="/home/user/t/a")
        info = sbx.files.get_info("t/a/link")
        assert (info.type.value, info.symlink_target) == ("file", f"{base}/a/f.txt")
        info = sbx.files.get_info("t/a/dangling")
        assert info.symlink_target == "/nowhere"


def test_lists_are_newest_first_paged_and_filtered_by_start(gateway):
    from e2b import SandboxQuery, SandboxState

    tag = {"parity-list": str(time.time_ns())}
    first = Sandbox.create(template="base", timeout=120, metadata=tag)
    second = Sandbox.create(template="base", timeout=120, metadata=tag)
    try:
        second.pause()
        q = SandboxQuery(metadata=tag)
        assert [s.sandbox_id for s in Sandbox.list(query=q).next_items()] == [second.sandbox_id, first.sandbox_id]
        asc = Sandbox.list(query=q, order="asc").next_items()
        assert [s.sandbox_id for s in asc] == [first.sandbox_id, second.sandbox_id]
        pages = Sandbox.list(query=SandboxQuery(metadata=tag, state=[SandboxState.RUNNING, SandboxState.PAUSED]), limit=1)
        p1 = pages.next_items()
        assert [s.sandbox_id for s in p1] == [second.sandbox_id] and pages.has_next
        p2 = pages.next_items()
        assert [s.sandbox_id for s in p2] == [first.sandbox_id] and not pages.has_next
        started = first.get_info().started_at
        ids = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata=tag, started_after=started)).next_items()]
        assert first.sandbox_id in ids  # inclusive
        later = second.get_info().started_at
        ids = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata=tag, started_after=later)).next_items()]
        assert first.sandbox_id not in ids or first.get_info().started_at >= later
        r = httpx.get(f"{gateway.url}/v2/sandboxes?nextToken=junk", headers={"x-api-key": gateway.key})
        assert r.status_code == 400
    finally:
        first.kill()
        second.kill()


def test_commands_end_as_envd_ends_them(gateway):
    from e2b import TimeoutException

    with Sandbox.create(template="base", timeout=60) as sbx:
        # Past its timeout: the caller's timeout, not an exit code.
        with pytest.raises(TimeoutException):
            sbx.commands.run("sleep 10", timeout=2)
        # Killed by the user: an exit.
        h = sbx.commands.run("sleep 60", background=True)
        assert sbx.commands.kill(h.pid)
        with pytest.raises(Exception) as e:
            h.wait()
        assert "TimeoutException" not in type(e.value).__name__
    # The sandbox killed under a running command: E2B's "killed or reached its end of life".
    sbx = Sandbox.create(template="base", timeout=60)
    h = sbx.commands.run("sleep 60", background=True)
    sbx.kill()
    with pytest.raises(TimeoutException) as e:
        h.wait()
    assert "killed or reached its end of life" in str(e.value)


def test_file_metadata_is_kept_as_xattrs(gateway):
    with Sandbox.create(template="base", timeout=60) as sbx:
        w = sbx.files.write("m.txt", "x", metadata={"Author": "mish", "purpose": "upload"})
        assert w.metadata == {"author": "mish", "purpose": "upload"}  # keys are header names
        assert sbx.files.get_info("m.txt").metadata == {"author": "mish", "purpose": "upload"}
        # Stored as the file's user.e2b.* attributes, visible from inside.
        r = sbx.commands.run("python3 -c \"import os; print(os.getxattr('/home/user/m.txt', 'user.e2b.author'))\"")
        assert r.stdout == "b'mish'\n"
        assert [e.metadata for e in sbx.files.list(".") if e.name == "m.txt"] == [{"author": "mish", "purpose": "upload"}]
        assert sbx.files.rename("m.txt", "n.txt").metadata == {"author": "mish", "purpose": "upload"}
        # Overwriting without metadata clears it; other user xattrs stay.
        sbx.commands.run("python3 -c \"import os; os.setxattr('/home/user/n.txt', 'user.other', b'kept')\"")
        assert sbx.files.write("n.txt", "y").metadata is None
        assert sbx.files.get_info("n.txt").metadata is None
        r = sbx.commands.run("python3 -c \"import os; print(os.listxattr('/home/user/n.txt'))\"")
        assert r.stdout == "['user.other']\n"
        # A value that is not printable ASCII is refused before anything is written.
        h = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "49983", "x-access-token": sbx._envd_access_token,
             "x-metadata-bad": "café".encode()}
        r = httpx.post(f"{gateway.url}/files?path=/home/user/refused.txt", headers=h, files={"file": b"z"})
        assert r.status_code == 400, r.text
        assert not sbx.files.exists("refused.txt")


def test_a_watch_sees_an_upload_as_envd_reports_it(gateway):
    from e2b import FilesystemEventType

    with Sandbox.create(template="base", timeout=60) as sbx:
        sbx.files.make_dir("w")
        h = sbx.files.watch_dir("w")
        sbx.files.write("w/f.txt", "x")
        deadline = time.monotonic() + 5
        events = []
        while time.monotonic() < deadline and len(events) < 3:
            events += h.get_new_events()
            time.sleep(0.1)
        h.stop()
        kinds = [e.type for e in events]
        assert set(kinds) == {FilesystemEventType.CREATE, FilesystemEventType.CHMOD, FilesystemEventType.WRITE}, kinds


def test_metrics_answer_within_their_range_and_snapshots_by_sandbox(gateway):
    import datetime

    with Sandbox.create(template="base", timeout=60) as sbx:
        now = datetime.datetime.now(datetime.timezone.utc)
        assert len(sbx.get_metrics(start=now - datetime.timedelta(minutes=1), end=now)) == 1
        old = now - datetime.timedelta(hours=1)
        assert sbx.get_metrics(start=old, end=old + datetime.timedelta(minutes=30)) == []
        snap = sbx.create_snapshot()
        try:
            ids = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()]
            assert snap.snapshot_id in ids
        finally:
            Sandbox.delete_snapshot(snap.snapshot_id)
