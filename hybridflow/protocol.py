"""The data protocol: `DataProto`, the batch that moves between the driver and the workers.

A `DataProto` has three parts that share one batch dimension:
- `batch`: a `TensorDict` of tensors (`input_ids`, `responses`, `advantages`, ...),
- `non_tensor_batch`: a dict of 1-D numpy object arrays (`data_source`, `uid`, raw prompts, ...),
- `meta_info`: a plain dict of batch-level values (sampling settings, `metrics`, ...).

The API follows verl's so that code written against it only changes the import.
"""

from __future__ import annotations

import copy
import io
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

__all__ = [
    "DataProto",
    "DataProtoItem",
    "DataProtoFuture",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "union_tensor_dict",
    "union_numpy_dict",
]


def _as_object_array(values: Any, key: str) -> np.ndarray:
    """`values` as a numpy array with one entry per row: a numpy array as it is (its dtype and trailing dimensions
    kept, as verl keeps them), anything else (a list, lists of lists) as a 1-D object array."""
    if isinstance(values, np.ndarray) and values.ndim >= 1:
        return values
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def union_tensor_dict(left: TensorDict, right: TensorDict) -> TensorDict:
    """Merge `right` into `left`; a key present in both must hold equal tensors."""
    if left.batch_size != right.batch_size:
        raise ValueError(f"cannot union batches of sizes {left.batch_size} and {right.batch_size}")
    for key in right.keys():
        if key in left.keys():
            if not torch.equal(left[key], right[key]):
                raise ValueError(f"union: key {key!r} is in both batches with different values")
        else:
            left[key] = right[key]
    return left


