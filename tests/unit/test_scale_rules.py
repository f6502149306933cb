"""One controller for thousands of nodes (issue 71): the messages it takes a second stay bounded whatever the job's
size -- the agents sample less often in a job of many nodes (protocol.paced) and send a node's arrivals in one
message, not one per rank -- and its listeners spend nothing while their nodes are quiet; what the judge works out
from every rank is worked out once, not at every look."""

from __future__ import annotations

import io
import json
import queue
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import pytest

from harness.control.live import LiveNode
from harness.control.supervisor import Supervisor, heard_as
from harness.control.terminal import Terminal
from harness.health.arrivals import Arrivals, _median
from harness.health.judge import HealthJudge
from harness.node.collectives import DIGEST_SLACK, WAITING_SECONDS, ArrivalsDigest
from harness.node.protocol import (
    CLOCK_PINGS,
    HEALTH_MESSAGES_PER_SECOND,
    YOUNG_SECONDS,
    Arrival,
    CollectiveArrivals,
    ControllerClock,
    Kind,
    Message,
    NodeArrivals,
    RankSample,
    StackChunks,
    alike_answers,
    answers_of,
    arrivals_bodies,
    health_bodies,
    message_line,
    paced,
    parse_arrivals,
    parse_health,
    sample_interval,
    split_line,
    stacks_bodies,
)
from harness.node.ranks import ProgressWatch
from harness.plan.planner import Node
from harness.spec.job import Health
from harness.targets.base import Messages, Outcome

PIPE_BUF = 4096
STALL = 30.0
SAMPLE = Health(stall=STALL).sample_seconds  # 1.5 s


@pytest.mark.parametrize(("nodes", "young", "steady"), [
    (16, 1.0, SAMPLE), (256, 1.0, SAMPLE), (2048, 2048 / 500, 2048 / 500), (10_000, 20.0, 20.0)])
def test_a_job_of_many_nodes_is_sampled_less_often_and_its_controller_takes_a_bounded_number_of_samples(
        nodes: int, young: float, steady: float) -> None:
    """Up to 500 nodes the spec's interval (and a second while the attempt is young); beyond, nodes / 500 s: the
    controller takes at most HEALTH_MESSAGES_PER_SECOND health messages a second (one a sample from a node of up to
    SAMPLES_PER_LINE ranks), whatever the attempt's age."""
    assert sample_interval(SAMPLE, 0.0, nodes) == pytest.approx(young)
    assert sample_interval(SAMPLE, YOUNG_SECONDS, nodes) == pytest.approx(steady)
    assert paced(SAMPLE, nodes) == pytest.approx(steady)
    for age in (0.0, YOUNG_SECONDS / 2, YOUNG_SECONDS, 3600.0):
        lines = len(health_bodies(0.0, {rank: RankSample(rank, "R", 0.0, 0.0, 0) for rank in range(8)}))
        assert nodes * lines / sample_interval(SAMPLE, age, nodes) <= HEALTH_MESSAGES_PER_SECOND * 1.000001


def test_at_2048_nodes_the_stall_still_spans_several_samples() -> None:
    """health.stall 30 at 2,048 nodes: one sample every 4.1 s, 7 in a stall (the judge's rules judge by time;
    these are what it has to judge by)."""
    assert STALL / paced(SAMPLE, 2048) > 7
    assert Health().stall / paced(Health().sample_seconds, 2048) >= 20, "the default stall: as before, 20 samples"


@pytest.mark.parametrize("nodes", [16, 2048])
@pytest.mark.parametrize("stops_at", [100.0, 100.0 + 0.01, 100.0 + 2.0])
def test_a_hang_is_found_within_the_stall_and_two_intervals_of_its_last_progress(nodes: int, stops_at: float) -> None:
    """A rank that stops using CPU at stops_at, sampled every paced interval: the judge names it no sooner than
    the stall after, and at the latest by the stall and two intervals (the interval it stopped in still shows
    progress, and the stall ends at most one interval before a sample); the health loop asks half a second later."""
    interval = paced(SAMPLE, nodes)
    judge = HealthJudge(stall=STALL, slow=0)
    node = Node(host="h1", address="10.0.0.1", node_rank=0, nproc=1)
    found = None
    for k in range(int(400 / interval)):
        t = k * interval
        judge.observe(node, t, {0: RankSample(100, "S", min(t, stops_at), 0.0, 0)})
        if judge.stalled():
            found = t
            break
    assert found is not None
    assert STALL <= found - stops_at <= STALL + 2 * interval


