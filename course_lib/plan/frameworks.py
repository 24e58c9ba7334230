"""What a training stack keeps and overlaps: the planner's framework profiles.

Two stacks can run one layout and differ by a third in speed and memory, for choices that are
not the layout: the bytes a parameter's gradient and master copy take, what "selective"
recomputation keeps, which collectives run beside the matmuls, how the pipeline's stages are
cut. A ``Framework`` names these choices, each with the file that makes it, and every formula of
the cost model reads them (``StepShape.framework``):

=================  ==========  ==================  ===============  =================================
profile            bytes per   selective keeps     overlapped       stages
                   parameter   (per block)
=================  ==========  ==================  ===============  =================================
``course``         2 + 2 + 12  matmul and          gradient         the list [embedding, blocks, head]
                               attention results   reductions       cut evenly
``torchtitan``     4 + 4 + 8   every 2nd matmul's  gradient         as course
                   (FSDP2)     result (op-SAC)     reductions;
                                                   TP if async TP
``megatron``       2 + 4 + 12  all but the         gradients,       equal blocks; embedding and head
                               attention core      parameter        at the ends; plain 1F1B waits
                                                   gathers, TP      on every micro-batch's sends
                                                   (as flagged)
``fp32-master``    2 + 4 + 4   as course           gradient         as course
                   + 8                             reductions
                   (autocast)
=================  ==========  ==================  ===============  =================================

How the bytes live through a step differs too: the course's and Megatron's gradients sit in a
buffer for the whole step (``kept``); torchtitan's and autocast's are freed after each optimizer
step and grow back during the backward (``regrown``), so their peak is the larger of the
forward's end and the backward's, not the sum (``memory_phases``).

In ``bf16``; in ``fp32`` every stack keeps 4 + 4 + 8 and reduces 4 bytes a gradient. A variant is a
profile with fields changed (``Framework.with_``): Megatron-LM of 2021 reduces its gradients after
the backward, Megatron-Core of 2024 with ``--overlap-grad-reduce`` beside it.

The cost: none; a profile changes which formula a term uses, never adds a fitted constant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..checks import check_choice, check_fields, check_number

SELECTIVE_POLICIES = ("course", "op_sac", "attention_core")
"""What ``recomputation="selective"`` keeps, by stack: ``course`` (``parallel.recompute``: the
block's input, its matmuls' and attention's results), ``op_sac`` (torchtitan: the results of
every other matmul and of the attention), ``attention_core`` (Megatron-LM: everything but the
attention core, recomputed)."""


GRADIENT_CONVENTIONS = ("kept", "regrown")
"""How a stack's gradients live through a step (``Framework.gradients``)."""


