"""One optimizer step of stage 2: what the training loop repeats and what benchmark P7 times.

`DistillStep` owns the student's optimizer, learning-rate schedule, precision and data-parallel wrapper:
* DeepSpeed (`distill.deepspeed`): a ZeRO engine (bucketed reduce-scatter of the gradients; in `bf16` mode its
  float32 partition is the master copy the optimizer steps); at ZeRO-3 the weights are partitioned too and the
  engine wraps the loss module (`sharded_weights`);
* plain torch on several ranks: DistributedDataParallel (bucketed all-reduce overlapped with the backward;
  the micro-batches before the last one of an accumulation run under `no_sync`); with master weights (bf16-mixed)
  `MasterWeights` instead, which sums every micro-batch's gradient into float32 and all-reduces that sum once per
  step (DDP would sum and reduce in bfloat16; the reduce no longer overlaps the last backward: one all-reduce of
  4 bytes a parameter per `grad_accum` micro-batches);
* plain torch on one rank: the student itself.
On the plain paths a policy with master weights (`distill.precision: bf16-mixed`, distill/precision.py) keeps the
student in bfloat16 and steps float32 copies of its parameters, as ZeRO does; gradients are summed in float32 on every
path (distill/precision.py); the three paths train the same numbers.
A step reads nothing back to the host: the running loss stays on the device until `take_loss()`
(the loop calls it at a report). Training blocks are packed, with no padding, so no attention mask
is passed: the models take SDPA's causal path and nothing checks a mask on the host.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from m2d_ray.catalog.targets import HIDDEN, ONLINE, TOPK, mode_of
from m2d_ray.config import DistillConfig
from m2d_ray.distill import kernels
from m2d_ray.distill.checkpointing import compile_layers, compose_problem
from m2d_ray.distill.kernels import KLKernel, Where, kl_kernel
from m2d_ray.distill.losses import LOSSES, hidden_mse, sampled_kl, sparse_kl
from m2d_ray.distill.masters import MasterWeights
from m2d_ray.distill.precision import (  # noqa: F401  (DEEPSPEED_FP32_SUMS, deepspeed_refusal: re-exported)
    DEEPSPEED_FP32_SUMS,
    PRECISIONS,
    Precision,
    deepspeed_refusal,
)
from m2d_ray.distill.targets import TargetSpec
from m2d_ray.errors import M2DError

# Imported inside functions: DeepSpeed (only where a student trains with it).


def lr_factor(step: int, cfg: DistillConfig) -> float:
    """Linear warm-up to lr, then cosine down to min_lr at the last step (a multiplier of lr)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    low = cfg.min_lr / cfg.lr
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))


def ds_config(cfg: DistillConfig, dtype: torch.dtype) -> dict:
    """ZeRO in `dtype`: `bf16` mode keeps float32 master weights and optimizer states (the `bf16-mixed` policy), and
    sums gradients in float32: over micro-batches into its float32 gradient partition (`grad_accum_dtype`, which ZeRO-2
    honours from DeepSpeed 0.19.8, DEEPSPEED_FP32_SUMS, checked by `deepspeed_refusal`: no bfloat16 sum, the error
    DeepSpeed itself warns of), and over ranks in float32 buckets (`communication_data_type`: twice a bfloat16
    reduce's bytes, once per micro-batch)."""
    fp32_sums = {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}
    return {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero, "overlap_comm": False, "contiguous_gradients": True},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        **(fp32_sums if dtype != torch.float32 else {}),
    }


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only (norm gains and biases are not shrunk towards zero)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def all_reduce_sum(values: Sequence[float | Tensor], device: str | torch.device, world: int) -> list[float]:
    """Sums over ranks of a few numbers, reduced in a float64 tensor on the training device: NCCL (every
    multi-GPU Ray Train job) takes CUDA tensors only. Reading the result is a host sync: call it rarely."""
    buf = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    if world > 1 and dist.is_initialized():
        dist.all_reduce(buf)
    return buf.tolist()


def all_reduce_max(values: Sequence[float], device: str | torch.device, world: int) -> list[float]:
    """Maxima over ranks of a few numbers (as `all_reduce_sum`, with MAX)."""
    buf = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if world > 1 and dist.is_initialized():
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf.tolist()