@pytest.mark.parametrize("nodes", [16, 2048])
def test_a_rank_stuck_in_a_collective_is_found_within_the_stall_and_one_interval(nodes: int) -> None:
    """An NCCL rank spins while it waits: its collective's wait (pending, by its agent) is what shows the hang."""
    interval, stuck_at = paced(SAMPLE, nodes), 100.3
    judge = HealthJudge(stall=STALL, slow=0)
    node = Node(host="h1", address="10.0.0.1", node_rank=0, nproc=1)
    found = None
    for k in range(int(400 / interval)):
        t = k * interval
        waited = t - stuck_at if t >= stuck_at else -1.0
        judge.observe(node, t, {0: RankSample(100, "R", t, t, 0, completed=int(min(t, stuck_at)), pending=waited)})
        if judge.stalled():
            found = t
            break
    assert found is not None and STALL <= found - stuck_at <= STALL + interval


def test_a_nodes_collectives_travel_in_few_lines_within_pipe_buf_and_come_back_whole() -> None:
    """Each line one write(2) within PIPE_BUF (no rank's output can split it), however many collectives and named
    ranks; parsed, every collective is back in order, with the sample's time and the node's clock."""
    said = [CollectiveArrivals(f"group-{seq % 3}-{'x' * (seq % 40)}", seq, None if seq % 7 == 0 else 1_700_000_000 * 10**9 + seq,
                       {rank: 1_700_000_000 * 10**9 + seq * rank for rank in range(1 + seq % 20)}) for seq in range(200)]
    bodies = arrivals_bodies(1234.5, said, ahead=-3.25)
    lines = [message_line(Kind.ARRIVALS, body) for body in bodies]
    assert len(lines) > 1 and max(len(line) for line in lines) <= PIPE_BUF
    back = [parse_arrivals(body) for body in bodies]
    assert {(one.t, one.ahead) for one in back} == {(1234.5, -3.25)}
    assert [c for one in back for c in one.collectives] == said


def test_a_node_of_eight_ranks_says_a_samples_collectives_in_one_message_and_none_without_any() -> None:
    digest = ArrivalsDigest()
    said = digest.add(range(8), {rank: [Arrival("0", seq, seq * 10**8 + rank) for seq in range(3)]
                                 for rank in range(8)}, 10**9)
    assert [(c.seq, c.at) for c in said] == [(0, 3), (1, 10**8 + 3), (2, 2 * 10**8 + 3)]
    assert len(arrivals_bodies(1.0, said)) == 1
    assert arrivals_bodies(1.0, []) == arrivals_bodies(1.0, digest.add(range(8), {}, 10**9)) == []


def test_a_node_names_the_ranks_that_straggled_and_says_the_rest_as_one_time() -> None:
    """A collective is said once every rank of the node arrived at it. Its first of a group names every rank not at
    the node's (low) median; after it, a rank is named where it is further from it than DIGEST_SLACK of the node's
    time between collectives: rank 5, 0.3 s late every 1 s, and rank 2 just once, not those a few ms off."""
    digest, said = ArrivalsDigest(), []
    for seq in range(6):
        t = int((1000 + seq) * 1e9)
        late = {5: 300_000_000, 2: 50_000_000 if seq == 4 else 0}
        arrived = {rank: [Arrival("0", seq, t + late.get(rank, 0) + rank * 1_000_000)] for rank in range(8) if rank != 5}
        said += digest.add(range(8), arrived, t)
        assert all(c.seq < seq for c in said), "not before rank 5 arrived"
        said += digest.add(range(8), {5: [Arrival("0", seq, t + late[5])]}, t + late[5])
        assert said[-1].seq == seq
    first, *rest = said
    assert first.at == int(1000e9) + 3_000_000 and sorted(first.named) == [0, 1, 2, 4, 5, 6, 7]
    assert [sorted(c.named) for c in rest] == [[5], [5], [5], [2, 5], [5]]
    assert rest[0].named[5] == int(1001.3e9)


