"""The health watch's judgements (harness/run/health.py), from samples and stacks as the agents send them."""

from __future__ import annotations

from harness.node.protocol import RankSample
from harness.plan.planner import Node
from harness.run.health import SLOW_CONFIRM, HealthWatch, RankStack, grouped, hang_verdict

NODES = [Node(host=f"h{i + 1}", address=f"10.0.0.{i + 1}", node_rank=i, nproc=1) for i in range(4)]
SITE = "/venv/lib/python3.11/site-packages"


def feed(watch: HealthWatch, seconds: int, cpu_per_s: dict[int, float], busy_per_s: dict[int, float] | None = None,
         start: float = 0.0, io_per_s: dict[int, int] | None = None) -> None:
    """One sample a second per rank, rank r on node r."""
    for t in range(seconds + 1):
        for rank, rate in cpu_per_s.items():
            busy = (busy_per_s or {}).get(rank, rate)
            io = (io_per_s or {}).get(rank, 0) * (start + t)
            sample = RankSample(100 + rank, "S", rate * (start + t), busy * (start + t), int(io))
            watch.observe(NODES[rank], start + t, {rank: sample})


def test_a_rank_without_cpu_for_the_stall_is_stalled_and_one_that_computes_is_not():
    watch = HealthWatch(stall=10, slow=0)
    feed(watch, 9, {0: 1.0, 1: 0.0})
    assert watch.stalled() == [], "not before the rank has been watched for `stall` seconds"
    feed(watch, 3, {0: 1.0, 1: 0.0}, start=9)
    assert watch.stalled() == [1]


def test_a_little_background_cpu_is_still_no_progress_but_two_percent_is():
    watch = HealthWatch(stall=10, slow=0)
    feed(watch, 12, {0: 0.01, 1: 0.05})
    assert watch.stalled() == [0]


def test_a_rank_that_sleeps_between_collectives_makes_progress_by_its_io():
    watch = HealthWatch(stall=10, slow=0)
    feed(watch, 12, {0: 0.0, 1: 0.0}, io_per_s={0: 4096})
    assert watch.stalled() == [1]


def test_ranks_of_a_node_that_ended_are_not_judged():
    watch = HealthWatch(stall=5, slow=0)
    feed(watch, 8, {0: 0.0, 1: 1.0})
    watch.node_ended(0)
    assert watch.stalled() == []


def test_a_rank_its_peers_wait_for_is_named_after_the_confirmation_and_cleared_when_it_keeps_up():
    watch = HealthWatch(stall=0, slow=20)
    feed(watch, 40, {0: 0.5, 1: 0.5, 2: 0.5}, busy_per_s={0: 0.5, 1: 1.0, 2: 0.5})
    named = [c for now in range(0, int(SLOW_CONFIRM) + 2) for c in watch.slow_changes(float(now))]
    assert named == [(1, 50.0)]
    assert watch.slow_ranks() == {1: 50.0}
    feed(watch, 40, {0: 0.5, 1: 0.5, 2: 0.5}, busy_per_s={0: 0.5, 1: 0.5, 2: 0.5}, start=41)
    later = [c for now in range(100, 100 + int(SLOW_CONFIRM) + 2) for c in watch.slow_changes(float(now))]
    assert later == [(1, None)] and watch.slow_ranks() == {}


def test_equal_ranks_name_nobody():
    watch = HealthWatch(stall=0, slow=20)
    feed(watch, 40, {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}, busy_per_s={0: 0.9, 1: 0.85, 2: 0.95, 3: 0.9})
    assert [c for now in range(60) for c in watch.slow_changes(float(now))] == []


def frame(name: str, file: str, line: int, code: str = "") -> dict:
    return {"name": name, "file": file, "line": line, "code": code}


