"""verl's entry-point modules with `verl` changed to `hybridflow`: each exists and runs the hybridflow command that
does its job."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

VERL_MODULES = {
    "hybridflow.trainer.main_ppo": "hybridflow.trainer.main_ppo",
    "hybridflow.trainer.fsdp_sft_trainer": "hybridflow.trainer.sft.main",
    "hybridflow.trainer.sft_trainer": "hybridflow.trainer.sft_trainer",
    "hybridflow.trainer.sft_trainer_ray": "hybridflow.trainer.sft_trainer",
    "hybridflow.trainer.main_generation": "hybridflow.trainer.main_generation",
    "hybridflow.trainer.main_eval": "hybridflow.trainer.main_eval",
    "hybridflow.trainer.main_generation_server": "hybridflow.trainer.main_generation_server",
    "hybridflow.model_merger": "hybridflow.engines.training.merge",
    "hybridflow.experimental.one_step_off_policy.main_ppo": "hybridflow.trainer.off_policy.main_one_step_off",
    "hybridflow.experimental.one_step_off_policy.async_main_ppo": "hybridflow.trainer.off_policy.main_one_step_off",
    "hybridflow.experimental.fully_async_policy.fully_async_main": "hybridflow.trainer.off_policy.main_fully_async",
}
"""verl's module (renamed) -> the module whose `main` it runs."""


@pytest.mark.parametrize("module", sorted(VERL_MODULES))
def test_verl_s_module_runs_the_hybridflow_command(module):
    assert importlib.import_module(module).main is importlib.import_module(VERL_MODULES[module]).main


def test_a_renamed_module_runs_as_a_script():
    result = subprocess.run([sys.executable, "-m", "hybridflow.experimental.fully_async_policy.fully_async_main",
                             "--help", "async_training"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "[async_training]" in result.stdout and "require_batches: int = 1" in result.stdout
