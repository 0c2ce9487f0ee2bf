"""DALI pipelines: each batch of a ``DrawPlan`` made inside the DALI graph, on the training device.

The graph (``_graph``) reads as its stages: source, cut, rotate, layout, cast; its outputs are ``OUTPUTS``. Where
the crops come from is the storage mode's crop source (``CropSource``): ``HostCrops``, ``ResidentCrops``,
``NumpyCrops`` and ``BatcherCrops`` below. The same graph runs on the CPU (``device_id=None``) and on a GPU;
docs/data.md (The pipeline) tells why each mode is cut where it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from nvidia.dali import fn, ops, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator
from torch.utils.dlpack import to_dlpack

from pipeline.crops import CropBatcher
from pipeline.device_cut import DeviceCutter
from pipeline.rotations import AXIS_PERMUTATIONS, VectorGroups, channel_order
from pipeline.sampling import Augmenter, DrawPlan, SampleDraw
from pipeline.volumes import VolumeFiles, VolumePair

# DALI has no bfloat16: such batches leave the pipeline as float32 and are cast by torch.
_DALI_DTYPES = {torch.float32: types.FLOAT, torch.float16: types.FLOAT16, torch.bfloat16: types.FLOAT}
_SPATIAL = [1, 2, 3]  # the spatial axes of a CDHW sample


# The graph's outputs, named for the iterator.
OUTPUTS = ("inputs", "targets")
# The per-sample rotation arguments the feed hands over where the graph rotates.
ROTATION_ARGUMENTS = ("perm_index", "flips", "input_signs", "target_signs")


def _rotation_arrays(draws: list[SampleDraw], augmenter: Augmenter) -> dict[str, np.ndarray]:
    """The batch's ``ROTATION_ARGUMENTS``: per sample, axis-order index, flips, input and target signs."""
    args = [augmenter.args(d) for d in draws]
    return {
        "perm_index": np.array([a.perm_index for a, _ in args], dtype=np.int32),
        "flips": np.stack([a.flips for a, _ in args]),
        "input_signs": np.stack([a.sign for a, _ in args]),
        "target_signs": np.stack([b.sign for _, b in args]),
    }


class CropSource(Protocol):
    """Where a graph's crops come from (a storage mode), and how much of the batch it makes itself.

    ``feeds`` names what ``feed`` hands the graph for each batch, with each one's layout; ``cut`` turns those nodes
    (and ``corners``, the crops' corners, where ``cut_at_corners``) into the (inputs, targets) nodes of the crops.
    """

    feeds: dict[str, str]  # name -> DALI layout ("" for arguments) of what ``feed`` returns
    cut_at_corners: bool  # the graph cuts at each sample's corner, fed as "corners"
    rotated: bool  # the crops come out of ``cut`` rotated already
    finished: bool  # ``cut`` makes the training batch itself: rotated, laid out and cast
    channels_last: bool  # ``cut`` returns DHWC samples
    padded: bool  # a reader that always reads a full batch: a short last batch is padded, then trimmed
    threads: int  # DALI's CPU threads

    def feed(self, epoch: int, index: int, draws: list[SampleDraw]) -> dict[str, Any]: ...

    def cut(self, nodes: dict[str, Any], crop_size: int, *, on_gpu: bool) -> tuple[Any, Any]: ...

    def close(self) -> None: ...


def _to_device(nodes: tuple[Any, Any], *, on_gpu: bool) -> tuple[Any, Any]:
    """The nodes on the GPU where the graph runs there."""
    return (nodes[0].gpu(), nodes[1].gpu()) if on_gpu else nodes