def test_a_collective_not_every_rank_of_the_node_arrives_at_is_let_go() -> None:
    """One of a group of some of the node's ranks, once WAITING_SECONDS old; one that a later collective of its
    group, complete, left behind (the recorder dropped a rank's arrival), at once."""
    digest = ArrivalsDigest()
    assert digest.add(range(4), {0: [Arrival("pairs", 0, 0)], 1: [Arrival("pairs", 0, 0)],
                                  2: [Arrival("0", 1, 0)], 3: [Arrival("0", 1, 0)]}, 0) == []
    assert [c.seq for c in digest.add(range(4), {r: [Arrival("0", 2, 10)] for r in range(4)}, 10)] == [2]
    late = digest.add(range(4), {0: [Arrival("0", 1, 5)], 1: [Arrival("0", 1, 5)]}, 20)
    assert late == [] and list(digest._waiting) == [("pairs", 0)]
    digest.add(range(4), {}, int(WAITING_SECONDS * 1e9) + 1)
    assert digest._waiting == {}


@pytest.mark.parametrize("seed", range(10))
def test_the_nodes_digests_weigh_every_rank_as_its_own_arrivals_do(seed: int) -> None:
    """4 nodes of 8 ranks, each rank a few ms off its node's, rank 13 late by 10-40% of every stretch and node 2
    late as a whole: the wait of each rank from what the nodes say (one time a node, and its stragglers) is its wait
    from every rank's own arrivals (as an agent of an older harness says them), within DIGEST_SLACK; and a
    collective keeps a time for each node and straggler, not for each rank."""
    rng = random.Random(seed)
    nodes = [Node(host=f"h{n}", address=f"10.0.0.{n}", node_rank=n, nproc=8) for n in range(4)]
    by_digest, by_rank = Arrivals(horizon=40.0), Arrivals(horizon=40.0)
    digests = {node.node_rank: ArrivalsDigest() for node in nodes}
    for step in range(80):
        t = 1000.0 + step * 0.5
        for node in nodes:
            behind = 0.1 if node.node_rank == 2 else 0.0
            arrived = {rank: [Arrival("0", step, int((t + behind + rng.uniform(0, 0.002)
                                                      + (rng.uniform(0.05, 0.2) if rank == 13 else 0)) * 1e9))]
                       for rank in node.ranks}
            by_digest.add(node, t + 0.6, NodeArrivals(t + 0.6, digests[node.node_rank].add(node.ranks, arrived, 0)))
            by_rank.add(node, t + 0.6, NodeArrivals(t + 0.6, [CollectiveArrivals("0", step, None, {rank: ns})
                                                              for rank, items in arrived.items()
                                                              for _, _, ns in items]))
    live = list(range(32))
    exact, digested = by_rank.waited(live, 20.0), by_digest.waited(live, 20.0)
    assert max(exact, key=exact.get) == max(digested, key=digested.get) == 13 and exact[13] > 20
    assert min(exact[rank] for rank in nodes[2].ranks) > 15, "node 2's ranks all late"
    assert all(abs(digested[rank] - exact[rank]) <= 100 * DIGEST_SLACK for rank in live), (exact, digested)
    kept = [len(entry.named) + (entry.at is not None) for entry in by_digest.seen["0", 70].values()]
    assert sum(kept) <= len(nodes) + 8, kept


def test_the_median_of_ranks_said_together_is_the_median_of_each_rank() -> None:
    rng = random.Random(7)
    for _ in range(200):
        groups = [(round(rng.uniform(0, 5), 1), tuple(range(rng.randint(1, 4)))) for _ in range(rng.randint(1, 9))]
        assert _median(groups) == statistics.median(when for when, ranks in groups for _ in ranks), groups


