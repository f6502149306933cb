"""The host inventory (hosts.yaml): which machines run the job and how to reach them."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, model_validator

from harness.errors import SpecError, short_repr
from harness.spec.job import DNS1123_LABEL, InterfaceName
from harness.spec.validation import StrictModel, validate
from harness.spec.yamlsource import Document, KeyPath, load_document, not_regular


class HostDefaults(StrictModel):
    """Values every host inherits unless it sets its own."""

    port: Annotated[int, Field(ge=1, le=65535)] = 22
    user: str | None = None
    identity_file: str | None = None
    python: str = "python3"
    workdir: str | None = None
    gpus: Annotated[int, Field(ge=0)] | None = None
    interface: InterfaceName | None = None  # for gloo and NCCL here; overrides the job's network.interface


class Host(HostDefaults):
    """One machine. `address` is what SSH connects to; the master's address is also MASTER_ADDR."""

    name: str
    address: str

    @model_validator(mode="after")
    def _valid_name(self) -> Host:
        if not DNS1123_LABEL.fullmatch(self.name) or len(self.name) > 63:
            raise ValueError(f"host name must be a DNS-1123 label (e.g. gpu-01), got {short_repr(self.name)}")
        if not self.address.strip() or any(c.isspace() or c == "\0" for c in self.address):
            raise ValueError(f"address must be an IP or hostname without spaces, got {short_repr(self.address)}")
        if self.address.startswith("["):
            raise ValueError(f"write the IPv6 address without brackets (as {self.address.strip('[]')!r}); "
                             f"the port goes in `port:`")
        return self

    @property
    def address_key(self) -> str:
        """One spelling per address, so that ::1 and 0:0:0:0:0:0:0:1 are the same host."""
        try:
            return str(ipaddress.ip_address(self.address))
        except ValueError:
            return self.address.lower().rstrip(".")


class _InventoryFile(StrictModel):
    defaults: HostDefaults = Field(default_factory=HostDefaults)
    hosts: Annotated[list[dict[str, Any]], Field(min_length=1)]
    master: str | None = None


class Inventory(StrictModel):
    """Hosts in rank order (node_rank i runs on hosts[i]); the master runs node_rank 0."""

    path: str
    hosts: list[Host]
    master: str

    def master_host(self) -> Host:
        return next(h for h in self.hosts if h.name == self.master)

    def key_path(self, host: Host, field: str) -> tuple[str | int, ...]:
        """Where a host's field is written in the file, for errors found after validation."""
        return ("hosts", self.hosts.index(host), field)

    def ordered_hosts(self) -> list[Host]:
        """Master first, then the others in file order: node_rank 0 must live on the master."""
        return [self.master_host()] + [h for h in self.hosts if h.name != self.master]


def _merge_host(doc: Document, index: int, raw: dict[str, Any], defaults: HostDefaults) -> Host:
    return validate(Host, doc, at=("hosts", index), data=defaults.model_dump(exclude_none=True) | raw)


def _key_problem(identity_file: str) -> str | None:
    """Why identity_file cannot be read as a key here (None when it can): the controller reads it at the
    first connection, so without this check a wrong path surfaces only then, and without the file's line."""
    key = Path(identity_file).expanduser()
    shown = short_repr(str(key), limit=200)  # a path cut short names no file
    try:
        kind = not_regular(key.stat().st_mode)
    except FileNotFoundError:
        return (f"{shown} does not exist; expected the path of an SSH private key on this machine, or no "
                f"identity_file (ssh-agent and ~/.ssh/id_* are tried then)")
    except OSError as exc:
        return f"cannot read {shown}: {exc.strerror}"
    return None if kind is None else f"{shown} is {kind}, not an SSH private key file"


def load_inventory(path: str | Path) -> Inventory:
    """Read and validate hosts.yaml: defaults merged, names and addresses unique, master known."""
    doc = load_document(path)
    parsed = validate(_InventoryFile, doc)
    hosts = [_merge_host(doc, i, raw, parsed.defaults) for i, raw in enumerate(parsed.hosts)]
    # Each key file once, where it is written: a host's own, or the defaults' that it inherits.
    keys: dict[KeyPath, str] = {
        ("hosts", index, "identity_file") if "identity_file" in raw else ("defaults", "identity_file"): identity
        for index, (raw, host) in enumerate(zip(parsed.hosts, hosts, strict=True))
        if (identity := host.identity_file) is not None
    }
    problems = [doc.problem(where, why) for where, identity in keys.items() if (why := _key_problem(identity))]
    for field, key in (("name", "name"), ("address", "address_key")):
        seen: dict[str, int] = {}
        for index, host in enumerate(hosts):
            value = getattr(host, key)
            if value in seen:
                problems.append(doc.problem(
                    ("hosts", index, field),
                    f"duplicate {field} {short_repr(getattr(host, field))} (also hosts[{seen[value]}]); every host "
                    f"must be distinct",
                ))
            seen.setdefault(value, index)
    master = parsed.master if parsed.master is not None else hosts[0].name
    if master not in {h.name for h in hosts}:
        problems.append(doc.problem(
            ("master",), f"master {short_repr(master)} is not a host in this inventory; expected one of: "
            + ", ".join(h.name for h in hosts),
        ))
    if problems:
        raise SpecError(problems)
    return Inventory(path=str(doc.path), hosts=hosts, master=master)
