"""The job's `setup:` script as /bin/sh runs it before torchrun: once per working directory, again when
it failed or changed (the same through `harness launch`: tests/integration/test_setup.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from harness.node.agent import free_what_was_read, remove_orphaned
from harness.node.proctable import start_ticks
from harness.plan.setup_script import setup_id, setup_script, with_setup
from harness.targets.boot import source


def started(script: str | None, workdir: Path, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(with_setup(argv or ["echo", "torchrun"], script), cwd=workdir, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_nodes_sharing_a_workdir_run_the_setup_once_and_every_one_then_starts(tmp_path):
    script = setup_script(["echo run >> count; sleep 1", "mkdir -p data/x"], ["data/x"])
    nodes = [started(script, tmp_path, "echo", f"torchrun {n}") for n in range(3)]
    outputs = [p.communicate(timeout=60)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0, 0], outputs
    assert (tmp_path / "count").read_text() == "run\n"
    assert [f"torchrun {n}" in out for n, out in enumerate(outputs)] == [True] * 3
    assert sum("harness setup: running 2 command(s)" in out for out in outputs) == 1, outputs
    assert sum("harness setup: done before" in out for out in outputs) == 2, outputs
    again = started(script, tmp_path).communicate(timeout=60)[0]
    assert "done before" in again and (tmp_path / "count").read_text() == "run\n"
    edited = setup_script(["echo edited >> count"])
    assert started(edited, tmp_path).wait(timeout=60) == 0
    assert (tmp_path / "count").read_text() == "run\nedited\n", "edited commands run again"


def test_a_failed_setup_starts_nothing_and_runs_again_next_time(tmp_path):
    script = setup_script(["echo fetching; test -e ready || exit 4", "echo second >> count"])
    node = started(script, tmp_path)
    out = node.communicate(timeout=60)[0]
    log = tmp_path / ".harness" / f"setup-{setup_id(['echo fetching; test -e ready || exit 4', 'echo second >> count'])}.log"
    assert node.returncode == 4, out
    assert f"harness setup failed: exit 4; torchrun was not started here. Its log: {log}" in out
    assert "torchrun\n" not in out and not (tmp_path / "count").exists(), "a failed command stops the rest"
    assert log.read_text() == "fetching\n"
    (tmp_path / "ready").touch()
    assert started(script, tmp_path).communicate(timeout=60)[0].endswith("torchrun\n")
    assert (tmp_path / "count").read_text() == "second\n"


def test_setup_must_leave_the_data_paths_it_was_meant_to_create(tmp_path):
    node = started(setup_script(["mkdir -p data"], ["data", "data/cifar 10"]), tmp_path)
    out = node.communicate(timeout=60)[0]
    assert node.returncode == 1
    assert f"the commands succeeded but data path data/cifar 10 is still missing in {tmp_path}" in out
    assert not list((tmp_path / ".harness").glob("*.done")), "not done: the next launch tries again"


def test_commands_find_the_jobs_python_first_on_path(tmp_path):
    script = setup_script(['python -c "import sys; print(sys.executable)"'])
    out = started(script, tmp_path, sys.executable, "-c", "print('the node')").communicate(timeout=60)[0]
    assert f"{sys.executable}\nthe node\n" in out or f"{Path(sys.executable).parent}/python\nthe node\n" in out, out


def test_the_rank_hook_goes_first_on_pythonpath_and_every_python_runs_it_then_the_environments_own(tmp_path):
    """What the agent sets up for a node, for real: its directory with the hook as sitecustomize.py, put first
    on PYTHONPATH by the setup line, before a PYTHONPATH of the job's own whose sitecustomize still runs.
    Outside a rank (no RANK) the hook starts nothing."""
    agent_dir, theirs = tmp_path / "agent", tmp_path / "theirs"
    agent_dir.mkdir()
    theirs.mkdir()
    (agent_dir / "sitecustomize.py").write_text(source("rank_hook"))
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    probe = ("import os, sys, threading; print(sys.path[1:3] == [os.environ['HARNESS_AGENT_DIR'], os.environ['THEIRS']],"
             " os.environ.get('THEIRS_RAN'), [t.name for t in threading.enumerate()])")
    for rank, threads in (("", "['MainThread']"), ("1", "['MainThread', 'harness-rank-hook']")):
        env = {"PATH": "/usr/bin:/bin", "HARNESS_AGENT_DIR": str(agent_dir), "PYTHONPATH": str(theirs),
               "THEIRS": str(theirs), **({"RANK": rank} if rank else {})}
        done = subprocess.run(with_setup([sys.executable, "-c", probe], setup_script([], rank_hook=True)),
                              env=env, capture_output=True, text=True, timeout=60, check=False)
        assert done.stdout.strip() == f"True 1 {threads}", done.stdout + done.stderr
    assert setup_script([]) is None, "no setup and no hook: the command runs as it is"


def test_a_ranks_lines_are_written_whole_so_no_other_streams_line_falls_inside_one(tmp_path):
    """Unbuffered, print() writes a line's text and its newline apart, and torchrun's tee once put torch's C++
    warning between them (`...userpkg 1.0[rank1]: [W1202 ...] ...`). Each write of the rank is one message of a
    SOCK_SEQPACKET socket given as its stdout and stderr: in a rank every line is one write, and a progress bar's
    carriage return still comes at once; outside a rank Python's own buffering is untouched."""
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    (agent_dir / "sitecustomize.py").write_text(source("rank_hook"))
    script = "import sys\nprint('one line')\nprint('to stderr', file=sys.stderr)\nprint('10%', end='\\r')\nsys.stdin.read()"
    for rank, writes in (("0", [b"one line\n", b"to stderr\n", b"10%\r"]), ("", [b"one line", b"\n"])):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {"PATH": "/usr/bin:/bin", "HARNESS_AGENT_DIR": str(agent_dir), "PYTHONUNBUFFERED": "1",
               **({"RANK": rank} if rank else {})}
        with theirs:
            python = subprocess.Popen(with_setup([sys.executable, "-c", script], setup_script([], rank_hook=True)),
                                      env=env, stdin=subprocess.PIPE, stdout=theirs, stderr=theirs)
        with ours:
            ours.settimeout(60)
            got = [ours.recv(4096) for _ in writes]
        python.communicate(b"", timeout=60)
        assert got == writes, (rank, got)


