"""The health judgements (harness/health/), from samples and stacks as the agents send them."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

from harness.control.health_loop import HealthLoop
from harness.health.judge import SLOW_CONFIRM, HealthJudge
from harness.health.rank_stack import Collective, Frame, RankStack, StackThread, grouped
from harness.health.rendezvous import rendezvous_verdict
from harness.health.verdict import hang_verdict
from harness.node.protocol import LAUNCHER_RANK, CollectiveArrivals, NodeArrivals, RankSample
from harness.plan.planner import Node

NODES = [Node(host=f"h{i + 1}", address=f"10.0.0.{i + 1}", node_rank=i, nproc=1) for i in range(4)]
SITE = "/venv/lib/python3.11/site-packages"


def feed(watch: HealthJudge, seconds: int, cpu_per_s: dict[int, float], busy_per_s: dict[int, float] | None = None,
         start: float = 0.0, io_per_s: dict[int, int] | None = None) -> None:
    """One sample a second per rank, rank r on node r."""
    for t in range(seconds + 1):
        for rank, rate in cpu_per_s.items():
            busy = (busy_per_s or {}).get(rank, rate)
            io = (io_per_s or {}).get(rank, 0) * (start + t)
            sample = RankSample(100 + rank, "S", rate * (start + t), busy * (start + t), int(io))
            watch.observe(NODES[rank], start + t, {rank: sample})


def test_a_rank_without_cpu_for_the_stall_is_stalled_and_one_that_computes_is_not():
    watch = HealthJudge(stall=10, slow=0)
    feed(watch, 9, {0: 1.0, 1: 0.0})
    assert watch.stalled() == [], "not before the rank has been watched for `stall` seconds"
    feed(watch, 3, {0: 1.0, 1: 0.0}, start=9)
    assert watch.stalled() == [1]


def test_a_little_background_cpu_is_still_no_progress_but_two_percent_is():
    watch = HealthJudge(stall=10, slow=0)
    feed(watch, 12, {0: 0.01, 1: 0.05})
    assert watch.stalled() == [0]


def test_a_rank_that_sleeps_between_collectives_makes_progress_by_its_io():
    watch = HealthJudge(stall=10, slow=0)
    feed(watch, 12, {0: 0.0, 1: 0.0}, io_per_s={0: 4096})
    assert watch.stalled() == [1]


def test_ranks_of_a_node_that_ended_are_not_judged():
    watch = HealthJudge(stall=5, slow=0)
    feed(watch, 8, {0: 0.0, 1: 1.0})
    watch.node_ended(0)
    assert watch.stalled() == []


def test_a_rank_its_peers_wait_for_is_named_after_the_confirmation_and_cleared_when_it_keeps_up():
    watch = HealthJudge(stall=0, slow=20)
    feed(watch, 40, {0: 0.5, 1: 0.5, 2: 0.5}, busy_per_s={0: 0.5, 1: 1.0, 2: 0.5})
    named = [c for now in range(0, int(SLOW_CONFIRM) + 2) for c in watch.slow_changes(float(now))]
    assert named == [(1, 50.0)]
    assert watch.slow_ranks() == {1: 50.0}
    feed(watch, 40, {0: 0.5, 1: 0.5, 2: 0.5}, busy_per_s={0: 0.5, 1: 0.5, 2: 0.5}, start=41)
    later = [c for now in range(100, 100 + int(SLOW_CONFIRM) + 2) for c in watch.slow_changes(float(now))]
    assert later == [(1, None)] and watch.slow_ranks() == {}


def test_equal_ranks_name_nobody():
    watch = HealthJudge(stall=0, slow=20)
    feed(watch, 40, {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}, busy_per_s={0: 0.9, 1: 0.85, 2: 0.95, 3: 0.9})
    assert [c for now in range(60) for c in watch.slow_changes(float(now))] == []


def frame(name: str, file: str, line: int, code: str = "") -> Frame:
    return Frame(name, file, line, code)


IN_ALL_REDUCE = [frame("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 2950, "work.wait()"),
                 frame("_exception_logger.<locals>.wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 81),
                 frame("step", "train.py", 55, "dist.all_reduce(x)"), frame("<module>", "train.py", 70)]
IN_SLEEP = [frame("load_batch", "train.py", 42, "time.sleep(60)"), frame("step", "train.py", 50),
            frame("<module>", "train.py", 70)]


def stack(rank: int, frames: list[Frame], state: str = "S") -> RankStack:
    return RankStack(rank, NODES[rank], 100 + rank, state,
                     (StackThread("MainThread", 100 + rank, tuple(frames), active=False),
                      StackThread("Thread-1 (pin_memory)", 200 + rank,
                                  (frame("wait", "/usr/lib/python3.11/threading.py", 320),), active=False)))


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
        RankStack(1, NODES[1], 301, "S", (StackThread("MainThread", 301, tuple(idle)),)),
        RankStack(1, NODES[1], 302, "S", (StackThread("MainThread", 302, tuple(in_getitem)),))))
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


# --- by collective (Flight Recorder) -----------------------------------------------------------------


def entry(seq: int, op: str = "all_reduce", done: bool = True, group: str = "0") -> Collective:
    return Collective(group, seq, f"gloo:{op}", done, [[100]], seq)


def reached(rank: int, frames: list[Frame], last: int, op: str = "all_reduce", waiting: bool = True) -> RankStack:
    """A rank whose last collective is #last, unfinished where it waits in it."""
    entries = (*(entry(seq) for seq in range(last - 3, last)), entry(last, op, done=not waiting))
    return replace(stack(rank, frames), collectives=entries)


