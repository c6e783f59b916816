"""The ``framework`` config group's schema: how a training framework behaves (xpar, torchtitan,
Megatron-LM, Megatron-Core, DeepSpeed, llm-foundry, MaxText profiles in conf/framework/*.yaml).

Every field is a behaviour the cost model prices (:class:`xpar.estimate.cost.Assumptions`) or a rule
of what the framework runs (xpar plan, validation); :mod:`xpar.config.schema` registers it in Hydra's
ConfigStore with the other groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class FrameworkConfig:
    """Which training framework the estimate is for: how it computes and communicates.
    Presets in conf/framework/ (xpar, megatron, megatron_core, torchtitan, llmfoundry, deepspeed,
    deepspeed_2021), each with its sources.
    The cost model's :class:`xpar.estimate.step_parts.Assumptions` are these fields but the plan's
    (``step_parts.PLAN_FIELDS``), and its ``MemoryOptions`` the ``model_states.MEMORY_FIELDS``: both derived from
    this class, so each field and default is declared here only."""

    name: str = "xpar"
    """The framework profile (framework=<name>): whose memory and time behaviour an estimate assumes."""
    flash_attention: bool = True
    """Fused (flash) attention: no s x s scores kept or moved through HBM."""
    sliding_window_kernel: bool = True
    """A sliding-window layer's (model.sliding_window) flash attention skips the (query, key) blocks outside the
    window (FlashAttention-2/3 and cuDNN through Transformer Engine: ``window_size``; flex_attention's block mask);
    false: the band is a dense mask over the whole s x s square, every block computed (torch SDPA with an
    ``attn_mask``: xpar's model)."""
    sink_attention: Optional[str] = None
    """How the attention core runs a model's learned sinks (model.attention_sinks), xpar.estimate.compute.kernel_block
    .sink_bytes: 'fused' (the sink is a term of the flash kernel's softmax; its backward adds one reduction
    dsink = sum over tokens of exp(sink - lse) D: Transformer Engine >= 2.8 FusedAttention with cuDNN >= 9.13.1,
    transformer_engine/common/fused_attn/fused_attn.cpp nvte_get_fused_attn_backend; cudnn-frontend
    scaled_dot_product_flash_attention.h), 'unfused' (the s x s scores in HBM, the sink column concatenated to
    them: Transformer Engine's UnfusedDotProductAttention, where cuDNN is older; priced as
    flash_attention false plus that copy), null: no sink path priced for this framework (an estimate of a model
    with sinks is refused; set one of the two)."""
    attention_kernel: str = "fa3"
    """The flash-attention kernel the framework runs (xpar.estimate.compute.kernel_costs.attention_fractions): 'fa3'
    (the device's own hardware.attention_efficiency: FlashAttention-3 on H100, FlashAttention-2 on A100); 'cudnn'
    (Transformer Engine's FusedAttention, which TE prefers on Hopper and newer: dot_product_attention/utils.py
    get_attention_backend), from cuDNN 9.5 at the device's own figures too (cuDNN 9.5.1 581.9 TFLOP/s forward against
    FlashAttention-3's 465.5 at 8 x 16 heads x 8192 x 128 on one H100: meta-pytorch/tritonbench issue 141; cuDNN
    1.7-2.3x SDPA's FlashAttention-2 on Hopper training shapes: huggingface/transformers PR 48163); 'cudnn_2024'
    (2024's cuDNN, 9.0-9.4, as FlashAttention-3's paper measured it in mid-2024), 'fa2' (the flash-attn 2 package)
    or 'sdpa' (torch SDPA, whose flash backend, FlashAttention-2, is first in its default order: PyTorch issue 138907;
    priced as 'fa2'); each at the preset's figures for that kernel (hardware.attention_efficiency_cudnn_2024, _fa2:
    on H100 0.545 and 0.35 of the BF16 peak forward against 0.65), the device's own where the preset has none."""
    cp_attention_merge: Optional[str] = None
    """How the attention core runs under context parallelism (xpar.estimate.cp_attention): None, one kernel per
    rank over the whole sequence's keys (xpar's engine: gathered K/V and a mask); 'bf16' or 'fp32', one kernel per
    cp step on the K/V chunk at hand, load-balanced (2 cp chunks, step 0 causal, the others unmasked halves), the
    steps' partial outputs merged by their log-sum-exp and the gradients accumulated in that dtype: 'bf16'
    Transformer Engine's ring (AttnFuncWithCP @v1.4, ``out = torch.empty_like(q)``, ``dq.add_``), 'fp32' torch's
    context_parallel (_templated_ring_attention, _SDPAMerger in float32, convert_to_f32) under torchtitan."""
    dropout: bool = False
    """Dropout after attention and MLP (1-byte masks kept, one more element-wise pass)."""
    fused_rmsnorm: bool = True
    """RMSNorm as one kernel keeping only its input (False: composite, keeps x * rstd too)."""
    sp_saves_gathered: bool = True
    """Sequence parallelism keeps the all-gathered inputs of column-parallel GEMMs (torch
    DTensor); False: keeps the shard and gathers again in backward (Megatron)."""
    passes_forward: float = 2.0
    """HBM passes per activation byte in forward (written, read back)."""
    passes_backward: float = 4.0
    """HBM passes per activation byte in backward."""
    scatter_gather: bool = False
    """Megatron's inter-stage scatter/gather: each tp rank sends 1/t of the activation."""
    dp_overlap: bool = True
    """Gradient reductions (DDP buckets, FSDP reduce-scatters) overlap the backward of the
    units before them; False: all after the backward (after the pipeline flush)."""
    fsdp_prefetch: bool = True
    """ZeRO-3/FSDP all-gathers unit k+1 while unit k computes (forward and backward)."""
    param_gather_overlap: bool = False
    """ZeRO-1/2 parameter all-gather after the optimizer step overlaps the next forward,
    unit by unit (Megatron-Core --overlap-param-gather); False: blocking after the step."""
    zero1: str = "zero_redundancy"
    """ZeRO-1 semantics: 'zero_redundancy' (torch ZeroRedundancyOptimizer: gradients
    all-reduced, updated shards broadcast; 1.5x DDP's bytes) or 'distributed_optimizer'
    (Megatron: gradients reduce-scattered, params all-gathered; 1x DDP's bytes) or 'owner_broadcast' (InternEvo's
    hybrid ZeRO: all-reduced as torch's, each updated tensor broadcast by its owner, one chain per owner:
    xpar.estimate.frameworks.owner_broadcast)."""
    grad_reduce_bytes: int = 4
    """Bytes per gradient element in the dp reduction (4: fp32 reduce, 2: bf16/fp16)."""
    dp_collective: str = "nccl"
    """Algorithm of dp collectives: 'nccl' (ring, or tree for all-reduce where faster),
    'ring' (flat ring), 'hierarchical' (intra-node, then inter-node, then intra-node)."""
    bucket_mb: float = 25.0
    """Gradient bucket size for DDP/ZeRO-1 reductions, MB (1e6 bytes): messages issued (under
    ``bucket_rule`` 'fixed')."""
    head_unit_last: bool = False
    """The output head (final norm and output projection) of an untied model on a one-stage pipeline is a dp unit of
    its own after the last block: gathered last in forward, reduced first in backward, kept from forward to backward
    (torchtitan's ``fully_shard([model.norm, model.output], reshard_after_forward=False)``; Megatron-Core's buckets in
    backward order, the output layer's first). False: one root unit with the embedding, first in forward and last in
    backward (xpar's ``fully_shard(model)`` root). xpar.estimate.comm.head_unit."""
    bucket_rule: str = "fixed"
    """How the DDP/ZeRO-1 bucket is sized: 'fixed' (``bucket_mb``) or 'megatron_core' (Megatron-Core's
    default when ``--ddp-bucket-size`` is unset: max(40M, 1M x dp) elements, the distributed optimizer's
    parameter all-gathers bucketed as its reduce-scatters: xpar.estimate.comm.dp.bucket_bytes)."""
    tp_overlap: float = 0.0
    """Share of tensor-parallel communication hidden behind the layer's GEMMs (0: blocking;
    async TP / Megatron-Core tp-comm-overlap hide most of it)."""
    tp_async_backward: bool = False
    """The input-gradient collective of each column-parallel linear runs behind its weight-gradient GEMM
    (Megatron-LM's async tensor-parallel all-reduce / reduce-scatter, 2022 on; xpar.estimate.cost.tp_times)."""
    pp_overlap: float = 0.0
    """Share of pipeline send/recv time hidden behind compute (0: blocking)."""
    ep_a2a_overlap: float = 0.0
    """Share of expert-parallel all-to-all time hidden behind compute (0: Megatron-Core's default;
    1: DeepSeek-V3's DualPipe)."""
    ep_dispatcher: str = "alltoall"
    """MoE token dispatcher: alltoall (each routed copy sent, received copies sorted by local expert;
    Megatron-Core's default, torchtitan's), deepep (DeepSeek's DeepEP) or hybridep (Megatron-Core's
    NVLink-domain aware one): a token crosses to each other node once, then NVLink. Each synchronises the
    host once per dropless MoE layer forward; ragged (a compiled step, JAX/XLA's ragged all-to-all) does
    not (xpar.estimate.moe_dispatch)."""
    moe_scatter: str = "fused"
    """How a MoE layer's routed copies are summed back into their tokens: 'fused' (a gather-and-sum kernel,
    Transformer Engine's moe_unpermute) or 'atomic' (aten atomic scatters: torchtitan's scatter_add_ combine and
    the index_add_ gradient of its token gather), xpar.estimate.moe_dispatch.SCATTERS."""
    expert_gemm_kernel: str = "dense"
    """The routed experts' GEMM kernel: 'dense' (at the device's dense GEMM rate) or 'torch_grouped_mm'
    (torch._grouped_mm, torchtitan's GroupedExperts), xpar.estimate.compute.kernels.EXPERT_GEMM_KERNELS."""
    expert_bias_add: str = "fused"
    """How the routed experts' biases (model.bias on a MoE model) are added: 'fused' (in the GEMM's epilogue or the
    activation kernel: no traffic of their own) or 'split' (NeMo AutoModel's GroupedExpertsDeepEP._apply_bias: eager,
    per local expert, the down projection's bias scaled by the fp32 routing probabilities),
    xpar.estimate.compute.kernel_block.split_bias_bytes."""
    overlap_slowdown: float = 0.15
    """Fraction by which compute slows while a collective runs beside it, the slowed time
    counted as exposed communication: NCCL runs one thread block per channel, 16 channels
    (2 per NIC, 8 NICs) of an A100's 108 SMs = 0.15 (derived, not measured)."""
    zero3_host_ops_per_rank: float = 0.0
    """Eager host ops per dp rank and parameter tensor in each ZeRO-3 all-gather: 0 for flat
    collectives (FSDP2, DeepSpeed >= 0.5); DeepSpeed 2021 gathered each parameter through torch's
    list API: its narrow per rank, torch's select and copy per rank, 3. Read where ZeRO-3 runs tensor by
    tensor (zero3_reuse_distance set: xpar.estimate.frameworks.deepspeed_zero3)."""
    zero3_reduce_host_ops_per_rank: float = 0.0
    """The same per gradient tensor reduce-scattered: DeepSpeed 2021's view and narrow per rank,
    torch's select and copy per rank, 4 (0: flat reduce-scatters)."""
    zero3_persist_numel: int = 0
    """ZeRO-3 keeps tensors below this many elements whole on every rank, never gathered
    (DeepSpeed's stage3_param_persistence_threshold, 1e5 by default; 0: none, FSDP's units)."""
    zero3_reuse_distance: Optional[float] = None
    """DeepSpeed's stage3_max_reuse_distance (elements, 1e9 by default): under full recompute the
    submodules used again beyond it are gathered a second time in the backward
    (xpar.estimate.frameworks.deepspeed_zero3); null: the block is one unit gathered once (FSDP)."""
    zero3_persist_host_ops_per_rank: float = 0.0
    """Host ops per dp rank and persistent tensor when ZeRO-3 gathers its persistent tensors back
    after each step (DeepSpeed 2021's unpack loop of _allgather_params: narrow, view, narrow, copy: 4;
    xpar.estimate.frameworks.deepspeed_zero3.persist_time); 0: none."""
    grad_reduce_scatter: bool = True
    """ZeRO-2/3 reduce-scatter the gradients (FSDP; DeepSpeed's reduce_scatter true); false: each
    bucket is all-reduced and each rank keeps its part (DeepSpeed's default, reduce_scatter false)."""
    fused_qkv: bool = False
    """The framework's attention projects query, key and value in one linear (Megatron's
    query_key_value): one tensor per kind where xpar's model has three (counts of ZeRO-3 tensors)."""
    host_op_us: float = 4.0
    """Host microseconds per eager op (PyTorch dispatch + CUDA kernel launch)."""
    checkpoint_early_stop: bool = False
    """Full recompute stops at the last tensor the backward needs, so the MLP's down projection (w2)
    and its tp collective are not rerun: torch's non-reentrant checkpoint (set_checkpoint_early_stop,
    torch >= 2.1: xpar's engine, measured in tests/config/test_remat.py; torchtitan's and FSDP's
    checkpoint_wrapper NO_REENTRANT), JAX's remat (MaxText). False: the whole forward is rerun
    (Megatron's and DeepSpeed's checkpoint functions, torch's reentrant checkpoint)."""
    layer_overhead_ms: float = 0.0
    """Milliseconds per transformer layer and micro-batch (forward, recomputed forward and backward
    together) that the framework's runs take beyond their kernels and communication, counted in the
    host_overhead term: 0 where no public run shows one; Megatron-DeepSpeed's is fitted on BLOOM's
    runs and checked on MT-NLG's (conf/framework/deepspeed_bloom.yaml, benchmarks/estimate_calibration.py)."""
    loss_kernel: str = "fp32"
    """The cross entropy's memory: 'fp32' (logits.float(): fp32 log-probs kept, two fp32 gradients
    in backward; xpar, torchtitan) or 'fused' (an in-place fused kernel; llm-foundry)."""
    fused_swiglu: bool = False
    """SwiGLU as one kernel keeping its input (Megatron-Core): 3 e f per token kept, not eager torch's 4 e f."""
    fp32_grad_partition: bool = False
    """DeepSpeed's ZeRO-1/2 step casts the rank's 16-bit gradient partition to an fp32 copy (+4 bytes per
    element of the optimizer partition, in the memory's comm_buffers: xpar.estimate.frameworks.zero12_step)."""
    fp8_saves_inputs: bool = False
    """Under train.dtype=fp8 linear layers keep their inputs in FP8 (1 byte) for the weight gradient
    (Transformer Engine: Megatron-Core, NeMo); False: at the compute width."""
    gqa_kv_expanded: bool = True
    """Attention keeps GQA's K and V expanded to every query head (h wide) for backward: models
    that repeat K/V before SDPA (xpar, torchtitan's repeat_kv). False: the kernel
    takes them at kv_heads x head_dim (Transformer Engine / flash-attn GQA: Megatron, NeMo,
    DeepSpeed, llm-foundry)."""
    moe_routed_copies_kept: int = 0
    """Copies of each routed token's hidden vector a MoE block keeps for backward beyond the experts' inner activations
    (xpar.estimate.memory.activations.routed_copy_bytes): Megatron-Core 1 (its grouped fc1 GEMM's input, which
    Transformer Engine's GroupedLinear keeps for the weight gradient); 0: not counted (profiles whose MoE code is not
    read for it)."""
    moe_recompute_graph_kept: bool = False
    """Under full recompute each MoE layer keeps, from its backward to its next forward, the graph its recompute built
    for the attention sublayer and the router, with that graph's saved tensors: one micro-batch's no-recompute bytes of
    both per MoE layer (xpar.estimate.memory.activations.moe_kept_graph_bytes). True for a MoE dispatcher that keeps the
    routing probabilities on the module between calls: the Primus-Turbo DeepEP manager of torchtitan's deepep branch
    @022f885f (torchtitan/distributed/deepep/utils.py PrimusTurboDeepepManager.setup_metadata stores
    ``self.token_probs`` and ``self.token_indices``, which nothing clears: ``combine`` clears the dispatch fields only;
    the recompute of torch's non-reentrant checkpoint, early stop or not (torchtitan's ActivationCheckpoint.early_stop
    is False), hands each recomputed node ``x.detach()`` to keep, torch/utils/checkpoint.py _recomputation_hook). False: a
    dispatcher that hands its state to combine (upstream torchtitan's EPDispatchMetadata,
    torchtitan/models/common/token_dispatcher.py 2026; Megatron-Core, DeepSpeed)."""
    moe_graph_break: bool = False
    """Its MoE layer breaks torch.compile's graph where ep > 1, so under activation checkpointing (full or selective)
    a compiled MoE block runs eagerly, forward and recompute: torch.utils.checkpoint.checkpoint is wrapped in
    ``torch._disable_dynamo`` (recursive), and where Dynamo cannot trace the checkpointed function whole it falls
    back to eager for the whole region and does not trace the frames inside it (torch/utils/checkpoint.py, "Note:
    [torch.compile and checkpoint]", torch 2.1 to 2.13). True for torchtitan (@022f885f): MoE blocks are compiled
    with ``fullgraph=False`` (torchtitan/models/llama4/infra/parallelize.py ``apply_compile``: "TODO: remove when
    torch.compile supports fullgraph=True for MoE") inside ``ptd_checkpoint_wrapper``
    (torchtitan/distributed/activation_checkpoint.py), and both EP paths break: DeepEP's ``FusedDispatch`` and
    ``FusedCombine`` are autograd Functions calling DeepEP's C++ ``Buffer`` with no torch.library registration
    (torchtitan/distributed/deepep/fused_a2a.py), the all-to-all path takes its split sizes to the host with
    ``.tolist()`` (torchtitan/distributed/expert_parallel.py ``ExpertParallel._token_dispatch``). Its element-wise
    traffic is then ``elementwise_passes`` times the fused one (xpar.estimate.compute.kernel_costs.eager_share).
    benchmarks/ttcompile_graph_breaks.py shows it on a CPU stand-in."""
    replicated_embedding_grad: bool = True
    """Under tp, a deferred token-embedding gradient is held whole (V x h) on every tp rank
    (torch DTensor: xpar, torchtitan; xpar.estimate.memory.per_device); False: it stays
    vocabulary-sharded (Megatron's VocabParallelEmbedding)."""
    fsdp_copies: str = "fsdp2"
    """ZeRO-2/3 copies on the compute stream (xpar.estimate.comm.dp.copy_times). 'fsdp2' (torch 2.13
    _fsdp_collectives.py): all-gather output copied into the parameters (``split_with_sizes_copy``),
    gradients into the reduce-scatter input in the reduce dtype (``foreach_reduce_scatter_copy_in``);
    'fsdp1' (FlatParameter views): only the flat gradient's cast where the reduce dtype differs;
    'none': DeepSpeed (ZeRO-3 gathers into a buffer its parameters view)."""
    adamw_bytes_per_element: Optional[float] = 84.0
    """Memory traffic of the optimizer step per element it updates, bytes. 84: torch's AdamW with
    foreach=False (xpar.parallel.data_parallel.build_optimizer) runs 8 element-wise kernels over
    fp32 tensors per parameter (weight decay mul_ 8, exp_avg lerp_ 12, exp_avg_sq mul_ 8 and
    addcmul_ 16, sqrt 8, div 8, add_ 8, param addcdiv_ 16: torch/optim/adamw.py); null: a fused
    AdamW, one read and one write of the states (2 passes at the ZeRO paper's widths)."""
    grad_accumulation_passes: float = 3.0
    """Passes over the held gradient bytes per micro-batch after the first (autograd's
    AccumulateGrad: 2 reads, 1 write); counted with ``gradient_passes``."""
    gradient_passes: bool = False
    """Count the passes over the gradients outside the GEMMs (accumulation, torch's pipeline
    scaling, the norm clip: xpar.estimate.cost.gradient_time). Set on a CPU whatever the profile;
    off on GPUs, where they are <= 1.5 % of the public runs' steps."""
    # --- memory (xpar.estimate.memory.per_device.MemoryOptions; documented on xpar.estimate.cost.Assumptions) ---
    count_buffers: bool = True
    """Count DDP buckets, FSDP gather/reduce buffers, p2p buffers, recompute workspace."""
    selective_recompute: str = "op"
    """What recompute=selective keeps: 'op' (xpar), 'torchtitan_op', 'attention' (Megatron)."""
    recompute_layer_fraction: float = 1.0
    """Fraction of blocks the recompute policy applies to where parallel.recompute_layers is null
    (torchtitan's selective_ac_option=2: 0.5)."""
    recompute: Optional[list] = None
    """Recompute policies the framework runs (xpar plan searches these; xpar.config.remat.RECOMPUTE);
    null: xpar.config.remat.PLAN_RECOMPUTE."""
    param_storage: str = "fp32"
    """'fp32': parameters are the master weights (xpar, torchtitan); 'bf16': fp32 master in the optimizer."""
    grad_bytes: int = 4
    """Bytes per held gradient element: 2 (bf16), 4 (fp32 main grads), 6 (bf16 + fp32 buffer: DeepSpeed BF16_Optimizer)."""
    optimizer_bytes: int = 0
    """Bytes per optimizer-state element, master copy included (0: 8 with fp32 storage, 12 with bf16);
    apex DistributedFusedAdam in NeMo: 10 (store_param_remainders) or 4 (optimizer dtype bf16)."""
    fsdp_reshard_under_pp: bool = True
    """ZeRO-3 under pp reshards parameters after each forward."""
    zero3_gather: str = "unit"
    """ZeRO-3's gather size: unit (a block, FSDP2) or tensor (one parameter tensor, DeepSpeed v0.3)."""
    ddp_bucket_copy: bool = True
    """DDP copies gradients into communication buckets (torch default)."""
    cpu_offload_optimizer: bool = False
    """Optimizer states (fp32 master, AdamW moments) in host memory, the step on the host CPU
    (DeepSpeed offload_optimizer; timed by xpar.estimate.memory.offload). Estimate only: xpar does not
    execute it (execute mode refuses it)."""
    activation_offload: bool = False
    """Whether the framework copies whole blocks' saved activations to host memory and back
    (parallel.activation_offload_layers; xpar.estimate.memory.activation_offload): Megatron-Core's
    --cpu-offloading (megatron/core/transformer/transformer_config.py, Transformer Engine's cpu_offload).
    False: torchtitan (its CPU offload is FSDP2's CPUOffloadPolicy of parameters, gradients and optimizer
    states), MaxText (its remat policies offload chosen tensors, not blocks), DeepSpeed (activation
    checkpoints to CPU only with checkpointing). xpar executes it with torch's save_on_cpu
    (xpar.parallel.offload)."""
    activation_offload_overlap: bool = True
    """How the offload's copies run (xpar.estimate.memory.activation_offload): true, Transformer Engine's
    (transformer_engine/pytorch/cpu_offload.py, ``AsyncDoubleBufferGroupOffloadHandler``): on a side stream behind
    the blocks' compute, one group in flight on the device; false, torch's ``save_on_cpu``
    (torch/autograd/graph.py, xpar): each saved tensor copied on the compute stream when saved and back when its
    backward reads it, every copy exposed, none in flight."""
    offload: list = field(default_factory=lambda: [False, True])
    """Optimizer offload choices the framework runs (xpar plan searches these): [false] or
    [false, true]."""
    zero_stages: list = field(default_factory=lambda: [0, 1, 2, 3])
    """ZeRO stages the framework runs (xpar plan searches these): xpar all four."""
    pp_zero_stages: list = field(default_factory=lambda: [0, 1, 2, 3])
    """ZeRO stages it runs together with pipeline parallelism (pp > 1)."""
    schedules: list = field(default_factory=lambda: ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs",
                                                     "zero_bubble", "zbv", "dualpipev"])
    """Pipeline schedules it runs (xpar.config.layout.SCHEDULES names; xpar plan searches these)."""
    make_vocab_size_divisible_by: Optional[int] = None
    """The vocabulary is padded to a multiple of this x tp (Megatron-LM's and NeMo's
    --make-vocab-size-divisible-by, 128 by default: xpar.config.vocab); null: not padded (torch
    trainers), tp must divide model.vocab_size."""
    microbatch_rule: str = "torch"
    """Whose micro-batch rules its pipeline schedules follow in estimates (xpar.config.layout.MICROBATCH_RULES):
    'torch' (torch.distributed.pipelining: Schedule1F1B needs m >= pp) or 'megatron' (its 1F1B runs
    any m >= 1 with min(pp - rank - 1, m) warm-up forwards: Megatron-LM/Core, DeepSpeed's PipelineEngine).
    Execute mode runs torch's classes and keeps torch's rule."""
    interleaved_min_pp: int = 2
    """Smallest pp it runs an interleaved 1F1B schedule with (Megatron-LM: more than 2)."""
    elementwise_passes: float = 1.0
    """HBM traffic of a block's element-wise and normalisation kernels against fused ones (1: Megatron,
    Transformer Engine, apex and XLA fuse each norm, activation and RoPE into one pass), where the
    kernel model prices compute (xpar.estimate.compute.kernel_costs): eager PyTorch runs each op as its own
    kernel, RMSNorm with an fp32 upcast in 6 (torchtitan, xpar: 3, counted in
    docs/concepts/kernels.md)."""
    interleaved_m_per_pp: bool = False
    """Whether its interleaved 1F1B is Megatron-LM's: m divisible by pp, and at m == pp every
    forward before any backward (its warm-up, xpar.estimate.memory.activations.memory_schedule); torch's
    Interleaved1F1B has its own rule and warm-up (xpar.config.layout.SCHEDULES)."""
    sequence_parallel: list = field(default_factory=lambda: [False, True])
    """Sequence parallelism choices it runs (Korthikanti et al. 2022; DeepSpeed 2021 had none)."""
    terms: list = field(default_factory=list)
    """Estimate terms this profile changes relative to framework=xpar (time_breakdown keys
    and memory terms); tests/config/test_framework.py checks that nothing else changes."""
    fp8_param_gather: bool = False
    """Under train.dtype=fp8 the blocks' compute weights are FP8 and the ZeRO/FSDP parameter all-gather
    moves 1 byte per element, not 2 (Megatron-Core --fp8-param-gather; torchtitan's
    enable_fsdp_float8_all_gather: xpar.estimate.frameworks.fp8_params)."""
    fsdp_head_units: bool = False
    """Under ZeRO-3 the token embedding and the output head (final norm and output projection) of an untied model
    are FSDP units of their own, not one root unit: the largest root unit a rank gathers (and reduces) is the larger
    of the two, not their sum (torchtitan/models/llama3/infra/parallelize.py apply_fsdp: ``fully_shard`` on
    ``tok_embeddings`` and on ``[norm, output]``; xpar.estimate.memory.buffers). False: one root unit holds both
    (xpar's ``fully_shard(model)`` root; Megatron-FSDP, whose units are the TransformerLayers and whose root owns the
    remaining parameters)."""
    fp8_cast_kernels: str = "fused"
    """Who quantises under train.dtype=fp8: 'te' (Transformer Engine's quantize kernels: current scaling, MXFP8 and
    blockwise at their measured share of HBM, xpar.estimate.compute.fp8_recipes.CAST_HBM_FRACTION, from TE's GEMM
    profiling tutorial) or 'fused' (the block's other memory-bound passes' share: torchao's casts, compiled or eager,
    for which no public bandwidth figure was found; delayed scaling under TE too, which reaches it)."""
    fp8_weight_copies: bool = False
    """Under train.dtype=fp8 each block's linear weight keeps an FP8 copy and its transpose beside the
    bf16 weight (+2 bytes per element at ZeRO stage < 3; Transformer Engine: Megatron-Core, NeMo;
    xpar.estimate.frameworks.fp8_weights). False: FP8 casts are transient (torchao float8: xpar, torchtitan)."""
    dp_overlap_per_chunk: bool = False
    """With v > 1 model chunks per pipeline rank (interleaved 1F1B), each chunk's gradient buckets are
    reduced when its last backward ends, behind the other chunks' remaining backwards, and its parameters
    gathered behind the earlier chunks' first forwards (Megatron-Core's overlap_grad_reduce and
    overlap_param_gather: xpar.estimate.frameworks.dp_chunks). False: the step's reductions overlap one micro-batch's
    backward, its gathers one forward."""
    zero_owner_reduce: bool = False
    """ZeRO-1/2 reduce each gradient bucket to the owners of the partitions it spans, one reduce per owner
    (DeepSpeed's stage_1_and_2.py average_tensor: xpar.estimate.frameworks.owner_reduce); False: one reduce-scatter
    (Megatron's distributed optimizer, FSDP)."""
    recompute_replays_comm: bool = True
    """A recomputed block's backward reruns its forward's MoE all-to-alls and cp K/V all-gathers
    (torch's checkpoint replays every op whose output it does not keep; Megatron's checkpoint of a
    layer or MoE layer too): priced by xpar.estimate.expert_parallel.ep_replay and
    xpar.estimate.context_parallel.cp_replay, per policy. false: the framework keeps their outputs."""
    tp_overlap_across_nodes: float = 0.0
    """Share of tensor-parallel communication hidden behind the GEMMs when the tp group spans nodes (its
    collectives over the NICs): ``tp_overlap`` applies inside a node only -- Transformer Engine's userbuffer
    overlap exchanges through NVLink peer memory (transformer_engine/pytorch/module/base.py initialize_ub),
    torch's async TP through symmetric memory inside a node. 0 unless a source shows a framework hiding more."""
    pp_overlap_schedules: Optional[list] = None
    """The schedules (xpar.config.layout.SCHEDULES names) whose pipeline sends ``pp_overlap`` hides; null: every
    schedule. Megatron-Core overlaps p2p only when interleaving (megatron/core/pipeline_parallel/schedules.py:
    "Non-interleaved pipeline parallelism does not support overlapping p2p communication"); DeepSeek's DualPipe too."""
    ep_a2a_overlap_schedules: Optional[list] = None
    """The schedules (xpar.config.layout.SCHEDULES names, pp > 1) under which ``ep_a2a_overlap`` hides the MoE
    all-to-alls; null: every layout. DeepSeek's DualPipe hides them by pairing one micro-batch's forward with
    another's backward (DeepSeek-AI 2024 Sec. 3.2.1): under 1F1B or without a pipeline nothing is paired."""
    ep_shared_expert_overlap: bool = False
    """The shared experts' GEMMs run on a second CUDA stream beside the routed experts' dispatch, GEMMs and combine,
    so each MoE layer's all-to-alls hide behind them (up to the shared experts' seconds, forward and backward: autograd
    runs an op's backward on its forward's stream, torch docs "CUDA semantics", "Stream semantics of backward
    passes"). NeMo AutoModel: nemo_automodel/components/moe/layers.py ``MoE.forward`` @037e04a6 ("Execute shared
    experts in a separate stream to overlap compute with the communication for grouped experts"); its DeepEP
    dispatch and combine themselves run synchronously (token_dispatcher.py ``token_permutation2`` /
    ``token_unpermutation``: async_finish=False), so nothing else hides them. Megatron-Core's opt-in
    ``--moe-shared-expert-overlap`` does the same. xpar.estimate.columns.ep_slots.ep_slot_columns."""
    etp_degrees: Optional[list] = None
    """The expert tensor-parallel degrees (parallel.etp; 0: etp = tp) ``xpar plan`` searches for a MoE model where
    plan.etp is null; null: [0]. Megatron-Core: etp = tp by default and etp 1 (MoE parallel folding), which its
    MoE recipes set (Megatron-Bridge ``expert_tensor_parallel_size: 1``)."""
    max_pp: Optional[int] = None
    """Largest pipeline-parallel degree the framework runs (validation and ``xpar plan``); null: any. llm-foundry: 1
    (Composer trains with FSDP only; no pipeline parallelism)."""
    max_tp: Optional[int] = None
    """Largest tensor-parallel degree the framework runs as xpar's tp (attention and MLP sharded, Megatron-LM style);
    null: any. llm-foundry: 1 (its one tp strategy, llmfoundry/tp/ffn_tp_strategy.py, shards the MLP only)."""
    max_cp: Optional[int] = None
    """Largest context-parallel degree the framework runs (validation and ``xpar plan``); null: any. Megatron-LM before
    its --context-parallel-size (2023-10, conf/framework/megatron_2021.yaml): 1."""
    max_ep: Optional[int] = None
    """Largest expert-parallel degree the framework runs (validation and ``xpar plan``); null: any. Megatron-LM before
    its --expert-model-parallel-size (2023-10, conf/framework/megatron_2021.yaml): 1."""
    moe_max_tp: Optional[int] = None
    """Largest tensor-parallel degree the framework runs for a model with routed experts (model.n_experts; validation
    and ``xpar plan``, beside ``max_tp``); null: as a dense model. NeMo AutoModel's MoE models (conf/framework/
    fsdp2_bf16.yaml): 1, nemo_automodel/components/moe/parallelizer.py ``parallelize_model`` asserts the tp mesh has
    size 1 ("Tensor parallelism not supported for DeepSeek v3 model", @89e3a9fd, 2025-10; "for custom MoE models"
    since)."""
    tp_ep_needs_sp: bool = False
    """Whether tp > 1 with ep > 1 runs only with sequence parallelism (validation and ``xpar plan``). Megatron-Core:
    megatron/core/transformer/transformer_config.py ``TransformerConfig.__post_init__`` raises "When using expert
    parallelism and tensor parallelism, sequence parallelism must be used"."""
    ddp_alone: bool = False
    """Whether its ZeRO-0 (DDP) runs at dp > 1 only with no other parallelism (tp = pp = cp = ep = 1; validation and
    ``xpar plan``). torchtitan 2024-25: torchtitan/models/llama3/parallelize_llama.py ``parallelize_llama`` raises
    "DDP has not supported > 1D parallelism" where the device mesh has more than the dp_replicate dimension."""
    even_layer_split: bool = False
    """Whether the framework needs the layers split evenly over the pp x v pipeline stages (n_layers divisible by
    pp x v: Megatron-LM 2021-22, megatron/model/transformer.py); false: ``xpar plan`` also splits them with lighter
    first and last stages (xpar.estimate.columns.stage_split)."""
    grad_reduce_cast_bytes: int = 0
    """Bytes per held gradient element of the copy its dp reduce casts the gradient buffer to (DeepSpeed's
    engine.allreduce_bucket: ``tensor.to(communication_data_type)``, bf16 with bf16 on, ZeRO 0 and no
    communication_data_type set: 2, BLOOM's runs); 0: reduced in place (xpar.estimate.frameworks.bf16_optimizer)."""
    grad_accum_cast_bytes: int = 0
    """Bytes per element of the largest parameter's gradient cast before its accumulation into the fp32 buffer
    after each micro-batch's backward (DeepSpeed BF16_Optimizer.update_hp_grads: ``lp.grad.to(fp32)``: 4); 0: none."""
    expert_gemm_call_us: float = 0.0
    """Host microseconds per local expert and GEMM call where the grouped expert GEMM is a loop of one cuBLAS
    GEMM per expert (Transformer Engine's GroupedLinear on multiple streams: fc1 and fc2 forward, their dgrad
    and wgrad backward, each expert's own call, allocations and split): issued after the MoE layer's host
    synchronisation, it idles the GPU where the experts' GEMMs are shorter (xpar.estimate.compute.kernel_block);
    0 where one kernel runs every expert (torch._grouped_mm, DeepGEMM, CUTLASS grouped GEMM, XLA)."""
    plan_schedules: Optional[list] = None
    """The pipeline schedules ``xpar plan`` searches when plan.schedules is null, a subset of ``schedules``; null: all
    of ``schedules``. The others stay valid for run.mode=estimate and for plan.schedules that names them (hai_llm:
    DeepSeek-V3's DualPipe and the 1F1B family; DeepSeek-V2's zero-bubble schedules on request)."""
    grad_buckets: int = 0
    """Gradient reduction buckets of ``bucket_mb`` the framework allocates beside the gradients where
    ``ddp_bucket_copy``: DeepSpeed ZeRO-0/1/2 reduces through its ipg buffer of reduce_bucket_size elements
    (deepspeed/runtime/zero/stage_1_and_2.py: 1, 2 with overlap_comm); 0: a copy of the whole gradient
    (torch DDP's flat buckets, gradient_as_bucket_view False) (xpar.estimate.memory.buffers)."""
    cp_comm: str = "all_gather"
    """How context parallelism exchanges K and V (xpar.estimate.cp_exchange): 'all_gather' (gathered before the
    attention core, gradients reduce-scattered after, exposed: xpar's engine, xpar/parallel/context.py; the Llama 3
    paper; torch's context_parallel with its default allgather rotate method), 'p2p' (Transformer Engine's ring,
    each K/V chunk sent while the previous one's attention runs: Megatron-Core's --cp-comm-type default, NeMo) or
    'a2a' (DeepSpeed-Ulysses all-to-alls of Q, K, V and the output: Transformer Engine's cp_comm_type='a2a')."""
    kv_heads_over_tp: str = "split"
    """K/V heads where tp exceeds model.n_kv_heads (xpar.config.attention.tp_kv_heads): 'split' (each tp rank holds
    n_kv_heads / tp of them, so tp must divide n_kv_heads: Megatron-Core's num_query_groups / tp, torch DTensor's
    ColwiseParallel) or 'replicate' (tp a multiple of n_kv_heads: each rank keeps the K/V head its query heads need
    whole: the K/V projection's parameters, gradients, optimizer states and saved K/V on every rank of the group;
    its GEMM on every rank's tokens, or on the sequence shard with sequence parallelism, its output gathered and its
    weight gradients all-reduced over tp: BigCode's Megatron-LM MQA, megatron/model/transformer.py key_value and
    optimizer.py allreduce_key_value_grads). Estimated only: xpar's engine splits K/V heads (DTensor)."""