@pytest.mark.parametrize("body", [
    "", "not json", "null", "[1, 2]", "{}", '{"t": 1}', '{"ranks": {}}', '{"t": "soon", "ranks": {}}',
    '{"t": 1, "ranks": [[0, []]]}', '{"t": 1, "ranks": {"zero": []}}', '{"t": 1, "ranks": {"0": 5}}',
    '{"t": 1, "ranks": {"0": [["g", 1]]}}', '{"t": 1, "ranks": {"0": [["g", "one", 2]]}}',
    '{"t": 1, "ranks": {"0": [null]}}', '{"t": 1, "ahead": "late", "ranks": {}}', '{"t": 1, "collectives": 5}',
    '{"t": 1, "collectives": [["g", 1, 5]]}', '{"t": 1, "collectives": [["g", 1, 5, []]]}',
    '{"t": 1, "collectives": [["g", "x", 5, {}]]}', '{"t": 1, "collectives": [["g", 1, 5, {"r": 1}]]}',
    '{"t": 1, "collectives": [["g", 1, "soon", {}]]}', '{"t": 1, "collectives": [["g", 1, 5, {"0": null}]]}',
    '{"t": 1, "collectives": [["g", 1, null, {}]]}', '{"t": 1, "collectives": [["g", 1.5, 5, {}]]}',
    '{"t": 1, "collectives": [["g", 1, null, {"0": 1.5}]]}'])
def test_a_damaged_arrivals_message_is_refused_as_the_listener_expects(body: str) -> None:
    """The listener drops a message that raises ValueError, KeyError or TypeError: anything else would end it."""
    with pytest.raises((ValueError, KeyError, TypeError)):
        parse_arrivals(body)


@dataclass
class QuietNode:
    """A NodeProcess that ends when told; what it said before its supervisor started is in its own queue."""

    node: Node
    messages: Messages = field(default_factory=queue.Queue)
    end: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> Outcome:
        self.end.wait()
        return Outcome(exit_code=0)


def test_one_listener_waits_for_every_node_s_messages_without_polling_and_takes_every_one_said_before_their_end(
        ) -> None:
    """No thread per node: one listener takes the messages of every node (those a node said before the supervisor
    took it first: a standby's STARTED), waiting once a message, and ends once every node has ended."""
    nodes = [Node(host=f"h{n}", address=f"10.0.0.{n}", node_rank=n, nproc=2) for n in range(2)]
    judge = HealthJudge(stall=STALL, slow=0)
    supervisor = Supervisor(1.0, Terminal(io.StringIO()), judge=judge)
    gets = 0
    take = supervisor._heard.get

    def counted(block: bool = True, timeout: float | None = None) -> tuple[Any, LiveNode, Message]:
        nonlocal gets
        gets += 1
        return take(block, timeout)

    supervisor._heard.get = counted  # type: ignore[method-assign]
    processes = [QuietNode(node) for node in nodes]
    processes[1].messages.put(Message(Kind.STARTED, "2,3"))
    lives = [LiveNode(node, started=time.time()) for node in nodes]
    supervisor.nodes += lives
    for process, live in zip(processes, lives, strict=True):
        process.messages = heard_as(process, live, supervisor._heard)
    listener = threading.Thread(target=supervisor._listen, args=(2,), daemon=True)
    listener.start()
    deadline = time.monotonic() + 5
    while lives[1].ranks_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lives[1].ranks_at is not None, "what node 1 said before it was routed is taken"
    time.sleep(0.5)
    assert gets == 2, "quiet nodes' listener waits once, woken by nothing"
    for node, process in enumerate(processes):
        for t in range(50):
            ranks = {str(2 * node): [100, "R", t, t, 0], str(2 * node + 1): [101, "R", t, t, 0]}
            process.messages.put(Message(Kind.HEALTH, json.dumps({"t": t, "ranks": ranks})))
    arrived = arrivals_bodies(time.time(), [CollectiveArrivals("0", 1, time.time_ns(), {1: time.time_ns()})])
    processes[0].messages.put(Message(Kind.ARRIVALS, arrived[0]))
    for process, live in zip(processes, lives, strict=True):
        process.end.set()
        supervisor._reap(process, live)
    listener.join(5)
    assert not listener.is_alive(), "it ends once every node has ended and all they said is taken"
    assert gets == 1 + 2 * 50 + 1 + 2, "one wait a message, and one for each node's end"
    assert {rank: len(kept.samples) for rank, kept in judge.ranks.items()} == {0: 50, 1: 50, 2: 50, 3: 50}
    assert list(judge.arrivals.seen) == [("0", 1)] and list(judge.arrivals.seen["0", 1][0].named) == [1]


