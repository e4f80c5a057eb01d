"""Fixtures: a real local cluster from the built binaries (integration tests), and helpers.

The cluster is ``opendsecctl cluster up`` with one sim edge offering the ``sim`` and
``container`` backends, brought up once per test session and killed at the end. A busybox image
``busybox:t`` is imported from the host's /bin/busybox for container sandboxes (root only), and
the Debian test image (bash, python3; built by ``make images`` through
``scripts/debian-image.sh``) as ``debian:bookworm`` for the examples (``examples/``).
Its edge saves sessions to a real S3-compatible server on loopback (moto's server mode, from
``make s3-server``), started here first.
``$OPENDSECCTL`` overrides the binary (default: the repository's target/debug/opendsecctl, else
target/release/opendsecctl).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
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


S3_VENV = Path(os.environ.get("OPENDSEC_S3_VENV") or REPO / "target" / "s3-venv")
S3_BUCKET = "sdk-sessions"


class S3Server:
    """moto's S3 server on a free loopback port, with bucket S3_BUCKET made; never skipped."""

    def __init__(self) -> None:
        exe = S3_VENV / "bin" / "moto_server"
        if not exe.exists():
            pytest.fail(f"{exe} is missing: run `make s3-server` (make sdk-test does)")
        self.proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", "0"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        found: List[str] = []
        ready = threading.Event()

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                if not found and "http://127.0.0.1:" in line:
                    found.append(line[line.index("http://127.0.0.1:"):].split()[0])
                    ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(30):
            self.close()
            raise RuntimeError("moto_server did not say where it listens")
        self.endpoint = found[0]
        deadline = time.monotonic() + 30
        while True:
            try:
                # moto takes an unsigned request.
                urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{S3_BUCKET}", method="PUT"), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise
                time.sleep(0.1)

    def store_config(self) -> dict:
        return {
            "endpoint": self.endpoint, "bucket": S3_BUCKET, "region": "us-east-1", "access_key_id": "test",
            "secret_access_key": "test", "allow_http": True, "prefix": "sdk/",
        }

    def keys(self) -> List[str]:
        body = urllib.request.urlopen(f"{self.endpoint}/{S3_BUCKET}?list-type=2", timeout=5).read().decode()
        return [part.split("</Key>")[0] for part in body.split("<Key>")[1:]]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@dataclass
class Cluster:
    local: LocalCluster
    s3: Optional[S3Server] = None
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


def vm_kernel() -> Path:
    """The VM backends' guest kernel, where ``scripts/vm-kernel.sh`` builds it (``make
    vm-kernel``, which ``make sdk-test`` runs first)."""
    out = subprocess.run([str(REPO / "scripts" / "vm-kernel.sh"), "--path"], capture_output=True, text=True)
    return Path(out.stdout.strip())


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
    s3 = S3Server()
    try:
        local = LocalCluster(
            CTL, ("sim", "container", "fncall", "microvm"), prefix="opendsec-sdk-test.",
            edge={"session_store": s3.store_config(), "vm": {"kernel_dir": str(vm_kernel()), "accel": "tcg"}},
        )
    except BaseException:
        s3.close()
        raise
    try:
        c = Cluster(local, s3)
        # The image is needed by every backend (sim too); running containers needs root.
        c.has_image = local.import_busybox(IMAGE)
        c.has_container = c.has_image and os.geteuid() == 0
        c.debian_missing = _import_debian(local)
        yield c
    finally:
        local.close()
        s3.close()


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
