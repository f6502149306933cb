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
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from harness.payload import PayloadError, batches, checkpoint, data, metrics, runtime
from harness.payload import model as models
from harness.payload import strategy as strategies
from harness.payload.metrics import EpochRecord
from harness.payload.progress import Config, Progress
from harness.payload.runtime import Runtime
from harness.payload.step_log import LossFile, StepReport

Log = Callable[[str], None]
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


def find_checkpoint(
    ckpt_dir: Path, rt: Runtime, strategy: str, log: Log
) -> tuple[Path, checkpoint.Checkpoint] | None:
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


def check_same_config(saved: Config, config: Config, ckpt_dir: Path) -> None:
    """Resuming is exact only with the settings that shaped the run so far."""
    changed = saved.changes(config)
    if changed:
        raise PayloadError(
            f"the checkpoint in {ckpt_dir} was made with other settings ({', '.join(changed)}); "
            "use a fresh --ckpt-dir to change them"
        )


def batch_split(args: argparse.Namespace, rt: Runtime, saved: Progress | None, log: Log) -> batches.Split:
    """The global batch: --global-batch, else the checkpoint's, else --batch-size x world size; cut
    into each rank's micro-batches of at most --batch-size."""
    global_batch = args.global_batch or (saved.config.global_batch if saved else args.batch_size * rt.world_size)
    split = batches.split(global_batch, rt.world_size, args.batch_size)
    if saved is not None and saved.world_size != rt.world_size:
        log(f"resume: world size {saved.world_size} -> {rt.world_size}; the same steps continue: {split.describe()}")
    return split


def run_config(args: argparse.Namespace, global_batch: int) -> Config:
    """The flags a checkpoint records: the ones --resume must find unchanged."""
    return Config(
        data=args.data, subset=args.subset, model=args.model, norm=args.norm, seed=args.seed,
        global_batch=global_batch, epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay,
        warmup=args.warmup, augment=not args.no_augment,
    )


