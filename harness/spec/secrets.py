"""A job's secret values: read where the launch runs, carried to each node's agent on its standard input
(targets/agent_link.py), given to the ranks in their environment, and never written: not in a plan, a
record, a manifest or a command line. And what the harness shows of env values that look like secrets.

On Kubernetes the pods take them from a Secret (targets/k8s), so nothing here runs there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml

from harness.spec.job import JobSpec
from harness.spec.yamlsource import located

MASK = "***"
SECRET_WORDS = ("PASSWORD", "SECRET")  # anywhere in a name
SECRET_ENDINGS = ("_TOKEN", "_KEY")


def looks_secret(name: str) -> bool:
    """An env name a value is hidden by when shown: *_TOKEN, *_KEY, *PASSWORD*, *SECRET*."""
    upper = name.upper()
    return upper.endswith(SECRET_ENDINGS) or any(word in upper for word in SECRET_WORDS)


def shown_env(env: Mapping[str, str]) -> dict[str, str]:
    """env as the harness shows it: the values of names that look secret masked."""
    return {key: MASK if looks_secret(key) else value for key, value in env.items()}


def secret_values(spec: JobSpec, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Each secret's value, from environ or its file; a missing one is an error at its key in the spec."""
    values = {}
    for name, secret in spec.secrets.items():
        if secret.file is not None:
            values[name] = _file_value(spec, name, Path(secret.file).expanduser())
            continue
        variable = secret.env or name
        if variable not in environ:
            raise located(spec.source, ("secrets", name),
                          f"{variable} is not set in the environment `harness launch` runs in: export it, or name "
                          f"a file that holds the value (secrets: {{{name}: {{file: PATH}}}})")
        values[name] = environ[variable]
    return values


def _file_value(spec: JobSpec, name: str, path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        said = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise located(spec.source, ("secrets", name, "file"), f"cannot read {path}: {said}") from None
    value = text.removesuffix("\n").removesuffix("\r")
    if not value or "\0" in value:
        raise located(spec.source, ("secrets", name, "file"),
                      f"{path} holds {'nothing' if not value else 'a NUL byte'}: expected the secret's value")
    return value


def masked_spec_text(text: str) -> str:
    """The spec file's text with the values of env names that look secret replaced by MASK: what the run keeps as
    its spec.yaml. Everything else stays as written (comments, order, quoting)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return text
    env = _mapping_value(root, "env")
    if env is None:
        return text
    spans = [(value.start_mark.index, value.end_mark.index, value.style in ("|", ">")) for key, value in env.value
             if isinstance(key, yaml.ScalarNode) and looks_secret(key.value)]
    for start, end, block in sorted(spans, reverse=True):  # a block scalar's span ends at the next line
        text = text[:start] + f"'{MASK}'" + ("\n" if block else "") + text[end:]
    return text


def _mapping_value(node: yaml.Node | None, key: str) -> yaml.MappingNode | None:
    if not isinstance(node, yaml.MappingNode):
        return None
    found = next((value for name, value in node.value if isinstance(name, yaml.ScalarNode) and name.value == key),
                 None)
    return found if isinstance(found, yaml.MappingNode) else None
