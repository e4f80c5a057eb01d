"""The SDK's side of crates/cli/tests/it/multihost.rs: run by that test (in its private network
namespace, where the hosts are), with the SDK from the repository's venv. Talks to the
cluster only through the SDK, over both apiservers (OPENDSEC_ADDR lists them).

    python multihost_sdk.py first    # image, project with a quota, sim and container sandboxes,
                                     # a shell session, pause and resume, the quota refusal
    python multihost_sdk.py after    # after the test killed IAM's leader and an apiserver:
                                     # creations, sessions and the quota still work

Prints one JSON line of what it saw; any failure raises (a non-zero exit with the trace).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import opendsec
from opendsec import errors

PROJECT = "root/mh"
IMAGE = "busybox:t"


async def until(what: str, check, timeout: float = 60.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            got = await check()
            if got:
                return got
        except errors.OpendsecError as e:
            last = e
        else:
            last = None
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s (last error: {last})")
        await asyncio.sleep(0.2)


async def create(client: opendsec.AsyncClient, backend: str):
    """A sandbox of ``backend``; waits (up to a minute) for an edge offering it to register
    and be probed healthy: the daemons were all started at once."""
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        try:
            return await client.create_sandbox(image=IMAGE, backend=backend, project=PROJECT)
        except (errors.NotFound, errors.NoCapacity) as e:
            if "offers backend" not in e.message and not isinstance(e, errors.NoCapacity):
                raise
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def usage(client: opendsec.AsyncClient) -> int:
    projects = await client.get_usage(PROJECT)
    return next(p.usage.sandboxes for p in projects if p.path == PROJECT)


async def first(client: opendsec.AsyncClient) -> dict:
    await client.import_image(rootfs=os.environ["MH_BUSYBOX"], name=IMAGE, store=os.environ["OPENDSEC_IMAGE_STORE"])
    await client.create_project(PROJECT, {"sandboxes": 5})

    # Sim sandboxes land on both sim edges (two hosts); the quota holds across apiservers.
    sims = []
    for _ in range(4):
        sims.append(await create(client, "sim"))
    edges = sorted({s.id.split(".")[0] for s in sims})

    # A container sandbox on the third host: a shell session keeps its state between calls.
    box = await create(client, "container")
    assert box.id.startswith("node-c."), box.id
    await box.run_shell("cd /tmp && export MH=carried && echo x > here", session="s1")
    r = await box.run_shell('echo "$MH $(pwd) $(cat here)"', session="s1")
    session_out = r.stdout.strip()
    assert session_out == "carried /tmp x", session_out

    # Quota: five in use, the sixth is refused whichever apiserver takes it.
    refused = None
    try:
        await create(client, "sim")
    except errors.QuotaExceeded as e:
        refused = e.reason
    assert refused == "quota_exceeded", refused
    assert await usage(client) == 5

    # Pause and resume the container sandbox: its files and session survive.
    paused = await box.pause()
    assert paused.state == "paused", paused.state
    resumed = await box.resume()
    assert resumed.state == "running", resumed.state
    r = await box.run_shell('echo "$MH $(cat /tmp/here)"', session="s1")
    after_pause = r.stdout.strip()
    assert after_pause == "carried x", after_pause

    for s in sims:
        await s.stop()
    await until("usage down to the container sandbox", lambda: _eq(usage(client), 1))
    return {"edges": edges, "container": box.id, "session": session_out, "refused": refused,
            "after_pause": after_pause}


async def _eq(aw, want) -> bool:
    return (await aw) == want


async def after(client: opendsec.AsyncClient) -> dict:
    # The container sandbox made before the faults still answers, its session intact.
    boxes = [s for s in await client.list_sandboxes(project=PROJECT) if s.backend == "container"]
    assert len(boxes) == 1, boxes
    box = boxes[0]
    r = await box.run_shell('echo "$MH"', session="s1")
    kept = r.stdout.strip()
    assert kept == "carried", kept
    # New creations up to the quota, then the refusal.
    made = []
    for _ in range(4):
        made.append(await create(client, "sim"))
    try:
        await create(client, "sim")
        raise AssertionError("the quota let a sixth sandbox in")
    except errors.QuotaExceeded:
        pass
    for s in made + [box]:
        await s.stop()
    await until("usage back to zero", lambda: _eq(usage(client), 0))
    return {"kept_session": kept, "created": len(made)}


async def main() -> None:
    phase = sys.argv[1]
    async with opendsec.AsyncClient(retry_timeout=30.0) as client:
        # The apiservers answer once IAM and a watcher do, and placements need healthy edges.
        await until("the cluster answers", client.whoami)
        out = await (first(client) if phase == "first" else after(client))
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
