"""verl's `verl.experimental.fully_async_policy` entry point: `hybridflow train-fully-async`."""
