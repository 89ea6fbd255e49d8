"""KV cache slot bookkeeping: prompt writes with repeats, decode appends, slot moves, release/restore."""

from __future__ import annotations

import torch

from hybridflow.engines.rollout.native.kv_cache import KVCache


def make_cache() -> KVCache:
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32, device=torch.device("cpu"))
    cache.reserve(num_slots=6, max_len=5)
    return cache


def test_write_prompts_repeats_each_prompt_into_consecutive_slots():
    cache = make_cache()
    keys = torch.arange(2 * 2 * 4 * 3, dtype=torch.float32).view(2, 2, 4, 3)
    cache.write_prompts(1, start_slot=1, keys=keys, values=-keys, repeats=2)
    for slot, prompt in ((1, 0), (2, 0), (3, 1), (4, 1)):
        assert torch.equal(cache.keys[1][slot, :, :4], keys[prompt])
        assert torch.equal(cache.values[1][slot, :, :4], -keys[prompt])
    assert (cache.keys[1][0] == 0).all() and (cache.keys[1][5] == 0).all() and (cache.keys[0] == 0).all()


def test_append_writes_at_each_slots_length_and_move_slots_copies():
    cache = make_cache()
    lengths = torch.tensor([0, 3, 1])
    new = torch.randn(3, 2, 3)
    cache.append(0, cache.decode_index(lengths), new, new + 1)
    for slot, length in enumerate(lengths.tolist()):
        assert torch.equal(cache.keys[0][slot, :, length], new[slot])
        assert torch.equal(cache.values[0][slot, :, length], new[slot] + 1)
    keys, values = cache.active(0, num_active=3, length=4)
    assert keys.shape == values.shape == (3, 2, 4, 3)
    cache.move_slots(torch.tensor([2]), torch.tensor([0]), length=4)
    assert torch.equal(cache.keys[0][0, :, :4], cache.keys[0][2, :, :4])


def test_release_and_restore_keep_the_shape():
    cache = make_cache()
    size = cache.num_bytes
    assert size == 2 * 2 * 6 * 2 * 5 * 3 * 4
    cache.release()
    assert cache.num_bytes == 0 and not cache.allocated
    cache.restore()
    assert cache.num_bytes == size
    cache.reserve(num_slots=2, max_len=3)  # smaller: kept
    assert cache.num_bytes == size
    cache.reserve(num_slots=2, max_len=7)  # longer: grows, keeps the slot count
    assert cache.keys[0].shape == (6, 2, 7, 3)
