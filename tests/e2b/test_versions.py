"""The version matrix: the oldest and the newest release of each of E2B's four SDKs we support
(Python `e2b` and `e2b-code-interpreter`, JavaScript `e2b` and `@e2b/code-interpreter`), each
running the core calls against the gateway with an `e2b_` key and the SDK's own key check on.
`make e2b-test` installs them (E2B_PY_OLD, E2B_PY_NEW, E2B_JS_OLD; the newest JavaScript
release is the pinned one) into venvs and module directories of their own."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TARGET = HERE.parents[1] / "target"

PYTHON = {"oldest": TARGET / "e2b-venv-old", "newest": TARGET / "e2b-venv-new"}
JAVASCRIPT = {"oldest": TARGET / "e2b-js-old", "newest": TARGET / "e2b-js"}


def run(cmd: list[str], label: str) -> None:
    # As a user of E2B's cloud: no E2B_SANDBOX_URL, so in-sandbox calls go to the sandbox's
    # hosts (<port>-<id>.<domain>, the domain the gateway answers); older SDKs send some of
    # them with no E2b-Sandbox-Id header at all.
    env = {k: v for k, v in os.environ.items() if k != "E2B_SANDBOX_URL"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{label}:\n{r.stdout}\n{r.stderr}"
    assert "core calls ok" in r.stdout, r.stdout


@pytest.mark.parametrize("point", list(PYTHON))
def test_python_sdks(gateway, point):
    venv = PYTHON[point]
    py = venv / "bin" / "python"
    if not py.exists():
        pytest.fail(f"{venv} is missing: run `make e2b-test`")
    versions = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('e2b'), m.version('e2b-code-interpreter'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    run([str(py), str(HERE / "versions" / "core.py"), point, versions], f"python {point} ({versions})")


@pytest.mark.parametrize("point", list(JAVASCRIPT))
def test_javascript_sdks(gateway, point):
    root = JAVASCRIPT[point]
    if not (root / "node_modules" / "e2b").is_dir():
        pytest.fail(f"{root}/node_modules is missing: run `make e2b-test`")
    # An ES module resolves packages from the node_modules beside it.
    script = root / "versions-core.mjs"
    shutil.copyfile(HERE / "versions" / "core.mjs", script)
    version = (root / "node_modules" / "e2b" / "package.json").read_text().split('"version": "')[1].split('"')[0]
    run(["node", str(script), point, version], f"javascript {point} ({version})")
