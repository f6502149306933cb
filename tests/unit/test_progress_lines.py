"""Which lines say a step (spec/progress.py), on real lines of the payload, PyTorch's examples, Lightning, the
Hugging Face Trainer and Megatron, and on the lines that name a step without being one."""

from __future__ import annotations

import pytest

from harness.spec.job import Health
from harness.spec.progress import global_step, step_total

DEFAULT = Health().progress_pattern
assert DEFAULT is not None


@pytest.mark.parametrize(("line", "step", "total", "loss"), [
    ("epoch 2/3 step 12/97 loss 2.1000 lr 0.1000 img/s 950", 109, 291, 2.1),  # the payload's
    ("epoch 1/3 step 12/97 (150 in all) loss 2.1000 lr 0.1000 img/s 950", 12, 150, 2.1),  # ... with --max-steps
    ("step 28/60 loss 0.4123", 28, 60, 0.4123),
    ("step 12", 12, None, None),
    ("Step 12/97: loss=0.5", 12, 97, 0.5),
    ("Epoch 1 step 5", 5, None, None),  # no `epoch N/M`: the step as it is
    ("2026-11-28 10:00:01,123 INFO step 40/60 loss 0.5", 40, 60, 0.5),  # logging's default format
    ("INFO:__main__:global step 40", 40, None, None),
    ("[2026-11-28 10:00:01] step 41/60", 41, 60, None),
    # PyTorch's examples: imagenet (epochs from 0) and mnist (its count is of samples)
    ("Epoch: [1][  10/5005]\tTime  0.512 ( 0.612)\tData  0.001 ( 0.101)\tLoss 6.9077e+00 (6.9080e+00)\t"
     "Acc@1   0.00 (  0.10)", 5015, None, 6.9077),
    ("Train Epoch: 2 [640/60000 (1%)]\tLoss: 0.298011", 60640, None, 0.298011),
    # tqdm bars: Lightning's (the steps of one epoch, epochs from 0), the Hugging Face Trainer's (the run's)
    ("Epoch 0:  45%|████▌     | 45/100 [00:02<00:02, 20.10it/s, v_num=0, train_loss=0.123]", 45, None, 0.123),
    ("Epoch 1: 100%|██████████| 100/100 [00:05<00:00, 19.80it/s, v_num=0, train_loss=0.101]", 200, None, 0.101),
    (" 50%|█████     | 30/60 [00:10<00:10,  2.90it/s]", 30, 60, None),
    # Megatron-LM
    (" [2026-11-28 10:00:01] iteration       10/     500 | consumed samples:          640 | lm loss: 1.051106E+01 |",
     10, 500, 10.51106),
])
def test_a_step_line_gives_the_runs_step_its_total_and_loss(line, step, total, loss):
    for prefixed in (line, f"[rank0]: {line}"):
        found = DEFAULT.search(prefixed)
        assert found is not None, prefixed
        assert (global_step(found), step_total(found)) == (step, total)
        assert (float(found["loss"]) if found.groupdict().get("loss") else None) == loss


@pytest.mark.parametrize("line", [
    "checkpoint: step 35 saved in 0.003 s",  # a checkpoint line
    "checkpoint: 20 steps saved in 0.120 s",  # the payload's
    "RuntimeError: boom at step 10",  # an exception's text
    "    raise RuntimeError(f'boom at step {step}')",  # ... and the traceback's source line
    "resumed from ckpt/step-25.pt at step 25",  # a resume
    "resume: epoch 2/12 step 5/97 (global step 102) from checkpoints/ckpt-102.pt",  # the payload's
    "Test: [ 10/196]\tTime  0.1 ( 0.2)",  # imagenet's evaluation
    "{'loss': 0.6931, 'grad_norm': 1.0, 'learning_rate': 5e-05, 'epoch': 0.5}",  # the HF Trainer's log
    "saving at step 100 of 200",
])
def test_a_line_that_names_a_step_without_taking_one_is_no_step(line):
    assert DEFAULT.search(line) is None and DEFAULT.search(f"[rank3]: {line}") is None


@pytest.mark.parametrize(("line", "step"), [
    ("resume: epoch 2/12 step 5/97 (global step 102) from checkpoints/ckpt-102.pt", 102),  # the payload's
    ("resumed from ckpt/step-25.pt at step 25", 25),
    ("Restored checkpoint: global step 300", 300),
])
def test_a_resume_line_says_where_the_attempts_count_starts(line, step):
    assert DEFAULT.resume is not None
    found = DEFAULT.resume.search(f"[rank1]: {line}")
    assert found is not None and global_step(found) == step


def test_a_jobs_own_pattern_or_patterns_replace_the_default_and_know_no_resume():
    own = Health(progress=r"it (?P<step>\d+) of (?P<total>\d+)").progress_pattern
    assert own is not None and own.resume is None
    found = own.search("it 7 of 70")
    assert found is not None and step_total(found) == 70
    several = Health(progress=[r"^a (?P<step>\d+)", r"^b (?P<step>\d+)"]).progress_pattern
    assert several is not None and [global_step(several.search(line)) for line in ("a 1", "b 2")] == [1, 2]
    assert Health(progress="").progress_pattern is None and Health(progress=[]).progress_pattern is None
