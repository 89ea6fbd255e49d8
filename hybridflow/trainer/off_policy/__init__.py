"""The off-policy trainers' room: `RayPPOTrainer` fed by a rollout pool that runs ahead of the trainer pool.

- `checks.py`: what an off-policy trainer needs from the config (split pools, one generation per step, ...);
- `generation.py`: a drawn prompt batch (`Generation`, with the sampler position a resume starts from) and the
  staleness columns and metrics both trainers tag their samples with;
- `partial_rollout.py`: one batch generated in resumable chunks, each token tagged with its weights' version;
- `schedule.py`: a seeded (or scripted) interleaving of generation and training, for exact tests;
- `rollouter.py`: the fully async trainer's producer behind one `take()`: a thread, or the schedule;
- `one_step_off_policy.py`, `fully_async_policy.py`: the two trainers; `main_one_step_off.py`,
  `main_fully_async.py`: their commands (`hybridflow train-one-step-off`, `hybridflow train-fully-async`).

May import the rest of `trainer/` (it reuses `RayPPOTrainer`'s stages); nothing outside this package imports it
except the `hybridflow` command table.
"""
