"""verl 0.9.1's actor update path on a CPU machine, in this process: what verl_checks.py's trainer checks
drive ``EntropyLensTrainer._update_actor`` through.

verl cannot train on CPU (verl_checks.test_why_verl_cannot_train_on_this_cpu_machine): its platform
says cuda, its FSDP engine is registered for cuda / npu only and wraps the model in FSDP on a device
mesh of that device, and its rollout needs an LLM server. So these are stood in for, and nothing else:

1. the transport of the worker group: :class:`LocalWorkerGroup` is verl's ``WorkerGroup`` base class
   with the worker's methods bound as verl binds them (``_bind_worker_method``: each method's own
   registered dispatch / collect functions, e.g. ``make_nd_compute_dataproto_dispatch_fn``), but
   "executing on all workers" calls the one worker object in this process (Ray's ``ray.get`` of the
   dispatched object refs, and a pickle round trip of every other argument, as a Ray actor call does)
   instead of a remote Ray actor;
2. the FSDP engine's construction and its device-bound parts: :class:`CPUEngine` subclasses verl's
   ``FSDPEngineWithLMHead`` and keeps its ``forward_backward_batch`` / ``forward_step`` /
   ``prepare_model_inputs`` / ``prepare_model_outputs`` (verl's code: global token counts, micro-batches,
   log-probs, entropies, sum pi^2, fused kernels); it replaces ``__init__`` (a plain module, no FSDP
   wrap, no device mesh), the train / eval mode contexts (no offload), and the optimizer step (SGD,
   no FSDP grad-norm clipping). It is registered as a verl engine backend of its own name
   (``entropylens_cpu``) and built by verl's ``EngineRegistry`` from the actor's engine config;
3. the device: ``get_device_name`` / ``get_device_id`` / ``get_torch_device`` are 'cpu' in the engine,
   worker and flops-counter modules while :func:`on_cpu` is entered (verl's platform says cuda here);
4. the trainer's ``_setup`` (which spawns Ray worker groups, rollout servers, the dataloader) sets the
   worker group of 1. instead, and ``on_init_end`` (the weight sync to the rollout servers) does nothing
   (:func:`build_trainer`); the batch is put into TransferQueue as the agent loop, _compute_old_log_prob
   and _compute_advantage leave it (:func:`put_rollout`), not generated.

Real: Ray (local), TransferQueue's controller and SimpleStorage unit (Ray actors), every KVBatchMeta,
verl's tqbridge (KVBatchMeta -> TensorDict with extra_info as non-tensor data on the worker side),
``ActorRolloutRefWorker`` (its ``__init__``, ``update_actor``, ``compute_log_prob``, ``set_loss_fn``),
``TrainingWorker`` (its ``__init__``, ``train_mini_batch``, ``train_batch``, ``infer_batch``,
``_postprocess_output``: the metric all-gather and ``Metric.aggregate_dp``), ``BaseEngine.train_batch``,
``prepare_micro_batches`` / ``postprocess_batch_func``, the trainer (``PPOTrainer.__init__``, its
``_update_actor``, ``reduce_metrics``), the hydra config composed as ``main_ppo`` composes it, a tiny
Qwen2 (built from a config; ``examples/verl/make_tiny.py``), torch.distributed (gloo, one rank).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BACKEND = "entropylens_cpu"


# ----------------------------------------------------------------------------------- device
class _CPUDevice:
    """verl's ``get_torch_device()`` module (torch.cuda on this machine) for CPU: memory stats 0."""

    @staticmethod
    def max_memory_allocated(*a, **k):
        return 0

    max_memory_reserved = memory_allocated = memory_reserved = max_memory_allocated

    @staticmethod
    def empty_cache():
        return None

    synchronize = empty_cache


def cpu_device_patches():
    """(module, name, value) triples that make verl's engine / worker modules place tensors on cpu."""
    import verl.utils.flops_counter as flops_counter
    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    import verl.workers.engine_workers as engine_workers

    return [
        (flops_counter, "get_torch_device", lambda: torch.cpu),  # verl's own CPU case: device 'CPU'
        (fsdp_impl, "get_device_id", lambda: "cpu"),
        (fsdp_impl, "get_device_name", lambda: "cpu"),
        (engine_workers, "get_device_name", lambda: "cpu"),
        (engine_workers, "get_torch_device", lambda: _CPUDevice),
    ]


