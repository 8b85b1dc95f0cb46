#!/usr/bin/env python3
"""What a Python brings to the comparisons of `paratrain bench`: torch's version (the one its
package was released as: Debian's build reports 1.13.0a0 for its 1.13.1), whether its
torch.distributed has MPI and Gloo, and the versions of the other packages the anchor scripts use,
read from their metadata without importing them (importing Ray takes seconds). Prints one JSON
line; exits 1 without it when torch cannot be imported."""
import importlib.metadata
import json
import re
import subprocess
import sys

PACKAGES = [
    "torchvision", "pillow", "numpy", "optuna", "ray", "hpbandster", "ConfigSpace", "deepspeed"
]


def debian_version(path):
    """The upstream version of the Debian package that owns `path` ("1.13.1" for python3-torch
    1.13.1+dfsg-4), or None where dpkg does not know the file."""
    try:
        owner = subprocess.run(["dpkg-query", "-S", path], capture_output=True, text=True,
                               check=True)
        package = owner.stdout.split(":")[0].strip()
        version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package],
                                 capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    version = version.split(":")[-1]  # an epoch
    return re.split(r"[+~-]", version)[0] or None


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print(f"torch cannot be imported: {e}", file=sys.stderr)
        sys.exit(1)
    reported = torch.__version__.split("+")[0]  # 2.15.0+cu132: the build's tag goes
    version = reported
    if not re.fullmatch(r"\d+\.\d+\.\d+", reported):  # a source build's 1.13.0a0
        version = debian_version(torch.__file__) or reported
    available = dist.is_available()
    print(json.dumps({
        "python": sys.executable,
        "prefix": sys.prefix,
        "torch": version,
        "torch_reported": torch.__version__,
        "mpi": available and dist.is_mpi_available(),
        "gloo": available and dist.is_gloo_available(),
        "packages": {name.lower(): package_version(name) for name in PACKAGES},
    }))


if __name__ == "__main__":
    main()
