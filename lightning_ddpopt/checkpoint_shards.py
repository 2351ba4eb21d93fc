"""What differs per rank in a checkpoint, as shards beside the file: every rank writes its own and reads its own.

A checkpoint saved at ``path`` by more than one rank keeps what is the same on every rank in the file (written by
rank 0, as Lightning's DDP strategies write it) and what differs per rank in the directory ``path + ".ddpopt"``,
written with ``torch.distributed.checkpoint`` (the library Lightning's FSDP uses for sharded checkpoints):

* ``hook/<rank>``: each rank's comm-hook state (PowerSGD's and int8's error feedback);
* ``inner/<rank>``: with local SGD, each replica's inner optimizer states, written by the replica's first rank only;
* ``outer/<start>/<name>``: an island's outer state (anchor, outer momentum, a sync still in flight) as the
  slices its ranks own, ``[start, stop)`` of the flattened parameters, written by the first island's ranks (every
  island holds the same).

Every rank writes its part at the same time; nothing is sent to rank 0 but DCP's plan (a few bytes per tensor), and
no tensor is copied on the way. At a resume every rank reads only its own part, alone (no collective): the file
that Lightning loads on every rank no longer holds every rank's state. An island's outer state is re-sharded on
load: each rank reads the saved slices its own slice overlaps, whatever the layout it was saved on.

The directory needs a filesystem that every rank sees, as FSDP's sharded checkpoints do. It is written as
``<dir>.partial`` and renamed once every rank has written, so a save that fails leaves the last good one.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_ddpopt._compat import PathType, dcp_load_alone

__all__ = [
    "SHARDS_SUFFIX",
    "ShardReader",
    "SlicedValues",
    "clear_partial",
    "find_shards",
    "remove_shards",
    "shard_directory",
    "shards_supported",
    "write_shards",
]

#: What the shards' directory adds to the checkpoint file's name.
SHARDS_SUFFIX = ".ddpopt"
_TENSOR = "ddpopt.tensor"  # a tensor's place in a state's skeleton: (_TENSOR, its index)
_SAVE_ID = "save_id"


def shard_directory(path: PathType) -> str:
    """Where a save at ``path`` writes the shards: beside it, ``path + ".ddpopt"``."""
    return os.fspath(path) + SHARDS_SUFFIX


def find_shards(path: PathType, name: str, save_id: str) -> tuple[ShardReader | None, str]:
    """The shards that the save ``save_id`` wrote for the checkpoint file ``path`` as the directory ``name``.

    Looked for beside the file a link ``path`` points to (``ModelCheckpoint``'s ``save_last="link"``), beside
    ``path``, and under their saved name beside either. Returns the reader, or ``None`` and why, in words.
    """
    path = os.fspath(path)
    beside = [shard_directory(os.path.realpath(path)), shard_directory(path)]
    places = list(dict.fromkeys([*beside, *(os.path.join(os.path.dirname(place), name) for place in beside)]))
    others = []
    for place in places:
        reader = ShardReader(place)
        if reader.exists():
            if reader.save_id() == save_id:
                return reader, ""
            others.append(place)
    if others:
        return None, f"the directory {others[0]} holds another save's (the file and its shards were not saved together)"
    return None, f"the directory {places[0]} is not there: copy or move it with the file"


def shards_supported(path: PathType) -> bool:
    """Whether a checkpoint at ``path`` can have shards: a local (or mounted) path, not a URL such as ``s3://``."""
    return "://" not in os.fspath(path)


def clear_partial(path: PathType) -> None:
    """Remove what a failed save left (rank 0, before the ranks meet to save; see :func:`write_shards`)."""
    shutil.rmtree(shard_directory(path) + ".partial", ignore_errors=True)


def write_shards(
    path: PathType,
    states: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    *,
    rank: int,
    group: dist.ProcessGroup | None,
    save_id: str,
) -> None:
    """Write this rank's part of the shards of the checkpoint at ``path``; a collective on ``group`` (every rank).

    ``states``: name -> a nested state (dicts, lists, tuples, numbers, strings and tensors, what
    ``torch.load(weights_only=True)`` reads), each read back whole by :meth:`ShardReader.state`. ``tensors``: name
    -> a tensor read back alone by :meth:`ShardReader.tensor`. Names are unique over the ranks. ``save_id``: this
    save's name, the same on every rank, which the file records too (:meth:`ShardReader.save_id`): a file is never
    read with another save's shards. Rank 0 must have called :func:`clear_partial` before the ranks met.
    """
    final = shard_directory(path)
    partial = final + ".partial"
    flat: dict[str, torch.Tensor] = {name: tensor.detach() for name, tensor in tensors.items()}
    for name, state in states.items():
        flat.update(_flatten(name, state))
    if rank == 0:
        flat[_SAVE_ID] = torch.tensor(list(save_id.encode()), dtype=torch.uint8)
    dcp.save(flat, storage_writer=dcp.FileSystemWriter(partial), process_group=group)
    # Every rank has written when DCP returns (its coordinator writes the metadata last).
    if rank == 0:
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)


