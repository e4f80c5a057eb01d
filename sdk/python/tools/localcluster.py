"""A local opendsec cluster for tests and benchmarks: ``opendsecctl cluster up`` in its own
process group with a temporary state directory, and what both need around it (a busybox image
from the host's /bin/busybox, importing a root file system).

The edge runs with ``keep_sandboxes_on_exit`` false: the state directory (and with it any
later adoption) goes with the cluster, so its sandboxes must go too. ``close`` stops it and
removes the state (kept with ``OPENDSEC_KEEP_STATE=1``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence


class LocalCluster:
    def __init__(
        self,
        ctl: Path,
        backends: Sequence[str] = ("sim", "container"),
        prefix: str = "opendsec-local.",
        edge: Optional[Dict[str, Any]] = None,
    ) -> None:
        """``edge``: more of the edge's configuration (e.g. ``session_store``)."""
        self.ctl = Path(ctl)
        self.state = Path(tempfile.mkdtemp(prefix=prefix))
        cfg = self.state / "config.json"
        edge = {"backends": list(backends), "keep_sandboxes_on_exit": False, **(edge or {})}
        # Sandbox networking changes the host's network (a table, forwarding): off here; the
        # Rust network tests run it inside namespaces of their own.
        cfg.write_text(json.dumps({
            "sim_edges": 1, "apiserver": {"listen": "127.0.0.1:0"}, "edge": edge, "network": {"enabled": False},
        }))
        self._log = open(self.state / "cluster.log", "w+")
        self.proc = subprocess.Popen(
            [str(self.ctl), "cluster", "up", "--state-dir", str(self.state), "--config", str(cfg)],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            self.addr = self._wait_for_address()
            self.token = (self.state / "admin.token").read_text().strip()
        except BaseException:
            self.close()
            raise

    def _wait_for_address(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("cluster up exited early:\n" + self.log())
            for line in self.log().splitlines():
                if line.startswith("  apiserver:"):
                    return line.split(":", 1)[1].strip()
            time.sleep(0.1)
        raise RuntimeError("cluster up printed no address:\n" + self.log())

    @property
    def ca(self) -> Path:
        """The cluster's CA certificate (its public port speaks TLS)."""
        return self.state / "pki" / "ca.pem"

    def e2b_env(self, timeout: float = 30) -> Dict[str, str]:
        """What E2B's SDKs need to reach this cluster's E2B gateway, from the export line
        ``cluster up`` prints: ``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_API_KEY`` and, when
        the gateway speaks HTTPS, ``SSL_CERT_FILE`` and ``NODE_EXTRA_CA_CERTS``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                if line.startswith("  export E2B_API_URL="):
                    pairs = (w.split("=", 1) for w in line.split()[1:] if "=" in w)
                    env = {k: v for k, v in pairs if k != "E2B_API_KEY"}
                    # The admin token as an E2B key (e2b_ + hex): the shape every E2B SDK
                    # release accepts, with its key check on.
                    env["E2B_API_KEY"] = (self.state / "admin.e2b-key").read_text().strip()
                    return env
            time.sleep(0.1)
        raise RuntimeError("cluster up printed no E2B gateway:\n" + self.log())

    def log(self) -> str:
        return (self.state / "cluster.log").read_text()

    def env(self) -> Dict[str, str]:
        """The environment of a client of this cluster (address, token, image store)."""
        e = dict(os.environ)
        e.pop("OPENDSEC_INSECURE_PLAINTEXT", None)
        e.update(
            OPENDSEC_ADDR=self.addr,
            OPENDSEC_TOKEN=self.token,
            OPENDSEC_CA=str(self.ca),
            OPENDSEC_IMAGE_STORE=str(self.state / "images"),
        )
        return e

    def ctl_json(self, *args: str, timeout: float = 600) -> Dict:
        """``opendsecctl --json ARGS`` against this cluster; its JSON answer."""
        out = subprocess.run(
            [str(self.ctl), "--json", *args], env=self.env(), capture_output=True, text=True, timeout=timeout
        )
        if out.returncode != 0:
            raise RuntimeError(f"opendsecctl {' '.join(args)}: {out.stderr}")
        return json.loads(out.stdout)

    def import_rootfs(self, root: Path, name: str, timeout: float = 300) -> Dict:
        """``opendsecctl image import --rootfs`` into this cluster's store."""
        return self.ctl_json(
            "image", "import", "--rootfs", str(root), "--name", name, "--store", str(self.state / "images"),
            timeout=timeout,
        )

    def import_busybox(self, name: str) -> bool:
        """A busybox root file system (the host's /bin/busybox, its applets, root and nobody
        in /etc/passwd) imported as ``name``; False when the host has no busybox."""
        busybox = shutil.which("busybox") or "/bin/busybox"
        if not Path(busybox).exists():
            return False
        root = self.state / "busybox"
        for d in ("bin", "etc", "tmp"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy(busybox, root / "bin" / "busybox")
        applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
        for a in applets:
            if a != "busybox" and not (root / "bin" / a).exists():
                os.symlink("busybox", root / "bin" / a)
        (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n")
        self.import_rootfs(root, name, timeout=120)
        return True

    def close(self) -> None:
        """Stops the cluster (its sandboxes with it) and removes its state."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()
        if not os.environ.get("OPENDSEC_KEEP_STATE"):
            shutil.rmtree(self.state, ignore_errors=True)
