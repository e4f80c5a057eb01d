#!/usr/bin/env python3
"""The README's quick start: a container sandbox, Python code run in it, the sandbox stopped.

    . opendsec-state/env          # written by `make up`: address, token, the SDK's venv
    python3 examples/quickstart.py
"""

import opendsec

# The address, token and CA come from OPENDSEC_ADDR, OPENDSEC_TOKEN and OPENDSEC_CA.
with opendsec.Client() as client:
    with client.run_sandbox("container", "debian:bookworm") as sb:
        sb.write_file("/tmp/task.py", "import sys, platform\nprint(sum(range(10)), platform.python_version())\n")
        r = sb.run_shell("python3 /tmp/task.py")
        print(sb.id, "exit", r.exit_code, "->", r.stdout.strip())
    # leaving the block stopped the sandbox