@contextlib.contextmanager
def on_cpu():
    saved = []
    for mod, name, value in cpu_device_patches():
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


# ----------------------------------------------------------------------------------- engine
SETTINGS = {"lr": 0.0, "fused": False}  # set by the checks before the engine is built


def _register_engine():
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if BACKEND in EngineRegistry._engines.get("language_model", {}):
        return EngineRegistry._engines["language_model"][BACKEND]["cuda"]

    @EngineRegistry.register(model_type="language_model", backend=[BACKEND], device=["cuda"])
    class CPUEngine(FSDPEngineWithLMHead):
        """verl's FSDP language-model engine without FSDP: see the module docstring (2.)."""

        def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config, **kwargs):
            from transformers import AutoConfig, Qwen2ForCausalLM

            self.model_config = model_config
            self.engine_config = engine_config
            self.optimizer_config = optimizer_config
            self.checkpoint_config = checkpoint_config
            self.mode = None
            self.rank = torch.distributed.get_rank()
            self.use_remove_padding = model_config.use_remove_padding
            self.ulysses_device_mesh = None
            self.ulysses_parallel_group = None
            self.ulysses_sequence_parallel_size = 1
            self.use_ulysses_sp = False
            self._is_offload_param = self._is_offload_optimizer = False
            self._is_lora = False
            self._autocast_dtype = torch.float32  # forward_step: no autocast
            self.scaler = None
            self._qat_enabled = False
            self.pad_to_length = False
            self.pad_to_length_bucket = None
            from verl.utils import torch_functional as verl_F

            self.compute_entropy_from_logits = verl_F.entropy_from_logits
            torch.manual_seed(0)
            cls = Qwen2ForCausalLM
            if SETTINGS["fused"]:  # verl's torch fused-kernel forward patches the class: a class of our own
                cls = type("FusedQwen2ForCausalLM", (Qwen2ForCausalLM,), {})
            hf = AutoConfig.from_pretrained(model_config.local_path)
            self.module = cls(hf).double()
            if SETTINGS["fused"]:
                from verl.models.transformers.monkey_patch import patch_forward_with_backends

                patch_forward_with_backends(self.module, use_fused_kernels=True, fused_kernels_backend="torch")
            self.optimizer = torch.optim.SGD(self.module.parameters(), lr=SETTINGS["lr"])
            self.lr_scheduler = None
            self.grad_norms: list[float] = []

        def initialize(self):
            return None

        @contextlib.contextmanager
        def train_mode(self, **kwargs):
            self.module.train()
            yield

        @contextlib.contextmanager
        def eval_mode(self, **kwargs):
            self.module.eval()
            yield

        def optimizer_zero_grad(self):
            self.optimizer.zero_grad(set_to_none=True)

        def optimizer_step(self):
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = (
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                if grads
                else torch.zeros((), dtype=torch.float64)
            )
            self.optimizer.step()
            self.grad_norms.append(float(norm))
            return float(norm)

        def lr_scheduler_step(self):
            return self.optimizer.param_groups[0]["lr"]

        def to(self, device, model=True, optimizer=True, grad=True):
            return None

    return CPUEngine


# ----------------------------------------------------------------------------------- worker group
def _local_execute(worker):
    def execute_all(method_name, *args, **kwargs):
        import ray

        def arrive(x):  # what a Ray actor call hands the method: refs resolved, everything else unpickled
            if isinstance(x, ray.ObjectRef):
                return ray.get(x)
            return pickle.loads(pickle.dumps(x))

        def one(i):
            a = [arrive(x[i]) if isinstance(x, list) and len(x) == 1 else arrive(x) for x in args]
            k = {n: arrive(v[i]) if isinstance(v, list) and len(v) == 1 else arrive(v) for n, v in kwargs.items()}
            return getattr(worker, method_name)(*a, **k)

        return [one(0)]

    return execute_all


