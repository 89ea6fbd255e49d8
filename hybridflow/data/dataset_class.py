"""Which dataset class reads the RL prompts: hybridflow's `RLHFDataset`, or a user's from `data.custom_cls`."""

from __future__ import annotations

from pathlib import Path

from hybridflow.data.config import RLHFDataConfig


def rl_dataset_class(config: RLHFDataConfig) -> type:
    """`data.custom_cls.name` from the file `data.custom_cls.path`, checked to be a torch Dataset; `RLHFDataset`
    when none is set. Errors name the key (the file, the class, what it must be)."""
    from torch.utils.data import Dataset

    from hybridflow.data.rl_dataset import RLHFDataset
    from hybridflow.utils.file_module import import_file

    custom = config.custom_cls
    if custom.path is None:
        return RLHFDataset
    path = str(Path(custom.path).expanduser().resolve())
    module = import_file(path, "hybridflow_custom_dataset_", "data.custom_cls.path")
    dataset_cls = getattr(module, custom.name, None)
    if dataset_cls is None:
        raise AttributeError(f"data.custom_cls.name={custom.name!r} is not defined in {path}")
    if not (isinstance(dataset_cls, type) and issubclass(dataset_cls, Dataset)):
        raise TypeError(
            f"data.custom_cls.name={custom.name!r} in {path} must be a class deriving from torch.utils.data.Dataset "
            "(subclass hybridflow.data.RLHFDataset to change how rows become prompts)"
        )
    return dataset_cls
