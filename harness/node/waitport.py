"""Wait until HOST:PORT accepts TCP connections, so workers start torchrun only once the master listens.

Pods start in any order and pod 0's DNS record appears only after it is scheduled; torchrun alone
would retry silently until its own timeout. This wait says what it waits for and fails clearly.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time


def wait_for_port(host: str, port: int, timeout: float, interval: float = 1.0) -> float:
    """Seconds waited until a connection succeeded; TimeoutError names the last failure."""
    start = time.monotonic()
    last = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(interval * 2, 5)):
                return time.monotonic() - start
        except socket.gaierror as exc:
            last = f"name does not resolve yet ({exc.strerror})"
        except OSError as exc:
            last = exc.strerror or str(exc)
        if time.monotonic() - start + interval > timeout:
            raise TimeoutError(f"{host}:{port} not reachable after {timeout:.0f} s (last error: {last})")
        time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    print(f"harness: waiting for the master's rendezvous port {args.host}:{args.port}", flush=True)
    try:
        waited = wait_for_port(args.host, args.port, args.timeout)
    except TimeoutError as exc:
        print(f"harness: {exc}; is node 0 running and is the port open between pods?", file=sys.stderr)
        return 1
    print(f"harness: master reachable after {waited:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
