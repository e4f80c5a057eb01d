#!/usr/bin/env python3
"""Benchmarks of the Python SDK against a real local cluster, beside the Rust client (the
peer: ``opendsecctl bench``) in the same run. Prints figures; passes or fails on nothing but
errors.

It starts ``opendsecctl cluster up`` (a container edge, state in a temporary directory, the
edge stopping its sandboxes on exit), imports a busybox image from /bin/busybox, then measures:

- batch creation of ``--count`` container sandboxes: ``create_sandboxes`` (one call) beside
  ``opendsecctl bench create --batch`` (one call), each followed by the stop of them all;
- shell round trips (``run_shell("true")``) in one session: the async client, the sync
  client, and ``opendsecctl bench exec`` on the same sandbox;
- the same with ``--sessions`` sessions in parallel (calls/s);
- ``stream_shell`` of a command printing ``--stream-mib`` MiB (MiB/s);
- ``write_file`` and ``read_file`` of ``--file-mib`` MiB (MiB/s).

Run as root (container sandboxes), after ``make agent`` and a release build of opendsecctl:

    make bench-sdk
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import List

import opendsec
from localcluster import LocalCluster  # beside this file

REPO = Path(__file__).resolve().parents[3]


def pct(v: List[float], p: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def lat(name: str, ms: List[float], seconds: float) -> str:
    return (f"{name}: {len(ms)} calls in {seconds:.2f}s ({len(ms) / seconds:.0f}/s); "
            f"p50 {pct(ms, 50):.3f} ms, p90 {pct(ms, 90):.3f} ms, p99 {pct(ms, 99):.3f} ms, "
            f"mean {statistics.fmean(ms):.3f} ms")


async def bench(args: argparse.Namespace, cl: LocalCluster, image: str) -> None:
    res = dict(cpu=100, memory_mb=64, disk_mb=64)
    async with opendsec.AsyncClient(cl.addr, token=cl.token, ca=cl.ca) as c:
        # Batch creation: the SDK, then the Rust client, the same count and spec.
        t = time.perf_counter()
        sbs = await c.create_sandboxes(args.count, "container", image, **res)
        made = time.perf_counter() - t
        t = time.perf_counter()
        await asyncio.gather(*(s.stop() for s in sbs))
        stopped = time.perf_counter() - t
        print(f"sdk  batch create {args.count}: {made:.2f}s ({args.count / made:.0f}/s); stop all: {stopped:.2f}s")
        r = cl.ctl_json("bench", "create", "--backend", "container", "--image", image, "--count", str(args.count),
                        "--batch", str(args.count), "--concurrency", "1", "--cpu", str(res["cpu"]),
                        "--memory", str(res["memory_mb"]), "--disk", str(res["disk_mb"]))
        if r["create"]["failed"] or r["stop"]["failed"]:
            raise RuntimeError(f"the Rust client's batch failed: {r['create']['errors']} {r['stop']['errors']}")
        print(f"rust batch create {args.count}: {r['create']['seconds']:.2f}s ({r['create']['per_second']:.0f}/s); "
              f"stop all: {r['stop']['seconds']:.2f}s")

        async with c.run_sandbox("container", image, cpu=2000, memory_mb=512, disk_mb=1024) as sb:
            # Shell round trips in one session (a warm-up call first).
            await sb.run_shell("true", session="lat")
            ms = []
            t = time.perf_counter()
            for _ in range(args.calls):
                t0 = time.perf_counter()
                r = await sb.run_shell("true", session="lat")
                ms.append((time.perf_counter() - t0) * 1e3)
                assert r.exit_code == 0
            print("sdk  async " + lat("run_shell true", ms, time.perf_counter() - t))

            with opendsec.Client(cl.addr, token=cl.token, ca=cl.ca) as sc:
                ssb = sc.sandbox(sb.id)
                ssb.run_shell("true", session="lat-sync")
                ms = []
                t = time.perf_counter()
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    ssb.run_shell("true", session="lat-sync")
                    ms.append((time.perf_counter() - t0) * 1e3)
                print("sdk  sync  " + lat("run_shell true", ms, time.perf_counter() - t))

            r = cl.ctl_json("bench", "exec", "--sandbox", sb.id, "--count", str(args.calls))
            print(f"rust       exec true: {r['ok']} calls in {r['seconds']:.2f}s ({r['per_second']:.0f}/s); "
                  f"p50 {r['latency_ms']['p50']:.3f} ms, p90 {r['latency_ms']['p90']:.3f} ms, "
                  f"p99 {r['latency_ms']['p99']:.3f} ms")

            # Parallel sessions.
            n = args.sessions
            await asyncio.gather(*(sb.run_shell("true", session=f"par-{i}") for i in range(n)))
            per = args.calls // n
            all_ms: List[float] = []

            async def loop(i: int) -> None:
                for _ in range(per):
                    t0 = time.perf_counter()
                    await sb.run_shell("true", session=f"par-{i}")
                    all_ms.append((time.perf_counter() - t0) * 1e3)

            t = time.perf_counter()
            await asyncio.gather(*(loop(i) for i in range(n)))
            print(f"sdk  async {n} sessions " + lat("run_shell true", all_ms, time.perf_counter() - t))
            r = cl.ctl_json("bench", "exec", "--sandbox", sb.id, "--count", str(per * n), "--concurrency", str(n))
            print(f"rust       {n} sessions exec true: {r['ok']} calls in {r['seconds']:.2f}s "
                  f"({r['per_second']:.0f}/s); p50 {r['latency_ms']['p50']:.3f} ms, p99 {r['latency_ms']['p99']:.3f} ms")

            # Streamed output.
            mib = args.stream_mib
            got = 0
            t = time.perf_counter()
            async for ch in sb.stream_shell(f"head -c {mib << 20} /dev/zero", session="stream", max_output_bytes=mib << 20):
                if isinstance(ch, opendsec.OutputChunk) and ch.stream == "stdout":
                    got += len(ch.data)
            s = time.perf_counter() - t
            assert got == mib << 20, got
            print(f"sdk  stream_shell {mib} MiB: {s:.2f}s, {mib / s:.0f} MiB/s")

            # Files.
            mib = args.file_mib
            data = os.urandom(mib << 20)
            t = time.perf_counter()
            await sb.write_file("/tmp/bench.bin", data)
            w = time.perf_counter() - t
            t = time.perf_counter()
            back = await sb.read_file("/tmp/bench.bin")
            r_s = time.perf_counter() - t
            assert back == data
            print(f"sdk  write_file {mib} MiB: {mib / w:.0f} MiB/s; read_file: {mib / r_s:.0f} MiB/s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=100, help="sandboxes per batch creation (default 100)")
    p.add_argument("--calls", type=int, default=1000, help="shell round trips per measurement (default 1000)")
    p.add_argument("--sessions", type=int, default=16, help="parallel sessions (default 16)")
    p.add_argument("--stream-mib", type=int, default=256)
    p.add_argument("--file-mib", type=int, default=32, help="size of the file written and read back (the sandbox's disk is 1 GiB)")
    p.add_argument("--opendsecctl", default=os.environ.get("OPENDSECCTL", str(REPO / "target" / "release" / "opendsecctl")))
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: container sandboxes need namespaces, cgroups and loop devices")
    cl = LocalCluster(Path(args.opendsecctl), ("container",), prefix="opendsec-sdk-bench.")
    try:
        image = "bench:busybox"
        if not cl.import_busybox(image):
            sys.exit("no /bin/busybox: apt-get install busybox-static")
        print(f"python {sys.version.split()[0]}, grpcio {__import__('grpc').__version__}, "
              f"{os.cpu_count()} CPUs; cluster at {cl.addr}")
        asyncio.run(bench(args, cl, image))
    finally:
        cl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
