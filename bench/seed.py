"""The seed recipe: the CIFAR-10 DDP training loop the blog posts use, as the baseline to beat.

fp32, one PIL image per sample through torchvision transforms (RandomCrop(32, padding=4),
RandomHorizontalFlip, ToTensor, Normalize), a DataLoader with a DistributedSampler and worker
processes from the CPU count, NCHW tensors, and the payload's own ResNet-18 (CIFAR stem) or small
model, so that model and batch are the same as in the payload rows. No CIFAR download here: the
images are the payload's synthetic CIFAR-shaped uint8 data, held as HWC arrays and handed out as
PIL images, exactly as torchvision's CIFAR10 dataset does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from bench import procs
from harness.payload import data
from harness.payload import model as models


class PILImages(Dataset):
    """torchvision.datasets.CIFAR10 without the download: HWC uint8 arrays -> PIL -> transform."""

    def __init__(self, images: np.ndarray, labels: np.ndarray,
                 transform: Callable[[Image.Image], torch.Tensor]) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


def loader(n_images: int, batch_size: int, *, seed: int = 0, workers: int | None = None,
           pin_memory: bool = False) -> DataLoader[tuple[torch.Tensor, int]]:
    """The seed recipe's input pipeline over n_images synthetic CIFAR-shaped images (one process, rank 0)."""
    from torchvision import transforms

    ds = data.synthetic(seed, n_images, 1)
    transform = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(ds.mean, ds.std),
    ])
    images = PILImages(ds.train_x.permute(0, 2, 3, 1).contiguous().numpy(), ds.train_y.numpy(), transform)
    sampler: DistributedSampler[tuple[torch.Tensor, int]] = DistributedSampler(
        images, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
    workers = procs.cpu_count() if workers is None else workers
    return DataLoader(images, batch_size=batch_size, sampler=sampler, num_workers=workers, drop_last=True,
                      pin_memory=pin_memory, persistent_workers=workers > 0)


def images_per_second(model_name: str, batch_size: int, warmup: int, steps: int, device: torch.device,
                      *, train: bool = True, workers: int | None = None) -> float:
    """Steady-state training images/s of the seed recipe (train=False: the input pipeline alone)."""
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    if cuda:  # the recipe's defaults, whatever an earlier measurement in this process set
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
    net = models.build(model_name, 3, 10).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    batches = loader(batch_size * (warmup + steps), batch_size, workers=workers, pin_memory=cuda)
    assert isinstance(batches.sampler, DistributedSampler)
    batches.sampler.set_epoch(0)
    running_loss = 0.0
    started = None
    for i, (images, labels) in enumerate(batches):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
        if not train:
            continue
        x, y = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        running_loss += loss.item()  # the recipe's per-step host sync
    if cuda:
        torch.cuda.synchronize()
    assert started is not None
    return steps * batch_size / (time.perf_counter() - started)
