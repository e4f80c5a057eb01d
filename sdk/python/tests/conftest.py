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
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[3]
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
    addr: str
    token: str
    state: Path
    has_container: bool
    has_image: bool = False
    # Why the Debian image is not there (None: imported as DEBIAN_IMAGE).
    debian_missing: Optional[str] = "not imported yet"

    def env(self) -> dict:
        e = dict(os.environ)
        e.update(OPENDSEC_ADDR=self.addr, OPENDSEC_TOKEN=self.token, OPENDSEC_IMAGE_STORE=str(self.state / "images"))
        return e


def _import_busybox(state: Path, cluster_env: dict) -> bool:
    busybox = shutil.which("busybox") or "/bin/busybox"
    if not Path(busybox).exists():
        return False
    root = state / "busybox"
    for d in ("bin", "etc", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy(busybox, root / "bin" / "busybox")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for a in applets:
        if a != "busybox" and not (root / "bin" / a).exists():
            os.symlink("busybox", root / "bin" / a)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n")
    subprocess.run(
        [str(CTL), "image", "import", "--rootfs", str(root), "--name", IMAGE, "--store", str(state / "images")],
        env=cluster_env, check=True, capture_output=True, timeout=120,
    )
    return True


def debian_rootfs() -> Path:
    """The Debian test image's root file system, where ``scripts/debian-image.sh`` builds it
    (``$OPENDSEC_DEBIAN_ROOTFS`` overrides), as the Rust tests find it."""
    env = os.environ.get("OPENDSEC_DEBIAN_ROOTFS")
    if env:
        return Path(env)
    out = subprocess.run([str(DEBIAN_SCRIPT), "--path"], capture_output=True, text=True, check=True).stdout
    return Path(out.strip())


def _import_debian(state: Path, cluster_env: dict) -> Optional[str]:
    """Imports the Debian test image as DEBIAN_IMAGE; returns why not, or None when imported."""
    rootfs = debian_rootfs()
    if not (rootfs / "usr" / "bin" / "python3").exists():
        return f"the Debian test image is missing ({rootfs}): run `make images` (scripts/debian-image.sh) first"
    subprocess.run(
        [str(CTL), "image", "import", "--rootfs", str(rootfs), "--name", DEBIAN_IMAGE, "--store", str(state / "images")],
        env=cluster_env, check=True, capture_output=True, timeout=300,
    )
    return None


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if not CTL.exists():
        pytest.fail(f"{CTL} is not built: run `cargo build -p opendsec-cli` (make sdk-test does)")
    state = Path(tempfile.mkdtemp(prefix="opendsec-sdk-test."))
    cfg = state / "config.json"
    # Sandboxes end with the cluster: the state directory (and so any later adoption) goes.
    edge = {"backends": ["sim", "container"], "keep_sandboxes_on_exit": False}
    cfg.write_text(json.dumps({"sim_edges": 1, "apiserver": {"listen": "127.0.0.1:0"}, "edge": edge}))
    log = open(state / "cluster.log", "w+")
    proc = subprocess.Popen(
        [str(CTL), "cluster", "up", "--state-dir", str(state), "--config", str(cfg)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        addr: Optional[str] = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and addr is None:
            if proc.poll() is not None:
                raise RuntimeError("cluster up exited early:\n" + (state / "cluster.log").read_text())
            for line in (state / "cluster.log").read_text().splitlines():
                if line.startswith("  apiserver:"):
                    addr = line.split(":", 1)[1].strip()
            time.sleep(0.1)
        if addr is None:
            raise RuntimeError("cluster up printed no address:\n" + (state / "cluster.log").read_text())
        token = (state / "admin.token").read_text().strip()
        c = Cluster(addr, token, state, False)
        # The image is needed by every backend (sim too); running containers needs root.
        c.has_image = _import_busybox(state, c.env())
        c.has_container = c.has_image and os.geteuid() == 0
        c.debian_missing = _import_debian(state, c.env())
        yield c
    finally:
        with_pg = True
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            with_pg = False
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            if with_pg:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        if not os.environ.get("OPENDSEC_KEEP_STATE"):
            shutil.rmtree(state, ignore_errors=True)


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
