#!/usr/bin/env python3
"""A stateful shell session: ``cd``, ``export`` and shell functions persist across calls.

Each ``run_shell`` call with the same ``session`` runs in one long-lived bash inside the
sandbox, the way commands typed into one terminal do. This example changes directory,
exports a variable and defines a function in separate calls, then uses all three from a
later call; a second session starts fresh, proving sessions are isolated from each other.

Run against a cluster (``opendsecctl cluster up`` prints the two variables):

    export OPENDSEC_ADDR=127.0.0.1:7000 OPENDSEC_TOKEN=...
    python examples/stateful_session.py [--image debian:bookworm]
"""

from __future__ import annotations

import argparse
import os
import sys

import opendsec


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", default=os.environ.get("OPENDSEC_IMAGE", "debian:bookworm"),
                   help="image with bash (default: $OPENDSEC_IMAGE or debian:bookworm)")
    p.add_argument("--backend", default="container", help="sandbox backend (default: container)")
    return p.parse_args()


def check(ok: bool, what: str) -> None:
    """Fails the example (exit 1) with a message when an expectation does not hold."""
    if not ok:
        sys.exit(f"FAILED: {what}")


def main() -> int:
    args = parse_args()
    # The sync client reads OPENDSEC_ADDR / OPENDSEC_TOKEN (and OPENDSEC_PROJECT) itself.
    with opendsec.Client() as client:
        # run_sandbox stops the sandbox when the block ends, error or not. Small resources:
        # a shell needs little.
        with client.run_sandbox(args.backend, args.image, cpu=250, memory_mb=128, disk_mb=64) as sb:
            print(f"sandbox {sb.id} is {sb.state}")
            s = "work"  # any name; the first use of a session starts its shell

            # 1. State set up in three separate calls...
            r = sb.run_shell("mkdir -p /tmp/project && cd /tmp/project", session=s)
            print(f"cd:       exit={r.exit_code} cwd={r.cwd}")  # ShellResult.cwd: where the shell is now
            r = sb.run_shell("export RUN_NAME=demo-42", session=s)
            print(f"export:   exit={r.exit_code}")
            r = sb.run_shell('greet() { echo "hello, $1, from $(pwd) in run $RUN_NAME"; }', session=s)
            print(f"function: exit={r.exit_code}")

            # 2. ...is all there in a later call.
            r = sb.run_shell("greet sandbox", session=s)
            print(f"greet:    {r.stdout.strip()}")
            check(r.ok and r.stdout == "hello, sandbox, from /tmp/project in run demo-42\n",
                  f"the session kept no state: {r!r}")

            # Exit codes and stderr come back as values, not exceptions; the session survives.
            r = sb.run_shell("echo to-stderr >&2; false", session=s)
            print(f"failing:  exit={r.exit_code} stderr={r.stderr.strip()!r}")
            check(r.exit_code == 1 and r.stderr == "to-stderr\n", f"unexpected result: {r!r}")
            r = sb.run_shell("echo still $RUN_NAME in $(pwd)", session=s)
            print(f"after:    {r.stdout.strip()}")
            check(r.stdout == "still demo-42 in /tmp/project\n", f"state lost after a failure: {r!r}")

            # 3. Another session is another shell: none of the above is visible there.
            r = sb.run_shell("echo ${RUN_NAME:-unset} $(type -t greet || echo no-greet) $(pwd)", session="other")
            print(f"other:    {r.stdout.strip()}")
            check(r.stdout.split()[:2] == ["unset", "no-greet"], f"sessions leaked state: {r!r}")

            # 4. Closing a session ends its shell; the next use starts a fresh one.
            sb.close_session(s)
            r = sb.run_shell("echo ${RUN_NAME:-unset}", session=s)
            print(f"reopened: {r.stdout.strip()}")
            check(r.stdout == "unset\n", f"a closed session kept state: {r!r}")
    print("OK: session state persisted across calls")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (opendsec.OpendsecError, ValueError) as e:
        # OpendsecError: a failed call (e.reason says which kind); ValueError: no OPENDSEC_ADDR.
        sys.exit(f"error: {e}")