class Trainer:
    """One rank's part of the run: its data, its model as the strategy holds it, the optimizer and the
    progress. Every rank calls the same methods in the same order, since most of them hold collectives
    (inside a step, the loss's all-reduces, checkpoints)."""

    def __init__(self, args: argparse.Namespace, rt: Runtime) -> None:
        self.args, self.rt = args, rt
        self.log: Log = (lambda msg: print(msg, flush=True)) if rt.is_main else (lambda msg: None)
        self.started = time.perf_counter()
        torch.manual_seed(args.seed)
        self.ds = data.load(args.data, args.data_dir, args.seed, args.subset).to(rt.device)
        # SIGUSR1 (a time-limit or preemption warning): the ranks agree at the next log interval, save a
        # checkpoint there and stop, so that the requeued job loses nothing.
        self.warned = runtime.warning_signal() if args.ckpt_dir is not None else None
        reading = time.perf_counter()
        found = find_checkpoint(args.ckpt_dir, rt, args.strategy, self.log) if args.resume else None
        read_s = time.perf_counter() - reading
        self.split = batch_split(args, rt, found[1].progress if found else None, self.log)
        self.steps_per_epoch = len(self.ds.train_y) // self.split.global_batch
        if self.steps_per_epoch == 0:
            raise PayloadError(f"{len(self.ds.train_y)} training images do not fill one step's "
                               f"{self.split.describe()}; lower --global-batch or --batch-size")
        total_steps = args.epochs * self.steps_per_epoch
        self.max_steps = total_steps if args.max_steps is None else min(args.max_steps, total_steps)
        self.model, self.parallel, self.optimizer, self.scheduler = self._build(total_steps)
        config = run_config(args, self.split.global_batch)
        self.progress = self._resume(*found, config, read_s) if found else Progress(config, rt.world_size)
        # Static shapes: every training batch has one shape, so a changed shape is a bug to recompile for,
        # not a reason to switch to slower shape-generic kernels.
        compiled = torch.compile(self.model, mode=args.compile, dynamic=False) if args.compile else self.model
        self.net = self.parallel.wrap(compiled)
        assert isinstance(compiled, nn.Module)  # torch.compile of a module is one (OptimizedModule)
        self.buffers = self._keep_buffers(compiled) if self._can_save_just_in_time() else None
        self.stopping = threading.Event()  # SIGTERM came while training (run)
        self.mean = torch.tensor(self.ds.mean, device=rt.device).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(self.ds.std, device=rt.device).view(1, -1, 1, 1) * 255
        self._announce()
        # Losses stay on the device; they reach the host once per log interval, checkpoint or epoch.
        self.loss_sum = torch.zeros((), device=rt.device)
        self.report = StepReport(rt, self.log, args.log_every, self.split.global_batch, self.scheduler)
        self.losses = LossFile(rt, args.losses) if args.losses is not None else None
        self.epoch_started = time.perf_counter()  # when this process took up the current epoch

    def _build(self, total_steps: int) -> tuple[nn.Module, strategies.Replicated | strategies.Sharded,
                                                 torch.optim.SGD, torch.optim.lr_scheduler.LambdaLR]:
        """The model, placed by its strategy before the optimizer is made (FSDP swaps in its shards)."""
        cuda = self.rt.device.type == "cuda"
        if cuda:
            torch.backends.cudnn.benchmark = True
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        model = models.build(self.args.model, self.ds.channels, self.ds.num_classes, self.args.norm)
        parallel = strategies.build(self.args.strategy, model.to(self.rt.device), self.rt)
        # fused: one kernel for the whole update on CUDA instead of a few per parameter group.
        optimizer = torch.optim.SGD(
            model.parameters(), lr=self.args.lr, momentum=0.9, nesterov=True, weight_decay=self.args.weight_decay,
            fused=(cuda and not parallel.sharded) or None,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(total_steps, self.args.warmup))
        return model, parallel, optimizer, scheduler

    def _can_save_just_in_time(self) -> bool:
        """DDP ranks each hold the whole state (save_just_in_time); a lone process has no peer to lose."""
        return self.args.ckpt_dir is not None and not self.parallel.sharded and self.rt.distributed

    def _keep_buffers(self, module: nn.Module) -> BufferCopy:
        """The model's buffers as each step found them: its forward changes them (batch norm's running
        statistics), so after a step that failed past its forward only this copy holds the last step's. Taken
        where DDP has just made every rank's buffers rank 0's, as the checkpoint of an unbroken run holds them."""
        kept = BufferCopy(dict(self.model.named_buffers()))
        module.register_forward_pre_hook(lambda *_: kept.take(self.progress.global_step))
        return kept

    def _resume(self, path: Path, saved: checkpoint.Checkpoint, config: Config, read_s: float) -> Progress:
        """Load the checkpoint's states; its progress goes on with this run's world size. The line says how long the
        restore took (read_s: finding and reading the file), the harness's `restore` phase of a restart."""
        loading = time.perf_counter()
        check_same_config(saved.progress.config, config, self.args.ckpt_dir)
        self.parallel.load(path, saved, self.optimizer)
        self.scheduler.load_state_dict(saved.scheduler)
        saved.rng.restore(self.rt.device)
        p = saved.progress
        # epoch E/EPOCHS step N/PER_EPOCH, as the progress lines say it: a progress pattern reads the same step
        restored_s = read_s + time.perf_counter() - loading
        self.log(f"resume: epoch {p.epoch + 1}/{self.args.epochs} step {p.step}/{self.steps_per_epoch} "
                 f"(global step {p.global_step}) from {path}, restored in {restored_s:.3f} s")
        return replace(p, world_size=self.rt.world_size)

    def _announce(self) -> None:
        """One line that says what runs, before the first step: logs and tests read it."""
        args, rt = self.args, self.rt
        self.log(
            f"train: data={args.data} ({len(self.ds.train_y)} train / {len(self.ds.test_y)} test) model={args.model} "
            f"world_size={rt.world_size} device={rt.device.type} backend={rt.backend or 'none'} "
            f"strategy={self.parallel.name} {self.split.describe()}, steps/epoch={self.steps_per_epoch} "
            f"max_steps={self.max_steps} precision={args.precision} compile={args.compile or 'off'}"
        )

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 images as the model takes them (batches.normalize)."""
        return batches.normalize(x, self.mean, self.std)

    def run(self) -> None:
        """Epochs up to --epochs or --max-steps, then the last line; SIGUSR1 stops it early, checkpointed. While
        it trains, SIGTERM (the launcher stopping this rank: a peer failed, or a stop was asked for) ends it at
        the end of its step, or when the step fails, with a just-in-time checkpoint (save_just_in_time)."""
        p = self.progress
        default = signal.signal(signal.SIGTERM, lambda *_: self.stopping.set()) if self.buffers is not None else None
        try:
            while p.epoch < self.args.epochs and p.global_step < self.max_steps:
                if not self.train_epoch():
                    return
                self.end_epoch()
        finally:
            if default is not None:
                signal.signal(signal.SIGTERM, default)
        self.finish()

    def train_epoch(self) -> bool:
        """The current epoch's remaining steps (within --max-steps); False when SIGUSR1 stopped the run."""
        p, rt = self.progress, self.rt
        plan = batches.epoch_plan(len(self.ds.train_y), self.args.seed, p.epoch, rt.rank, rt.world_size, self.ds.pad,
                                  self.ds.flip, rt.device, self.split.accumulation)
        cut = self.max_steps < self.args.epochs * self.steps_per_epoch  # --max-steps ends the run first
        self.report.begin(f"epoch {p.epoch + 1}/{self.args.epochs}", self.steps_per_epoch, p.step, p.global_step,
                          self.max_steps if cut else None)
        self.epoch_started = time.perf_counter()
        while p.step < self.steps_per_epoch and p.global_step < self.max_steps:
            loss, every_rank = self.train_step(plan)
            self.loss_sum += every_rank
            p.step += 1
            p.global_step += 1
            if self.losses is not None:
                self.losses.add(p.global_step, loss)
            self.report.step(loss, p.step, p.global_step)
            if self.stopping.is_set():
                self.save_just_in_time("SIGTERM: stopped")
                raise SystemExit(128 + signal.SIGTERM)
            try:
                if self.save_mid_epoch():
                    return False
            except RuntimeError as exc:  # its collectives (SIGUSR1's agreement, a save's barrier) lost a peer
                self.save_just_in_time(_first_line(exc))
                raise
        self.report.end()
        return True

    def train_step(self, plan: batches.Epoch) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on this rank's share of the global batch, micro-batch by micro-batch; the
        rank's mean loss, and the ranks' mean losses summed (an all-reduce before the optimizer step: every
        rank knows the epoch's loss so far, so any survivor of a lost peer can save it). Each micro-batch's
        loss is scaled so the gradients sum to the share's mean. Nothing changes until every collective of the
        step has succeeded: a step that fails leaves the state of the one before it."""
        self.optimizer.zero_grad(set_to_none=True)
        accumulation = self.split.accumulation
        step_loss = torch.zeros((), device=self.rt.device)
        try:
            for micro in range(accumulation):
                idx = plan.batch(self.progress.step, self.split.micro, micro)
                x = self.ds.train_x[idx]
                if not self.args.no_augment:
                    x = batches.augment(x, plan.offsets[idx], plan.flips[idx], self.ds.pad)
                with self.parallel.accumulating(self.net, last=micro == accumulation - 1):
                    with autocast(self.rt, self.args.precision):
                        loss = F.cross_entropy(self.net(self.norm(x)), self.ds.train_y[idx])
                    (loss / accumulation).backward()
                step_loss += loss.detach()
            mine = step_loss / accumulation
            every_rank = runtime.all_reduce_sum(self.rt, mine.clone())
        except RuntimeError as exc:  # a collective's lost peer (gloo: "Connection reset by peer"), or anything else
            self.save_just_in_time(_first_line(exc))
            raise
        self.optimizer.step()
        self.scheduler.step()
        return mine, every_rank

    def save_mid_epoch(self) -> bool:
        """Checkpoint every --ckpt-every steps, and when SIGUSR1 came: then True, to stop. Not on an
        epoch's last step, whose end saves anyway; SIGUSR1 is looked for at log intervals only, as
        the ranks must agree on it in a collective."""
        p, args = self.progress, self.args
        if not (p.step < self.steps_per_epoch and p.global_step < self.max_steps):
            return False
        if args.ckpt_every and p.global_step % args.ckpt_every == 0:
            self.save(p.seconds_carry + time.perf_counter() - self.epoch_started)
        if self.warned is None or p.global_step % args.log_every or not runtime.any_rank(self.rt, self.warned.is_set()):
            return False
        self.save(p.seconds_carry + time.perf_counter() - self.epoch_started)
        self.log(f"warning signal (SIGUSR1): checkpoint saved at global step {p.global_step}; stopping here, "
                 f"to resume with --resume")
        return True

    def fold_losses(self) -> None:
        """Move the ranks' loss sums into loss_carry (the global mean loss, summed over steps): a host
        sync, so only at checkpoints and epoch ends."""
        self.progress.loss_carry += self.loss_sum.item() / self.rt.world_size
        self.loss_sum.zero_()

    def save_just_in_time(self, why: str) -> None:
        """A step failed before its optimizer step, or a collective between steps failed (most often one whose peer
        was lost), or SIGTERM came: the state of the last step finished, which every DDP rank holds whole, saved by
        the first rank to claim it (checkpoint.save_just_in_time), so that the next attempt redoes no step: the
        weights and the optimizer as that step left them, the buffers as the failed step's forward found them
        (BufferCopy); the steps draw nothing from the global generators (the epoch plan holds the augmentation's
        draws). FSDP's state is spread over the ranks, the lost one's part with it: its newest regular checkpoint
        is used instead. SIGTERM (the launcher stopping this rank) waits until the file is whole."""
        args, p = self.args, self.progress
        if self.buffers is None or p.global_step == 0:
            return
        if (buffers := self.buffers.of_step(p.global_step, mine=self.rt.is_main)) is None:
            return  # the step failed in DDP's own broadcast of rank 0's buffers: this rank never had them
        began = time.perf_counter()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            self.fold_losses()
            saved = checkpoint.Checkpoint(
                replace(p, seconds_carry=p.seconds_carry + began - self.epoch_started), self.scheduler.state_dict(),
                checkpoint.Rng.capture(self.rt.device), self.model.state_dict() | buffers, self.optimizer.state_dict())
            path = checkpoint.save_just_in_time(saved, args.ckpt_dir, p.global_step)
            if path is not None:  # said before SIGTERM, held back meanwhile, may end the rank
                reason = re.sub(r"^\[[^]]*\] ", "", why).split(". ")[0][:200]  # gloo's "[pair.cc:545] Read error"
                print(f"checkpoint: {p.global_step} steps saved in {time.perf_counter() - began:.3f} s just in time, "
                      f"as {path.name} ({reason})", flush=True)  # no `step N` in it: not a progress line
        except Exception as exc:  # noqa: BLE001 - the step's own failure is what the rank must end with
            print(f"checkpoint: none saved just in time ({type(exc).__name__}: {exc})", flush=True)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    def save(self, seconds: float) -> None:
        """A checkpoint of the progress, with `seconds` of this epoch's training so far (a collective)."""
        if self.args.ckpt_dir is None:
            return
        self.fold_losses()
        began = time.perf_counter()
        saved = checkpoint.Checkpoint(replace(self.progress, seconds_carry=seconds), self.scheduler.state_dict(),
                                      checkpoint.Rng.capture(self.rt.device))
        self.parallel.save(self.optimizer, saved, self.args.ckpt_dir, self.progress.global_step, self.args.keep)
        # `N steps`, not `step N`: a progress pattern reads no step from it (health.checkpoint reads the seconds)
        self.log(f"checkpoint: {self.progress.global_step} steps saved in {time.perf_counter() - began:.3f} s")

    def end_epoch(self) -> None:
        """Score and record the epoch just ended (finished or stopped by --max-steps) and checkpoint; a
        finished one hands over to the next epoch with nothing carried."""
        p = self.progress
        self.fold_losses()
        seconds = p.seconds_carry + time.perf_counter() - self.epoch_started
        accuracy = self.evaluate()
        record = EpochRecord(
            epoch=p.epoch + 1, steps=p.step, loss=p.loss_carry / p.step, accuracy=accuracy,
            images_per_s=p.step * self.split.global_batch / seconds, seconds=seconds, world_size=self.rt.world_size,
            global_step=p.global_step,
        )
        p.history = [r for r in p.history if r.epoch != record.epoch] + [record]
        self.log(
            f"epoch {record.epoch}/{self.args.epochs}: train_loss {record.loss:.4f} test_acc {accuracy:.4f} "
            f"time {seconds:.1f}s img/s {record.images_per_s:.0f}"
            + ("" if p.step == self.steps_per_epoch else f" (stopped at step {p.step})")
        )
        if self.rt.is_main and self.args.out_dir is not None:
            metrics.write(self.args.out_dir, p.history)
        p.seconds_carry = seconds
        if p.step == self.steps_per_epoch:
            p.epoch, p.step = p.epoch + 1, 0
            p.loss_carry = p.seconds_carry = 0.0
        self.save(p.seconds_carry)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Test accuracy; each rank scores a disjoint slice, one all-reduce at the end. Every rank runs
        the same number of batches (a short slice is padded with image 0, not counted): under FSDP
        each forward is a collective."""
        rt, ds, batch_size = self.rt, self.ds, self.args.eval_batch_size
        self.model.eval()
        n = len(ds.test_y)
        mine = torch.arange(rt.rank, n, rt.world_size, device=rt.device)
        share = -(-n // rt.world_size)
        idx_all = torch.cat([mine, mine.new_zeros(share - len(mine))])
        correct = torch.zeros((), dtype=torch.int64, device=rt.device)
        for start, idx in zip(range(0, len(idx_all), batch_size), idx_all.split(batch_size), strict=True):
            counted = (torch.arange(start, start + len(idx), device=rt.device) < len(mine))
            with autocast(rt, self.args.precision):
                correct += ((self.model(self.norm(ds.test_x[idx])).argmax(1) == ds.test_y[idx]) & counted).sum()
        self.model.train()
        counts = runtime.all_reduce_sum(rt, torch.stack([correct, torch.tensor(len(mine), device=rt.device)]))
        return counts[0].item() / max(1, counts[1].item())

    def finish(self) -> None:
        """The final accuracy (the last record's when no step followed it), --save-final, and the last line."""
        p, rt = self.progress, self.rt
        last = p.history[-1] if p.history else None
        accuracy = last.accuracy if last is not None and last.global_step == p.global_step else self.evaluate()
        if self.args.save_final is not None and (final := self.parallel.full_state()) is not None:
            checkpoint.atomic_write(self.args.save_final, checkpoint.serialize(final))
        peak = runtime.peak_memory_mib(rt)
        held = runtime.most_of_any_rank(rt, strategies.state_mib(self.model, self.optimizer))
        self.log(
            f"done: test_acc={accuracy:.4f} global_step={p.global_step} world_size={rt.world_size} "
            f"seconds={time.perf_counter() - self.started:.1f} peak_memory_mib={peak:.0f} state_mib={held:.2f}"
        )


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


class BufferCopy:
    """A model's buffers as they were when a step's forward began (take), for a just-in-time checkpoint."""

    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        self.live = buffers
        self.copy = {name: buffer.clone() for name, buffer in buffers.items()}
        self.step: int | None = None  # the steps done when the copy was taken

    def take(self, done: int) -> None:
        """At each forward; a step's later micro-batches keep its first one's copy."""
        if self.step != done and self.live:
            torch._foreach_copy_(list(self.copy.values()), list(self.live.values()))
            self.step = done

    def of_step(self, done: int, mine: bool) -> dict[str, torch.Tensor] | None:
        """The buffers as `done` steps left them: the copy taken in the step after, else (its forward never
        ran) the live ones if they are rank 0's own (mine), else None: not known here."""
        if self.step == done:
            return self.copy
        return dict(self.live) if mine else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rt = runtime.setup(args.device, args.local_rank)
        Trainer(args, rt).run()
    except PayloadError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    except SystemExit as stopped:  # SIGTERM while training, after its just-in-time checkpoint (Trainer.run)
        return int(stopped.code or 0)
    # Only after success: tearing down while other ranks may still be inside a collective can hang.
    runtime.teardown(rt)
    return 0


if __name__ == "__main__":
    # Exit without interpreter finalization: a gloo worker thread may still be releasing the last
    # collective's tensors, and if that happens while Python shuts down, the process aborts
    # ("terminate called without an active exception", SIGABRT) after a run that succeeded.
    # A rank that fails (a lost peer's collective, after its just-in-time checkpoint) leaves the same way, its
    # traceback printed as Python would: finalizing would wait on the broken process group for seconds.
    try:
        code = main()
    except Exception:  # noqa: BLE001 - printed whole, as the interpreter prints an uncaught one
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
