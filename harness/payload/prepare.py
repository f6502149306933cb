"""Download and verify CIFAR-10 once, before training: `python -m harness.payload.prepare --data-dir DIR`.

One process does this so that training ranks never race on the download; they only read DIR.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.payload import PayloadError
from harness.payload.data import CIFAR_URL, prepare_cifar10


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="harness.payload.prepare", description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--url", default=CIFAR_URL, help="a mirror of cifar-10-python.tar.gz (md5 is still checked)")
    args = p.parse_args(argv)
    try:
        folder = prepare_cifar10(args.data_dir, url=args.url)
    except PayloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"CIFAR-10 ready in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
