"""Plain result types returned by the SDK (the raw protos stay reachable where useful)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class ShellResult:
    """The outcome of :meth:`Sandbox.run_shell`.

    ``stdout``/``stderr`` are the recorded bytes decoded as UTF-8 (invalid bytes replaced);
    ``stdout_bytes``/``stderr_bytes`` are exact.
    """

    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    timed_out: bool = False
    cwd: str = ""
    request_id: str = ""
    stdout_dropped_bytes: int = 0
    stderr_dropped_bytes: int = 0

    @property
    def stdout(self) -> str:
        """``stdout_bytes`` decoded as UTF-8, invalid bytes replaced."""
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        """``stderr_bytes`` decoded as UTF-8, invalid bytes replaced."""
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        """Exit code 0 and no timeout."""
        return self.exit_code == 0 and not self.timed_out


@dataclass
class OutputChunk:
    """Output of a streamed command or process: ``stream`` is ``"stdout"`` or ``"stderr"``;
    ``offset`` is the position of ``data[0]`` in that stream."""

    stream: str
    offset: int
    data: bytes

    @property
    def text(self) -> str:
        """``data`` decoded as UTF-8, invalid bytes replaced."""
        return self.data.decode("utf-8", "replace")


@dataclass
class ShellExit:
    """Last item of :meth:`Sandbox.stream_shell`."""

    exit_code: int
    timed_out: bool = False
    cwd: str = ""
    request_id: str = ""
    stdout_dropped_bytes: int = 0
    stderr_dropped_bytes: int = 0


@dataclass
class ProcessExit:
    """Last item of :meth:`Sandbox.connect_process`: ``exit_code`` is -1 when killed by
    ``signal``."""

    exit_code: int
    signal: int = 0


@dataclass
class FileEntry:
    """One entry of :meth:`Sandbox.list_dir` (or :meth:`Sandbox.stat`)."""

    name: str
    path: str
    type: str  # "file", "dir", "symlink", "other"
    size: int
    mode: int
    modified_ms: int
    uid: int = 0
    gid: int = 0
    symlink_target: str = ""


@dataclass
class ProcessInfo:
    """One process of :meth:`Sandbox.list_processes`."""

    pid: int
    tag: str
    cmd: List[str] = field(default_factory=list)
    running: bool = False
    exit: Optional[ProcessExit] = None
