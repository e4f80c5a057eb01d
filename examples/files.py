#!/usr/bin/env python3
"""Files in and out of a sandbox: upload a local file, transform it inside, download the result.

The input is a small CSV of (episode, reward) rows, written locally (or given with
``--input``). It is uploaded, a Python program written into the sandbox computes per-row
statistics and sorts the rows, ``sort``/``wc`` summarize it with shell tools, and the result is
downloaded back and printed. Nothing of the transformation runs on the local machine.

    export OPENDSEC_ADDR=127.0.0.1:7000 OPENDSEC_TOKEN=...
    python examples/files.py [--input rewards.csv] [--output result.csv]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import opendsec

# Runs inside the sandbox (python3 of the image): reads the CSV, sorts by reward, adds a rank
# column and a z-score, and writes a new CSV.
TRANSFORM = r'''
import csv, statistics, sys
src, dst = sys.argv[1], sys.argv[2]
with open(src, newline="") as f:
    rows = [(r["episode"], float(r["reward"])) for r in csv.DictReader(f)]
mean = statistics.mean(r for _, r in rows)
sd = statistics.pstdev(r for _, r in rows) or 1.0
rows.sort(key=lambda r: -r[1])
with open(dst, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["rank", "episode", "reward", "zscore"])
    for i, (ep, r) in enumerate(rows, 1):
        w.writerow([i, ep, f"{r:.2f}", f"{(r - mean) / sd:+.2f}"])
print(f"{len(rows)} rows, mean reward {mean:.2f}")
'''


def sample_input(path: Path) -> None:
    """A deterministic stand-in for real data: 12 episodes with made-up rewards."""
    lines = ["episode,reward"] + [f"ep-{i:02d},{(i * 37) % 11 + 0.5 * i:.1f}" for i in range(12)]
    path.write_text("\n".join(lines) + "\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", type=Path, help="CSV with episode,reward columns (default: a generated sample)")
    p.add_argument("--output", type=Path, help="where to save the result (default: a temporary file)")
    p.add_argument("--image", default=os.environ.get("OPENDSEC_IMAGE", "debian:bookworm"),
                   help="image with python3 (default: $OPENDSEC_IMAGE or debian:bookworm)")
    p.add_argument("--backend", default="container", help="sandbox backend (default: container)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="opendsec-files.") as tmp:
        src = args.input or Path(tmp) / "rewards.csv"
        if args.input is None:
            sample_input(src)
        out = args.output or Path(tmp) / "ranked.csv"

        with opendsec.Client() as client, client.run_sandbox(
            args.backend, args.image, cpu=250, memory_mb=128, disk_mb=64
        ) as sb:
            # In: upload copies a local file (in 1 MiB chunks; parent directories are made).
            n = sb.upload(src, "/data/in/rewards.csv")
            print(f"uploaded {src.name}: {n} bytes")
            # write_file puts bytes or text straight into a file: here, the program to run.
            sb.write_file("/data/transform.py", TRANSFORM)

            # Transform: python3 inside the sandbox, then plain shell tools on the result.
            sb.make_dir("/data/out")
            r = sb.run_shell("python3 transform.py in/rewards.csv out/ranked.csv", cwd="/data")
            if not r.ok:
                sys.exit(f"FAILED: transform exited {r.exit_code}: {r.stderr}")
            print(f"transform: {r.stdout.strip()}")
            r = sb.run_shell("wc -l < out/ranked.csv; cut -d, -f4 out/ranked.csv | tail -n +2 | sort -n | head -1",
                             cwd="/data")
            lines, lowest_z = r.stdout.split()
            print(f"shell tools: {lines} lines, lowest z-score {lowest_z}")

            # What is there now (list_dir returns names, types, sizes and modes).
            for e in sb.list_dir("/data/out"):
                print(f"  /data/out/{e.name}  {e.type}  {e.size} bytes")

            # Out: download streams the file to a local path (a temporary name, then renamed,
            # so a half-downloaded file never appears under the final name).
            n = sb.download("/data/out/ranked.csv", out)
            print(f"downloaded {n} bytes to {out}")

        # The sandbox is stopped here; the result is local.
        result = out.read_text()
        print(result, end="")
        rows = result.splitlines()
        if len(rows) != sum(1 for _ in src.open()) or not rows[0].startswith("rank,"):
            sys.exit("FAILED: the result does not have one row per input row")
    print("OK: file uploaded, transformed and downloaded")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (opendsec.OpendsecError, ValueError) as e:
        # OpendsecError: a failed call (e.reason says which kind); ValueError: no OPENDSEC_ADDR.
        sys.exit(f"error: {e}")
