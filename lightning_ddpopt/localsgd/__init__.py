"""Local SGD and DiLoCo: each rank takes ``H`` optimizer steps on its own, then the ranks average what changed.

When even compressed gradient syncs cost more than the compute, syncing less often is the lever: after
``warmup_steps`` ordinary synchronous steps, gradients are not all-reduced at all (DDP's backward sync is off, so
no bucket reaches a hook), and every ``sync_every`` optimizer steps the ranks all-reduce the change of their
parameters since the last sync (the *outer gradient* ``anchor - params``), take one outer optimizer step on the
anchor (SGD, optionally with Nesterov momentum: DiLoCo, Douillard et al. 2023) and all continue from the new
anchor, identical on every rank. With ``outer_lr=1`` and no momentum that is plain parameter averaging (post-local
SGD, Lin et al. 2020). Floating-point buffers (batch-norm statistics) are averaged at the same point, others
broadcast from rank 0.

The schedule counts optimizer step *calls*, the same on every rank: under fp16 AMP a rank whose GradScaler skips
an inner step (in the local phase each rank's scaler sees only its own gradients) still counts it, so every rank
reaches each sync together; skipped inner steps are counted per sync window.

``sync_every="auto"`` trains the first window after the warm-up with a provisional H, measures its steps and its
sync, and every rank takes the same H from the ranks' figures after that sync; ``diloco()``'s outer learning
rate and momentum follow the inner optimizer (``"auto"``). See :class:`LocalSGDConfig`.

Inner optimizer state (momentum, Adam moments) stays local to each rank, as in DiLoCo; the strategy saves every
rank's in the checkpoint, with the anchor and the outer momentum, so a resume at a sync boundary continues
exactly. A resume between syncs continues from rank 0's parameters on every rank (the checkpoint holds one copy
of the weights): the ranks' local progress since the last sync is replaced by rank 0's.
"""

from lightning_ddpopt.localsgd.config import LocalSGDConfig
from lightning_ddpopt.localsgd.driver import LocalSGDDriver
from lightning_ddpopt.localsgd.outer import LocalSGD, ParameterSync, SyncEveryChoice

__all__ = ["LocalSGD", "LocalSGDConfig", "LocalSGDDriver", "ParameterSync", "SyncEveryChoice"]
