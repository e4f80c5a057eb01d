#!/usr/bin/env python3
"""An RL-style batch: many sandboxes from one call, a scored task in each, results collected.

The shape of an evaluation or rollout step in a training loop:

1. ``create_sandboxes(n, ...)`` asks for all ``n`` sandboxes in one call; the cluster places
   them and streams each one back as it is running (``on_progress`` drives a progress bar).
2. Every sandbox runs a small scored task (here: a Python "policy" whose parameter depends on
   the sandbox's index, evaluated on a fixed objective; its last output line is the score),
   at most ``--parallel`` at a time, with a second progress bar.
3. A summary: how many scored, mean/best/worst score, failures by kind.
4. Clean-up: every sandbox of this run is stopped, also after an error or Ctrl-C. The
   sandboxes carry a label unique to the run, so even ones whose creation answer was lost are
   found and stopped.

Resources are kept small (0.25 CPU, 128 MiB memory, 64 MiB disk each; see --cpu, --memory,
--disk) so the default 200 fit a local cluster's edge. On a small, busy machine the edge may
refuse some with ``no_capacity`` (its final admission also checks the host's actual CPU and
memory pressure); the SDK asks again for those, in one more batch call, until they are made or
the client's ``retry_timeout`` runs out. What is still refused then counts as a failure, and
``--max-failures`` says how many the run tolerates.

    export OPENDSEC_ADDR=127.0.0.1:7000 OPENDSEC_TOKEN=...
    python examples/rl_batch.py [--count 200] [--parallel 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from typing import Dict, List, Optional, Tuple

import opendsec
from opendsec import errors

# The task each sandbox runs. POLICY_PARAM differs per sandbox; the objective peaks at 0.7, so
# the sandbox whose parameter is nearest 0.7 scores best. A real job would run an episode of
# an environment here (and could stream its log with stream_shell).
TASK = r'''
import math, os
x = float(os.environ["POLICY_PARAM"])
score = 1.0 - (x - 0.7) ** 2 + 0.05 * math.sin(20 * x)
print(f"param={x:.3f}")
print(f"{score:.6f}")
'''


class ProgressBar:
    """A dependency-free text progress bar on stderr.

    On a terminal it redraws one line; otherwise (a log file, a CI job) it prints a line at
    each 10% step so logs stay readable.
    """

    def __init__(self, label: str, total: int, width: int = 30) -> None:
        self.label, self.total, self.width = label, max(total, 1), width
        self.tty = sys.stderr.isatty()
        self.last_step = -1
        self.start = time.monotonic()

    def update(self, done: int, total: Optional[int] = None) -> None:
        if total is not None:
            self.total = max(total, 1)
        frac = min(done / self.total, 1.0)
        filled = int(frac * self.width)
        line = f"{self.label:<9} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} " \
               f"{time.monotonic() - self.start:5.1f}s"
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done >= self.total else ""))
        else:
            step = int(frac * 10)
            if step == self.last_step:
                return
            self.last_step = step
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=200, help="sandboxes to create (default: 200)")
    p.add_argument("--parallel", type=int, default=32, help="tasks running at once (default: 32)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds allowed per task (default: 60)")
    p.add_argument("--image", default=os.environ.get("OPENDSEC_IMAGE", "debian:bookworm"),
                   help="image with python3 (default: $OPENDSEC_IMAGE or debian:bookworm)")
    p.add_argument("--backend", default="container", help="sandbox backend (default: container)")
    p.add_argument("--cpu", type=int, default=250, help="millicores per sandbox (default: 250)")
    p.add_argument("--memory", type=int, default=128, help="MiB of memory per sandbox (default: 128)")
    p.add_argument("--disk", type=int, default=64, help="MiB of disk per sandbox (default: 64)")
    p.add_argument("--max-failures", type=int, default=0,
                   help="exit non-zero when more items than this fail (default: 0)")
    args = p.parse_args()
    if args.count < 1 or args.parallel < 1:
        p.error("--count and --parallel must be at least 1")
    return args


async def run_task(sb: opendsec.Sandbox, index: int, n: int, timeout: float) -> float:
    """Runs the scored task in one sandbox and returns its score (raises on failure)."""
    param = index / max(n - 1, 1)
    r = await sb.run_shell(
        "python3 -c \"$TASK_SRC\"",
        env={"TASK_SRC": TASK, "POLICY_PARAM": f"{param:.6f}"},
        timeout=timeout,
    )
    if r.timed_out:
        raise TimeoutError(f"task timed out after {timeout}s")
    if r.exit_code != 0:
        raise RuntimeError(f"task exited {r.exit_code}: {r.stderr.strip()[-200:]}")
    return float(r.stdout.strip().splitlines()[-1])


async def stop_run(
    client: opendsec.AsyncClient, run_label: Dict[str, str], known: List[opendsec.Sandbox]
) -> Tuple[int, int]:
    """Stops every sandbox of this run: those we hold plus any the label finds.

    Returns (stopped, failed to stop)."""
    ids = {s.id for s in known}
    try:
        ids |= {s.id for s in await client.list_sandboxes(labels=run_label)}
    except errors.OpendsecError as e:
        print(f"warning: could not list the run's sandboxes ({e}); stopping the known ones", file=sys.stderr)

    async def stop(sid: str) -> bool:
        # Already stopped (or gone) is fine; anything else is reported but does not stop the rest.
        try:
            await client.stop_sandbox(sid)
        except (errors.NotFound, errors.InvalidState):
            pass
        except errors.OpendsecError as e:
            print(f"warning: stopping {sid}: {e}", file=sys.stderr)
            return False
        return True

    # shield: the clean-up completes even when the run is being cancelled (Ctrl-C).
    done = await asyncio.shield(asyncio.gather(*(stop(sid) for sid in sorted(ids))))
    return sum(done), len(done) - sum(done)


async def run(args: argparse.Namespace) -> int:
    # A label unique to this run: clean-up finds every sandbox of it by this label.
    run_label = {"example": "rl-batch", "run": uuid.uuid4().hex[:12]}
    ok = False  # set when the run's results are good enough
    clean = True  # cleared when some sandbox could not be stopped
    sandboxes: List[opendsec.Sandbox] = []
    async with opendsec.AsyncClient() as client:
        try:
            # 1. One call for all of them. return_exceptions=True: an item that failed (e.g.
            # no_capacity) comes back as an OpendsecError in its place instead of raising.
            t0 = time.monotonic()
            bar = ProgressBar("created", args.count)
            items = await client.create_sandboxes(
                args.count, args.backend, args.image,
                cpu=args.cpu, memory_mb=args.memory, disk_mb=args.disk,
                labels=run_label,
                # A safety net: sandboxes of a crashed script stop on their own after 10 min.
                ttl_max_s=600,
                return_exceptions=True,
                on_progress=bar.update,
            )
            created_s = time.monotonic() - t0
            sandboxes = [s for s in items if isinstance(s, opendsec.Sandbox)]
            failures: Dict[str, int] = {}
            for i, it in enumerate(items):
                if isinstance(it, errors.OpendsecError):
                    failures[f"create: {it.reason}"] = failures.get(f"create: {it.reason}", 0) + 1
                    print(f"  item {i} not created: {it}", file=sys.stderr)
            print(f"created {len(sandboxes)}/{args.count} sandboxes in {created_s:.1f}s")

            # 2. The scored task in each, at most --parallel at once.
            t1 = time.monotonic()
            sem = asyncio.Semaphore(args.parallel)
            bar = ProgressBar("scored", len(sandboxes))
            done = 0

            async def one(i: int, sb: opendsec.Sandbox) -> Tuple[int, object]:
                nonlocal done
                async with sem:
                    try:
                        result: object = await run_task(sb, i, args.count, args.timeout)
                    except (errors.OpendsecError, RuntimeError, TimeoutError, ValueError) as e:
                        result = e
                done += 1
                bar.update(done)
                return i, result

            results = await asyncio.gather(*(one(i, sb) for i, sb in enumerate(items) if isinstance(sb, opendsec.Sandbox)))
            run_s = time.monotonic() - t1
            scores = {i: r for i, r in results if isinstance(r, float)}
            for _, r in results:
                if not isinstance(r, float):
                    kind = f"task: {r.reason}" if isinstance(r, errors.OpendsecError) else f"task: {type(r).__name__}"
                    failures[kind] = failures.get(kind, 0) + 1
                    print(f"  failed: {r}", file=sys.stderr)

            # 3. Summary.
            print(f"scored {len(scores)}/{args.count} in {run_s:.1f}s")
            if scores:
                best = max(scores, key=scores.__getitem__)
                worst = min(scores, key=scores.__getitem__)
                print(f"mean score: {statistics.mean(scores.values()):.4f}")
                print(f"best:  sandbox #{best} ({items[best].id}) score {scores[best]:.4f}")
                print(f"worst: sandbox #{worst} ({items[worst].id}) score {scores[worst]:.4f}")
            n_failed = sum(failures.values())
            print(f"failures: {n_failed}" + "".join(f"\n  {k}: {v}" for k, v in sorted(failures.items())))
            ok = n_failed <= args.max_failures and bool(scores)
        finally:
            # 4. Clean-up, whatever happened above.
            stopped, not_stopped = await stop_run(client, run_label, sandboxes)
            print(f"stopped {stopped} sandboxes")
            if not_stopped:
                # Their ttl_max_s stops them later; still, the run did not end cleanly.
                print(f"error: {not_stopped} sandboxes could not be stopped", file=sys.stderr)
                clean = False
    return 0 if ok and clean else 1


def main() -> int:
    args = parse_args()
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        print("interrupted (the run's sandboxes were stopped)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (opendsec.OpendsecError, ValueError) as e:
        # OpendsecError: a failed call (e.reason says which kind); ValueError: no OPENDSEC_ADDR.
        sys.exit(f"error: {e}")
