"""verl's data.sampler.class_path / class_name: a user's sampler class is loaded from a file or a pkg:// module,
built with the data section, counted for resume, and handed each trained batch when it is a curriculum."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from hybridflow.data.config import DataSamplerConfig, RLHFDataConfig
from hybridflow.data.custom_sampler import UserSampler, build_user_sampler, load_sampler_class
from hybridflow.trainer.scaffold import build_train_loader
from hybridflow.utils.config import ConfigFieldError
from tests.data import curriculum_sampler

MODULE = "pkg://tests.data.curriculum_sampler"


def data_config(class_name: str, class_path: str = MODULE, **kwargs) -> RLHFDataConfig:
    return RLHFDataConfig(sampler=DataSamplerConfig(class_path=class_path, class_name=class_name), **kwargs)


def test_a_curriculum_sampler_orders_the_batches_and_sees_the_trained_ones() -> None:
    sampler = build_user_sampler(list(range(6)), data_config("ReverseCurriculumSampler", seed=7))
    assert sampler.sampler.seed == 7  # it was given the data section, as verl gives it
    loader = build_train_loader(list(range(6)), 2, True, 7, lambda rows: rows, sampler)
    assert [batch for batch in loader] == [[5, 4], [3, 2], [1, 0]]
    curriculum_sampler.UPDATES.clear()
    sampler.update([0, 1])
    assert curriculum_sampler.UPDATES == [2] and sampler.sampler.updates == 1


def test_a_sampler_s_own_state_is_saved_and_restored() -> None:
    sampler = build_user_sampler(list(range(6)), data_config("ReverseCurriculumSampler"))
    batches = iter(DataLoader(list(range(6)), batch_size=2, sampler=sampler))
    next(batches)
    sampler.update([0, 1])
    state = sampler.state_dict()
    assert state == {"epoch": 0, "position": 2, "finished": False, "sampler": {"updates": 1, "given": 2}}
    resumed = build_user_sampler(list(range(6)), data_config("ReverseCurriculumSampler"))
    resumed.load_state_dict(state)
    assert resumed.sampler.updates == 1 and (resumed.epoch, resumed.position) == (0, 2)
    assert [b.tolist() for b in DataLoader(list(range(6)), batch_size=2, sampler=resumed)] == [[3, 2], [1, 0]]


def test_a_sampler_without_state_is_fast_forwarded_with_a_warning(caplog) -> None:
    sampler = build_user_sampler(list(range(6)), data_config("PlainOrderSampler"))
    batches = iter(DataLoader(list(range(6)), batch_size=2, sampler=sampler))
    assert next(batches).tolist() == [0, 1]
    resumed = build_user_sampler(list(range(6)), data_config("PlainOrderSampler"))
    resumed.load_state_dict(sampler.state_dict())
    assert "skips the 2 indices it had given in epoch 0" in caplog.text
    assert [b.tolist() for b in DataLoader(list(range(6)), batch_size=2, sampler=resumed)] == [[2, 3], [4, 5]]
    assert [b.tolist() for b in DataLoader(list(range(6)), batch_size=2, sampler=resumed)][0] == [0, 1]
    assert resumed.epoch == 1


def test_a_state_of_hybridflow_s_own_sampler_is_refused() -> None:
    sampler = UserSampler(curriculum_sampler.PlainOrderSampler([1, 2], None), seed=None)
    with pytest.raises(ValueError, match="saved without data.sampler.class_path"):
        sampler.load_state_dict({"epoch": 0, "position": 1, "seed": 3, "shuffle": True, "num_samples": 2})


def test_a_file_path_loads_too(tmp_path) -> None:
    source = tmp_path / "my_sampler.py"
    source.write_text("from torch.utils.data import Sampler\nclass Mine(Sampler):\n"
                      "    def __init__(self, data_source, data_config):\n        self.n = len(data_source)\n"
                      "    def __iter__(self):\n        return iter(range(self.n))\n"
                      "    def __len__(self):\n        return self.n\n")
    assert load_sampler_class(DataSamplerConfig(class_path=str(source), class_name="Mine")).__name__ == "Mine"


@pytest.mark.parametrize("class_path, class_name, message", [
    (MODULE, "NotASampler", "must be a class deriving from torch.utils.data.Sampler"),
    (MODULE, "Missing", "class_name='Missing' is not defined"),
    ("pkg://no_such_package.samplers", "X", "cannot import module 'no_such_package.samplers'"),
    ("/no/such/file.py", "X", "data.sampler.class_path not found: /no/such/file.py"),
])
def test_bad_samplers_are_named(class_path: str, class_name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_sampler_class(DataSamplerConfig(class_path=class_path, class_name=class_name))


def test_class_path_and_class_name_come_together() -> None:
    with pytest.raises(ConfigFieldError, match="set both"):
        DataSamplerConfig(class_path=MODULE)
