"""Fixtures: a real local cluster from the built binaries (integration tests), and helpers.

The cluster is ``opendsecctl cluster up`` with one sim edge offering the ``sim`` and
``container`` backends, brought up once per test session and killed at the end. A busybox image
``busybox:t`` is imported from the host's /bin/busybox for container sandboxes (root only), and
the Debian test image (bash, python3; built by ``make images`` through
``scripts/debian-image.sh``) as ``debian:bookworm`` for the examples (``examples/``).
``$OPENDSECCTL`` overrides the binary (default: the repository's target/debug/opendsecctl, else
target/release/opendsecctl).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "sdk" / "python" / "tools"))
from localcluster import LocalCluster  # noqa: E402  (beside the SDK, shared with tools/bench.py)

def _default_ctl() -> Path:
    for profile in ("debug", "release"):
        p = REPO / "target" / profile / "opendsecctl"
        if p.exists():
            return p
    return REPO / "target" / "debug" / "opendsecctl"


CTL = Path(os.environ.get("OPENDSECCTL") or _default_ctl())
# The SDK's import_image runs the same binary.
os.environ["OPENDSECCTL"] = str(CTL)
IMAGE = "busybox:t"
DEBIAN_IMAGE = "debian:bookworm"
DEBIAN_SCRIPT = REPO / "scripts" / "debian-image.sh"


@dataclass
class Cluster:
    local: LocalCluster
    has_container: bool = False
    has_image: bool = False
    # Why the Debian image is not there (None: imported as DEBIAN_IMAGE).
    debian_missing: Optional[str] = "not imported yet"

    @property
    def addr(self) -> str:
        return self.local.addr

    @property
    def token(self) -> str:
        return self.local.token

    @property
    def state(self) -> Path:
        return self.local.state

    def env(self) -> dict:
        return self.local.env()


def debian_rootfs() -> Path:
    """The Debian test image's root file system, where ``scripts/debian-image.sh`` builds it
    (``$OPENDSEC_DEBIAN_ROOTFS`` overrides), as the Rust tests find it."""
    env = os.environ.get("OPENDSEC_DEBIAN_ROOTFS")
    if env:
        return Path(env)
    out = subprocess.run([str(DEBIAN_SCRIPT), "--path"], capture_output=True, text=True, check=True).stdout
    return Path(out.strip())


def _import_debian(local: LocalCluster) -> Optional[str]:
    """Imports the Debian test image as DEBIAN_IMAGE; returns why not, or None when imported."""
    rootfs = debian_rootfs()
    if not (rootfs / "usr" / "bin" / "python3").exists():
        return f"the Debian test image is missing ({rootfs}): run `make images` (scripts/debian-image.sh) first"
    local.import_rootfs(rootfs, DEBIAN_IMAGE)
    return None


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if not CTL.exists():
        pytest.fail(f"{CTL} is not built: run `cargo build -p opendsec-cli` (make sdk-test does)")
    local = LocalCluster(CTL, ("sim", "container", "fncall"), prefix="opendsec-sdk-test.")
    try:
        c = Cluster(local)
        # The image is needed by every backend (sim too); running containers needs root.
        c.has_image = local.import_busybox(IMAGE)
        c.has_container = c.has_image and os.geteuid() == 0
        c.debian_missing = _import_debian(local)
        yield c
    finally:
        local.close()


@pytest.fixture
def dead_address() -> str:
    """An address nothing listens on (a port just bound and released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


@pytest.fixture
def container(cluster: Cluster) -> Cluster:
    if not cluster.has_container:
        pytest.fail("container sandboxes need root and /bin/busybox (CI runs as root; make setup installs busybox-static)")
    return cluster


@pytest.fixture
def debian(container: Cluster) -> Cluster:
    """A cluster with container sandboxes and the Debian image (bash, python3): never skipped;
    fails, saying what to run, when the image was not built."""
    if container.debian_missing is not None:
        pytest.fail(container.debian_missing)
    return container


class Proxy:
    """A TCP proxy in front of an address whose live connections can be cut at will."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.server: Optional[asyncio.base_events.Server] = None
        self.conns: List[asyncio.StreamWriter] = []
        self.address = ""

    async def start(self) -> "Proxy":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = "127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(self.host, self.port)
        except OSError:
            w.close()
            return
        self.conns += [w, uw]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(r, uw), pump(ur, w))

    def cut(self) -> None:
        """Resets every live connection (new ones are still accepted)."""
        for w in self.conns:
            t = w.transport
            if t is not None:
                t.abort()
        self.conns = []

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def proxy(cluster: Cluster):
    p = await Proxy(cluster.addr).start()
    yield p
    await p.close()