def _walked(samples: list[RankSample], times: list[float], stall: float) -> tuple[bool, float]:
    """What the judge said before it kept each rank's newest progress: a walk over every sample -- stalled (no
    progress in any interval of the last stall seconds, or a collective stuck that long) and idle seconds (since its
    newest progress, however long ago)."""
    kept = list(zip(times, samples, strict=True))
    last_t, last = kept[-1]
    stuck = last.pending >= stall and last.completed >= 0 and \
        all(s.completed == last.completed for t, s in kept if t >= last_t - stall)
    moved = [tb for (ta, a), (tb, b) in pairwise(kept)
             if b.cpu - a.cpu > 0.02 * (tb - ta) or b.io != a.io or b.completed > a.completed]
    since = max((i for i, (t, _) in enumerate(kept) if t <= last_t - stall), default=None)
    quiet = since is not None and not [t for t in moved if t > kept[since][0]]
    return stuck or quiet, max(last_t - (moved[-1] if moved else kept[0][0]), last.pending)


@pytest.mark.parametrize("seed", range(40))
def test_a_rank_is_judged_from_its_newest_progress_as_from_a_walk_over_its_samples(seed: int) -> None:
    """Each tick looks at a rank in the same time however many samples it keeps; what it finds is what the walk over
    every sample found: random courses of progress, idleness and stuck collectives, judged after every sample -- by
    the rank's agent (its idle and still seconds said with each sample, node.ranks.ProgressWatch) and, for an agent that says
    neither (an older harness), by the controller alike."""
    rng = random.Random(seed)
    judge, told = HealthJudge(stall=STALL, slow=0), HealthJudge(stall=STALL, slow=0)
    agent = ProgressWatch()
    node = Node(host="h1", address="10.0.0.1", node_rank=0, nproc=1)
    t, cpu, io_bytes, completed, waited_since = 0.0, 0.0, 0, 0, None
    taken: list[RankSample] = []
    times: list[float] = []
    for _ in range(120):
        t += rng.choice([0.5, 1.0, 1.5, 4.1])
        moves = rng.random() < 0.3
        cpu += rng.choice([0.5, 0.01]) if moves else 0.0
        io_bytes += 100 if moves and rng.random() < 0.5 else 0
        if rng.random() < 0.2:
            completed += 1
        waited_since = None if rng.random() < 0.15 else (waited_since if waited_since is not None else t)
        sample = RankSample(7, "S", cpu, cpu, io_bytes, completed, t - waited_since if waited_since is not None else -1)
        judge.observe(node, t, {0: sample})
        told.observe(node, t, agent.judged(t, {0: sample}))
        taken.append(sample)
        times.append(t)
        stalled, idle = _walked(taken, times, STALL)
        assert (judge.stalled() == [0]) == stalled, (seed, t)
        assert (told.stalled() == [0]) == stalled, (seed, t)
        if len(taken) >= 2:
            assert judge.views()[0].idle == pytest.approx(idle), (seed, t)
            assert told.views()[0].idle == pytest.approx(idle, abs=0.001), (seed, t)
    assert not told.unjudged and judge.unjudged, "said by the agent, the controller judges no rank's progress itself"


def test_of_16384_ranks_a_tick_looks_only_at_the_one_that_may_be_hung() -> None:
    """2,048 nodes of 8 ranks, sampled by their agents every paced interval, one rank stopping: what a tick looks at
    (the judge's suspects) is that rank alone, and it is found within the stall and two intervals of its stop."""
    nodes = [Node(host=f"h{n}", address=f"10.0.{n // 256}.{n % 256}", node_rank=n, nproc=8) for n in range(2048)]
    agents = [ProgressWatch() for _ in nodes]
    judge = HealthJudge(stall=STALL, slow=0)
    interval, stops_at, hung = paced(SAMPLE, len(nodes)), 20.0, 16_383
    found = None
    for k in range(int(120 / interval)):
        t = k * interval
        for node, agent in zip(nodes, agents, strict=True):
            samples = {rank: RankSample(rank, "S", min(t, stops_at) if rank == hung else t, 0.0, 0)
                       for rank in node.ranks}
            judge.observe(node, t, agent.judged(t, samples))
        assert judge.suspects <= {hung}
        if judge.stalled():
            found = t
            break
    assert judge.stalled() == [hung] and found is not None
    assert STALL <= found - stops_at <= STALL + 2 * interval