class BatcherCrops:
    """Crops cut by a ``CropBatcher`` (rotated already where ``batcher.rotate_here``), a batch at a time."""

    padded, finished, cut_at_corners = False, False, False

    def __init__(self, batcher: CropBatcher) -> None:
        self.batcher = batcher
        self.rotated = batcher.rotate_here
        self.channels_last = batcher.channels_last  # the batcher cut channels-last already
        layout = "DHWC" if batcher.channels_last else "CDHW"
        self.feeds = {"inputs": layout, "targets": layout}
        self.threads = 1  # the graph's CPU work is bookkeeping: the batcher's threads cut the crops

    def feed(self, epoch: int, index: int, draws: list[SampleDraw]) -> dict[str, Any]:
        inputs, targets, _ = self.batcher.get(epoch, index).contiguous()
        return {"inputs": inputs, "targets": targets}

    def cut(self, nodes: dict[str, Any], crop_size: int, *, on_gpu: bool) -> tuple[Any, Any]:
        return _to_device((nodes["inputs"], nodes["targets"]), on_gpu=on_gpu)

    def close(self) -> None:
        self.batcher.close()


class HostCrops:
    """Crops sliced by DALI's CPU threads out of volumes in host memory, handed to the graph without a copy."""

    padded, rotated, finished, cut_at_corners, channels_last = False, False, False, True, False
    feeds = {"nbody": "CDHW", "hydro": "CDHW"}

    def __init__(self, volumes: VolumePair, threads: int) -> None:
        self.nbody, self.hydro = volumes.nbody, volumes.hydro  # contiguous float32 (VolumePair.load)
        self.threads = threads

    def feed(self, epoch: int, index: int, draws: list[SampleDraw]) -> dict[str, Any]:
        # The same array for every sample: DALI takes the list as it is, with no copy.
        return {"nbody": [self.nbody] * len(draws), "hydro": [self.hydro] * len(draws)}

    def cut(self, nodes: dict[str, Any], crop_size: int, *, on_gpu: bool) -> tuple[Any, Any]:
        shape = np.full(3, crop_size, np.int32)
        inputs = fn.slice(
            nodes["nbody"], nodes["corners"], shape, axes=_SPATIAL, normalized_anchor=False, normalized_shape=False
        )
        targets = fn.slice(
            nodes["hydro"], nodes["corners"], shape, axes=_SPATIAL, normalized_anchor=False, normalized_shape=False
        )
        return _to_device((inputs, targets), on_gpu=on_gpu)

    def close(self) -> None:
        pass