def worker_group(worker):
    """verl's WorkerGroup over the one worker object ``worker`` (in this process): the module docstring (1.).
    Its ``calls`` lists the worker methods called, in order."""
    from verl.single_controller.base.worker_group import WorkerGroup

    class LocalWorkerGroup(WorkerGroup):
        def __init__(self):
            super().__init__(resource_pool=None)
            self._workers = [worker]
            self._worker_names = ["actor_rollout_0"]
            self.calls: list[str] = []
            self.execute_all = _local_execute(worker)
            self.execute_rank_zero = self.execute_all

            def func_generator(wg, method_name, dispatch_fn, collect_fn, execute_fn, blocking):
                def call(*args, **kwargs):  # verl.single_controller.ray.base.func_generator, results already here
                    wg.calls.append(method_name)
                    args, kwargs = dispatch_fn(wg, *args, **kwargs)
                    kwargs.pop("_padding_size_key", None)
                    return collect_fn(wg, execute_fn(method_name, *args, **kwargs))

                return call

            self._bind_worker_method(type(worker), func_generator)

        def _query_dispatch_info(self, mesh_name):
            return [w._query_dispatch_info(mesh_name) for w in self._workers]

        def _query_collect_info(self, mesh_name):
            return [w.query_collect_info(mesh_name) for w in self._workers]

    return LocalWorkerGroup()


# ----------------------------------------------------------------------------------- setup
def start_ray_and_store():
    """A local Ray instance and TransferQueue's controller + one SimpleStorage unit (Ray actors)."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))


def stop_ray_and_store():
    import ray
    import transfer_queue as tq

    try:
        tq.close()
    finally:
        ray.shutdown()


def tiny_model_dir(work: Path) -> Path:
    """examples/verl/make_tiny.py's model directory (config + word-level tokenizer, no downloads)."""
    sys.path.insert(0, str(ROOT / "examples" / "verl"))
    try:
        import make_tiny
    finally:
        sys.path.pop(0)
    if not (work / "model" / "config.json").exists():
        make_tiny.main(str(work))
    return work / "model"


