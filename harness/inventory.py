"""The host inventory (hosts.yaml): which machines run the job and how to reach them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, model_validator

from harness.errors import SpecError
from harness.spec import DNS1123_LABEL
from harness.validation import StrictModel, validate
from harness.yamlsource import Document, load_document


class HostDefaults(StrictModel):
    """Values every host inherits unless it sets its own."""

    port: Annotated[int, Field(ge=1, le=65535)] = 22
    user: str | None = None
    identity_file: str | None = None
    python: str = "python3"
    workdir: str | None = None
    gpus: Annotated[int, Field(ge=0)] | None = None


class Host(HostDefaults):
    """One machine. `address` is what SSH connects to; the master's address is also MASTER_ADDR."""

    name: str
    address: str

    @model_validator(mode="after")
    def _valid_name(self) -> Host:
        if not DNS1123_LABEL.match(self.name) or len(self.name) > 63:
            raise ValueError(f"host name must be a DNS-1123 label (e.g. gpu-01), got {self.name!r}")
        if not self.address.strip() or any(c.isspace() for c in self.address):
            raise ValueError(f"address must be an IP or hostname without spaces, got {self.address!r}")
        return self


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

    def ordered_hosts(self) -> list[Host]:
        """Master first, then the others in file order: node_rank 0 must live on the master."""
        return [self.master_host()] + [h for h in self.hosts if h.name != self.master]


def _merge_host(doc: Document, index: int, raw: dict[str, Any], defaults: HostDefaults) -> Host:
    return validate(Host, doc, at=("hosts", index), data=defaults.model_dump(exclude_none=True) | raw)


def load_inventory(path: str | Path) -> Inventory:
    """Read and validate hosts.yaml: defaults merged, names and addresses unique, master known."""
    doc = load_document(path)
    parsed = validate(_InventoryFile, doc)
    hosts = [_merge_host(doc, i, raw, parsed.defaults) for i, raw in enumerate(parsed.hosts)]
    problems = []
    for field in ("name", "address"):
        seen: dict[str, int] = {}
        for index, host in enumerate(hosts):
            value = getattr(host, field)
            if value in seen:
                problems.append(doc.problem(
                    ("hosts", index, field),
                    f"duplicate {field} {value!r} (also hosts[{seen[value]}]); every host must be distinct",
                ))
            seen.setdefault(value, index)
    master = parsed.master if parsed.master is not None else hosts[0].name
    if master not in {h.name for h in hosts}:
        problems.append(doc.problem(
            ("master",), f"master {master!r} is not a host in this inventory; expected one of: "
            + ", ".join(h.name for h in hosts),
        ))
    if problems:
        raise SpecError(problems)
    return Inventory(path=str(doc.path), hosts=hosts, master=master)