def remove_shards(path: PathType) -> None:
    """Remove the shards saved at ``path``, if it has any (with the file, by ``ModelCheckpoint``).

    A link's target keeps its shards: call it before removing the link, or after (the link is then gone).
    """
    if shards_supported(path) and not os.path.islink(path):
        shutil.rmtree(shard_directory(path), ignore_errors=True)


class ShardReader:
    """Reads parts of a checkpoint's shards, each alone (no collective), only what is asked for.

    Args:
        directory: the shards' directory (:func:`shard_directory`).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._metadata: dcp.Metadata | None = None

    def exists(self) -> bool:
        """Whether the directory holds shards."""
        return os.path.isfile(os.path.join(self.directory, ".metadata"))

    def names(self) -> list[str]:
        """Every stored tensor's name."""
        return list(self._stored())

    def save_id(self) -> str | None:
        """The name of the save that wrote these shards (see :func:`write_shards`)."""
        if _SAVE_ID not in self._stored():
            return None
        return bytes(self.tensor(_SAVE_ID).tolist()).decode()

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor stored as ``name``, on the CPU."""
        return self._read([name])[name]

    def state(self, name: str) -> Any:
        """The nested state stored as ``name``, its tensors on the CPU; ``None`` when none was."""
        prefix = f"{name}/"
        names = [stored for stored in self._stored() if stored.startswith(prefix)]
        if not names:
            return None
        read = self._read(names)
        skeleton = torch.load(io.BytesIO(read[prefix + "skeleton"].numpy().tobytes()), weights_only=True)
        return _fill(skeleton, read, prefix)

    def _stored(self) -> dict[str, Any]:
        if self._metadata is None:
            self._metadata = dcp.FileSystemReader(self.directory).read_metadata()
        return self._metadata.state_dict_metadata

    def _read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        stored = self._stored()
        into = {name: torch.empty(stored[name].size, dtype=stored[name].properties.dtype) for name in names}
        dcp_load_alone(into, dcp.FileSystemReader(self.directory))
        return into


class SlicedValues:
    """One outer-state tensor of the whole model, stored as slices: read by the slice a rank owns.

    ``values[start:stop]`` reads the stored slices that overlap ``[start, stop)``, one at a time.

    Args:
        reader: the shards.
        name: the tensor's name in each slice (``anchor``, ``momentum``, ``mean``).
        slices: the stored slices' ``(start, stop)``, in order, end to end.
    """

    def __init__(self, reader: ShardReader, name: str, slices: Sequence[Sequence[int]]) -> None:
        self.reader, self.name = reader, name
        self.slices = [(int(start), int(stop)) for start, stop in slices]

    def numel(self) -> int:
        """The values of the whole model."""
        return self.slices[-1][1] if self.slices else 0

    def __getitem__(self, where: slice) -> torch.Tensor:
        start, stop, _ = where.indices(self.numel())
        pieces = []
        for low, high in self.slices:
            if low < stop and start < high and low < high:
                stored = self.reader.tensor(f"outer/{low}/{self.name}")
                pieces.append(stored[max(start, low) - low : min(stop, high) - low])
        return torch.cat(pieces) if pieces else torch.empty(0)


def _flatten(name: str, state: Any) -> dict[str, torch.Tensor]:
    """``state`` as tensors: its skeleton (the state with each tensor's index in its place, pickled) and the tensors."""
    found: list[torch.Tensor] = []

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            found.append(value.detach())
            return (_TENSOR, len(found) - 1)
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(item) for item in value)
        return value

    buffer = io.BytesIO()
    torch.save(strip(state), buffer)
    flat = {f"{name}/skeleton": torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)}
    flat.update({f"{name}/{index}": tensor for index, tensor in enumerate(found)})
    return flat


def _fill(skeleton: Any, read: dict[str, torch.Tensor], prefix: str) -> Any:
    if isinstance(skeleton, tuple) and len(skeleton) == 2 and skeleton[0] == _TENSOR:
        return read[f"{prefix}{skeleton[1]}"]
    if isinstance(skeleton, dict):
        return {key: _fill(item, read, prefix) for key, item in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(item, read, prefix) for item in skeleton)
    return skeleton
