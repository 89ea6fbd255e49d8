"""The data files of a run, checked before Ray starts: they exist and are parquet, every data_source has a scorer,
every agent_name a loop, and the batch fits the rows. Only the needed columns are read."""

from __future__ import annotations

from hybridflow.data.config import DataFilesConfig, expand_path
from hybridflow.trainer.config.schema import PPOConfig


def holds_values(parquet, column: str) -> bool:
    """Whether the pyarrow ParquetFile `parquet` has `column` with a non-empty value in some row (reads that column
    only)."""
    return column in parquet.schema_arrow.names and any(parquet.read(columns=[column]).column(column).to_pylist())


def check_data_files(data: DataFilesConfig) -> None:
    """Training files are given, and every training and validation file exists (`~` expanded)."""
    if not data.train_files:
        raise ValueError("data.train_files is empty; give parquet files, e.g. data.train_files=[data/train.parquet]")
    for key, path in data.named_files():
        if not expand_path(path).is_file():
            raise ValueError(f"{key} entry {path!r} does not exist; hybridflow/data/preprocess/ writes parquet files")


def check_rows(cfg: PPOConfig) -> None:
    """Every data_source of the training and validation files has a scorer (unless a custom function scores
    them), and every agent_name is a registered agent loop; reads only those columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    key = cfg.data.reward_fn_key
    interactions = cfg.actor_rollout_ref.rollout.multi_turn.interaction_config_path is not None
    built_in = cfg.custom_reward_function.path is None
    wanted = (key, "agent_name", *(("extra_info",) if interactions else ()), *(("reward_model",) if built_in else ()))
    num_train_rows = 0
    for name, path in cfg.data.named_files():
        try:  # ParquetFile, not read_table: the dataset reader would import pandas (0.3 s) for nothing
            parquet = pq.ParquetFile(expand_path(path))
        except (OSError, pa.ArrowException) as err:
            raise ValueError(f"{name} entry {path!r} is not a readable parquet file: {err}") from None
        columns = parquet.schema_arrow.names
        if key not in columns:
            raise ValueError(f"{name} entry {path!r} has no {key!r} column (data.reward_fn_key); columns: {columns}")
        if cfg.data.custom_cls.path is None and cfg.data.prompt_key not in columns:
            raise ValueError(f"{name} entry {path!r} has no {cfg.data.prompt_key!r} column (data.prompt_key); "
                             f"columns: {columns}")
        table = parquet.read(columns=[c for c in wanted if c in columns])
        num_train_rows += table.num_rows if name == "data.train_files" else 0
        if built_in and not (cfg.reward_model_only and name == "data.train_files"):
            _check_scorers(sorted(set(table.column(key).to_pylist())), f"{name} entry {path!r}")
            _check_ground_truths(table, key, f"{name} entry {path!r}")
        if "agent_name" in columns:
            _check_agent_names(sorted({n for n in table.column("agent_name").to_pylist() if n}), path,
                               cfg.actor_rollout_ref.rollout.mode)
        if interactions:
            _check_interaction_rows(cfg, table, f"{name} entry {path!r}")
    _check_steps(cfg, num_train_rows)


def _check_steps(cfg: PPOConfig, num_train_rows: int) -> None:
    """The batch fits the rows, and critic warm-up leaves actor steps (rows before overlong-prompt filtering)."""
    data, trainer = cfg.data, cfg.trainer
    if data.train_max_samples > 0:
        num_train_rows = min(num_train_rows, data.train_max_samples)
    if num_train_rows < data.train_batch_size:
        raise ValueError(
            f"data.train_batch_size={data.train_batch_size} is larger than the {num_train_rows} training rows; lower "
            "it or add data"
        )
    if data.gen_batch_size is not None and num_train_rows < data.gen_batch_size:
        raise ValueError(
            f"data.gen_batch_size={data.gen_batch_size} is larger than the {num_train_rows} training rows; lower it"
        )
    most_steps = trainer.total_epochs * (num_train_rows // (data.gen_batch_size or data.train_batch_size))
    steps = min(most_steps, trainer.total_training_steps or most_steps)
    if trainer.critic_warmup and trainer.critic_warmup >= steps:
        raise ValueError(
            f"trainer.critic_warmup={trainer.critic_warmup} leaves no actor update in the run's {steps} steps "
            "(trainer.total_training_steps, or total_epochs x rows // data.train_batch_size); lower it"
        )


def _check_scorers(data_sources: list[str], where: str) -> None:
    from hybridflow.rewards.score import has_scorer

    missing = [source for source in data_sources if not has_scorer(source)]
    if missing:
        raise ValueError(
            f"{where}: no reward scorer for data_source {missing}; register one in hybridflow.rewards.score.SCORERS "
            "or set custom_reward_function.path"
        )


def _check_ground_truths(table, key: str, where: str) -> None:
    """Each row's reward_model.ground_truth is one its built-in scorer can grade against (not empty; for code rows,
    cases or test code that can fail: `rewards.score.ground_truth_error`)."""
    from hybridflow.rewards.score import ground_truth_error

    if "reward_model" not in table.column_names:
        return  # the dataset names the missing field when it reads the rows
    for index, (source, reward) in enumerate(zip(table.column(key).to_pylist(), table.column("reward_model").to_pylist())):
        if not isinstance(reward, dict) or reward.get("ground_truth") is None:
            continue  # the dataset's row check names it
        error = ground_truth_error(str(source), reward["ground_truth"])
        if error is not None:
            raise ValueError(f"{where}: row {index} ({key}={source!r}): {error}")


def _check_interaction_rows(cfg: PPOConfig, table, where: str) -> None:
    """With an interaction config, every row the tool agent runs names its interaction
    (extra_info.interaction_kwargs.name), as verl requires: without one the row would run as a plain single turn."""
    rollout = cfg.actor_rollout_ref.rollout
    default = "tool_agent" if rollout.multi_turn.enable else rollout.agent.default_agent_loop
    names = table.column("agent_name").to_pylist() if "agent_name" in table.column_names else [None] * table.num_rows
    infos = table.column("extra_info").to_pylist() if "extra_info" in table.column_names else [None] * table.num_rows
    for index, (agent, info) in enumerate(zip(names, infos)):
        kwargs = (info or {}).get("interaction_kwargs") or {}
        if (agent or default) == "tool_agent" and not kwargs.get("name"):
            raise ValueError(
                f"{where} row {index}: actor_rollout_ref.rollout.multi_turn.interaction_config_path is set, but the "
                "row's extra_info.interaction_kwargs names no interaction ('name'), which verl requires; without it "
                "the row would run without its interaction. Add it (verl's gsm8k multi-turn preprocessing writes "
                "one) or drop interaction_config_path"
            )


def _check_agent_names(names: list[str], path: str, mode: str) -> None:
    """Every agent_name is a registered loop; with batch generation (sync) only the single-turn one, as no
    other loop would run."""
    from hybridflow.agents.base import AGENT_LOOPS
    from hybridflow.agents.manager import AgentLoopManager  # noqa: F401  (registers the built-in loops)

    unknown = [name for name in names if name not in AGENT_LOOPS]
    if unknown:
        raise ValueError(f"{path}: agent_name {unknown} is not a registered agent loop; known: {AGENT_LOOPS.names()}")
    looped = [name for name in names if name != "single_turn_agent"]
    if mode != "async" and looped:
        raise ValueError(
            f"{path}: rows ask for agent loop {looped} (column agent_name), which runs only with "
            "actor_rollout_ref.rollout.mode=async; set it (and data.return_raw_chat=True), or drop the column"
        )