def test_a_health_line_of_the_largest_numbers_stays_within_pipe_buf() -> None:
    """Every field of every rank at its widest (a long run's CPU seconds and I/O bytes, a GPU's memory, ranks of six
    digits): each line is still one write(2) within PIPE_BUF, and every sample comes back whole."""
    widest = RankSample(4_194_303, "R", 123456.78, 123456.789, 10**13, 10**7, 12345.67, 800.5, 150 << 30,
                        123456.789, 123456.789)
    samples = {rank: widest for rank in range(100_000, 100_100)}
    lines = [message_line(Kind.HEALTH, body) for body in health_bodies(1_764_758_400.123456, samples)]
    assert max(len(line) for line in lines) <= PIPE_BUF
    back = {}
    for line in lines:
        _, message = split_line(line)
        assert message is not None
        back.update(parse_health(message.body).samples)
    assert back == samples


@pytest.mark.parametrize("seed", range(20))
def test_what_the_arrivals_keep_between_looks_gives_what_a_fresh_look_at_them_gives(seed: int) -> None:
    """Each collective's lateness is worked out once and kept; an arrival at it or at the next one, a collective let
    go past the horizon and a change of the live ranks all undo what was kept: after each message, the kept
    Arrivals and one fed the same messages anew judge alike (random courses: stragglers, resent and late words)."""
    rng = random.Random(seed)
    nodes = [Node(host=f"h{n}", address=f"10.0.0.{n}", node_rank=n, nproc=2) for n in range(3)]
    kept = Arrivals(horizon=40.0)
    said: list[tuple[Node, float, NodeArrivals]] = []
    live, judged = list(range(6)), 0
    for step in range(150):
        t = 1000.0 + step * 0.4
        for rank in [rank for rank in range(6) if rng.random() < 0.85]:
            seqs = {step, step - rng.randint(1, 3)} if rng.random() < 0.3 else {step}  # a resent word, a late one
            arrived = [CollectiveArrivals("0", seq, None, {rank: int((t + rng.uniform(0, 0.3) + (0.2 if rank == 4 else 0)) * 1e9)})
                       for seq in sorted(seqs) if seq >= 0]
            one = (nodes[rank // 2], t + rng.uniform(0.05, 0.2), NodeArrivals(t, arrived))
            kept.add(*one)
            said.append(one)
        if rng.random() < 0.05:
            live = sorted(rng.sample(range(6), rng.randint(2, 6)))
        fresh = Arrivals(horizon=40.0)
        for one in said:
            fresh.add(*one)
        found = kept.waited(live, 20.0)
        assert found == pytest.approx(fresh.waited(live, 20.0)), (seed, step)
        judged += bool(found)
    assert judged > 30, "most looks find stretches to judge"


def test_a_node_s_clock_is_taken_from_the_controller_s_pings_not_from_when_the_controller_read_its_messages() -> None:
    """Four nodes whose ranks all arrive together, node 1's clock 5 s ahead, and the controller (busy: thousands of
    nodes) reading node 2's messages 0.3 s after they were sent, every time. By when it read them, node 2's ranks
    seem to come 0.3 s late to every collective, which names them slow; by the clocks the pings show (the agent
    reads its words at once: the least of its `now - T` is its clock's lead), nobody is late."""
    clocks = [ControllerClock() for _ in range(4)]
    for ping in range(CLOCK_PINGS + 5):
        sent = 1000.0 + 2 * ping
        for node, clock in enumerate(clocks):
            clock.heard(sent, sent + (5.0 if node == 1 else 0.0) + (0.02 if ping % 3 else 0.001))
    assert clocks[1].ahead() == pytest.approx(5.001) and clocks[0].ahead() == pytest.approx(0.001)
    nodes = [Node(host=f"h{n}", address=f"10.0.0.{n}", node_rank=n, nproc=2) for n in range(4)]
    by_pings, by_reading = Arrivals(horizon=40.0), Arrivals(horizon=40.0)
    for step in range(60):  # a collective every 0.5 s; each node says its new arrivals every 1.5 s
        if step % 3:
            continue
        for node in nodes:
            ahead = 5.0 if node.node_rank == 1 else 0.0
            sent = 1000.0 + step * 0.5 + ahead
            received = 1000.0 + step * 0.5 + (0.3 if node.node_rank == 2 else 0.01)
            for rank in node.ranks:
                arrived = [CollectiveArrivals("0", seq, None, {rank: int((1000.0 + seq * 0.5 - 0.4 + ahead) * 1e9)})
                           for seq in range(max(0, step - 2), step + 1)]
                by_pings.add(node, received, NodeArrivals(sent, arrived, clocks[node.node_rank].ahead()))
                by_reading.add(node, received, NodeArrivals(sent, arrived))
    live = list(range(8))
    assert max(by_pings.waited(live, 20.0).values()) < 1, by_pings.waited(live, 20.0)
    assert min(by_reading.waited(live, 20.0)[rank] for rank in nodes[2].ranks) > 20, "the reading's lag, as late"


def _answer(rng: random.Random, rank: int, place: int) -> dict[str, Any]:
    """A rank's stacks answer as the agent makes it: its main thread at one of a few places, maybe a second thread and
    a DataLoader worker, its own pid, threads' ids and collectives (times of its own)."""
    frames = [{"name": "main", "file": "train.py", "line": 10 + place, "code": f"step({place})"}]
    threads: object = [{"name": "MainThread", "tid": 1000 + rank, "active": True, "gil": False, "frames": frames}]
    if place == 2:
        threads = "py-spy had not read it when the verdict was made"
    elif place == 1:
        threads.append({"name": "pin_memory", "tid": 5000 + rank, "active": False, "gil": False, "frames": frames})
    workers = [{"pid": 9000 + rank, "state": "S", "threads": [{"name": "MainThread", "tid": 9000 + rank, "active": False,
                                                              "gil": False, "frames": frames}]}] if place == 1 else []
    return {"pid": 1000 + rank, "state": "S", "threads": threads, "workers": workers,
            "collectives": [{"group": "0", "seq": 7, "op": "gloo:all_reduce", "done": False, "sizes": [[4]],
                             "created_ns": rng.randrange(10**18)}]}


@pytest.mark.parametrize("seed", range(10))
def test_alike_stacks_travel_once_with_their_ranks_and_come_back_whole(seed: int) -> None:
    """A node's ranks at a few places (a thread or a DataLoader worker more at one, py-spy's words at another): one
    answer per place goes to the controller, every rank's whole answer comes back from them, through the lines a
    node sends (within PIPE_BUF), its pid, threads' and workers' ids and collectives its own."""
    rng = random.Random(seed)
    places = {rank: rng.randrange(4) for rank in range(rng.randrange(1, 17))}
    answers = {rank: _answer(rng, rank, place) for rank, place in places.items()}
    sent = alike_answers(answers)
    assert len(sent) == len(set(places.values()))
    chunks, back = StackChunks(), {}
    for rank, answer in sent.items():
        for body in stacks_bodies("hang-0-1", rank, answer):
            assert len(message_line(Kind.STACKS, body)) <= PIPE_BUF
            if (whole := chunks.take(body)) is not None:
                back.update(answers_of(whole.rank, whole.answer))
    assert back == answers


@pytest.mark.parametrize("alike", ['"ranks"', '{"x": {}}', '{"1": {"pid": 2, "tids": []}}', '{"1": []}'])
def test_a_damaged_alike_answer_is_refused_as_the_listener_expects(alike: str) -> None:
    answer = json.loads(f'{{"pid": 1, "state": "S", "threads": [{{"name": "m", "tid": 1, "frames": []}}], '
                        f'"alike": {alike}}}')
    with pytest.raises((ValueError, KeyError, TypeError)):
        answers_of(0, answer)