class ResidentCrops:
    """The training batch itself, made from volumes held by this object by ``DeviceCutter`` in a function that
    DALI calls with each batch's draws: crops cut, rotated, laid out (channels-last) and cast in three passes over
    the batch, and a fourth where DALI copies them into its output. On a GPU the volumes are resident in its memory
    and the function runs on DALI's CUDA stream; on the CPU they are host tensors."""

    padded, rotated, finished, cut_at_corners = False, True, True, False
    feeds = {"draws": ""}  # each sample's (rotation, corner)

    def __init__(
        self,
        nbody: torch.Tensor,
        hydro: torch.Tensor,
        augmenter: Augmenter,
        *,
        crop_size: int,
        dtype: torch.dtype,
        channels_last: bool,
    ) -> None:
        self.volumes = (nbody, hydro)
        self.on_gpu = nbody.device.type == "cuda"
        self.cutter = DeviceCutter(augmenter, crop_size, nbody.device)
        if self.on_gpu:  # the cutter's tables, made on this stream, are read on DALI's
            torch.cuda.synchronize(nbody.device)
        self.dtypes = (torch.float32 if _DALI_DTYPES[dtype] == types.FLOAT else dtype, torch.float32)
        self.channels_last = channels_last  # the layout this function makes (the graph adds none: finished)
        self.threads = 1  # nothing is cut on the CPU's threads

    def feed(self, epoch: int, index: int, draws: list[SampleDraw]) -> dict[str, Any]:
        return {"draws": DeviceCutter.host_arguments(draws, cut_already=False).numpy()}

    def _make(self, draws: list[Any]) -> tuple[Any, Any]:
        """Called by DALI with the batch's draws (DLPack, on the volumes' device): the batch's inputs and targets."""
        if not self.on_gpu:
            return self._batch(draws)
        # DALI's stream: the graph's work before and after this call is ordered with the cutter's without a host
        # sync, and memory that torch frees here is reused on that stream only, after DALI has copied the batch.
        device = self.volumes[0].device
        stream = torch.cuda.ExternalStream(ops.PythonFunction.current_stream().ptr, device=device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            return self._batch(draws)

    def _batch(self, draws: list[Any]) -> tuple[Any, Any]:
        args = torch.stack([torch.from_dlpack(d) for d in draws])
        batch = self.cutter(self.volumes, args, self.dtypes, channels_last=self.channels_last)
        if self.channels_last:  # the NDHWC memory the cutter wrote, which DALI takes as DHWC samples
            batch = [t.permute(0, 2, 3, 4, 1) for t in batch]
        # Per output, one DLPack per sample: views of the batch, which DALI copies into its own buffer.
        return tuple([to_dlpack(sample) for sample in t] for t in batch)

    def cut(self, nodes: dict[str, Any], crop_size: int, *, on_gpu: bool) -> tuple[Any, Any]:
        if on_gpu != self.on_gpu:
            raise ValueError("resident volumes must be on the device the graph runs on")
        layout = "DHWC" if self.channels_last else "CDHW"
        return fn.dl_tensor_python_function(
            nodes["draws"].gpu() if on_gpu else nodes["draws"],
            function=self._make,
            num_outputs=2,
            batch_processing=True,
            synchronize_stream=False,
            device="gpu" if on_gpu else "cpu",
            output_layouts=[layout, layout],
        )

    def close(self) -> None:
        self.volumes = ()


class NumpyCrops:
    """Crops read from .npy files by DALI's numpy reader, each a region of interest of the file. The reader
    reads a fixed number of samples per batch: a short last batch is padded and trimmed by ``DaliLoader``."""

    padded, rotated, finished, cut_at_corners, channels_last = True, False, False, True, False
    feeds: dict[str, str] = {}  # the reader reads the files itself; only the corners are fed

    def __init__(self, volumes: VolumePair, batch_size: int, threads: int) -> None:
        files: VolumeFiles = volumes.files
        self.paths = [str(files.inputs), str(files.targets)]
        self.dtypes = [volumes.nbody.dtype, volumes.hydro.dtype]
        self.files_channels_last = files.npy_layout == "DHWC"
        self.batch_size, self.threads = batch_size, threads

    def feed(self, epoch: int, index: int, draws: list[SampleDraw]) -> dict[str, Any]:
        return {}

    def cut(self, nodes: dict[str, Any], crop_size: int, *, on_gpu: bool) -> tuple[Any, Any]:
        out = []
        for path, dtype in zip(self.paths, self.dtypes):  # noqa: B905 (DALI's autograph knows no strict=)
            crop = fn.readers.numpy(  # on the CPU: see the module's docstring for the GPU reader
                files=[path] * self.batch_size,
                roi_start=nodes["corners"],
                roi_shape=[crop_size] * 3,
                roi_axes=[0, 1, 2] if self.files_channels_last else _SPATIAL,
                out_of_bounds_policy="error",
                random_shuffle=False,
            )
            if on_gpu:
                crop = crop.gpu()
            if self.files_channels_last:
                crop = fn.transpose(crop, perm=[3, 0, 1, 2], transpose_layout=False)
            if dtype != np.float32:
                crop = fn.cast(crop, dtype=types.FLOAT)
            out.append(fn.reshape(crop, layout="CDHW"))
        return out[0], out[1]

    def close(self) -> None:
        pass


def _position(info: Any, first_epoch: int, first_batch: int, *, num_batches: int) -> tuple[int, int]:
    """(epoch, batch) for DALI's (epoch_idx, iteration); the first epoch starts at ``first_batch``."""
    batch = info.iteration + (first_batch if info.epoch_idx == 0 else 0)
    if batch >= num_batches:
        raise StopIteration
    return first_epoch + info.epoch_idx, batch


class _Feed:
    """External-source callback: for DALI's (epoch, iteration), the arrays named in ``outputs``: what the crops'
    source hands over, the corners of the crops where the graph cuts them, and the rotation arguments where it
    rotates."""

    def __init__(
        self,
        plan: DrawPlan,
        augmenter: Augmenter,
        crops: CropSource,
        *,
        first_epoch: int,
        first_batch: int,
        rotate_here: bool,
    ) -> None:
        self.plan, self.augmenter, self.crops = plan, augmenter, crops
        self.first_epoch, self.first_batch, self.rotate_here = first_epoch, first_batch, rotate_here
        self.outputs = dict(crops.feeds)  # the external source's outputs in order: name -> layout
        if crops.cut_at_corners:
            self.outputs["corners"] = ""
        if rotate_here:
            self.outputs.update(dict.fromkeys(ROTATION_ARGUMENTS, ""))

    def __call__(self, info: Any) -> list[Any]:  # info: nvidia.dali.types.BatchInfo
        epoch, index = _position(info, self.first_epoch, self.first_batch, num_batches=self.plan.num_batches)
        draws = self.plan.batch_draws(epoch, index)
        if self.crops.padded:  # a short last batch, filled up to the reader's batch size with its last sample
            draws = draws + draws[-1:] * (self.plan.batch_size - len(draws))
        arrays = self.crops.feed(epoch, index, draws)
        if self.crops.cut_at_corners:
            arrays["corners"] = np.array([d.corner for d in draws], dtype=np.int32)
        if self.rotate_here:
            arrays.update(_rotation_arrays(draws, self.augmenter))
        return [arrays[name] for name in self.outputs]


def _gather_channels(x, order: tuple[int, ...]):
    """Reorder the channels of a CDHW DataNode (a static order), copying runs of consecutive channels at once."""
    if order == tuple(range(len(order))):
        return x
    runs: list[list[int]] = []
    for c in order:
        if runs and c == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([c, c + 1])
    return fn.cat(*(x[start:stop] for start, stop in runs), axis=0)


def rotate(x, perm_index, flips, *, sign, num_channels: int, vectors: VectorGroups):
    """Rotate a CDHW DataNode as ``pipeline.rotations.rotate_into`` does, exactly.

    ``fn.transpose`` takes no per-sample permutation, so each of the six axis orders is a branch
    (DALI conditionals split the batch by ``perm_index``); its channel reorder is static within the
    branch. Flips and the sign of the vector components are per-sample arguments.
    """
    y = x
    for i, perm in enumerate(AXIS_PERMUTATIONS):
        if i == 0:
            continue  # the identity order
        if perm_index == i:
            y = fn.transpose(x, perm=[0, *(1 + p for p in perm)], transpose_layout=False)
            y = _gather_channels(y, channel_order(perm, num_channels, vectors))
    y = fn.flip(y, depthwise=flips[0], vertical=flips[1], horizontal=flips[2])
    return y * sign


def _source(feed: _Feed) -> dict[str, Any]:
    """The external source's outputs, by name."""
    nodes = fn.external_source(
        feed,
        num_outputs=len(feed.outputs),
        batch=True,
        batch_info=True,
        no_copy=True,
        layout=list(feed.outputs.values()),
    )
    return dict(zip(feed.outputs, nodes))  # noqa: B905 (DALI's autograph knows no strict=)


def _rotated(inputs, targets, nodes: dict[str, Any], *, augmenter: Augmenter, on_gpu: bool):
    """Inputs and targets turned by each sample's rotation, vector channels with them."""
    input_signs, target_signs = nodes["input_signs"], nodes["target_signs"]
    if on_gpu:
        input_signs, target_signs = input_signs.gpu(), target_signs.gpu()
    perm_index, flips = nodes["perm_index"], nodes["flips"]
    inputs = rotate(
        inputs, perm_index, flips, sign=input_signs, num_channels=augmenter.in_channels, vectors=augmenter.in_vectors
    )
    targets = rotate(
        targets,
        perm_index,
        flips,
        sign=target_signs,
        num_channels=augmenter.out_channels,
        vectors=augmenter.out_vectors,
    )
    return inputs, targets


def _channels_last(x):
    """CDHW to DHWC samples: NDHWC batches, the model's memory format."""
    return fn.transpose(x, perm=[1, 2, 3, 0], transpose_layout=False)


@pipeline_def(enable_conditionals=True)
def _graph(feed: _Feed, crop_size: int, *, on_gpu: bool, dtype, channels_last: bool):
    """Source, cut, rotate, layout, cast: the training batch's ``OUTPUTS``."""
    crops = feed.crops
    nodes = _source(feed)  # source
    inputs, targets = crops.cut(nodes, crop_size, on_gpu=on_gpu)  # cut
    if crops.finished:  # the crops' own function made the training batch (ResidentCrops)
        return inputs, targets
    if feed.rotate_here:  # rotate
        inputs, targets = _rotated(inputs, targets, nodes, augmenter=feed.augmenter, on_gpu=on_gpu)
    if channels_last and not crops.channels_last:  # layout
        inputs, targets = _channels_last(inputs), _channels_last(targets)
    if dtype != types.FLOAT:  # cast
        inputs = fn.cast(inputs, dtype=dtype)
    return inputs, targets


class DaliLoader:
    """Iterates over one epoch of (input, target) torch tensors per ``for`` loop, made by a DALI graph from ``crops`` on
    the GPU ``device_id``, or on the CPU where it is None.

    Inputs come in ``dtype`` (the engine's), targets in float32; NDHWC in memory with ``channels_last``. The first
    epoch starts at batch ``first_batch`` (a run resumed part-way through it); ``prefetch`` batches are made ahead.
    """

    def __init__(
        self,
        *,
        plan: DrawPlan,
        augmenter: Augmenter,
        crops: CropSource,
        device_id: int | None,
        dtype: torch.dtype,
        first_epoch: int = 0,
        first_batch: int = 0,
        channels_last: bool = False,
        prefetch: int = 1,
    ) -> None:
        self.plan, self.crops, self.dtype, self.channels_last = plan, crops, dtype, channels_last
        self._first_batch = first_batch
        feed = _Feed(
            plan,
            augmenter,
            crops,
            first_epoch=first_epoch,
            first_batch=first_batch,
            rotate_here=plan.rotate and not crops.rotated,
        )
        pipe = _graph(
            feed=feed,
            crop_size=plan.crop_size,
            on_gpu=device_id is not None,
            dtype=_DALI_DTYPES[dtype],
            channels_last=channels_last,
            batch_size=plan.batch_size,
            num_threads=crops.threads,
            device_id=device_id,
            # A batcher works ahead itself and its ring holds two batches for DALI (``batches_held``).
            prefetch_queue_depth=1 if isinstance(crops, BatcherCrops) else max(1, prefetch),
            seed=0,  # the graph draws nothing itself: all randomness comes from the plan
        )
        # The epoch ends when the feed raises StopIteration; auto_reset starts the next one.
        self._iterator = DALIGenericIterator([pipe], list(OUTPUTS), auto_reset=True)

    @property
    def batcher(self) -> CropBatcher | None:
        return self.crops.batcher if isinstance(self.crops, BatcherCrops) else None

    def close(self) -> None:
        """Stop the work the crops' source had started ahead (a batcher's threads)."""
        self.crops.close()

    def __len__(self) -> int:
        return self.plan.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        first, self._first_batch = self._first_batch, 0
        for index, batch in enumerate(self._iterator, first):
            inputs, targets = (batch[0][name] for name in OUTPUTS)
            if self.crops.padded:  # the samples that fill up a short last batch go
                size = min(self.plan.batch_size, self.plan.num_samples - index * self.plan.batch_size)
                inputs, targets = inputs[:size], targets[:size]
            if self.channels_last:  # NDHWC in memory, seen as NCDHW: channels_last_3d strides, no copy
                inputs, targets = inputs.permute(0, 4, 1, 2, 3), targets.permute(0, 4, 1, 2, 3)
            if inputs.dtype != self.dtype:  # bfloat16 only: one cast kernel per batch (keeps the memory format)
                inputs = inputs.to(self.dtype)
            yield inputs, targets