@dataclass(frozen=True)
class Framework:
    """One training stack's conventions, as the cost model reads them (bf16 training).

    Args:
        name: the profile's name (``FRAMEWORKS``).
        param_bytes: bytes of each parameter as stored for forward and backward.
        grad_bytes: bytes of each gradient as kept until the optimizer step.
        master_bytes: bytes of an fp32 master copy kept beside the parameters (0: the stored
            parameters are the master, as FSDP2's fp32 shards are).
        moment_bytes: bytes of the optimizer's moments per parameter (Adam: two fp32).
        master_sharded: the master copy is sharded with the optimizer's moments (ZeRO-1 and up);
            False: every data-parallel rank keeps all of it, only the moments are sharded.
        reduce_bytes: bytes per gradient element the data axis reduces.
        loss_bytes_per_logit: bytes per logit alive at the loss (the logits, an fp32 copy, the
            log-softmax kept for backward).
        selective: what ``"selective"`` recomputation keeps, one of ``SELECTIVE_POLICIES``.
        tensor_overlap: tensor parallelism's collectives run beside the matmuls they feed (async
            TP, Megatron's ``--tp-comm-overlap``), cut into T pieces of which only the first waits.
        param_gather_overlap: ZeRO-1/2's gather of the updated parameters runs beside the next
            forward (Megatron's ``--overlap-param-gather``).
        grad_reduce_overlap: the data axis reduces gradients beside the backward (DDP's buckets);
            False: after it.
        compiled: the blocks' memory-bound operations are fused (``torch.compile``, or a stack's
            own fused kernels) rather than run one kernel each.
        gathered_under_pipeline: under pipeline parallelism FSDP keeps a stage's parameters
            gathered for the whole step (one gather a step, not one a micro-batch), so the stage's
            whole bf16 copy is held; False: two units at a time, as without a pipeline.
        fp8_all_gather: under ``fp8``, FSDP gathers the parameters already cast to fp8 (1 byte an
            element, torchtitan's ``enable_fsdp_float8_all_gather``), not in bf16.
        blocking_pipeline_sends: the pipeline schedules in which every micro-batch waits for its
            sends and receives between stages (Megatron's 1F1B without interleaving cannot overlap
            them); in the others only filling and draining the pipeline pays them.
        equal_stage_blocks: every pipeline stage holds L/(P·v) blocks, the embedding and head
            added to the ends (Megatron-LM); False: the list [embedding, blocks, head] is cut
            evenly (``pipeline.split_model``, torchtitan's default).
        gradients: how the gradients live through a step, one of ``GRADIENT_CONVENTIONS``:
            ``"kept"`` in a buffer for the whole step (DDP's buckets that the gradients are views
            of, Megatron's ``main_grad``, the course's flat shards); ``"regrown"``: freed by
            ``zero_grad(set_to_none=True)`` after the optimizer step and grown again during the
            backward as the activations are freed (PyTorch's default; FSDP2's sharded gradients).
            With more than one micro-batch they are present from the second forward on either way.
        autocast: PyTorch's autocast around an fp32 model: the stored parameters are the fp32
            master; the matmuls' weights are cast to bf16 in forward (``param_bytes``, saved for
            backward and freed as it runs, so absent at its end); the residual stream stays fp32
            (the embedding's output is fp32, and a bf16 result added to it stays fp32), so each
            norm keeps an fp32 input and an fp32 normalized output; every step casts each weight
            to bf16 and each bf16 weight gradient back to fp32.
        logits_upcast: the loss makes an fp32 copy of the bf16 logits (``.float()``), and its
            backward casts the gradient back: 12 bytes a logit copied (``loss_bytes_per_logit``
            counts the copy among what is alive at the loss).
        fsdp_side_streams: FSDP's gathers and reductions run on streams of their own (FSDP2): the
            caching allocator keeps one pool per stream, so the gathered parameters, the reduction
            buffers and the sharded gradients come from pools the default stream cannot reuse
            (reserved though freed), and the root module's parameters (the embedding, the final
            norm and the head) stay gathered from its forward to its backward.
        expert_imbalance: under expert parallelism, the busiest expert rank's load over the mean,
            as the stack's routing leaves it: a step waits for that rank's experts' matmuls and
            all-to-all rows. The busiest expert's load over the mean
            (``parallel.dropless.load_imbalance``, ``bench balance``) bounds it, and equals it at
            one expert a rank. 1 (the default, the best case, stated as an assumption): even.
        grouped_experts: a rank's experts multiply their rows in one grouped kernel
            (``torch._grouped_mm``, CUTLASS's grouped GEMM); False: one product per expert.
        sources: where each convention is made, ``(field, "repository@commit:path (what)")``.
    """

    name: str
    param_bytes: float = 2
    grad_bytes: float = 2
    master_bytes: float = 4
    moment_bytes: float = 8
    master_sharded: bool = True
    reduce_bytes: float = 2
    loss_bytes_per_logit: float = 4
    selective: str = "course"
    tensor_overlap: bool = False
    param_gather_overlap: bool = False
    grad_reduce_overlap: bool = True
    equal_stage_blocks: bool = False
    compiled: bool = False
    gathered_under_pipeline: bool = False
    fp8_all_gather: bool = False
    blocking_pipeline_sends: tuple[str, ...] = ()
    gradients: str = "kept"
    autocast: bool = False
    logits_upcast: bool = False
    fsdp_side_streams: bool = False
    expert_imbalance: float = 1.0
    grouped_experts: bool = False
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        byte_fields = ("param_bytes", "grad_bytes", "master_bytes", "moment_bytes", "reduce_bytes")
        check_fields(self, minimum=dict.fromkeys((*byte_fields, "loss_bytes_per_logit"), 0))
        check_choice("selective", self.selective, SELECTIVE_POLICIES)
        check_choice("gradients", self.gradients, GRADIENT_CONVENTIONS)
        check_number("expert_imbalance", self.expert_imbalance, minimum=1.0)

    def with_(self, **changes) -> Framework:
        """This profile with some fields changed (a stack's flags)."""
        return dataclasses.replace(self, **changes)

    def state_bytes(self, precision: str) -> dict[str, float]:
        """Bytes per parameter of parameters, gradients and optimizer state, as
        ``memory.model_state_bytes`` takes them: a master copy that is not sharded with the
        moments counts with the parameters (it is sharded only where they are).

        Args:
            precision: ``"bf16"`` (this profile's bytes) or ``"fp32"`` (4 + 4 + 8 for every stack).
        """
        if precision == "fp32":
            return {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}
        master_with_params = 0 if self.master_sharded else self.master_bytes
        return {
            "param_bytes": self.param_bytes + master_with_params,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.moment_bytes + self.master_bytes - master_with_params,
        }

    def gradient_reduce_bytes(self, precision: str) -> float:
        """Bytes per gradient element the data axis reduces, in ``precision``."""
        return 4 if precision == "fp32" else self.reduce_bytes

    def gather_bytes(self, precision: str) -> float:
        """Bytes per parameter element FSDP and ZeRO gather, in ``precision``."""
        if precision == "fp32":
            return 4
        return 1 if precision == "fp8" and self.fp8_all_gather else 2

    def autocasts(self, precision: str) -> bool:
        """Whether a step in ``precision`` runs under autocast (``autocast``; in fp32 nothing is cast)."""
        return self.autocast and precision != "fp32"

    def logit_bytes(self, precision: str) -> float:
        """Bytes per logit alive at the loss, in ``precision`` (the course's 4 in fp32)."""
        return 4 if precision == "fp32" else self.loss_bytes_per_logit


