"""Time split placement's weight sync (trainer rank 0 -> every rollout rank, in buckets) on local Ray.

Starts the trainer pool (`--trainer` processes, FSDP) and the rollout pool (`--rollout` processes, hf rollout) for
`--model`, then runs `--repeats` syncs and prints each one's wall time as the driver sees it
(`timing_s/sync_rollout_weights` in a training run), the megabytes sent, and the 1-minute load average (the
machine may be shared). The baseline, in the same run, is the trainer pool's gather alone (every full tensor
gathered from the FSDP shards one at a time, nothing sent): what the broadcast and the rollout's copy add.
`--bucket_mb` compares bucket sizes (`rollout.checkpoint_engine.update_weights_bucket_megabytes`) in one run, each
on its own pools in turn: 1 MiB sends most of SmolLM2's tensors alone, 2048 (verl's default) all in one broadcast.

    python benchmarks/weight_sync.py --model smollm2-135m-instruct --trainer 2 --rollout 2 --bucket_mb 1 2048
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
    parser.add_argument("--bucket_mb", type=int, nargs="+", default=[2048], help="bucket sizes to compare (MiB)")
    args = parser.parse_args()
    load_before = list(os.getloadavg())

    import ray

    ray.init(num_cpus=args.trainer + args.rollout, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for bucket_mb in args.bucket_mb:
            rows += time_syncs(args, bucket_mb)
    finally:
        ray.shutdown()
    baseline = statistics.median(row["sync_s"] for row in rows if row["bucket_mb"] == args.bucket_mb[0])
    print(f"{'bucket MiB':>10}{'buckets':>9}{'median sync':>13}{'gather alone':>14}{'vs first':>10}{'bitwise':>9}")
    for bucket_mb in args.bucket_mb:
        mine = [row for row in rows if row["bucket_mb"] == bucket_mb]
        sync = statistics.median(row["sync_s"] for row in mine)
        gather = statistics.median(row["gather_s"] for row in mine)
        print(f"{bucket_mb:>10}{mine[0]['buckets']:>9.0f}{sync:>11.3f} s{gather:>12.3f} s{sync / baseline:>9.2f}x"
              f"{str(mine[0]['bitwise_equal']):>9}")
    path = write_results("weight_sync", vars(args), rows, load_before)
    print(f"load average {os.getloadavg()[0]:.2f}; raw results: {path}")


def time_syncs(args: argparse.Namespace, bucket_mb: int) -> list[dict]:
    """`args.repeats` syncs on fresh pools with `bucket_mb` buckets: per sync its seconds, the gather alone, the
    megabytes and buckets sent, and whether the rollout ranks end bitwise equal to the trainer."""
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.worker_setup import build_worker_groups

    config = load_config([
        f"actor_rollout_ref.model.path={args.model}", "actor_rollout_ref.hybrid_engine=False",
        f"trainer.n_gpus_per_node={args.trainer}", f"rollout.n_gpus_per_node={args.rollout}",
        "trainer.num_threads_per_worker=1",
        f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes={bucket_mb}",
    ])
    workers = build_worker_groups(config, total_training_steps=1)
    try:
        seconds, gather_seconds, metrics = [], [], {}
        for _ in range(args.repeats):
            start = time.perf_counter()
            workers.actor_rollout.weight_sync_info()  # gathers every tensor, sends nothing
            gather_seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            metrics = workers.sync_rollout_weights()
            seconds.append(time.perf_counter() - start)
        same = all(rank == workers.actor_rollout.weight_digests()[0] for rank in workers.rollout.weight_digests())
        num_tensors = workers.weight_sync.num_tensors
    finally:
        workers.shutdown()
    print(f"{args.model}: {num_tensors} tensors, {metrics['sync_rollout_weights/size_mb']:.1f} MB per sync "
          f"(trainer {args.trainer} -> rollout {args.rollout} processes, CPU, gloo), {bucket_mb} MiB buckets: "
          f"sync {', '.join(f'{s:.3f}' for s in seconds)} s")
    return [{"bucket_mb": bucket_mb, "sync_s": s, "gather_s": g, "size_mb": metrics["sync_rollout_weights/size_mb"],
             "buckets": metrics["sync_rollout_weights/num_buckets"], "bitwise_equal": same}
            for s, g in zip(seconds, gather_seconds)]


if __name__ == "__main__":
    main()
