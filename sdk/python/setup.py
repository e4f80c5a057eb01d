"""Build step for the opendsec SDK: generates the gRPC code from the repository's protos.

The protos (``proto/opendsec/v1/{opendsec,runtime}.proto``) are the contract; nothing generated
is checked in. ``build_py`` runs ``grpc_tools.protoc`` (from the grpcio-tools build requirement,
so no system protoc is needed) into ``opendsec/_pb`` of the build directory and rewrites the
generated absolute imports (``from opendsec.v1 import ...``) to package-relative ones, so the
generated modules never collide with another top-level ``opendsec`` package layout.

Where the protos are looked for, first found wins: ``$OPENDSEC_PROTO_DIR``, ``./proto`` (an sdist
carries a copy), ``../../proto`` (a checkout of the repository).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
# The public API only: cluster.proto and iam.proto are between components.
PROTOS = ["opendsec/v1/opendsec.proto", "opendsec/v1/runtime.proto"]


def proto_root() -> Path:
    candidates = []
    if os.environ.get("OPENDSEC_PROTO_DIR"):
        candidates.append(Path(os.environ["OPENDSEC_PROTO_DIR"]))
    candidates += [HERE / "proto", HERE.parent.parent / "proto"]
    for c in candidates:
        if all((c / p).is_file() for p in PROTOS):
            return c
    raise SystemExit(
        "opendsec: cannot find the protos (looked in %s); install from a checkout of the "
        "repository or set OPENDSEC_PROTO_DIR" % ", ".join(str(c) for c in candidates)
    )


_ABS_IMPORT = re.compile(r"^from opendsec\.v1 import (\w+)", re.MULTILINE)


def generate(out_pkg: Path) -> None:
    """Runs protoc over the protos and writes the modules, imports fixed, into ``out_pkg``."""
    from grpc_tools import protoc  # the build requirement
    import grpc_tools

    root = proto_root()
    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(root / p) for p in PROTOS],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("opendsec: grpc_tools.protoc failed on " + ", ".join(PROTOS))
        out_pkg.mkdir(parents=True, exist_ok=True)
        gen = Path(tmp) / "opendsec" / "v1"
        for f in sorted(gen.iterdir()):
            if f.suffix not in (".py", ".pyi"):
                continue
            text = _ABS_IMPORT.sub(r"from . import \1", f.read_text())
            (out_pkg / f.name).write_text(text)
        (out_pkg / "__init__.py").write_text(
            '"""Code generated from proto/opendsec/v1 at build time; do not edit."""\n'
        )


def runtime_requirements() -> list[str]:
    """The grpcio/protobuf the generated code needs: at least what generated it."""
    try:
        from google import protobuf
        from importlib.metadata import version

        tools = version("grpcio-tools")
        pb = protobuf.__version__
        pb_major_minor = ".".join(pb.split(".")[:2])
        tools_major_minor = ".".join(tools.split(".")[:2])
        return [
            f"grpcio>={tools_major_minor}",
            f"protobuf>={pb_major_minor}",
            "googleapis-common-protos>=1.56",
        ]
    except Exception:  # metadata unavailable (egg_info before build deps): loose bounds
        return ["grpcio>=1.62", "protobuf>=4.25", "googleapis-common-protos>=1.56"]


class BuildPyWithProtos(build_py):
    """``build_py`` that also generates ``opendsec/_pb`` from the protos."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "opendsec" / "_pb"
        generate(target)
        if getattr(self, "editable_mode", False):
            generate(HERE / "src" / "opendsec" / "_pb")

    def get_outputs(self, include_bytecode: bool = True):  # type: ignore[override]
        outs = list(super().get_outputs(include_bytecode))
        pb = Path(self.build_lib) / "opendsec" / "_pb"
        if pb.is_dir():
            outs += [str(p) for p in pb.iterdir() if p.is_file()]
        return outs


class SdistWithProtos(sdist):
    """``sdist`` that carries a copy of the protos, so the sdist builds outside the repo."""

    def make_release_tree(self, base_dir: str, files) -> None:  # type: ignore[override]
        super().make_release_tree(base_dir, files)
        root = proto_root()
        for p in PROTOS:
            dst = Path(base_dir) / "proto" / p
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / p, dst)


setup(
    install_requires=runtime_requirements(),
    cmdclass={"build_py": BuildPyWithProtos, "sdist": SdistWithProtos},
)
