"""A policy loss registered in the driver (as docs/algorithms.md shows) trains in the Ray workers: the trainer
ships the registration to them (`workers.registrations`). Before, the workers' registry never held it, and the
run failed at its first update, after Ray, model load and generation, with "unknown policy loss"."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import torch

from hybridflow.algorithms import agg_loss, register_policy_loss
from hybridflow.algorithms.policy_loss_registry import POLICY_LOSSES
from hybridflow.workers.registrations import driver_registrations
from tests.conftest import REPO_ROOT
from tests.tiny_runs import workspace_overrides
from tests.trainer.e2e_runs import by_step, run, workspace  # noqa: F401 (a fixture)

LOSS_NAME = f"driver_reinforce_{uuid.uuid4().hex[:6]}"


def driver_reinforce(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
                     dp_size=1, batch_num_tokens=None, global_batch_size=None):
    """REINFORCE, with a metric that only this loss reports."""
    loss = agg_loss(-advantages * log_prob, response_mask, loss_agg_mode, dp_size=dp_size,
                    batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    return loss, {"actor/driver_loss_calls": 1.0}


def test_a_loss_registered_in_the_driver_trains_in_the_ray_workers(workspace, monkeypatch):
    monkeypatch.setitem(POLICY_LOSSES._entries, LOSS_NAME, driver_reinforce)
    records = by_step(run([
        *workspace_overrides(workspace, workspace / "custom_loss", validate=False), "trainer.logger=[file]",
        "trainer.n_gpus_per_node=1", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={LOSS_NAME}", "trainer.total_training_steps=1",
    ]))
    step = records[1]
    assert step["actor/driver_loss_calls"] == 1.0 and step["actor/grad_norm"] > 0


def test_registrations_are_rebuilt_where_their_module_cannot_be_imported(tmp_path):
    """A loss from a module only the driver can import (here a file outside every path) is pickled by value:
    a fresh interpreter, as a Ray worker is, installs and calls it; hybridflow's own entries are not shipped."""
    module_dir = tmp_path / "private"
    module_dir.mkdir()
    (module_dir / "my_private_losses.py").write_text(textwrap.dedent(f'''
        from hybridflow.algorithms import agg_loss, register_policy_loss
        SCALE = 3.0
        @register_policy_loss("{LOSS_NAME}_private")
        def scaled(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean"):
            return agg_loss(-SCALE * advantages * log_prob, response_mask, loss_agg_mode), {{}}
    '''))
    sys.path.insert(0, str(module_dir))
    try:
        import my_private_losses  # noqa: F401
        shipped = driver_registrations()
    finally:
        sys.path.remove(str(module_dir))
        POLICY_LOSSES._entries.pop(f"{LOSS_NAME}_private", None)
        sys.modules.pop("my_private_losses", None)
    assert list(shipped) == ["policy loss"] and list(shipped["policy loss"]) == [f"{LOSS_NAME}_private"]
    payload = tmp_path / "shipped.pt"
    torch.save(shipped, payload)
    worker = textwrap.dedent(f'''
        import torch
        from hybridflow.algorithms.policy_loss_registry import get_policy_loss_fn
        from hybridflow.workers.registrations import install_registrations
        install_registrations(torch.load({str(payload)!r}, weights_only=False))
        loss, _ = get_policy_loss_fn("{LOSS_NAME}_private")(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                                                           torch.ones(1, 2))
        print(float(loss))
    ''')
    result = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "-3.0"
