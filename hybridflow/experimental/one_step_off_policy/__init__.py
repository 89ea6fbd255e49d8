"""verl's `verl.experimental.one_step_off_policy` entry points: `hybridflow train-one-step-off`."""
