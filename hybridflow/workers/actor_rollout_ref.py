"""`ActorRolloutRefWorker`: the hybrid-engine worker hosting the actor (training), rollout and reference.

One instance per rank. With role `actor_rollout_ref` the three share a process: before each generation
the rollout engine receives the actor's current weights, gathered from the FSDP shards one tensor at a
time (`timing_s/update_weights`); on a single rank the rollout uses the actor's own module, so there is
no hand-over and no second copy of the weights.

Split placement puts role `actor` (or `actor_ref`) on the trainer pool and role `rollout` on its own pool; after
each update the driver has the trainer's rank 0 broadcast the weights to the rollout ranks (`workers.weight_sync`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from hybridflow.algorithms import masked_mean
from hybridflow.algorithms.config import RolloutCorrectionConfig
from hybridflow.engines.rollout import ROLLOUTS, SamplingParams
from hybridflow.engines.rollout.base import compute_rollout_copy_dtype, copy_buffers, rollout_engine_metrics
from hybridflow.engines.rollout.server import GenerationServer, TokenOutput
from hybridflow.engines.training import build_fsdp_engine
from hybridflow.engines.training.mesh import ParallelLayout
from hybridflow.models import build_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.models.loader import resolve_dtype
from hybridflow.models.vision import copy_image_processor
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Execute, Worker, make_nd_compute_dataproto_dispatch_fn, register
from hybridflow.single_controller.base.worker import find_free_port, get_node_ip
from hybridflow.utils.device import get_torch_device
from hybridflow.workers.config import HF_MODEL_DIR, ActorRolloutRefConfig, WorkerRuntimeConfig
from hybridflow.workers.efficiency import EfficiencyMeter
from hybridflow.workers.offload import optimizer_on_device
from hybridflow.workers.process import prepare_worker_process
from hybridflow.workers.ppo_update import BYPASS_CORRECTION_KEY, OnPolicyRecord, make_actor_loss_fn, mean_metrics
from hybridflow.workers.ppo_update import run_update, update_computes_entropy
from hybridflow.workers.weight_check import WEIGHT_VERSION_KEY, WeightDeliveryCheck
from hybridflow.workers.weight_sync import WeightInfo, WeightSyncGroup, describe_tensors, digest_tensors

logger = logging.getLogger(__name__)

ROLES = ("actor", "rollout", "ref", "actor_ref", "actor_rollout", "actor_rollout_ref")
TRAIN_MESH = "actor"
"""Dispatch mesh of the actor's and reference's compute methods: one data shard per data-parallel group."""
ROLLOUT_MESH = "rollout"
"""Dispatch mesh of generation: the ranks of one rollout tensor-parallel group take the same prompts and the
first of them reports the responses (`rollout.tensor_model_parallel_size`; 1: every rank its own prompts)."""


def check_same_vocabulary(policy_tokenizer, teacher_tokenizer) -> None:
    """A reference (distillation teacher) scores the policy's token ids, so both must share one vocabulary."""
    if policy_tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        raise ValueError(
            "actor_rollout_ref.ref.model.path: the reference (teacher) model's tokenizer differs from the policy's; "
            "its log-probs of the policy's token ids would be meaningless. Use a teacher with the same tokenizer"
        )


def sampling_seed(seed: int, replica: int, version: int, offset: int) -> int:
    """The sampling seed of a rollout replica at a policy version and call offset. The offset also moves the low 32
    bits: torch's CPU generator (mt19937) keeps only those (`offset << 32` alone gave every call of a version one
    stream on CPU, so the chunks of a partial rollout, or `hybridflow generate`'s samples, repeated each other); the
    high bits keep CUDA's 64-bit Philox streams apart as before. Offset 0 gives the seed of earlier versions."""
    return seed + 1_000_003 * (replica + 1) + version + (offset << 32) + (offset * 0x9E3779B1) % (1 << 32)


