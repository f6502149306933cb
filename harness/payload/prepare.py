"""Download and verify CIFAR-10 once, before training: `python -m harness.payload.prepare --data-dir DIR`.

One process does this so that training ranks never race on the download; they only read DIR.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from urllib.parse import urlsplit

from harness.payload import PayloadError
from harness.payload.data import CIFAR_ARCHIVE, CIFAR_DIR, CIFAR_URL, prepare_cifar10

# What urllib fetches from: any other scheme is the user's typo, not a network failure.
URL_SCHEMES = ("http", "https", "ftp", "file")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

EPILOG = (
    f"Exit status: {EXIT_OK} the data is ready; {EXIT_FAILED} the download, its md5 check, the unpacking or the "
    f"disk failed (run it again, or name a mirror with --url); {EXIT_USAGE} bad usage."
)


def parser(prog: str) -> argparse.ArgumentParser:
    """prog: how the user ran it (`harness prepare` through the harness CLI), so --help and errors say so."""
    p = argparse.ArgumentParser(prog=prog, epilog=EPILOG, description="Download CIFAR-10 once, check its md5 and "
                                "unpack it, before training: one process, so that training ranks only read it.")
    p.add_argument("--data-dir", type=Path, required=True, metavar="DIR",
                   help=f"where the data goes: DIR/{CIFAR_ARCHIVE} and the unpacked DIR/{CIFAR_DIR}/ (created if "
                        "missing; nothing is downloaded when the batches are already there)")
    p.add_argument("--url", default=CIFAR_URL, metavar="URL",
                   help=f"where to fetch {CIFAR_ARCHIVE} from: a mirror, or a file:// URL of a copy (the md5 is still "
                        f"checked; {', '.join(URL_SCHEMES)}; default {CIFAR_URL})")
    return p


def main(argv: list[str] | None = None, prog: str = "harness.payload.prepare") -> int:
    """Exit 1 for what went wrong on the way (network, checksum, disk): the same command may work
    later or with a mirror; 2 only for a command line that can never work (argparse's own status)."""
    p = parser(prog)
    args = p.parse_args(argv)
    if args.data_dir.exists() and not args.data_dir.is_dir():
        p.error(f"--data-dir {args.data_dir} is a file, expected a directory (or a path to create one at)")
    if urlsplit(args.url).scheme not in URL_SCHEMES:
        p.error(f"--url {args.url!r}: expected a URL starting with {', '.join(s + '://' for s in URL_SCHEMES)}")
    try:
        folder = prepare_cifar10(args.data_dir, url=args.url)
    except PayloadError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:  # the data directory itself: permissions, a full disk
        print(f"{prog}: error: could not prepare CIFAR-10 in {args.data_dir} ({e}); free space or fix the "
              f"permissions there, or name another --data-dir", file=sys.stderr)
        return EXIT_FAILED
    print(f"CIFAR-10 ready in {folder}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
