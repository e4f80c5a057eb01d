"""The gateway as a daemon of its own (`opendsec e2b --config F`), as a deployment without
`cluster up` runs it: calling the cluster's apiserver over TLS with the cluster's CA, and
serving HTTPS with a certificate the operator issued for it (`opendsecctl pki issue`)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

from e2b import Sandbox


def test_opendsec_e2b_runs_alone_from_its_config(gateway, tmp_path):
    opendsec = Path(str(gateway.local.ctl).replace("opendsecctl", "opendsec"))
    bundle = tmp_path / "gateway.pem"
    subprocess.run([str(gateway.local.ctl), "pki", "issue", "--ca-dir", str(gateway.local.ca.parent),
                    "--id", "gateway/e2b-1", "--out", str(bundle)], check=True, capture_output=True, timeout=60)
    cfg = tmp_path / "e2b.json"
    cfg.write_text(json.dumps({
        "state_dir": str(tmp_path / "state"),
        "tls": {"ca": str(gateway.local.ca)},
        "e2b": {"listen": "127.0.0.1:0", "apiserver_addrs": [gateway.local.addr], "tls_bundle": str(bundle)},
    }))
    log = tmp_path / "e2b.log"
    with open(log, "w") as out:
        p = subprocess.Popen([str(opendsec), "e2b", "--config", str(cfg)], stdout=out, stderr=subprocess.STDOUT)
    try:
        url = None
        deadline = time.monotonic() + 30
        while url is None and time.monotonic() < deadline:
            m = re.search(r"https://127\.0\.0\.1:\d+", "".join(line for line in log.read_text().splitlines() if "listens" in line))
            url = m.group(0) if m else None
            time.sleep(0.1)
        assert url, log.read_text()
        sbx = Sandbox.create(api_url=url, sandbox_url=url)
        try:
            assert sbx.commands.run("echo via the daemon").stdout == "via the daemon\n"
        finally:
            assert Sandbox.kill(sbx.sandbox_id, api_url=url) is True
    finally:
        p.terminate()
        p.wait(timeout=30)
    # Without TLS a non-loopback address is refused: API keys would cross the network in the
    # clear.
    cfg.write_text(json.dumps({"apiserver": {"insecure_plaintext": True},
                               "e2b": {"listen": "0.0.0.0:0", "apiserver_addrs": [gateway.local.addr]}}))
    r = subprocess.run([str(opendsec), "e2b", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "e2b.listen" in r.stderr and "loopback" in r.stderr
