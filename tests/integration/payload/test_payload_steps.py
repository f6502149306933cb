"""The training step as the GPU needs it: no host syncs between log intervals, one compiled graph.

On the CPU here; tests/gpu runs the same checks on CUDA, where a sync stalls the GPU's queue.
"""

from __future__ import annotations

from train_probe import check_steps_make_no_host_sync, compile_counts

RUN = ["--data", "synthetic", "--model", "small", "--batch-size", "32", "--device", "cpu"]


def test_steps_between_log_lines_make_no_host_sync() -> None:
    check_steps_make_no_host_sync([*RUN, "--subset", "1024"])


def test_compiled_training_compiles_once_without_graph_breaks() -> None:
    """Two epochs with an evaluation between them: one frame, one graph, never a recompile (dynamo's counts, the
    same with any backend: aot_eager here, inductor in tests/gpu)."""
    found = compile_counts([*RUN, "--subset", "256", "--epochs", "2", "--log-every", "4", "--compile"], "aot_eager")
    assert "compile=default" in found["output"]
    assert (found["frames"], found["graphs"], found["graph_breaks"]) == (1, 1, {}), found
