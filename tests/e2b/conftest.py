"""A real local cluster (``opendsecctl cluster up``, container sandboxes) with its E2B gateway,
for E2B's own SDKs installed unmodified from PyPI (``make e2b-test``).

The E2B templates' images are built by ``scripts/e2b-images.sh`` (``make e2b-images``) and
imported into the cluster's root project, the admin token's: ``e2b-base:latest`` (template
``base``) and ``code-interpreter-v1:latest`` (the code interpreter's). The SDK finds the
gateway through ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` (both the gateway, HTTPS with the
cluster's certificate, trusted through ``SSL_CERT_FILE`` and ``NODE_EXTRA_CA_CERTS``) and
authenticates with ``E2B_API_KEY`` (the admin token), set here for every test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sdk" / "python" / "tools"))
from localcluster import LocalCluster  # noqa: E402

SCRIPT = REPO / "scripts" / "e2b-images.sh"


def _ctl() -> Path:
    env = os.environ.get("OPENDSECCTL")
    if env:
        return Path(env)
    for profile in ("debug", "release"):
        p = REPO / "target" / profile / "opendsecctl"
        if p.exists():
            return p
    return REPO / "target" / "debug" / "opendsecctl"


def rootfs(which: str) -> Path:
    out = subprocess.run([str(SCRIPT), which, "--path"], capture_output=True, text=True, check=True).stdout
    return Path(out.strip())


@dataclass
class Gateway:
    local: LocalCluster
    url: str

    @property
    def key(self) -> str:
        return self.local.token

    def ctl(self, *args: str) -> dict:
        return self.local.ctl_json(*args)


@pytest.fixture(scope="session")
def gateway() -> Iterator[Gateway]:
    ctl = _ctl()
    if not ctl.exists():
        pytest.fail(f"{ctl} is not built: run `cargo build -p opendsec-cli` (make e2b-test does)")
    if os.geteuid() != 0:
        pytest.fail("container sandboxes need root (CI runs as root)")
    base, interp = rootfs("base"), rootfs("code-interpreter")
    for r in (base, interp):
        if not (r / "home" / "user").is_dir():
            pytest.fail(f"an E2B template image is missing ({r}): run `make e2b-images` first")
    local = LocalCluster(ctl, ("container",), prefix="opendsec-e2b-test.")
    try:
        env = local.e2b_env()
        url = env["E2B_API_URL"]
        # The test cluster has TLS: so does its gateway, with the cluster's certificate, which
        # the SDKs trust through SSL_CERT_FILE (Python) and NODE_EXTRA_CA_CERTS (Node).
        assert url.startswith("https://") and env["SSL_CERT_FILE"] and env["NODE_EXTRA_CA_CERTS"], env
        local.import_rootfs(base, "e2b-base:latest")
        local.import_rootfs(interp, "code-interpreter-v1:latest", timeout=600)
        os.environ.update(env)
        os.environ.pop("E2B_DEBUG", None)
        os.environ.pop("E2B_DOMAIN", None)
        yield Gateway(local, url)
    finally:
        local.close()