TORCHTITAN = "pytorch/torchtitan@004b3148a92b565ef0ce7a7bcc61e0159c7ec930"
TORCHTITAN_LOSS = "pytorch/torchtitan@f90c845c0ef9dbaf29d4d577e926c974e1630163:torchtitan/components/loss.py"
MEGATRON = "NVIDIA/Megatron-LM@f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4"

MIXTRAL_RECIPE = "NVIDIA-NeMo/Megatron-Bridge@556b474d34f88ccf7f4521bb6142c5c2a7ca809a"
GPT_OSS_RECIPE = "NVIDIA-NeMo/Megatron-Bridge@a9497c6b1cad42f11d875f72317d404140b003fb"

COURSE_PROFILE = Framework(
    "course",
    grouped_experts=True,
    sources=(
        (
            "grouped_experts",
            "course_lib/parallel/dropless.py (GroupedExperts: one grouped_mm for a rank's experts)",
        ),
        ("bytes", "Rajbhandari et al., ZeRO (arXiv:1910.02054) section 3: 2 + 2 + 12 bytes a parameter"),
        ("selective", "course_lib/parallel/recompute.py (the selective policy's saved operations)"),
        ("stages", "course_lib/parallel/pipeline (split_model)"),
    ),
)

TORCHTITAN_PROFILE = Framework(
    "torchtitan",
    param_bytes=4,
    grad_bytes=4,
    master_bytes=0,
    reduce_bytes=4,
    loss_bytes_per_logit=2 + 4 + 4,
    selective="op_sac",
    gathered_under_pipeline=True,
    gradients="regrown",
    logits_upcast=True,
    fsdp_side_streams=True,
    grouped_experts=True,
    sources=(
        (
            "grouped_experts",
            "pytorch/torchtitan@b4a1b8882da64a81e49f0d1067619c3babb8eb62:torchtitan/models/moe.py "
            "(GroupedExperts: torch._grouped_mm over a rank's experts)",
        ),
        (
            "gradients",
            f"{TORCHTITAN}:torchtitan/train.py (optimizers.zero_grad() before each step, "
            "set_to_none by default; 'del pred' before loss.backward() so the logits are not kept)",
        ),
        (
            "fsdp_side_streams",
            "torch.distributed.fsdp.fully_shard's docstring (reshard_after_forward: 'the root FSDP state "
            "has its value specially set to False'); the CUDA semantics notes, memory management (the "
            "caching allocator's blocks are reused on the stream they were freed on)",
        ),
        (
            "bytes",
            f"{TORCHTITAN}:torchtitan/parallelisms/parallelize_llama.py (apply_fsdp: "
            "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32); the optimizer steps "
            "the fp32 shards)",
        ),
        (
            "selective",
            f"{TORCHTITAN}:torchtitan/parallelisms/parallelize_llama.py (_apply_ac_to_transformer_block: "
            "saves the outputs of mm, SDPA and reduce_scatter, 'except every second mm')",
        ),
        (
            "loss",
            f"{TORCHTITAN_LOSS} (cross_entropy(pred.flatten(0, 1).float(), ...): the bf16 logits, "
            "their fp32 copy, the fp32 log-softmax)",
        ),
        (
            "gathered_under_pipeline",
            f"{TORCHTITAN}:torchtitan/parallelisms/parallelize_llama.py (apply_fsdp: 'For PP, do not "
            "reshard after forward to avoid per-microbatch all-gathers')",
        ),
        (
            "tensor_overlap",
            f"{TORCHTITAN}:torchtitan/parallelisms/parallelize_llama.py (apply_tp, enable_async_tp: "
            "inductor's micro-pipelined TP)",
        ),
    ),
)

