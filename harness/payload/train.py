"""Train CIFAR-10 (or synthetic / digits data) with DDP or FSDP2; resumable on any world size, bitwise on CPU.

Runs under plain torchrun; it knows nothing about the harness:

    torchrun --nproc-per-node=2 -m harness.payload.train --data synthetic --model small --epochs 1
    torchrun --nnodes=2 --node-rank=0 --master-addr=10.0.0.1 --master-port=29500 --nproc-per-node=8 \\
        -m harness.payload.train --data cifar10 --data-dir /data --precision bf16 --compile \\
        --ckpt-dir /ckpt --resume --out-dir /out
    python -m harness.payload.train --data digits --model small --epochs 5      # one process, no torchrun

CIFAR-10 is prepared once beforehand: `python -m harness.payload.prepare --data-dir DIR`.
torchrun provides RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; HARNESS_BACKEND picks the
backend (auto = nccl on CUDA, else gloo). Rank 0 alone prints progress and writes metrics
(--out-dir); checkpoints go to --ckpt-dir, which every node must share. A run killed at any point and
restarted with --resume ends with the same weights as one never stopped (bitwise on CPU, on the same
world size), because the data order and augmentation derive from (seed, epoch, sample) and a
checkpoint holds everything else. The global batch, not the world size, defines each step, so a run
may also resume on any world size that divides it (each rank's share and its micro-batches adjusted).
The last line is `done: test_acc=... global_step=... world_size=... seconds=... peak_memory_mib=...`
(the peak of the rank that held the most: CUDA tensors on a GPU, the process's resident set on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.payload import PayloadError, batches, checkpoint, data, metrics, runtime
from harness.payload import model as models
from harness.payload import strategy as strategies
from harness.payload.runtime import Runtime

Log = Callable[[str], None]
Normalize = Callable[[torch.Tensor], torch.Tensor]
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="harness.payload.train", description=__doc__.splitlines()[0])
    p.add_argument("--data", choices=data.DATASETS, default="cifar10")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="where `prepare` put CIFAR-10")
    p.add_argument("--subset", type=int, help="use only the first N train and N test images")
    p.add_argument("--model", choices=models.MODELS, default="resnet18")
    p.add_argument("--norm", choices=models.NORMS, default="batch", help="group: no per-rank statistics")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps in total")
    p.add_argument("--batch-size", type=int, default=1024,
                   help="images one rank computes at once; a larger share of the global batch is accumulated")
    p.add_argument("--global-batch", type=int,
                   help="images per optimizer step over all ranks (default: --batch-size x ranks; on --resume, "
                        "the checkpoint's), which must divide by the world size")
    p.add_argument("--strategy", choices=strategies.STRATEGIES, default="ddp",
                   help="ddp: a replica per rank; fsdp: FSDP2, parameters, gradients and optimizer state sharded")
    p.add_argument("--lr", type=float, default=0.4,
                   help="peak learning rate: 0.1 per 256 images of global batch (ranks x --batch-size)")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of steps with rising learning rate")
    p.add_argument("--no-augment", action="store_true", help="no random crop and flip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast")
    p.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES, metavar="MODE",
                   help="torch.compile the model; MODE defaults to default, and reduce-overhead adds CUDA graphs")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--ckpt-dir", type=Path, help="checkpoints: every --ckpt-every steps and each epoch end")
    p.add_argument("--ckpt-every", type=int, default=0, help="steps between checkpoints (0: epoch ends only)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--resume", action="store_true", help="continue from the newest readable checkpoint")
    p.add_argument("--out-dir", type=Path, help="metrics.jsonl and metrics.png")
    p.add_argument("--save-final", type=Path, help="write the final model state_dict here")
    p.add_argument("--losses", type=Path, metavar="FILE",
                   help="append every step's loss (mean over the global batch) to FILE as JSON lines; "
                        "costs a host sync per step")
    p.add_argument("--log-every", type=int, default=50, help="steps between progress updates")
    p.add_argument("--eval-batch-size", type=int, default=1000)
    p.add_argument("--local-rank", "--local_rank", type=int, help="torch.distributed.launch; LOCAL_RANK wins")
    args = p.parse_args(argv)
    if args.resume and args.ckpt_dir is None:
        p.error("--resume needs --ckpt-dir")
    for flag in ("epochs", "batch_size", "log_every", "eval_batch_size", "keep", "global_batch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def lr_schedule(total_steps: int, warmup: float) -> Callable[[int], float]:
    """Linear rise to the peak over the warmup fraction, then linear decay to zero, per step."""
    rise = max(1, round(warmup * total_steps))

    def factor(step: int) -> float:
        return min((step + 1) / rise, max(0.0, (total_steps - step) / max(1, total_steps - rise)))

    return factor


def autocast(rt: Runtime, precision: str) -> torch.autocast:
    return torch.autocast(rt.device.type, torch.bfloat16, enabled=precision == "bf16")


@torch.no_grad()
def evaluate(net: nn.Module, ds: data.Dataset, rt: Runtime, norm: Normalize, precision: str, batch_size: int) -> float:
    """Test accuracy; each rank scores a disjoint slice, one all-reduce at the end. Every rank runs
    the same number of batches (a short slice is padded with image 0, not counted): under FSDP
    each forward is a collective."""
    net.eval()
    n = len(ds.test_y)
    mine = torch.arange(rt.rank, n, rt.world_size, device=rt.device)
    share = -(-n // rt.world_size)
    idx_all = torch.cat([mine, mine.new_zeros(share - len(mine))])
    correct = torch.zeros((), dtype=torch.int64, device=rt.device)
    for start, idx in zip(range(0, len(idx_all), batch_size), idx_all.split(batch_size), strict=True):
        counted = (torch.arange(start, start + len(idx), device=rt.device) < len(mine))
        with autocast(rt, precision):
            correct += ((net(norm(ds.test_x[idx])).argmax(1) == ds.test_y[idx]) & counted).sum()
    net.train()
    counts = runtime.all_reduce_sum(rt, torch.stack([correct, torch.tensor(len(mine), device=rt.device)]))
    return counts[0].item() / max(1, counts[1].item())


def find_checkpoint(ckpt_dir: Path, rt: Runtime, strategy: str, log: Log) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0 picks the newest readable checkpoint; every rank then loads that same one (the state; a
    sharded checkpoint's shards are loaded once the model is sharded)."""
    found = None
    log(f"resume: looking for the newest checkpoint in {ckpt_dir}")
    if rt.is_main:
        checkpoint.remove_partial_writes(ckpt_dir)
        found = checkpoint.load_newest(ckpt_dir, rt.device, warn=log)
    chosen = runtime.broadcast(rt, str(found[0]) if found else None)
    assert chosen is None or isinstance(chosen, str)
    if chosen is None:
        log(f"resume: no checkpoint in {ckpt_dir}, starting from scratch")
        return None
    path = Path(chosen)
    wanted = "fsdp" if checkpoint.is_sharded(path) else "ddp"
    if wanted != strategy:
        raise PayloadError(f"the newest checkpoint in {ckpt_dir}, {path.name}, was written with --strategy {wanted}; "
                           f"resume it with --strategy {wanted}, or start afresh in another --ckpt-dir")
    if found:
        return path, found[1]
    try:
        return path, checkpoint.load(path, rt.device)
    except Exception as e:  # noqa: BLE001 - any failure here means the directory is not shared
        raise PayloadError(
            f"rank {rt.rank} cannot read {path}, chosen by rank 0 ({e}); --ckpt-dir must be shared by all nodes"
        ) from None


