"""Hostile and careless input: every value arrives exactly as written or is refused with where and why;
no traceback, bounded memory, and nothing reaches outside the run's own directory or outlives it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import cli

from conftest import DEMO_JOB as JOB
from conftest import REPO, harness


def render(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return harness("render", str(path), "--format", "json", *extra)


def argv_of(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    argv = json.loads(result.stdout)["nodes"][0]["argv"]
    return argv[argv.index("harness.payload.train") + 1:]


def refused(path: Path, *extra: str, timeout: float = 120) -> str:
    result = harness("render", str(path), *extra, timeout=timeout)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


# -- values arrive exactly as written ------------------------------------------------------------------

def test_unquoted_args_reach_the_script_exactly_as_typed(write_yaml):
    words = ["1.10", "0123", "12:30", "2024-01-01", "1_000", "yes", "0x1F", "1e3", "-0", ".5", "~x"]
    path = write_yaml(JOB.replace("args: [--x]", f"args: [{', '.join(words)}]"))
    assert argv_of(render(path)) == words


def test_numbers_that_other_yaml_tools_read_differently_are_refused_where_numbers_are_meant(write_yaml):
    error = refused(write_yaml(JOB.replace("29400", "070000")))
    assert re.search(r"job.yaml:3:1: master_port: 070000 has a leading zero, which other YAML tools read as an "
                     r"octal number; write 70000", error), error
    assert "rendezvous: expected whole seconds" in refused(write_yaml(JOB + "timeouts: {rendezvous: 0.5}\n"))
    assert "expected a finite number of seconds, got .nan" in refused(write_yaml(JOB + "timeouts: {connect: .nan}\n"))
    assert "got 100000000000000000000" in refused(write_yaml(JOB.replace("nnodes: 2", "nnodes: 100000000000000000000")))


@pytest.mark.parametrize("line", ['name: "demo\\n"', "image: >\n  registry/harness:1\n",
                                  'entrypoint: {module: "a.b\\n"}'], ids=["name", "folded-image", "module"])
def test_a_trailing_newline_never_passes_a_pattern(write_yaml, line):
    key = line.split(":")[0]
    text = re.sub(rf"^{key}:.*(\n  .*)*$", line.rstrip("\n"), JOB, flags=re.M) if key != "image" else JOB + line
    error = refused(write_yaml(text))
    assert re.search(rf"job.yaml:\d+:\d+: {key}", error), error


def test_a_script_that_looks_like_a_torchrun_option_is_refused(write_yaml):
    error = refused(write_yaml(JOB.replace("module: harness.payload.train", "script: --nnodes=99")))
    assert "script '--nnodes=99' starts with '-', which torchrun would take for one of its own options" in error


def test_two_spellings_of_one_ipv6_address_are_one_host(write_yaml):
    hosts = write_yaml("hosts:\n  - {name: a, address: '::1'}\n  - {name: b, address: '0:0:0:0:0:0:0:1'}\n", "h.yaml")
    error = refused(write_yaml(JOB), "--hosts", str(hosts))
    assert "h.yaml:3:15: hosts[1].address: duplicate address '0:0:0:0:0:0:0:1' (also hosts[0])" in error


# -- no traceback, bounded ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("base: &b {nnodes: 2}\njob:\n  <<: *b\n", "job.yaml:3:3: job: YAML merge keys (<<) are not supported"),
    ("name: !secret demo\n", "job.yaml:1:7: name: YAML tag '!secret' is not supported"),
    ("name: !!python/object:os.system demo\n", "YAML tag '!!python/object:os.system' is not supported"),
    ("a: " + "[" * 40 + "]" * 40 + "\n", "nested more than 32 levels deep"),
    ("name: d\xe9mo\n".encode("latin-1"), "job.yaml:1:8: not UTF-8 text (byte 0xe9); save the file as UTF-8"),
    ("name: " + "x" * 1_000_000 + "\n", "name: expected a DNS-1123 label"),
    ("nnodes: " + "9" * 5000 + "\n", "nnodes: expected an integer from 1 to 4096, got '999"),  # past int()'s digits
    ("resources: {memory: " + "9" * 999_000 + "Ei}\n", "resources.memory: expected a Kubernetes quantity from 1Mi"),
    ("a: \"x\\0y\"\nnnodes: 1\nname: d\nentrypoint: {module: m, args: [\"a\\0b\"]}\n", "contains a NUL byte"),
], ids=["merge", "tag", "python-tag", "deep-32", "latin-1", "megabyte", "5000-digits", "megabyte-quantity", "nul"])
def test_malformed_files_are_located_errors(tmp_path, text, message):
    path = tmp_path / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    error = refused(path)
    assert message in error, error
    assert len(error) < 1000, "a hostile value must not be echoed back whole"


TOO_DEEP = "nested more than 32 levels deep (the limit is 32; a job spec or inventory needs a few)"


@pytest.mark.parametrize("nested, job_column, hosts_column", [
    ("[" * 3000 + "]" * 3000, 36, 67),  # the 33rd level: the 33rd `[` in the job, the 31st in a host
    ("{a: " * 3000 + "}" * 3000, 129, 154),  # the key of the 32nd mapping in the job, of the 30th in a host
], ids=["sequences", "mappings"])
def test_deep_nesting_is_refused_where_it_passes_the_limit(write_yaml, nested, job_column, hosts_column):
    job = write_yaml(f"a: {nested}\n")
    assert refused(job) == f"harness: error: {job}:1:{job_column}: {TOO_DEEP}\n"
    hosts = write_yaml(f"hosts:\n  - {{name: a, address: 10.0.0.1, x: {nested}}}\n", "h.yaml")
    assert refused(write_yaml(JOB), "--hosts", str(hosts)) == f"harness: error: {hosts}:2:{hosts_column}: {TOO_DEEP}\n"


def test_an_alias_bomb_stops_early_with_bounded_memory(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    (tmp_path / "job.yaml").write_text("\n".join(lines) + "\n")
    # The child may map 512 MiB in all: an unbounded expansion would die of MemoryError, not exit 2.
    probe = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20)); "
             "from harness import cli; sys.exit(cli.main(['render', sys.argv[1]]))")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "job.yaml")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "more than 100000 values once anchors and aliases are expanded" in result.stderr
    assert time.monotonic() - started < 60  # guard: an expansion runs for minutes; a refusal, a Python start


def test_bad_output_and_runs_directories_are_errors(write_yaml, tmp_path):
    job = write_yaml(JOB + "image: r/h:1\n")
    afile = tmp_path / "afile"
    afile.write_text("x")
    result = harness("render", str(job), "--target", "k8s", "--out", str(afile))
    assert (result.returncode, result.stderr.strip()) == (2, f"harness: error: --out {afile} is a file; give the "
                                                              f"directory to write demo.yaml into")
    result = harness("render", str(job), "--target", "k8s", "--out", str(afile / "sub"))
    assert result.returncode == 1 and result.stderr.startswith("harness: error: cannot write") and \
        "Traceback" not in result.stderr
    for verb in (["status"], ["launch", str(job)], ["stop", "some-run"]):
        result = harness(*verb, "--runs-dir", str(afile))
        assert (result.returncode, result.stderr.strip()) == (
            2, f"harness: error: runs directory {afile} is not a directory; give --runs-dir a directory"), verb
    assert afile.read_text() == "x"


def _socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))  # the socket file outlives the socket


NOT_REGULAR = {"a FIFO (named pipe)": os.mkfifo, "a directory": os.mkdir, "a socket": _socket,
               "a character device": lambda path: os.symlink("/dev/null", path)}


@pytest.mark.parametrize("kind", NOT_REGULAR)
def test_a_spec_or_inventory_that_is_not_a_regular_file_is_refused_unopened(write_yaml, tmp_path, kind):
    path = tmp_path / "x.yaml"
    NOT_REGULAR[kind](path)
    expected = f"harness: error: {path}: is {kind}, not a regular file; a job spec or inventory is a YAML file\n"
    # A FIFO without a writer once blocked open() forever: the timeout ends the test if it ever does again.
    assert refused(path, timeout=20) == expected
    assert refused(write_yaml(JOB), "--hosts", str(path), timeout=20) == expected


def test_ctrl_c_while_reading_a_file_is_exit_130(write_yaml):
    # A read that takes long (a stalled network filesystem) stands in for the slow file; Ctrl-C comes meanwhile.
    probe = ("import sys, time; from harness import cli; from harness.spec import job; "
             "job.load_document = lambda path: (print('reading', flush=True), time.sleep(120)); "
             "sys.exit(cli.main(['render', sys.argv[1]]))")
    # Ctrl-C as at a terminal: a handled SIGINT is reset to its default by exec, an ignored one (as in a
    # background job) would stay ignored, so the test handles it while it starts the harness.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        reader = subprocess.Popen([sys.executable, "-c", probe, str(write_yaml(JOB))], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reader.stdout is not None and reader.stdout.readline() == "reading\n"
    reader.send_signal(signal.SIGINT)
    _, err = reader.communicate(timeout=30)
    assert (reader.returncode, err) == (130, "harness: interrupted\n")


@pytest.mark.parametrize("key, value, expected", [
    ("memory", "1e400", "from 1Mi to 1Pi bytes, such as 16Gi or 512Mi, got 1e400"),
    ("memory", ".inf", "from 1Mi to 1Pi bytes, such as 16Gi or 512Mi, got .inf"),
    ("memory", ".nan", "from 1Mi to 1Pi bytes, such as 16Gi or 512Mi, got .nan"),
    ("memory", "-1Gi", "from 1Mi to 1Pi bytes, such as 16Gi or 512Mi, got '-1Gi'"),
    ("memory", "2Pi", "from 1Mi to 1Pi bytes, such as 16Gi or 512Mi, got '2Pi'"),
    ("memory", "64", "from 1Mi to 1Pi bytes, such as 16Gi or 512Mi, got 64"),  # 64 bytes: 64Gi was meant
    ("shm_size", "1e99999999999999999999", "from 1Mi to 1Pi bytes, such as 16Gi or 512Mi, got 1e99999999999999999999"),
    ("cpu", "1e400", "from 1m to 16384 CPUs, such as 4 or 500m, got 1e400"),
    ("cpu", "0.0001", "from 1m to 16384 CPUs, such as 4 or 500m, got 0.0001"),  # Kubernetes would make it 1m
    ("storage", "9Ei", "from 1Mi to 1Ei bytes, such as 50Gi or 2Ti, got '9Ei'"),  # past 2^63 - 1: capped unsaid
])
def test_resources_no_node_can_have_are_refused_at_their_key(write_yaml, key, value, expected):
    error = refused(write_yaml(JOB + f"resources:\n  {key}: {value}\n"))
    assert f"job.yaml:8:3: resources.{key}: expected a Kubernetes quantity {expected}\n" in error, error


def test_the_bounds_of_resources_are_accepted(write_yaml):
    assert render(write_yaml(JOB + "resources: {cpu: 1m, memory: 1Pi, shm_size: 1Mi, storage: 1Ei}\n")).returncode == 0
    assert render(write_yaml(JOB + "resources: {cpu: 16384, memory: 1Mi, storage: 1Mi}\n")).returncode == 0


def test_an_identity_file_that_is_not_a_key_file_is_refused_at_its_line(write_yaml, tmp_path):
    key = tmp_path / "id_ed25519"
    key.write_text("a key\n")
    missing = f"~/no-such-dir-{os.getpid()}/id_ed25519"  # ~ expanded as ssh does
    hosts = write_yaml(f"defaults: {{identity_file: {missing}}}\nhosts:\n"
                       f"  - {{name: a, address: 10.0.0.1, identity_file: {key}}}\n"
                       f"  - {{name: b, address: 10.0.0.2, identity_file: {tmp_path}}}\n"
                       f"  - {{name: c, address: 10.0.0.3}}\n"
                       f"  - {{name: d, address: 10.0.0.4, identity_file: {tmp_path}/nope}}\n", "h.yaml")
    error = refused(write_yaml(JOB), "--hosts", str(hosts))
    expected = "; expected the path of an SSH private key on this machine, or no identity_file (ssh-agent and " \
               "~/.ssh/id_* are tried then)"
    assert error.splitlines() == [
        f"harness: error: {hosts}:4:34: hosts[1].identity_file: '{tmp_path}' is a directory, not an SSH private "
        f"key file",
        f"{hosts}:1:12: defaults.identity_file: '{Path(missing).expanduser()}' does not exist{expected}",  # c's, once
        f"{hosts}:6:34: hosts[3].identity_file: '{tmp_path}/nope' does not exist{expected}",
    ]


# -- nothing outside the run's own space ----------------------------------------------------------------

def test_run_ids_cannot_leave_the_runs_directory(write_yaml, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "state.json").write_text("{}")
    for verb in (["stop", "../outside"], ["status", "../outside"], ["launch", str(write_yaml(JOB)), "--run-id", "../x"],
                 ["render", str(write_yaml(JOB)), "--run-id", "a/b"]):
        result = harness(*verb, "--runs-dir", str(runs)) if verb[0] != "render" else harness(*verb)
        assert result.returncode == 2 and "is not a run id" in result.stderr, (verb, result.stderr)
    assert (outside / "state.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == [
        "job.yaml", "outside", "runs"]


def test_rendered_files_and_records_are_readable_by_others(write_yaml, tmp_path):
    old = os.umask(0o022)
    try:
        job = write_yaml(JOB + "image: r/h:1\n")
        assert harness("render", str(job), "--target", "k8s", "--out", str(tmp_path / "k8s")).returncode == 0
        assert stat.S_IMODE((tmp_path / "k8s" / "demo.yaml").stat().st_mode) == 0o644
    finally:
        os.umask(old)


# -- the promised error, not another one -----------------------------------------------------------------


@pytest.mark.parametrize("hosts, message", [
    ("hosts:\n  - {name: a, address: '[fe80::1]'}\n", "h.yaml:2:5: hosts[0]: write the IPv6 address without brackets"),
    ("hosts:\n  - {name: a, address: 10.0.0.1}\n", "h.yaml:1:1: hosts: the job needs nnodes=2 hosts but the inventory "
                                                  "lists 1"),
    ("hosts:\n  - {name: a, address: 127.0.0.1}\n  - {name: b, address: 10.0.0.2}\n",
     "h.yaml:2:15: hosts[0].address: the master's address 127.0.0.1 is loopback"),
], ids=["brackets", "too-few", "loopback-master"])
def test_inventory_errors_name_file_line_and_key(write_yaml, hosts, message):
    assert message in refused(write_yaml(JOB), "--hosts", str(write_yaml(hosts, "h.yaml")))


def test_job_errors_found_after_validation_name_their_key(write_yaml):
    assert "job.yaml:7:1: container: container: true runs every node in `image:`" in refused(
        write_yaml(JOB + "container: true\n"))
    assert "job.yaml:1:1: image: required to render for Kubernetes" in refused(write_yaml(JOB), "--target", "k8s")


def test_bad_command_line_values_blame_the_option(write_yaml, tmp_path):
    result = harness("preflight", str(write_yaml("hosts:\n  - {name: a, address: 10.0.0.1}\n", "h.yaml")),
                     "--timeout", "-1")
    assert result.returncode == 2 and "argument --timeout: expected seconds between 0 and 86400, got -1" in result.stderr


def test_env_names_that_differ_from_reserved_ones_only_in_case_are_refused(write_yaml):
    error = refused(write_yaml(JOB + "env: {master_addr: 10.0.0.9}\n"))
    assert "env.master_addr: master_addr differs only in case from MASTER_ADDR, which is set by the harness" in error


# -- generated input ------------------------------------------------------------------------------------

VALID = {"name": "fuzz", "nnodes": 2, "nproc_per_node": 1, "backend": "gloo", "master_port": 29400,
         "entrypoint": {"module": "harness.payload.train", "args": ["--x", 1]}, "env": {"A": "b"},
         "timeouts": {"rendezvous": 10, "stop_grace": 1, "connect": 5}, "resources": {"gpus": 0, "shm_size": "1Gi"}}
JUNK = [None, True, -1, 0, 2**70, 1.5, float("nan"), "", " ", "x\n", "\0", "-flag", "../..", "a" * 5000, [], {},
        [1, [2]], {"k": {"k": "v"}}, "0123", "1e400", "${HOME}", "🚀", "!tag"]
RAW_EDITS = [lambda t, r: t[: r.randrange(len(t))], lambda t, r: t.replace(":", "", 1),
             lambda t, r: t.replace("  ", "\t", 1), lambda t, r: t + "\n" + t,
             lambda t, r: t.replace("{", "[", 1), lambda t, r: "&a " + t,
             lambda t, r: t[: (i := r.randrange(len(t)))] + r.choice("\"'&*!%@`|>{}[],#-?:") + t[i:]]


def _mutate(data: object, chance: random.Random) -> object:
    """A copy of data with one value somewhere replaced by junk, deleted, or given an unknown sibling."""
    if not isinstance(data, dict) or not data or chance.random() < 0.3:
        return chance.choice(JUNK)
    key = chance.choice(sorted(data))
    copy = dict(data)
    action = chance.random()
    if action < 0.15:
        del copy[key]
    elif action < 0.25:
        copy[key + "_x"] = chance.choice(JUNK)
    else:
        copy[key] = _mutate(copy[key], chance)
    return copy


def test_generated_malformed_specs_and_inventories_end_with_exit_0_or_2(tmp_path):
    chance = random.Random(11)
    hosts = {"defaults": {"gpus": 0}, "hosts": [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "b.x"}]}
    outcomes = {0: 0, 2: 0}
    for index in range(300):
        job, inventory = tmp_path / f"job{index}.yaml", tmp_path / f"hosts{index}.yaml"
        spec_data, hosts_data = (_mutate(VALID, chance), hosts) if index % 3 else (VALID, _mutate(hosts, chance))
        job_text, hosts_text = json.dumps(spec_data, allow_nan=True), json.dumps(hosts_data, allow_nan=True)
        if index % 4 == 0:
            job_text = chance.choice(RAW_EDITS)(job_text, chance)
        job.write_text(job_text)
        inventory.write_text(hosts_text)
        argv = ["render", str(job), "--format", "json"] + (["--hosts", str(inventory)] if index % 2 else [])
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = cli.main(argv)  # an exception escaping here is the traceback a user would see
        assert code in outcomes, (index, job_text[:300], err.getvalue())
        assert code == 0 or err.getvalue().startswith("harness: error: "), (index, err.getvalue())
        outcomes[code] += 1
    assert outcomes[2] > 150 and outcomes[0] > 10, outcomes
