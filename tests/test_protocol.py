"""DataProto: every method with concrete expected values, and the errors users hit."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto


def make(n: int = 6) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(n), "y": torch.arange(2 * n).view(n, 2)},
        {"uid": [f"u{i}" for i in range(n)]},
        {"temperature": 1.0},
    )


def test_from_dict_and_len_and_repr():
    data = make()
    assert len(data) == 6
    assert data.non_tensor_batch["uid"].dtype == object
    assert "len=6" in repr(data)


def test_from_single_dict_splits_tensors_and_arrays():
    data = DataProto.from_single_dict({"x": torch.ones(2), "raw": np.array([[1, 2], [3]], dtype=object)})
    assert list(data.batch.keys()) == ["x"]
    assert data.non_tensor_batch["raw"][1] == [3]
    with pytest.raises(TypeError, match="'bad' must be a tensor"):
        DataProto.from_single_dict({"bad": 3})


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="share their first dimension"):
        DataProto.from_dict({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="mismatched batch lengths"):
        DataProto.from_dict({"a": torch.zeros(2)}, {"s": ["x", "y", "z"]})


def test_int_index_gives_item_and_slices_give_dataproto():
    data = make()
    item = data[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["y"].tolist() == [4, 5] and item.non_tensor_batch["uid"] == "u2"
    assert data[-1].non_tensor_batch["uid"] == "u5"
    with pytest.raises(IndexError):
        data[6]
    assert data[1:4].batch["x"].tolist() == [1, 2, 3]
    assert data.slice(0, 6, 2).batch["x"].tolist() == [0, 2, 4]
    assert list(data[torch.tensor([5, 0])].non_tensor_batch["uid"]) == ["u5", "u0"]
    assert list(data[[1, 3]].non_tensor_batch["uid"]) == ["u1", "u3"]


def test_select_idxs_with_bool_mask():
    data = make(4)
    picked = data.select_idxs(torch.tensor([True, False, False, True]))
    assert picked.batch["x"].tolist() == [0, 3] and list(picked.non_tensor_batch["uid"]) == ["u0", "u3"]
    with pytest.raises(ValueError, match="boolean mask has length 2"):
        data.select_idxs(np.array([True, False]))


def test_select_keeps_named_keys_and_errors_on_missing():
    data = make()
    part = data.select(batch_keys=["x"], non_tensor_batch_keys=[], meta_info_keys=["temperature"])
    assert list(part.batch.keys()) == ["x"] and part.non_tensor_batch == {} and part.meta_info == {"temperature": 1.0}
    with pytest.raises(KeyError, match=r"batch has no key\(s\) \['z'\]"):
        data.select(batch_keys=["z"])
    deep = data.select(deepcopy=True)
    deep.batch["x"][0] = 100
    assert data.batch["x"][0] == 0


def test_pop_removes_and_returns():
    data = make()
    popped = data.pop(batch_keys=["y"], non_tensor_batch_keys=["uid"], meta_info_keys=["temperature"])
    assert list(data.batch.keys()) == ["x"] and data.non_tensor_batch == {} and data.meta_info == {}
    assert popped.batch["y"].shape == (6, 2) and len(popped.non_tensor_batch["uid"]) == 6
    with pytest.raises(KeyError, match="'missing'"):
        data.pop(batch_keys=["missing"])


def test_rename():
    data = make().rename("x", "x2")
    assert sorted(data.batch.keys()) == ["x2", "y"]
    with pytest.raises(ValueError, match="as many new keys"):
        data.rename(["x2", "y"], ["a"])


def test_union_compares_per_row_dicts_of_tensors_by_value():
    """A vision-language rollout returns each row's multi_modal_inputs (dicts of tensors) that the batch holds."""

    def rows(scale: float) -> np.ndarray:
        values = [{"pixel_values": torch.ones(4, 2) * scale, "image_grid_thw": torch.tensor([[1, 2, 2]])}] * 2
        array = np.empty(2, dtype=object)
        array[:] = values
        return array

    left = DataProto.from_dict({"a": torch.zeros(2)}, non_tensors={"multi_modal_inputs": rows(1.0)})
    same = DataProto.from_dict({"b": torch.ones(2)}, non_tensors={"multi_modal_inputs": rows(1.0)})
    assert set(left.union(same).batch.keys()) == {"a", "b"}
    other = DataProto.from_dict({"c": torch.ones(2)}, non_tensors={"multi_modal_inputs": rows(2.0)})
    with pytest.raises(ValueError, match="non-tensor key 'multi_modal_inputs' is in both batches with different"):
        left.union(other)