def check_same_config(saved: dict[str, Any], config: dict[str, Any], ckpt_dir: Path) -> None:
    """Resuming is exact only with the settings that shaped the run so far."""
    changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in config.items() if saved.get(k) != v]
    if changed:
        raise PayloadError(
            f"the checkpoint in {ckpt_dir} was made with other settings ({', '.join(changed)}); "
            "use a fresh --ckpt-dir to change them"
        )


def batch_split(args: argparse.Namespace, rt: Runtime, saved: dict[str, Any] | None, log: Log) -> batches.Split:
    """The global batch: --global-batch, else the checkpoint's, else --batch-size x world size; cut
    into each rank's micro-batches of at most --batch-size."""
    global_batch = args.global_batch or (saved["config"]["global_batch"] if saved else args.batch_size * rt.world_size)
    split = batches.split(global_batch, rt.world_size, args.batch_size)
    before = saved.get("world_size") if saved else None
    if before is not None and before != rt.world_size:
        log(f"resume: world size {before} -> {rt.world_size}; the same steps continue: {split.describe()}")
    return split


def train(args: argparse.Namespace, rt: Runtime) -> None:
    log: Log = (lambda msg: print(msg, flush=True)) if rt.is_main else (lambda msg: None)
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    ds = data.load(args.data, args.data_dir, args.seed, args.subset).to(rt.device)
    # SIGUSR1 (a time-limit or preemption warning): the ranks agree at the next log interval, save a
    # checkpoint there and stop, so that the requeued job loses nothing.
    warned = runtime.warning_signal() if args.ckpt_dir is not None else None
    found = find_checkpoint(args.ckpt_dir, rt, args.strategy, log) if args.resume else None
    split = batch_split(args, rt, found[1] if found else None, log)
    global_batch = split.global_batch
    steps_per_epoch = len(ds.train_y) // global_batch
    if steps_per_epoch == 0:
        raise PayloadError(f"{len(ds.train_y)} training images do not fill one step's {split.describe()}; "
                           f"lower --global-batch or --batch-size")
    total_steps = args.epochs * steps_per_epoch
    max_steps = total_steps if args.max_steps is None else min(args.max_steps, total_steps)

    cuda = rt.device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model = models.build(args.model, ds.channels, ds.num_classes, args.norm)
    parallel = strategies.build(args.strategy, model.to(rt.device), rt)
    # fused: one kernel for the whole update on CUDA instead of a few per parameter group.
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=args.weight_decay,
        fused=(cuda and not parallel.sharded) or None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(total_steps, args.warmup))
    config = {
        "data": args.data, "subset": args.subset, "model": args.model, "norm": args.norm, "seed": args.seed,
        "global_batch": global_batch, "epochs": args.epochs, "lr": args.lr, "weight_decay": args.weight_decay,
        "warmup": args.warmup, "augment": not args.no_augment,
    }

    epoch = step = global_step = 0
    loss_carry = seconds_carry = 0.0
    history: list[dict[str, Any]] = []
    if found is not None:
        path, state = found
        check_same_config(state["config"], config, args.ckpt_dir)
        parallel.load(path, state, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["cpu"].cpu())
        if cuda and state["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu())
        epoch, step, global_step = state["epoch"], state["step"], state["global_step"]
        loss_carry, seconds_carry, history = state["loss_carry"], state["seconds_carry"], state["history"]
        log(f"resume: epoch {epoch + 1} step {step} (global step {global_step}) from {path}")

    # Static shapes: every training batch has one shape, so a changed shape is a bug to recompile for,
    # not a reason to switch to slower shape-generic kernels.
    net = parallel.wrap(torch.compile(model, mode=args.compile, dynamic=False) if args.compile else model)
    mean = torch.tensor(ds.mean, device=rt.device).view(1, -1, 1, 1) * 255
    std = torch.tensor(ds.std, device=rt.device).view(1, -1, 1, 1) * 255

    def norm(x: torch.Tensor) -> torch.Tensor:
        return batches.normalize(x, mean, std)

    log(
        f"train: data={args.data} ({len(ds.train_y)} train / {len(ds.test_y)} test) model={args.model} "
        f"world_size={rt.world_size} device={rt.device.type} backend={rt.backend or 'none'} "
        f"strategy={parallel.name} {split.describe()}, steps/epoch={steps_per_epoch} max_steps={max_steps} "
        f"precision={args.precision} compile={args.compile or 'off'}"
    )
    # Losses stay on the device; they reach the host once per log interval, checkpoint or epoch.
    loss_sum = torch.zeros((), device=rt.device)
    log_loss = torch.zeros((), device=rt.device)
    losses = _loss_writer(args.losses) if rt.is_main and args.losses is not None else None

    def fold_losses() -> None:
        """Move the ranks' loss sums into loss_carry (the global mean loss, summed over steps)."""
        nonlocal loss_carry
        loss_carry += runtime.all_reduce_sum(rt, loss_sum).item() / rt.world_size
        loss_sum.zero_()

    def save(at_epoch: int, at_step: int, seconds: float) -> None:
        if args.ckpt_dir is None:
            return
        fold_losses()
        state = {
            "scheduler": scheduler.state_dict(), "epoch": at_epoch, "step": at_step, "global_step": global_step,
            "loss_carry": loss_carry, "seconds_carry": seconds, "history": history, "config": config,
            "world_size": rt.world_size,
            "rng": {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if cuda else None},
        }
        parallel.save(optimizer, state, args.ckpt_dir, global_step, args.keep)

    def train_step(plan: batches.Epoch) -> torch.Tensor:
        """One optimizer step on this rank's share of the global batch, micro-batch by micro-batch; the
        rank's mean loss. Each micro-batch's loss is scaled so the gradients sum to the share's mean."""
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=rt.device)
        for micro in range(split.accumulation):
            idx = plan.batch(step, split.micro, micro)
            x = ds.train_x[idx]
            if not args.no_augment:
                x = batches.augment(x, plan.offsets[idx], plan.flips[idx], ds.pad)
            with parallel.accumulating(net, last=micro == split.accumulation - 1):
                with autocast(rt, args.precision):
                    loss = F.cross_entropy(net(norm(x)), ds.train_y[idx])
                (loss / split.accumulation).backward()
            step_loss += loss.detach()
        optimizer.step()
        scheduler.step()
        return step_loss / split.accumulation

    while epoch < args.epochs and global_step < max_steps:
        plan = batches.epoch_plan(
            len(ds.train_y), args.seed, epoch, rt.rank, rt.world_size, ds.pad, ds.flip, rt.device, split.accumulation
        )
        bar = _progress_bar(rt, steps_per_epoch, step, f"epoch {epoch + 1}/{args.epochs}")
        t_epoch = t_log = time.perf_counter()
        logged_at = global_step
        log_loss.zero_()
        while step < steps_per_epoch and global_step < max_steps:
            loss = train_step(plan)
            loss_sum += loss
            step += 1
            global_step += 1
            if args.losses is not None:
                mean_loss = runtime.all_reduce_sum(rt, loss.clone()).item() / rt.world_size
                if losses is not None:
                    losses(global_step, mean_loss)
            if rt.is_main:
                log_loss += loss
                if bar is not None:
                    bar.update()
                if global_step % args.log_every == 0:
                    now, steps = time.perf_counter(), global_step - logged_at
                    shown = (
                        f"loss {log_loss.item() / steps:.4f} lr {scheduler.get_last_lr()[0]:.4f} "
                        f"img/s {steps * global_batch / (now - t_log):.0f}"
                    )
                    log_loss.zero_()
                    t_log, logged_at = now, global_step
                    if bar is not None:
                        bar.set_postfix_str(shown)
                    else:
                        log(f"epoch {epoch + 1}/{args.epochs} step {step}/{steps_per_epoch} {shown}")
            mid_epoch = step < steps_per_epoch and global_step < max_steps  # an epoch's end saves anyway
            if args.ckpt_every and global_step % args.ckpt_every == 0 and mid_epoch:
                save(epoch, step, seconds_carry + time.perf_counter() - t_epoch)
            if warned is not None and mid_epoch and global_step % args.log_every == 0 \
                    and runtime.any_rank(rt, warned.is_set()):
                save(epoch, step, seconds_carry + time.perf_counter() - t_epoch)
                log(f"warning signal (SIGUSR1): checkpoint saved at global step {global_step}; stopping here, "
                    f"to resume with --resume")
                return
        if bar is not None:
            bar.close()

        fold_losses()
        seconds = seconds_carry + time.perf_counter() - t_epoch
        accuracy = evaluate(model, ds, rt, norm, args.precision, args.eval_batch_size)
        record = {
            "epoch": epoch + 1, "steps": step, "loss": loss_carry / step, "accuracy": accuracy,
            "images_per_s": step * global_batch / seconds, "seconds": seconds, "world_size": rt.world_size,
            "global_step": global_step,
        }
        history = [r for r in history if r["epoch"] != epoch + 1] + [record]
        log(
            f"epoch {epoch + 1}/{args.epochs}: train_loss {record['loss']:.4f} test_acc {accuracy:.4f} "
            f"time {seconds:.1f}s img/s {record['images_per_s']:.0f}"
            + ("" if step == steps_per_epoch else f" (stopped at step {step})")
        )
        if rt.is_main and args.out_dir is not None:
            metrics.write(args.out_dir, history)
        seconds_carry = seconds
        if step == steps_per_epoch:
            epoch, step = epoch + 1, 0
            loss_carry = seconds_carry = 0.0
        save(epoch, step, seconds_carry)

    last = history[-1] if history else None
    if last is not None and last["global_step"] == global_step:
        accuracy = last["accuracy"]
    else:
        accuracy = evaluate(model, ds, rt, norm, args.precision, args.eval_batch_size)
    if args.save_final is not None and (final := parallel.full_state()) is not None:
        checkpoint.atomic_write(args.save_final, checkpoint.serialize(final))
    peak = runtime.peak_memory_mib(rt)
    held = runtime.most_of_any_rank(rt, strategies.state_mib(model, optimizer))
    log(
        f"done: test_acc={accuracy:.4f} global_step={global_step} world_size={rt.world_size} "
        f"seconds={time.perf_counter() - started:.1f} peak_memory_mib={peak:.0f} state_mib={held:.2f}"
    )


def _loss_writer(path: Path) -> Callable[[int, float], None]:
    """Appends one JSON line per optimizer step: a resumed run's lines follow the killed run's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole run; closed when the process ends

    def write(global_step: int, loss: float) -> None:
        f.write(json.dumps({"global_step": global_step, "loss": loss}) + "\n")

    return write


def _progress_bar(rt: Runtime, total: int, initial: int, desc: str) -> Any:
    """tqdm on a terminal; otherwise None, and progress goes out as one line per log interval."""
    if not (rt.is_main and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rt = runtime.setup(args.device, args.local_rank)
        train(args, rt)
    except PayloadError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    # Only after success: tearing down while other ranks may still be inside a collective can hang.
    runtime.teardown(rt)
    return 0


if __name__ == "__main__":
    # Exit without interpreter finalization: a gloo worker thread may still be releasing the last
    # collective's tensors, and if that happens while Python shuts down, the process aborts
    # ("terminate called without an active exception", SIGABRT) after a run that succeeded.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
