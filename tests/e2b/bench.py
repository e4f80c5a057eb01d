#!/usr/bin/env python3
"""Benchmarks of the E2B gateway: E2B's own SDK (through the gateway) beside opendsec's SDK
(straight to the apiserver) doing the same, in one run against one cluster. Prints figures;
passes or fails on nothing but errors (``make bench-e2b``).

- the first creation from the image (its layers not yet cached on the edge, as a user's first);
- creation to first command: E2B ``Sandbox.create()`` then ``commands.run("true")``, beside
  opendsec ``create_sandbox`` then ``run_shell("true")`` (each SDK's way to the first command),
  both with E2B's default resources and the e2b-base image, sequential, p50/p99;
- ``commands.run("true")`` round trips on one sandbox, beside opendsec's ``run_shell("true")``
  (a session's shell) and beside what the gateway itself does for it (opendsec
  ``start_process(["/bin/bash", "-l", "-c", "true"])`` then its exit): the last pair is the
  gateway's own cost;
- ``run_code("1+1")`` round trips (code interpreter, a warm kernel);
- a sandbox's port: E2B ``get_host(port)`` through the gateway (public traffic), beside
  opendsec's ``http_request`` and beside ``curl`` to 127.0.0.1 inside the sandbox (the floor);
- file write and read of ``--file-mib`` MiB through E2B's SDK, beside opendsec's SDK.

Published E2B figures for comparison: ~150 ms creation, 0.44 s time to interactive
(third-party measurement).

Run as root after ``make agent e2b-images`` and a release build of opendsecctl.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sdk" / "python" / "tools"))
from localcluster import LocalCluster  # noqa: E402


def pct(v: List[float], p: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def show(name: str, ms: List[float]) -> None:
    print(f"  {name:<58} p50 {pct(ms, 50):8.2f} ms  p99 {pct(ms, 99):8.2f} ms  mean {statistics.fmean(ms):8.2f} ms  (n={len(ms)})")


def timed(n: int, f: Callable[[], None]) -> List[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def rootfs(which: str) -> Path:
    out = subprocess.run([str(REPO / "scripts" / "e2b-images.sh"), which, "--path"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--creations", type=int, default=20)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--code-calls", type=int, default=100)
    ap.add_argument("--file-mib", type=int, default=64)
    args = ap.parse_args()
    ctl = Path(os.environ.get("OPENDSECCTL", REPO / "target" / "release" / "opendsecctl"))
    cl = LocalCluster(ctl, ("container",), prefix="opendsec-e2b-bench.")
    try:
        e2b_env = cl.e2b_env()
        cl.import_rootfs(rootfs("base"), "e2b-base:latest")
        cl.import_rootfs(rootfs("code-interpreter"), "code-interpreter-v1:latest", timeout=900)
        os.environ.update(e2b_env)
        run(args, cl)
    finally:
        cl.close()


def run(args: argparse.Namespace, cl: LocalCluster) -> None:
    import opendsec
    from e2b import Sandbox
    from e2b_code_interpreter import Sandbox as CodeSandbox

    res = dict(cpu=2000, memory_mb=512, disk_mb=2048)
    print("E2B gateway benchmark (container sandboxes, 2 CPUs / 512 MiB / 2 GiB, image e2b-base)")
    with opendsec.Client(cl.addr, token=cl.token, ca=cl.ca) as c:
        # The first creation from the image, as a user's first: its layers are not on the
        # edge's cache yet. It warms the cache for everything after.
        t = time.perf_counter()
        first = Sandbox.create()
        first.commands.run("true")
        print(f"first creation from the image (cold layer cache), E2B SDK, create + first command: "
              f"{(time.perf_counter() - t) * 1e3:.0f} ms")
        first.kill()
        c.create_sandbox("container", "e2b-base:latest", user="user", **res).stop()

        print("creation to the first command, sequential (layers cached):")
        e2b_ms, ods_ms = [], []
        for _ in range(args.creations):
            t = time.perf_counter()
            s = Sandbox.create()
            s.commands.run("true")
            e2b_ms.append((time.perf_counter() - t) * 1e3)
            s.kill()
            t = time.perf_counter()
            sb = c.create_sandbox("container", "e2b-base:latest", user="user", **res)
            sb.run_shell("true")
            ods_ms.append((time.perf_counter() - t) * 1e3)
            sb.stop()
        show("E2B SDK   Sandbox.create() + commands.run('true')", e2b_ms)
        show("opendsec  create_sandbox() + run_shell('true')", ods_ms)

        print("round trips on one sandbox:")
        s = Sandbox.create()
        sb = c.create_sandbox("container", "e2b-base:latest", user="user", **res)
        try:
            s.commands.run("true")
            show("E2B SDK   commands.run('true')  (a process: bash -l -c)", timed(args.calls, lambda: s.commands.run("true")))
            sb.run_shell("true")
            show("opendsec  run_shell('true')  (the session's shell)", timed(args.calls, lambda: sb.run_shell("true")))

            def same_as_gateway() -> None:
                pid = sb.start_process(["/bin/bash", "-l", "-c", "true"], user="user")
                sb.wait_process(pid)

            same_as_gateway()
            show("opendsec  start_process(bash -l -c true) + wait  (the gateway's path)", timed(args.calls, same_as_gateway))

            # A sandbox's port: E2B's get_host (the gateway, for nobody: public traffic)
            # beside opendsec's http_request (a token), and curl inside the sandbox to
            # 127.0.0.1 (the server's own time: the floor).
            import httpx

            s.commands.run("python3 -m http.server 8100", background=True, timeout=0)
            sb.start_process(["python3", "-m", "http.server", "8100"], user="user")
            url = f"https://{s.get_host(8100)}/"
            for _ in range(100):
                try:
                    if httpx.get(url).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            with httpx.Client() as hc:
                show("E2B SDK   GET https://get_host(8100)/  (gateway, keep-alive)", timed(args.calls, lambda: hc.get(url)))
            sb.http_request(8100)
            show("opendsec  http_request(8100, '/')", timed(args.calls, lambda: sb.http_request(8100)))
            loop = f"for i in $(seq {args.calls}); do curl -s -o /dev/null -w '%{{time_total}}\\n' http://127.0.0.1:8100/; done"
            inside = [float(x) * 1e3 for x in s.commands.run(loop, timeout=0).stdout.split()]
            show("curl inside the sandbox, http://127.0.0.1:8100/  (the floor)", inside)

            data = os.urandom(args.file_mib << 20)
            mib = args.file_mib
            for who, write, read in (
                ("E2B SDK  ", lambda: s.files.write("/tmp/big.bin", data), lambda: s.files.read("/tmp/big.bin", format="bytes")),
                ("opendsec ", lambda: sb.write_file("/tmp/big.bin", data), lambda: sb.read_file("/tmp/big.bin")),
            ):
                t = time.perf_counter()
                write()
                w = time.perf_counter() - t
                t = time.perf_counter()
                got = read()
                r = time.perf_counter() - t
                assert bytes(got) == data
                print(f"  {who} file write {mib} MiB: {mib / w:7.1f} MiB/s   read: {mib / r:7.1f} MiB/s")
        finally:
            s.kill()
            sb.stop()

    print("code interpreter:")
    with CodeSandbox.create() as ci:
        t = time.perf_counter()
        ci.run_code("1+1")
        print(f"  first run_code('1+1') (the kernel starts): {(time.perf_counter() - t) * 1e3:.0f} ms")
        show("E2B SDK   run_code('1+1')", timed(args.code_calls, lambda: ci.run_code("1+1")))
    print("published E2B figures: ~150 ms creation, 0.44 s time to interactive (third-party)")


if __name__ == "__main__":
    main()