def union_numpy_dict(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Merge `right` into `left`; a key present in both must hold equal arrays."""
    for key, value in right.items():
        if key in left:
            same = len(left[key]) == len(value) and all(
                _objects_equal(a, b) for a, b in zip(left[key], value, strict=True)
            )
            if not same:
                raise ValueError(f"union: non-tensor key {key!r} is in both batches with different values")
        else:
            left[key] = value
    return left


def _objects_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):  # e.g. a row's multi_modal_inputs (tensors)
        return a.keys() == b.keys() and all(_objects_equal(a[key], b[key]) for key in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        try:
            return bool(np.array_equal(a, b, equal_nan=True))
        except TypeError:  # object arrays: NaN inside them compared as values below
            pass
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True  # a copy of the same NaN (verl's union treats them as equal)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_objects_equal(x, y) for x, y in zip(a, b))
    result = a == b
    if isinstance(result, np.ndarray):
        return bool(result.all())
    return bool(result)


def _check_concatenable(batches: Sequence[TensorDict]) -> None:
    """The same tensor keys with the same trailing shapes in every part (e.g. ranks that padded their responses
    to different lengths), or an error naming the key and the parts, instead of tensordict's bare one."""
    keys = set(batches[0].keys())
    for position, part in enumerate(batches[1:], start=1):
        if set(part.keys()) != keys:
            raise ValueError(f"concat: part {position} has tensor keys {sorted(part.keys())}, part 0 has "
                             f"{sorted(keys)}")
    for key in sorted(keys):
        shapes = [tuple(part[key].shape[1:]) for part in batches]
        if len(set(shapes)) > 1:
            raise ValueError(f"concat: tensor {key!r} has per-row shapes {shapes} across the parts; they must match "
                             "(pad every part to the same length first)")


def _merge_meta(metas: Sequence[dict]) -> dict:
    """Merge meta_info dicts for `concat`: `metrics` are merged key by key into lists; for any other key the
    first DataProto's value is kept (as verl's concat keeps the first's meta_info)."""
    merged: dict[str, Any] = {}
    metrics: dict[str, list] = {}
    for meta in metas:
        for key, value in meta.items():
            if key == "metrics":
                items = value if isinstance(value, list) else [value]
                for item in (item for item in items if item):  # a part without metrics (None, {}) adds none
                    for name, number in item.items():
                        metrics.setdefault(name, []).extend(number if isinstance(number, list) else [number])
            elif key not in merged:
                merged[key] = value
    if metrics:
        merged["metrics"] = metrics
    return merged


@dataclass
class DataProtoItem:
    """One row of a `DataProto` (what `data[i]` returns for an int `i`)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataProto:
    """A batch: tensors in `batch`, per-sample Python objects in `non_tensor_batch`, batch-level `meta_info`."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check_consistency()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build from a dict of tensors (same first dimension), per-sample lists/arrays, and meta info."""
        tensors = tensors or {}
        non_tensors = {key: _as_object_array(value, key) for key, value in (non_tensors or {}).items()}
        batch = None
        if tensors:
            sizes = {key: value.shape[0] for key, value in tensors.items()}
            if len(set(sizes.values())) != 1:
                raise ValueError(f"tensors must share their first dimension, got sizes {sizes}")
            batch = TensorDict(dict(tensors), batch_size=[next(iter(sizes.values()))])
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None) -> DataProto:
        """Build from one dict, sending tensors to `batch` and numpy arrays/lists to `non_tensor_batch`."""
        tensors = {key: value for key, value in data.items() if isinstance(value, torch.Tensor)}
        non_tensors = {key: value for key, value in data.items() if not isinstance(value, torch.Tensor)}
        for key, value in non_tensors.items():
            if not isinstance(value, (np.ndarray, list, tuple)):
                raise TypeError(f"from_single_dict: {key!r} must be a tensor, numpy array or list, got {type(value)}")
        return cls.from_dict(tensors, non_tensors, meta_info)

    def check_consistency(self) -> None:
        """Raise if the tensor batch and the non-tensor arrays do not share one batch size."""
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise ValueError(f"batch must have exactly one batch dimension, got {self.batch.batch_size}")
        sizes = {key: len(value) for key, value in self.non_tensor_batch.items()}
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(f"non_tensor_batch[{key!r}] must be a numpy array, got {type(value)}")
        if self.batch is not None:
            sizes = {"batch": self.batch.batch_size[0], **sizes}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"mismatched batch lengths: {sizes}")

    # ---------------------------------------------------------------- size and access
    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.batch_size[0]
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    def __getitem__(self, item: int | slice | list | np.ndarray | torch.Tensor) -> DataProto | DataProtoItem:
        """`data[i]` gives a `DataProtoItem`; a slice, list, bool mask or index tensor gives a `DataProto`."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)):
            index = int(item)
            if not -len(self) <= index < len(self):
                raise IndexError(f"index {index} out of range for a DataProto of length {len(self)}")
            batch = self.batch[index] if self.batch is not None else None
            non_tensor = {key: value[index] for key, value in self.non_tensor_batch.items()}
            return DataProtoItem(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)
        raise TypeError(f"DataProto indices must be int, slice, list, ndarray or tensor, got {type(item)}")

    def __iter__(self) -> Iterator[DataProtoItem]:
        for index in range(len(self)):
            yield self[index]

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows `start:end:step` as a new DataProto (tensors are views)."""
        window = slice(start, end, step)
        batch = self.batch[window] if self.batch is not None else None
        non_tensor = {key: value[window] for key, value in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def select_idxs(self, idxs: list | np.ndarray | torch.Tensor) -> DataProto:
        """Rows at integer positions or where a boolean mask is True."""
        index = torch.as_tensor(np.asarray(idxs) if isinstance(idxs, list) else idxs)
        if index.dtype == torch.bool:
            if index.shape[0] != len(self):
                raise ValueError(f"boolean mask has length {index.shape[0]}, DataProto has {len(self)}")
            index = index.nonzero().flatten()
        index = index.long()
        batch = self.batch[index] if self.batch is not None else None
        np_index = index.numpy()
        non_tensor = {key: value[np_index] for key, value in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the named keys (None keeps all keys of that part)."""
        batch = self.batch
        if batch_keys is not None and batch is not None:
            self._require_keys(batch_keys, list(batch.keys()), "batch")
            batch = batch.select(*batch_keys)
        non_tensor = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            self._require_keys(non_tensor_batch_keys, list(non_tensor), "non_tensor_batch")
            non_tensor = {key: non_tensor[key] for key in non_tensor_batch_keys}
        else:
            non_tensor = dict(non_tensor)
        meta = self.meta_info
        if meta_info_keys is not None:
            self._require_keys(meta_info_keys, list(meta), "meta_info")
            meta = {key: meta[key] for key in meta_info_keys}
        else:
            meta = dict(meta)
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    @staticmethod
    def _require_keys(wanted: Sequence[str], present: list[str], part: str) -> None:
        missing = [key for key in wanted if key not in present]
        if missing:
            raise KeyError(f"{part} has no key(s) {missing}; present: {sorted(present)}")

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the named keys from this DataProto and return them as a new one (None: none of that kind)."""
        batch_keys, non_tensor_batch_keys, meta_info_keys = (
            list(keys or ()) for keys in (batch_keys, non_tensor_batch_keys, meta_info_keys))
        present = list(self.batch.keys()) if self.batch is not None else []
        self._require_keys(batch_keys, present, "batch")
        self._require_keys(non_tensor_batch_keys, list(self.non_tensor_batch), "non_tensor_batch")
        self._require_keys(meta_info_keys, list(self.meta_info), "meta_info")
        tensors = {key: self.batch.pop(key) for key in batch_keys}
        non_tensors = {key: self.non_tensor_batch.pop(key) for key in non_tensor_batch_keys}
        meta = {key: self.meta_info.pop(key) for key in meta_info_keys}
        if tensors:
            return DataProto(TensorDict(tensors, batch_size=self.batch.batch_size), non_tensors, meta)
        return DataProto(None, non_tensors, meta)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename tensor keys in place; returns self."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"rename needs as many new keys as old ones, got {old} -> {new}")
        present = list(self.batch.keys()) if self.batch is not None else []
        self._require_keys(old, present, "batch")
        for old_key, new_key in zip(old, new, strict=True):
            self.batch.rename_key_(old_key, new_key)
        return self

    def union(self, other: DataProto) -> DataProto:
        """Add `other`'s keys to self (in place; returns self). Shared keys must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"union of DataProtos of lengths {len(self)} and {len(other)}")
        for key, value in other.meta_info.items():  # checked first: a refused union leaves self as it was
            if key in self.meta_info and not _objects_equal(self.meta_info[key], value):
                raise ValueError(f"union: meta_info key {key!r} differs: {self.meta_info[key]!r} vs {value!r}")
        if other.batch is not None:
            self.batch = other.batch.clone(False) if self.batch is None else union_tensor_dict(self.batch, other.batch)
        self.non_tensor_batch = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        self.meta_info.update(other.meta_info)
        self.check_consistency()
        return self

    # ---------------------------------------------------------------- split and merge
    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into `chunks` equal parts (an empty DataProto into `chunks` empty ones, as verl's). Raises unless
        len is divisible (pad first with `pad_dataproto_to_divisor`, or set `meta_info['_padding_enabled']`)."""
        if chunks <= 0:
            raise ValueError(f"chunk needs chunks >= 1, got {chunks}")
        if len(self) == 0:
            return [self.slice(0, 0) for _ in range(chunks)]
        if len(self) % chunks != 0:
            if not self.meta_info.get("_padding_enabled", False):
                raise ValueError(
                    f"cannot chunk a DataProto of length {len(self)} into {chunks} equal parts; "
                    "pad it with pad_dataproto_to_divisor first"
                )
            padded, pad_size = pad_dataproto_to_divisor(self, chunks)
            parts = padded.chunk(chunks)
            for part in parts:
                part.meta_info.pop("_padding_enabled", None)
            return parts
        return self.split(len(self) // chunks)

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of `split_size` rows (the last one may be shorter)."""
        if split_size <= 0:
            raise ValueError(f"split needs split_size >= 1, got {split_size}")
        return [self.slice(start, start + split_size) for start in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Stack DataProtos along the batch; `meta_info['metrics']` entries are merged into lists."""
        if not data:
            raise ValueError("concat needs at least one DataProto")
        batches = [item.batch for item in data]
        batch = None
        if all(part is not None for part in batches):
            _check_concatenable(batches)
            batch = torch.cat(batches, dim=0)
        elif any(part is not None for part in batches):
            raise ValueError("concat: some DataProtos have tensors and some do not")
        keys = set(data[0].non_tensor_batch)
        for item in data[1:]:
            if set(item.non_tensor_batch) != keys:
                raise ValueError(f"concat: non-tensor keys differ: {sorted(keys)} vs {sorted(item.non_tensor_batch)}")
        non_tensor = {key: np.concatenate([item.non_tensor_batch[key] for item in data]) for key in keys}
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=_merge_meta([d.meta_info for d in data]))

    def reorder(self, indices: torch.Tensor) -> None:
        """Permute rows in place: row i becomes old row `indices[i]`."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row `repeat_times` times: `aabb` when interleaved, `abab` otherwise."""
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")
        n = len(self)
        if interleave:
            index = torch.arange(n).repeat_interleave(repeat_times)
        else:
            index = torch.arange(n).repeat(repeat_times)
        return self.select_idxs(index)

    def make_iterator(
        self, mini_batch_size: int, epochs: int = 1, seed: int | None = None, dataloader_kwargs: dict | None = None
    ) -> Iterator[DataProto]:
        """Mini-batches of `mini_batch_size` rows for `epochs` passes, as verl's DataLoader over the batch gives
        them: in order, or reshuffled every epoch with `dataloader_kwargs={'shuffle': True}` (`seed` seeds the
        shuffle; alone it shuffles nothing, as in verl). `shuffle` is the one DataLoader option taken."""
        if mini_batch_size <= 0 or len(self) % mini_batch_size != 0:
            raise ValueError(
                f"make_iterator: mini_batch_size={mini_batch_size} must divide the batch length {len(self)}"
            )
        options = dict(dataloader_kwargs or {})
        shuffle = bool(options.pop("shuffle", False))
        if options:
            raise TypeError(f"make_iterator takes dataloader_kwargs={{'shuffle': bool}} only, got {sorted(options)}")
        generator = None
        if shuffle:
            generator = torch.Generator()
            if seed is not None:
                generator.manual_seed(seed)
            else:
                generator.seed()

        def iterate() -> Iterator[DataProto]:
            for _ in range(epochs):
                order = torch.randperm(len(self), generator=generator) if generator is not None else None
                data = self.select_idxs(order) if order is not None else self
                yield from data.split(mini_batch_size)

        return iterate()

    # ---------------------------------------------------------------- devices and storage
    def to(self, device: str | torch.device) -> DataProto:
        """Move tensors to `device` (returns self)."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Tensors and non-tensor arrays as one flat dict (meta_info left out)."""
        tensors = {key: value for key, value in self.batch.items()} if self.batch is not None else {}
        return {**tensors, **self.non_tensor_batch}

    def save_to_disk(self, path: str | os.PathLike) -> None:
        """Write to `path` (torch.save of plain tensors, numpy arrays and meta info); atomic via rename."""
        tmp_path = f"{path}.tmp-{os.getpid()}"
        torch.save(self._plain_state(), tmp_path)
        os.replace(tmp_path, path)

    @classmethod
    def load_from_disk(cls, path: str | os.PathLike) -> DataProto:
        """Read a DataProto written by `save_to_disk`."""
        state = torch.load(path, weights_only=False)
        return cls._from_plain_state(state)

    def _plain_state(self) -> dict[str, Any]:
        tensors = {key: value for key, value in self.batch.items()} if self.batch is not None else None
        rows = int(self.batch.batch_size[0]) if self.batch is not None else None
        return {"tensors": tensors, "batch_size": rows, "non_tensor_batch": self.non_tensor_batch,
                "meta_info": self.meta_info}

    @classmethod
    def _from_plain_state(cls, state: dict[str, Any]) -> DataProto:
        tensors = state["tensors"]
        batch = None
        if tensors is not None:  # a batch whose keys were all popped keeps its size (older states: the tensors')
            rows = state.get("batch_size")
            if rows is None:
                rows = next(iter(tensors.values())).shape[0]
            batch = TensorDict(tensors, batch_size=[rows])
        return cls(batch=batch, non_tensor_batch=state["non_tensor_batch"], meta_info=state["meta_info"])

    def __getstate__(self) -> dict[str, Any]:
        # Plain tensors pickle as raw storage (Ray ships them as buffers); this avoids pickling
        # TensorDict internals and never turns tensors into Python lists.
        return self._plain_state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        restored = self._from_plain_state(state)
        self.batch, self.non_tensor_batch, self.meta_info = (
            restored.batch,
            restored.non_tensor_batch,
            restored.meta_info,
        )

    def __repr__(self) -> str:
        tensors = {key: tuple(value.shape) for key, value in self.batch.items()} if self.batch is not None else {}
        return (
            f"DataProto(len={len(self)}, batch={tensors}, non_tensor_batch={sorted(self.non_tensor_batch)}, "
            f"meta_info={sorted(self.meta_info)})"
        )

    def nbytes(self) -> int:
        """Bytes held by the tensors (for logging transfer sizes)."""
        if self.batch is None:
            return 0
        return sum(value.numel() * value.element_size() for value in self.batch.values())

    def serialize(self) -> bytes:
        """Bytes for transport outside Ray (torch.save format)."""
        buffer = io.BytesIO()
        torch.save(self._plain_state(), buffer)
        return buffer.getvalue()


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad `data` cyclically (rows 0, 1, ... again) to a multiple of `size_divisor`; return it and the pad size.

    3 rows to divisor 2 pads 1 row; 3 rows to divisor 7 pads 4 rows (0, 1, 2, 0).
    """
    if size_divisor <= 0:
        raise ValueError(f"size_divisor must be >= 1, got {size_divisor}")
    if len(data) == 0:
        raise ValueError("cannot pad an empty DataProto")
    pad_size = (-len(data)) % size_divisor
    if pad_size == 0:
        return data, 0
    index = torch.arange(len(data) + pad_size) % len(data)
    padded = data.select_idxs(index)
    return padded, pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last `pad_size` rows added by `pad_dataproto_to_divisor`."""
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"pad_size {pad_size} out of range for length {len(data)}")
    return data if pad_size == 0 else data.slice(0, len(data) - pad_size)


@dataclass
class DataProtoFuture:
    """The result of a non-blocking call: Ray object refs plus how to collect and split them.

    `collect_fn` turns the list of per-rank outputs into one DataProto; `dispatch_fn`, if set,
    cuts that result again for the consumer (used when a future is passed into the next call).
    """

    collect_fn: Callable[[list[Any]], DataProto]
    futures: list[Any]
    dispatch_fn: Callable[[DataProto], Any] | None = None

    @staticmethod
    def concat(data: list[Any]) -> DataProtoFuture:
        """A future that concatenates the per-rank outputs of `data` (a list of object refs)."""
        return DataProtoFuture(collect_fn=DataProto.concat, futures=list(data))

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """`chunks` futures each yielding one part of the collected result (resolved lazily)."""
        from functools import partial

        def take(output: DataProto, index: int) -> DataProto:
            if len(output) % chunks:
                raise ValueError(
                    f"a blocking=False result of {len(output)} rows cannot be split over the {chunks} ranks of the "
                    "call it was passed to: a blocking call pads its batch to split it, but a future's length is "
                    "known only where it resolves. Call the producing method with blocking=True, or give it a batch "
                    f"whose length divides by {chunks}"
                )
            return output.chunk(chunks)[index]

        return [
            DataProtoFuture(collect_fn=self.collect_fn, futures=self.futures, dispatch_fn=partial(take, index=i))
            for i in range(chunks)
        ]

    def get(self) -> DataProto:
        """Wait for the refs and return the collected (and, if set, re-dispatched) DataProto."""
        import ray

        outputs = ray.get(self.futures)
        collected = self.collect_fn(outputs)
        if self.dispatch_fn is not None:
            collected = self.dispatch_fn(collected)
        return collected
