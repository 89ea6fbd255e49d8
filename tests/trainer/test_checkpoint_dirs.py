"""Checkpoint directories: atomic commit, latest pointer, pruning, never overwriting."""

from __future__ import annotations

import pytest

from hybridflow.trainer import checkpoint_dirs as cd


def write_step(root, step, keep=None):
    staging = cd.staging_dir(root, step)
    (staging / "weights.pt").write_text(f"step {step}")
    (staging / cd.DRIVER_STATE).write_text("{}")  # every save writes it last (checkpointing.save_checkpoint)
    return cd.commit_step(root, step, staging, keep)


def test_commit_renames_into_place_and_records_latest(tmp_path):
    final = write_step(tmp_path, 5)
    assert final == tmp_path / "global_step_5" and (final / "weights.pt").read_text() == "step 5"
    assert cd.latest_step(tmp_path) == 5 and cd.list_steps(tmp_path) == [5]
    assert not list(tmp_path.glob("*.tmp-*")), "no staging directory is left behind"


def test_an_interrupted_save_leaves_the_previous_checkpoint_current(tmp_path):
    write_step(tmp_path, 1)
    staging = cd.staging_dir(tmp_path, 2)  # killed before commit_step
    (staging / "weights.pt").write_text("half")
    assert cd.latest_step(tmp_path) == 1 and cd.list_steps(tmp_path) == [1]


def test_existing_step_is_never_overwritten(tmp_path):
    write_step(tmp_path, 3)
    staging = cd.staging_dir(tmp_path, 3)
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        cd.commit_step(tmp_path, 3, staging)
    assert (tmp_path / "global_step_3" / "weights.pt").read_text() == "step 3"


def test_pruning_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        write_step(tmp_path, step, keep=2)
    assert cd.list_steps(tmp_path) == [3, 4] and cd.latest_step(tmp_path) == 4


def test_pruning_deletes_only_committed_checkpoints(tmp_path):
    """A user's folder that happens to be named global_step_0 was deleted by max_actor_ckpt_to_keep."""
    (tmp_path / "global_step_0").mkdir()
    (tmp_path / "global_step_0" / "notes.txt").write_text("mine")
    for step in (1, 2, 3):
        write_step(tmp_path, step, keep=1)
    assert (tmp_path / "global_step_0" / "notes.txt").read_text() == "mine"
    assert cd.list_checkpoints(tmp_path) == [3] and cd.list_steps(tmp_path) == [0, 3]


def test_the_newest_directory_wins_over_a_lagging_or_bad_pointer(tmp_path, caplog):
    write_step(tmp_path, 1)
    write_step(tmp_path, 2)
    (tmp_path / cd.LATEST_FILE).write_text("1")  # a kill between the rename of step 2 and the pointer update
    assert cd.latest_step(tmp_path) == 2 and "newest checkpoint is global_step_2" in caplog.text
    (tmp_path / cd.LATEST_FILE).write_text("abc")
    assert cd.latest_step(tmp_path) == 2
    assert cd.step_of(tmp_path / "global_step_12") == 12
    with pytest.raises(ValueError, match="not a global_step_N"):
        cd.step_of(tmp_path / "step_12")


def test_stale_staging_of_dead_processes_is_removed(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"global_step_4.tmp-{dead.stdout.strip()}"
    stale.mkdir()
    pointer = tmp_path / f"latest_checkpointed_iteration.tmp-{dead.stdout.strip()}"  # killed before its rename
    pointer.write_text("4")
    ours = cd.staging_dir(tmp_path, 5)  # this process is alive: kept
    assert cd.remove_stale_staging(tmp_path) == [stale, pointer]
    assert not stale.exists() and not pointer.exists() and ours.exists()
