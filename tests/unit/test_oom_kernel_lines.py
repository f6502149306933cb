"""The OOM killer's records, read as harness.node.oom reads them on a node: the kernel's log in
/dev/kmsg's format, and the memory cgroup's counter (a real kill: tests/integration/test_oom.py)."""

from __future__ import annotations

from pathlib import Path

from harness.node.oom import cgroup_oom_kills, kernel_oom_kills, oom_kill_count

# /dev/kmsg records of a real kill (Linux 6.18, a cgroup v1 memory limit of 64 MiB), each as one read returns
# it; then a kill by the global OOM killer, in the format of the same kernel's mm/oom_kill.c.
MEMCG_KILL = [
    "4,3261,11105325213,-;python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0\n",
    "6,3336,11105327404,-;[  18307]     0 18307   132143    19710    18048     1662         0   217088        0"
    "             0 python3\n",
    "6,3337,11105327407,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
    "oom_memcg=/process_api/43a0/harness-oom-probe,task_memcg=/process_api/43a0/harness-oom-probe,task=python3,"
    "pid=18307,uid=0\n",
    "3,3338,11105327431,-;Memory cgroup out of memory: Killed process 18307 (python3) total-vm:528572kB, "
    "anon-rss:72192kB, file-rss:6648kB, shmem-rss:0kB, UID:0 pgtables:212kB oom_score_adj:0\n",
]
GLOBAL_KILL = [
    "6,9001,523000111,-;oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,"
    "task_memcg=/user.slice/user-1000.slice/session-3.scope,task=python,pid=4242,uid=1000\n",
    "3,9002,523000150,-;Out of memory: Killed process 4242 (python) total-vm:31243520kB, anon-rss:30990336kB, "
    "file-rss:1024kB, shmem-rss:0kB, UID:1000 pgtables:60712kB oom_score_adj:0\n",
]


def test_the_kernels_killed_process_line_names_the_rank():
    found = kernel_oom_kills(MEMCG_KILL + GLOBAL_KILL, {18307: 3, 4242: 0, 777: 1}, since_boot_s=100.0)
    assert found == {
        3: "Memory cgroup out of memory: Killed process 18307 (python3) total-vm:528572kB, anon-rss:72192kB, "
           "file-rss:6648kB, shmem-rss:0kB, UID:0 pgtables:212kB oom_score_adj:0",
        0: "Out of memory: Killed process 4242 (python) total-vm:31243520kB, anon-rss:30990336kB, file-rss:1024kB, "
           "shmem-rss:0kB, UID:1000 pgtables:60712kB oom_score_adj:0",
    }


def test_the_oom_kill_line_alone_is_enough_and_records_before_since_and_other_pids_are_not():
    """A ring buffer that lost the `Killed process` line still has `oom-kill:`; a kill logged before the
    node started was another process that had the same pid."""
    assert kernel_oom_kills(MEMCG_KILL[:3], {18307: 2}, 100.0) == {2: MEMCG_KILL[2].split(";", 1)[1].rstrip("\n")}
    assert kernel_oom_kills(MEMCG_KILL, {18307: 2}, since_boot_s=11106.0) == {}
    assert kernel_oom_kills(MEMCG_KILL, {1830: 2, 183070: 1}, since_boot_s=100.0) == {}


def test_a_memory_cgroups_counter_that_grew_names_the_ranks(tmp_path: Path):
    """cgroup v2's memory.events and v1's memory.oom_control, as the kernel writes them."""
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), v1.mkdir()
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 41\noom 1\noom_kill 1\noom_group_kill 0\n")
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert (oom_kill_count(v2), oom_kill_count(v1), oom_kill_count(tmp_path)) == (1, 2, None)
    assert cgroup_oom_kills({101: 0, 102: 1}, {str(v2): 1, str(v1): 2}) == {}
    assert cgroup_oom_kills({101: 0, 102: 1}, {str(v2): 0}) == dict.fromkeys(
        (0, 1), f"memory cgroup {v2}: oom_kill count grew from 0 to 1 (the kernel's log is not readable here)")
