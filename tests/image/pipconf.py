"""This machine's effective pip settings as buildah build arguments, so RUN steps reach the same indexes.

pip here may be configured by files (/etc/pip.conf, ~/.config/pip/pip.conf) and PIP_* variables
(an index mirror, a CA bundle, local wheel folders). A RUN step sees none of that. The test build
gets it at build time only, the way docker/Dockerfile documents for users: the merged settings as
the `pipconf` secret, the CA bundle they name as the `cacert` secret, and every local folder they
name as a read-only --volume. Nothing of it is stored in the image (buildah leaves an empty
directory where a volume was mounted; run.sh checks that nothing more is left).

  python pipconf.py OUT   writes the merged pip.conf to OUT; prints the build arguments, one a line
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

LINE = re.compile(r"^(?P<section>:env:|[^.]+)\.(?P<key>[^=]+)=(?P<value>.*)$")
PATH_KEYS = ("find-links", "index-url", "extra-index-url", "client-cert")
SECRET_CERT = "/run/secrets/cacert"


def effective_config() -> dict[str, dict[str, str]]:
    """`pip config list` per section; PIP_* variables (`:env:`) override the files' [global]."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True).stdout
    sections: dict[str, dict[str, str]] = {}
    environment: dict[str, str] = {}
    for line in listing.splitlines():
        match = LINE.match(line.strip())
        if match is None:
            continue
        target = environment if match["section"] == ":env:" else sections.setdefault(match["section"], {})
        target[match["key"]] = ast.literal_eval(match["value"])
    sections["global"] = sections.get("global", {}) | environment
    return sections


def local_paths(sections: dict[str, dict[str, str]]) -> list[str]:
    """Existing files and folders the settings point at (file:// indexes, wheel folders).

    A local simple index links to its files relatively (../../files/x.whl), so it is mounted with
    its parent folder.
    """
    found: list[str] = []
    for values in sections.values():
        for key in PATH_KEYS:
            for item in values.get(key, "").split():
                if not item.startswith(("file:", "/")):
                    continue
                path = Path(urlparse(item).path if item.startswith("file:") else item)
                if key.endswith("index-url"):
                    path = path.parent
                if path.exists() and str(path) not in found:
                    found.append(str(path))
    return found


def render(sections: dict[str, dict[str, str]]) -> str:
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {value}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def build_arguments(sections: dict[str, dict[str, str]], conf: Path) -> list[str]:
    """Writes the pip.conf the build reads (its CA bundle moved to the secret's path) to conf."""
    arguments = ["--secret", f"id=pipconf,src={conf}"]
    cert = sections["global"].get("cert")
    if cert:
        arguments += ["--secret", f"id=cacert,src={cert}"]
        sections["global"]["cert"] = SECRET_CERT
    for path in local_paths(sections):
        arguments += ["--volume", f"{path}:{path}:ro"]
    conf.write_text(render(sections))
    return arguments


def main() -> int:
    print("\n".join(build_arguments(effective_config(), Path(sys.argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