class ActorRolloutRefWorker(Worker):
    """Actor / rollout / reference roles of one rank; methods are called on the whole group by the driver."""

    def __init__(self, config: ActorRolloutRefConfig, role: str, runtime: WorkerRuntimeConfig) -> None:
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"role={role!r} is not one of {list(ROLES)}")
        self.config, self.role, self.runtime = config, role, runtime
        self.is_actor = role in ("actor", "actor_ref", "actor_rollout", "actor_rollout_ref")
        self.is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self.is_ref = role in ("ref", "actor_ref", "actor_rollout_ref")
        self.actor_engine = self.ref_engine = self.rollout = None
        self._rollout_weights_stale = False
        self._rollout_shares_module = False
        self._server: GenerationServer | None = None
        self._update_count = 0
        # Split placement: the sync group, what a sync sends, and the policy version the last sync brought.
        self._weight_sync: WeightSyncGroup | None = None
        self._weight_sync_info: WeightInfo = []
        self._policy_version = 0
        self._served_version = 0  # the policy version of the weights the rollout serves (set at each hand-over)
        # Each hand-over to a rollout with its own copy of the weights is verified (`workers.weight_check`).
        self._weight_check: WeightDeliveryCheck | None = None
        self._weight_check_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ setup
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the models of this role (collective when the group has several ranks)."""
        runtime, model = self.runtime, self.config.model
        model_path, self.tokenizer = prepare_worker_process(self, runtime, model)
        self._model_path = model_path
        actor = self.config.actor
        if self.is_actor:
            engine_config = actor.engine_config(model, runtime.total_training_steps)
            self.actor_engine = build_fsdp_engine(model_path, engine_config, tokenizer=self.tokenizer)
        ref = self.config.ref
        is_teacher = ref.model.path not in (None, model.path)  # another checkpoint: KL terms distil toward it
        # LoRA: the reference is the actor's own model with the adapter disabled (no second model in memory).
        lora_base = self.actor_engine is not None and self.actor_engine.lora_scaling is not None and not is_teacher
        if self.is_ref and not lora_base:
            ref_path = model_path
            if is_teacher:
                ref_path = resolve_model_path(ref.model.path)
                teacher_tokenizer = resolve_model_path(ref.model.tokenizer_path or ref.model.path)
                check_same_vocabulary(self.tokenizer, load_tokenizer(teacher_tokenizer))
            # A separate reference is a plain model: never wrapped in (or loaded with) LoRA adapters.
            ref_config = ref.engine_config(model, share_prompts=actor.use_prefix_grouper)
            self.ref_engine = build_fsdp_engine(ref_path, ref_config, tokenizer=self.tokenizer)
        if self.is_actor or self.is_ref:
            # Tensor/sequence-parallel peers take the same data shard; one of them reports the result.
            self.train_layout = ParallelLayout(
                self.world_size, actor.fsdp_config.tensor_parallel_size, actor.ulysses_sequence_parallel_size
            )
            layout = self.train_layout
            self.register_dispatch_collect_info(
                TRAIN_MESH, layout.dp_rank(self.rank), layout.dp, layout.is_collect(self.rank)
            )
            # perf/mfu/{actor,actor_infer,ref}; a LoRA actor's reference is the actor's own engine
            self.actor_efficiency = EfficiencyMeter(self.actor_engine, layout) if self.actor_engine else None
            self.ref_efficiency = EfficiencyMeter(self.ref_engine, layout) if self.ref_engine else self.actor_efficiency
        if self.is_rollout:
            self._build_rollout(model_path)

    def _build_rollout(self, model_path: str) -> None:
        rollout = self.config.rollout
        rollout_cls = ROLLOUTS.get(rollout.name)
        # Rollout tensor parallel: consecutive groups of tp ranks decode one replica each (the config allows it
        # with the engines whose spec says tensor_parallel: native, hf, and vllm on accelerators, whose engines
        # form their own groups over the same consecutive blocks).
        self.rollout_layout = layout = ParallelLayout(self.world_size, rollout.tensor_model_parallel_size)
        self.register_dispatch_collect_info(
            ROLLOUT_MESH, layout.dp_rank(self.rank), layout.dp, layout.is_collect(self.rank)
        )
        tp_mesh = None
        if layout.tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            device_type = get_torch_device(self.local_rank).type
            mesh = init_device_mesh(device_type, (layout.dp, layout.tp), mesh_dim_names=("rollout_dp", "rollout_tp"))
            tp_mesh = mesh["rollout_tp"]
        # One rank: generate with the actor's own module (no copy, no hand-over), unless its dtype is not the
        # rollout's on an accelerator (fp32 master weights: generate from a bf16 copy). Sharded, LoRA with a backend
        # that cannot run peft layers, or a backend holding its own weights (vllm): a full copy that receives
        # the (merged) weights before generating. Tensor parallel: this rank's shard, read from the checkpoint
        # slice by slice, which receives its shard of each full tensor before generating.
        self._rollout_shares_module = (
            tp_mesh is None
            and self.actor_engine is not None
            and not self.actor_engine.is_sharded
            and not rollout_cls.holds_own_weights
            and (self.actor_engine.lora_scaling is None or rollout_cls.runs_peft_modules)
            and self._rollout_copy_dtype() is None
        )
        shares = self._rollout_shares_module
        if shares:
            model = self._actor_hf_module()
        else:
            # tensor parallel reads its shard from the checkpoint; vllm loads the checkpoint itself
            own_load = tp_mesh is not None or rollout_cls.holds_own_weights
            model = model_path if own_load else self._rollout_copy(model_path)
        self._rollout_weights_stale = self.actor_engine is not None and not shares
        # Backend-specific settings of the rollout config, for the backends that take them.
        # vllm reads its keys from the section; hf and native take the memory share the rollout may use
        # and the engine keys their spec declares (native: enforce_eager)
        spec = rollout.backend_spec
        if spec.reads_engine_keys:  # vllm loads the checkpoint itself: it takes the HF config overrides too
            extra = {"config": rollout, "hf_overrides": self.config.model.hf_config_overrides}
        else:
            extra = {"memory_utilization": rollout.gpu_memory_utilization,
                     **(rollout_cls.kwargs_from_config(rollout) if spec.engine_keys else {})}
        if tp_mesh is not None:
            extra["tp_mesh"] = tp_mesh
        if rollout.mode == "sync" and rollout.over_sample_rate > 0:  # agent loops over-sample in the manager
            extra["over_sample_rate"] = rollout.over_sample_rate
        self.rollout = rollout_cls(
            model,
            self.tokenizer,
            SamplingParams.from_config(rollout, rollout.response_length),
            val_sampling_params=SamplingParams.from_config(rollout.val_kwargs, rollout.response_length),
            **extra,
        )
        self.rollout.shares_training_weights = shares
        self.rollout.record_routed_experts = rollout.enable_rollout_routing_replay  # hf only (config check)
        if not shares:
            self._weight_check = WeightDeliveryCheck(self.rollout, self.rank)

    def _rollout_copy(self, model_path: str) -> torch.nn.Module:
        """The rollout's own full copy of the model, in rollout.dtype on this rank's device.

        When the actor hands its weights over before every generation, the copy is allocated empty (no checkpoint
        read, no host copy) and takes its buffers (e.g. rotary frequencies, which hand-overs do not carry) from
        the actor's module; without an actor on this worker it is loaded from the checkpoint.
        """
        device = get_torch_device(self.local_rank)
        dtype = resolve_dtype(self.config.rollout.dtype, device)
        model = self.config.model
        # The trainer's kernel where generation takes it (gpt-oss has no sdpa path: its runs set eager); else
        # transformers' own choice (sdpa where the family has it).
        attn = model.attn_implementation if model.attn_implementation in ("sdpa", "eager") else None
        load = dict(dtype=dtype, attn_implementation=attn, trust_remote_code=model.trust_remote_code,
                    config_overrides=model.hf_config_overrides)
        if self.actor_engine is None:
            return build_causal_lm(model_path, **load)
        copy = build_causal_lm(model_path, empty=True, **load).to_empty(device=device)
        copy.tie_weights()  # to_empty unties tied embeddings; a hand-over carries the tied weight once
        copy_buffers(copy, self._actor_hf_module())
        return copy

    def _rollout_copy_dtype(self) -> torch.dtype | None:
        """The dtype of a copy the rollout needs in place of the actor's one-rank module (fp32 master weights on an
        accelerator generate from a bf16 copy), or None (`compute_rollout_copy_dtype`)."""
        training_dtype = next(self.actor_engine.module.parameters()).dtype
        device = get_torch_device(self.local_rank)
        return compute_rollout_copy_dtype(self.config.rollout.dtype, device, training_dtype)

    def _actor_hf_module(self):
        """The actor's HF model; for LoRA the model inside the peft wrapper, its adapters active."""
        module = self.actor_engine.module
        return module.get_base_model() if self.actor_engine.lora_scaling is not None else module

    # ------------------------------------------------------------------ generation
    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(ROLLOUT_MESH))
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses for this rank's prompts; hands the actor's weights to the rollout first if they changed."""
        if self.rollout is None:
            raise RuntimeError(f"generate_sequences called on a worker with role {self.role!r} (no rollout)")
        start = time.perf_counter()
        wake_up_s, update_weights_s = self._wake_up_with_weights()
        self._seed_sampling(prompts.meta_info.get("sampling_seed_offset", 0))
        output = self.rollout.generate_sequences(prompts)
        # Which weights sampled each row: the trainer checks that on-policy steps never reuse old ones.
        output.batch[WEIGHT_VERSION_KEY] = torch.full((len(output),), self._served_weight_version(), dtype=torch.int64)
        sleep_start = time.perf_counter()
        if self.config.rollout.free_cache_engine:
            self.rollout.sleep()
        output.meta_info["metrics"] = {
            "timing_s/update_weights": update_weights_s,
            "timing_s/rollout_wake_up": wake_up_s,
            "timing_s/rollout_sleep": time.perf_counter() - sleep_start,
            "timing_s/generate_sequences": time.perf_counter() - start,
            **rollout_engine_metrics(getattr(self.rollout, "last_stats", None)),
            **self._weight_check_metrics,
        }
        return output

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(ROLLOUT_MESH), blocking=False)
    def generate_sequences_async(self, prompts: DataProto) -> DataProto:
        """`generate_sequences` whose group call returns at once, with a `DataProtoFuture` (the one-step off-policy
        trainer generates the next batch while the actor trains)."""
        return self.generate_sequences(prompts)

    def _seed_sampling(self, offset: int = 0) -> None:
        """Give each rollout replica its own sampling stream, deterministic per replica and policy version (the
        number of updates, which checkpoints restore): copies of one prompt on several replicas (n above the rows
        per replica, or agent loops spread over replicas) must not sample the same responses. The ranks of one
        tensor-parallel replica share its seed (its data-parallel rank; the rank itself without TP), so that they
        draw the same tokens and stay in lock-step. `offset` (`meta_info['sampling_seed_offset']`: the chunk index
        of a partial rollout) gives each call of one version its own stream."""
        version = self._actor_version() if self.actor_engine is not None else self._policy_version
        torch.manual_seed(sampling_seed(self.runtime.seed, self.rollout_layout.dp_rank(self.rank), version, offset))

    def _served_weight_version(self) -> int:
        """The policy version of the weights the rollout generates with: the actor's own when it shares the actor's
        module, else the version of the last hand-over (an update that never reached it leaves it behind)."""
        return self._actor_version() if self._rollout_shares_module else self._served_version

    def _actor_version(self) -> int:
        """The actor's policy version: its learning-rate schedule's steps (restored with checkpoints)."""
        return self.actor_engine.lr_scheduler.last_epoch

    def _wake_up_with_weights(self) -> tuple[float, float]:
        """Wake the rollout and hand it the actor's weights if they changed; (wake-up s, hand-over s). The rollout
        wakes first, so that the hand-over copies device to device, never through host memory; with
        rollout.multi_stage_wake_up its KV cache wakes only after the hand-over."""
        staged = self.config.rollout.multi_stage_wake_up
        start = time.perf_counter()
        self.rollout.wake_up_weights() if staged else self.rollout.wake_up()
        wake_up_s = time.perf_counter() - start
        update_weights_s = self._sync_rollout_weights()
        if staged:
            start = time.perf_counter()
            self.rollout.wake_up()  # what is still asleep: the KV cache
            wake_up_s += time.perf_counter() - start
        return wake_up_s, update_weights_s

    def _sync_rollout_weights(self) -> float:
        """Gather the actor's full weights tensor by tensor into the rollout engine (collective); seconds taken."""
        if not self._rollout_weights_stale:
            return 0.0
        start = time.perf_counter()
        self._hand_over(self.actor_engine.named_full_params(), self._actor_version())
        self._rollout_weights_stale = False
        return time.perf_counter() - start

    def _hand_over(self, named_tensors, version: int) -> None:
        """Load `named_tensors` into the rollout engine, then check that it serves them (`workers.weight_check`)."""
        check = self._weight_check
        self.rollout.update_weights(named_tensors if check is None else check.record(named_tensors))
        self._served_version = version
        if check is not None:
            self._weight_check_metrics = check.verify(version)

    # ------------------------------------------------------------------ server mode (agent loops)
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def wake_up_rollout_server(self) -> dict[str, float]:
        """Hand the actor's weights to the rollout and start this rank's generation server (collective)."""
        if self.rollout is None:
            raise RuntimeError(f"wake_up_rollout_server called on a worker with role {self.role!r} (no rollout)")
        _, update_weights_s = self._wake_up_with_weights()
        self._seed_sampling()
        if self._server is None:
            agent = self.config.rollout.agent
            self._server = GenerationServer(
                self.rollout,
                self.tokenizer.pad_token_id,
                max_batch_size=agent.max_concurrent_requests_per_replica,
                batch_wait_s=agent.server_batch_wait_s,
                max_model_len=self.config.rollout.prompt_length + self.config.rollout.response_length,
            )
        self._server.start()
        return {"timing_s/update_weights": update_weights_s}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep_rollout_server(self) -> dict[str, float]:
        """Stop this rank's generation server (after its queued requests) and free the rollout's cache."""
        stats = {}
        if self._server is not None:
            self._server.stop()
            stats = {f"rollout_server/{key}": value for key, value in self._server.stats().items()}
            self._server = None
        if self.rollout is not None and self.config.rollout.free_cache_engine:
            self.rollout.sleep()
        return stats

    @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    def abort_generation(self) -> int:
        """End this rank's requests still in its server (`GenerationServer.abort`; over_sample_rate): call it in the
        `CONTROL_GROUP`, beside the threads that wait on requests. Returns the queued requests it answered."""
        if self._server is None or not self._server.running:
            return 0  # the step's server is already asleep: nothing is left to end
        return self._server.abort()

    @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    def generate_tokens(self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams) -> TokenOutput:
        """One token-in-token-out request to this rank's server; concurrent calls are batched together."""
        if self._server is None or not self._server.running:
            raise RuntimeError("generate_tokens needs a running server: call wake_up_rollout_server first")
        return self._server.generate(request_id, prompt_ids, sampling_params)

    # ------------------------------------------------------------------ split placement: weight sync
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_sync_info(self) -> WeightInfo:
        """Name, shape and dtype of each tensor a sync sends, in order (actor; collective over the trainer pool)."""
        return describe_tensors(self.actor_engine.named_full_params())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def weight_sync_address(self) -> tuple[str, int]:
        """Where the sync group's store will listen: this host and a free port (trainer rank 0 hosts it)."""
        return get_node_ip(), find_free_port()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_weight_sync_group(self, address: str, port: int, world_size: int, info: WeightInfo | None = None) -> None:
        """Join the sync group (all members at once): trainer rank 0 as sender (sync rank 0), rollout rank r as
        receiver r + 1, each keeping `info` (both sides plan the same buckets from it); the other trainer ranks stay
        out (they only help gather each tensor)."""
        if self.is_actor and self.rank != 0:
            return
        device = get_torch_device(self.local_rank)
        bucket_bytes = self.config.rollout.checkpoint_engine.update_weights_bucket_megabytes * 2**20
        if info is None:
            raise ValueError("a weight sync group member joins with the sender's weight info")
        sync_rank = 0 if self.is_actor else self.rank + 1
        self._weight_sync = WeightSyncGroup(address, port, sync_rank, world_size, device, bucket_bytes)
        self._weight_sync_info = info

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_rollout_weights(self) -> dict[str, float]:
        """Trainer side of a sync (collective): every rank gathers each full tensor, rank 0 broadcasts it."""
        start = time.perf_counter()
        tensors = self.actor_engine.named_full_params()
        num_bytes = num_buckets = 0
        if self._weight_sync is None:
            for _ in tensors:  # ranks 1..: take part in each gather only
                pass
        else:
            num_bytes = self._weight_sync.send(self._actor_version(), self._weight_sync_info, tensors)
            num_buckets = self._weight_sync.num_broadcasts
        return {"seconds": time.perf_counter() - start, "bytes": float(num_bytes), "buckets": float(num_buckets)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_rollout_weights(self) -> dict[str, float]:
        """Rollout side of a sync: load the tensors into the rollout engine as they arrive."""
        if self._weight_sync is None or self.is_actor:
            raise RuntimeError(f"receive_rollout_weights needs a rollout-only worker in a sync group (role {self.role!r})")
        start = time.perf_counter()
        self._policy_version = self._weight_sync.receive_version()
        self._hand_over(self._weight_sync.receive(self._weight_sync_info), self._policy_version)
        return {"seconds": time.perf_counter() - start, "policy_version": float(self._policy_version)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_digests(self) -> dict[str, str]:
        """sha256 per tensor of this rank's weights: the actor's full ones (collective; rank 0 answers, the others
        return {}) or, on a rollout-only rank, the rollout engine's. Equal digests: bitwise-equal weights."""
        if self.actor_engine is None:
            return digest_tensors(self.rollout.named_weights())
        tensors = self.actor_engine.named_full_params()
        if self.rank == 0:
            return digest_tensors(tensors)
        for _ in tensors:
            pass
        return {}

    # ------------------------------------------------------------------ log-probs
    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(TRAIN_MESH))
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """`old_log_probs` (bs, response_len) under the current actor at the rollout's log-prob temperature, and
        with `actor.calculate_sum_pi_squared` each position's `sum_pi_squared` under the same distribution; the
        policy's mean token entropy on this rank's responses is returned as the metric `actor/entropy`."""
        start = time.perf_counter()
        stats = self.actor_engine.compute_token_stats(
            data,
            temperature=self.config.rollout.log_prob_temperature,
            calculate_entropy=True,
            calculate_sum_pi_squared=self.config.actor.calculate_sum_pi_squared,
            micro_batch_size=self.config.rollout.log_prob_micro_batch_size_per_gpu,
            max_token_len=self.config.rollout.log_prob_token_budget,
        )
        seconds = time.perf_counter() - start
        entropy = stats.pop("entropy")
        metrics = {
            "actor/entropy": float(masked_mean(entropy, data.batch["response_mask"].to(entropy.dtype))),
            "timing_s/compute_log_prob": seconds,
            **self.actor_efficiency.metrics("actor_infer", seconds),
        }
        stats["old_log_probs"] = stats.pop("log_probs")
        return DataProto.from_dict(stats, meta_info={"metrics": metrics})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(TRAIN_MESH))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """`ref_log_prob` (bs, response_len) under the frozen reference policy (LoRA: the adapter-free base)."""
        use_base = self.is_ref and self.ref_engine is None and self.actor_engine is not None
        if self.ref_engine is None and not use_base:
            raise RuntimeError(f"compute_ref_log_prob called on a worker with role {self.role!r} (no ref)")
        start = time.perf_counter()
        log_probs, _ = (self.actor_engine if use_base else self.ref_engine).compute_log_prob(
            data,
            temperature=self.config.rollout.log_prob_temperature,
            micro_batch_size=self.config.ref.log_prob_micro_batch_size_per_gpu,
            max_token_len=self.config.ref.log_prob_token_budget,
            disable_adapter=use_base,
        )
        seconds = time.perf_counter() - start
        metrics = {
            "timing_s/compute_ref_log_prob": seconds,
            **self.ref_efficiency.metrics("ref", seconds),
        }
        return DataProto.from_dict({"ref_log_prob": log_probs}, meta_info={"metrics": metrics})

    # ------------------------------------------------------------------ training
    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(TRAIN_MESH))
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over this rank's shard; returns `actor/*` metrics in meta_info['metrics']."""
        actor = self.config.actor
        start = time.perf_counter()
        mini_per_rank = actor.ppo_mini_batch_size * self.config.rollout.n // self.train_layout.dp
        on_policy = self._check_on_policy(data, mini_per_rank)
        bypass = data.meta_info.get(BYPASS_CORRECTION_KEY)
        bypass = RolloutCorrectionConfig(**bypass) if bypass is not None else None
        with optimizer_on_device(self.actor_engine, actor.fsdp_config.optimizer_offload):
            metrics = run_update(
                self.actor_engine,
                data,
                mini_batch_size_per_rank=mini_per_rank,
                micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
                max_token_len=actor.update_token_budget,
                epochs=actor.ppo_epochs,
                shuffle=actor.shuffle,
                seed=self.runtime.seed + self._update_count,
                make_loss_fn=lambda counts: make_actor_loss_fn(actor, counts, on_policy, bypass),
                temperature=self.config.rollout.log_prob_temperature,
                calculate_entropy=update_computes_entropy(actor, on_policy is not None),
                metric_prefix="actor",
            )
        self._update_count += 1
        lr = self.actor_engine.lr_scheduler_step()
        self._rollout_weights_stale = self.rollout is not None and not self._rollout_shares_module
        result = mean_metrics(metrics)
        result.update(on_policy.metrics() if on_policy is not None else {})
        result["actor/lr"] = lr
        result["timing_s/update_actor_worker"] = seconds = time.perf_counter() - start
        result.update(self.actor_efficiency.metrics("actor", seconds))
        return DataProto.from_dict({}, meta_info={"metrics": result})

    def _check_on_policy(self, data: DataProto, mini_batch_size_per_rank: int) -> OnPolicyRecord | None:
        """None when `data` carries old log-probs; else a record for the update's own ones, after checking that the
        update is one optimizer step (one epoch, one mini-batch), the only case where they equal the old ones."""
        if "old_log_probs" in data.batch.keys():
            return None
        actor = self.config.actor
        if actor.ppo_epochs != 1 or mini_batch_size_per_rank < len(data):
            raise ValueError(
                f"update_actor got no old_log_probs, but ppo_epochs={actor.ppo_epochs} with {len(data)} samples in "
                f"mini-batches of {mini_batch_size_per_rank} per rank makes several optimizer steps; compute them "
                "first (compute_log_prob), or make the update one step (ppo_epochs=1, ppo_mini_batch_size = "
                "data.train_batch_size)"
            )
        return OnPolicyRecord()

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str) -> None:
        """The actor's `checkpoint.save_contents` under `local_path` (collective): sharded model, optimizer and
        scheduler/RNG state, and with hf_model a full HF directory (`huggingface_full/`)."""
        contents = self.config.actor.checkpoint
        self.actor_engine.save_checkpoint(local_path, contents.engine_parts)
        hf_path = str(Path(local_path) / HF_MODEL_DIR) if contents.saves_hf_model else None
        if hf_path is not None:
            self.actor_engine.save_hf_model(hf_path, self.tokenizer)
        if self.rank == 0:  # a vision-language model's image processor goes with its config (exports load it)
            for target in (Path(local_path) / "huggingface", hf_path):
                if target is not None:
                    copy_image_processor(self._model_path, target)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        """Restore the actor's `checkpoint.load_contents` of what `save_checkpoint` wrote (same layout); the rollout
        gets the weights before generating."""
        self.actor_engine.load_checkpoint(local_path, contents=self.config.actor.checkpoint.resume_parts)
        self._rollout_weights_stale = self.rollout is not None and not self._rollout_shares_module
