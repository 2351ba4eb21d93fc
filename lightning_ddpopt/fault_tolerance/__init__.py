"""Fault-tolerant replicas on torchft: a run that loses an island goes on, and the island heals back in.

Each island (a replica of the model: one rank, or the ranks of a node) is a replica group of torchft's quorum, run
as a Lightning job of its own. Inside an island DDP syncs every step as always; across islands each step's
gradients are averaged over the islands that take part, and the step commits only where every one of them
succeeded. A lost island's step is dropped, the others go on; a restarted island receives a live peer's whole
training state at its first quorum and takes the next step with them. A Lighthouse (``ddpopt lighthouse``) forms
the quorums. Needs the ``[ft]`` extra (torchft, torch >= 2.7); the local SGD guide has the set-up.

* :mod:`~lightning_ddpopt.fault_tolerance.config`: :class:`FaultTolerance`, the user's arguments.
* :mod:`~lightning_ddpopt.fault_tolerance.lighthouse`: the quorum server and the check that it answers.
* :mod:`~lightning_ddpopt.fault_tolerance.replica`: the island's torchft manager, the average, the vote.
* :mod:`~lightning_ddpopt.fault_tolerance.state`: the training state a returning island heals from.
* :mod:`~lightning_ddpopt.fault_tolerance.driver`: how the strategy runs a fault-tolerant step.
"""

from lightning_ddpopt.fault_tolerance.config import FaultTolerance, require_torchft

__all__ = ["FaultTolerance", "require_torchft"]
