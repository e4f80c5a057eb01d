"""opendsec: Python SDK for the opendsec sandbox platform.

Quick use::

    import asyncio, opendsec

    async def main():
        async with opendsec.AsyncClient() as client:          # OPENDSEC_ADDR / OPENDSEC_TOKEN
            async with client.run_sandbox("container", "debian:bookworm") as sb:
                r = await sb.run_shell("echo hello")
                print(r.exit_code, r.stdout)

    asyncio.run(main())

Synchronous scripts use :class:`opendsec.Client` with the same methods.
"""

from . import errors
from .client import AsyncClient, Sandbox, egress_rule, egress_text, state_name, state_value
from .errors import OpendsecError
from .sync import Client, SyncSandbox
from .types import FileEntry, OutputChunk, ProcessExit, ProcessInfo, ShellExit, ShellResult
from ._ids import new_lease_id, new_request_id

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "Client",
    "Sandbox",
    "SyncSandbox",
    "ShellResult",
    "ShellExit",
    "OutputChunk",
    "ProcessExit",
    "ProcessInfo",
    "FileEntry",
    "OpendsecError",
    "errors",
    "state_name",
    "state_value",
    "new_lease_id",
    "new_request_id",
    "egress_rule",
    "egress_text",
]