IN_ALL_REDUCE = [frame("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 2950, "work.wait()"),
                 frame("_exception_logger.<locals>.wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 81),
                 frame("step", "train.py", 55, "dist.all_reduce(x)"), frame("<module>", "train.py", 70)]
IN_SLEEP = [frame("load_batch", "train.py", 42, "time.sleep(60)"), frame("step", "train.py", 50),
            frame("<module>", "train.py", 70)]


def stack(rank: int, frames: list[dict], state: str = "S") -> RankStack:
    return RankStack(rank, NODES[rank], 100 + rank, state,
                     [{"name": "MainThread", "tid": 100 + rank, "active": False, "frames": frames},
                      {"name": "Thread-1 (pin_memory)", "tid": 200 + rank, "active": False,
                       "frames": [frame("wait", "/usr/lib/python3.11/threading.py", 320)]}])


def test_the_verdict_names_the_rank_outside_the_collective_and_where_the_others_wait():
    stacks = {0: stack(0, IN_ALL_REDUCE), 1: stack(1, IN_SLEEP), 2: stack(2, IN_ALL_REDUCE), 3: stack(3, IN_ALL_REDUCE)}
    verdict = hang_verdict(300, stacks, {})
    assert verdict.odd == [1]
    assert verdict.text == ("no progress for 300 s: rank 1 (node1 on h2) at train.py:42 in load_batch: time.sleep(60); "
                            "ranks 0,2,3 wait in all_reduce at train.py:55 in step")


def test_a_stopped_rank_and_an_ended_node_are_the_odd_ones_even_inside_a_collective():
    stacks = {0: stack(0, IN_ALL_REDUCE), 1: stack(1, IN_ALL_REDUCE, state="T")}
    verdict = hang_verdict(10, stacks, {2: (NODES[2], "exit code 0")})
    assert verdict.odd == [1, 2]
    assert verdict.text == ("no progress for 10 s: rank 1 (node1 on h2) is stopped (SIGSTOP) in all_reduce at "
                            "train.py:55 in step; rank 2 (node2 on h3) had ended (exit code 0); rank 0 waits in "
                            "all_reduce at train.py:55 in step")


def test_every_rank_in_the_same_collective_points_at_the_network():
    verdict = hang_verdict(10, {0: stack(0, IN_ALL_REDUCE), 1: stack(1, IN_ALL_REDUCE)}, {})
    assert verdict.odd == []
    assert verdict.text.endswith("ranks 0,1 wait in all_reduce at train.py:55 in step; no rank is behind the others: "
                                 "suspect the network between the nodes, or a peer's host")


def test_ranks_in_different_collectives_are_a_mismatch_and_a_minority_is_named():
    barrier = [frame("barrier", f"{SITE}/torch/distributed/distributed_c10d.py", 4800), frame("<module>", "train.py", 80)]
    tie = hang_verdict(10, {0: stack(0, IN_ALL_REDUCE), 1: stack(1, barrier)}, {})
    assert tie.odd == [1], "rank 1 got past the all_reduce rank 0 waits in: it skipped it"
    assert tie.text == ("no progress for 10 s: rank 1 waits in barrier at train.py:80 in <module>; rank 0 waits in "
                        "all_reduce at train.py:55 in step; the ranks wait in different collectives, and rank 1 got "
                        "further in <module> (train.py:80, the others at :70): it likely skipped a collective the "
                        "others wait in (or the others call one it does not)")
    unordered = [frame("barrier", f"{SITE}/torch/distributed/distributed_c10d.py", 4800), frame("finish", "train.py", 90),
                 frame("<module>", "train.py", 70)]
    same_line = hang_verdict(10, {0: stack(0, IN_ALL_REDUCE), 1: stack(1, unordered)}, {})
    assert same_line.odd == [] and same_line.text.endswith("the program calls them in a different order on "
                                                           "different ranks"), same_line.text
    three = hang_verdict(10, {0: stack(0, IN_ALL_REDUCE), 1: stack(1, barrier), 2: stack(2, IN_ALL_REDUCE)}, {})
    assert three.odd == [1] and three.text.startswith("no progress for 10 s: rank 1 waits in barrier at train.py:80")


def test_a_rank_waiting_for_its_stuck_dataloader_worker_names_the_worker_and_where_it_is():
    waiting = [frame("wait", "/usr/lib/python3.11/threading.py", 331),
               frame("_try_get_data", f"{SITE}/torch/utils/data/dataloader.py", 1133),
               frame("__next__", f"{SITE}/torch/utils/data/dataloader.py", 733),
               frame("<module>", "dlhang.py", 23, "for batch in loader:")]
    in_getitem = [frame("__getitem__", "dlhang.py", 16, "time.sleep(3600)"),
                  frame("fetch", f"{SITE}/torch/utils/data/_utils/fetch.py", 52),
                  frame("_worker_loop", f"{SITE}/torch/utils/data/_utils/worker.py", 349)]
    idle = [frame("get", "/usr/lib/python3.11/multiprocessing/queues.py", 113),
            frame("_worker_loop", f"{SITE}/torch/utils/data/_utils/worker.py", 309)]
    rank1 = stack(1, waiting)
    rank1 = RankStack(1, NODES[1], 101, "S", rank1.threads, workers=(
        RankStack(1, NODES[1], 301, "S", [{"name": "MainThread", "tid": 301, "frames": idle}]),
        RankStack(1, NODES[1], 302, "S", [{"name": "MainThread", "tid": 302, "frames": in_getitem}])))
    verdict = hang_verdict(10, {0: stack(0, IN_ALL_REDUCE), 1: rank1}, {})
    assert verdict.odd == [1]
    assert verdict.text == ("no progress for 10 s: rank 1's DataLoader worker 1 (node1 on h2, pid 302) at dlhang.py:16 "
                            "in __getitem__: time.sleep(3600); rank 0 waits in all_reduce at train.py:55 in step")
    text = rank1.text()
    assert "rank 1's DataLoader worker 1, pid 302, sleeping\n" in text and "        time.sleep(3600)" in text
    assert RankStack.from_answer(1, NODES[1], rank1.to_answer()) == rank1, "stacks.json keeps the workers"


def test_a_rank_whose_stack_could_not_be_read_says_why():
    unread = RankStack(0, NODES[0], 100, "S", None, "Permission denied (os error 13)")
    assert unread.where() == "(no stack: Permission denied (os error 13))"
    assert RankStack.from_answer(0, NODES[0], unread.to_answer()) == unread
    assert "stacks unavailable: Permission denied" in unread.text()


def test_alike_stacks_are_shown_once_with_every_rank_they_stand_for():
    text = grouped([stack(0, IN_ALL_REDUCE), stack(1, IN_SLEEP), stack(2, IN_ALL_REDUCE)])
    assert text.count("all_reduce (torch/distributed/distributed_c10d.py:2950)") == 1
    assert text.count("load_batch (train.py:42)") == 1
    assert text.startswith("ranks 0,2: 0 (node0 on h1, pid 100, sleeping), 2 (node2 on h3, pid 102, sleeping)\n")
    assert "        time.sleep(60)" in text
