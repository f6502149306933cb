"""Bring your own script, without running it: its traceback read for the user's own frame, and its
--local_rank argument as the Slurm and Kubernetes renderers hand it to torchrun (the scripts run through
`harness launch` for real: tests/integration/test_own_scripts.py)."""

from __future__ import annotations

from harness.control.live import LiveNode
from harness.control.worker_output import is_cpp_info, normalize, user_error
from harness.plan.planner import Node
from harness.spec.job import load_job
from harness.targets.k8s.manifests import render_manifests
from harness.targets.slurm.batch import batch_script
from testbed.kubelet import job_spec


def test_the_users_frame_is_the_innermost_outside_the_library():
    chained = [
        "Traceback (most recent call last):",
        '  File "/srv/train.py", line 3, in <module>',
        "    load()",
        "KeyError: 'x'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "/srv/train.py", line 9, in <module>',
        "    main()",
        '  File "/srv/model.py", line 40, in forward',
        "    return self.net(x)",
        '  File "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1775, in _call_impl',
        "    return forward_call(*args, **kwargs)",
        '  File "<frozen runpy>", line 88, in _run_code',
        "ValueError: bad shape",
        "  extra detail",
    ]
    error = user_error(chained)
    assert error is not None
    assert (error.exception, error.where, error.source) == ("ValueError: bad shape", "/srv/model.py:40, in forward",
                                                            "return self.net(x)")
    library_only = ['  File "/opt/venv/lib/python3.11/site-packages/torch/x.py", line 2, in f', "    g()"]
    only = user_error(["Traceback (most recent call last):", *library_only, "RuntimeError: boom"])
    assert only is not None and only.where == "/opt/venv/lib/python3.11/site-packages/torch/x.py:2, in f"
    assert user_error(["no traceback here"]) is None
    assert normalize("[rank3]: [rank3]: [rank3]: x") == "[rank3]: x"
    assert normalize("[rank3]: [rank1]: x") == "[rank3]: [rank1]: x"
    info = "[rank1]: [rank1]:[I1123 05:18:03.275864889 reducer.cpp:1282] Reducer: using regular allocator"
    assert normalize(info) == "[rank1]: [I1123 05:18:03.275864889 reducer.cpp:1282] Reducer: using regular allocator"
    assert is_cpp_info(normalize(info)) and not is_cpp_info("[rank1]: [W1123 05:18:01.1 socket.cpp:207] [c10d] x")


def test_local_rank_arg_reaches_slurm_and_kubernetes_as_torchruns_macro(write_yaml):
    """Each backend's own quoting must hand torchrun `${local_rank}` to substitute, and the job's args as written."""
    spec = load_job(write_yaml("name: byo\nnnodes: 2\nimage: registry.example/own:1\nentrypoint:\n"
                               "  script: /opt/code/train.py\n  local_rank_arg: --local_rank\n  args: [--lr, $x]\n"))
    script = batch_script(spec, "job.yaml")
    assert "  /opt/code/train.py '--local_rank=${local_rank}' --lr '$$x'\n" in script, script
    container = job_spec(render_manifests(spec, "", code={}, supervised=False))["template"]["spec"]["containers"][0]
    assert container["args"][-4:] == ["/opt/code/train.py", "--local_rank=$${local_rank}", "--lr", "$$$$x"]


def test_torchruns_own_cpp_log_and_its_exception_dump_go_to_the_log_only():
    """What a node's torchrun prints when the master's agent left first at the end of a run: kept in the
    tail (the node log), out of the live stream; the ranks' own lines around it are shown."""
    lines = [
        "[rank1]: rank 1 final loss 0.0023",
        "[W1125 14:02:36.852364142 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=3): "
        "Failed to recv, got 0 bytes. Connection was likely closed.",
        "Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:786 "
        "(most recent call first):",
        "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f5e in libc10.so)",
        "<omitting python frames>",
        "frame #34: _start + 0x21 (0x562f0d7b4081 in /venv/bin/python)",
        "",
        "[rank1]: done",
    ]
    live = LiveNode(Node(host="sim1", address="127.0.0.1", node_rank=1, nproc=1), started=0.0)
    shown = [line for line in lines if live.take(line)[1]]
    assert shown == ["[rank1]: rank 1 final loss 0.0023", "[rank1]: done"]
    assert list(live.tail) == lines