AT_35 = [frame("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 2950),
         frame("sync_metrics", "f.py", 35), frame("<module>", "f.py", 60)]
AT_37 = [frame("broadcast", f"{SITE}/torch/distributed/distributed_c10d.py", 2700),
         frame("sync_metrics", "f.py", 37), frame("<module>", "f.py", 60)]


def test_alike_stacks_name_the_collective_each_rank_waits_in():
    """As `harness stacks` and `harness report` show them: where Flight Recorder was read, each rank's unfinished
    collective."""
    text = grouped([reached(0, IN_ALL_REDUCE, 1043), reached(1, IN_SLEEP, 1042, waiting=False),
                    reached(2, IN_ALL_REDUCE, 1043)])
    assert text.startswith("ranks 0,2: 0 (node0 on h1, pid 100, sleeping, waiting in all_reduce #1043), 2 (node2 on "
                           "h3, pid 102, sleeping, waiting in all_reduce #1043)\n"), text
    assert "\nrank 1: 1 (node1 on h2, pid 101, sleeping)\n" in text, text


def test_by_collective_a_rank_that_has_not_reached_the_others_collective_is_behind():
    stacks = {0: reached(0, IN_ALL_REDUCE, 1043), 1: reached(1, IN_SLEEP, 1042, waiting=False),
              2: reached(2, IN_ALL_REDUCE, 1043), 3: reached(3, IN_ALL_REDUCE, 1043)}
    verdict = hang_verdict(300, stacks, {})
    assert verdict.odd == [1]
    assert verdict.text == ("no progress for 300 s: ranks 0,2,3 wait in all_reduce #1043 at train.py:55 in step; "
                            "rank 1 (node1 on h2) has not reached #1043, at train.py:42 in load_batch: time.sleep(60)")
    again = RankStack.from_answer(1, NODES[1], stacks[1].to_answer())
    assert again == stacks[1], "stacks.json keeps the collectives"


def test_a_mismatch_names_both_sides_whichever_branch_each_rank_took():
    texts = []
    for first, second in ((AT_35, AT_37), (AT_37, AT_35)):
        ops = {id(AT_35): "all_reduce", id(AT_37): "broadcast"}
        stacks = {0: reached(0, first, 17, ops[id(first)]), 1: reached(1, second, 17, ops[id(second)])}
        verdict = hang_verdict(10, stacks, {})
        assert verdict.odd == [0, 1], "both sides, no culprit"
        texts.append(verdict.text)
    assert texts == [
        "no progress for 10 s: collective mismatch at #17: rank 0 in all_reduce at f.py:35 in sync_metrics, rank 1 in "
        "broadcast at f.py:37 in sync_metrics: the program calls different collectives on different ranks",
        "no progress for 10 s: collective mismatch at #17: rank 0 in broadcast at f.py:37 in sync_metrics, rank 1 in "
        "all_reduce at f.py:35 in sync_metrics: the program calls different collectives on different ranks"]


def test_every_rank_in_the_same_unfinished_collective_is_no_rank_behind():
    verdict = hang_verdict(10, {0: reached(0, IN_ALL_REDUCE, 9), 1: reached(1, IN_ALL_REDUCE, 9)}, {})
    assert verdict.odd == []
    assert verdict.text == ("no progress for 10 s: ranks 0,1 wait in all_reduce #9 at train.py:55 in step; no rank is "
                            "behind: the collective itself does not complete (suspect the network between the nodes, "
                            "a peer's host, or a GPU kernel before it that never ends)")


def test_a_rank_still_in_a_collective_its_peer_completed_points_at_the_network_not_at_itself():
    """A partition mid-collective: rank 0 got all of #23 and waits in #24; rank 1 still waits in #23."""
    stacks = {0: reached(0, IN_ALL_REDUCE, 24), 1: reached(1, IN_ALL_REDUCE, 23)}
    verdict = hang_verdict(10, stacks, {})
    assert verdict.odd == []
    assert verdict.text == ("no progress for 10 s: rank 0 waits in all_reduce #24 at train.py:55 in step; rank 1 "
                            "(node1 on h2) waits in all_reduce #23, which rank 0 completed: the rest of its data did "
                            "not arrive (suspect the network between the nodes, or a peer's host)")


def test_where_a_rank_collectives_cannot_be_read_the_stacks_decide_and_the_verdict_says_why():
    unread = replace(stack(1, IN_SLEEP), collectives="its worker server did not answer: Connection refused")
    verdict = hang_verdict(10, {0: reached(0, IN_ALL_REDUCE, 5), 1: unread}, {})
    assert verdict.odd == [1]
    assert verdict.text == ("no progress for 10 s: rank 1 (node1 on h2) at train.py:42 in load_batch: time.sleep(60); "
                            "rank 0 waits in all_reduce at train.py:55 in step (Flight Recorder not read: rank 1: its "
                            "worker server did not answer: Connection refused)")


def test_a_rank_whose_collective_does_not_complete_is_stalled_however_busy_its_cpu():
    watch = HealthJudge(stall=10, slow=0)
    for t in range(13):
        spinning = RankSample(100, "R", 1.0 * t, 1.0 * t, 0, completed=40, pending=float(t))
        completing = RankSample(101, "R", 1.0 * t, 1.0 * t, 0, completed=40 + t, pending=0.05)
        watch.observe(NODES[0], t, {0: spinning})
        watch.observe(NODES[1], t, {1: completing})
        assert watch.stalled() == ([0] if t >= 10 else []), t
    assert watch.views()[0].state == "no progress for 12 s"


def test_the_rank_that_arrives_last_at_its_collectives_is_the_one_its_peers_wait_for():
    watch = HealthJudge(stall=0, slow=20)
    jitter = random.Random(7)
    for step in range(300):  # 30 s, a collective every 0.1 s; rank 2 arrives 60 ms after the others
        if step % 10 >= 4:
            continue  # what the agents read: the recorder's buffer does not reach back to every collective
        for rank in range(4):
            late = 0.06 if rank == 2 else 0.0
            clock = 5.0 * rank  # each host's clock off by seconds: its messages say by how much
            at = int((1000.0 + step * 0.1 + late - clock + jitter.uniform(0, 0.005)) * 1e9)
            watch.arrivals.add(NODES[rank], 1000.0 + step * 0.1 + 0.2,
                               NodeArrivals(1000.0 + step * 0.1 + 0.2 - clock, [CollectiveArrivals("0", step, None, {rank: at})]))
    waited = watch.arrivals.waited([0, 1, 2, 3], 20.0)
    assert 55 <= waited[2] <= 65 and all(waited[r] < 5 for r in (0, 1, 3)), waited
    assert watch.waited() == {}, "no health samples: the live ranks are not known yet"
    feed(watch, 25, {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}, busy_per_s={0: 0.5, 1: 0.5, 2: 0.7, 3: 0.5})
    assert round(dict((m.by, m.percent) for m in watch.measures()[2])["busy"]) == 20 and watch.waited()[2] == (waited[2], "arrival"), "the larger"


def test_a_rank_is_said_once_where_it_waits_in_a_subgroup_and_the_one_it_waits_for_is_behind_there():
    """Ranks 0,1 wait in the default group's #11; rank 2 waits in its pair's (group 2) #11 for rank 3, asleep
    before it: rank 3 is behind in group 2, and rank 2 is not called behind in the default group."""
    pair = [entry(seq, group="2") for seq in range(8, 11)]
    default = [entry(seq) for seq in range(8, 11)]
    stacks = {0: replace(stack(0, IN_ALL_REDUCE), collectives=(*default, entry(11, done=False))),
              1: replace(stack(1, IN_ALL_REDUCE), collectives=(*default, entry(11, done=False))),
              2: replace(stack(2, AT_35), collectives=(*default, *pair, entry(11, done=False, group="2"))),
              3: replace(stack(3, IN_SLEEP), collectives=(*default, *pair))}
    verdict = hang_verdict(10, stacks, {})
    assert verdict.odd == [3]
    assert verdict.text == ("no progress for 10 s: ranks 0,1 wait in all_reduce #11 at train.py:55 in step; rank 2 "
                            "waits in all_reduce #11 of process group 2 at f.py:35 in sync_metrics; rank 3 (node3 on h4) "
                            "has not reached #11 of process group 2, at train.py:42 in load_batch: time.sleep(60)")


def test_ranks_waiting_in_their_first_collective_for_ranks_still_starting_are_not_hung_until_the_rendezvous_ends():
    """At hundreds of nodes the start is spread over more than a short stall: ranks 0 and 1 wait in collective #1
    while rank 2 has not made its process group (unseen, then its recorder unread). Once it has, a rank stuck
    before #1 is a hang again after `stall`; and past `startup` seconds the wait is one anyway."""
    def waiting(t: int, completed: int = 0) -> RankSample:
        return RankSample(100, "S", 0.0, 0.0, 0, completed=completed, pending=float(t))

    watch = HealthJudge(stall=10, slow=0, world_size=3, startup=60)
    for t in range(13):
        watch.observe(NODES[0], t, {0: waiting(t)})
        watch.observe(NODES[1], t, {1: waiting(t)})
    assert watch.stalled() == [], "rank 2 unseen: the job is starting"
    for t in range(13, 25):
        for rank in (0, 1):
            watch.observe(NODES[rank], t, {rank: waiting(t)})
        watch.observe(NODES[2], t, {2: RankSample(102, "R", float(t), float(t), 0)})  # importing, say
    assert watch.stalled() == [], "rank 2 seen, its process group not made yet"
    for t in range(25, 27):
        for rank in (0, 1, 2):
            watch.observe(NODES[rank], t, {rank: waiting(t, completed=0)})
    assert watch.stalled() == [0, 1], "every rank made its process group: 0 and 1 waited past the stall"
    late = HealthJudge(stall=10, slow=0, world_size=3, startup=20)
    for t in range(22):
        late.observe(NODES[0], t, {0: waiting(t)})
    assert late.stalled() == [0], "past the rendezvous's time the wait is a hang whoever is missing"


def test_ranks_that_made_progress_while_their_stacks_were_read_are_not_hung():
    """The capture takes seconds (a minute for 1,024 ranks on 2 cores); the agents' samples come in meanwhile. A
    rank judged stalled whose collectives completed in that time was starting slowly: said, and nothing stopped."""
    watch = HealthJudge(stall=10, slow=0)
    feed(watch, 12, {0: 0.0, 1: 0.0})
    said: list[str] = []

    tags: list[str] = []

    class Capture:
        def capture(self, tag: str) -> dict:
            tags.append(tag)
            for t in (12, 13):  # the supervisor's threads go on feeding the judge meanwhile
                for rank in (0, 1):
                    watch.observe(NODES[rank], t, {rank: RankSample(100, "S", 0.0, 0.0, 0, completed=t)})
            return {}

    class Stopper:
        def stop_all(self) -> None:
            raise AssertionError("a job that made progress was stopped")

    loop = HealthLoop(watch, None, 0, [], Capture(), SimpleNamespace(say=said.append), Stopper())
    loop._hung(watch.stalled())
    assert said[-1] == "ranks 0,1 made progress while their stacks were read: not hung", said
    assert loop.hang is None and loop.hang_at is None
    loop._hung([0, 1])
    assert tags == ["hang-0-1", "hang-0-2"], "late answers to the first capture must not count for the next"


def test_a_rendezvous_past_its_deadline_names_the_nodes_not_waiting_in_it_and_where_their_torchrun_is():
    """node1's torchrun stopped in an import, node2's agent silent: they are the ones the others wait for; node0's
    torchrun waits in the rendezvous and is not named at fault. Where every late node waits in it, none can be told
    apart: all are named."""
    def launcher(node: int, state: str, *frames: Frame) -> RankStack:
        thread = StackThread("MainThread", 50 + node, frames)
        return RankStack(LAUNCHER_RANK, NODES[node], 50 + node, state, (thread,),
                         command="/venv/bin/python -m torch.distributed.run --nnodes=3 train.py")

    waiting = launcher(0, "S", Frame("_barrier", f"{SITE}/torch/distributed/elastic/utils/store.py", 170),
                       Frame("next_rendezvous", f"{SITE}/torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py",
                             60))
    importing = launcher(1, "T", Frame("_find_and_load", "<frozen importlib._bootstrap>", 1176),
                         Frame("<module>", f"{SITE}/torch/nn/__init__.py", 3),
                         Frame("_call_with_frames_removed", "<frozen importlib._bootstrap>", 241),
                         Frame("<module>", f"{SITE}/torch/__init__.py", 2100))
    verdict = rendezvous_verdict(30, NODES[:3], {0: waiting, 1: importing}, joined=1)
    assert verdict.text == (
        "the rendezvous did not complete within 30 s (timeouts.rendezvous): node1 on h2 never joined: its torchrun "
        "(pid 51) is stopped (SIGSTOP), in an import at torch/nn/__init__.py:3; node2 on h3 never joined, and its node "
        "agent did not say where its torchrun is; node0 waiting for it in the rendezvous; 1 node(s) started their ranks")
    assert (verdict.late, verdict.culprits) == ([0, 1, 2], [1, 2])
    everyone = rendezvous_verdict(30, NODES[:1], {0: waiting}, joined=0)
    assert everyone.culprits == [0] and "node0 on h1 never joined: its torchrun (pid 50) is sleeping, waiting in the " \
        "rendezvous at torch/distributed/elastic/utils/store.py:170 in _barrier" in everyone.text
