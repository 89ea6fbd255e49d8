"""Time split placement's weight sync (trainer rank 0 -> every rollout rank, one tensor at a time) on local Ray.

Starts the trainer pool (`--trainer` processes, FSDP) and the rollout pool (`--rollout` processes, hf rollout) for
`--model`, then runs `--repeats` syncs and prints each one's wall time as the driver sees it
(`timing_s/sync_rollout_weights` in a training run), the megabytes sent, and the 1-minute load average (the
machine may be shared). The baseline, in the same run, is the trainer pool's gather alone (every full tensor
gathered from the FSDP shards one at a time, nothing sent): what the broadcast and the rollout's copy add.

    python benchmarks/weight_sync.py --model smollm2-135m-instruct --trainer 2 --rollout 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from hybridflow.utils.host import write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalogue name or model directory")
    parser.add_argument("--trainer", type=int, default=2, help="trainer pool processes")
    parser.add_argument("--rollout", type=int, default=2, help="rollout pool processes")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_before = list(os.getloadavg())

    import ray

    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.worker_setup import build_worker_groups

    config = load_config([
        f"actor_rollout_ref.model.path={args.model}", "actor_rollout_ref.hybrid_engine=False",
        f"trainer.n_gpus_per_node={args.trainer}", f"rollout.n_gpus_per_node={args.rollout}",
        "trainer.num_threads_per_worker=1",
    ])
    ray.init(num_cpus=args.trainer + args.rollout, include_dashboard=False, log_to_driver=False)
    workers = build_worker_groups(config, total_training_steps=1)
    try:
        seconds, gather_seconds, mbytes = [], [], 0.0
        for _ in range(args.repeats):
            start = time.perf_counter()
            workers.actor_rollout.weight_sync_info()  # gathers every tensor, sends nothing
            gather_seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            mbytes = workers.sync_rollout_weights()["sync_rollout_weights/size_mb"]
            seconds.append(time.perf_counter() - start)
        same = all(rank == workers.actor_rollout.weight_digests()[0] for rank in workers.rollout.weight_digests())
    finally:
        workers.shutdown()
        ray.shutdown()
    print(f"model {args.model}: {workers.weight_sync.num_tensors} tensors, {mbytes:.1f} MB per sync "
          f"(trainer {args.trainer} -> rollout {args.rollout} processes, CPU, gloo)")
    print(f"sync seconds: {', '.join(f'{s:.3f}' for s in seconds)} (median {statistics.median(seconds):.3f})")
    print(f"gather alone: {', '.join(f'{s:.3f}' for s in gather_seconds)} "
          f"(median {statistics.median(gather_seconds):.3f})")
    print(f"rollout weights bitwise equal to the trainer's: {same}; load average {os.getloadavg()[0]:.2f}")
    rows = [{"sync_s": s, "gather_s": g, "size_mb": mbytes, "bitwise_equal": same}
            for s, g in zip(seconds, gather_seconds)]
    print(f"raw results: {write_results('weight_sync', vars(args), rows, load_before)}")


if __name__ == "__main__":
    main()