MEGATRON_PROFILE = Framework(
    "megatron",
    grad_bytes=4,
    reduce_bytes=4,
    selective="attention_core",
    equal_stage_blocks=True,
    compiled=True,
    blocking_pipeline_sends=("1f1b",),
    grouped_experts=True,
    sources=(
        (
            "grouped_experts",
            f"{MIXTRAL_RECIPE}:src/megatron/bridge/models/mixtral/mixtral_provider.py and {GPT_OSS_RECIPE}:"
            "scripts/performance/dryrun_configs/gpt_oss/gpt_oss_120b_pretrain_h100_fp8_mx_v1.yaml "
            "(moe_grouped_gemm: true, moe_token_dispatcher_type: alltoall, no capacity: dropless)",
        ),
        (
            "grad_bytes",
            f"{MEGATRON}:megatron/training/arguments.py ('bfloat16 requires gradient accumulation and "
            "all-reduce to be done in fp32'); docs/source/api-guide/distrib_optimizer.md (18 bytes a "
            "parameter, 6 + 12/d with the distributed optimizer)",
        ),
        (
            "selective",
            "Korthikanti et al. (arXiv:2205.05198) section 4.2, recompute the attention core; "
            f"{MEGATRON}:megatron/training/arguments.py (--recompute-granularity selective)",
        ),
        (
            "overlap",
            f"{MEGATRON}:megatron/training/arguments.py (--overlap-grad-reduce, --overlap-param-gather, "
            "--tp-comm-overlap)",
        ),
        (
            "compiled",
            f"{MEGATRON}:megatron/training/arguments.py (--bias-gelu-fusion, --masked-softmax-fusion, "
            "--bias-dropout-fusion and the fused LayerNorm, on unless turned off)",
        ),
        (
            "stages",
            f"{MEGATRON}:megatron/core/transformer/transformer_block.py (get_num_layers_to_build: L/P "
            "blocks a stage)",
        ),
        (
            "blocking_pipeline_sends",
            f"{MEGATRON}:megatron/core/pipeline_parallel/schedules.py (forward_backward_pipelining_"
            "without_interleaving: 'Non-interleaved pipeline parallelism does not support overlapping "
            "p2p communication'; the interleaved schedule overlaps them with overlap_p2p_comm)",
        ),
    ),
)

FP32_MASTER_PROFILE = Framework(
    "fp32-master",
    grad_bytes=4,
    reduce_bytes=4,
    master_sharded=False,
    loss_bytes_per_logit=2 + 4 + 4,
    gradients="regrown",
    autocast=True,
    logits_upcast=True,
    sources=(
        (
            "bytes",
            "PyTorch's automatic mixed precision: fp32 parameters (the master, on every rank; ZeRO-1 "
            "shards only Adam's moments), their bf16 casts made by torch.autocast in forward, fp32 "
            "gradients",
        ),
        (
            "autocast",
            "torch.amp's autocast op reference: matmuls run in bf16 (their fp32 weights cast, the cast "
            "saved for backward), embedding and elementwise operations in their inputs' dtype",
        ),
        ("gradients", "torch.optim.Optimizer.zero_grad (set_to_none=True, the default since PyTorch 2.0)"),
        ("loss", "the bf16 logits, their fp32 copy and the fp32 log-softmax, alive together at the loss"),
    ),
)

FRAMEWORKS = {
    profile.name: profile
    for profile in (COURSE_PROFILE, TORCHTITAN_PROFILE, MEGATRON_PROFILE, FP32_MASTER_PROFILE)
}
"""The built-in profiles, by name (``--framework``)."""
