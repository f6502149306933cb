"""A job's secret values: read where the launch runs, carried to each node's agent on its standard input
(targets/agent_link.py), given to the ranks in their environment, and never written: not in a plan, a
record, a manifest or a command line. And what the harness shows of env values that look like secrets.

On Kubernetes the pods take them from a Secret (targets/k8s), so nothing here runs there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from harness.spec.job import JobSpec
from harness.spec.yamlsource import located

MASK = "***"
# Words that name a secret wherever they stand in a name, even run together with others (DBPASSWORD, CLIENTSECRET,
# OPENAI_APIKEY): none of them is part of an innocent word.
SECRET_WORDS = ("SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "PRIVKEY", "APIKEY")
# Words that name a secret only as a whole part of a name (the parts between `_`, `-` or `.`): as a piece of a
# longer part they are innocent (KEYBOARD, PATH, AUTHOR, PASSES, BYPASS, SESSIONS is not SESSION).
SECRET_PARTS = frozenset({
    "TOKEN", "TOKENS",  # HF_TOKEN, AWS_SESSION_TOKEN (a part ending in TOKEN too: GHTOKEN; not TOKENIZERS_...)
    "KEY", "KEYS",  # WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, SSH_PRIVATE_KEY (AWS_ACCESS_KEY_ID too: a *** costs little)
    "PAT",  # a personal access token: GITHUB_PAT, GH_PAT
    "AUTH", "OAUTH",  # HF_AUTH, GITHUB_OAUTH: a bearer value
    "PASS",  # DB_PASS, SMTP_PASS
    "PWD",  # MYSQL_PWD, DB_PWD; but a name that is PWD alone is the shell's working directory (and OLDPWD one part)
    "CREDS",  # DB_CREDS (CREDENTIALS is a SECRET_WORD)
    "COOKIE", "COOKIES",  # a session cookie: YT_COOKIE
    "SESSION",  # AOC_SESSION, OP_SESSION_ACCOUNT: a session's value is a bearer credential
})
NAME_PARTS = re.compile(r"[^A-Z0-9]+")


def looks_secret(name: str) -> bool:
    """Whether an env name's value is hidden wherever the harness shows it or runs it: its name holds a word of
    SECRET_WORDS anywhere, or one of SECRET_PARTS as a whole part (a part ending in TOKEN too), case aside. Wide on
    purpose: a name taken for a secret that is not one costs a `***` where the harness shows it and a line at launch;
    a secret taken for a plain value would be written in clear."""
    upper = name.upper()
    if any(word in upper for word in SECRET_WORDS):
        return True
    parts = [part for part in NAME_PARTS.split(upper) if part]
    if parts == ["PWD"]:
        return False
    return any(part in SECRET_PARTS or part.endswith("TOKEN") for part in parts)


def shown_env(env: Mapping[str, str]) -> dict[str, str]:
    """env as the harness shows it: the values of names that look secret masked."""
    return {key: MASK if looks_secret(key) else value for key, value in env.items()}


def env_apart(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """env as (the entries a command line may hold, those whose names look secret): the latter reach a process
    through its environment alone, as a secret's value does."""
    plain = {key: value for key, value in env.items() if not looks_secret(key)}
    return plain, {key: value for key, value in env.items() if key not in plain}


def shown_words(words: Sequence[str]) -> list[str]:
    """A harness command line as the harness shows or keeps it (a run's `# Made by:` header, a render's header, a
    usage error's suggestion): the value of each `--env NAME=VALUE` (or `--env=NAME=VALUE`) before `--` whose NAME
    looks secret masked. After `--` the words are the script's own, which the plan shows as they are."""
    shown: list[str] = []
    for at, word in enumerate(words):
        if word == "--":
            return shown + list(words[at:])
        pair = word.removeprefix("--env=") if word.startswith("--env=") else \
            word if at and words[at - 1] == "--env" else None
        name = pair.partition("=")[0] if pair is not None else ""
        shown.append(word[:len(word) - len(pair)] + f"{name}={MASK}" if pair is not None and looks_secret(name)
                     else word)
    return shown


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