def test_union_merges_and_raises_on_conflict_naming_the_key():
    left = DataProto.from_dict({"x": torch.arange(3)}, {"s": ["a", "b", "c"]}, {"m": 1})
    right = DataProto.from_dict({"x": torch.arange(3), "z": torch.ones(3)}, {"t": [1, 2, 3]}, {"n": 2})
    merged = left.union(right)
    assert sorted(merged.batch.keys()) == ["x", "z"] and sorted(merged.non_tensor_batch) == ["s", "t"]
    assert merged.meta_info == {"m": 1, "n": 2}
    with pytest.raises(ValueError, match="key 'x' is in both batches with different values"):
        left.union(DataProto.from_dict({"x": torch.tensor([9, 9, 9])}))
    with pytest.raises(ValueError, match="non-tensor key 's'"):
        left.union(DataProto.from_dict({}, {"s": ["a", "b", "X"]}))
    with pytest.raises(ValueError, match="meta_info key 'm'"):
        left.union(DataProto.from_dict({"x": torch.arange(3)}, meta_info={"m": 5}))
    with pytest.raises(ValueError, match="lengths 3 and 2"):
        left.union(DataProto.from_dict({"q": torch.ones(2)}))


def test_chunk_and_split():
    data = make()
    assert [part.batch["x"].tolist() for part in data.chunk(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [len(part) for part in data.split(4)] == [4, 2]
    with pytest.raises(ValueError, match="cannot chunk a DataProto of length 6 into 5"):
        data.chunk(5)
    data.meta_info["_padding_enabled"] = True
    parts = data.chunk(5)  # auto-padding: 6 rows padded to 10
    assert [part.batch["x"].tolist() for part in parts] == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]


def test_concat_merges_metrics():
    a = DataProto.from_dict({"x": torch.arange(2)}, {"s": ["a", "b"]}, {"metrics": {"loss": 1.0}})
    b = DataProto.from_dict({"x": torch.arange(2, 4)}, {"s": ["c", "d"]}, {"metrics": {"loss": 2.0, "kl": 0.1}})
    merged = DataProto.concat([a, b])
    assert merged.batch["x"].tolist() == [0, 1, 2, 3] and list(merged.non_tensor_batch["s"]) == ["a", "b", "c", "d"]
    assert merged.meta_info["metrics"] == {"loss": [1.0, 2.0], "kl": [0.1]}
    with pytest.raises(ValueError, match="non-tensor keys differ"):
        DataProto.concat([a, DataProto.from_dict({"x": torch.arange(1)})])


def test_reorder_and_repeat():
    data = make(3)
    data.reorder(torch.tensor([2, 0, 1]))
    assert data.batch["x"].tolist() == [2, 0, 1] and list(data.non_tensor_batch["uid"]) == ["u2", "u0", "u1"]
    data = make(2)
    assert data.repeat(2, interleave=True).batch["x"].tolist() == [0, 0, 1, 1]
    assert list(data.repeat(3, interleave=False).non_tensor_batch["uid"]) == ["u0", "u1"] * 3


def test_make_iterator_shuffles_as_verls_dataloader_and_checks_divisibility():
    data = make()
    shuffled = {"shuffle": True}
    first = [batch.batch["x"].tolist() for batch in data.make_iterator(3, epochs=2, seed=7, dataloader_kwargs=shuffled)]
    second = [batch.batch["x"].tolist() for batch in data.make_iterator(3, epochs=2, seed=7, dataloader_kwargs=shuffled)]
    assert first == second and len(first) == 4 and first != [[0, 1, 2], [3, 4, 5]] * 2
    assert sorted(first[0] + first[1]) == [0, 1, 2, 3, 4, 5]
    assert [b.batch["x"].tolist() for b in data.make_iterator(2)] == [[0, 1], [2, 3], [4, 5]]
    # verl: a seed alone seeds the DataLoader's generator, which shuffles nothing without shuffle=True
    assert [b.batch["x"].tolist() for b in data.make_iterator(3, seed=7)] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(TypeError, match=r"'shuffle': bool\} only, got \['drop_last'\]"):
        data.make_iterator(3, dataloader_kwargs={"drop_last": True})
    with pytest.raises(ValueError, match="mini_batch_size=4 must divide the batch length 6"):
        data.make_iterator(4)


def test_pad_is_cyclic_and_unpad_restores():
    data = make(3)
    padded, pad = pad_dataproto_to_divisor(data, 2)
    assert pad == 1 and padded.batch["x"].tolist() == [0, 1, 2, 0]
    padded, pad = pad_dataproto_to_divisor(data, 7)
    assert pad == 4 and padded.batch["x"].tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert unpad_dataproto(padded, pad).batch["x"].tolist() == [0, 1, 2]
    assert pad_dataproto_to_divisor(data, 3)[1] == 0


def test_to_device_and_save_load(tmp_path):
    data = make().to("cpu")
    path = tmp_path / "batch.pt"
    data.save_to_disk(path)
    loaded = DataProto.load_from_disk(path)
    assert torch.equal(loaded.batch["y"], data.batch["y"])
    assert list(loaded.non_tensor_batch["uid"]) == list(data.non_tensor_batch["uid"])
    assert loaded.meta_info == {"temperature": 1.0}


def test_pickle_round_trip_keeps_tensors_as_storage():
    data = DataProto.from_dict({"big": torch.randn(1000, 1000)}, {"s": ["a"] * 1000})
    blob = pickle.dumps(data)
    # 4 MB of float32 must not balloon (a Python-list pickle of floats would be ~9 MB)
    assert len(blob) < 4_200_000
    restored = pickle.loads(blob)
    assert torch.equal(restored.batch["big"], data.batch["big"]) and len(restored) == 1000


def test_a_refused_union_leaves_self_unchanged_and_concat_names_the_mismatch():
    left = DataProto.from_dict({"a": torch.zeros(2, 3)}, meta_info={"step": 1})
    right = DataProto.from_dict({"b": torch.ones(2, 3)}, meta_info={"step": 2})
    with pytest.raises(ValueError, match="meta_info key 'step' differs"):
        left.union(right)
    assert list(left.batch.keys()) == ["a"] and left.meta_info == {"step": 1}  # it had merged 'b' already
    ragged = DataProto.from_dict({"a": torch.zeros(2, 5)})
    with pytest.raises(ValueError, match=r"concat: tensor 'a' has per-row shapes \[\(3,\), \(5,\)\]"):
        DataProto.concat([left, ragged])
    with pytest.raises(ValueError, match=r"concat: part 1 has tensor keys \['b'\], part 0 has \['a'\]"):
        DataProto.concat([left, right])


# ----------------------------------------------------------------------------- verl's semantics (API probe)
def test_a_batch_whose_tensors_were_all_popped_keeps_its_size_through_pickle_and_disk(tmp_path):
    import pickle

    data = DataProto.from_dict(tensors={"a": torch.zeros(4, 2)}, non_tensors={"uid": ["u0", "u1", "u2", "u3"]})
    data.pop(batch_keys=["a"])
    for copy in (pickle.loads(pickle.dumps(data)), _round_trip(data, tmp_path / "d.pt")):
        assert len(copy) == 4 and list(copy.non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u3"]


def _round_trip(data: DataProto, path) -> DataProto:
    data.save_to_disk(path)
    return DataProto.load_from_disk(path)


def test_union_takes_equal_columns_that_hold_nan():
    """verl's union compares non-tensor values as equal when both are NaN (a repeated row's extra_info dict)."""
    rows = [{"score": float("nan"), "index": 0}, {"score": 1.0, "index": 1}]
    left = DataProto.from_dict(non_tensors={"extra_info": rows, "value": np.array([np.nan, 2.0])})
    right = DataProto.from_dict(non_tensors={"extra_info": [dict(row) for row in rows],
                                             "value": np.array([np.nan, 2.0])})
    assert len(left.union(right)) == 2
    with pytest.raises(ValueError, match="different values"):
        left.union(DataProto.from_dict(non_tensors={"value": np.array([np.nan, 3.0])}))


def test_numpy_columns_keep_their_dtype_and_shape():
    data = DataProto.from_single_dict({"ids": torch.zeros(3, 2), "score": np.array([0.5, 1.0, 0.0]),
                                       "pairs": np.arange(6).reshape(3, 2), "names": ["a", "b", "c"]})
    assert data.non_tensor_batch["score"].dtype == np.float64 and data.non_tensor_batch["pairs"].shape == (3, 2)
    assert torch.tensor(data.non_tensor_batch["score"]).tolist() == [0.5, 1.0, 0.0]
    assert data.non_tensor_batch["names"].dtype == object
    again = DataProto.concat([data, data.repeat(2)])
    assert again.non_tensor_batch["pairs"].shape == (9, 2) and len(again) == 9


def test_pop_takes_verls_none_defaults_and_concat_a_part_without_metrics():
    data = DataProto.from_dict(tensors={"a": torch.zeros(2), "b": torch.ones(2)}, meta_info={"metrics": None})
    popped = data.pop(batch_keys=["a"], non_tensor_batch_keys=None, meta_info_keys=None)
    assert list(popped.batch.keys()) == ["a"] and list(data.batch.keys()) == ["b"]
    other = DataProto.from_dict(tensors={"b": torch.ones(2)}, meta_info={"metrics": {"loss": 1.0}})
    assert DataProto.concat([data, other]).meta_info["metrics"] == {"loss": [1.0]}


def test_an_empty_dataproto_chunks_into_empty_parts():
    empty = DataProto.from_dict(tensors={"x": torch.zeros(0, 2)}, non_tensors={"uid": []})
    parts = empty.chunk(2)
    assert [len(part) for part in parts] == [0, 0] and parts[0].batch["x"].shape == (0, 2)
