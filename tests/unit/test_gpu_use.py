"""A rank's GPU use, from the node agent's sample to `harness status`: where the driver says nothing, nothing
is shown; an older agent's samples still read. The driver's own answers are read for real in tests/gpu."""

from __future__ import annotations

import json
import os

from harness.health.judge import HealthJudge
from harness.node.gpu import driver_gpu_count, open_nvml
from harness.node.protocol import RankSample, health_bodies, parse_health
from harness.plan.planner import Node
from harness.record.schema import LiveHealth, RankRow
from harness.view.status import rank_rows

NODE = Node(host="sim0", address="127.0.0.1", node_rank=0, nproc=2)


def test_without_an_nvidia_driver_nothing_is_read_and_the_reason_is_said():
    nvml = open_nvml()
    if os.path.exists("/dev/nvidiactl"):  # a GPU machine's driver: every GPU found (tests/gpu reads them)
        assert not isinstance(nvml, str) and driver_gpu_count() == len(nvml.devices) > 0
    else:
        assert nvml == "no NVIDIA driver here (libnvidia-ml.so.1 not found)" and driver_gpu_count() == 0


def test_gpu_use_travels_with_the_health_sample_and_an_older_agents_sample_still_reads():
    sample = RankSample(100, "R", 3.0, 2.0, 10, 40, 0.2, gpu_util=87.5, gpu_memory=3 << 30)
    assert parse_health(health_bodies(5.0, {0: sample})[0]).samples == {0: sample}
    older = json.dumps({"t": 5.0, "ranks": {"0": [100, "R", 3.0, 2.0, 10, 40, 0.2]}})
    assert parse_health(older).samples[0] == RankSample(100, "R", 3.0, 2.0, 10, 40, 0.2)  # GPU use unknown


def test_status_shows_gpu_columns_only_where_a_ranks_gpu_use_is_known():
    judge = HealthJudge(stall=0, slow=20)
    for t in (0.0, 1.0):
        judge.observe(NODE, t, {0: RankSample(100, "R", t, t, 0, gpu_util=91.0, gpu_memory=3 << 30),
                                1: RankSample(101, "R", t, t, 0)})
    views = judge.views()
    assert (views[0].gpu_util, views[0].gpu_memory, views[1].gpu_util, views[1].gpu_memory) == (91.0, 3 << 30, None,
                                                                                               None)
    rows = {rank: RankRow("node0", "sim0", "computing", cpu=1.0, gpu_util=views[rank].gpu_util,
                          gpu_memory=views[rank].gpu_memory) for rank in views}
    shown = rank_rows(LiveHealth(attempt=0, t=1.0, ranks=rows), now=1.0, width=200)
    assert "CPU  GPU  GPU MEM" in shown[0]
    assert " 100%  91%   3.0GiB " in shown[1] and " 100%    -        - " in shown[2], shown
    cpu_only = rank_rows(LiveHealth(attempt=0, t=1.0, ranks={1: rows[1]}), now=1.0, width=200)
    assert "GPU" not in "\n".join(cpu_only), cpu_only