def teacher_outputs(teacher: nn.Module, ids: Tensor, with_states: bool) -> tuple[Tensor, tuple[Tensor, ...] | None]:
    """The frozen teacher's final hidden states (and every layer's, for the MSE term) on one batch."""
    with torch.no_grad():
        out = teacher.base_model(input_ids=ids, output_hidden_states=with_states, use_cache=False)
    return out.last_hidden_state, out.hidden_states if with_states else None


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """The model's floating-point parameters in `dtype`, in place (the same Parameter objects: an optimizer or a
    wrapper built after sees them); buffers keep their dtype (rotary frequencies stay float32)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def refuse_aliases(student: nn.Module, teacher: Sequence[nn.Module | Tensor | None]) -> None:
    """One line when a student parameter shares memory with its teacher's weights (a student built in-process from
    a teacher without copying them): its optimizer would update the teacher that the loss treats as frozen."""
    mine = {_storage(p): n for n, p in student.named_parameters()}
    tensors = [x for t in teacher if t is not None for x in ([t] if isinstance(t, Tensor) else t.state_dict().values())]
    shared = sorted({mine[s] for t in tensors if (s := _storage(t)) in mine and s is not None})
    if shared:
        raise M2DError(
            f"the student shares {len(shared)} tensors with its teacher ({', '.join(shared[:3])}"
            f"{', ...' if len(shared) > 3 else ''}): distilling it would train the frozen teacher too; give the "
            "student its own copy of them (m2d_ray.convert's builders do)"
        )


def _storage(t: Tensor) -> int | None:
    """The address of the memory a tensor lives in (a sharded one's local shard); None for meta or empty ones."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return None if local.device.type == "meta" or not local.numel() else local.untyped_storage().data_ptr()


class StudentLoss(nn.Module):
    """The student's forward and its loss against the teacher's outputs on the same batch.

    A module of its own so that DDP can wrap it: DDP reduces gradients only for forwards that run
    through it, and the student's own forward would form the [tokens x vocab] logits the chunked KL avoids.
    """

    def __init__(
        self, student: nn.Module, cfg: DistillConfig, targets: TargetSpec | None = None, kernel: KLKernel | None = None
    ) -> None:
        super().__init__()
        self.student = student
        self.kind, self.with_states = LOSSES[cfg.loss]
        self.cfg, self.targets = cfg, targets
        self.mode = mode_of(targets)
        self.kl = (kernel or kl_kernel("chunked", "cpu")).kl

    def forward(
        self,
        ids: Tensor,
        t_last: Tensor | dict[str, Tensor],
        w_t: Tensor | None = None,
        t_states: tuple[Tensor, ...] | None = None,
    ) -> Tensor:
        """Online and from cached hidden states: `t_last` is the teacher's final hidden states and `w_t` its
        output head (the same exact loss); top-K / sampled: the batch's targets (distill/targets.py)."""
        out = self.student.base_model(input_ids=ids, output_hidden_states=self.with_states, use_cache=False)
        h = out.last_hidden_state
        h, w_s, t, c = (
            h.reshape(-1, h.shape[-1]),
            self.student.get_output_embeddings().weight,
            self.cfg.temperature,
            self.cfg.loss_chunk,
        )
        if self.mode not in (ONLINE, HIDDEN):  # cached top-K / sampled targets: their own losses
            flat = {k: v.reshape(h.shape[0], *v.shape[2:]) for k, v in t_last.items()}
            if self.mode == TOPK:
                return sparse_kl(h, w_s, flat["ids"], flat["logp"], flat["tail"], temperature=t, chunk=c)
            return sampled_kl(h, w_s, flat["ids"], flat["counts"], flat["logp"], temperature=t, chunk=c)
        loss = self.kl(h, w_s, t_last.reshape(-1, t_last.shape[-1]), w_t, kind=self.kind, temperature=t, chunk=c)
        if self.with_states:
            loss = loss + self.cfg.mse_weight * hidden_mse(out.hidden_states, t_states)
        return loss


class DistillStep:
    """`step(micro_batches)` = one optimizer step over cfg.grad_accum micro-batches of [batch, seq_len] ids.

    `teacher` runs here (online), or is None with cached `targets`; `head` is the teacher's output projection
    [V, d] that online and `hidden` targets form the teacher's logits with (no gradient reaches it): given with
    `hidden` targets and a sharded teacher, else the loaded teacher's. The student's parameters are cast to the
    `precision`'s dtype here (its buffers, such as rotary frequencies, are left as they are, as DeepSpeed leaves
    them), after the plain path's float32 masters are taken from them. A student that shares a tensor with its
    teacher is refused: the step would train the frozen teacher too.
    DeepSpeed, or `world` > 1, needs an initialised process group (Ray Train's, or deepspeed.init_distributed).

    `__init__` reads top to bottom as named steps (torchtune's KD recipe's way): the training mode, the teacher's
    head, the loss (kernel; compiled with distill.compile), the float32 masters, the cast, the optimizer and schedule,
    then the data-parallel wrapper (DeepSpeed replaces the optimizer and schedule, so it comes last).
    """

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module | None,
        cfg: DistillConfig,
        device: str,
        world: int = 1,
        precision: Precision = PRECISIONS["fp32"],
        targets: TargetSpec | None = None,
        head: Tensor | None = None,
    ) -> None:
        """The set-up, in the order its steps depend on each other (each step's docstring says what it needs)."""
        self.cfg, self.student, self.teacher, self.device, self.world = cfg, student, teacher, device, world
        self.precision, self.targets = precision, targets
        self.mode = self._setup_mode()
        self.head = self._setup_head(head)
        refuse_aliases(student, [teacher, self.head])
        self.kernel, self.loss_module = self._setup_loss()
        self.masters = self._setup_masters()
        cast_parameters(student, precision.dtype)  # after the masters: they copy the float32 weights
        self.opt, self.sched = self._setup_optimizer()
        self.trained = [p for g in self.opt.param_groups for p in g["params"]]  # what the gradient clip reads
        self.engine, self.ddp = self._setup_parallel()
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._losses = 0

    def _setup_mode(self) -> str:
        """The training mode, the one source that step() and StudentLoss read: online (the teacher runs here) or the
        cached targets' mode (hidden, topk, sampled)."""
        if (self.teacher is None) == (self.targets is None):
            raise ValueError("DistillStep trains online (a teacher, no targets) or from cached targets (no teacher)")
        return mode_of(self.targets)

    def _setup_head(self, head: Tensor | None) -> Tensor | None:
        """The teacher's output head [V, d] the exact modes form its logits with: given (hidden targets, a sharded
        teacher), else the loaded teacher's; no gradient reaches it."""
        if head is None and self.teacher is not None:
            head = self.teacher.get_output_embeddings().weight
        return head.detach() if head is not None else None

    def _setup_loss(self) -> tuple[KLKernel, StudentLoss]:
        """The KL kernel for this run (its loss, temperature and path) and the student's loss module; with
        distill.compile the student's decoder layers compiled one by one, the head and the KL left eager
        (distill/checkpointing.py compile_layers; before the masters and the cast: it wraps the modules, not their
        weights)."""
        cfg = self.cfg
        where = Where.of(cfg.loss, cfg.temperature, cfg.uses_deepspeed, self.world, cfg.batch_size * cfg.seq_len)
        kernel = kl_kernel(cfg.kl_kernel, self.device, self.targets, where)
        loss_module = StudentLoss(self.student, cfg, self.targets, kernel)
        if cfg.compile:
            problem = (
                compose_problem()
                if any(getattr(m, "gradient_checkpointing", False) for m in self.student.modules())
                else None
            )
            if problem:  # the lever says so, in one line: its layers run eagerly under their checkpoint
                print(f"distill.compile: {problem}", file=sys.stderr, flush=True)
            compile_layers(self.student, kernels.COMPILE_BACKEND)
        return kernel, loss_module

    def _setup_masters(self) -> MasterWeights | None:
        """Float32 master copies of the student's parameters on the plain paths of a policy with masters; taken
        before the parameters are cast to the policy's dtype (DeepSpeed keeps its own)."""
        if self.precision.masters and not self.cfg.uses_deepspeed:
            return MasterWeights(self.student.parameters(), self.world)
        return None

    def _setup_optimizer(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """AdamW over the masters (if any) or the cast parameters, and the warm-up + cosine schedule; needs the
        masters and the cast done."""
        cfg = self.cfg
        groups = param_groups(self.student, cfg.weight_decay)
        fused = torch.device(self.device).type in ("cpu", "cuda")  # one kernel for all tensors (P7: -2.6% step)
        opt = torch.optim.AdamW(
            self.masters.groups(groups) if self.masters else groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=fused
        )
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))

    def _setup_parallel(self):
        """The data-parallel wrapper: a DeepSpeed engine (which replaces the optimizer and the scheduler by its own
        wrappers: called last), DDP over the loss module on several plain ranks without masters (masters sum and
        reduce their gradients in float32 themselves), or none."""
        if self.cfg.uses_deepspeed:
            why = deepspeed_refusal(self.precision.dtype, self.cfg.zero)
            if why:
                raise M2DError(why)
            import deepspeed

            engine, self.opt, _, self.sched = deepspeed.initialize(
                model=self.loss_module if self.sharded_weights else self.student,
                optimizer=self.opt,
                lr_scheduler=self.sched,
                config=ds_config(self.cfg, self.precision.dtype),
            )
            return engine, None
        if self.world > 1 and self.masters is None:
            cuda = torch.device(self.device).type == "cuda"
            ddp = nn.parallel.DistributedDataParallel(
                self.loss_module,
                device_ids=[torch.cuda.current_device()] if cuda else None,
                gradient_as_bucket_view=True,
            )
            return None, ddp
        return None, None

    def _inputs(self, mb: Tensor | dict[str, Tensor]) -> tuple[Tensor, tuple]:
        """A micro-batch as the student's ids and what its loss compares them with, by the training mode."""
        if self.mode == ONLINE:
            t_last, t_states = teacher_outputs(self.teacher, mb, self.loss_module.with_states)
            return mb, (t_last, self.head, t_states)
        if self.mode == HIDDEN:  # cached final hidden states: the online loss through the head
            return mb["tokens"], (mb[HIDDEN].to(self.head.dtype), self.head)
        return mb["tokens"], ({k: v for k, v in mb.items() if k != "tokens"},)  # top-K / sampled targets

    def step(self, micro_batches: Sequence[Tensor | dict[str, Tensor]]) -> None:
        """Micro-batches of ids (online: the teacher runs here), or dicts of input `tokens` and their cached targets."""
        forward = self.ddp or (self.engine if self.sharded_weights else self.loss_module)
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            ids, teacher = self._inputs(mb)
            with self.ddp.no_sync() if self.ddp is not None and i < last else contextlib.nullcontext():
                loss = forward(ids, *teacher)
                if self.engine is not None:
                    self.engine.backward(loss)  # scaled by 1/grad_accum inside
                    self.engine.step()  # the optimizer runs at accumulation boundaries only
                else:
                    (loss / len(micro_batches)).backward()
            self._loss_sum += loss.detach()
            self._losses += 1
        if self.engine is None:
            if self.masters is not None:
                self.masters.take_grads()
            torch.nn.utils.clip_grad_norm_(self.trained, self.cfg.grad_clip)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            if self.masters is not None:
                self.masters.write_back()

    @property
    def sharded_weights(self) -> bool:
        """ZeRO-3: the student's weights partitioned over the ranks. The engine wraps the loss module and the step's
        forward runs through it: each layer is gathered as it runs, and the student's head, which the chunked KL reads
        as a tensor outside any layer's forward, is found by DeepSpeed's external-parameter detection and gathered for
        the loss and its backward. The student's own module and parameter names are unchanged (`consolidated`)."""
        return self.cfg.uses_deepspeed and self.cfg.zero == 3

    def whole_head(self) -> contextlib.AbstractContextManager:
        """The student's output head gathered whole while inside (every rank enters it: a collective); the head as it
        is off ZeRO-3. What validation needs: it reads the head as a tensor, outside the engine's forward."""
        if not self.sharded_weights:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters([self.student.get_output_embeddings().weight])

    def consolidated(self, rank: int) -> dict[str, Tensor] | None:
        """ZeRO-3: the student's parameters gathered one at a time (every rank takes part) and copied to the host on
        rank 0, by their own names (tied ones once): the consolidated student rank 0 exports; None elsewhere or off
        ZeRO-3 (the student's module holds them whole)."""
        if not self.sharded_weights:
            return None
        import deepspeed

        out = {}
        for name, p in self.student.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                if rank == 0:
                    out[name] = p.detach().to("cpu", copy=True)
        return out if rank == 0 else None

    def take_loss(self) -> float:
        """Mean training loss over the micro-batches since the last call (and over ranks); resets it."""
        total, count = all_reduce_sum([self._loss_sum, self._losses], self.device, self.world)
        self._loss_sum.zero_()
        self._losses = 0
        return total / max(count, 1)

    @property
    def lr(self) -> float:
        return self.sched.get_last_lr()[0]
