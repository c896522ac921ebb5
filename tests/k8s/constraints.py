"""The image's pip constraints (constraints.txt at the repository root), made from this environment.

The Dockerfile installs torch first, then `pip install -c constraints.txt ".[k8s,megatron]"`, so
every package that install pulls in is pinned to the version tested here. The pins are the
project's runtime dependencies (pyproject's `dependencies` plus the image's extras) and their
dependencies, as installed in the running interpreter, minus torch and what only torch needs
(torch comes from its own index; the CPU and CUDA wheels differ). Regenerate after changing
dependencies or upgrading the environment:

    .venv/bin/python -m tests.k8s.constraints > constraints.txt

tests/k8s/test_helm_hardening.py fails when constraints.txt and this environment disagree.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
IMAGE_EXTRAS = ("k8s", "megatron")  # the Dockerfile's runtime stage: pip install ".[k8s,megatron]"
EXCLUDED = {"torch"}  # installed before the constraints apply, from TORCH_INDEX_URL


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in (extras or {""}))


def runtime_closure() -> dict[str, str]:
    """canonical name -> installed version of every package the image's install pulls in."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for extra in IMAGE_EXTRAS for r in project["optional-dependencies"][extra]]
    wanted = [r for r in wanted if _applies(r, set())]
    pins: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    while wanted:
        req = wanted.pop()
        name = canonicalize_name(req.name)
        if name in EXCLUDED or (name in pins and set(req.extras) <= extras_seen[name]):
            continue
        extras = extras_seen.setdefault(name, set()) | set(req.extras)
        extras_seen[name] = extras
        pins[name] = md.version(name)  # a missing package is an error: the environment is incomplete
        for text in md.requires(name) or ():
            dep = Requirement(text)
            if _applies(dep, extras):
                wanted.append(dep)
    return dict(sorted(pins.items()))


def render() -> str:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    lines = [
        "# Pins for the image's `pip install -c constraints.txt \".[k8s,megatron]\"` (Dockerfile, runtime stage):",
        "# the runtime dependencies and theirs, as tested; torch is installed before, from its own index.",
        f"# Generated on Python {version}: .venv/bin/python -m tests.k8s.constraints > constraints.txt",
    ]
    lines += [f"{name}=={pinned}" for name, pinned in runtime_closure().items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
