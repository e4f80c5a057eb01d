#!/usr/bin/env python3
"""E2B's own Python test suites, unmodified, against a local cluster's gateway (issue 40).

    tests/e2b/upstream/run.py --e2b-src DIR --ci-src DIR [--point pinned|newest] [--suite NAME]...

``--e2b-src`` is a checkout of github.com/e2b-dev/E2B, ``--ci-src`` one of
github.com/e2b-dev/code-interpreter (CI cannot reach GitHub: this is a developer's tool; `make
e2b-test` is what CI runs). Each suite runs from its checkout's ``tests`` directory with the
SDK installed from PyPI into a venv of its own: at ``pinned``, the releases the checkouts are
(their ``pyproject.toml``); at ``newest``, the newest on PyPI.

The cluster is ``cluster up`` with container sandboxes and the E2B templates imported (as
``make e2b-test`` makes it). The SDK is given what a user of E2B's cloud is: the API URL and
an ``e2b_`` key, no ``E2B_SANDBOX_URL`` (envd is reached at ``49983-<id>.<domain>``, the
domain the gateway answers), the key check on.

Tests that need the public internet, or a template that only E2B's cloud has, are
deselected by ``deselect.txt`` (one node id prefix and its reason per line); nothing else is.
A summary table is printed, and every failure with its first error line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "sdk" / "python" / "tools"))
from localcluster import LocalCluster  # noqa: E402

TEST_DEPS = [
    "pytest>=8,<10", "pytest-asyncio>=1.0,<2", "pytest-timeout", "pytest-xdist", "python-dotenv",
    "pytest-dotenv", "attrs", "httpx",
]
# The suites: name -> (which checkout, directory in it, test paths, SDK packages). `e2b` is
# the sandbox and API tests, sync and async (the SDK's own unit tests need no server; its
# template, volume and secret tests are of E2B services opendsec does not have).
SUITES = {
    "e2b": ("e2b", "packages/python-sdk",
            ["tests/sync/sandbox_sync", "tests/sync/api_sync", "tests/async/sandbox_async", "tests/async/api_async"],
            ["e2b"]),
    "git": ("e2b", "packages/python-sdk", ["tests/shared/git"], ["e2b"]),
    "code-interpreter": ("ci", "python", ["tests"], ["e2b-code-interpreter"]),
}


def version_of(pyproject: Path) -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
    if not m:
        raise SystemExit(f"no version in {pyproject}")
    return m.group(1)


def venv(path: Path, packages: list[str]) -> Path:
    py = path / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *packages, *TEST_DEPS], check=True)
    return py


def deselected() -> list[tuple[str, str]]:
    out = []
    for line in (HERE / "deselect.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        node, _, why = line.partition("#")
        out.append((node.strip(), why.strip()))
    return out


def run_suite(name: str, root: Path, paths: list[str], py: Path, env: dict, out: Path, workers: int) -> dict:
    junit = out / f"{name}.xml"
    args = [str(py), "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "--timeout", "180",
            "-o", "addopts=--import-mode=importlib", f"--junitxml={junit}", "-n", str(workers)]
    skipped = [(n, w) for n, w in deselected() if n.startswith(f"{name}:")]
    for node, _ in skipped:
        args += ["--deselect", node.split(":", 1)[1]]
    log = out / f"{name}.log"
    with open(log, "w") as f:
        subprocess.run(args, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT)
    tree = ET.parse(junit)
    res = {"passed": 0, "failed": [], "skipped": 0, "deselected": len(skipped)}
    for case in tree.iter("testcase"):
        node = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            first = (bad.get("message") or "").splitlines()[0:1]
            res["failed"].append((node, first[0][:200] if first else ""))
        elif case.find("skipped") is not None:
            res["skipped"] += 1
        else:
            res["passed"] += 1
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--e2b-src", type=Path, required=True)
    ap.add_argument("--ci-src", type=Path, required=True)
    ap.add_argument("--point", choices=["pinned", "newest"], default="pinned")
    ap.add_argument("--suite", action="append", choices=list(SUITES))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", type=Path, default=REPO / "target" / "e2b-upstream")
    a = ap.parse_args()
    ctl = Path(os.environ.get("OPENDSECCTL", REPO / "target" / "debug" / "opendsecctl"))
    srcs = {"e2b": a.e2b_src, "ci": a.ci_src}
    a.out.mkdir(parents=True, exist_ok=True)
    images = {w: Path(subprocess.run([str(REPO / "scripts" / "e2b-images.sh"), w, "--path"], capture_output=True,
                                     text=True, check=True).stdout.strip()) for w in ("base", "code-interpreter")}
    cluster = LocalCluster(ctl, ("container",), prefix="opendsec-e2b-upstream.")
    results = {}
    try:
        # Hermetic: the sandboxes have loopback only, whatever a test asks of their network.
        assert json.loads((cluster.state / "config.json").read_text())["network"]["enabled"] is False
        env0 = cluster.e2b_env()
        cluster.import_rootfs(images["base"], "e2b-base:latest")
        cluster.import_rootfs(images["code-interpreter"], "code-interpreter-v1:latest", timeout=600)
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        env.update(env0)
        env.pop("E2B_SANDBOX_URL", None)  # envd at <port>-<id>.<domain>, as in E2B's cloud
        for name in a.suite or list(SUITES):
            which, sub, paths, pkgs = SUITES[name]
            root = srcs[which] / sub
            if a.point == "pinned":
                version = version_of(root / "pyproject.toml")
                pins = [f"{pkgs[0]}=={version}"]
                if pkgs[0] != "e2b":
                    # The e2b release of the same time (the newest one breaks older wrappers).
                    pins.append(f"e2b=={version_of(srcs['e2b'] / 'packages/python-sdk/pyproject.toml')}")
            else:
                pins = [f"{p}" for p in pkgs]
            py = venv(a.out / f"venv-{name}-{a.point}", ["--upgrade", *pins] if a.point == "newest" else pins)
            got = subprocess.run([str(py), "-m", "pip", "show", pkgs[0]], capture_output=True, text=True).stdout
            ver = re.search(r"^Version: (.+)$", got, re.M)
            t0 = time.monotonic()
            res = run_suite(name, root, paths, py, env, a.out, a.workers)
            res["version"] = ver.group(1) if ver else "?"
            res["seconds"] = round(time.monotonic() - t0)
            results[name] = res
    finally:
        cluster.close()
    print(f"\n| suite ({a.point}) | SDK | passed | failed | skipped | deselected |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['version']} | {r['passed']} | {len(r['failed'])} | {r['skipped']} | {r['deselected']} |")
    for name, r in results.items():
        for node, why in r["failed"]:
            print(f"FAIL {name} {node}: {why}")
    (a.out / f"results-{a.point}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
