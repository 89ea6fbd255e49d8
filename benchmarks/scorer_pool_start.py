"""Time a fresh scorer pool's first batch: workers forked from the driver ('fork') against workers started from
the fork server (what a driver connected to Ray now uses, `hybridflow/utils/processes.py`), then a warm batch.

8 workers score 64 rows of the demo's reasoning-gym data with the built-in scorer; the variants alternate in one
run, each in its own process (a process has one fork server). Prints the medians and their ratio to 'fork';
writes the raw times to benchmarks/results/.

    python benchmarks/scorer_pool_start.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from hybridflow.utils.host import write_results

DATA = "outputs/demo/data/train.parquet"


def time_pool(method: str) -> dict:
    """One pool's first and warm batch, in this process (run as a child by `main`)."""
    import time

    import pyarrow.parquet as pq

    from hybridflow.rewards.pool import ScorerPool, ScoringConfig
    from hybridflow.rewards.score import default_compute_score

    rows = pq.read_table(DATA).to_pylist()[:64]
    calls = [(default_compute_score, {"data_source": row["data_source"], "solution_str": "Answer: 3",
                                      "ground_truth": row["reward_model"]["ground_truth"],
                                      "extra_info": row.get("extra_info")}) for row in rows]
    default_compute_score(**calls[0][1])  # the driver has scored once (reasoning-gym imported), as a run has
    pool = ScorerPool(ScoringConfig(mp_context=method, num_workers=8))
    try:
        start = time.perf_counter()
        outcomes = pool.run(calls)
        first = time.perf_counter() - start
        start = time.perf_counter()
        pool.run(calls)
        warm = time.perf_counter() - start
    finally:
        pool.close()
    return {"mp_context": method, "first_batch_s": first, "warm_batch_s": warm,
            "ok": sum(outcome.status == "ok" for outcome in outcomes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["fork", "forkserver"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(time_pool(args.child)))
        return
    if not os.path.exists(DATA):
        raise SystemExit(f"{DATA} is missing: make demo writes it (or run hybridflow.data.preprocess.reasoning_gym)")
    load_before = list(os.getloadavg())
    rows = []
    for _ in range(args.repeats):
        for method in ("fork", "forkserver"):
            out = subprocess.run([sys.executable, __file__, "--child", method], capture_output=True, text=True,
                                 check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    base = statistics.median(row["first_batch_s"] for row in rows if row["mp_context"] == "fork")
    print(f"{'start method':<14}{'first batch':>13}{'warm batch':>12}{'vs fork':>9}")
    for method in ("fork", "forkserver"):
        mine = [row for row in rows if row["mp_context"] == method]
        first = statistics.median(row["first_batch_s"] for row in mine)
        warm = statistics.median(row["warm_batch_s"] for row in mine)
        print(f"{method:<14}{first:>11.2f} s{warm:>10.3f} s{first / base:>8.1f}x")
    print(f"raw: {write_results('scorer_pool_start', vars(args), rows, load_before)}")


if __name__ == "__main__":
    main()
