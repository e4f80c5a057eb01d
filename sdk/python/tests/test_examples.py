"""The examples of ``examples/`` (repository root), each run as a script against the test cluster.

Each example runs as ``python examples/NAME.py`` would for a user: a subprocess of this
interpreter (which has the SDK installed), configured only through ``OPENDSEC_ADDR``,
``OPENDSEC_TOKEN`` and ``OPENDSEC_IMAGE`` (the Debian test image: bash and python3). The
assertions check the exit code and the lines each example prints about what it showed.

``rl_batch.py`` runs at its full size, 200 sandboxes (``OPENDSEC_EXAMPLES_RL_COUNT``
overrides). On a small machine the edge's CPU-pressure check may refuse some creations
(``no_capacity``); the SDK asks again for those, so the run still gets all 200.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, List

import pytest

import opendsec

pytestmark = pytest.mark.integration

# conftest.py is not importable under --import-mode=importlib: the two facts it shares.
REPO = Path(__file__).resolve().parents[3]
DEBIAN_IMAGE = "debian:bookworm"  # imported by the cluster fixture
EXAMPLES = REPO / "examples"
Cluster = Any  # conftest.Cluster
RL_COUNT = int(os.environ.get("OPENDSEC_EXAMPLES_RL_COUNT", "200"))


def run_example(cluster: Cluster, name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = cluster.env()
    env["OPENDSEC_IMAGE"] = DEBIAN_IMAGE
    env.pop("OPENDSEC_PROJECT", None)
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )
    assert p.returncode == 0, f"{name} exited {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    return p


def lines(p: subprocess.CompletedProcess) -> List[str]:
    return p.stdout.splitlines()


def test_every_example_is_tested() -> None:
    names = {p.name for p in EXAMPLES.glob("*.py")}
    assert names == {"quickstart.py", "stateful_session.py", "files.py", "rl_batch.py", "retry_safe.py"}


def test_quickstart(debian: Cluster) -> None:
    """The README's Python example, as it stands there."""
    readme = (REPO / "README.md").read_text()
    code = (EXAMPLES / "quickstart.py").read_text()
    body = code[code.index("import opendsec"):].strip()
    assert body in readme, "README.md must show examples/quickstart.py's code as it is"
    out = lines(run_example(debian, "quickstart.py"))
    assert re.fullmatch(r"\S+\.\S+ exit 0 -> 45 3\.\d+\.\d+", out[-1]), out


def test_stateful_session(debian: Cluster) -> None:
    out = lines(run_example(debian, "stateful_session.py"))
    assert "cd:       exit=0 cwd=/tmp/project" in out
    assert "greet:    hello, sandbox, from /tmp/project in run demo-42" in out
    assert "failing:  exit=1 stderr='to-stderr'" in out
    assert "after:    still demo-42 in /tmp/project" in out
    assert "other:    unset no-greet /root" in out
    assert "reopened: unset" in out
    assert out[-1] == "OK: session state persisted across calls"


def test_files(debian: Cluster, tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    src.write_text("episode,reward\na,1\nb,3\nc,2\n")
    dst = tmp_path / "out.csv"
    out = lines(run_example(debian, "files.py", "--input", str(src), "--output", str(dst)))
    assert f"uploaded in.csv: {src.stat().st_size} bytes" in out
    assert "transform: 3 rows, mean reward 2.00" in out
    assert "shell tools: 4 lines, lowest z-score -1.22" in out
    # Ranked by reward, best first, with z-scores computed in the sandbox.
    assert dst.read_text().splitlines() == [
        "rank,episode,reward,zscore", "1,b,3.00,+1.22", "2,c,2.00,+0.00", "3,a,1.00,-1.22",
    ]
    assert out[-1] == "OK: file uploaded, transformed and downloaded"
    # The default input (generated) works too.
    assert lines(run_example(debian, "files.py"))[-1] == "OK: file uploaded, transformed and downloaded"


def test_retry_safe(debian: Cluster) -> None:
    out = lines(run_example(debian, "retry_safe.py"))
    assert "  first call:  'run number 1' (exit 0)" in out
    assert "  second call: 'run number 1' (exit 0)" in out
    assert "  the command ran 1 time(s)" in out
    assert "new request id: 'run number 2'; the command ran 2 time(s)" in out
    assert [l for l in out if l.startswith("  (second reader)")] == [
        f"  (second reader) stdout@{7 * (i - 1)}: 'step {i}\\n'" for i in range(1, 6)
    ]
    assert "  exit 0; the command ran 1 time(s) for this request id" in out
    assert out[-1] == "OK: every request id ran its command exactly once"


def test_rl_batch(debian: Cluster) -> None:
    p = run_example(debian, "rl_batch.py", "--count", str(RL_COUNT), timeout=300)
    out = lines(p)
    assert re.fullmatch(rf"created {RL_COUNT}/{RL_COUNT} sandboxes in [\d.]+s", out[0]), out
    assert re.fullmatch(rf"scored {RL_COUNT}/{RL_COUNT} in [\d.]+s", out[1]), out
    mean = float(next(l for l in out if l.startswith("mean score: ")).split(": ")[1])
    # Scores differ per sandbox (the parameter is index/(n-1)): the mean is the objective's
    # average over [0, 1], about 0.87, for any count of a few or more.
    assert 0.8 < mean < 0.95, out
    assert "failures: 0" in out and out[-1] == f"stopped {RL_COUNT} sandboxes"
    # The progress bars went to stderr, ending at n/n.
    assert f"created   [{'#' * 30}] {RL_COUNT}/{RL_COUNT}" in p.stderr
    assert f"scored    [{'#' * 30}] {RL_COUNT}/{RL_COUNT}" in p.stderr
    # Clean-up: nothing of the run is left running.
    with opendsec.Client(debian.addr, token=debian.token, ca=debian.local.ca) as c:
        assert c.list_sandboxes(labels={"example": "rl-batch"}) == []
