"""Orthonormal columns for PowerSGD: the seeded start of the power iteration and the orthogonalisation of P.

Both give the same bits on every rank: the start is drawn by the CPU generator from ``(seed, iteration, key)``,
and with numba the orthogonalisation runs as a loop whose arithmetic does not depend on the thread count.
"""

from __future__ import annotations

import zlib

import torch

from lightning_ddpopt.hooks import _kernels
from lightning_ddpopt.hooks.powersgd_config import PowerSGDConfig

__all__ = ["orthogonalize", "random_q"]


def random_q(
    config: PowerSGDConfig, iteration: int, key: str, shape: tuple[int, int], loops: bool = False
) -> torch.Tensor:
    """The orthonormal start of the power iteration, seeded by (seed, iteration, key): the same on every rank.

    Drawn by the CPU generator: a GPU's generator spreads its draws over the device's multiprocessors, so GPUs of
    different models could draw different values.
    """
    # The CPU generator keeps only a seed's low 32 bits, so all three go through one 32-bit hash.
    seed = zlib.crc32(f"{config.seed}/{iteration}/{key}".encode())
    q = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    orthogonalize(q, config.orthogonalization_epsilon, loops)
    return q


def orthogonalize(matrix: torch.Tensor, epsilon: float, loops: bool = False) -> None:
    """Make the columns of ``matrix`` orthonormal, in place, computing in fp32.

    ``loops``: through numba's loop, the same bits whatever the thread count.
    """
    if loops and _kernels.fits(matrix):
        _kernels.orthogonalize(matrix, epsilon)
        return
    work = matrix.float()
    if epsilon == 0:
        work = torch.linalg.qr(work, mode="reduced").Q
    else:
        for i in range(work.shape[1]):
            column = work[:, i : i + 1]
            column.div_(column.norm() + epsilon)
            if i + 1 < work.shape[1]:
                rest = work[:, i + 1 :]
                rest.sub_(column @ (column.t() @ rest))
    matrix.copy_(work)
