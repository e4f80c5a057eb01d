#!/usr/bin/env python3
"""Retry-safe execution: a request id makes a command run at most once, however often it is sent.

Every ``run_shell``/``stream_shell`` call carries a request id (generated when you pass none).
The sandbox remembers the command and its result under that id, so sending the same id
again - because a connection dropped, a process crashed and restarted, or a job queue
delivered a message twice - re-attaches to the first run instead of starting a second one.
The SDK does this by itself on ``unavailable``; passing your own id (e.g. derived from a job
id) extends the guarantee across processes.

The command here appends a line to a counter file, so the file shows how often it really ran:

1. ``run_shell`` twice with one explicit request id: the same result, one line in the file.
2. A new request id runs the command again (two lines): ids, not command texts, are the key.
3. ``stream_shell`` prints output as it comes; a consumer that stops reading half way and
   calls again with the same id gets the whole output from the start, and the command still
   ran once.

    export OPENDSEC_ADDR=127.0.0.1:7000 OPENDSEC_TOKEN=...
    python examples/retry_safe.py
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

import opendsec

COUNTER = "/tmp/counter"
# Appends to the counter file and reports how many runs it has seen: the visible side effect.
COMMAND = f"echo ran >> {COUNTER}; echo \"run number $(wc -l < {COUNTER})\""
# Output over about a second, so a stream has something to deliver piece by piece.
STREAMED = f"echo ran >> {COUNTER}; for i in 1 2 3 4 5; do echo step $i; sleep 0.2; done"


def check(ok: bool, what: str) -> None:
    """Fails the example (exit 1) with a message when an expectation does not hold."""
    if not ok:
        sys.exit(f"FAILED: {what}")


def runs(sb: opendsec.SyncSandbox) -> int:
    """How many times the commands really ran (lines in the counter file)."""
    return sb.read_file(COUNTER).count(b"\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", default=os.environ.get("OPENDSEC_IMAGE", "debian:bookworm"),
                   help="image with a POSIX shell (default: $OPENDSEC_IMAGE or debian:bookworm)")
    p.add_argument("--backend", default="container", help="sandbox backend (default: container)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    with opendsec.Client() as client, client.run_sandbox(
        args.backend, args.image, cpu=250, memory_mb=128, disk_mb=64
    ) as sb:
        # 1. The same request id twice. In real code the id comes from something stable
        # (a job id, an episode number) so a restarted worker sends the same one.
        rid = opendsec.new_request_id()
        first = sb.run_shell(COMMAND, request_id=rid)
        again = sb.run_shell(COMMAND, request_id=rid)  # e.g. a retry after a timeout
        print(f"request {rid}")
        print(f"  first call:  {first.stdout.strip()!r} (exit {first.exit_code})")
        print(f"  second call: {again.stdout.strip()!r} (exit {again.exit_code})")
        print(f"  the command ran {runs(sb)} time(s)")
        check(first.stdout == again.stdout == "run number 1\n", "the second call returned another result")
        check(runs(sb) == 1, "the command ran twice")

        # 2. A new id is a new command run.
        other = sb.run_shell(COMMAND, request_id=opendsec.new_request_id())
        print(f"new request id: {other.stdout.strip()!r}; the command ran {runs(sb)} time(s)")
        check(other.stdout == "run number 2\n" and runs(sb) == 2, "a new request id did not run the command")

        # 3. stream_shell: chunks as they come (OutputChunk: stream, offset, data), then a
        # ShellExit. After a dropped connection the SDK re-attaches by itself from the offsets
        # it has; here the consumer itself gives up after the first chunk, as a crashed
        # worker would, and a second call with the same id picks the command up again.
        sid = opendsec.new_request_id()
        print(f"stream {sid}:")
        for item in sb.stream_shell(STREAMED, request_id=sid):
            if isinstance(item, opendsec.OutputChunk):
                print(f"  (first reader) {item.stream}@{item.offset}: {item.text!r}; stops reading")
                break  # leaving the loop closes this stream; the command keeps running
        seen: List[bytes] = []
        exit_code = None
        for item in sb.stream_shell(STREAMED, request_id=sid):
            if isinstance(item, opendsec.ShellExit):
                exit_code = item.exit_code
            else:
                print(f"  (second reader) {item.stream}@{item.offset}: {item.text!r}")
                seen.append(item.data)
        out = b"".join(seen).decode()
        print(f"  exit {exit_code}; the command ran {runs(sb) - 2} time(s) for this request id")
        check(exit_code == 0 and out == "".join(f"step {i}\n" for i in range(1, 6)),
              f"the re-attached stream lost or repeated output: {out!r}")
        check(runs(sb) == 3, "the streamed command ran twice")
    print("OK: every request id ran its command exactly once")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (opendsec.OpendsecError, ValueError) as e:
        # OpendsecError: a failed call (e.reason says which kind); ValueError: no OPENDSEC_ADDR.
        sys.exit(f"error: {e}")