def test_an_agent_removes_the_directories_of_agents_that_were_killed_and_keeps_the_living_ones(tmp_path):
    """An agent SIGKILLed (a node lost, a sweep) cannot remove its directory; the next one on the host does."""
    alive = tmp_path / f"harness-agent-{os.getpid()}-{start_ticks(os.getpid())}-abc"
    dead = tmp_path / f"harness-agent-{os.getpid()}-{start_ticks(os.getpid()) + 1}-def"  # a pid since reused
    other = tmp_path / "harness-agent-notes"
    for directory in (alive, dead, other):
        directory.mkdir()
        (directory / "sitecustomize.py").write_text("")
    remove_orphaned(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])


def test_what_torchrun_has_read_of_its_workers_output_is_given_back_and_the_rest_kept(tmp_path):
    """A reader (torchrun tailing a worker's stdout.log, here a process reading it) at 600 KB of 1 MB: the blocks
    before it are freed, the file keeps its size and the unread part; a file it writes, or reads elsewhere, is
    left whole."""
    logs = tmp_path / "torchrun"
    tee, other = logs / "run_x" / "attempt_0" / "0" / "stdout.log", tmp_path / "elsewhere.log"
    tee.parent.mkdir(parents=True)
    data = bytes(range(256)) * 4096
    for path in (tee, other):
        path.write_bytes(data)
    reader = subprocess.Popen([sys.executable, "-c", "import sys\nfiles = [open(p, 'rb', buffering=0) for p in sys.argv[1:]]\n"
                               "for f in files: f.read(600_000)\nprint('read', flush=True)\nsys.stdin.read()",
                               str(tee), str(other)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdout.readline() == "read\n"
        with open(logs / "written.log", "wb") as written:  # this process's write: never freed
            written.write(data)
            freed: dict[str, int] = {}
            free_what_was_read(str(logs), reader.pid, freed)
            free_what_was_read(str(logs), os.getpid(), freed)
    finally:
        reader.communicate("")
    kept = 600_000 // 4096 * 4096
    assert freed == {str(tee): kept}
    assert tee.stat().st_size == len(data) and tee.read_bytes()[kept:] == data[kept:]
    assert tee.read_bytes()[:kept] == bytes(kept), "the freed blocks read as a hole"
    assert tee.stat().st_blocks * 512 <= len(data) - kept + 4096
    assert other.read_bytes() == data and (logs / "written.log").read_bytes() == data