def compose(overrides: list[str]):
    """ppo_trainer.yaml with ``overrides``, as main_ppo's hydra composes it."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def build_actor_worker(cfg):
    """verl's ActorRolloutRefWorker (role 'actor') with its actor TrainingWorker built as
    ``ActorRolloutRefWorker.init_model`` builds it (step 2), the engine backend swapped for ours."""
    from functools import partial

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    _register_engine()
    for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", "29561")
    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    tw = TrainingWorkerConfig(
        model_type="language_model",
        model_config=model_config,
        engine_config=actor_config.engine,
        optimizer_config=actor_config.optim,
        checkpoint_config=actor_config.checkpoint,
        profiler_config=None,
    )
    ec = tw.engine_config
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    ec.use_dynamic_bsz = a.use_dynamic_bsz
    ec.infer_max_token_len_per_gpu = r.log_prob_max_token_len_per_gpu
    ec.infer_micro_batch_size_per_gpu = r.log_prob_micro_batch_size_per_gpu
    ec.max_token_len_per_gpu = a.ppo_max_token_len_per_gpu
    ec.micro_batch_size_per_gpu = a.ppo_micro_batch_size_per_gpu
    ec.use_remove_padding = model_config.get("use_remove_padding", False)
    object.__setattr__(ec, "strategy", BACKEND)  # the one swap: verl's EngineRegistry builds our CPUEngine
    worker.actor = TrainingWorker(config=tw)  # under on_cpu() (the caller's)
    worker.loss_fn = partial(ppo_loss, config=actor_config)
    worker.actor.set_loss_fn(worker.loss_fn)
    worker.set_dispatch_collect(mesh_name="actor", **worker.actor.get_dispatch_collect())
    return worker


def trainer_overrides(model_dir: Path, *, loss_mode="ce_gppo", record_dir=None, mini=4, micro=2, epochs=1, extra=()):
    out = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.actor.policy_loss._target_=entropylens.integrations.verl.EntropyLensLossConfig",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.ppo_epochs={epochs}",
        "actor_rollout_ref.actor.shuffle=true",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.temperature=0.7",
        "algorithm.adv_estimator=grpo",
        "trainer.use_v1=true",
        "trainer.v1.trainer_mode=entropylens",
    ]
    if record_dir is not None:
        out += [
            f"+actor_rollout_ref.actor.policy_loss.record_dir={record_dir}",
            "+actor_rollout_ref.actor.policy_loss.run=trainer-test",
        ]
    return out + list(extra)


def build_trainer(cfg, wg, *, global_steps: int = 1, trainer_cls=None):
    """``EntropyLensTrainer`` (verl's PPOTrainer.__init__ and our init) with verl's ``_setup`` (Ray
    worker groups, rollout servers, dataloader) replaced by ``wg`` and the weight sync to the rollout
    servers (on_init_end) left out."""
    import entropylens.integrations.verl as el_verl

    base = trainer_cls or el_verl.EntropyLensTrainer

    class Trainer(base):
        def _setup(self):
            self.actor_rollout_wg = wg
            self.global_steps = 0  # a job started from scratch (verl's _load_checkpoint found none)

        def on_init_end(self):
            return None

    t = Trainer(cfg)
    t.init()
    t.global_steps = global_steps
    return t


def put_rollout(
    partition: str, *, seed: int = 0, b: int = 8, with_old: bool = True, vocab: int = 20, zero_mask_tail: bool = True
):
    """A rollout as v1's agent loop and _compute_old_log_prob / _compute_advantage leave it in
    TransferQueue: per-sample prompts, responses, response_mask (= loss_mask), input_ids, position_ids,
    then (``with_old``) old_log_probs, the old entropy (``entropy``) and advantages, all nested over
    the response. old_log_probs are spread so that the current policy's ratios fall in every region.
    Returns (KVBatchMeta, reference dict of the padded tensors)."""
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    keys, fields, tags = [], [], []
    ref = {"adv": [], "old": [], "old_ent": [], "mask": [], "responses": [], "prompts": []}
    for i in range(b):
        p_len, r_len = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(3, 8, (1,), generator=g))
        prompts = torch.randint(3, 3 + vocab, (p_len,), generator=g)
        responses = torch.randint(3, 3 + vocab, (r_len,), generator=g)
        mask = torch.ones(r_len, dtype=torch.int64)
        if zero_mask_tail and i % 3 == 1:
            mask[-1] = 0  # e.g. a tool-output token: no loss
        input_ids = torch.cat([prompts, responses])
        field = {
            "prompts": prompts,
            "responses": responses,
            "response_mask": mask,
            "loss_mask": mask,
            "input_ids": input_ids,
            "position_ids": torch.arange(p_len + r_len),
            "attention_mask": torch.ones(p_len + r_len, dtype=torch.int64),
        }
        keys.append(f"{partition}_{seed}_{i}")
        fields.append(field)
        tags.append(
            {
                "status": "success",
                "prompt_len": p_len,
                "response_len": r_len,
                "seq_len": p_len + r_len,
                "global_steps": 1,
            }
        )
        adv = torch.full((r_len,), [1.5, -1.0, 0.7, -0.4, 0.0, 2.0, -2.0, 0.3][i % 8], dtype=torch.float64)
        old = -torch.rand(r_len, generator=g, dtype=torch.float64) * 6.0 - 0.3
        old_ent = torch.rand(r_len, generator=g, dtype=torch.float64) * 2.0 + 0.5
        for k, v in (
            ("adv", adv),
            ("old", old),
            ("old_ent", old_ent),
            ("mask", mask),
            ("responses", responses),
            ("prompts", prompts),
        ):
            ref[k].append(v)
    meta = tq.kv_batch_put(keys=keys, partition_id=partition, fields=tu.list_of_dict_to_tensordict(fields), tags=tags)
    if with_old:
        nested = lambda xs: torch.nested.as_nested_tensor(list(xs), layout=torch.jagged)  # noqa: E731
        td = TensorDict(
            {"old_log_probs": nested(ref["old"]), "entropy": nested(ref["old_ent"]), "advantages": nested(ref["adv"])},
            batch_size=b,
        )
        meta = tq.kv_batch_put(keys=keys, partition_id=partition, fields=td)
    return meta, ref


def fetch(meta, fields):
    import transfer_queue as tq

    return tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=list(fields))


__all__ = [
    "start_ray_and_store",
    "stop_ray_and_store",
    "tiny_model_dir",
    "compose",
    "build_actor_worker",
    "worker_group",
    "build_trainer",
    "put_rollout",
    "fetch",
    "trainer_overrides",
    "SETTINGS",
    "on_cpu",
]
