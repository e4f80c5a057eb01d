"""Integration tests against a real local cluster (conftest.py brings it up).

Lifecycle on the ``sim`` backend; shell, files and processes on ``container`` sandboxes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import opendsec
from opendsec import errors

pytestmark = pytest.mark.integration


def client(cluster, **kw) -> opendsec.AsyncClient:
    return opendsec.AsyncClient(cluster.addr, token=cluster.token, ca=cluster.local.ca, **kw)


async def test_whoami_and_env_defaults(cluster, monkeypatch) -> None:
    monkeypatch.setenv("OPENDSEC_ADDR", cluster.addr)
    monkeypatch.setenv("OPENDSEC_TOKEN", cluster.token)
    monkeypatch.setenv("OPENDSEC_CA", str(cluster.local.ca))
    monkeypatch.delenv("OPENDSEC_INSECURE_PLAINTEXT", raising=False)
    async with opendsec.AsyncClient() as c:
        me = await c.whoami()
    assert me.principal == "admin" and me.project == "root"


async def test_sim_lifecycle(cluster) -> None:
    async with client(cluster) as c:
        await c.create_project("root/sdk-life")
        sb = await c.create_sandbox("sim", IMG, project="root/sdk-life", labels={"job": "life"}, cpu=100, memory_mb=64)
        assert sb.state == "running" and sb.labels == {"job": "life"}
        assert (await c.get_sandbox(sb.id)).id == sb.id
        await sb.pause()
        assert (await sb.refresh()).state == "paused"
        await sb.resume()
        assert (await sb.refresh()).state == "running"
        await sb.set_timeout(ttl_running_stop_s=3600, ttl_max_s=7200)
        assert sb.info.expires_at_ms > sb.info.created_at_ms
        await sb.stop()
        assert sb.state in ("stopping", "stopped")
        with pytest.raises(errors.OpendsecError):
            await sb.pause()


async def test_egress_rules_round_trip_and_update(cluster) -> None:
    async with client(cluster) as c:
        sb = await c.create_sandbox("sim", IMG, egress=["pypi.org", "203.0.113.0/24:tcp/80"])
        # Stored in canonical form (a bare address becomes a /32), shown back as text.
        assert sb.egress == ["pypi.org", "203.0.113.0/24:tcp/80"]
        await sb.update_network(["*:tcp/443", "198.51.100.7"])
        assert sb.egress == ["*:tcp/443", "198.51.100.7/32"]
        assert (await c.get_sandbox(sb.id)).egress == ["*:tcp/443", "198.51.100.7/32"]
        await sb.update_network([])
        assert sb.egress == []
        # A bad rule: refused with the rule named, nothing changed.
        with pytest.raises(errors.InvalidArgument, match="192.0.2.1/24"):
            await sb.update_network(["192.0.2.1/24"])
        with pytest.raises(errors.InvalidArgument, match="localhost"):
            await c.create_sandbox("sim", IMG, egress=["localhost"])
        # No egress asked for: the cluster's default, which is none.
        plain = await c.create_sandbox("sim", IMG)
        assert plain.egress == []
        await sb.stop()
        await plain.stop()


async def test_a_project_egress_ceiling_refuses_more(cluster) -> None:
    async with client(cluster) as c:
        await c.create_project("root/sdk-ceiling")
        p = await c.set_egress_ceiling("root/sdk-ceiling", ["pypi.org", "203.0.113.0/24:tcp"])
        assert [opendsec.egress_text(r) for r in p.egress_ceiling.allow] == ["pypi.org", "203.0.113.0/24:tcp"]
        ok = await c.create_sandbox("sim", IMG, project="root/sdk-ceiling", egress=["files.pypi.org:tcp/443"])
        with pytest.raises(errors.PermissionDenied, match=r"\*"):
            await c.create_sandbox("sim", IMG, project="root/sdk-ceiling", egress=["*"])
        with pytest.raises(errors.PermissionDenied, match="udp"):
            await ok.update_network(["203.0.113.9:udp/53"])
        assert ok.egress == ["files.pypi.org:tcp/443"]
        await c.set_egress_ceiling("root/sdk-ceiling", None)
        await ok.update_network(["*"])
        assert ok.egress == ["*"]
        await ok.stop()


async def test_same_lease_id_is_one_sandbox(cluster) -> None:
    async with client(cluster) as c:
        lease = opendsec.new_lease_id()
        a = await c.create_sandbox("sim", IMG, lease_id=lease)
        b = await c.create_sandbox("sim", IMG, lease_id=lease)
        assert a.id == b.id
        await a.stop()


async def test_pools_create_update_list_delete(cluster) -> None:
    async with client(cluster) as c:
        p = await c.create_pool("sdk-pool", IMG, 2, memory_mb=128, env={"MODE": "warm"})
        assert p.template.backend == "fncall" and p.size_per_edge == 2 and len(p.revision) == 64
        with pytest.raises(errors.AlreadyExists):
            await c.create_pool("sdk-pool", IMG, 2)
        q = await c.update_pool("sdk-pool", IMG, 3, memory_mb=256)
        assert q.revision != p.revision and q.size_per_edge == 3
        assert [x.name for x in await c.list_pools()] == ["sdk-pool"]
        assert (await c.get_pool("sdk-pool")).revision == q.revision
        await c.delete_pool("sdk-pool")
        with pytest.raises(errors.NotFound):
            await c.get_pool("sdk-pool")


async def test_batch_items_with_their_own_env_and_labels(cluster) -> None:
    async with client(cluster) as c:
        patches = [{"env": {"SHARD": str(i)}, "labels": {"shard": str(i)}} for i in range(3)]
        made = await c.create_sandboxes(4, "sim", IMG, labels={"job": "patched"}, patches=patches, memory_mb=64)
        try:
            for i, sb in enumerate(made[:3]):
                assert sb.labels == {"job": "patched", "shard": str(i)}
                assert dict(sb.info.spec.env)["SHARD"] == str(i)
            assert made[3].labels == {"job": "patched"}
        finally:
            for sb in made:
                await sb.stop()


async def test_batch_list_with_labels_and_pagination(cluster) -> None:
    async with client(cluster) as c:
        await c.create_project("root/sdk-batch")
        seen = []
        sbs = await c.create_sandboxes(
            25, "sim", IMG, project="root/sdk-batch", labels={"job": "batch"}, on_progress=lambda d, n: seen.append((d, n))
        )
        assert len(sbs) == 25 and len({s.id for s in sbs}) == 25 and seen[-1] == (25, 25)
        other = await c.create_sandbox("sim", IMG, project="root/sdk-batch", labels={"job": "other"})
        listed = await c.list_sandboxes("root/sdk-batch", labels={"job": "batch"}, page_size=7)
        assert sorted(s.id for s in listed) == sorted(s.id for s in sbs)
        assert [s.id for s in await c.list_sandboxes("root/sdk-batch", labels={"job": "other"})] == [other.id]
        streamed = [s.id async for s in c.iter_sandboxes("root/sdk-batch", labels={"job": "batch"}, page_size=4)]
        assert sorted(streamed) == sorted(s.id for s in sbs)
        await sbs[0].pause()
        paused = await c.list_sandboxes("root/sdk-batch", states=["paused"])
        assert [s.id for s in paused] == [sbs[0].id]
        await asyncio.gather(*(s.stop() for s in sbs + [other]))
        assert await c.list_sandboxes("root/sdk-batch", labels={"job": "batch"}) == []


async def test_errors_raise_their_class(cluster) -> None:
    async with client(cluster) as c:
        with pytest.raises(errors.NotFound) as e:
            await c.get_sandbox("edge-000.nosuchlease")
        assert e.value.reason == "not_found" and e.value.has_error_info
        with pytest.raises(errors.InvalidArgument):
            await c.get_sandbox("not an id")
        with pytest.raises(errors.InvalidArgument):
            await c.create_sandbox("no-such-backend", IMG)
        await c.create_project("root/sdk-dup")
        with pytest.raises(errors.AlreadyExists):
            await c.create_project("root/sdk-dup")
    async with opendsec.AsyncClient(cluster.addr, token="dsk.bad.token", ca=cluster.local.ca) as c:
        with pytest.raises(errors.Unauthenticated):
            await c.whoami()
    # More memory than any edge has: every edge skipped, retried for retry_timeout, then raised.
    async with client(cluster, retry_timeout=0.5) as c:
        with pytest.raises(errors.NoCapacity) as e:
            await c.create_sandbox("sim", IMG, memory_mb=10_000_000)
        assert e.value.retryable and "memory" in e.value.message


async def test_a_dead_address_next_to_a_live_one(cluster, dead_address) -> None:
    dead = dead_address
    async with opendsec.AsyncClient([dead, cluster.addr], token=cluster.token, ca=cluster.local.ca) as c:
        for _ in range(4):
            assert (await c.whoami()).principal == "admin"
        assert c.pool.is_avoided(dead)


def test_sync_client(cluster) -> None:
    with opendsec.Client(cluster.addr, token=cluster.token, ca=cluster.local.ca) as c:
        assert c.whoami().principal == "admin"
        with c.run_sandbox("sim", IMG, labels={"job": "sync"}) as sb:
            assert isinstance(sb, opendsec.SyncSandbox) and sb.state == "running"
            sid = sb.id
        assert c.get_sandbox(sid).state in ("stopping", "stopped")


# -- container sandboxes ----------------------------------------------------------------------

IMG = "busybox:t"
RES = dict(cpu=500, memory_mb=128)


async def test_run_shell_sessions(container) -> None:
    async with client(container) as c, c.run_sandbox("container", IMG, **RES) as sb:
        r = await sb.run_shell("cd /tmp && export GREETING=hello && echo in $(pwd)", session="s1")
        assert r.ok and r.stdout == "in /tmp\n" and r.cwd == "/tmp"
        r = await sb.run_shell("echo $GREETING from $(pwd); echo oops >&2; (exit 3)", session="s1")
        assert (r.exit_code, r.stdout, r.stderr) == (3, "hello from /tmp\n", "oops\n")
        r = await sb.run_shell("echo ${GREETING:-unset} $V", session="s2", env={"V": "v"}, cwd="/etc")
        assert r.stdout == "unset v\n" and r.cwd == "/etc"
        r = await sb.run_shell("sleep 30", session="s3", timeout=0.5)
        assert r.timed_out and not r.ok
        assert await sb.close_session("s1") is True
        r = await sb.run_shell("echo ${GREETING:-gone}", session="s1")
        assert r.stdout == "gone\n"
    # run_sandbox stopped it
    async with client(container) as c:
        assert (await c.get_sandbox(sb.id)).state in ("stopping", "stopped")


async def test_snapshot_and_create_from_it(container) -> None:
    async with client(container) as c, c.run_sandbox("container", IMG, **RES) as sb:
        await sb.run_shell("echo kept > /etc/state && echo scratch > /tmp/scratch")
        snap = await sb.snapshot("sdk-snap:one")
        assert snap.image.repo == "sdk-snap" and snap.image.tag == "one" and snap.layer == snap.image.layers[-1]
        packed = await sb.snapshot("sdk-snap:packed", pack_diff=True)
        assert packed.layer != snap.layer
        # The source runs on; a copy starts from the snapshot's file system.
        assert (await sb.run_shell("cat /etc/state")).stdout == "kept\n"
        async with c.run_sandbox("container", "sdk-snap:one", **RES) as copy:
            r = await copy.run_shell("cat /etc/state /tmp/scratch")
            assert r.stdout == "kept\nscratch\n"
        async with c.run_sandbox("container", "sdk-snap:packed", **RES) as copy:
            r = await copy.run_shell("cat /etc/state; ls -A /tmp")
            assert r.stdout == "kept\n"
        with pytest.raises(errors.AlreadyExists):
            await sb.snapshot("sdk-snap:one")
        with pytest.raises(errors.InvalidArgument):
            await sb.snapshot("Not A Name")


async def test_create_from_a_warm_pool(container) -> None:
    async with client(container) as c:
        await c.create_pool("sdk-warm", IMG, 1, cpu=500, memory_mb=128, disk_mb=64, env={"MODE": "warm"})
        try:
            for _ in range(600):
                p = await c.get_pool("sdk-warm")
                if p.edges and p.edges[0].idle >= 1:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"the pool never had an idle member: {p}")
            sb = await c.create_sandbox(pool="sdk-warm", env={"TASK": "7"}, labels={"k": "v"})
            try:
                assert sb.info.spec.pool == "sdk-warm" and sb.info.spec.image == IMG
                r = await sb.run_shell("echo $OPENDSEC_SANDBOX_ID $MODE $TASK; cat /run/opendsec/sandbox-id")
                assert r.stdout == f"{sb.id} warm 7\n{sb.id}\n"
            finally:
                await sb.stop()
            with pytest.raises(ValueError):
                await c.create_sandbox(pool="sdk-warm", image=IMG)
            with pytest.raises(ValueError):
                await c.create_sandbox()
        finally:
            await c.delete_pool("sdk-warm")


async def test_fork_as_a_list_and_as_an_iterator(container) -> None:
    async with client(container) as c, c.run_sandbox("container", IMG, **RES) as sb:
        await sb.run_shell("echo branch-point > /etc/state")
        copies = await sb.fork(3)
        try:
            assert len(copies) == 3 and len({x.id for x in copies}) == 3
            for i, x in enumerate(copies):
                await x.run_shell(f"echo {i} >> /etc/state")
            outs = [(await x.run_shell("cat /etc/state")).stdout for x in copies]
            assert outs == [f"branch-point\n{i}\n" for i in range(3)]
            seen = [x async for x in sb.iter_fork(2, snapshot_name="sdk-fork:named")]
            copies += seen
            assert all(isinstance(x, opendsec.Sandbox) for x in seen)
            assert {x.info.spec.image for x in seen} == {"sdk-fork:named"}
            with pytest.raises(errors.InvalidArgument):
                await sb.fork(0)
        finally:
            for x in copies:
                await x.stop()


async def test_a_microvm_fork_carries_its_running_processes(container) -> None:
    async with client(container) as c, c.run_sandbox("microvm", IMG, cpu=1000, memory_mb=192, disk_mb=64) as sb:
        await sb.run_shell("(i=0; while :; do i=$((i+1)); echo $i > /tmp/n; sleep 0.1; done) >/dev/null 2>&1 &")
        await asyncio.sleep(0.5)
        copies = await sb.fork(2)
        try:
            for x in copies:
                r = await x.run_shell("a=$(cat /tmp/n); sleep 0.5; b=$(cat /tmp/n); echo $((a > 0 && b > a)) $(hostname)")
                ran, host = r.stdout.split()
                assert ran == "1", r
                assert host == x.id.split(".", 1)[1]
            image = copies[0].info.spec.image
            img = await c.get_image(image)
            assert img.vm_snapshot.startswith("vm-")
            with pytest.raises(errors.InvalidArgument):
                await c.create_sandbox("container", image, **RES)
        finally:
            for x in copies:
                await x.stop()


async def test_request_id_runs_once(container) -> None:
    async with client(container) as c, c.run_sandbox("container", IMG, **RES) as sb:
        rid = opendsec.new_request_id()
        a = await sb.run_shell("echo x >> /tmp/count; wc -l < /tmp/count", request_id=rid)
        b = await sb.run_shell("echo x >> /tmp/count; wc -l < /tmp/count", request_id=rid)
        assert a.stdout.strip() == b.stdout.strip() == "1"
        assert (await sb.read_file("/tmp/count")) == b"x\n"


async def test_run_shell_survives_a_cut_connection_and_runs_once(container, proxy) -> None:
    async with opendsec.AsyncClient(proxy.address, token=container.token, ca=container.local.ca) as c:
        sb = await c.create_sandbox("container", IMG, **RES)
        try:
            task = asyncio.create_task(sb.run_shell("echo run >> /tmp/ran; sleep 1.5; echo done"))
            await asyncio.sleep(0.7)
            proxy.cut()
            r = await task
            assert r.stdout == "done\n"
            assert await sb.read_file("/tmp/ran") == b"run\n"
        finally:
            await sb.stop()


async def test_stream_shell_resumes_byte_exact(container, proxy) -> None:
    script = "i=0; while [ $i -lt 40 ]; do echo line-$i; echo err-$i >&2; i=$((i+1)); sleep 0.05; done"
    expected_out = "".join(f"line-{i}\n" for i in range(40)).encode()
    expected_err = "".join(f"err-{i}\n" for i in range(40)).encode()
    async with opendsec.AsyncClient(proxy.address, token=container.token, ca=container.local.ca) as c:
        sb = await c.create_sandbox("container", IMG, **RES)
        try:
            out = {"stdout": b"", "stderr": b""}
            cuts = 0
            exit_ = None
            async for ch in sb.stream_shell(script):
                if isinstance(ch, opendsec.ShellExit):
                    exit_ = ch
                    break
                assert ch.offset == len(out[ch.stream])
                out[ch.stream] += ch.data
                if cuts < 2 and len(out["stdout"]) > (cuts + 1) * 100:
                    proxy.cut()
                    cuts += 1
            assert cuts == 2 and exit_ is not None and exit_.exit_code == 0
            assert out["stdout"] == expected_out and out["stderr"] == expected_err
        finally:
            await sb.stop()


async def test_files(container, tmp_path: Path) -> None:
    async with client(container) as c, c.run_sandbox("container", IMG, **RES) as sb:
        with pytest.raises(errors.NotFound):
            await sb.write_file("/tmp/x/y/no.txt", "no\n", make_parents=False)
        assert await sb.write_file("/tmp/a/b/hello.txt", "hello\n") == 6  # parents made
        assert await sb.read_file("/tmp/a/b/hello.txt") == b"hello\n"
        await sb.write_file("/tmp/a/b/hello.txt", b"more\n", append=True)
        assert await sb.read_file("/tmp/a/b/hello.txt", offset=6) == b"more\n"
        assert await sb.write_file("/tmp/empty", b"") == 0
        assert await sb.read_file("/tmp/empty") == b""
        big = bytes(range(256)) * (3 * 4096 + 7)  # > 3 MiB: several chunks
        src = tmp_path / "big.bin"
        src.write_bytes(big)
        src.chmod(0o750)
        assert await sb.upload(src, "/tmp/up/big.bin") == len(big)
        st = await sb.stat("/tmp/up/big.bin")
        assert st.size == len(big) and st.type == "file" and st.mode & 0o777 == 0o750
        r = await sb.run_shell("md5sum /tmp/up/big.bin")
        import hashlib

        assert r.stdout.split()[0] == hashlib.md5(big).hexdigest()
        dst = tmp_path / "down.bin"
        assert await sb.download("/tmp/up/big.bin", dst) == len(big)
        assert dst.read_bytes() == big
        names = {e.name: e.type for e in await sb.list_dir("/tmp/a")}
        assert names == {"b": "dir"}
        with pytest.raises(errors.NotFound):
            await sb.read_file("/tmp/nope")
        # A range read in chunks; directories made, files moved, trees removed.
        chunks = [ch async for ch in sb.iter_file("/tmp/up/big.bin", offset=1000, length=2_000_000)]
        assert len(chunks) > 1 and b"".join(chunks) == big[1000:2_001_000]
        await sb.make_dir("/tmp/m/n")
        assert (await sb.stat("/tmp/m/n")).type == "dir"
        await sb.move("/tmp/a/b/hello.txt", "/tmp/m/n/hello.txt")
        assert await sb.read_file("/tmp/m/n/hello.txt") == b"hello\nmore\n"
        with pytest.raises(errors.NotFound):
            await sb.stat("/tmp/a/b/hello.txt")
        with pytest.raises(errors.OpendsecError):
            await sb.remove("/tmp/m")  # not empty
        await sb.remove("/tmp/m", recursive=True)
        with pytest.raises(errors.NotFound):
            await sb.stat("/tmp/m")


async def test_processes(container) -> None:
    async with client(container) as c, c.run_sandbox("container", IMG, **RES) as sb:
        pid = await sb.start_process(["sh", "-c", "read x; echo got $x; echo e >&2; exit 4"], tag="reader")
        await sb.send_input("reader", "hi\n", eof=True)
        exit_, out, err = await sb.wait_process(pid)
        assert (exit_.exit_code, out, err) == (4, b"got hi\n", b"e\n")
        sleeper = await sb.start_process(["sleep", "600"], tag="sleeper")
        procs = {p.tag: p for p in await sb.list_processes()}
        assert procs["sleeper"].running and procs["sleeper"].pid == sleeper
        assert procs["reader"].exit is not None and procs["reader"].exit.exit_code == 4
        await sb.signal_process("sleeper", 15)
        events = [ev async for ev in sb.connect_process(sleeper)]
        assert events[-1] == opendsec.ProcessExit(exit_code=-1, signal=15)
        with pytest.raises(errors.OpendsecError):
            await sb.signal_process(999999, 15)


async def test_session_sync_round_trip(container) -> None:
    """A session's paths saved (on demand and at stop) to the S3 server, restored into a new
    sandbox; what lies outside them does not come along."""
    kw = dict(session="work", session_paths=["/work"], **RES)
    async with client(container) as c:
        async with c.run_sandbox("container", IMG, **kw) as sb:
            r = await sb.run_shell("mkdir -p /work && echo one > /work/a && echo out > /outside")
            assert r.ok, r
            saved = await sb.save_session()
            assert saved.name == "work" and saved.bytes > 0
            assert await sb.run_shell("echo two > /work/b") is not None
        # Saved again at the stop, with /work/b.
        assert any(k.endswith("work.tar.zst") for k in container.s3.keys()), container.s3.keys()
        async with c.run_sandbox("container", IMG, **kw) as sb:
            r = await sb.run_shell("cat /work/a /work/b; [ -e /outside ] && echo leaked || echo clean")
            assert r.stdout == "one\ntwo\nclean\n", r
        with pytest.raises(ValueError):
            await c.create_sandbox("container", IMG, session="work", **RES)


def test_sync_shell_and_stream(container) -> None:
    with opendsec.Client(container.addr, token=container.token, ca=container.local.ca) as c:
        with c.run_sandbox("container", IMG, **RES) as sb:
            assert sb.run_shell("echo sync").stdout == "sync\n"
            items = list(sb.stream_shell("echo a; echo b"))
            assert b"".join(i.data for i in items[:-1]) == b"a\nb\n"
            assert isinstance(items[-1], opendsec.ShellExit)


# -- images -----------------------------------------------------------------------------------


async def test_import_compose_and_use_images(container, tmp_path: Path) -> None:
    """import_image runs the store tool (as root, beside the cluster) and registers the image;
    a sandbox from it runs; compose stacks layers; errors keep their classes."""
    root = tmp_path / "root"
    (root / "srv").mkdir(parents=True)
    (root / "srv" / "hello.txt").write_text("from an imported layer\n")
    store = container.state / "images"
    async with client(container) as c:
        img = await c.import_image(rootfs=root, name="sdk-hello:v1", store=store)
        assert (img.repo, img.tag, img.project, len(img.layers)) == ("sdk-hello", "v1", "root", 1)
        assert img.source.startswith("rootfs:")
        assert "sdk-hello" in {i.repo for i in await c.list_images()}
        # Over busybox (bottom) so a shell exists: the new layer's file is visible.
        combo = await c.compose_image("sdk-combo:v1", [IMG, "sdk-hello:v1"])
        assert list(combo.layers) == list((await c.get_image(IMG)).layers) + list(img.layers)
        async with c.run_sandbox("container", "sdk-combo:v1", **RES) as sb:
            assert (await sb.run_shell("cat /srv/hello.txt")).stdout == "from an imported layer\n"
        with pytest.raises(errors.AlreadyExists):
            await c.import_image(rootfs=root, name="sdk-hello:v1", store=store)
        again = await c.import_image(rootfs=root, name="sdk-hello:v1", store=store, replace=True)
        assert list(again.layers) == list(img.layers)  # the same content: the same layer
        with pytest.raises(OSError):
            await c.import_image(rootfs=tmp_path / "absent", name="sdk-absent:v1", store=store)
        with pytest.raises(FileNotFoundError):
            await c.import_image(rootfs=root, name="x:v1", store=store, opendsecctl="/nonexistent/opendsecctl")
        await c.delete_image("sdk-combo:v1")
        with pytest.raises(errors.NotFound):
            await c.get_image("sdk-combo:v1")


# -- IAM administration -----------------------------------------------------------------------


async def test_iam_administration_end_to_end(cluster) -> None:
    """Projects with quotas, a principal with a grant and a token, the token's reach and its
    revocation, usage, and the errors on the way, all through the SDK."""
    async with client(cluster) as admin:
        team = await admin.create_project("root/sdk-iam", {"sandboxes": 2, "cpu_millis": 4000})
        assert team.path == "root/sdk-iam"
        await admin.create_project("root/sdk-iam/rl")
        assert {p.path for p in await admin.list_projects("root/sdk-iam")} == {"root/sdk-iam", "root/sdk-iam/rl"}
        p = await admin.set_quota("root/sdk-iam", {"sandboxes": 1, "cpu_millis": 4000})
        assert p.effective.sandboxes == 1
        with pytest.raises(ValueError):
            await admin.set_quota("root/sdk-iam", {"sandbox": 1})
        await admin.create_principal("sdk-alice", "root/sdk-iam")
        assert [x.name for x in await admin.list_principals("root/sdk-iam")] == ["sdk-alice"]
        await admin.grant("sdk-alice", "root/sdk-iam", "sandbox.create")
        await admin.grant("sdk-alice", "root/sdk-iam", "sandbox.operate")
        await admin.grant("sdk-alice", "root", "layer.use")  # the images of root (scratch)
        assert sorted((g.project, g.permission) for g in await admin.list_grants(principal="sdk-alice")) == [
            ("root", "layer.use"), ("root/sdk-iam", "sandbox.create"), ("root/sdk-iam", "sandbox.operate")
        ]
        tok = await admin.create_token("sdk-alice", ttl_s=3600, description="sdk test")
        assert tok.token.startswith("dsk.") and tok.info.principal == "sdk-alice"
        assert [t.description for t in await admin.list_tokens("sdk-alice")] == ["sdk test"]

        async with opendsec.AsyncClient(cluster.addr, token=tok.token, project="root/sdk-iam/rl", ca=cluster.local.ca) as alice:
            me = await alice.whoami()
            assert me.principal == "sdk-alice"
            # The grant on root/sdk-iam holds in its subproject; the quota of 1 on the parent
            # stops the second sandbox; nothing is granted elsewhere.
            sb = await alice.create_sandbox("sim", cpu=500, memory_mb=64)
            with pytest.raises(errors.QuotaExceeded):
                await alice.create_sandbox("sim", cpu=500, memory_mb=64)
            with pytest.raises(errors.PermissionDenied):
                await alice.create_sandbox("sim", project="root", cpu=500, memory_mb=64)
            usage = {u.path: u.usage.sandboxes for u in await admin.get_usage("root/sdk-iam")}
            assert usage["root/sdk-iam"] == 1 and usage["root/sdk-iam/rl"] == 1
            with pytest.raises(errors.InvalidState):
                await admin.delete_project("root/sdk-iam/rl")  # it still has a sandbox
            await sb.stop()

            await admin.revoke_grant("sdk-alice", "root/sdk-iam", "sandbox.create")
            with pytest.raises(errors.NotFound):
                await admin.revoke_grant("sdk-alice", "root/sdk-iam", "sandbox.create")
            await admin.revoke_token(tok.info.id)
            with pytest.raises(errors.Unauthenticated):
                await alice.whoami()
        await admin.delete_principal("sdk-alice")
        with pytest.raises(errors.NotFound):
            await admin.delete_principal("sdk-alice")


async def test_http_request_to_a_server_inside(container) -> None:
    async with client(container) as c, c.run_sandbox("container", IMG, **RES) as sb:
        await sb.write_file("/www/index.html", "hello over http\n", make_parents=True)
        await sb.start_process(["httpd", "-f", "-p", "127.0.0.1:8080", "-h", "/www"], tag="web")
        last: object = None
        for _ in range(100):
            try:
                r = await sb.http_request(8080, "/index.html", method="get", timeout=5)
                break
            except errors.OpendsecError as e:  # the server is not listening yet
                last = e
                await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"no answer from the server inside: {last!r}")
        assert r.status == 200 and r.body == b"hello over http\n"
        r = await sb.http_request(8080, "/absent")
        assert r.status == 404


async def test_output_limits(container) -> None:
    async with client(container) as c, c.run_sandbox("container", IMG, cpu=500, memory_mb=256, disk_mb=256) as sb:
        r = await sb.run_shell("printf 0123456789abcdef; printf xyz >&2", max_output_bytes=10)
        assert (r.stdout, r.stdout_dropped_bytes, r.stderr, r.stderr_dropped_bytes) == ("0123456789", 6, "xyz", 0)
        # Past the 16 MiB default, when asked for: all of it, and nothing dropped.
        n = 20 << 20
        got, dropped = 0, -1
        async for ch in sb.stream_shell(f"head -c {n} /dev/zero", max_output_bytes=n):
            if isinstance(ch, opendsec.OutputChunk):
                got += len(ch.data)
            else:
                dropped = ch.stdout_dropped_bytes
        assert (got, dropped) == (n, 0)
        with pytest.raises(ValueError):
            await sb.run_shell("true", max_output_bytes=-1)
